"""Issue 25: lying clients. The robust setting's screen (``fedfuse.flower.trust.screen``) and a robust run against lying
clients (``tests/support/liars.py``), score inflation through a strategy, the robust strategies' run-config keys and
Flower's differential-privacy wrappers around fedfuse's strategies. The trust benchmark's own threats are tested
with the benchmark."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from fedfuse.config import ConfigError, parse_run_config as check_config
from fedfuse.flower import FusionStrategy
from fedfuse.flower.client_app import make_client_app
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.flower.trust.screen import ClientScreen, agreements, update_norm
from fedfuse.models import build_model, levels
from tests.support.liars import Liar
from tests.support.trust_cases import TINY, strategy_history as _history

SHAPE = (1, 8, 8)


def _mlp(seed: int = 0) -> torch.nn.Module:
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=32, depth=1, seed=seed).eval()


def _moved(model: torch.nn.Module, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """An honest client's model: a shared descent direction (seed 1234) plus its own part (``seed``)."""
    common, own = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(seed)
    return {k: v + scale * (torch.randn(v.shape, generator=common) + torch.randn(v.shape, generator=own))
            for k, v in model.state_dict().items()}


def _inputs(n: int = 200) -> torch.Tensor:
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(5))


def _screen(updates, g, screen=ClientScreen()):
    record: dict = {}

    def build(state):
        m = _mlp()
        m.load_state_dict(state)
        return m.eval()

    kept = screen(updates, g.state_dict(), build, _inputs(), record)
    return kept, record["screened"]


# ------------------------------------------------------------------------------------------- the screen
def test_screen_keeps_honest_clients_and_drops_free_riders_and_outliers():
    g = _mlp()
    gs = g.state_dict()
    honest = [ClientUpdate(i, i, _moved(g, 0.02, i), None, 100, {}) for i in range(6)]
    free_rider = ClientUpdate(10, 10, copy.deepcopy(gs), None, 100, {})
    rand = ClientUpdate(11, 11, _mlp(seed=99).state_dict(), None, 100, {})
    flipped = ClientUpdate(12, 12, {k: 2 * gs[k] - v for k, v in honest[0].state.items()}, None, 100, {})
    kept, info = _screen(honest + [free_rider, rand, flipped], g)
    assert {u.node_id for u in kept} == set(range(6))
    reasons = {d["node-id"]: d["reason"] for d in info["dropped"]}
    assert set(reasons) == {10, 11, 12} and "free rider" in reasons[10]
    assert "above 3 × the round's median" in reasons[11] and "median update" in reasons[12]
    assert set(info["clients"]) == {str(i) for i in (*range(6), 10, 11, 12)}


def test_cosine_mads_widens_the_direction_check_with_the_spread_of_honest_cosines():
    """Issue 45, part 5 (20 clients; an option, off by default): honest non-IID updates whose cosines with the median
    update spread widely, one of them low but positive (0.14 against a median 0.63, below 0.4 × the median). With
    ``cosine_mads=3`` the direction line is the lower of 0.4 × the median cosine and the median − 3 scaled MADs, so
    that client is kept and a sign-flipped update is still dropped; the default (the ratio alone) drops both."""
    g = _mlp()
    gs = g.state_dict()

    def update(c: float, seed: int) -> dict[str, torch.Tensor]:   # c × the shared direction + its own part
        common, own = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(seed)
        return {k: v + 0.02 * (c * torch.randn(v.shape, generator=common) + torch.randn(v.shape, generator=own))
                for k, v in gs.items()}

    honest = [ClientUpdate(i, i, update(c, i), None, 100, {})
              for i, c in enumerate([*np.linspace(0.25, 1.5, 19), 0.12])]
    flipped = ClientUpdate(99, 99, {k: 2 * gs[k] - v for k, v in update(1.0, 99).items()}, None, 100, {})
    kept, info = _screen(honest + [flipped], g, ClientScreen(cosine_mads=3))
    assert {u.node_id for u in kept} == set(range(20))
    assert [d["node-id"] for d in info["dropped"]] == [99] and "scaled MADs" in info["dropped"][0]["reason"]
    kept, info = _screen(honest + [flipped], g)
    assert {d["node-id"] for d in info["dropped"]} == {19, 99}


