"""Warm start benchmark: multi-round FL from the clients' fused own models against FedAvg from scratch, from the best
client's model and from their plain average, on the anchor splits (issue 23, item 5).

The cross-silo case: every client (institution) already has a model of the shared architecture, trained on its own
data from its own initialisation (here: ``warm-start-epochs`` local epochs, ``warm-start-lr``). Rows, every one a
run of fedfuse's ServerApp and ClientApp (in-process engine) on the anchor's client splits with the anchor's client
recipe (``simulations.bench.anchor_cell.anchor_recipe``: MLP 256×2, SGD momentum 0.9, batch 32, E = 1, 10 clients,
``val-fraction=0``, a 300-sample fusion set from the public pool):

- ``fedavg scratch``: FedAvg from a fresh initialisation at the anchor's lr (the reference: its final accuracy
  is the target), and at the lr of the other rows;
- ``fedavg from best client``: FedAvg started (``initial-model-path``) from the client model with the best *test*
  accuracy (an oracle: no server could pick it so; an upper bound for "start from one institution's model");
- ``fedavg from average``: FedAvg started from the clients' sample-weighted plain average;
- ``warm <fusion> → <strategy>``: ``mode='warm-start'``: round 1 fuses the clients' models with ``<fusion>``,
  rounds 2.. run ``<strategy>`` from the fused model.

The client models behind the best-client and average rows are the ones the first warm-start run of the same split
trained in its round 1 (``<run>/warm-start/client-<p>.pt``; the clients' seeds make every warm-start run of a split
train the same models). Round numbers: a run's own (a warm-start run's round 1 is its fusion round); ``epochs`` is
the cumulative local epochs per client at a round, counting the ``warm-start-epochs`` that made the clients' models
for every row that uses them.

Writes ``runs.json`` (every run's accuracy curve; runs already there are skipped, so an interrupted benchmark
continues), ``table.md`` and ``accuracy.png`` (mean test accuracy per round and row).

    .venv/bin/python -m simulations.bench.warm_start --out results/warm-start
    .venv/bin/python -m simulations.bench.warm_start --alphas 0.1 --seeds 0 --rounds 5 --out /tmp/ws   # smoke
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

from simulations.bench.anchor_cell import ANCHORS, anchor_recipe  # noqa: E402
from fedfuse.flower.runner.console import format_mean_std  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Row:
    """One benchmark row: its label, run-config overrides and the model it starts from (``scratch``,
    ``best-client``, ``average``; ``warm`` for a warm-start run)."""

    label: str
    start: str
    overrides: dict = field(default_factory=dict)


def rows(lr: float, warm_epochs: int, warm_lr: float) -> list[Row]:
    """The benchmark's rows (warm-start rows first: they train the client models the started rows reuse)."""
    warm = {"mode": "warm-start", "warm-start-epochs": warm_epochs, "warm-start-lr": warm_lr, "lr": lr}
    return [
        Row("warm kf-linear → fedavg", "warm", {**warm, "strategy": "fedavg", "warm-start-fusion": "kf-linear"}),
        Row("warm kf-linear → average", "warm", {**warm, "strategy": "average", "warm-start-fusion": "kf-linear"}),
        Row("warm ot → fedavg", "warm", {**warm, "strategy": "fedavg", "warm-start-fusion": "ot",
                                        "warm-start-fusion-options": ""}),
        Row("warm feddf → fedavg", "warm", {**warm, "strategy": "fedavg", "warm-start-fusion": "feddf",
                                           "warm-start-fusion-options": ""}),
        Row("fedavg scratch (anchor lr 0.2)", "scratch", {"strategy": "fedavg"}),
        Row(same_lr_reference(lr), "scratch", {"strategy": "fedavg", "lr": lr}),
        Row("fedavg from best client (oracle)", "best-client", {"strategy": "fedavg", "lr": lr}),
        Row("fedavg from average", "average", {"strategy": "fedavg", "lr": lr}),
        # the lr checks: the anchor's lr from a trained start, and a warm start at twice the rows' lr
        Row("fedavg from best client (oracle; anchor lr 0.2)", "best-client", {"strategy": "fedavg"}),
        Row(f"warm kf-linear → average (lr {2 * lr:g})", "warm", {**warm, "lr": 2 * lr, "strategy": "average",
                                                                   "warm-start-fusion": "kf-linear"}),
    ]


REFERENCE = "fedavg scratch (anchor lr 0.2)"


