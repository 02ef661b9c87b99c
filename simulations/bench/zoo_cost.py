"""The cost of fusing models users bring, as ratios to the physical floor (issue 57's cost goal).

For each model (torchvision ResNet-18 at 3 × 32 × 32 by default: the hand-written family and the generic reader on
the same weights), ``--clients`` independently initialised copies and a fusion set of ``--fusion-size`` images:
the seconds of each method's ``fuse`` call ÷ the seconds of one forward pass of every client over the fusion set
(the floor: an activation-based method has to run every client over the set at least once), measured in this
process, median of ``--repeats``.

    .venv/bin/python -m simulations.bench.zoo_cost --models tv:resnet18,graph:tv:resnet18 --out results/zoo-cost
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fedfuse.fusion import fuse  # noqa: E402
from fedfuse.models import set_example_input  # noqa: E402

METHODS = ("rebasin-weights", "rebasin", "ot", "transfusion", "kf-linear")


def _build(name: str, seed: int) -> torch.nn.Module:
    import torchvision
    torch.manual_seed(seed)
    return getattr(torchvision.models, name.split(":")[-1])(num_classes=10).eval()


class _User(torch.nn.Module):
    """The same model as a user's own module holding it: no hand-written adapter matches, the generic reader reads
    it."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


def _forced_graph(model: torch.nn.Module) -> torch.nn.Module:
    return _User(model).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tv:resnet18,graph:tv:resnet18")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--fusion-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/zoo-cost")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.fusion_size, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    rows = []
    for name in args.models.split(","):
        models = [_build(name, s) for s in range(args.clients)]
        if name.startswith("graph:"):
            models = [_forced_graph(m) for m in models]
        for m in models:
            set_example_input(m, x)
        floors = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            with torch.no_grad():
                for m in models:
                    m(x)
            floors.append(time.perf_counter() - t)
        floor = statistics.median(floors)
        fuse("average", models)   # warm the caches (the reader traces once per architecture)
        for method in args.methods.split(","):
            meth, opts = ("rebasin", {"matching": "weights"}) if method == "rebasin-weights" else (method, {})
            secs = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fuse(meth, models, fusion_inputs=x, **opts)
                secs.append(time.perf_counter() - t)
            s = statistics.median(secs)
            rows.append({"model": name, "method": method, "seconds": s, "floor_seconds": floor, "ratio": s / floor})
            print(f"{name:22s} {method:16s} {s:8.2f} s  floor {floor:6.2f} s  ratio {s / floor:6.1f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    lines = ["| model | method | fuse ÷ forward floor |", "|---|---|---|"]
    lines += [f"| {r['model']} | {r['method']} | {r['ratio']:.1f} |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
