"""Table of ``simulations/bench/od_draw.sh``: per width-tier cell, the global model and every tier's final accuracy
(mean ± sample std over the cell's seeds) of the ordered-dropout-draw rows next to the committed rows of
``results/tiers/<cell>`` (the default, HeteroFL, FedRolex, FedDF, the no-OD ablation); whether each row is above the
three baselines on the global model and on every tier (means), as ``tiers_summary``'s goal column.

    .venv/bin/python -m simulations.bench.od_draw OUT [--committed results/tiers]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BASELINES = ("heterofl", "fedrolex", "feddf")


def group_runs(runs: list[dict]) -> dict[str, list[dict]]:
    """``{strategy label: its runs}`` of a sweep's runs, leaving out the runs with no final accuracy (failed)."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        if r.get("final-accuracy") is not None:
            out.setdefault(r["strategy"], []).append(r)
    return out


def _rows(path: Path) -> dict[str, list[dict]]:
    return group_runs(json.loads(path.read_text())) if path.exists() else {}


def _ms(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def cell_table(name: str, committed: Path, new: Path) -> str:
    rows = _rows(committed / name / "sweep.json")
    rows.update(_rows(new / name / "sweep.json"))
    tiers = sorted({t for rs in rows.values() for r in rs for t in (r.get("final-tier-accuracy") or {})},
                   key=float, reverse=True)

    def means(rs):
        g = statistics.mean(r["final-accuracy"] for r in rs)
        return g, {t: statistics.mean(r["final-tier-accuracy"][t] for r in rs) for t in tiers
                   if all(t in (r.get("final-tier-accuracy") or {}) for r in rs)}

    base = {b: means(rows[b]) for b in BASELINES if b in rows}
    lines = [f"\n### {name}\n", "| row | seeds | global | " + " | ".join(f"tier {t}" for t in tiers)
             + " | above HeteroFL, FedRolex, FedDF (global and every tier) |",
             "|---|---|---|" + "---|" * len(tiers) + "---|"]
    for s, rs in rows.items():
        if not s.startswith("average") and s not in BASELINES:
            continue
        g, t = means(rs)
        above = "" if s in BASELINES else (
            "yes" if all(g > bg and all(t.get(k, 0) > bt.get(k, 0) for k in bt) for bg, bt in base.values())
            else "no")
        lines.append(f"| {s} | {len(rs)} | {_ms([r['final-accuracy'] for r in rs])} | "
                     + " | ".join(_ms([r['final-tier-accuracy'][k] for r in rs if k in (r.get('final-tier-accuracy') or {})])
                                  for k in tiers) + f" | {above} |")
    return "\n".join(lines) + "\n"


def _above(rows: dict[str, list[dict]], row: str) -> tuple[bool, float | None]:
    """(above the three baselines on the global model and every tier, smallest tier − FedAvg at the smallest width)
    for ``row`` of a cell (means)."""
    def means(rs):
        tiers = set.intersection(*(set(r.get("final-tier-accuracy") or {}) for r in rs))
        return (statistics.mean(r["final-accuracy"] for r in rs),
                {t: statistics.mean(r["final-tier-accuracy"][t] for r in rs) for t in tiers})

    g, t = means(rows[row])
    ok = all(g > bg and all(t.get(k, 0) > v for k, v in bt.items())
             for bg, bt in (means(rows[b]) for b in BASELINES if b in rows))
    small = min(t, key=float)
    fedavg = [r for s, rs in rows.items() if s.startswith("fedavg[model-width") for r in rs]
    gain = 100 * (t[small] - statistics.mean(r["final-accuracy"] for r in fedavg)) if fedavg else None
    return ok, gain


def goal_table(cells: list[str], rows_of, rows_shown: list[str], heading) -> str:
    """Per cell (``rows_of(cell)``: its rows by strategy) and per row of ``rows_shown`` (titled ``heading(row)``):
    above the three baselines on the global model and every tier / smallest tier − FedAvg at the smallest width,
    and how many cells each row passes."""
    lines = ["| cell | " + " | ".join(heading(r) for r in rows_shown) + " |", "|---|" + "---|" * len(rows_shown)]
    wins = {r: 0 for r in rows_shown}
    for cell in cells:
        rows = rows_of(cell)
        parts = []
        for r in rows_shown:
            if r not in rows:
                parts.append("—")
                continue
            ok, gain = _above(rows, r)
            wins[r] += ok
            parts.append(("yes" if ok else "no") + ("" if gain is None else f" / {gain:+.1f} pts"))
        lines.append(f"| {cell} | " + " | ".join(parts) + " |")
    lines.append("| **cells above the 3 baselines** | " + " | ".join(f"**{wins[r]} of {len(cells)}**" for r in rows_shown)
                 + " |")
    return "\n".join(lines) + "\n"


def summary(cells: list[str], committed: Path, new: Path, rows_shown: list[str]) -> str:
    return goal_table(cells, lambda c: {**_rows(committed / c / "sweep.json"), **_rows(new / c / "sweep.json")},
                      rows_shown, lambda r: f"{r}: above the 3 baselines / smallest tier − FedAvg at it")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--committed", default="results/tiers")
    a = ap.parse_args(argv)
    out = Path(a.out)
    text = ("Ordered dropout's width draw (`ordered-dropout-draw`): final test accuracy, "
            "mean ± sample std over the cell's seeds; rows without `[...]` are the committed runs of "
            f"`{a.committed}` (same configs and seeds). Command: `bash simulations/bench/od_draw.sh {a.out} CELL...`, "
            f"then `.venv/bin/python -m simulations.bench.od_draw {a.out}`.\n")
    cells = sorted(p.parent.name for p in out.glob("*/sweep.json"))
    text += "\n" + summary(cells, Path(a.committed), out,
                           ["average", "average[ordered-dropout-draw='width']", "average[ordered-dropout-draw='0.75']",
                            "average[ordered-dropout-draw='0.9']"])
    for cell in cells:
        text += cell_table(cell, Path(a.committed), out)
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
