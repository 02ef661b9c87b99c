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


def _rows(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    if path.exists():
        for r in json.loads(path.read_text()):
            if r.get("final-accuracy") is not None:
                out.setdefault(r["strategy"], []).append(r)
    return out


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
    for cell in sorted(p.parent.name for p in out.glob("*/sweep.json")):
        text += cell_table(cell, Path(a.committed), out)
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
