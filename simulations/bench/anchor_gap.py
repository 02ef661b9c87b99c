"""Per round: is the clients' ensemble better than their average, and do the clients' own data rank the candidates?

The diagnostic behind strategy ``auto`` (docs/multi-round.md). Plain FedAvg rounds (the anchor's MLP and client
recipe, all 10 clients) on stock Flower's MNIST-1D anchor splits; after each round's local training it reports on
the test set the weighted average, the clients' weighted probability ensemble and FedDF (``fuse("feddf")`` on a
300-sample fusion set from the public pool), the label-free disagreement KL(ensemble ‖ average) on the fusion set,
and the sample-weighted accuracy of the average and of FedDF on the clients' own training data (what ``auto``'s
clients score). The global model of the next round is the average.

    .venv/bin/python -m simulations.bench.anchor_gap --cells 40x2@0.02,10x3@0.02,1x6@0.2 --seeds 0,1 \\
        --out results/anchor-gap
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from fedfuse.fusion import fuse_result  # noqa: E402
from simulations.bench.anchor_lr_screen import SPLITS, load_split, mlp, train_local  # noqa: E402


def _acc(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def cell(alpha: float, seed: int, epochs: int, rounds: int, lr: float, fusion_size: int = 300) -> list[dict]:
    """One row per round (see the module docstring)."""
    xs, ys, xt, yt = load_split(SPLITS / f"mnist1d-a{alpha:g}-s{seed}")
    pool = torch.tensor(np.load(SPLITS / "mnist1d-public.npz")["x"])
    fx = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[:fusion_size]]
    torch.manual_seed(seed)
    g = mlp(xs[0].shape[1])
    n = [len(y) for y in ys]
    w = [v / sum(n) for v in n]
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(1, rounds + 1):
        clients = [train_local(copy.deepcopy(g), x, y, epochs, lr, gen).eval() for x, y in zip(xs, ys)]
        avg = fuse_result("average", clients, weights=n).model
        fd = fuse_result("feddf", clients, fusion_inputs=fx, weights=n, seed=seed + r).model
        with torch.no_grad():
            pe = sum(wi * c(fx).softmax(1) for wi, c in zip(w, clients))
            pa = avg(fx).softmax(1)
            kl = float((pe * (pe.clamp_min(1e-12).log() - pa.clamp_min(1e-12).log())).sum(1).mean())
            ens = float((sum(wi * c(xt).softmax(1) for wi, c in zip(w, clients)).argmax(1) == yt).float().mean())
        rows.append({"alpha": alpha, "seed": seed, "E": epochs, "lr": lr, "round": r, "kl": kl,
                     "average": _acc(avg, xt, yt), "ensemble": ens, "feddf": _acc(fd, xt, yt),
                     "own-average": sum(wi * _acc(avg, x, y) for wi, x, y in zip(w, xs, ys)),
                     "own-feddf": sum(wi * _acc(fd, x, y) for wi, x, y in zip(w, xs, ys))})
        g = avg
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| α | E (lr) | seed | round | KL(ens‖avg) | test: average | ensemble | FedDF | own data: average | "
             "FedDF | own data ranks like test |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = (r["feddf"] > r["average"]) == (r["own-feddf"] > r["own-average"])
        lines.append(f"| {r['alpha']:g} | {r['E']} ({r['lr']:g}) | {r['seed']} | {r['round']} | {r['kl']:.3f} | "
                     f"{r['average']:.3f} | {r['ensemble']:.3f} | {r['feddf']:.3f} | {r['own-average']:.3f} | "
                     f"{r['own-feddf']:.3f} | {'yes' if same else 'no'} |")
    agree = sum((r["feddf"] > r["average"]) == (r["own-feddf"] > r["own-average"]) for r in rows)
    return "\n".join(lines) + f"\n\nThe clients' own data rank FedDF vs the average as the test set does in {agree} " \
                              f"of {len(rows)} rounds.\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="40x2@0.02,10x3@0.02,1x6@0.2", help="ExR@lr, comma-separated")
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", default="results/anchor-gap")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for spec in args.cells.split(","):
        er, lr = spec.split("@")
        e, r = (int(v) for v in er.split("x"))
        for s in args.seeds.split(","):
            rows += cell(args.alpha, int(s), e, r, float(lr))
    text = table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
