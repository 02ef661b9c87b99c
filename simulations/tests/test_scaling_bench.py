"""The scaling benchmark's core (``simulations.bench.scaling.run_scaling``) on 3 and 6 tiny clients: the
output structure, the real reply contract (every constructed reply accepted), the table and the plot.
No timing asserts (the machine is shared)."""

import math

import numpy as np
import pytest
import torch

from simulations.bench.scaling import (ScalingSetup, fit_growth, label_skewed_indices, render_table, plot,
                                       run_scaling)

STRATEGIES = ("fedavg", "average", "feddf", "kf-linear")


@pytest.fixture(scope="module")
def result():
    gen = torch.Generator().manual_seed(0)
    classes = 4
    pool_y = torch.arange(160) % classes
    # class-dependent means so local training moves the clients apart
    pool_x = torch.randn(160, 1, 12, generator=gen) + pool_y.float().view(-1, 1, 1)
    fusion_x = torch.randn(24, 1, 12, generator=gen)
    setup = ScalingSetup(width=8, depth=1, shard_size=16, val_size=8, warmup_epochs=1, warmup_size=40,
                         importance="uniform", repeats=1, lr=0.05)
    return run_scaling(pool_x, pool_y, fusion_x, classes, client_counts=(6, 3), strategies=STRATEGIES[1:],
                       setup=setup, memory=True)


def test_rows_cover_every_strategy_and_count(result):
    assert result["clients"] == [3, 6]                       # sorted
    assert result["strategies"] == list(STRATEGIES)          # fedavg added as the baseline
    keys = {(r["strategy"], r["clients"]) for r in result["rows"]}
    assert keys == {(s, n) for s in STRATEGIES for n in (3, 6)}
    for r in result["rows"]:
        assert r["valid"] == r["clients"]                    # every constructed reply met the contract
        assert r["fallback"] is None
        for k in ("wall", "cpu", "x-fedavg", "x-local-epoch", "x-local-epoch-cpu", "fusion-seconds"):
            assert math.isfinite(r[k]) and r[k] >= 0, (k, r)
        assert 0.0 <= r["validation-share"] <= 1.0
        assert set(r["memory"]) == {"rss-peak-delta", "tracemalloc-peak", "retained-after-round", "torch-peak"}
        assert r["memory"]["tracemalloc-peak"] > 0
        assert r["client-scores"] == (r["strategy"] == "kf-linear")
    fedavg = [r for r in result["rows"] if r["strategy"] == "fedavg"]
    assert all(r["x-fedavg"] == pytest.approx(1.0) for r in fedavg)
    # the default refine of a fusion strategy ran (calibrate); FedDF distilled
    average = next(r for r in result["rows"] if r["strategy"] == "average")
    assert average["fusion-info"]["refine"] == "calibrate"
    assert "distill-epochs" in next(r for r in result["rows"] if r["strategy"] == "feddf")["fusion-info"]


def test_growth_and_report(result, tmp_path):
    assert set(result["growth"]) == set(STRATEGIES)
    for g in result["growth"].values():
        for k in ("slope", "intercept", "exponent", "slope-local-epochs", "cpu-exponent", "clients-at-one-epoch",
                  "tracemalloc-bytes-per-client", "torch-bytes-per-client", "retained-bytes-per-client"):
            assert k in g
    # the strategy keeps every round's updates: more clients, more retained memory
    # kf-linear keeps every round's updates: more clients, more retained memory; the streamed average keeps none
    kept = {(r["strategy"], r["clients"]): r["memory"]["retained-after-round"] for r in result["rows"]}
    assert kept[("kf-linear", 6)] > kept[("kf-linear", 3)]
    assert kept[("average", 6)] - kept[("average", 3)] < kept[("kf-linear", 6)] - kept[("kf-linear", 3)]
    assert all(r["streamed"] == (r["strategy"] in ("fedavg", "average")) for r in result["rows"])
    text = render_table(result, "python -m simulations.bench.scaling --test")
    for name in STRATEGIES:
        assert f"| {name} |" in text
    assert "Growth with the number of clients" in text and "Server memory per round" in text
    plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_fit_growth_and_skewed_shards():
    fit = fit_growth([10, 50, 200], [1.0 + 0.01 * n for n in (10, 50, 200)])
    assert fit["slope"] == pytest.approx(0.01) and fit["intercept"] == pytest.approx(1.0)
    assert fit_growth([10, 100], [1.0, 100.0])["exponent"] == pytest.approx(2.0)
    labels = np.repeat(np.arange(10), 50)
    idx = label_skewed_indices(labels, 10, 40, 0.1, np.random.default_rng(0))
    assert len(idx) == 40 and len(set(idx.tolist())) == 40
    assert np.bincount(labels[idx], minlength=10).max() >= 10  # α = 0.1: a few classes dominate
