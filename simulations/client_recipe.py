"""Choose the one-shot benchmark's client training recipe on the clients' *validation* splits.

    python -m simulations.client_recipe --datasets digits,mnist1d --partitions shards2,dirichlet4 --seeds 0,1

Trains every client of each cell with each candidate recipe (``RECIPES``) and prints, per recipe, the
mean client validation cross-entropy and accuracy (the selection criterion: what a real client can
measure) and, for diagnosis only, the test accuracy of the best client and of the ensemble. Writes
``results/one_shot/client_recipe.json`` / ``.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from fedfuse.models import build_model
from fedfuse.training import predict_logits
from simulations.oneshot_lib import CellConfig, load_data, train_client

RECIPES = {
    "old (adam, 40 ep, no reg)": dict(optimizer="adam", weight_decay=0.0, label_smoothing=0.0, patience=0,
                                      schedule="constant", epochs=40, lr=1e-3),
    "adamw+ls0.1+cos+ES lr1e-3": dict(epochs=60, lr=1e-3),
    "adamw+ls0.1+cos+ES lr3e-3": dict(epochs=60, lr=3e-3),
    "adamw+cos+ES lr1e-3 (no ls)": dict(epochs=60, lr=1e-3, label_smoothing=0.0),
    "adamw+ls0.1+cos+ES lr1e-3 wd5e-2": dict(epochs=60, lr=1e-3, weight_decay=5e-2),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", default="digits,mnist1d")
    ap.add_argument("--partitions", default="shards2,dirichlet4")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--recipes", default="", help="comma-separated indices into RECIPES (default all)")
    ap.add_argument("--out", default="results/one_shot/client_recipe")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = list(RECIPES)
    if args.recipes:
        names = [names[int(i)] for i in args.recipes.split(",")]
    rows = []
    for ds in args.datasets.split(","):
        for part in args.partitions.split(","):
            for seed in [int(s) for s in args.seeds.split(",")]:
                for rname in names:
                    r = dict(RECIPES[rname])
                    cfg = CellConfig(dataset=ds, partition=part, model="mlp", seed=seed, width=128, depth=2,
                                     epochs=r.pop("epochs"), lr=r.pop("lr"), **r)
                    data = load_data(cfg, 300)
                    probs, accs, vls, vas, eps = [], [], [], [], []
                    for pid in range(data.num_clients):
                        m = build_model("mlp", num_classes=data.num_classes, input_shape=data.input_shape,
                                        width=128, depth=2, seed=seed * 1000 + pid)
                        tr, va = data.client_data(pid, cfg.val_fraction, seed)
                        info = train_client(m, tr, va, cfg, seed=seed * 1000 + pid)
                        lg = predict_logits(m, data.test.x)
                        probs.append(lg.softmax(1))
                        accs.append(float((lg.argmax(1) == data.test.y).float().mean()))
                        vls.append(info["val-loss"])
                        vas.append(info["val-accuracy"])
                        eps.append(info["best-epoch"])
                    ens = float((sum(probs).argmax(1) == data.test.y).float().mean())
                    row = dict(dataset=ds, partition=part, seed=seed, recipe=rname, val_loss=float(np.mean(vls)),
                               val_acc=float(np.mean(vas)), best_epochs=eps, test_best=max(accs), test_ens=ens)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    lines = ["| dataset/partition | recipe | client val CE | client val acc | (test) best client | (test) ensemble |",
             "|---|---|---|---|---|---|"]
    keys = sorted({(r["dataset"], r["partition"]) for r in rows})
    for k in keys:
        for rname in names:
            rs = [r for r in rows if (r["dataset"], r["partition"]) == k and r["recipe"] == rname]
            lines.append(f"| {k[0]}/{k[1]} | {rname} | {np.mean([r['val_loss'] for r in rs]):.3f} | "
                         f"{100 * np.mean([r['val_acc'] for r in rs]):.1f} | {100 * np.mean([r['test_best'] for r in rs]):.1f} | "
                         f"{100 * np.mean([r['test_ens'] for r in rs]):.1f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