def same_lr_reference(lr: float) -> str:
    """The FedAvg-from-scratch row at the lr of the other rows (the fair target: same client recipe)."""
    return f"fedavg scratch (lr {lr:g})"


def start_models(warm_run: Path, split: Path, out: Path) -> dict[str, Path]:
    """The best client's model (by test accuracy: the oracle) and the clients' sample-weighted average, written from
    the client models of ``warm_run``'s round 1; ``{start: path}``."""
    import numpy as np
    import torch

    from fedfuse.fusion import fuse
    from fedfuse.models import build_model

    res = json.loads((warm_run / "results.json").read_text())
    first = next(r for r in res["rounds"] if r["round"] == 1)
    pids, accs = first["client-partition-ids"], first["client-test-accuracy"]
    states = {p: torch.load(warm_run / "warm-start" / f"client-{p}.pt", weights_only=True) for p in pids}
    counts = [len(np.load(split / f"node-{p}.npz")["y_train"]) for p in pids]
    models = []
    for p in pids:
        m = build_model("mlp", num_classes=10, input_shape=(40,), width=256, depth=2, seed=0)
        m.load_state_dict(states[p])
        models.append(m)
    out.mkdir(parents=True, exist_ok=True)
    best = pids[max(range(len(pids)), key=lambda i: accs[i])]
    torch.save(states[best], out / "best-client.pt")
    torch.save(fuse("average", models, weights=counts).state_dict(), out / "average.pt")
    return {"best-client": out / "best-client.pt", "average": out / "average.pt"}


def run_row(row: Row, base: dict, out: Path, starts: dict[str, Path]) -> dict:
    """Run one row on one split; its record (curve, cumulative epochs, guarded / fell-back rounds)."""
    from fedfuse.flower.runner.inprocess import run_inprocess

    cfg = {**base, **row.overrides, "output-dir": str(out.parent), "run-name": out.name}
    if row.start in starts:
        cfg["initial-model-path"] = str(starts[row.start])
    res = json.loads((run_inprocess(cfg, echo=False) / "results.json").read_text())
    curve = [r["test-accuracy"] for r in res["rounds"]]
    warm_e = int(cfg.get("warm-start-epochs", 20))
    e = int(cfg["local-epochs"])
    if row.start == "warm":
        epochs = [0] + [warm_e + (r - 1) * e for r in range(1, len(curve))]
    elif row.start == "scratch":
        epochs = [r * e for r in range(len(curve))]
    else:   # the started model cost the clients their warm-start epochs
        epochs = [warm_e + r * e for r in range(len(curve))]
    hist = res.get("strategy-history", [])
    return {"label": row.label, "curve": curve, "epochs": epochs,
            "guarded": sum(1 for h in hist if h.get("guard")), "fell-back": sum(1 for h in hist if h.get("fallback")),
            "fusion-info": (hist[0].get("fusion-info") or {}).get("auto-choice") if hist else None}


def reach(curve: list[float], target: float) -> int | None:
    """The first round whose accuracy is at least ``target`` (``None``: never)."""
    return next((r for r, a in enumerate(curve) if a >= target), None)


def _reach_cells(got: list[dict], target: dict[int, float], rounds: int) -> str:
    """``reach (rounds) | never | epochs at reach`` of ``got`` against per-seed ``target`` accuracies."""
    hits = [reach(r["curve"], target[r["seed"]]) if r["seed"] in target else None for r in got]
    reached = [h if h is not None else rounds + 1 for h in hits]
    epochs = [r["epochs"][h] for r, h in zip(got, hits) if h is not None]
    return (f"{format_mean_std(reached, digits=1)} | {sum(h is None for h in hits)} | "
            f"{format_mean_std(epochs, digits=1) if epochs else '—'}")


