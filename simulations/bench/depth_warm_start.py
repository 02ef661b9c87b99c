"""Seed 000's claim in a federation: clients with their own independently trained models of different depths (and
widths) join, the server combines them across depths into one global model (``mode='warm-start'`` with depth tiers:
``ot`` aligns them, ``feddf`` for width x depth tiers), and the federation trains on; against the best parent
fine-tuned by FedAvg among the clients that share its architecture, for the same number of rounds.

Stock Flower FedAvg's own MNIST-1D splits (``../shared/anchors``, 12,000 samples, 10 clients, Dirichlet alpha, seeds
0-2), an MLP of 4 hidden layers of 256, tiers ``--tiers`` round-robin by partition id, the anchors' client recipe
(SGD, batch 32, 1 local epoch per round) at ``--lr``, 300 public fusion samples. Round 1 of every warm-start row: each
client trains its own tier's model from its own initialisation for ``--warm-epochs`` epochs at ``--warm-lr`` (the
*parents*; the same parents in every row: their seeds and data do not depend on the row), then ``--rounds - 1``
rounds of FL. Rows:

- ``warm-start`` (fedfuse's default with depth tiers, ``average``: round 1 combines the parents, the head round
  after the last round);
- ``warm-start-depthfl``: DepthFL started from the same combined parents;
- ``scratch``: the default from a fresh initialisation, the same number of rounds;
- ``best-parent``: the parents' models scored on the test set, the best one (any tier) fine-tuned by Flower's FedAvg
  among the clients of its tier (its architecture: a plain MLP of its layers and width whose classifier is its exit)
  for ``--rounds - 1`` rounds, so that every row has the same number of rounds after the parents; ``best-parent@0``:
  that parent before fine-tuning.

``table.md``: final test accuracy mean +- sample std over seeds, the global model's parameters against the larger
parent's (the global model's deepest classifier runs the full-depth, full-width parent's architecture).

    .venv/bin/python -m simulations.bench.depth_warm_start --out results/depth-warm-start
    .venv/bin/python -m simulations.bench.depth_warm_start --tiers 1x1,1x0.5,0.5x0.5 --out results/depth-warm-start-wxd
    # the seed's own family: timm ViTs of width 64 and 4 blocks on the signals viewed [N, 1, 40] (Adam, lr 0.005)
    .venv/bin/python -m simulations.bench.depth_warm_start --model vit --lr 0.005 --warm-lr 0.005 \
        --out results/depth-warm-start-vit

``--model vit`` parents are ViTs of their tier's blocks whose head is their exit (LayerNorm, class token, Linear:
the ViT's own head), fine-tuned as such in the ``best-parent`` row.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

from fedfuse.flower.runner.console import format_mean_std  # noqa: E402
from fedfuse.hetero.tiers import parse_tier_pairs, tier_of  # noqa: E402
from simulations.bench.anchor_cell import ANCHORS, ROOT, anchor_recipe, run_or_read  # noqa: E402
from simulations.bench.depth_tiers import MODELS, signals, subset_split  # noqa: E402

LAYERS = 4
ROWS = ("warm-start", "warm-start-depthfl", "scratch", "best-parent")


def base_config(args, alpha: float, seed: int) -> tuple[dict, Path]:
    split = Path(args.anchors) / "splits" / f"mnist1d-a{alpha:g}-s{seed}"
    public = Path(args.anchors) / "splits" / "mnist1d-public.npz"
    if args.model != "mlp":   # the signals viewed [N, 1, 40]
        split, public = signals(split, public, Path(args.out) / "runs" / "signals" / split.name)
    cfg = {**anchor_recipe(split, public, "mnist1d", seed, args.rounds), **MODELS[args.model][0],
           "model-depth": LAYERS, "lr": args.lr, "client-tiers": args.tiers}
    return cfg, split


def fl_jobs(args, alpha: float, seed: int) -> list[dict]:
    cfg, _ = base_config(args, alpha, seed)
    runs = Path(args.out) / "runs"
    tag = f"a{alpha:g}-s{seed}"
    warm = {"mode": "warm-start", "warm-start-epochs": args.warm_epochs, "warm-start-lr": args.warm_lr}
    rows = {"warm-start": {"strategy": "average", **warm}, "warm-start-depthfl": {"strategy": "depthfl", **warm},
            "scratch": {"strategy": "average"}}
    return [{"label": label, "alpha": alpha, "seed": seed,
             "config": {**cfg, **extra, "output-dir": str(runs), "run-name": f"{label}-{tag}"}}
            for label, extra in rows.items()]


def _fl(job: dict) -> dict:
    out, res, failed = run_or_read(job["config"])
    last = res["rounds"][-1]
    return {"label": job["label"], "alpha": job["alpha"], "seed": job["seed"], "failed": failed, "out": str(out),
            "global": last["test-accuracy"], "tiers": last.get("tier-accuracy") or {},
            "curve": [r["test-accuracy"] for r in res["rounds"]]}


def plain_state(state: dict, units: int, model: str = "mlp") -> dict:
    """A depth tier's held arrays (``base.*`` of its units, ``exits.<k>.*``) as the state of the plain model of
    ``units`` units whose classifier is the exit: an MLP ``Flatten, (Linear, ReLU) x k, Linear`` (the exit head is
    ReLU then Linear on the level output, the same function), or a ViT of ``units`` blocks whose ``norm`` and ``head``
    are the exit's LayerNorm and Linear (the exit reads the class token after its LayerNorm, as the ViT's head)."""
    out = {k[len("base."):]: v for k, v in state.items() if k.startswith("base.")}
    if units < LAYERS:
        names = {"mlp": {"fc": str(2 * units + 1)}, "vit": {"fc": "head", "norm": "norm"}}[model]
        for part, name in names.items():
            out[f"{name}.weight"] = state[f"exits.{units}.{part}.weight"]
            out[f"{name}.bias"] = state[f"exits.{units}.{part}.bias"]
    return out


def build_plain(args, width: int, depth: int):
    from fedfuse.models import build_model

    return build_model(args.model, 10, MODELS[args.model][1], width=width, depth=depth)


def best_parent_job(args, fl_row: dict) -> dict:
    """Score every parent (``<run>/warm-start/client-<p>.pt``) on the test set, and the config that fine-tunes the
    best one by FedAvg among the clients of its tier."""
    import numpy as np
    import torch

    from fedfuse.hetero.depth import units_at

    alpha, seed = fl_row["alpha"], fl_row["seed"]
    cfg, split = base_config(args, alpha, seed)
    test = np.load(split / "test.npz")
    x, y = torch.as_tensor(test["x"]).float(), torch.as_tensor(test["y"]).long()
    pairs = parse_tier_pairs(args.tiers)
    scored = []
    for path in sorted(Path(fl_row["out"], "warm-start").glob("client-*.pt")):
        p = int(path.stem.split("-")[1])
        w, d = tier_of(p, pairs)
        k, width = units_at(d, LAYERS), math.ceil(w * MODELS[args.model][0]["model-width"] - 1e-9)
        model = build_plain(args, width, k)
        model.load_state_dict(plain_state(torch.load(path), k, args.model))
        with torch.no_grad():
            acc = float((model.eval()(x).argmax(-1) == y).float().mean())
        scored.append((acc, -p, p, (w, d), k, width, model.state_dict()))
    acc, _, p, tier, k, width, state = max(scored, key=lambda t: t[:2])
    runs = Path(args.out) / "runs"
    tag = f"a{alpha:g}-s{seed}"
    init = runs / "parents" / f"best-{tag}.pt"
    init.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, init)
    same = [q for q in range(10) if tier_of(q, pairs) == tier]
    sub = subset_split(split, same, runs / "splits" / f"tier-{tier[0]:g}x{tier[1]:g}-{tag}")
    config = {**cfg, "strategy": "fedavg", "client-tiers": "", "model-depth": k, "model-width": width,
              "initial-model-path": str(init), "num-server-rounds": args.rounds - 1,
              "partition-files": str(sub / "node-{partition-id}.npz"), "num-clients": len(same),
              "min-train-nodes": len(same), "fraction-train": 1.0, "output-dir": str(runs),
              "run-name": f"best-parent-{tag}"}
    return {"label": "best-parent", "alpha": alpha, "seed": seed, "config": config, "parent": p,
            "parent-tier": f"{tier[0]:g}x{tier[1]:g}", "parent-accuracy": acc,
            "parents": {str(q): a for a, _, q, *_ in scored}}


def _best(job: dict) -> dict:
    out, res, failed = run_or_read(job["config"])
    return {"label": "best-parent", "alpha": job["alpha"], "seed": job["seed"], "failed": failed,
            "global": res["rounds"][-1]["test-accuracy"], "tiers": {}, "parent": job["parent"],
            "parent-tier": job["parent-tier"], "parent-accuracy": job["parent-accuracy"], "parents": job["parents"],
            "curve": [r["test-accuracy"] for r in res["rounds"]]}


def parameters(args) -> tuple[int, int]:
    """(the global model's deepest-classifier parameters, the largest parent's: the plain model of its tier)."""
    from fedfuse.hetero.depth import units_at

    def count(width: int, depth: int) -> int:
        return sum(p.numel() for p in build_plain(args, width, depth).parameters())

    width = MODELS[args.model][0]["model-width"]
    parents = [count(math.ceil(w * width - 1e-9), units_at(d, LAYERS)) for w, d in parse_tier_pairs(args.tiers)]
    return count(width, LAYERS), max(parents)


def table(rows: list[dict], args) -> str:
    tier_labels = sorted({t for r in rows for t in r["tiers"]}, key=lambda t: [-float(v) for v in t.split("x")][::-1])
    lines = ["| α | row | global (deepest) | " + " | ".join(f"tier {t}" for t in tier_labels) + " | the parent |",
             "|" + "---|" * (4 + len(tier_labels))]
    for alpha in sorted({r["alpha"] for r in rows}):
        for label in ROWS:
            got = [r for r in rows if r["alpha"] == alpha and r["label"] == label]
            if not got:
                continue
            cells = [format_mean_std([r["global"] for r in got], digits=3)]
            cells += [format_mean_std([r["tiers"][t] for r in got if t in r["tiers"]], digits=3)
                      if any(t in r["tiers"] for r in got) else "" for t in tier_labels]
            parent = ""
            if label == "best-parent":
                parent = (format_mean_std([r["parent-accuracy"] for r in got], digits=3) + " before fine-tuning (tiers "
                          + ", ".join(r["parent-tier"] for r in got) + ")")
            died = sum(1 for r in got if r["failed"])
            note = f" ({died} of {len(got)} runs died)" if died else ""
            lines.append(f"| {alpha:g} | `{label}`{note} | " + " | ".join(cells) + f" | {parent} |")
    full, larger = parameters(args)
    return "\n".join(lines) + (f"\n\nGlobal model (deepest classifier): {full:,} parameters; the larger parent: "
                               f"{larger:,}.\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default="1x1,1x0.75,1x0.5,1x0.25")
    ap.add_argument("--model", default="mlp", choices=("mlp", "vit"),
                    help="the MLP 256x4, or a timm ViT of width 64 and 4 blocks on the signals (then --lr 0.005 "
                    "--warm-lr 0.005: Adam, the ViT recipe)")
    ap.add_argument("--alphas", default="0.1,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=5, help="rounds in all, the warm start's round 1 included")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--warm-epochs", type=int, default=20)
    ap.add_argument("--warm-lr", type=float, default=0.05)
    ap.add_argument("--anchors", default=str(ANCHORS))
    ap.add_argument("--out", default=str(ROOT / "results" / "depth-warm-start"))
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [(float(a), int(s)) for a in args.alphas.split(",") for s in args.seeds.split(",")]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(_fl, [j for a, s in cells for j in fl_jobs(args, a, s)]))
        warm = [r for r in rows if r["label"] == "warm-start"]
        rows += list(pool.map(_best, [best_parent_job(args, r) for r in warm]))
    for r in rows:
        print(f"{r['label']:>20} α={r['alpha']} s{r['seed']}: global {r['global']:.3f}", flush=True)
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    text = table(rows, args)
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
