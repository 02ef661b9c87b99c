"""Runners of the fedfuse Flower app: every one validates the whole run config locally first.

- ``flwr_runner``: ``flwr run`` on the local simulation engine with a private ``FLWR_HOME``, free ports,
  the SuperLink stopped by PID and the run status read with ``flwr list``.
- ``run``: one run and its summary table (``python -m simulations.runners.run``; ``scripts/run.sh``).
- ``sweep``: strategies × partitionings × seeds, mean ± std tables and plots.
- ``deployment``: a real SuperLink + SuperNodes deployment on loopback.
- ``cli``: the ``--run-config`` tokenizer and the preflight every runner calls before starting Flower.
"""
