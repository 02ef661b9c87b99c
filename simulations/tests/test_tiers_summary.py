"""The capacity-tier summary (simulations.bench.tiers_summary) and the sweep's per-epoch aggregation ratio."""

import json

from simulations.bench import tiers_summary
from fedfuse.flower.runner.sweep import epoch_ratios, tier_fields


def _row(strategy, seed, glob, tiers, **kw):
    return {"strategy": strategy, "partitioning": "dirichlet", "seed": seed, "final-accuracy": glob,
            "final-tier-accuracy": tiers, **kw}


def test_summary_checks_the_goals_on_means(tmp_path):
    cell = tmp_path / "mnist1d-mlp-a0.1-t1-05-025"
    cell.mkdir()
    rows = []
    for s in (0, 1):
        rows += [_row("average", s, 0.5, {"1": 0.5, "0.5": 0.55, "0.25": 0.50},
                      **{"fusion-seconds": [0.02, 0.02], "tier-derivation-seconds": [0.01, 0.01],
                         "largest-tier-epoch-seconds": [0.01, 0.01]}),
                 _row("heterofl", s, 0.4, {"1": 0.4, "0.5": 0.45, "0.25": 0.30}),
                 _row("fedrolex", s, 0.45, {"1": 0.45, "0.5": 0.56, "0.25": 0.30}),   # beats average on tier 0.5
                 {"strategy": "fedavg[model-width=64 client-tiers='' sweep-as-tier=0.25]", "partitioning": "dirichlet",
                  "seed": s, "final-accuracy": 0.42, "as-tier": "0.25"}]
    (cell / "sweep.json").write_text(json.dumps(rows))
    shot = tmp_path / "oneshot-digits-mlp-a0.5"
    shot.mkdir()
    (shot / "sweep.json").write_text(json.dumps([
        _row("heterofl", 0, 0.2, {"1": 0.2}, **{"best-client-accuracy": 0.6, "ensemble-accuracy": 0.9}),
        _row("kd", 0, 0.8, {"1": 0.8}), _row("kf-linear", 0, 0.85, {"1": 0.85})]))
    assert tiers_summary.main(["--root", str(tmp_path)]) == 0
    text = (tmp_path / "summary.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("| mnist1d-mlp"))
    assert "0.500 / 0.500" in line and "no (vs heterofl, fedrolex)" in line    # fedrolex's tier 0.5 is higher
    assert "+8.0 pts" in line and "3.0×" in line                              # 0.50 − 0.42; (0.02+0.01)/0.01
    shot_line = next(ln for ln in text.splitlines() if ln.startswith("| oneshot-digits"))
    assert "| 60.0 | 90.0 |" in shot_line and "| +5.0 pts | +5.0 pts |" in shot_line   # 85 − max(60, 80)


def test_largest_tier_epoch_seconds_from_the_round_records(tmp_path):
    results = {"config": {"local-epochs": 2}, "rounds": [
        {"round": 0, "tier-accuracy": {"1": 0.1, "0.5": 0.1}},
        {"round": 1, "tier-accuracy": {"1": 0.3, "0.5": 0.2}, "fusion-seconds": 0.04,
         "tier-train-seconds": {"1": 0.02, "0.5": 0.01}}]}
    row = tier_fields(results, tmp_path)
    assert row["largest-tier-epoch-seconds"] == [0.01]                 # the widest tier's 0.02 s / 2 epochs
    assert epoch_ratios(row) == [0.04 / 0.01]
