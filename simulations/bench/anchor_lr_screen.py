"""Client learning-rate screen for plain FedAvg on the anchor splits at long local training (no fedfuse code).

The anchor recipe's lr 0.2 (SGD momentum 0.9, batch 32) is tuned for 1 local epoch; with E ≥ 10 it drives clients
to their majority class. Before the regime cells compare strategies at E local epochs, FedAvg gets its best lr of a
small grid, measured here with plain PyTorch (the anchor's MLP 256×2, 10 clients, sample-weighted averaging, central
test accuracy after R rounds), mean ± sample std over seeds 0–2:

    .venv/bin/python -m simulations.bench.anchor_lr_screen --epochs 10 --rounds 4 --lrs 0.02,0.05,0.1
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

SPLITS = Path(__file__).resolve().parents[3] / "shared" / "anchors" / "splits"


def mlp(d: int) -> nn.Module:
    """The anchor's MLP: ``d``-256-256-10 with ReLU."""
    return nn.Sequential(nn.Linear(d, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def load_split(split: Path) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(xs, ys, x_test, y_test)`` of one anchor split folder (10 node files and ``test.npz``)."""
    nodes = [np.load(split / f"node-{i}.npz") for i in range(10)]
    test = np.load(split / "test.npz")
    return ([torch.tensor(n["x_train"]) for n in nodes], [torch.tensor(n["y_train"]) for n in nodes],
            torch.tensor(test["x"]), torch.tensor(test["y"]))


def train_local(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float,
                gen: torch.Generator) -> nn.Module:
    """The anchor's client step: ``epochs`` of SGD (momentum 0.9, batch 32, fresh optimizer) on ``(x, y)``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=gen)
        for b in range(0, len(perm), 32):
            idx = perm[b:b + 32]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model


def fedavg(split: Path, seed: int, epochs: int, rounds: int, lr: float) -> float:
    """Final test accuracy of FedAvg (all 10 clients every round) with the anchor's client recipe at ``lr``."""
    xs, ys, xt, yt = load_split(split)
    torch.manual_seed(seed)
    g = mlp(xs[0].shape[1])
    w = torch.tensor([len(y) for y in ys], dtype=torch.float64)
    w = w / w.sum()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        states = [train_local(copy.deepcopy(g), x, y, epochs, lr, gen).state_dict() for x, y in zip(xs, ys)]
        g.load_state_dict({k: sum(float(wi) * s[k] for wi, s in zip(w, states)) for k in states[0]})
    with torch.no_grad():
        return float((g(xt).argmax(1) == yt).float().mean())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--lrs", default="0.02,0.05,0.1")
    ap.add_argument("--alphas", default="0.1,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"| α | lr | FedAvg E={args.epochs} × R={args.rounds} (per seed) | mean ± std |\n|---|---|---|---|")
    for alpha in args.alphas.split(","):
        for lr in [float(v) for v in args.lrs.split(",")]:
            accs = [fedavg(SPLITS / f"mnist1d-a{alpha}-s{s}", int(s), args.epochs, args.rounds, lr)
                    for s in args.seeds.split(",")]
            print(f"| {alpha} | {lr:g} | {' / '.join(f'{a:.3f}' for a in accs)} | "
                  f"{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f} |", flush=True)


if __name__ == "__main__":
    main()
