"""Depth tiers on stock Flower FedAvg's own client splits: DepthFL, its ablation and fedfuse's aggregations against
FedAvg at the shallowest depth and FedAvg of the full-depth clients alone.

The anchors' splits (``../shared/anchors``: MNIST-1D, 12,000 samples, 10 clients, Dirichlet α 0.1 / 0.5, seeds 0-2)
and their client recipe (``simulations.bench.anchor_cell.anchor_recipe``: SGD lr 0.2, batch 32, 1 local epoch, all
clients every round, 300 fusion samples from the public pool), with an MLP of ``--depth`` hidden layers of 256 and
depth tiers ``--tiers`` assigned round-robin by partition id (``--model vit``: a timm ViT of width 64 with ``--depth``
blocks on the same signals viewed ``[N, 1, 40]``, Adam lr 0.005; ``--model resnet``: fedfuse's ResNet of width 16
with ``--depth`` one-block stages on the same signals) (``1x1,1x0.75,1x0.5,1x0.25``: partitions 0,4,8 full
depth, 1,5,9 three layers, 2,6 two, 3,7 one). Rows:

- ``depthfl``, ``depthfl-fedavg``, ``inclusivefl``, ``average``, ``feddf`` (``fedfuse.flower.tiers.depth_tiers``) with the
  depth tiers;
- ``fedavg-shallowest``: every client trains the smallest tier's model (the shallowest, and of those the narrowest:
  model-depth = its layers, model-width = its width), FedAvg;
- ``fedavg-full-only``: FedAvg of the full-depth clients alone (their files only);
- ``fedavg-all-full`` (reference, not a tiered federation): every client at full depth;
- ``heterofl-equal-params``: HeteroFL with width tiers of each depth tier's parameter count (``equal_param_widths``),
  its tiers in the depth tiers' columns.

``table.md``: final test accuracy of the global model (its deepest classifier) and of every tier's classifier, the
ensemble of the exits, mean ± sample std over seeds; bytes sent per tier per round; the server's aggregation seconds
per round over the full-depth clients' local-epoch seconds.

    .venv/bin/python -m simulations.bench.depth_tiers --lr 0.05 --out results/depth-tiers
    .venv/bin/python -m simulations.bench.depth_tiers --model vit --alphas 0.1 --rounds 15 --out results/depth-tiers-vit
    .venv/bin/python -m simulations.bench.depth_tiers --alphas 0.1 --seeds 0 --rounds 5 --out /tmp/depth
    # digits (``--dataset digits``: the anchors' digits splits, the MLP at their width 128; the fusion pool is the
    # clients' pooled inputs, no disjoint pool ships) and 20 clients (the anchors' recipe):
    .venv/bin/python -m simulations.bench.anchor_splits --clients 20 --out results/cache/anchor-splits
    .venv/bin/python -m simulations.bench.depth_tiers --clients 20 --splits results/cache/anchor-splits ...
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

from fedfuse.flower.runner.console import format_mean_std  # noqa: E402
from fedfuse.flower.runner.sweep import parse_strategy, split_strategies  # noqa: E402
from fedfuse.hetero.tiers import parse_tier_pair, parse_tier_pairs, tier_of  # noqa: E402
from simulations.bench.anchor_cell import ANCHORS, ROOT, WIDTH, anchor_recipe, client_pool, run_or_read  # noqa: E402

DEPTH_STRATEGIES = "depthfl,depthfl-fedavg,inclusivefl,average,feddf"
BASELINES = ("fedavg-shallowest", "fedavg-full-only", "fedavg-all-full", "heterofl-equal-params")


# per --model: the run config of the clients' model and the input shape of the signals
MODELS = {"mlp": ({"model": "mlp", "model-width": 256}, (40,)),
          # the ViT recipe of the width-tier cells (simulations/bench/tiers.sh): Adam lr 0.005, width 64
          "vit": ({"model": "vit", "model-width": 64, "optimizer": "adam", "lr": 0.005, "dataset": "mnist1d"},
                  (1, 40)),
          # fedfuse's ResNet on the signals: 4 stages of one block (16, 32, 64, 128 channels), the anchors' SGD
          "resnet": ({"model": "resnet", "model-width": 16, "dataset": "mnist1d"}, (1, 40))}


def model_config(model: str, dataset: str = "mnist1d") -> tuple[dict, tuple[int, ...]]:
    """The run config of ``model`` and its input shape on ``dataset`` (digits: the anchors' 64 standardised features
    and the MLP at the anchors' width 128; the anchors' digits are standardised, not the [0, 1] images fedfuse's
    image models read, so digits takes the MLP only)."""
    cfg, shape = MODELS[model]
    if dataset == "mnist1d":
        return dict(cfg), shape
    if model != "mlp":
        raise ValueError(f"--dataset {dataset} takes --model mlp only (the anchors' digits are standardised features)")
    return {**cfg, "model-width": WIDTH[dataset]}, (64,)


def equal_param_widths(depths: list[float], layers: int, model: str = "mlp",
                       widths: list[float] | None = None, dataset: str = "mnist1d") -> list[float]:
    """Per depth tier (of width ``widths[i]``, 1 by default), the HeteroFL width multiplier whose sub-model of the
    full-depth model has the tier's parameter count (its blocks and its exit; bisection over the width
    multiplier)."""
    from fedfuse.hetero.depth import held_keys, multi_exit, units_at
    from fedfuse.models import build_model

    cfg, shape = model_config(model, dataset)

    def build(r: float | None = None):
        return build_model(model, 10, shape, width=cfg["model-width"], depth=layers, width_mult=r)

    def params(r: float) -> int:
        return sum(p.numel() for p in build(r).parameters())

    me = multi_exit(build(), depths, 10)
    out = []
    for d, w in zip(depths, widths or [1.0] * len(depths)):
        state = (me if w == 1 else me.at_width_mult(w, input_shape=shape)).state_dict()
        want = sum(state[k].numel() for k in held_keys(me, units_at(d, layers)))
        lo, hi = 1.0 / cfg["model-width"], 1.0
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if params(mid) < want else (lo, mid)
        out.append(1.0 if d == 1 and w == 1 else round(hi, 3))
    return out


def subset_split(split: Path, partitions: list[int], out: Path) -> Path:
    """A split folder holding only ``partitions`` of ``split`` (renumbered 0..n-1, symbolic links) and its test set."""
    out.mkdir(parents=True, exist_ok=True)
    for i, p in enumerate(partitions):
        link = out / f"node-{i}.npz"
        if not link.exists():
            link.symlink_to((split / f"node-{p}.npz").resolve())
    if not (out / "test.npz").exists():
        (out / "test.npz").symlink_to((split / "test.npz").resolve())
    return out


def signals(split: Path, public: Path, out: Path) -> tuple[Path, Path]:
    """The split and the public pool with every ``x`` viewed as ``[N, 1, 40]`` signals (the ViT's and the ResNet's
    input)."""
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    for f in [*split.glob("*.npz"), public]:
        dst = out / f.name
        if not dst.exists():
            z = np.load(f)
            np.savez(dst, **{k: (z[k].reshape(len(z[k]), 1, -1) if k.startswith("x") else z[k]) for k in z.files})
    return out, out / public.name


def jobs_for(args, alpha: float, seed: int) -> list[dict]:
    cfg, _ = model_config(args.model, args.dataset)
    if args.clients == 10:
        split = Path(args.anchors) / "splits" / f"{args.dataset}-a{alpha:g}-s{seed}"
    else:   # simulations.bench.anchor_splits' folders: the anchors' recipe for other client counts
        split = Path(args.splits) / f"{args.dataset}-c{args.clients}-a{alpha:g}-s{seed}"
    public = Path(args.anchors) / "splits" / "mnist1d-public.npz"
    if args.dataset == "digits":   # no disjoint public pool ships for digits: the clients' inputs (tables say so)
        public = client_pool(split, Path(args.out) / "runs" / "pools")
    if args.model != "mlp":
        split, public = signals(split, public, Path(args.out) / "runs" / "signals" / split.name)
    pairs = parse_tier_pairs(args.tiers)
    depths, widths = [d for _, d in pairs], [w for w, _ in pairs]
    # the smallest tier: the shallowest, and of those the narrowest
    small_w, small_d = min(pairs, key=lambda t: (t[1], t[0]))
    shallow_layers = max(1, math.ceil(small_d * args.depth - 1e-9))
    base = {**anchor_recipe(split, public, args.dataset, seed, args.rounds, clients=args.clients),
            "model-depth": args.depth, **cfg}
    if args.lr:
        base["lr"] = args.lr
    if args.one_shot:
        base.update({"mode": "one-shot", "num-server-rounds": 1, "local-epochs": args.one_shot_epochs,
                     "lr": args.one_shot_lr})
    runs = Path(args.out) / "runs"
    tag = f"a{alpha:g}-s{seed}"
    jobs = []
    for label in split_strategies(args.strategies):
        name, extra = parse_strategy(label)
        jobs.append({"label": label, "config": {**base, "strategy": name, "client-tiers": args.tiers, **extra,
                                                "output-dir": str(runs), "run-name": f"{label}-{tag}"}})
    full = [p for p in range(args.clients) if tier_of(p, tuple(pairs)) == (1.0, 1.0)]
    equal = equal_param_widths(depths, args.depth, args.model, widths, args.dataset)
    baseline = {"heterofl-equal-params": {"strategy": "heterofl", "client-tiers": ",".join(f"{w:g}" for w in equal),
                                          "width-labels": dict(zip((f"{w:g}" for w in equal),
                                                                   (f"{w:g}x{d:g}" for w, d in pairs)))},
                "fedavg-shallowest": {"model-depth": shallow_layers,
                                      "model-width": math.ceil(small_w * cfg["model-width"] - 1e-9)},
                "fedavg-full-only": {"partition-files": str(subset_split(split, full, runs / "splits" / f"full-{tag}")
                                                            / "node-{partition-id}.npz"),
                                     "num-clients": len(full), "min-train-nodes": len(full)},
                "fedavg-all-full": {}}
    for label in args.baselines:   # a baseline's run config may be extended as a strategy's: name[key=value ...]
        name, over = parse_strategy(label)
        extra = dict(baseline[name])
        relabel = extra.pop("width-labels", None)
        jobs.append({"label": label, "kind": name, "relabel": relabel,
                     "config": {**base, "strategy": "fedavg", **extra, **over, "output-dir": str(runs),
                                "run-name": f"{label}-{tag}"}})
    for j in jobs:
        j.update(alpha=alpha, seed=seed, shallow=f"{small_w:g}x{small_d:g}")
    return jobs


def _run(job: dict) -> dict:
    out, res, failed = run_or_read(job["config"])
    last = res["rounds"][-1]
    trained = next((r for r in reversed(res["rounds"]) if r.get("tier-bytes-sent")), last)   # not the head round
    hist = res.get("strategy-history", [])
    train = [s for h in res["rounds"][1:] for t, s in (h.get("tier-train-seconds") or {}).items() if t == "1x1"]
    tiers = dict(last.get("tier-accuracy") or {})
    if job.get("kind") == "fedavg-shallowest":
        tiers = {job["shallow"]: last["test-accuracy"]}
    relabel = job.get("relabel") or {}
    if relabel:   # HeteroFL's width tiers in the columns of the depth tiers of the same parameter count
        tiers = {relabel.get(t, t): v for t, v in tiers.items()}
        train = [s for h in res["rounds"][1:] for t, s in (h.get("tier-train-seconds") or {}).items() if t == "1"]
    return {"label": job["label"], "alpha": job["alpha"], "seed": job["seed"], "failed": failed,
            "global": last["test-accuracy"], "tiers": tiers, "exit-ensemble": last.get("exit-ensemble-accuracy"),
            # one-shot references (the server's): the best client model and the clients' ensemble
            "best-client": last.get("best-client-accuracy"), "client-ensemble": last.get("ensemble-accuracy"),
            # and fedfuse.references' KD: the weighted ensemble distilled into client 0's model (a full-depth client)
            "kd": next((r.get("accuracy") for r in (res.get("one-shot-references") or {}).get("rows", [])
                        if r["key"] == "kd"), None),
            "bytes": {relabel.get(t, t): v / max(1, (trained.get("tier-clients") or {}).get(t, 1))
                      for t, v in (trained.get("tier-bytes-sent") or {}).items()},
            "head-round-numbers": next((h["fusion-info"]["head-round"].get("numbers-per-reply") for h in hist
                                        if (h.get("fusion-info") or {}).get("head-round")), None), "curve": [r["test-accuracy"] for r in res["rounds"]],
            "fusion-seconds": [h.get("fusion-seconds", 0.0) for h in hist if not h.get("post-step")],
            "full-train-seconds": statistics.median(train) if train else None}


def table(rows: list[dict], labels: list[str], tier_labels: list[str]) -> str:
    head = ("| α | strategy | global (deepest) | " + " | ".join(f"tier {t}" for t in tier_labels)
            + " | exit ensemble | best client | clients' ensemble | KD (one-shot) | KB sent per client / round "
            "| aggregation / full-depth local epoch |")
    lines = [head, "|" + "---|" * (9 + len(tier_labels))]
    for alpha in sorted({r["alpha"] for r in rows}):
        for label in labels:
            got = [r for r in rows if r["alpha"] == alpha and r["label"] == label]
            if not got:
                continue
            died = sum(1 for r in got if r["failed"])   # trained to chance: kept in the mean, and said

            def ms(vals):
                vals = [v for v in vals if v is not None]
                return format_mean_std(vals, digits=3) if vals else ""

            cells = [ms([r["global"] for r in got])]
            cells += [ms([r["tiers"].get(t) for r in got]) for t in tier_labels]
            cells.append(ms([r["exit-ensemble"] for r in got]))
            cells += [ms([r.get(k) for r in got]) for k in ("best-client", "client-ensemble", "kd")]
            b = got[0]["bytes"]
            cells.append(", ".join(f"{t}: {b[t] / 1e3:.0f}" for t in tier_labels if t in b))
            ratios = [statistics.median(r["fusion-seconds"]) / r["full-train-seconds"] for r in got
                      if r["fusion-seconds"] and r["full-train-seconds"]]
            cells.append(f"{statistics.mean(ratios):.2f}" if ratios else "")
            note = f" ({died} of {len(got)} runs died)" if died else ""
            lines.append(f"| {alpha:g} | `{label}`{note} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(row: dict, col: str) -> float | None:
    """A run's final accuracy in column ``col``: ``global`` or a tier label."""
    return row["global"] if col == "global" else row["tiers"].get(col)


