"""Table of ``simulations/bench/tiers_head.sh``: the width-tier cells with the head round (every tier's classifier
solved from every node's statistics) for the default ``average`` and for every baseline, next to the same rows
without it (``results/tiers``, ``results/tiers-od-draw``: the same run configs and seeds before the head round
took width tiers). Per cell the global model and every tier's final accuracy (mean ± sample std over the seeds);
the goal column as ``tiers_summary``'s: the default above HeteroFL, FedRolex and FedDF on the global model and on
every tier (means), and its smallest tier − FedAvg at the smallest width (both with the head round).

    .venv/bin/python -m simulations.bench.tiers_head OUT [--before results/tiers --before-default results/tiers-od-draw]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from simulations.bench.od_draw import BASELINES, _ms, _rows, goal_table, group_runs, summary

BEFORE_DEFAULT = "average[ordered-dropout-draw='width']"   # the default before, as results/tiers-od-draw names it


# FedDF (B at the cell's lr, G at lr 0.05 and 0.1), the default's variants (C; E, F: the sandwich rule; H: the
# head-solver), the default and the other rows
LANES = ("B", "G", "C", "E", "F", "H", "A")


STRIP = ""   # --strip: a run-config override every row of OUT carries, read as if it were the default


def relabel(label: str, strip: str | None = None) -> str:
    """``label`` without the override ``strip`` (``--strip``): ``average[head-solver='best']`` → ``average``,
    ``feddf[lr=0.1 head-solver='best']`` → ``feddf[lr=0.1]``."""
    strip = STRIP if strip is None else strip
    if not strip:
        return label
    out = label.replace(" " + strip, "").replace(strip, "")
    return out[:-2] if out.endswith("[]") else out


def _runs(path: Path) -> list[dict]:
    """The runs of a ``sweep.json``, their strategy labels without ``STRIP``."""
    return [{**r, "strategy": relabel(r["strategy"])} for r in json.loads(path.read_text())] if path.exists() else []


def best_lr(rows: dict[str, list[dict]], name: str) -> str | None:
    """The label of ``name``'s row at its best lr: among ``name`` (the cell's lr) and ``name[lr=…]``, the one whose
    global model has the highest mean (a run that trained itself to chance has no final accuracy: it is not a
    candidate); ``None`` when there is none."""
    labels = [s for s in rows if s == name or (s.startswith(f"{name}[lr=") and s.endswith("]"))]
    return max(labels, key=lambda s: statistics.mean(r["final-accuracy"] for r in rows[s]), default=None)


def _new_rows(out: Path, name: str, *, best: bool = True) -> dict[str, list[dict]]:
    """A cell's rows by strategy over every lane; with ``best``, each baseline is its row at its best lr (under the
    baseline's own name: the goal reads it there)."""
    rows: dict[str, list[dict]] = {}
    for lane in LANES:   # a label in several lanes keeps all their runs
        for label, runs in group_runs(_runs(out / lane / name / "sweep.json")).items():
            rows.setdefault(label, []).extend(runs)
    if best:
        for b in BASELINES:
            label = best_lr(rows, b)
            if label is not None:
                rows[b] = rows[label]
    return rows


def _lr_note(out: Path, cell: str, name: str) -> str:
    """`` (lr 0.05)`` when ``name``'s best row is not at the cell's lr, and how many of its runs ended with a model
    when some did not (trained to chance)."""
    rows = _new_rows(out, cell, best=False)
    label = best_lr(rows, name)
    if label is None:
        return ""
    runs = [r for lane in LANES for r in _runs(out / lane / cell / "sweep.json") if r["strategy"] == label]
    notes = ([] if label == name else [label[len(name) + 1:-1].replace("=", " ")]) + (
        [f"{len(rows[label])} of {len(runs)} seeds, the others trained to chance"] if len(runs) > len(rows[label])
        else [])
    return f" ({'; '.join(notes)})" if notes else ""


def head_summary(cells: list[str], out: Path) -> str:
    """Per cell and per ``average`` row (the default and its variants): above the three baselines (all with the
    head round) on the global model and every tier / smallest tier − FedAvg at the smallest width."""
    shown = sorted({s for c in cells for s in _new_rows(out, c) if s.startswith("average")}, key=len)
    return goal_table(cells, lambda c: _new_rows(out, c), shown, lambda r: f"`{r}`")


def _global_small(rs: list[dict]) -> str:
    """``global / smallest tier`` (means) of a row's runs."""
    if not rs:
        return "—"
    tiers = set.intersection(*(set(r.get("final-tier-accuracy") or {}) for r in rs))
    g = statistics.mean(r["final-accuracy"] for r in rs)
    if not tiers:
        return f"{g:.3f}"
    small = min(tiers, key=float)
    return f"{g:.3f} / {statistics.mean(r['final-tier-accuracy'][small] for r in rs):.3f}"


