"""The anchor cell: fedfuse strategies on stock Flower FedAvg's own client splits, with the anchor's client recipe.

``../shared/anchors`` holds byte-exact client partitions (MNIST-1D and digits, Dirichlet α 0.1 / 0.5, seeds 0-2) on
which stock ``flwr.serverapp.strategy.FedAvg`` was measured, and its numbers (``README.md``). This runs fedfuse's
ServerApp and ClientApp (in-process engine) on the same files through ``partition-files``:

- clients: MLP 256×2, SGD momentum 0.9, lr 0.2, batch 32, 1 local epoch, all 10 clients every round, 30 rounds,
  ``val-fraction=0`` (all of a client's data trains, as in plain Flower);
- server: central evaluation on the split's ``test.npz``; the fusion set is ``fusion-set-size`` samples drawn
  (seeded) from the public pool ``mnist1d-public.npz`` (3,000 unlabeled samples disjoint from every client).

and writes ``table.md`` (final test accuracy, mean ± sample std over seeds, next to stock Flower's per-seed numbers
read from the anchors' README) and ``runs.json``.

    .venv/bin/python -m simulations.bench.anchor_cell --out results/anchor
    .venv/bin/python -m simulations.bench.anchor_cell --strategies fedavg,average --alphas 0.5 --seeds 0 --rounds 5
    .venv/bin/python -m simulations.bench.anchor_cell --summary results/anchor results/anchor-e20 results/anchor-e40
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

from fedfuse.flower.runner.stats import format_mean_std, mean_std  # noqa: E402
from fedfuse.flower.runner.sweep import parse_strategy, split_strategies  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ANCHORS = ROOT.parent / "shared" / "anchors"
DATASET = {"mnist1d": "mnist1d-flat", "digits": "digits-flat"}


def anchor_recipe(split_dir: Path, public: Path, dataset: str, seed: int, rounds: int) -> dict:
    """The run config of the anchor's client recipe on one split folder."""
    return {"dataset": DATASET[dataset], "partition-files": str(split_dir / "node-{partition-id}.npz"),
            "test-set-path": str(split_dir / "test.npz"), "fusion-set-path": str(public), "fusion-set-size": 300,
            "num-clients": 10, "min-train-nodes": 10, "fraction-train": 1.0, "model": "mlp", "model-width": 256,
            "model-depth": 2, "optimizer": "sgd", "lr": 0.2, "batch-size": 32, "local-epochs": 1,
            "weight-decay": 0.0, "val-fraction": 0.0, "num-server-rounds": rounds, "seed": seed}


def stock_flower(readme: Path) -> dict[tuple[str, float], list[float]]:
    """Stock Flower FedAvg's per-seed final accuracies from the anchors' README table."""
    out = {}
    for line in readme.read_text().splitlines():
        m = re.match(r"\|\s*(\w+) α=([\d.]+)\s*\|\s*([\d.]+) / ([\d.]+) / ([\d.]+)\s*\|", line)
        if m:
            out[(m.group(1), float(m.group(2)))] = [float(m.group(i)) for i in (3, 4, 5)]
    return out


def _run(job: dict) -> dict:
    from fedfuse.flower.runner.inprocess import run_inprocess

    out = run_inprocess(job["config"], echo=False)
    res = json.loads((out / "results.json").read_text())
    accs = [r["test-accuracy"] for r in res["rounds"]]
    hist = res.get("strategy-history", [])
    # head-round=true: the last row is the head round, the one before it the last training round's global model
    head = bool(hist) and "head-round" in (hist[-1].get("fusion-info") or {})
    return {**{k: job[k] for k in ("label", "dataset", "alpha", "seed")}, "final": accs[-1], "best": max(accs),
            "before-head": accs[-2] if head else None,
            "curve": accs, "fusion-seconds": [h.get("fusion-seconds", 0.0) for h in hist],
            "guarded": sum(1 for h in hist if h.get("guard")), "fell-back": sum(1 for h in hist if h.get("fallback")),
            "round-seconds": [r.get("round-seconds") for r in res["rounds"][1:]],
            # strategy 'auto': the aggregation each round chose
            "choices": [(h.get("fusion-info") or {}).get("select-choice") for h in hist]}


def _mean_std(values: list[float]) -> str:
    return format_mean_std(values, digits=3)


def _gain(points: list[float]) -> str:
    """Points of gain, signed: ``"+m ± s"`` (sample std), ``"+m"`` for one seed, ``"—"`` for none."""
    m, sd, n = mean_std(points)
    return "—" if n == 0 else f"{m:+.1f}" if n < 2 else f"{m:+.1f} ± {sd:.1f}"


