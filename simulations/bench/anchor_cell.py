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

Federations the anchors do not ship (20 clients, 8 sampled per round) run on splits made with the anchors' own
recipe (``simulations.bench.anchor_splits``, byte-identical to the anchors at 10 clients):

    .venv/bin/python -m simulations.bench.anchor_splits --clients 20 --out results/cache/anchor-splits
    .venv/bin/python -m simulations.bench.anchor_cell --clients 20 --per-round 8 --splits results/cache/anchor-splits ...
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

from fedfuse.flower.runner.console import format_mean_std, mean_std  # noqa: E402
from fedfuse.flower.runner.sweep import parse_strategy, split_strategies  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ANCHORS = ROOT.parent / "shared" / "anchors"
DATASET = {"mnist1d": "mnist1d-flat", "digits": "digits-std"}   # the anchors' digits are standardised features
WIDTH = {"mnist1d": 256, "digits": 128}   # the anchors' MLPs: 40-256-256-10 and 64-128-128-10


def anchor_recipe(split_dir: Path, public: Path, dataset: str, seed: int, rounds: int, clients: int = 10,
                  per_round: int | None = None) -> dict:
    """The run config of the anchor's client recipe on one split folder (``per_round`` of ``clients`` sampled each
    round; all by default)."""
    per_round = per_round or clients
    return {"dataset": DATASET[dataset], "partition-files": str(split_dir / "node-{partition-id}.npz"),
            "test-set-path": str(split_dir / "test.npz"), "fusion-set-path": str(public), "fusion-set-size": 300,
            "num-clients": clients, "min-train-nodes": per_round, "fraction-train": per_round / clients,
            "model": "mlp", "model-width": WIDTH[dataset],
            "model-depth": 2, "optimizer": "sgd", "lr": 0.2, "batch-size": 32, "local-epochs": 1,
            "weight-decay": 0.0, "val-fraction": 0.0, "num-server-rounds": rounds, "seed": seed}


def client_pool(split_dir: Path, out: Path) -> Path:
    """The unlabeled union of a split's client inputs as a fusion pool file (``x``), for datasets whose anchors ship
    no disjoint public pool (digits: every training sample belongs to a client). Not disjoint from the clients: it
    favours server-side methods that read the fusion set, and tables must say so."""
    path = out / f"client-pool-{split_dir.name}.npz"
    if not path.exists():
        import numpy as np

        files = sorted(split_dir.glob("node-*.npz"))
        if not files:
            raise FileNotFoundError(f"{split_dir} holds no node-*.npz client files")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, x=np.concatenate([np.load(f)["x_train"] for f in files]))
    return path


def stock_flower(readme: Path) -> dict[tuple[str, float], list[float]]:
    """Stock Flower FedAvg's per-seed final accuracies from the anchors' README table."""
    out = {}
    for line in readme.read_text().splitlines():
        m = re.match(r"\|\s*(\w+) α=([\d.]+)\s*\|\s*([\d.]+) / ([\d.]+) / ([\d.]+)\s*\|", line)
        if m:
            out[(m.group(1), float(m.group(2)))] = [float(m.group(i)) for i in (3, 4, 5)]
    return out


def run_or_read(cfg: dict, **kw) -> tuple[Path, dict, str | None]:
    """The run folder, ``results.json`` and failure reason (or ``None``) of the in-process run ``cfg``; a finished
    run is read, not rerun. A run fedfuse fails because its model died (e.g. an lr far too high, an attack) is kept
    as a result, marked ``RUN-FAILED``; any other failure raises. ``kw`` goes to ``run_inprocess``."""
    from fedfuse.flower.runner.inprocess import run_inprocess

    out = Path(cfg["output-dir"]) / cfg["run-name"]
    failed = out / "RUN-FAILED"
    if not ((out / "DONE").exists() or failed.exists()) or not (out / "results.json").exists():
        try:
            out = run_inprocess(cfg, echo=False, **kw)
        except RuntimeError as exc:
            if not (out / "results.json").exists():
                raise
            failed.write_text(str(exc))
    reason = failed.read_text()[-300:] if failed.exists() else None
    return out, json.loads((out / "results.json").read_text()), reason


