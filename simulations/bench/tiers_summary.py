"""Capacity-tier benchmark summary: every cell folder of a tier sweep root in two tables, with the issue's goals.

    python -m simulations.bench.tiers_summary --root results/tiers

A cell is a folder ``<root>/<cell>/sweep.json`` written by ``fedfuse.flower.runner.sweep`` (its own ``tiers.md``
has every column); folder names say the cell: ``<dataset>-<model>-a<alpha>-t<tiers>`` (multi-round) and
``oneshot-<dataset>-<model>-a<alpha>`` (one round, clients trained independently). Writes ``summary.md``.

Multi-round table: per cell and strategy, the final test accuracy of the global model / the smallest tier's
model (mean over seeds), and the goal checks: is fedfuse's default (``average``) above HeteroFL, FedRolex and
FedDF on the global model **and** every tier (means), and its smallest tier minus "everyone at the smallest
tier" FedAvg. One-shot table: the global model's accuracy (mean ± sample std) next to the best client, the
client ensemble and KD.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from simulations.bench.stats import format_mean_std, mean_std
from fedfuse.flower.runner.sweep import epoch_ratios, render

MULTI = [("average", "average (default)"), ("average[ordered-dropout='off']", "average, no OD"),
         ("heterofl", "HeteroFL"), ("fedrolex", "FedRolex"), ("feddf", "FedDF"),
         ("heterofl[ordered-dropout='all']", "HeteroFL + OD (FjORD-style)"),
         ("fedavg[model-width", "FedAvg at the smallest width"), ("fedavg[client-tiers=''", "FedAvg, full-width clients only")]
BASELINES = ("heterofl", "fedrolex", "feddf")
ONESHOT = ["heterofl", "kd", "feddf", "kf-linear", "kf-linear[refine='distill']",
           "kf-linear[ordered-dropout='all' refine='distill']", "kf-gradient", "kf-gradient[refine='distill']",
           "ot", "ot[refine='distill']", "kf-linear[tier-models='fuse' refine='distill']",
           "kf-gradient[tier-models='fuse' refine='distill']"]
# the default one-shot fusion row of a cell: kf-linear (the ViT cells: kf-gradient; kf-linear takes no blocks)
ONESHOT_DEFAULT = ("kf-linear", "kf-gradient")   # as these cells ran (the ViT default is feddf since the head round)


def _label_rows(rows: list[dict], key: str) -> list[dict]:
    """Finished rows of a strategy label (a ``fedavg[...`` key matches by prefix: its width differs per cell)."""
    ok = [r for r in rows if "final-accuracy" in r]
    if key.startswith("fedavg["):
        return [r for r in ok if r["strategy"].startswith(key)]
    return [r for r in ok if r["strategy"] == key]


def _tier_means(rows: list[dict]) -> dict[str, float]:
    """Mean over seeds of every model's final accuracy: ``"global"`` and each tier (``as-tier`` for no-tier runs)."""
    out: dict[str, list[float]] = {"global": [r["final-accuracy"] for r in rows]}
    for r in rows:
        for t, a in (r.get("final-tier-accuracy") or {}).items():
            out.setdefault(t, []).append(a)
        if r.get("as-tier"):
            out.setdefault(r["as-tier"], []).append(r["final-accuracy"])
    return {k: mean_std(v)[0] for k, v in out.items()}


def multi_round(cells: dict[str, list[dict]]) -> str:
    head = ("| cell | " + " | ".join(name for _, name in MULTI) +
            " | default above the 3 baselines, global and every tier | default's smallest tier − FedAvg at it |"
            " default's aggregation per largest-tier local epoch |\n|---" + "|---" * (len(MULTI) + 3) + "|\n")
    lines = []
    for cell, rows in cells.items():
        tiers = sorted({t for r in rows for t in (r.get("final-tier-accuracy") or {})}, key=float)
        small = tiers[0] if tiers else None
        cols, means = [], {}
        for key, _ in MULTI:
            sel = _label_rows(rows, key)
            means[key] = _tier_means(sel) if sel else {}
            m = means[key]
            if not sel:
                cols.append("—")
            elif key.startswith("fedavg[model-width"):
                cols.append(f"— / {m.get(small, float('nan')):.3f}")
            elif key.startswith("fedavg[client-tiers"):
                cols.append(f"{m['global']:.3f} / —")
            else:
                cols.append(f"{m['global']:.3f} / {m.get(small, float('nan')):.3f}")
        d = means.get("average") or {}
        base = [means[b] for b in BASELINES if means.get(b)]
        if d and base:
            wins = all(d.get(k, -1) > b.get(k, 2) for b in base for k in ["global", *tiers])
            check = ("yes" if wins else "no") + f" (vs {', '.join(b for b in BASELINES if means.get(b))})"
        else:
            check = "—"
        fa = means.get("fedavg[model-width") or {}
        gap = f"{100 * (d[small] - fa[small]):+.1f} pts" if d and fa and small in d and small in fa else "—"
        ratios = []
        for r in _label_rows(rows, "average"):
            v = epoch_ratios(r)
            if v:
                ratios.append(sorted(v)[len(v) // 2])
        ep = f"{sum(ratios) / len(ratios):.1f}×" if ratios else "—"
        lines.append(f"| {cell} | " + " | ".join(cols) + f" | {check} | {gap} | {ep} |")
    return head + "\n".join(lines) + "\n"


def one_shot(cells: dict[str, list[dict]]) -> str:
    present = [k for k in ONESHOT if any(_label_rows(rows, k) for rows in cells.values())]
    head = ("| cell | best client | ensemble | " + " | ".join(present) +
            " | default (kf-linear; ViT: kf-gradient) − max(best client, KD) | best fusion row − max(best client, KD) |"
            "\n|---|---|---" + "|---" * (len(present) + 2) + "|\n")
    lines = []
    for cell, rows in cells.items():
        any_rows = [r for r in rows if "final-accuracy" in r and r["strategy"] == "heterofl"] or \
            [r for r in rows if "final-accuracy" in r]
        seeds: dict[int, dict] = {}
        for r in any_rows:
            seeds.setdefault(r["seed"], r)
        best = [r.get("best-client-accuracy") for r in seeds.values()]
        ens = [r.get("ensemble-accuracy") for r in seeds.values()]
        cols = [format_mean_std(best, scale=100), format_mean_std(ens, scale=100)]
        means = {}
        for k in present:
            sel = _label_rows(rows, k)
            cols.append(format_mean_std([r["final-accuracy"] for r in sel], scale=100) if sel else "—")
            means[k] = mean_std([r["final-accuracy"] for r in sel])[0] if sel else float("nan")
        fused = [means[k] for k in present if k.startswith(("kf-", "ot")) and means[k] == means[k]]
        ref = max(mean_std(best)[0], means.get("kd", float("nan")))
        default = next((means[k] for k in ONESHOT_DEFAULT if means.get(k, float("nan")) == means.get(k)), None)
        gap_default = f"{100 * (default - ref):+.1f} pts" if default is not None and ref == ref else "—"
        gap = f"{100 * (max(fused) - ref):+.1f} pts" if fused and ref == ref else "—"
        lines.append(f"| {cell} | " + " | ".join(cols) + f" | {gap_default} | {gap} |")
    return head + "\n".join(lines) + "\n"


ORDER = ["heterofl", "fedrolex", "feddf", "average", "average[ordered-dropout='off']",
         "heterofl[ordered-dropout='all']"] + ONESHOT[1:]
RUN_KEYS_NOT_CELL = ("strategy", "partitioning", "seed", "run-name", "output-dir")


def cell_labels(rows: list[dict]) -> list[str]:
    """The cell's strategy labels, baselines first (``ORDER``), then the rest in order of appearance."""
    seen = list(dict.fromkeys(r["strategy"] for r in rows))
    return sorted(seen, key=lambda s: (ORDER.index(s) if s in ORDER else len(ORDER), seen.index(s)))


def cell_run_config(rows: list[dict]) -> str:
    """The run config the cell's rows share (a heterofl row's, else the first), as ``--run-config`` text."""
    row = next((r for r in rows if r["strategy"] == "heterofl"), rows[0])
    cfg = {k: v for k, v in (row.get("run-config") or {}).items() if k not in RUN_KEYS_NOT_CELL}
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in cfg.items())


def render_cells(root: Path) -> None:
    """Rewrite every cell's ``table.md`` / ``tiers.md`` / plots from its whole ``sweep.json`` (a sweep renders only
    the strategies it ran: the FedDF pass alone, the extra seeds alone)."""
    for p in sorted(root.glob("*/sweep.json")):
        rows = json.loads(p.read_text())
        if rows:
            render(rows, cell_labels(rows), ["dirichlet"], "fedavg", p.parent, cell_run_config(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench.tiers_summary", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="results/tiers")
    ap.add_argument("--render", action="store_true", help="first re-render every cell's own tables from sweep.json")
    ap.add_argument("--oneshot-note", default=(
        "Measured at 9983f46, where one-shot `refine='auto'` meant distillation; labels are the final code's "
        "(`kf-linear` = calibration, the default; `[refine='distill']` rows = that run's default)."),
        help="the line under the one-shot table's title (how and when its cells ran)")
    args = ap.parse_args(argv)
    root = Path(args.root)
    if args.render:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):   # render prints every table
            render_cells(root)
    cells = {p.parent.name: json.loads(p.read_text()) for p in sorted(root.glob("*/sweep.json"))
             if not p.parent.name.startswith("explore")}
    multi = {k: v for k, v in cells.items() if not k.startswith("oneshot")}
    shot = {k: v for k, v in cells.items() if k.startswith("oneshot")}
    text = ("# Capacity tiers: summary of every cell\n\n"
            "10 clients, Dirichlet partitions, 3 seeds; each cell's own `tiers.md` has every tier, mean ± sample std "
            "(ddof 1), MB per round and timings; its `README.md`/`table.md` the run config. Rerun: "
            "`results/tiers/queue.sh`; this file: `python -m simulations.bench.tiers_summary --root results/tiers`.\n\n"
            "## Multi-round (30 rounds): final accuracy, global / smallest tier (mean over seeds)\n\n"
            "OD = FjORD's ordered dropout in local training (`ordered-dropout`; on by default for `average`). The "
            "goal columns compare means.\n\n" + multi_round(multi) +
            "\n## One-shot (one round; clients trained independently, tiers 1/0.5/0.25): global model test accuracy %\n\n"
            f"{args.oneshot_note}\n\n" + one_shot(shot))
    (root / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
