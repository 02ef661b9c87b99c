"""Runners of the fedfuse Flower app (``fedfuse run``, ``fedfuse compare``): every one validates the whole run
config locally before any Flower process starts.

- ``flwr_runner``: ``flwr run`` on the local simulation engine with a private ``FLWR_HOME``, free ports,
  the SuperLink stopped by PID and the run status read with ``flwr list``; where every runner finds the Flower app
  (the checkout, or ``app/pyproject.toml`` shipped in this package when fedfuse is installed without its
  repository) and the default results folder.
- ``inprocess``: the same ServerApp/ClientApp bodies on an in-process Flower Grid (no Ray; same numbers).
- ``run``: the default run: the strategy, then FedAvg on the same split and seed, side by side
  (``fedfuse run``), and the command line every runner shares (the preflight before Flower starts, the engine switch); ``compare``: the baseline's config, the side-by-side table and the accuracy plot;
  ``console``: the quiet console (one line per round, fedfuse's warnings; everything in ``run.log``), tqdm bars
  (ETA) for long loops, on a terminal only, and the one format of a spread (mean ± sample std).
- ``sweep``: strategies × partitionings × seeds, mean ± std tables and plots (``fedfuse compare``).

They import Flower, so they live under ``fedfuse.flower``; nothing here imports the repository's experiments.
"""
