"""``simulations.bench.fmnist_tiers``' table: the raw runs (git-ignored) and the tracked ``runs.json`` merged, so a
fresh clone that reruns one row keeps every other row's evidence."""

from __future__ import annotations

import json
from types import SimpleNamespace

from simulations.bench.fmnist_tiers import collect, table


def _row(strategy, seed, acc, tiers=None):
    return {"strategy": strategy, "seed": seed, "status": "completed", "error": None, "seconds": 10.0,
            "final-accuracy": acc, "final-tier-accuracy": tiers, "as-tier": None,
            "accuracy-per-round": [0.1, 0.3, acc], "tier-accuracy-per-round": None,
            "run-config": {"num-server-rounds": 2, "local-epochs": 1, "optimizer": "adam", "lr": 0.003}}


def test_table_keeps_tracked_rows_and_lets_a_raw_run_replace_its_own(tmp_path):
    tracked = [{"cell": "wd3-a0.5", **_row("average", s, 0.6 + s / 100, {"1x1": 0.6, "0.5x0.5": 0.5})}
               for s in (0, 1)] + [{"cell": "wd3-a0.5", **_row("depthfl", 0, 0.7, {"1x1": 0.7, "0.5x0.5": 0.4})}]
    (tmp_path / "runs.json").write_text(json.dumps(tracked))
    raw = tmp_path / "runs" / "wd3-a0.5" / "s1"
    raw.mkdir(parents=True)
    (raw / "sweep.json").write_text(json.dumps([_row("average", 1, 0.65, {"1x1": 0.65, "0.5x0.5": 0.55}),
                                                _row("depthfl", 1, 0.72, {"1x1": 0.72, "0.5x0.5": 0.45})]))
    rows = {(r["strategy"], r["seed"]): r for r in collect(tmp_path)}
    assert set(rows) == {("average", 0), ("average", 1), ("depthfl", 0), ("depthfl", 1)}
    assert rows["average", 1]["final-accuracy"] == 0.65 and rows["average", 0]["final-accuracy"] == 0.6
    table(SimpleNamespace(out=str(tmp_path)))
    text = (tmp_path / "table.md").read_text()
    assert "| `average` | 2 / 2 | 0.625 ± 0.035 |" in text and "| `depthfl` | 2 / 2 | 0.710 ± 0.014 |" in text
    assert len(json.loads((tmp_path / "runs.json").read_text())) == 4