def table(rows: list[dict], stock: dict, strategies: list[str]) -> str:
    lines = ["| split | strategy | per seed | mean ± std | vs stock Flower FedAvg (mean) |", "|---|---|---|---|---|"]
    cells = sorted({(r["dataset"], r["alpha"]) for r in rows})
    for ds, alpha in cells:
        ref = stock.get((ds, alpha))
        if ref is not None:
            lines.append(f"| {ds} α={alpha} | stock Flower FedAvg (anchors) | {' / '.join(f'{v:.3f}' for v in ref)} | "
                         f"{_mean_std(ref)} | |")
        for label in strategies:
            got = sorted((r for r in rows if (r["dataset"], r["alpha"], r["label"]) == (ds, alpha, label)),
                         key=lambda r: r["seed"])
            if not got:
                continue
            finals = [r["final"] for r in got]
            diff = f"{100 * (statistics.mean(finals) - statistics.mean(ref)):+.1f} points" if ref else ""
            if all(r.get("before-head") is not None for r in got):   # head-round=true: the model before it too
                before = [r["before-head"] for r in got]
                bdiff = f"{100 * (statistics.mean(before) - statistics.mean(ref)):+.1f} points" if ref else ""
                lines.append(f"| {ds} α={alpha} | fedfuse `{label}`, before the head round | "
                             f"{' / '.join(f'{v:.3f}' for v in before)} | {_mean_std(before)} | {bdiff} |")
            lines.append(f"| {ds} α={alpha} | fedfuse `{label}` | {' / '.join(f'{v:.3f}' for v in finals)} | "
                         f"{_mean_std(finals)} | {diff} |")
    return "\n".join(lines) + "\n"


def _regime_rows(dirs: list[Path]) -> list[dict]:
    rows = [r for d in dirs for r in json.loads((Path(d) / "runs.json").read_text())]
    for r in rows:
        name, extra = parse_strategy(r["label"])
        rest = " ".join(f"{k}={v}" for k, v in extra.items() if k not in ("local-epochs", "lr"))
        r["name"] = f"{name}[{rest}]" if rest else name
        r["E"], r["R"] = int(extra.get("local-epochs", 1)), len(r["curve"]) - 1
        r["lr"] = float(extra.get("lr", 0.2))   # the anchor recipe's lr unless overridden
    return rows