def table(runs: list[dict], rounds: int, lr: float) -> str:
    """Per α and row: accuracy at rounds 0 (the start), 1, 5, 10 and the last (mean ± sample std over seeds); rounds to
    reach the final accuracy of FedAvg from scratch of the same seed, at the anchor's lr (``REFERENCE``) and at the
    rows' lr (never = rounds + 1, counted in the mean and said how often), and the cumulative local epochs there."""
    marks = [r for r in (0, 1, 5, 10, rounds) if r <= rounds]
    head = ("| α | row | seeds | " + " | ".join(f"round {r}" for r in marks) +
            " | reach anchor-lr FedAvg | never | epochs there | reach same-lr FedAvg | never | epochs there |")
    lines = [head, "|---|---|---|" + "---|" * (len(marks) + 6)]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    for alpha in sorted({r["alpha"] for r in runs}):
        targets = [{r["seed"]: r["curve"][-1] for r in runs if r["alpha"] == alpha and r["label"] == ref}
                   for ref in (REFERENCE, same_lr_reference(lr))]
        for label in labels:
            got = sorted((r for r in runs if r["alpha"] == alpha and r["label"] == label), key=lambda r: r["seed"])
            if not got:
                continue
            accs = [format_mean_std([r["curve"][m] for r in got if len(r["curve"]) > m], digits=3) for m in marks]
            lines.append(f"| {alpha:g} | {label} | {len(got)} | " + " | ".join(accs) + " | " +
                         " | ".join(_reach_cells(got, t, rounds) for t in targets) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    """Mean test accuracy per round, one line per row, one panel per α."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    alphas = sorted({r["alpha"] for r in runs})
    fig, axes = plt.subplots(1, len(alphas), figsize=(6.5 * len(alphas), 4.5), squeeze=False)
    for ax, alpha in zip(axes[0], alphas):
        for label in dict.fromkeys(r["label"] for r in runs):
            curves = [r["curve"] for r in runs if r["alpha"] == alpha and r["label"] == label]
            if curves:
                n = min(len(c) for c in curves)
                ax.plot(range(n), np.mean([c[:n] for c in curves], axis=0), label=f"{label} ({len(curves)} seeds)",
                        ls="-" if "warm" in label else "--")
        ax.set(title=f"MNIST-1D anchor splits, α={alpha:g}", xlabel="round", ylabel="test accuracy (mean)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", default="0.1,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.05, help="client lr of every row but the anchor-lr reference")
    ap.add_argument("--warm-epochs", type=int, default=20)
    ap.add_argument("--warm-lr", type=float, default=0.02)
    ap.add_argument("--rows", default="", help="comma-separated labels to run (default: all)")
    ap.add_argument("--anchors", default=str(ANCHORS))
    ap.add_argument("--out", default=str(ROOT / "results" / "warm-start"))
    ap.add_argument("--table", action="store_true", help="only rewrite table.md and accuracy.png from runs.json")
    args = ap.parse_args(argv)
    out, splits = Path(args.out).resolve(), Path(args.anchors) / "splits"
    out.mkdir(parents=True, exist_ok=True)
    store = out / "runs.json"
    runs = json.loads(store.read_text()) if store.exists() else []
    if args.table:
        return _write(runs, out, args)
    chosen = [r for r in rows(args.lr, args.warm_epochs, args.warm_lr)
              if not args.rows or r.label in args.rows.split(",")]
    for alpha in [float(a) for a in args.alphas.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            split = splits / f"mnist1d-a{alpha:g}-s{seed}"
            base = anchor_recipe(split, splits / "mnist1d-public.npz", "mnist1d", seed, args.rounds)
            cell = out / "runs" / f"a{alpha:g}-s{seed}"
            starts: dict[str, Path] = {}
            for row in chosen:
                name = row.label.replace(" ", "_").replace("→", "to").replace("(", "").replace(")", "")
                done = any((r["alpha"], r["seed"], r["label"]) == (alpha, seed, row.label) for r in runs)
                if row.start in ("best-client", "average") and not starts:
                    warm_run = next(cell.glob("warm_*"), None)
                    if warm_run is None:
                        raise SystemExit(f"{row.label}: no warm-start run in {cell} to take the client models from")
                    starts = start_models(warm_run, split, cell / "starts")
                if done:
                    continue
                rec = {"alpha": alpha, "seed": seed, **run_row(row, base, cell / name, starts)}
                runs.append(rec)
                store.write_text(json.dumps(runs, indent=1))
                print(f"α={alpha:g} seed={seed} {row.label}: round 1 {rec['curve'][1]:.3f}, final {rec['curve'][-1]:.3f}",
                      flush=True)
    _write(runs, out, args)


def _write(runs: list[dict], out: Path, args: argparse.Namespace) -> None:
    if not runs:
        raise SystemExit(f"no runs in {out / 'runs.json'}: nothing to tabulate")
    text = table(runs, args.rounds, args.lr)
    (out / "table.md").write_text(text)
    plot(runs, out / "accuracy.png")
    print(text)


if __name__ == "__main__":
    main()
