"""Benchmark harness and benchmarks (``python -m simulations.bench.<name>``).

Harness (one concern per module):

- ``specs``   — the command-line spec syntaxes: partitions (``shards2``, ``dirichlet4``, ``iid4``, ``full2``),
  method specs with TOML options (``kf-gradient[setting=2,eps=0.5]``), comma lists.
- ``clients`` — the client training recipe, ``train_client`` (the one trainer every benchmark uses) and
  the on-disk cache of trained clients with their importance scores, keyed by every setting.
- ``stats``   — mean ± sample standard deviation (ddof = 1) and the note every table states.
- ``tables``  — markdown tables, JSON rows.  ``plots`` — accuracy bar plots.
- ``timing``  — interleaved repeated timings (median), peak-memory measures, timed fusion.
- ``cells``   — one one-shot cell: clients, references and every requested fusion method, evaluated.
- ``report``  — the one-shot tables (accuracy, gap recovery, validation, validation-selected options,
  comparison to a reference method, time ratios) and ``write_results``.

Benchmarks: ``one_shot``, ``ot`` (width-heterogeneous fusion, task-vector transport), ``fs_merge``
(low-data sweep with time/memory vs KD), ``fusion_time`` (fusion time against ``average``, a forward
pass and a client's training, measured in the same run), ``tofu`` (Token Fusion), ``load`` (a ``flwr run``
with many clients), and the others ``python -m simulations.bench --help`` lists. One-off studies are archived
(docs/benchmarks.md, "Archived one-off studies").
"""

import os

# before torch is imported by any benchmark: no OpenMP busy-waiting on shared cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