def test_a_screen_that_would_drop_every_reply_keeps_them_and_says_so():
    g = _mlp()
    honest = [ClientUpdate(i, i, _moved(g, 0.02, i), None, 100, {}) for i in range(4)]
    kept, info = _screen(honest, g, ClientScreen(cosine_ratio=10.0, norm_clip=0))   # no cosine is 10 × the median
    assert info["dropped-all"] and len(info["dropped"]) == 4 and [u.node_id for u in kept] == [0, 1, 2, 3]


def test_the_fusion_set_check_is_an_option():
    g = _mlp()
    honest = [ClientUpdate(i, i, _moved(g, 0.02, i), None, 100, {}) for i in range(6)]
    rand = ClientUpdate(11, 11, _mlp(seed=99).state_dict(), None, 100, {})
    kept, info = _screen(honest + [rand], g, ClientScreen(stale=0, max_norm=0, cosine_ratio=0, agreement_mads=3,
                                                                 norm_clip=0))
    assert [d["node-id"] for d in info["dropped"]] == [11] and "majority vote" in info["dropped"][0]["reason"]
    assert all("agreement" in c for c in info["clients"].values())


def test_screen_bounds_a_scaled_update_and_leaves_a_clean_round_alone():
    g = _mlp()
    honest = [ClientUpdate(i, i, _moved(g, 0.02, i), None, 100, {}) for i in range(5)]
    kept, info = _screen(honest, g)
    assert info["dropped"] == [] and info["clipped"] == []
    assert all(kept[i] is honest[i] for i in range(5))
    gs = g.state_dict()
    scaled = {k: gs[k] + 10 * (v - gs[k]) for k, v in honest[0].state.items()}
    kept, info = _screen(honest[1:] + [ClientUpdate(9, 9, scaled, None, 100, {})], g)
    assert [d["node-id"] for d in info["dropped"]] == [9] and "above 3" in info["dropped"][0]["reason"]
    # 2.5 × is below the drop limit and above the bound: kept, shrunk to 2 × the median norm
    larger = {k: gs[k] + 2.5 * (v - gs[k]) for k, v in honest[0].state.items()}
    kept, info = _screen(honest[1:] + [ClientUpdate(9, 9, larger, None, 100, {})], g)
    bounded = next(u for u in kept if u.node_id == 9)
    assert [c["node-id"] for c in info["clipped"]] == [9]
    assert update_norm(bounded.state, g.state_dict()) == pytest.approx(2 * info["median-norm"], rel=1e-5)


def _random_weights(g: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A ``random`` liar's weights: every tensor replaced by Gaussian noise of its standard deviation."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * (v.std() if v.numel() > 1 else v.abs() + 1e-3)
            for k, v in g.state_dict().items()}


# `core-positive` drops only replies pointing away from the majority: a random-weight update is near-orthogonal to it
# (either sign), and in the benchmark the norm check drops those (docs/trust.md, "Clustering the updates")
@pytest.mark.parametrize("liar,mode,min_samples", [
    ("random", "flame", 1), ("random", "core", 1), ("sign-flip", "flame", 1), ("sign-flip", "core", 1),
    ("sign-flip", "core-positive", 1), ("sign-flip", "core-positive", 0)])
def test_the_cluster_rule_drops_three_lying_replies_among_honest_ones(liar, mode, min_samples):
    g = _mlp()
    gs = g.state_dict()
    honest = [ClientUpdate(i, i, _moved(g, 0.02, i), None, 100, {}) for i in range(7)]
    if liar == "random":
        bad = [ClientUpdate(20 + j, 20 + j, _random_weights(g, 50 + j), None, 100, {}) for j in range(3)]
    else:   # the negated updates of clients that trained honestly
        bad = [ClientUpdate(20 + j, 20 + j, {k: 2 * gs[k] - v for k, v in _moved(g, 0.02, 30 + j).items()}, None,
                            100, {}) for j in range(3)]
    # the norm checks off: the clustering alone must find them
    kept, info = _screen(honest + bad, g, ClientScreen(stale=0, max_norm=0, norm_clip=0, cluster=mode,
                                                       min_samples=min_samples))
    assert {d["node-id"] for d in info["dropped"]} >= {20, 21, 22}
    assert all("majority cluster" in d["reason"] for d in info["dropped"])
    assert set(info["clients"]) == {str(i) for i in (*range(7), 20, 21, 22)}
    assert all("cluster" in c for c in info["clients"].values()) and set(info["majority-cluster"]) <= set(range(7))
    if mode != "flame":   # the honest replies outside the majority cluster pass the direction check against it
        assert {u.node_id for u in kept} == set(range(7))