def _failed(out: Path, cell: str, strategy: str) -> str:
    """A row whose every run failed (e.g. trained to chance: the run's own check): say so, with the reason."""
    for lane in LANES:
        path = out / lane / cell / "sweep.json"
        runs = [r for r in _runs(path) if r["strategy"] == strategy]
        if runs:
            return f"failed ({len(runs)} of {len(runs)}: trained to chance)" if all(
                "dead" in str(r.get("error", "")) for r in runs) else f"failed ({len(runs)} runs)"
    return "—"


def compact(cells: list[str], out: Path, before_default: Path) -> str:
    """One line per cell: the global model / the smallest tier (means) of the default and every baseline with the
    head round, FedAvg at the smallest width, and the default without the head round."""
    head = ["average", *BASELINES]
    lines = ["| cell | " + " | ".join(f"`{s}`" for s in head) + " | FedAvg at the smallest width | "
             "`average`, no head round |", "|---|" + "---|" * (len(head) + 2)]
    for cell in cells:
        rows = _new_rows(out, cell)
        fedavg = [r for s, rs in rows.items() if s.startswith("fedavg[model-width") for r in rs]
        old = _rows(before_default / cell / "sweep.json").get(BEFORE_DEFAULT, [])
        lines.append(f"| {cell} | " + " | ".join(_global_small(rows[s]) + _lr_note(out, cell, s) if s in rows
                                                 else _failed(out, cell, s) for s in head)
                     + f" | {_global_small(fedavg)} | {_global_small(old)} |")
    return "\n".join(lines) + "\n"


def cell_table(name: str, out: Path, before: Path, before_default: Path) -> str:
    new = _new_rows(out, name, best=False)
    old = _rows(before / name / "sweep.json")
    old_default = _rows(before_default / name / "sweep.json").get(BEFORE_DEFAULT, [])
    variants = sorted((s for s in new if s.startswith("average[")), key=len)
    lr_rows = sorted((s for s in new for b in BASELINES if s.startswith(f"{b}[lr=")), key=len)
    shown = [(f"**{s} + head round**" if s == "average" else f"{s} + head round", new[s])
             for s in ("average", *variants, *BASELINES, *lr_rows) if s in new]
    shown += [("average, no head round (the default before)", old_default)] if old_default else []
    shown += [(f"{s}, no head round", old[s]) for s in BASELINES if s in old]
    tiers = sorted({t for _, rs in shown for r in rs for t in (r.get("final-tier-accuracy") or {})}, key=float,
                   reverse=True)
    lines = [f"\n### {name}\n", "| row | seeds | global | " + " | ".join(f"tier {t}" for t in tiers) + " |",
             "|---|---|---|" + "---|" * len(tiers)]
    for label, rs in shown:
        cells = [_ms([r["final-tier-accuracy"][t] for r in rs if t in (r.get("final-tier-accuracy") or {})])
                 for t in tiers]
        lines.append(f"| {label} | {len(rs)} | {_ms([r['final-accuracy'] for r in rs])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--before", default="results/tiers")
    ap.add_argument("--before-default", default="results/tiers-od-draw")
    ap.add_argument("--strip", default="", help="a run-config override every row of OUT carries (e.g. "
                    "\"head-solver='best'\"): rows are read as if it were the default")
    a = ap.parse_args(argv)
    global STRIP
    STRIP = a.strip
    out, before, before_default = Path(a.out), Path(a.before), Path(a.before_default)
    cells = sorted(p.parent.name for p in (out / "A").glob("*/sweep.json"))
    text = ("The head round with width tiers: final test accuracy, mean ± sample std over the cell's seeds; "
            "10 clients, 30 rounds, the run configs of `results/tiers/<cell>`. Command: `bash "
            f"simulations/bench/tiers_head.sh A {a.out}` and `... B {a.out}` (FedDF), `ROWS=\"feddf[lr=0.05],"
            f"feddf[lr=0.1]\" ... G {a.out} CELL...` (FedDF at two more lrs; each baseline is read at its best lr), "
            "then "
            f"`.venv/bin/python -m simulations.bench.tiers_head {a.out}`.\n\n")
    if STRIP:
        text += (f"Every row of this folder ran with `{STRIP}` (its lanes' rows: the default, HeteroFL, FedRolex and "
                 "the FedAvg rows in A; FedDF at its best lr of `results/tiers-head` in B); the labels below leave it "
                 f"out. Table: `.venv/bin/python -m simulations.bench.tiers_head {a.out} --strip \"{STRIP}\"`.\n\n")
    text += (
            "## The default above HeteroFL, FedRolex and FedDF (global and every tier) / its smallest tier − FedAvg "
            "at the smallest width\n\nWith the head round (every row getting it):\n\n")
    text += head_summary(cells, out)
    text += f"\nWithout it (`{a.before}`, `{a.before_default}`; the default then: `{BEFORE_DEFAULT}`):\n\n"
    text += summary(cells, before, before_default, [BEFORE_DEFAULT])
    text += ("\n## Global model / smallest tier (means), every row with the head round\n\n"
             + compact(cells, out, before_default))
    text += "\n## Every cell\n"
    for cell in cells:
        text += cell_table(cell, out, before, before_default)
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
