"""The sweep's capacity-tier table (issue 13): sweep-only keys, per-tier columns, timing ratio."""

import pytest

from fedfuse.config import ConfigError
from fedfuse.flower.runner.sweep import aggregation_seconds, parse_strategy, sweep_keys, tier_table


def test_sweep_only_keys_are_popped_and_checked():
    _, extra = parse_strategy("fedavg[model-width=64 sweep-partitions='0,3' sweep-as-tier=0.25]")
    assert sweep_keys(extra) == ([0, 3], "0.25") and extra == {"model-width": 64}
    assert sweep_keys({}) == (None, None)
    with pytest.raises(ConfigError, match="sweep-partitions"):
        sweep_keys({"sweep-partitions": "0,0"})
    with pytest.raises(ConfigError, match="sweep-as-tier"):
        sweep_keys({"sweep-as-tier": 2})
    # a width x depth tier, named as the depth-tier runs name theirs
    _, extra = parse_strategy("fedavg[model-width=8 model-depth=2 sweep-as-tier='0.5x0.5']")
    assert sweep_keys(extra) == (None, "0.5x0.5")
    with pytest.raises(ConfigError, match="sweep-as-tier"):
        sweep_keys({"sweep-as-tier": "0.5x2"})


def _row(strategy, seed, acc, tiers=None, secs=(1.0, 1.0), as_tier=None, nbytes=None):
    row = {"strategy": strategy, "partitioning": "dirichlet", "seed": seed, "final-accuracy": acc,
           "accuracy-per-round": [0.1, acc], "fusion-seconds": list(secs), "tier-derivation-seconds": [None, 0.5]}
    if tiers:
        row["final-tier-accuracy"] = tiers
        row["tier-bytes-sent"] = {"1": 4e6, "0.5": 1e6}
    if as_tier:
        row["as-tier"], row["tier-bytes-sent"] = as_tier, {"all": nbytes}
    return row


def test_tier_table_columns_and_ratio():
    rows = [_row("heterofl", s, 0.4, {"1": 0.4, "0.5": 0.3 + s / 100}, secs=(1.0, 1.0)) for s in (0, 1)]
    rows += [_row("kf-linear", s, 0.5, {"1": 0.5, "0.5": 0.45}, secs=(3.0, 3.0)) for s in (0, 1)]
    rows += [_row("fedavg", s, 0.2, as_tier="0.5", nbytes=2e6) for s in (0, 1)]
    assert aggregation_seconds(rows[0]) == [1.0, 1.5]
    text = tier_table(rows, ["heterofl", "kf-linear", "fedavg"], "dirichlet")
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines() if ln.startswith("| ")}
    assert "tier 1 | tier 0.5 |" in lines["strategy"]
    assert "0.305 ± 0.007" in lines["heterofl"] and "1.0×" in lines["heterofl"]
    assert "2.6×" in lines["kf-linear"]          # median (3.0 + 3.5) / 2 = 3.25 vs 1.25
    assert "| — | 0.200 ± 0.000 |" in lines["fedavg"] and "— / 2.000" in lines["fedavg"]


def test_depth_tier_names_order_and_time_the_largest_tier(tmp_path):
    """Width x depth tier labels ('1x1', '1x0.5', '0.5x0.5') sort as tiers and the deepest, widest one is the
    yardstick of a round's epoch (a sweep over depth tiers used to fail reading '1x1' as a number)."""
    from fedfuse.flower.runner.sweep import tier_fields

    results = {"config": {"local-epochs": 2}, "rounds": [
        {"round": 0}, {"round": 1, "tier-accuracy": {"1x1": 0.6, "1x0.5": 0.4, "0.5x0.5": 0.3},
                       "tier-train-seconds": {"0.5x0.5": 1.0, "1x1": 4.0, "1x0.5": 2.0}, "fusion-seconds": 0.1}]}
    out = tier_fields(results, tmp_path)
    assert out["largest-tier-epoch-seconds"] == [2.0] and out["final-tier-accuracy"]["1x1"] == 0.6
    rows = [_row("average", s, 0.6, {"1x1": 0.6, "1x0.5": 0.4, "0.5x0.5": 0.3 + s / 100}) for s in (0, 1)]
    rows += [_row("fedavg", s, 0.35, as_tier="0.5x0.5", nbytes=1e6) for s in (0, 1)]
    header = next(ln for ln in tier_table(rows, ["average", "fedavg"], "dirichlet").splitlines()
                  if ln.startswith("| strategy"))
    assert header.index("tier 1x1") < header.index("tier 1x0.5") < header.index("tier 0.5x0.5")