@pytest.mark.parametrize("mode,min_samples", [("core", 1), ("core-positive", 1), ("core-positive", 0)])
def test_the_cluster_rule_keeps_every_honest_reply_of_a_clean_round(mode, min_samples):
    g = _mlp()
    honest = [ClientUpdate(i, i, _moved(g, 0.02, i), None, 100, {}) for i in range(10)]
    kept, info = _screen(honest, g, ClientScreen(cluster=mode, min_samples=min_samples))
    assert info["dropped"] == [] and [u.node_id for u in kept] == list(range(10))
    assert "no-majority-cluster" not in info and len(info["majority-cluster"]) >= 6
    with pytest.raises(ValueError, match="cluster"):
        ClientScreen(cluster="yes")


def test_screen_needs_three_replies_and_checks_its_options():
    g = _mlp()
    two = [ClientUpdate(i, i, _moved(g, 0.02, i), None, 100, {}) for i in range(2)]
    record: dict = {}
    assert ClientScreen()(two, g.state_dict(), lambda s: g, _inputs(), record) == two and "screened" not in record
    with pytest.raises(ValueError, match="norm_clip"):
        ClientScreen(norm_clip=-1)


def test_agreements_is_the_share_of_majority_votes():
    a, b = _mlp(1), _mlp(2)
    x = _inputs(50)
    agree = agreements([a, copy.deepcopy(a), b], x)
    assert agree[0] == agree[1] == 1.0 and agree[2] < 1.0


# ------------------------------------------------------------------------------------------- scores through a strategy
def test_inflated_scores_fuse_to_the_same_global_model():
    """The bound through a FusionStrategy (kf-linear): one reply's scores × 1000 leave the fused weights unchanged."""
    models = [_mlp(seed=s) for s in (1, 2, 3)]
    gen = torch.Generator().manual_seed(0)
    scores = [{lv.name: torch.rand(lv.width, generator=gen) + 0.1 for lv in levels(m)} for m in models]
    strategy = FusionStrategy("kf-linear", model_fn=_mlp, fusion_inputs=_inputs(64), refine="none", guard=False)

    def fused(sc):
        ups = [ClientUpdate(i, i, m.state_dict(), s, 50, {}) for i, (m, s) in enumerate(zip(models, sc))]
        return strategy.aggregate(1, ups)[0]

    honest = fused(scores)
    lying = fused([scores[0], {k: v * 1000 for k, v in scores[1].items()}, scores[2]])
    for k in honest:
        torch.testing.assert_close(lying[k], honest[k], rtol=1e-4, atol=1e-5)


def _with_dead_units(model: torch.nn.Module, units: slice) -> torch.nn.Module:
    """``model`` with the given units of its first level dead (zero incoming weights, negative bias: ReLU is 0)."""
    lv = levels(model)[0]
    with torch.no_grad():
        lv.layer.weight[units] = 0.0
        lv.layer.bias[units] = -1.0
    return model


def test_scores_on_units_the_model_does_not_use_are_inconsistent():
    """Conductance and uniform scores agree with their weights; scores piled on dead or disconnected units do not."""
    from fedfuse.fusion.score_check import inert_units, score_inconsistency
    from fedfuse.importance import neuron_importance

    model = _with_dead_units(_mlp(seed=1), slice(0, 6))
    first, second = (lv.name for lv in levels(model)[:2])
    with torch.no_grad():
        levels(model)[1].layer.weight[:, 6:8] = 0.0        # units 6, 7 feed nothing
    before = copy.deepcopy(model.state_dict())
    inert = inert_units(model, _inputs())
    assert inert[first].nonzero().flatten().tolist() == list(range(8)) and not inert[second].any()
    honest = neuron_importance(model, _inputs(100), torch.randint(0, 10, (100,), generator=torch.Generator()))
    uniform = {k: torch.ones_like(v) for k, v in honest.items()}
    assert score_inconsistency(model, honest, _inputs()) is None
    assert score_inconsistency(model, uniform, _inputs()) is None
    lying = {**honest, first: torch.zeros(32).index_fill_(0, torch.arange(8), 1.0)}
    reason = score_inconsistency(model, lying, _inputs())
    assert reason is not None and f"level {first!r}" in reason and "100%" in reason and "8 of its 32" in reason
    for k, v in model.state_dict().items():                # the check leaves the model's weights alone
        torch.testing.assert_close(v, before[k])