def plot(rows: list[dict], labels: list[str], tier_labels: list[str], path: Path) -> None:
    """Per alpha: the final accuracy of the global model and of every tier per row (bars, mean ± sample std over
    seeds), and the global model's test accuracy per round (mean over seeds) below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simulations.bench.stats import mean_std

    alphas = sorted({r["alpha"] for r in rows})
    cols = ["global", *tier_labels]
    fig, axes = plt.subplots(2, len(alphas), figsize=(6.5 * len(alphas), 8), squeeze=False)
    for i, alpha in enumerate(alphas):
        ax, cx = axes[0, i], axes[1, i]
        shown = [lab for lab in labels if any(r["alpha"] == alpha and r["label"] == lab for r in rows)]
        width, lows = 0.8 / max(1, len(shown)), [100.0]
        for j, lab in enumerate(shown):
            got = [r for r in rows if r["alpha"] == alpha and r["label"] == lab]
            stats = [mean_std([v for r in got if (v := _cell(r, c)) is not None]) for c in cols]
            xs = [k + (j - (len(shown) - 1) / 2) * width for k in range(len(cols))]
            lows += [m * 100 for m, _, n in stats if n]
            ax.bar(xs, [m * 100 if n else 0 for m, _, n in stats], width,
                   yerr=[sd * 100 if n > 1 else 0 for _, sd, n in stats], label=lab, alpha=0.85)
            curves = [r["curve"] for r in got if r.get("curve")]
            if curves:
                n = min(len(c) for c in curves)
                cx.plot(range(n), [100 * sum(c[t] for c in curves) / len(curves) for t in range(n)], label=lab)
        ax.set_xticks(range(len(cols)), cols, fontsize=8)
        ax.set_ylim(bottom=max(0.0, min(lows) - 10))
        ax.set_ylabel("final test accuracy (%), mean ± sample std")
        ax.set_title(f"α = {alpha:g}: global model and every tier", fontsize=9)
        ax.legend(fontsize=6)
        cx.set_xlabel("round (the last: the head round where it runs)")
        cx.set_ylabel("global model test accuracy (%), mean over seeds")
        cx.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default=DEPTH_STRATEGIES)
    ap.add_argument("--baselines", default=",".join(BASELINES))
    ap.add_argument("--tiers", default="1x1,1x0.75,1x0.5,1x0.25")
    ap.add_argument("--depth", type=int, default=4, help="hidden layers of the global MLP (blocks of the ViT)")
    ap.add_argument("--model", default="mlp", choices=sorted(MODELS))
    ap.add_argument("--dataset", default="mnist1d", choices=("mnist1d", "digits"),
                    help="the anchors' splits (digits: the clients' pooled inputs as the fusion pool, not disjoint)")
    ap.add_argument("--clients", type=int, default=10, help="clients (10: the anchors' splits; else --splits)")
    ap.add_argument("--splits", help="folder of simulations.bench.anchor_splits output for --clients != 10")
    ap.add_argument("--alphas", default="0.1,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.0, help="the clients' lr (0: the model's recipe: the anchors' SGD "
                    "0.2 for the MLP, Adam 0.005 for the ViT)")
    ap.add_argument("--one-shot", action="store_true", help="one round, clients trained from their own initialisation")
    ap.add_argument("--one-shot-epochs", type=int, default=20)
    ap.add_argument("--one-shot-lr", type=float, default=0.05)
    ap.add_argument("--anchors", default=str(ANCHORS))
    ap.add_argument("--out", default=str(ROOT / "results" / "depth-tiers"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--replot", action="store_true", help="no runs: redraw table.md and tiers.png from runs.json")
    args = ap.parse_args(argv)
    args.baselines = [b for b in split_strategies(args.baselines) if b]
    if args.clients != 10 and not args.splits:
        ap.error("--clients other than 10 needs --splits (made by simulations.bench.anchor_splits)")
    if args.clients != 10 and args.dataset != "mnist1d":
        ap.error("--clients other than 10 takes --dataset mnist1d (simulations.bench.anchor_splits makes MNIST-1D)")
    bad = {parse_strategy(b)[0] for b in args.baselines} - set(BASELINES)
    if bad:
        ap.error(f"--baselines: unknown {sorted(bad)}; choose from {list(BASELINES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [] if args.replot else [j for a in args.alphas.split(",") for s in args.seeds.split(",")
                                   for j in jobs_for(args, float(a), int(s))]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = []
        for row in pool.map(_run, jobs):
            rows.append(row)
            print(f"{row['label']:>20} α={row['alpha']} s{row['seed']}: global {row['global']:.3f} "
                  f"tiers {json.dumps({k: round(v, 3) for k, v in row['tiers'].items()})}", flush=True)
    previous = json.loads((out / "runs.json").read_text()) if (out / "runs.json").exists() else []
    done = {(r["label"], r["alpha"], r["seed"]) for r in rows}
    rows = [r for r in previous if (r["label"], r["alpha"], r["seed"]) not in done] + rows
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    tier_labels = sorted({t for r in rows for t in r["tiers"]}, key=lambda t: tuple(-v for v in reversed(
        parse_tier_pair(t))))
    text = table(rows, labels, tier_labels)
    (out / "table.md").write_text(text)
    plot(rows, labels, tier_labels, out / "tiers.png")
    print(text)


if __name__ == "__main__":
    main()
