"""Differential privacy as run configuration (fedfuse.flower.trust.privacy) and the private head round (fedfuse.privacy)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from fedfuse.config import ConfigError, dp_strategy, parse_run_config
from fedfuse.privacy import (HEAD_SENSITIVITY, check_bounded, clip_rows, feature_clip_bound, noisy_head_sum,
                             private_head_statistics, public_projection, raw_feature_head)
from fedfuse.progressive import HeadStatistics, head_statistics, solve_classifier, with_head

TINY = {"dataset": "digits", "model": "mlp", "model-width": 32, "model-depth": 1, "num-clients": 5,
        "partitioning": "iid", "num-server-rounds": 2, "local-epochs": 2, "lr": 0.05, "fusion-set-size": 150,
        "min-train-nodes": 5}


def _model(seed: int = 0, scale: float = 1.0) -> nn.Sequential:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():
        m[1].weight.mul_(scale)
    return m.eval()


def _data(n: int = 300, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + 2.0 * nn.functional.one_hot(y, 8).float()
    return x, y


# ------------------------------------------------------------------------------------------------------- core
@pytest.mark.parametrize("scale", [1.0, 1e6])
def test_a_clients_private_statistics_are_bounded_whatever_its_data(scale):
    """‖Ā‖_F ≤ 2 and ‖B̄‖_F ≤ √2 for any model scale and any sample count: one client moves the pair by ≤ √6."""
    for n in (1, 7, 300):
        x, y = _data(n)
        s = private_head_statistics(_model(scale=scale), x, y, 3, clip=1.0)
        assert s.num_examples == 1
        assert float(s.gram.norm()) <= 2 + 1e-9 and float(s.cross.norm()) <= math.sqrt(2) + 1e-9
        assert math.hypot(float(s.gram.norm()), float(s.cross.norm())) <= HEAD_SENSITIVITY + 1e-9
        check_bounded(s)
        assert float(s.cross[-1].sum()) == pytest.approx(1.0)


def test_inflated_or_raw_statistics_are_rejected_not_noised():
    x, y = _data()
    raw = head_statistics(_model(), x, y, 3)
    with pytest.raises(ValueError, match="count the client as 1"):
        check_bounded(raw)
    s = private_head_statistics(_model(), x, y, 3, clip=1.0)
    gram = s.gram * 5
    gram[-1, -1] = 1.0
    big = HeadStatistics(gram, s.cross, 1)
    with pytest.raises(ValueError, match="exceed their bound"):
        noisy_head_sum([s, big], 1.0)


def test_clip_rows_bounds_every_row_and_keeps_short_ones():
    f = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64)
    u = clip_rows(f, 1.0)
    assert u.norm(dim=1).tolist() == pytest.approx([1.0, 0.5, 0.0])
    with pytest.raises(ValueError, match="clip"):
        clip_rows(f, 0.0)


def test_with_vanishing_noise_the_private_head_classifies_as_the_clients_mean_statistics_do():
    """σ → 0: the noised sum is the plain sum of the bounded statistics, and the head (back on the raw features)
    predicts what a head solved on the clipped, scaled features predicts."""
    model = _model()
    parts = [_data(200, seed=s) for s in range(4)]
    clip = 1e6   # nothing clipped
    stats = [private_head_statistics(model, x, y, 3, clip) for x, y in parts]
    noisy = noisy_head_sum(stats, 1e-9, torch.Generator().manual_seed(0))
    assert noisy.num_examples == 4
    head = raw_feature_head(solve_classifier([noisy], "ridge", ridge=1e-6), clip)
    exact = solve_classifier([HeadStatistics(sum(s.gram for s in stats), sum(s.cross for s in stats), 4)], "ridge",
                             ridge=1e-6)
    x, _ = _data(500, seed=9)
    feats = model[:-1](x)
    raw = with_head(_model(), head)(x).argmax(1)
    scaled = exact(feats / clip).argmax(1)
    assert float((raw == scaled).float().mean()) > 0.98


def test_a_public_projection_keeps_the_head_exact_on_its_subspace():
    """Features that live in the projection's subspace: the head solved on the k projected features and mapped back
    (``raw_feature_head``) gives the same logits on the raw features."""
    model = _model()
    x, y = _data(400)
    proj = public_projection(model, x, 4)
    assert proj.shape == (16, 4) and torch.allclose(proj.T @ proj, torch.eye(4, dtype=proj.dtype), atol=1e-8)
    assert public_projection(model, x, 0) is None and public_projection(model, x, 16) is None
    clip = 1e6
    s = private_head_statistics(model, x, y, 3, clip, projection=proj)
    assert s.gram.shape == (5, 5)
    small = solve_classifier([HeadStatistics(s.gram * 1, s.cross, 1)], "ridge", ridge=1e-9)
    raw = raw_feature_head(small, clip, proj)
    feats = model[:-1](x).double()
    expected = small((feats @ proj / clip).float())
    assert torch.allclose(raw(feats.float()), expected, atol=1e-4)


def test_noise_scales_with_the_multiplier_and_is_seeded():
    x, y = _data()
    s = [private_head_statistics(_model(), x, y, 3, clip=1.0)]
    a = noisy_head_sum(s, 1.0, torch.Generator().manual_seed(3))
    b = noisy_head_sum(s, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(a.cross, b.cross)
    gap_small = float((noisy_head_sum(s, 0.01, torch.Generator().manual_seed(1)).cross - s[0].cross).norm())
    gap_large = float((noisy_head_sum(s, 10.0, torch.Generator().manual_seed(1)).cross - s[0].cross).norm())
    assert gap_large == pytest.approx(1000 * gap_small, rel=1e-6)
    assert bool((torch.linalg.eigvalsh(a.gram) > -1e-9).all())   # projected onto the PSD cone


def test_the_clip_bound_comes_from_the_servers_inputs():
    model = _model()
    x, _ = _data(101)
    bound = feature_clip_bound(model, x)
    assert bound == pytest.approx(float(model[:-1](x).norm(dim=1).median()), rel=1e-6)
    with pytest.raises(ValueError, match="server-side inputs"):
        feature_clip_bound(model, x[:0])


# ------------------------------------------------------------------------------------------------ accounting
def test_the_account_composes_releases_and_stops_before_the_budget():
    from fedfuse.flower.trust.privacy import PrivacyAccount, PrivacyBudgetError, noise_for_epsilon

    account = PrivacyAccount(10, 1e-5)
    assert account.epsilon == 0.0
    e1 = account.spend(1.0, 10, "round 1")
    e2 = account.spend(1.0, 10, "round 2")
    assert 0 < e1 < e2
    limited = PrivacyAccount(10, 1e-5, max_epsilon=e1 * 1.01)
    limited.spend(1.0, 10, "round 1")
    with pytest.raises(PrivacyBudgetError, match="dp-options.max-epsilon"):
        limited.spend(1.0, 10, "round 2")
    assert len(limited.releases) == 1
    sigma = noise_for_epsilon(4.0, 1e-5)
    check = PrivacyAccount(10, 1e-5)
    check.spend(sigma, 10, "one")
    assert check.epsilon == pytest.approx(4.0, rel=1e-3)


# ----------------------------------------------------------------------------------------------------- config
def test_dp_keys_are_checked_before_any_client_trains():
    with pytest.raises(ConfigError, match="'dp-options.clipping-norm' applies to differentially private runs"):
        parse_run_config({"dp-clipping-norm": 1.0})
    with pytest.raises(ConfigError, match="'dp-options.clipping-norm' must be > 0"):
        parse_run_config({"dp-noise-multiplier": 1.0})
    dp = {"dp-noise-multiplier": 1.0, "dp-clipping-norm": 1.0}
    with pytest.raises(ConfigError, match="'strategy'.*kf-linear"):
        parse_run_config({**dp, "strategy": "kf-linear"})
    with pytest.raises(ConfigError, match="'strategy'.*auto-fusion-epochs"):
        parse_run_config({**dp, "local-epochs": 10})
    with pytest.raises(ConfigError, match="'strategy'"):
        parse_run_config({**dp, "strategy": "fedmedian"})
    with pytest.raises(ConfigError, match="'robust'"):
        parse_run_config({**dp, "strategy": "fedavg", "robust": True})
    with pytest.raises(ConfigError, match="'evaluation'"):
        parse_run_config({**dp, "strategy": "fedavg", "evaluation": "both"})
    with pytest.raises(ConfigError, match="'client-tiers'"):
        parse_run_config({**dp, "strategy": "fedavg", "client-tiers": "1,0.5"})
    with pytest.raises(ConfigError, match="'mode'"):
        parse_run_config({**dp, "strategy": "fedavg", "mode": "one-shot", "num-server-rounds": 1})
    with pytest.raises(ConfigError, match="dp-options.clipping"):
        parse_run_config({**dp, "dp-clipping": "node"})
    # the defaults run: 'auto' below auto-fusion-epochs is fedavg exactly
    cfg = parse_run_config(dp)
    assert cfg.strategy == "auto" and dp_strategy(cfg) == "fedavg"
    for name in ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi"):
        assert dp_strategy(parse_run_config({**dp, "strategy": name})) == name
    # plain-SGD clients: auto takes the momentum step, under DP Flower's FedAvgM at auto's momentum
    from fedfuse.flower.trust.privacy import private_config

    cross = parse_run_config({**dp, "optimizer": "sgd", "momentum": 0.0, "fraction-train": 0.5})
    assert dp_strategy(cross) == "fedavgm"
    run, _ = private_config(cross)
    assert run.strategy == "fedavgm" and run.server_momentum == 0.5


# ---------------------------------------------------------------------------------------------- end to end
def test_a_dp_run_is_configuration_its_head_round_is_private_and_epsilon_is_recorded(tmp_path):
    from fedfuse.flower.runner.inprocess import run_inprocess

    out = run_inprocess({**TINY, "dp-noise-multiplier": 0.3, "dp-clipping-norm": 2.0, "output-dir": str(tmp_path),
                         "run-name": "dp"}, echo=False)
    results = json.loads((out / "results.json").read_text())
    privacy = results["privacy"]
    assert privacy["delta"] == 1e-5 and privacy["epsilon"] > 0
    whats = [r["what"] for r in privacy["per-release"]]
    assert whats[:2] == ["round 1", "round 2"] and "head statistics" in whats and "head check" in whats
    assert [r["epsilon"] for r in privacy["per-release"]] == sorted(r["epsilon"] for r in privacy["per-release"])
    assert results["config"]["strategy"] == "fedavg" and results["config"]["report-options.client-references"] is False
    head = next(h for h in results["strategy-history"] if h.get("post-step") == "head-round")
    private = head["fusion-info"]["head-round"]["private"]
    assert private["clip"] > 0 and private["noise-multiplier"] == 0.3 and private["projection"] == 8
    assert not any(k.startswith("client-") for k in results["rounds"][0])


def test_client_side_clipping_runs_through_fedfuses_client_app(tmp_path):
    from fedfuse.flower.runner.inprocess import run_inprocess

    out = run_inprocess({**TINY, "strategy": "fedavg", "head-round": False, "dp-noise-multiplier": 0.01,
                         "dp-clipping-norm": 5.0, "dp-clipping": "client", "output-dir": str(tmp_path),
                         "run-name": "dpc"}, echo=False)
    results = json.loads((out / "results.json").read_text())
    assert results["rounds"][-1]["test-accuracy"] > 0.3 and results["privacy"]["releases"] == 2


def test_flowers_dp_wrapper_around_a_fusion_method_or_with_the_head_round_fails_before_training(tmp_path):
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from fedfuse.flower.runner.inprocess import run_app_inprocess
    from fedfuse.flower.server_app import run_server

    def server(grid, context):
        run_server(grid, context, wrap_strategy=lambda s, _c: DifferentialPrivacyServerSideFixedClipping(
            s, noise_multiplier=0.01, clipping_norm=5.0, num_sampled_clients=5))

    for extra, why in (({"strategy": "kf-linear", "head-round": False}, "'strategy'"),
                       ({"strategy": "fedavg"}, "'head-round'")):
        outcome = run_app_inprocess({**TINY, **extra, "output-dir": str(tmp_path), "run-name": why.strip("'")},
                                    echo=False, server=server)
        assert not outcome.ok and why in outcome.details and "DifferentialPrivacyServerSideFixedClipping" in \
            outcome.details
        results = outcome.out_dir / "results.json"   # nothing trained: no results, or none with a round
        assert not results.exists() or json.loads(results.read_text()).get("rounds", []) == []


@pytest.mark.parametrize("dp", [False, True])
def test_secure_aggregation_sums_the_head_statistics_with_flowers_secaggplus(tmp_path, dp):
    """secure-aggregation=true: the head round's bounded statistics reach the server through Flower's SecAgg+ as
    their sum (with DP: then noised); the solved head is used and recorded."""
    from fedfuse.flower.runner.inprocess import run_inprocess

    extra = {"dp-noise-multiplier": 0.3, "dp-clipping-norm": 2.0} if dp else {"strategy": "fedavg"}
    out = run_inprocess({**TINY, "secure-aggregation": True, **extra, "output-dir": str(tmp_path),
                         "run-name": f"sa{int(dp)}"}, echo=False)
    results = json.loads((out / "results.json").read_text())
    head = next(h for h in results["strategy-history"] if h.get("post-step") == "head-round")["fusion-info"]
    record = head["head-round"]
    assert record["secure-aggregation"] is True and record["valid"] == 5 and record["fallback"] is None
    assert record["private"]["clip"] > 0
    assert ("epsilon" in record["private"]) == dp
    if not dp:   # no noise: the head is the bounded statistics' solution, kept unless the clients score it lower
        assert record["kept"] in ("head", "before") and results["rounds"][-1]["test-accuracy"] > 0.5


def test_secure_aggregation_keys_are_checked():
    with pytest.raises(ConfigError, match="'head-options.secure-aggregation'.*head-round=true"):
        parse_run_config({"secure-aggregation": True, "head-round": False})
    with pytest.raises(ConfigError, match="'head-options.secure-aggregation'.*tiers"):
        parse_run_config({"secure-aggregation": True, "client-tiers": "1,0.5"})