def test_a_reply_whose_scores_disagree_with_its_weights_is_rejected_and_the_round_goes_on():
    from fedfuse.flower.round.replies import reject_inconsistent_scores

    dead = _with_dead_units(_mlp(seed=2), slice(0, 8))
    first = levels(dead)[0].name
    good = [ClientUpdate(i, i, _mlp(seed=i).state_dict(), {lv.name: torch.ones(lv.width) for lv in levels(_mlp())},
                         50, {}) for i in (0, 1)]
    liar = ClientUpdate(7, 7, dead.state_dict(), {first: torch.zeros(32).index_fill_(0, torch.arange(8), 1.0)},
                        50, {})

    def build(state):
        m = _mlp()
        m.load_state_dict(state)
        return m

    record: dict = {"rejected": []}
    kept = reject_inconsistent_scores(good + [liar], build, _inputs(), record, 1)
    assert [u.node_id for u in kept] == [0, 1]
    assert record["rejected"][0]["node-id"] == 7 and record["rejected"][0]["inconsistent-scores"]
    # through a kf-linear strategy's round: the liar is rejected with the reason, the others fused
    from unittest.mock import Mock

    def message(u):
        msg = Mock(spec=Message)
        msg.metadata = Mock(src_node_id=u.node_id)
        msg.has_error.return_value = False
        msg.content = RecordDict({
            "arrays": ArrayRecord({k: Array(v.numpy().copy()) for k, v in u.state.items()}),
            "metrics": MetricRecord({"num-examples": 50, "partition-id": u.partition_id}),
            "importance": ArrayRecord({k: Array(v.numpy().copy()) for k, v in u.scores.items()})})
        return msg

    full = {lv.name: torch.ones(lv.width) for lv in levels(_mlp())}
    liar.scores = {**full, **liar.scores}
    for check, valid in ((True, 2), (False, 3)):
        strategy = FusionStrategy("kf-linear", model_fn=_mlp, fusion_inputs=_inputs(64), refine="none",
                                  score_check=check)
        arrays, metrics = strategy.aggregate_train(1, [message(u) for u in good + [liar]])
        assert arrays is not None and metrics["num-valid"] == valid
        assert [r["node-id"] for r in strategy.history[-1]["rejected"]] == ([7] if check else [])


# ------------------------------------------------------------------------------------------- run config
def test_robust_keys_fail_before_any_client_trains():
    with pytest.raises(ConfigError, match="'robust'"):
        check_config({"strategy": "fedmedian", "robust": True})
    with pytest.raises(ConfigError, match="'strategy-options.num-malicious-nodes'"):
        check_config({"strategy": "krum", "num-malicious-nodes": 3, "min-train-nodes": 4, "num-clients": 4})
    with pytest.raises(ConfigError, match="'strategy-options.num-malicious-nodes'"):
        check_config({"strategy": "fedavg", "num-malicious-nodes": 1})
    from fedfuse.config import config_notes
    with config_notes() as notes:   # one-shot: the clients' answers only are screened, and the run says so
        assert check_config({"strategy": "auto", "robust": True, "mode": "one-shot", "num-server-rounds": 1}).robust
    assert any("screens their answers only" in n for n in notes)
    with pytest.raises(ConfigError, match="'strategy-options.trim-beta'"):
        check_config({"strategy": "fedavg", "trim-beta": 0.1})
    assert check_config({"strategy": "krum", "num-malicious-nodes": 1, "min-train-nodes": 4,
                         "num-clients": 4}).num_malicious_nodes == 1


