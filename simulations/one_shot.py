"""One-shot fusion benchmark: train clients once (cached), fuse with every method, evaluate.

    python -m simulations.one_shot --datasets digits,mnist1d --partitions shards2,shards4,dirichlet4 \\
        --models mlp --methods average,ensemble,kd,lp,hf-linear,kf-linear,hf-gradient,kf-gradient \\
        --importance uniform,conductance,deeplift --seeds 0,1,2 --fusion-size 300 --fusion-source client0 \\
        --out results/one_shot/mlp

Methods are names in ``fedfuse.fusion.METHODS``, optionally with options in brackets (TOML values):
``kf-gradient[setting=2,eps=0.5]``. Methods that use importance scores run once per ``--importance``
method (and per ``--score-source``: ``client`` = each client on its own validation split, ``server`` =
the server on its fusion set with its labels). ``average`` and ``ensemble`` always run (they are the
time and accuracy references). Clients are cached under ``--cache`` keyed by every setting that
changes them, so a later invocation with other methods reuses them. ``--merge`` adds the rows of
earlier ``results.json`` files to the tables (e.g. methods other engineers ran on the same cells).

Outputs in ``--out``: ``results.json`` (raw rows), ``table.md`` (mean ± std, gap recovery, time
ratios to ``average`` and to one client's local training), ``accuracy.png``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no OpenMP spinning on shared cores

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from simulations.oneshot_lib import (DEPTH_DEFAULTS, RECIPE_DEFAULTS, TRAIN_DEFAULTS, WIDTH_DEFAULTS, CellConfig, load_rows,
                                     parse_partition, run_cell, split_methods, write_results)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _strs(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="digits,mnist1d")
    ap.add_argument("--partitions", default="shards2,shards4,dirichlet4")
    ap.add_argument("--models", default="mlp")
    ap.add_argument("--methods", default="average,ensemble,kd,lp,hf-linear,kf-linear,hf-gradient,kf-gradient")
    ap.add_argument("--importance", default="uniform,conductance,deeplift")
    ap.add_argument("--score-source", default="client", help="client, server or client,server")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--fusion-size", type=int, default=300)
    ap.add_argument("--fusion-source", default="client0", choices=["client0", "public"])
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    ap.add_argument("--width", type=int, default=0, help="model width (0 = per-model default: mlp 128, cnn 16, vit 32)")
    ap.add_argument("--depth", type=int, default=0, help="model depth (0 = per-model default)")
    ap.add_argument("--epochs", type=int, default=0, help="client epochs (0 = per dataset/model default)")
    ap.add_argument("--lr", type=float, default=0.0, help="client Adam lr (0 = default)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--optimizer", default=RECIPE_DEFAULTS["optimizer"], help="client optimizer (adam, adamw, sgd)")
    ap.add_argument("--weight-decay", type=float, default=RECIPE_DEFAULTS["weight_decay"])
    ap.add_argument("--label-smoothing", type=float, default=RECIPE_DEFAULTS["label_smoothing"])
    ap.add_argument("--patience", type=int, default=RECIPE_DEFAULTS["patience"],
                    help="client early stopping on its validation loss (0 = off, train all --epochs)")
    ap.add_argument("--schedule", default=RECIPE_DEFAULTS["schedule"], choices=["cosine", "constant"])
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--importance-samples", type=int, default=256)
    ap.add_argument("--model-options", default="{}", help='JSON per model, e.g. {"vit": {"num_heads": 2}}')
    ap.add_argument("--method-options", default="{}", help='JSON per method, e.g. {"kd": {"epochs": 50}}')
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default="results/cache")
    ap.add_argument("--out", default="results/one_shot/default")
    ap.add_argument("--merge", default="", help="comma-separated results.json files whose rows join the table")
    ap.add_argument("--title", default="One-shot fusion")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    methods = split_methods(args.methods)
    importance = _strs(args.importance) or ["uniform"]
    sources = _strs(args.score_source)
    model_options = json.loads(args.model_options)
    method_options = json.loads(args.method_options)
    for p in _strs(args.partitions):
        parse_partition(p)  # fail fast on typos
    rows = []
    for f in _strs(args.merge):
        rows += load_rows(Path(f))
    meta = {"argv": sys.argv if argv is None else ["simulations.one_shot", *argv], "args": vars(args),
            "title": args.title, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    t_start = time.perf_counter()
    for dataset in _strs(args.datasets):
        for model in _strs(args.models):
            defaults = TRAIN_DEFAULTS.get((dataset, model), dict(epochs=30, lr=1e-3))
            for partition in _strs(args.partitions):
                for seed in _ints(args.seeds):
                    cfg = CellConfig(dataset=dataset, partition=partition, model=model, seed=seed,
                                     width=args.width or WIDTH_DEFAULTS.get(model, 64),
                                     depth=args.depth or DEPTH_DEFAULTS.get(model, 2),
                                     epochs=args.epochs or defaults["epochs"], lr=args.lr or defaults["lr"],
                                     batch_size=args.batch_size, val_fraction=args.val_fraction, alpha=args.alpha,
                                     fusion_source=args.fusion_source, importance_samples=args.importance_samples,
                                     model_options=model_options.get(model, {}), optimizer=args.optimizer,
                                     weight_decay=args.weight_decay, label_smoothing=args.label_smoothing,
                                     patience=args.patience, schedule=args.schedule)
                    print(f"== {dataset}/{partition}/{model} seed {seed}", flush=True)
                    rows += run_cell(cfg, methods, importance, sources, args.fusion_size, Path(args.cache),
                                     device=args.device, method_options=method_options,
                                     log=lambda s: print(s, flush=True))
                    meta["elapsed_seconds"] = time.perf_counter() - t_start
                    write_results(rows, out, meta)  # after every cell: partial results survive
    print(f"wrote {out}/table.md ({time.perf_counter() - t_start:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
