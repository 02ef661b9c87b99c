"""Runners of the fedfuse Flower app: every one validates the whole run config locally first.

- ``flwr_runner``: ``flwr run`` on the local simulation engine with a private ``FLWR_HOME``, free ports,
  the SuperLink stopped by PID and the run status read with ``flwr list``.
- ``inprocess``: the same ServerApp/ClientApp bodies on an in-process Flower Grid (no Ray; same numbers).
- ``run``: the default run: the strategy, then FedAvg on the same split and seed, side by side
  (``fedfuse run``; ``scripts/run.sh``); ``compare``: the baseline's config and the side-by-side table;
  ``console``: the quiet console (one line per round, fedfuse's warnings; everything in ``run.log``).
- ``sweep``: strategies × partitionings × seeds, mean ± std tables and plots (``fedfuse compare``);
  ``progress``: tqdm bars (ETA) for long loops, on a terminal only.
- ``deployment``: a real SuperLink + SuperNodes deployment on loopback.
- ``cli``: the ``--run-config`` tokenizer and the preflight every runner calls before starting Flower.
"""