def test_robust_strategy_options_reach_flowers_strategy():
    from fedfuse.flower.server_app import setup
    from fedfuse.config import parse_run_config

    base = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 4,
            "min-train-nodes": 4, "fusion-set-size": 40}
    _, _, krum = setup(parse_run_config({**base, "strategy": "krum", "num-malicious-nodes": 1}))
    assert krum.flower.num_malicious_nodes == 1
    _, _, trimmed = setup(parse_run_config({**base, "strategy": "fedtrimmedavg", "trim-beta": 0.3}))
    assert trimmed.flower.beta == 0.3
    _, _, robust = setup(parse_run_config({**base, "strategy": "auto", "robust": True}))
    assert isinstance(robust.screen, ClientScreen) and robust.screen.norm_clip == 2.0
    assert robust.robust_answers   # the vote and the head round too (fedfuse.flower.trust.screen)
    # one-shot: no update screen (the clients start from their own models), the answers screened
    _, _, one_shot = setup(parse_run_config({**base, "strategy": "auto", "robust": True, "mode": "one-shot",
                                             "num-server-rounds": 1}))
    assert one_shot.screen is None and one_shot.robust_answers
    _, _, plain = setup(parse_run_config({**base, "strategy": "auto"}))
    assert plain.screen is None and not plain.robust_answers


# ------------------------------------------------------------------------------------------- a federation
def test_robust_run_drops_random_sign_flipped_and_free_riding_clients_every_round(tmp_path):
    from fedfuse.flower.runner.inprocess import run_inprocess

    attacks = [Liar("random", frozenset({1})).mod, Liar("free-ride", frozenset({3})).mod,
               Liar("sign-flip", frozenset({5})).mod, Liar("scale", frozenset({6})).mod]
    out = run_inprocess({**TINY, "num-clients": 8, "min-train-nodes": 8, "strategy": "fedavg", "robust": True,
                         "output-dir": str(tmp_path), "run-name": "r"},
                        echo=False, client_app=make_client_app(mods=attacks))
    history = _history(out)
    assert len(history) == 2
    partitions = {int(k) for k in history[0]["screened"]["clients"]}
    for h in history:
        dropped = {d["partition-id"]: d["reason"] for d in h["screened"]["dropped"]}
        assert set(dropped) == {1, 3, 5, 6}, dropped
        assert "free rider" in dropped[3] and "median update" in dropped[1] and "median update" in dropped[5]
        # the scaled update (10 × an honest one)
        assert "above 3 × the round's median" in dropped[6]
    assert partitions == set(range(8))
    assert json.loads((out / "results.json").read_text())["rounds"][-1]["test-accuracy"] > 0.5


@pytest.mark.parametrize("wrapper", ["server-fixed", "client-fixed"])
def test_flowers_dp_wrappers_run_around_fedfuses_average(tmp_path, wrapper):
    """Flower's central-DP wrapper strategies around fedfuse's averaging strategy (docs/trust.md: the guarantee holds for
    the average; fusion methods read each client's model and are not covered)."""
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp.strategy import (DifferentialPrivacyClientSideFixedClipping,
                                         DifferentialPrivacyServerSideFixedClipping)

    from fedfuse.flower.runner.inprocess import run_inprocess
    from fedfuse.flower.server_app import run_server

    cls = (DifferentialPrivacyServerSideFixedClipping if wrapper == "server-fixed"
           else DifferentialPrivacyClientSideFixedClipping)

    def server(grid, context):
        run_server(grid, context, wrap_strategy=lambda s, _c: cls(s, noise_multiplier=0.01, clipping_norm=5.0,
                                                                  num_sampled_clients=5))

    mods = [fixedclipping_mod] if wrapper == "client-fixed" else []
    out = run_inprocess({**TINY, "strategy": "fedavg", "output-dir": str(tmp_path), "run-name": wrapper}, echo=False,
                        server=server, client_app=make_client_app(mods=mods))
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    assert len(rounds) == 3 and rounds[-1]["test-accuracy"] > 0.3


def test_inflated_class_counts_weigh_no_more_than_the_sample_count():
    """A client claiming 100 × its samples, all of one class, moves the calibration prior only by its sample count."""
    from fedfuse.flower.round.steps import class_prior

    honest = [ClientUpdate(i, i, {}, None, 100, {}, [10] * 10) for i in range(3)]
    liar = ClientUpdate(9, 9, {}, None, 100, {}, [10_000] + [0] * 9)
    prior, name = class_prior("class-counts", honest + [liar])
    assert name == "class-counts"
    assert prior.tolist() == pytest.approx([130.0] + [30.0] * 9)