def _run(job: dict) -> dict:
    out, res, failed = run_or_read(job["config"])
    accs = [r["test-accuracy"] for r in res["rounds"]]
    hist = res.get("strategy-history", [])
    # head-round=true: the last row is the head round, the one before it the last training round's global model
    head = bool(hist) and "head-round" in (hist[-1].get("fusion-info") or {})
    return {**{k: job[k] for k in ("label", "dataset", "alpha", "seed", "clients", "per-round")}, "final": accs[-1], "best": max(accs),
            "failed": failed,
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
    cells = sorted({(r["dataset"], r["alpha"], _fed(r)) for r in rows})
    for ds, alpha, fed in cells:
        ref = stock.get((ds, alpha)) if fed == (10, 10) else None   # the anchors: 10 clients, all sampled
        where = f"{ds} α={alpha}" + ("" if fed == (10, 10) else f", {fed[1]} of {fed[0]} clients per round")
        if ref is not None:
            lines.append(f"| {where} | stock Flower FedAvg (anchors) | {' / '.join(f'{v:.3f}' for v in ref)} | "
                         f"{_mean_std(ref)} | |")
        for label in strategies:
            got = sorted((r for r in rows if (r["dataset"], r["alpha"], _fed(r), r["label"]) == (ds, alpha, fed, label)),
                         key=lambda r: r["seed"])
            if not got:
                continue
            finals = [r["final"] for r in got]
            diff = f"{100 * (statistics.mean(finals) - statistics.mean(ref)):+.1f} points" if ref else ""
            if all(r.get("before-head") is not None for r in got):   # head-round=true: the model before it too
                before = [r["before-head"] for r in got]
                bdiff = f"{100 * (statistics.mean(before) - statistics.mean(ref)):+.1f} points" if ref else ""
                lines.append(f"| {where} | fedfuse `{label}`, before the head round | "
                             f"{' / '.join(f'{v:.3f}' for v in before)} | {_mean_std(before)} | {bdiff} |")
            dead = sum(1 for r in got if r.get("failed"))   # runs fedfuse failed: the model died (chance level)
            lines.append(f"| {where} | fedfuse `{label}` | {' / '.join(f'{v:.3f}' for v in finals)} | "
                         f"{_mean_std(finals)}{f' (†{dead} died)' if dead else ''} | {diff} |")
    return "\n".join(lines) + "\n"


def _fed(r: dict) -> tuple[int, int]:
    """``(clients, sampled per round)`` of a run (runs recorded before 20-client cells existed: 10 of 10)."""
    return r.get("clients", 10), r.get("per-round", 10)


def _regime_rows(dirs: list[Path]) -> list[dict]:
    rows = [r for d in dirs for r in json.loads((Path(d) / "runs.json").read_text())]
    for r in rows:
        name, extra = parse_strategy(r["label"])
        rest = " ".join(f"{k}={v}" for k, v in extra.items() if k not in ("local-epochs", "lr"))
        r["name"] = f"{name}[{rest}]" if rest else name
        r["E"] = int(extra.get("local-epochs", 1))
        r["R"] = len(r["curve"]) - 1 - (r.get("before-head") is not None)   # training rounds: not the head round
        r["lr"] = float(extra.get("lr", 0.2))   # the anchor recipe's lr unless overridden
    return rows


def regime_heatmap(dirs: list[Path], path: Path, names: list[str], reference: str = "fedavg",
                   metric: str = "final") -> None:
    """One panel per strategy in ``names``: mean gain over ``reference`` (points, same split, seed, cell and client
    lr) by E × R (columns) and α / federation (rows). Where a cell was run at several client lrs, the lr at which
    the strategy has the most seeds against the reference, then the reference's best one (the table lists
    ``reference`` at every lr, so its best honest setting stays visible)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = _regime_rows(dirs)
    budgets = sorted({(r["E"], r["R"]) for r in rows})
    ys = sorted({(r["alpha"], _fed(r)) for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(1.0 + 0.9 * len(budgets) * len(names), 0.6 + 0.45 * len(ys)),
                             squeeze=False)
    for ax, n in zip(axes[0], names):
        grid = np.full((len(ys), len(budgets)), np.nan)
        for i, (a, fed) in enumerate(ys):
            for j, (e, rr) in enumerate(budgets):
                here = [r for r in rows if (r["alpha"], _fed(r), r["E"], r["R"]) == (a, fed, e, rr)]
                per_lr = []
                for lr in {r["lr"] for r in here}:
                    ref = {r["seed"]: _score(r, metric) for r in here if r["name"] == reference and r["lr"] == lr}
                    gains = [100 * (_score(r, metric) - ref[r["seed"]]) for r in here
                             if r["name"] == n and r["lr"] == lr and r["seed"] in ref]
                    if gains:
                        per_lr.append((len(gains), statistics.mean(ref.values()), statistics.mean(gains)))
                if per_lr:
                    grid[i, j] = max(per_lr)[2]
                    ax.text(j, i, f"{grid[i, j]:+.1f}", ha="center", va="center", fontsize=8)
        ax.imshow(grid, cmap="RdYlGn", vmin=-10, vmax=10, aspect="auto")
        ax.set_xticks(range(len(budgets)), [f"{e}×{rr}" for e, rr in budgets], fontsize=7)
        ax.set_yticks(range(len(ys)), [f"α={a:g} {m}/{k}" for a, (k, m) in ys], fontsize=7)
        ax.set_title(f"{n} − {reference}", fontsize=8)
    fig.suptitle(f"gain over {reference} at the same client lr, points ({metric}; E × R = local epochs × rounds)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _score(r: dict, metric: str) -> float:
    """A run's final test accuracy: ``"final"`` = after the head round when it ran, ``"trained"`` = the last
    training round's global model (before the head round)."""
    return r["before-head"] if metric == "trained" and r.get("before-head") is not None else r["final"]


def _where(cell: tuple) -> str:
    alpha, e, rr, lr, (k, m) = cell
    return f"| {alpha:g} | {m}/{k} | {e} × {rr} ({lr:g}) |"


def regime_summary(dirs: list[Path], reference: str = "fedavg", metric: str = "final") -> str:
    """Gain over ``reference`` (same split, seed, federation, E and R), mean ± sample std in points, per
    (α, clients sampled/total, E, R) cell and strategy, from the ``runs.json`` of several anchor-cell output folders;
    ``metric`` as in ``_score``."""
    rows = _regime_rows(dirs)
    cells = sorted({_cell(r) for r in rows})
    names = sorted({r["name"] for r in rows} - {reference})
    lines = [f"| α | clients | E × R (lr) | {reference} ({metric}) | " + " | ".join(f"`{n}` gain" for n in names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for key in cells:
        ref = {r["seed"]: _score(r, metric) for r in rows if _cell(r) == key and r["name"] == reference}
        if not ref:
            continue
        cols = []
        for n in names:
            gains = [100 * (_score(r, metric) - ref[r["seed"]]) for r in rows
                     if _cell(r) == key and r["name"] == n and r["seed"] in ref]
            cols.append(_gain(gains))
        lines.append(f"{_where(key)} {_mean_std(list(ref.values()))} | " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n\n" + _speed_table(rows, cells, names, reference, metric)


def _cell(r: dict) -> tuple:
    return r["alpha"], r["E"], r["R"], r["lr"], _fed(r)


def _rounds_to(curve: list[float], target: float) -> int | None:
    """The first round (1-based; the curve's entry 0 is the initial model) at or above ``target``."""
    return next((i for i, a in enumerate(curve) if i > 0 and a >= target - 1e-9), None)


def _speed_table(rows: list[dict], cells, names: list[str], reference: str, metric: str = "final") -> str:
    """Per cell and strategy: rounds to reach ``reference``'s final accuracy (same seed; ``>R`` when never; the
    training rounds' curve) and the aggregation time as a fraction of the round's local training (runs that recorded
    round times; the head round excluded)."""
    lines = ["| α | clients | E × R (lr) | strategy | rounds to reach FedAvg's final (per seed) | "
             "aggregation / local training |", "|---|---|---|---|---|---|"]
    for key in cells:
        rr = key[2]
        ref = {r["seed"]: _score(r, metric) for r in rows if _cell(r) == key and r["name"] == reference}
        for n in [reference] + names:
            got = sorted((r for r in rows if _cell(r) == key and r["name"] == n and r["seed"] in ref),
                         key=lambda r: r["seed"])
            if not got:
                continue
            reach = [_rounds_to(r["curve"][:rr + 1], ref[r["seed"]]) for r in got]
            fracs = []
            for r in got:
                rs = [x for x in (r.get("round-seconds") or [])[:rr] if x is not None]
                fs = (r.get("fusion-seconds") or [])[:rr]
                if rs and len(rs) == len(fs) and sum(rs) > sum(fs):
                    fracs.append(sum(fs) / (sum(rs) - sum(fs)))
            frac = f"{100 * statistics.mean(fracs):.0f} %" if fracs else "not recorded"
            lines.append(f"{_where(key)} `{n}` | {' / '.join(str(x) if x else f'>{rr}' for x in reach)} | {frac} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default="fedavg,average,fedavgm")
    ap.add_argument("--dataset", default="mnist1d", choices=sorted(DATASET))
    ap.add_argument("--alphas", default="0.1,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--anchors", default=str(ANCHORS))
    ap.add_argument("--clients", type=int, default=10, help="clients in the federation (10: the anchors' splits)")
    ap.add_argument("--per-round", type=int, default=0, help="clients sampled per round (0: all)")
    ap.add_argument("--public", default="", help="fusion pool file (default: the anchors' <dataset>-public.npz); "
                    "'clients': the unlabeled union of each split's client inputs (digits ships no disjoint pool)")
    ap.add_argument("--splits", help="folder of anchor_splits output (<dataset>-c<K>-a<α>-s<seed>) for --clients != 10")
    ap.add_argument("--metric", default="final", choices=("final", "trained"),
                    help="with --summary: after the head round (final) or the last training round's model (trained)")
    ap.add_argument("--out", default=str(ROOT / "results" / "anchor"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--summary", nargs="+", help="only print the gain-over-FedAvg table of these output folders")
    ap.add_argument("--reference", default="fedavg", help="with --summary: the row every gain is measured against "
                    "(its name with its non-lr overrides, e.g. 'fedavg[momentum=0]')")
    ap.add_argument("--plot", help="with --summary: write the gain heat map (one panel per --plot-strategies) here")
    ap.add_argument("--plot-strategies", default="average,feddf,auto")
    args = ap.parse_args(argv)
    if args.summary:
        print(regime_summary([Path(d) for d in args.summary], reference=args.reference, metric=args.metric))
        if args.plot:
            regime_heatmap([Path(d) for d in args.summary], Path(args.plot), split_strategies(args.plot_strategies),
                           metric=args.metric)
        return
    if args.clients != 10 and not args.splits:
        ap.error("--clients other than 10 needs --splits (made by simulations.bench.anchor_splits)")
    anchors, out = Path(args.anchors), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    public = anchors / "splits" / f"{args.dataset}-public.npz"
    if args.public not in ("", "clients"):
        public = Path(args.public)
    if args.public != "clients" and not public.exists():
        ap.error(f"--public: no fusion pool {public}; the anchors ship one for mnist1d only (--public clients: the "
                 "union of the split's client inputs)")
    strategies = split_strategies(args.strategies)
    jobs = []
    for alpha in [float(a) for a in args.alphas.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            split = (Path(args.splits) / f"{args.dataset}-c{args.clients}-a{alpha:g}-s{seed}" if args.splits
                     else anchors / "splits" / f"{args.dataset}-a{alpha:g}-s{seed}")
            per_round = args.per_round or args.clients
            for label in strategies:
                name, extra = parse_strategy(label)
                pool = client_pool(split, out / "pools") if args.public == "clients" else public
                cfg = {**anchor_recipe(split, pool, args.dataset, seed, args.rounds, args.clients, per_round),
                       "strategy": name, **extra, "output-dir": str(out / "runs"),
                       "run-name": f"{label}-{args.dataset}-c{args.clients}-a{alpha:g}-s{seed}"}
                jobs.append({"label": label, "dataset": args.dataset, "alpha": alpha, "seed": seed,
                             "clients": args.clients, "per-round": per_round, "config": cfg})
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = []
        for row in pool.map(_run, jobs):
            rows.append(row)
            print(f"{row['label']:>24} {row['dataset']} α={row['alpha']} s{row['seed']}: final {row['final']:.3f} "
                  f"best {row['best']:.3f}", flush=True)
    previous = json.loads((out / "runs.json").read_text()) if (out / "runs.json").exists() else []
    keep = [r for r in previous if (r["label"], r["dataset"], r["alpha"], r["seed"], _fed(r))
            not in {(j["label"], j["dataset"], j["alpha"], j["seed"], (j["clients"], j["per-round"])) for j in jobs}]
    rows = keep + rows
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    labels = list(dict.fromkeys([r["label"] for r in rows]))
    text = table(rows, stock_flower(anchors / "README.md"), labels)
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
