"""The centralised ceiling of NIID-Bench's Fashion-MNIST cell: one LeNet-5 trained on every client's images pooled
(the 59,000 training images outside the public pool), with the clients' own recipe, test accuracy after every epoch.

A federated run on the same images and model cannot be expected above this: it is what the model and recipe reach
when the data is not split at all. NIID-Bench (Li et al., arXiv 2102.02079) reports FedAvg at Dir(0.5) 88.09 and
IID 89.23 after 50 rounds × 10 local epochs; the issue's goal for fedfuse's default there is ≥ 90.0, so the pooled
model's best over epochs says how far that goal is above what LeNet-5 with this recipe can reach.

Recipe (the clients' in M1): SGD lr 0.01, momentum 0.9, weight decay 1e-5, batch 64, pixels in [0, 1]; seeded
initialisation and batch order. Rows: best test accuracy over epochs (NIID-Bench's "best over rounds"), final, and
the epoch of the best, mean ± sample std over seeds.

    .venv/bin/python -m simulations.bench.fmnist_central --seeds 0,1,2 --epochs 30 --out results/fmnist-central
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedfuse.models import build_model  # noqa: E402
from fedfuse.training import evaluate, limit_threads, train  # noqa: E402
from simulations.bench.fmnist_splits import write_splits  # noqa: E402

SPLITS = Path("results/cache/fmnist-splits")


def pooled(folder: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every node file of one split folder concatenated, and its test set."""
    xs, ys = [], []
    for f in sorted(folder.glob("node-*.npz")):
        d = np.load(f)
        xs.append(d["x_train"])
        ys.append(d["y_train"])
    t = np.load(folder / "test.npz")
    return (torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)),
            torch.from_numpy(t["x"]), torch.from_numpy(t["y"]))


def run(seed: int, epochs: int, folder: Path) -> dict:
    """One seeded pooled run: the test accuracy after each epoch."""
    x, y, xt, yt = pooled(folder)
    model = build_model("lenet", num_classes=10, input_shape=(1, 28, 28), seed=seed)
    curve, seconds = [], 0.0
    for epoch in range(epochs):
        t0 = time.perf_counter()
        # one epoch at a time so the curve is recorded; the optimiser's momentum restarts each epoch (a 1-epoch
        # restart of a 0.9 momentum buffer costs nothing measurable), the batch order is seeded per epoch
        train(model, x, y, epochs=1, batch_size=64, optimizer="sgd", lr=0.01, weight_decay=1e-5, momentum=0.9,
              seed=seed * 1000 + epoch)
        seconds += time.perf_counter() - t0
        curve.append(float(evaluate(model, xt, yt)["accuracy"]))
        print(json.dumps({"seed": seed, "epoch": epoch + 1, "test-accuracy": round(curve[-1], 4)}), flush=True)
    return {"seed": seed, "images": int(len(y)), "epochs": epochs, "curve": curve, "best": max(curve),
            "best-epoch": int(np.argmax(curve)) + 1, "final": curve[-1], "train-seconds": seconds}


def mean_std(v: list[float]) -> str:
    return f"{100 * statistics.mean(v):.1f} ± {100 * statistics.stdev(v):.1f} (n={len(v)})" if len(v) > 1 \
        else f"{100 * v[0]:.1f} (n=1)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--out", default="results/fmnist-central")
    a = ap.parse_args(argv)
    limit_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # the pooled images are the same for every split; the iid split's folder of seed 0 holds them
    folder = write_splits(SPLITS, ["iid"], 10, [0])[0]
    runs = []
    for s in (int(v) for v in a.seeds.split(",")):
        path = out / f"seed{s}-e{a.epochs}.json"
        if not path.exists():
            path.write_text(json.dumps(run(s, a.epochs, folder)))
        runs.append(json.loads(path.read_text()))
    table = ["| model | images | epochs | best over epochs | epoch of the best | final |", "|---|---|---|---|---|---|",
             f"| LeNet-5, pooled (centralised) | {runs[0]['images']:,} | {a.epochs} | "
             f"{mean_std([r['best'] for r in runs])} | {' / '.join(str(r['best-epoch']) for r in runs)} | "
             f"{mean_std([r['final'] for r in runs])} |"]
    (out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