def regime_heatmap(dirs: list[Path], path: Path, names: list[str], reference: str = "fedavg") -> None:
    """One panel per strategy in ``names``: mean gain over ``reference`` (points, same split and seed) by local
    epochs E (columns) and α (rows)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = _regime_rows(dirs)
    best_lr = {}   # per (α, E): the lr at which the reference scores best (its best honest setting)
    for a, e in {(r["alpha"], r["E"]) for r in rows}:
        refs = {}
        for r in rows:
            if (r["alpha"], r["E"], r["name"]) == (a, e, reference):
                refs.setdefault(r["lr"], []).append(r["final"])
        best_lr[(a, e)] = max(refs, key=lambda lr: statistics.mean(refs[lr]))
    rows = [r for r in rows if r["lr"] == best_lr.get((r["alpha"], r["E"]))]
    es, alphas = sorted({r["E"] for r in rows}), sorted({r["alpha"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 2.6), squeeze=False)
    for ax, n in zip(axes[0], names):
        grid = np.full((len(alphas), len(es)), np.nan)
        for i, a in enumerate(alphas):
            for j, e in enumerate(es):
                ref = {r["seed"]: r["final"] for r in rows if (r["alpha"], r["E"], r["name"]) == (a, e, reference)}
                gains = [100 * (r["final"] - ref[r["seed"]]) for r in rows
                         if (r["alpha"], r["E"], r["name"]) == (a, e, n) and r["seed"] in ref]
                if gains:
                    grid[i, j] = statistics.mean(gains)
                    ax.text(j, i, f"{grid[i, j]:+.1f}", ha="center", va="center", fontsize=9)
        ax.imshow(grid, cmap="RdYlGn", vmin=-10, vmax=10, aspect="auto")
        ax.set_xticks(range(len(es)), [f"E={e}" for e in es])
        ax.set_yticks(range(len(alphas)), [f"α={a:g}" for a in alphas])
        ax.set_title(f"{n} − {reference} (points)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def regime_summary(dirs: list[Path], reference: str = "fedavg") -> str:
    """Gain over ``reference`` (same split, same seed, same E and R), mean ± sample std in points, per (α, E, R) cell
    and strategy, from the ``runs.json`` of several anchor-cell output folders."""
    rows = _regime_rows(dirs)
    cells = sorted({(r["alpha"], r["E"], r["R"], r["lr"]) for r in rows})
    names = sorted({r["name"] for r in rows} - {reference})
    lines = [f"| α | E × R (lr) | {reference} (final) | " + " | ".join(f"`{n}` gain" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for alpha, e, rr, lr in cells:
        key = (alpha, e, rr, lr)
        ref = {r["seed"]: r["final"] for r in rows if _cell(r) == key and r["name"] == reference}
        if not ref:
            continue
        cols = []
        for n in names:
            gains = [100 * (r["final"] - ref[r["seed"]]) for r in rows
                     if _cell(r) == key and r["name"] == n and r["seed"] in ref]
            cols.append(_gain(gains))
        lines.append(f"| {alpha:g} | {e} × {rr} ({lr:g}) | {_mean_std(list(ref.values()))} | " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n\n" + _speed_table(rows, cells, names, reference)


def _cell(r: dict) -> tuple:
    return r["alpha"], r["E"], r["R"], r["lr"]


def _rounds_to(curve: list[float], target: float) -> int | None:
    """The first round (1-based; the curve's entry 0 is the initial model) at or above ``target``."""
    return next((i for i, a in enumerate(curve) if i > 0 and a >= target - 1e-9), None)


def _speed_table(rows: list[dict], cells, names: list[str], reference: str) -> str:
    """Per cell and strategy: rounds to reach ``reference``'s final accuracy (same seed; ``>R`` when never; mean
    over the seeds that reach it) and the aggregation time as a fraction of the round's local training (runs that
    recorded round times)."""
    lines = ["| α | E × R (lr) | strategy | rounds to reach FedAvg's final (per seed) | aggregation / local training |",
             "|---|---|---|---|---|"]
    for alpha, e, rr, lr in cells:
        key = (alpha, e, rr, lr)
        ref = {r["seed"]: r["final"] for r in rows if _cell(r) == key and r["name"] == reference}
        for n in [reference] + names:
            got = sorted((r for r in rows if _cell(r) == key and r["name"] == n and r["seed"] in ref),
                         key=lambda r: r["seed"])
            if not got:
                continue
            reach = [_rounds_to(r["curve"], ref[r["seed"]]) for r in got]
            fracs = []
            for r in got:
                rs = [x for x in r.get("round-seconds") or [] if x is not None]
                fs = r.get("fusion-seconds") or []
                if rs and len(rs) == len(fs) and sum(rs) > sum(fs):
                    fracs.append(sum(fs) / (sum(rs) - sum(fs)))
            frac = f"{100 * statistics.mean(fracs):.0f} %" if fracs else "not recorded"
            lines.append(f"| {alpha:g} | {e} × {rr} ({lr:g}) | `{n}` | {' / '.join(str(x) if x else f'>{rr}' for x in reach)} "
                         f"| {frac} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="fedavg,average,fedavgm")
    ap.add_argument("--dataset", default="mnist1d", choices=sorted(DATASET))
    ap.add_argument("--alphas", default="0.1,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--anchors", default=str(ANCHORS))
    ap.add_argument("--out", default=str(ROOT / "results" / "anchor"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--summary", nargs="+", help="only print the gain-over-FedAvg table of these output folders")
    ap.add_argument("--plot", help="with --summary: write the gain heat map (one panel per --plot-strategies) here")
    ap.add_argument("--plot-strategies", default="average,feddf,auto")
    args = ap.parse_args(argv)
    if args.summary:
        print(regime_summary([Path(d) for d in args.summary]))
        if args.plot:
            regime_heatmap([Path(d) for d in args.summary], Path(args.plot), split_strategies(args.plot_strategies))
        return
    anchors, out = Path(args.anchors), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    public = anchors / "splits" / f"{args.dataset}-public.npz"
    strategies = split_strategies(args.strategies)
    jobs = []
    for alpha in [float(a) for a in args.alphas.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            split = anchors / "splits" / f"{args.dataset}-a{alpha:g}-s{seed}"
            for label in strategies:
                name, extra = parse_strategy(label)
                cfg = {**anchor_recipe(split, public, args.dataset, seed, args.rounds), "strategy": name, **extra,
                       "output-dir": str(out / "runs"), "run-name": f"{label}-{args.dataset}-a{alpha:g}-s{seed}"}
                jobs.append({"label": label, "dataset": args.dataset, "alpha": alpha, "seed": seed, "config": cfg})
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = []
        for row in pool.map(_run, jobs):
            rows.append(row)
            print(f"{row['label']:>24} {row['dataset']} α={row['alpha']} s{row['seed']}: final {row['final']:.3f} "
                  f"best {row['best']:.3f}", flush=True)
    previous = json.loads((out / "runs.json").read_text()) if (out / "runs.json").exists() else []
    keep = [r for r in previous if (r["label"], r["dataset"], r["alpha"], r["seed"])
            not in {(j["label"], j["dataset"], j["alpha"], j["seed"]) for j in jobs}]
    rows = keep + rows
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    labels = list(dict.fromkeys([r["label"] for r in rows]))
    text = table(rows, stock_flower(anchors / "README.md"), labels)
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
