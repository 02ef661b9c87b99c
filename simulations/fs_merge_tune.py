"""FS-Merge option selection on a held-out split of the fusion set (never on test).

    python -m simulations.fs_merge_tune --cells digits/dirichlet4/0 --size 300 \
        --configs '{"default": {}, "avg": {"init": "average"}}' --method fs-merge --out results/fs_merge/tune/x.jsonl

Clients come from the shared one-shot runner's cache (same recipe as results/one_shot). The fusion set
(``--size`` samples from client 0, as in the runner) is split ``--val-frac`` held out / rest used to fuse.
Selection metric: accuracy of the fused model on the held-out fusion samples (their labels are the server's,
as for ``--score-source server`` in the runner) and agreement with the ensemble's argmax there (label-free).
Test accuracy is recorded for the report only.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import time
from pathlib import Path

import torch

from fedfuse.fusion import fuse
from simulations.oneshot_lib import (DEPTH_DEFAULTS, TRAIN_DEFAULTS, WIDTH_DEFAULTS, CellConfig, get_clients,
                                     load_data)


def cell_models(dataset, partition, model, seed, size, cache="results/cache"):
    d = TRAIN_DEFAULTS[(dataset, model)]
    cfg = CellConfig(dataset=dataset, partition=partition, model=model, seed=seed, width=WIDTH_DEFAULTS[model],
                     depth=DEPTH_DEFAULTS[model], epochs=d["epochs"], lr=d["lr"])
    data = load_data(cfg, size)
    clients = get_clients(cfg, data, ["uniform"], Path(cache), log=lambda s: print(s, flush=True))
    return [c["model"] for c in clients], data


def acc(m, x, y):
    with torch.no_grad():
        return float((m(x).argmax(1) == y).float().mean())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", required=True, help="dataset/partition/seed,...")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--size", type=int, default=300)
    ap.add_argument("--val-frac", type=float, default=0.25)
    ap.add_argument("--method", default="fs-merge")
    ap.add_argument("--configs", required=True, help="JSON {name: options}")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    configs = json.loads(a.configs)
    for cell in a.cells.split(","):
        ds, part, seed = cell.split("/")
        models, data = cell_models(ds, part, a.model, int(seed), a.size)
        fx, fy = data.fusion_x, data.fusion_y
        g = torch.Generator().manual_seed(1234 + int(seed))
        perm = torch.randperm(len(fx), generator=g)
        nv = max(1, int(round(a.val_frac * len(fx))))
        vi, ti = perm[:nv], perm[nv:]
        with torch.no_grad():
            ens_v = torch.stack([m(fx[vi]).softmax(-1) for m in models]).mean(0).argmax(1)
        for name, opts in configs.items():
            t0 = time.perf_counter()
            fused = fuse(a.method, models, fusion_inputs=fx[ti], device="cpu", seed=int(seed), **opts)
            sec = time.perf_counter() - t0
            row = dict(cell=cell, model=a.model, size=a.size, method=a.method, config=name, options=opts,
                       n_fuse=len(ti), n_val=nv, val_acc=acc(fused, fx[vi], fy[vi]),
                       val_agree_ens=acc(fused, fx[vi], ens_v), test_acc=acc(fused, data.test.x, data.test.y),
                       seconds=sec)
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
