"""A fused model collapsed to one prediction, reproduced on the CPU, and the warning that now says so.

On the GPU, ``kd`` into torchvision ResNet-18 clients at Dirichlet α 0.1 ended at exactly 10.0 % (one class for every
test image) and the run completed without a word (``docs/fashion-mnist.md``, item 4). Here the same failure on a
2-core machine: fedfuse's own ResNet (BatchNorm) on scikit-learn's digits, 3 clients that each hold 3–4 classes
(client ``i`` the classes ``c % 3 == i``, so at most 30–40 % of the test set each), 5 local epochs of Adam (lr 0.05);
300 fusion images, 400 test images.
Rows: the clients, their ensemble, ``kd`` at its default lr with 30 / 50 (its default) / 200 epochs and at lr 0.1,
``feddf`` at its defaults; each with whether ``fuse_result`` warned that the fused model collapsed
(``fedfuse.fusion.output_checks``) and the share of the fusion set its most predicted class takes.

    .venv/bin/python -m simulations.bench.kd_collapse --seeds 0,1,2 --out results/kd-collapse
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch

ROWS = (("kd", {"epochs": 30}), ("kd", {}), ("kd", {"epochs": 200}), ("kd", {"lr": 0.1}), ("feddf", {}))


def run_seed(seed: int) -> list[dict]:
    from sklearn.datasets import load_digits

    from fedfuse.fusion import fuse_result
    from fedfuse.fusion.distillation import teacher_probs
    from fedfuse.models import build_model
    from fedfuse.training import evaluate, train

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    tx, ty, fx, rx, ry = x[:400], y[:400], x[400:700], x[700:], y[700:]
    models = []
    for i in range(3):
        keep = ry % 3 == i
        m = build_model("resnet", 10, (1, 8, 8), seed=seed * 10 + i)
        train(m, rx[keep], ry[keep], epochs=5, lr=0.05, seed=seed * 10 + i)
        models.append(m)
    clients = [evaluate(m, tx, ty)["accuracy"] for m in models]
    ens = (teacher_probs(models, tx, [1 / 3] * 3).argmax(1) == ty).float().mean().item()
    ens_pred = teacher_probs(models, fx, [1 / 3] * 3).argmax(1)
    rows = [{"seed": seed, "row": "best client", "accuracy": max(clients)},
            {"seed": seed, "row": "clients' ensemble", "accuracy": ens,
             "top-class-share": float(torch.bincount(ens_pred, minlength=10).max()) / len(ens_pred)}]
    for method, opts in ROWS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = fuse_result(method, models, fusion_inputs=fx, seed=seed, **opts)
        with torch.no_grad():
            pred = res.model(fx).argmax(1)
        rows.append({"seed": seed, "row": method + "".join(f" {k} {v}" for k, v in opts.items()),
                     "accuracy": evaluate(res.model, tx, ty)["accuracy"],
                     "top-class-share": float(torch.bincount(pred, minlength=10).max()) / len(pred),
                     "warned": "collapse-warning" in res.info,
                     "warnings": [str(w.message) for w in caught if "collapsed" in str(w.message)]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--table-only", action="store_true", help="rewrite table.md from OUT/per-seed.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    if args.table_only:
        rows = json.loads((out / "per-seed.json").read_text())
    else:
        rows = [r for s in args.seeds.split(",") for r in run_seed(int(s))]
        out.mkdir(parents=True, exist_ok=True)
        (out / "per-seed.json").write_text(json.dumps(rows, indent=1))
    from simulations.bench.stats import pct

    names = list(dict.fromkeys(r["row"] for r in rows))
    seeds = sorted({r["seed"] for r in rows})
    lines = ["fedfuse ResNet on digits, 3 clients of 3–4 classes each; test accuracy % per seed "
             f"({', '.join(map(str, seeds))}), mean ± sample std; the most predicted class's share of the fusion set; warned = "
             "`fuse_result` said the fused model collapsed", "",
             "| row | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± sd | top-class share | warned |",
             "|---|" + "---|" * (len(seeds) + 3)]
    for name in names:
        rs = [r for r in rows if r["row"] == name]
        share = ", ".join(f"{r['top-class-share']:.0%}" for r in rs if "top-class-share" in r) or "-"
        warned = ", ".join("yes" if r["warned"] else "no" for r in rs if "warned" in r) or "-"
        lines.append(f"| {name} | " + " | ".join(f"{100 * r['accuracy']:.1f}" for r in rs)
                     + f" | {pct([r['accuracy'] for r in rs], count=False)} | {share} | {warned} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
