"""One-shot fusion benchmark: train clients once (cached), fuse with every method, evaluate.

    python -m simulations.bench.one_shot --datasets digits,mnist1d --partitions shards2,shards4,dirichlet4 \\
        --models mlp --methods average,ensemble,kd,lp,hf-linear,kf-linear,hf-gradient,kf-gradient \\
        --importance uniform,conductance,deeplift --seeds 0,1,2 --fusion-size 300 --fusion-source client0 \\
        --out results/one_shot/mlp

Methods are names in ``fedfuse.fusion.METHODS``, optionally with options in brackets (TOML values):
``kf-gradient[setting=2,eps=0.5]``; several variants of one method form a grid whose validation-selected
variant is reported. Every method also takes the fuse-level options ``refine`` (``"distill"``,
``"calibrate"``, ``"calibrate+distill"``, ``"distill+calibrate"``: a post-fusion step) and ``prior``
(``"uniform"`` or ``"class-counts"``, for ``calibrate``): ``kf-linear[refine="distill"]``. The ``auto`` row is,
per seed, the fused candidate (all methods and variants) with the highest federated validation accuracy. Methods that use importance scores run once per ``--importance`` method and per
``--score-source`` (``client`` = each client on its own validation split, ``server`` = the server on its
fusion set with its labels). ``average`` and ``ensemble`` always run (time and accuracy references).
``--compare-to kd`` adds per-seed accuracy differences and time ratios to that method. ``--merge`` adds
rows of earlier ``results.json`` files. Client settings (``--epochs``, ``--lr``, ``--optimizer``, …) are
hashed into the client cache key.

Outputs in ``--out`` (rewritten after every cell): ``results.json``, ``table.md``, ``accuracy.png``.
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from simulations.bench.cells import check_methods, run_cell
from simulations.bench.clients import add_client_arguments, cell_from_args
from simulations.bench.report import write_results
from simulations.bench.specs import parse_ints, parse_partition, split_list
from simulations.bench.tables import load_rows
from fedfuse.flower.runner.console import progress, progress_print


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench.one_shot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="digits,mnist1d")
    ap.add_argument("--partitions", default="shards2,shards4,dirichlet4", help="e.g. shards2, dirichlet4, iid4")
    ap.add_argument("--models", default="mlp")
    ap.add_argument("--methods", default="average,ensemble,kd,lp,hf-linear,kf-linear,hf-gradient,kf-gradient")
    ap.add_argument("--importance", default="uniform,conductance,deeplift")
    ap.add_argument("--score-source", default="client", help="client, server or client,server")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--fusion-size", type=int, default=300)
    ap.add_argument("--method-options", default="{}", help='JSON per method, e.g. {"kd": {"epochs": 50}}')
    ap.add_argument("--compare-to", default="", help="a method row (e.g. kd) to compare every method with per seed")
    ap.add_argument("--out", default="results/one_shot/default")
    ap.add_argument("--merge", default="", help="comma-separated results.json files whose rows join the table")
    ap.add_argument("--title", default="One-shot fusion")
    add_client_arguments(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    methods = split_list(args.methods)
    importance = split_list(args.importance) or ["uniform"]
    sources = split_list(args.score_source)
    bad = [s for s in sources if s not in ("client", "server")]
    if bad:
        raise SystemExit(f"--score-source: {bad} not in (client, server)")
    method_options = json.loads(args.method_options)
    partitions = [parse_partition(p).name for p in split_list(args.partitions)]  # fail fast on typos
    check_methods(methods, method_options)
    seeds = parse_ints(args.seeds)
    rows = []
    for f in split_list(args.merge):
        rows += load_rows(Path(f))
    meta = {"argv": sys.argv if argv is None else ["simulations.bench.one_shot", *argv], "args": vars(args),
            "title": args.title, "reference": args.compare_to, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t_start = time.perf_counter()
    cells = [(d, m, p, s) for d in split_list(args.datasets) for m in split_list(args.models) for p in partitions
             for s in seeds]
    for dataset, model, partition, seed in progress(cells, desc="one-shot cells", unit="cell"):  # bar + ETA on a tty
        cfg = cell_from_args(args, dataset, partition, model, seed)
        progress_print(f"== {dataset}/{partition}/{model} seed {seed}")
        rows += run_cell(cfg, methods, importance, sources, args.fusion_size, Path(args.cache),
                         device=args.device, method_options=method_options, log=progress_print)
        meta["elapsed_seconds"] = time.perf_counter() - t_start
        write_results(rows, out, meta)  # after every cell: partial results survive
    print(f"wrote {out}/table.md ({time.perf_counter() - t_start:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
