"""tier-models='prune' (issues 13/14): each narrower tier's model is the fused global model structurally pruned to the
tier's architecture, and the global model's units are reordered (same function) so that it is the top-left slice."""

import json
from unittest.mock import Mock

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.flower.round.protocol import state_to_record
from fedfuse.hetero import slice_state, submodel
from fedfuse.hetero.prune import kept_units, prune_order
from fedfuse.models import build_model, levels
from fedfuse.pruning import prune

SHAPES = {"mlp": (40,), "cnn": (1, 40), "vit": (1, 8, 8)}


def _shapes(state):
    return {k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parametrize("family", ["mlp", "cnn", "vit"])
def test_reordered_global_is_the_same_function_and_its_slices_are_the_pruned_tiers(family):
    torch.manual_seed(0)
    shape = SHAPES[family]
    g = build_model(family, 10, shape).eval()
    tiers = {r: build_model(family, 10, shape, width_mult=r) for r in (0.5, 0.25)}
    x = torch.randn(48, *shape)
    state, perms, info = prune_order(g, {str(r): m for r, m in tiers.items()}, fusion_inputs=x)
    g2 = build_model(family, 10, shape)
    g2.load_state_dict(state)
    with torch.no_grad():
        assert torch.allclose(g(x), g2.eval()(x), atol=1e-5)        # a permutation: the global function is kept
    assert set(info) == {"0.5", "0.25"} and all(0 <= v["kept-moved"] <= 1 for v in info.values())
    for r, sk in tiers.items():
        sub = slice_state(state, submodel(g2, sk))
        assert _shapes(sub) == _shapes(sk.state_dict())                 # exactly the tier's architecture
    # tier 0.5 = prune(global, target=tier 0.5) (up to the order of its units, which tier 0.25 fixes inside it)
    half = build_model(family, 10, shape, width_mult=0.5)
    half.load_state_dict(slice_state(state, submodel(g2, tiers[0.5])))
    pruned = prune(g, target=tiers[0.5], fusion_inputs=x)
    with torch.no_grad():
        assert torch.allclose(half.eval()(x), pruned(x), atol=1e-5)
    # nested: tier 0.25 = prune(tier 0.5's model, target=tier 0.25), and its slice of the tier-0.5 slice
    quarter = build_model(family, 10, shape, width_mult=0.25)
    quarter.load_state_dict(slice_state(state, submodel(g2, tiers[0.25])))
    pruned2 = prune(half, target=tiers[0.25], fusion_inputs=x)
    with torch.no_grad():
        assert torch.allclose(quarter.eval()(x), pruned2(x), atol=1e-5)
    assert all(torch.equal(v, slice_state(half.state_dict(), submodel(half, tiers[0.25]))[k])
               for k, v in quarter.state_dict().items())


def test_kept_units_finds_the_pruned_units_and_refuses_a_changed_model():
    torch.manual_seed(0)
    g = build_model("mlp", 10, (40,), width=16, depth=2)
    p = prune(g, target=build_model("mlp", 10, (40,), width=8, depth=2))
    kept = kept_units(g, p)
    assert all(len(v) == 8 and len(set(v.tolist())) == 8 for v in kept.values())
    w0 = g.state_dict()[next(iter(g.state_dict()))]
    assert torch.equal(w0[kept[next(iter(kept))]], p.state_dict()[next(iter(p.state_dict()))])
    with torch.no_grad():
        next(p.parameters()).add_(1.0)
    with pytest.raises(ValueError, match="no exact counterpart"):
        kept_units(g, p)



RANKED = {"mlp": ((40,), {}), "cnn": ((1, 40), {}), "resnet": ((3, 8, 8), {"width": 8, "depth": 2})}


@pytest.mark.parametrize("criterion", ["magnitude", "taylor", "scores"])
@pytest.mark.parametrize("family", sorted(RANKED))
def test_keep_indices_ranks_like_the_pruned_model(family, criterion):
    """The per-round path (``keep_indices``: the ranking on a cached dependency graph, no pruned copy) keeps
    exactly the units that ``prune(..., target=)`` keeps, for every criterion, also on a second call with other
    weights (the cached graph reads the new weights)."""
    from fedfuse.hetero.prune import _kept_by_ranking

    shape, kw = RANKED[family]
    tier = build_model(family, 10, shape, width_mult=0.25, **kw)
    x = torch.randn(32, *shape)
    for seed in (1, 2):
        g = build_model(family, 10, shape, seed=seed, **kw)
        scores = {lv.name: torch.rand(lv.width) for lv in levels(g)} if criterion == "scores" else None
        kept, used = _kept_by_ranking(g, tier, fusion_inputs=x, criterion=criterion, scores=scores)
        assert used == criterion
        pruned = kept_units(g, prune(g, target=tier, fusion_inputs=x, criterion=criterion, scores=scores))
        assert set(kept) == set(pruned) and all(torch.equal(kept[k], pruned[k]) for k in pruned)


def test_keep_indices_refuses_what_it_cannot_rank():
    from fedfuse.pruning import keep_indices

    g = build_model("vit", 10, (1, 8, 8))
    with pytest.raises(ValueError, match="attention heads"):
        keep_indices(g, build_model("vit", 10, (1, 8, 8), width_mult=0.5))
    r = build_model("resnet", 10, (3, 8, 8), width=8, depth=2)
    with pytest.raises(ValueError, match="another depth"):
        keep_indices(r, build_model("resnet", 10, (3, 8, 8), width=8, depth=1))
    with pytest.raises(ValueError, match="criterion"):
        keep_indices(build_model("mlp", 10, (40,)), build_model("mlp", 10, (40,), width_mult=0.5), criterion="l1")


def test_prune_order_ranks_after_one_checked_round_and_falls_back_where_ranking_differs(monkeypatch):
    """The first call per architecture prunes for real and checks the ranking; later calls rank only (same result
    as pruning); an architecture where the ranking disagreed prunes for real on every call."""
    import fedfuse.hetero.prune as hp

    monkeypatch.setattr(hp, "_RANKING_CHECKED", {})
    tiers = {"0.5": build_model("mlp", 10, (40,), width=24, depth=2, width_mult=0.5)}
    x = torch.randn(16, 40)
    g1, g2 = (build_model("mlp", 10, (40,), width=24, depth=2, seed=s) for s in (1, 2))
    _, g1_perms, g1_info = prune_order(g1, tiers, fusion_inputs=x)
    assert not g1_info["0.5"]["ranked"]
    state, perms, info = prune_order(g2, tiers, fusion_inputs=x)
    assert info["0.5"]["ranked"]
    monkeypatch.setattr(hp, "_RANKING_CHECKED", {})   # the reference: the same call, pruning for real
    ref_state, ref_perms, ref_info = prune_order(g2, tiers, fusion_inputs=x)
    assert not ref_info["0.5"]["ranked"]
    assert all(torch.equal(perms[k], ref_perms[k]) for k in ref_perms)
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    # a ranking that disagrees with the pruned model is never used for that architecture
    monkeypatch.setattr(hp, "_RANKING_CHECKED", {})
    real = hp._kept_by_ranking
    monkeypatch.setattr(hp, "_kept_by_ranking",
                        lambda *a, **k: ({g: v.flip(0) for g, v in real(*a, **k)[0].items()}, real(*a, **k)[1]))
    for g in (g1, g2, g1):
        state, perms, info = prune_order(g, tiers, fusion_inputs=x)
        assert not info["0.5"]["ranked"]
    assert all(torch.equal(perms[k], g1_perms[k]) for k in g1_perms)   # the pruned model's units, not the flip


def _strategy(method="kf-linear", **kw):
    from fedfuse.flower.tiers.tiered import build_tier_strategy

    return build_tier_strategy(method, tiers=(1.0, 0.5, 0.25), input_shape=(40,), seed=0,
                               model_fn=lambda: build_model("mlp", 10, (40,), width=16, depth=2),
                               fusion_inputs=torch.randn(32, 40), **kw)


def _updates(s):
    torch.manual_seed(0)
    ups = []
    for i, r in enumerate((1.0, 0.5, 0.25)):
        sk = s.skeleton(r)
        scores = {lv.name: torch.rand(lv.width) + 0.1 for lv in levels(sk)}
        ups.append(ClientUpdate(node_id=i + 1, partition_id=i, num_examples=10 * (i + 1),
                                state={k: v + 0.05 * torch.randn_like(v) for k, v in sk.state_dict().items()},
                                metrics={"tier": r}, scores=scores, class_counts=None))
    return ups


def _mock_round(s, ups, fused):
    """aggregate_train of a round whose fusion returned ``fused`` (the base aggregation mocked)."""
    import fedfuse.flower.round.protocol as base

    s.history.append({"round": 1})
    s.last_updates = ups
    orig = base.RoundProtocol.aggregate_train
    base.RoundProtocol.aggregate_train = lambda self, rnd, replies: (state_to_record(fused), None)
    try:
        return s.aggregate_train(1, [])
    finally:
        base.RoundProtocol.aggregate_train = orig


@pytest.mark.parametrize("tier_models", ["prune", "prune-recover"])
def test_mocked_round_with_tier_models_prune_sends_every_node_its_pruned_tier(tier_models, monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)   # Message() needs a run and a sending node
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    s = _strategy(tier_models=tier_models, guard=False)
    s.tier_layout.node_tier = {1: 1.0, 2: 0.5, 3: 0.25}
    ups = _updates(s)
    torch.manual_seed(1)
    fused = build_model("mlp", 10, (40,), width=16, depth=2, seed=3).state_dict()
    s._global = state_to_record(fused)
    s.momentum_step.velocity = {k: v.double().clone() for k, v in fused.items()}   # the server momentum follows the units
    arrays, _ = _mock_round(s, ups, fused)
    new = arrays.to_torch_state_dict()
    x = torch.randn(20, 40)
    a, b = build_model("mlp", 10, (40,), width=16, depth=2), build_model("mlp", 10, (40,), width=16, depth=2)
    a.load_state_dict(fused)
    b.load_state_dict(new)
    with torch.no_grad():
        assert torch.allclose(a.eval()(x), b.eval()(x), atol=1e-5)       # reordered, same function
    assert not all(torch.equal(new[k], fused[k]) for k in fused)         # ... and really reordered
    assert all(torch.equal(s.momentum_step.velocity[k].float(), new[k]) for k in new)
    rec = s.history[-1]["tier-prune"]
    assert set(rec) == {"0.5", "0.25"}
    if tier_models == "prune":   # the tier model is the pruned global = the reordered global's top-left slice
        sub = slice_state(new, s.layout(0.5, 0))
        assert all(torch.equal(s.tier_state(0.5, 2)[k], sub[k]) for k in sub)
        pruned = prune(a, target=s.skeleton(0.5))
        with torch.no_grad():
            assert torch.allclose(s.build_model(sub)(x), pruned(x), atol=1e-5)
    # configure_train: one message per node with its tier's shapes
    grid = Mock()
    grid.get_node_ids.return_value = [1, 2, 3]
    msgs = list(s.configure_train(2, arrays, ConfigRecord({}), grid))
    assert len(msgs) == 3
    for m in msgs:
        r = s.tier_layout.node_tier[int(m.metadata.dst_node_id)]
        got = m.content.array_records[s.arrayrecord_key].to_torch_state_dict()
        assert _shapes(got) == _shapes(s.skeleton(r).state_dict())
        assert m.content.config_records[s.configrecord_key]["tier-width-mult"] == r
        if r == 1:
            assert all(torch.equal(got[k], new[k]) for k in new)


def test_aggregated_scores_average_the_clients_holding_each_unit():
    s = _strategy(tier_models="prune")
    ups = _updates(s)
    sc = s.aggregated_scores(ups)
    first = levels(s.skeleton(1.0))[0]
    assert sc[first.name].shape == (first.width,)
    # the last units are held by the full-width client only
    full = ups[0].scores[first.name]
    assert torch.allclose(sc[first.name][-1], (full / full.mean())[-1])
    ups[1].scores = None
    assert s.aggregated_scores(ups) is None


def test_a_guarded_pruned_tier_keeps_the_unpermuted_sub_model_average():
    s = _strategy(tier_models="prune")
    s.tier_layout.node_tier = {1: 1.0, 2: 0.5, 3: 0.25}
    ups = _updates(s)
    s._global = state_to_record(s.skeleton(1.0).state_dict())
    average = s.weighted_average(ups)
    arrays, _ = _mock_round(s, ups, {k: v * 1e3 for k, v in average.items()})   # a diverged "fused" global
    got = arrays.to_torch_state_dict()
    assert all(torch.allclose(got[k], average[k]) for k in average)
    assert "tier-guard" in s.history[-1] and s.tier_models_step.take_round()[1] is None and s.tier_models_step.derived == {}


def test_tier_models_prune_config():
    assert parse_run_config({"client-tiers": "1,0.5", "strategy": "kf-linear", "tier-models": "prune"})
    assert parse_run_config({"client-tiers": "1,0.5", "strategy": "average", "tier-models": "prune-recover"})
    with pytest.raises(ConfigError, match="tier-options.models"):
        parse_run_config({"client-tiers": "1,0.5", "strategy": "heterofl", "tier-models": "prune"})
    with pytest.raises(ConfigError, match="tier-options.models"):
        parse_run_config({"client-tiers": "1,0.5", "strategy": "kf-linear", "tier-models": "prunе"})
    with pytest.raises(ValueError, match="tier_models"):
        _strategy("heterofl", tier_models="prune")


def test_tier_models_auto_default_prunes_for_fusion_and_slices_for_the_submodel_baselines():
    # the run-config default is 'auto': the measured best per strategy (prune above slice on every MNIST-1D cell)
    assert parse_run_config({"client-tiers": "1,0.5"}).tier_models == "auto"
    for name in ("average", "kf-linear"):
        assert _strategy(name).tier_models_step.tier_models == "prune"
    for name in ("heterofl", "fedrolex", "feddf"):
        assert parse_run_config({"client-tiers": "1,0.5", "strategy": name})      # auto is valid for them
        assert _strategy(name).tier_models_step.tier_models == "slice"
    assert _strategy("average", tier_models="slice").tier_models_step.tier_models == "slice"
    # ViTs: slicing measured above pruning (results/tiers/explore-vit-slice)
    from fedfuse.flower.tiers.tiered import build_tier_strategy

    vit = build_tier_strategy("average", tiers=(1.0, 0.5), input_shape=(1, 8, 8), seed=0,
                              model_fn=lambda: build_model("vit", 10, (1, 8, 8)))
    assert vit.tier_models_step.tier_models == "slice"


@pytest.mark.parametrize("strategy", ["kf-linear", "average"])
def test_two_round_inprocess_run_with_tier_models_prune(tmp_path, strategy):
    from fedfuse.flower.runner.inprocess import run_inprocess

    cfg = {"dataset": "mnist1d", "model": "mlp", "model-width": 32, "model-depth": 1, "num-clients": 2,
           "partitioning": "iid", "num-server-rounds": 2, "local-epochs": 1, "fusion-set-size": 120,
           "min-train-nodes": 2, "importance": "uniform", "client-tiers": "1,0.5", "tier-models": "prune",
           "strategy": strategy, "output-dir": str(tmp_path), "run-name": "t"}
    out = run_inprocess(cfg, 2, echo=False)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed"
    last, head = res["rounds"][-2:]   # the last training round, then the head round (the default)
    assert last["valid-replies"] == 2 and last["rejected"] == [] and last["failures"] == []
    assert set(last["tier-accuracy"]) == {"1", "0.5"} and last["tier-clients"] == {"1": 1, "0.5": 1}
    assert set(head["tier-accuracy"]) == set(head["fusion-info"]["head-round"]["tiers"]) == {"1", "0.5"}
    assert last["test-accuracy"] > 0.12
    pruned = [h["tier-prune"] for h in res["strategy-history"] if "tier-prune" in h]
    assert pruned and set(pruned[-1]) == {"0.5"}                           # every round derived tier 0.5 by pruning
