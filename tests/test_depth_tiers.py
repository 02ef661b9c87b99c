"""Depth tiers (issue 26): ``<width>x<depth>`` tiers, the multi-exit global model, the sub-model a depth tier holds,
DepthFL's layer-wise average and local loss, per-node depth messages, depth-tier runs end to end."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.hetero.depth import (MultiExit, aggregate_held, depth_units, held_keys, multi_exit,
                                  mutual_distillation_loss, units_at)
from fedfuse.hetero.tiers import parse_tier_pairs, parse_tiers
from fedfuse.models import adapter_for, build_model

SHAPES = {"mlp": (40,), "resnet": (1, 40), "vit": (1, 40), "cnn": (1, 40)}
TINY = {"dataset": "mnist1d", "model": "mlp", "model-width": 32, "model-depth": 4, "num-clients": 4,
        "partitioning": "iid", "num-server-rounds": 2, "local-epochs": 1, "fusion-set-size": 120,
        "min-train-nodes": 4, "importance": "uniform", "client-tiers": "1x1,1x0.75,1x0.5,1x0.25"}


def _me(family="mlp", depths=(1, 0.75, 0.5, 0.25), seed=0):
    return multi_exit(build_model(family, 10, SHAPES[family], width=16, depth=4, seed=seed), depths, 10)


# ------------------------------------------------------------------------------------- syntax and fail-fast checks
def test_tier_syntax_width_x_depth_and_bare_widths():
    assert parse_tier_pairs("1x1,1x0.5, 0.5") == ((1.0, 1.0), (1.0, 0.5), (0.5, 1.0))
    assert parse_tiers("1,0.5x1") == (1.0, 0.5)          # '<width>x1' is a width tier: today's syntax keeps working
    assert parse_run_config({"client-tiers": "1,0.5", "strategy": "average"}).depth_tiers == ()
    cfg = parse_run_config({**TINY, "strategy": "depthfl"})
    assert cfg.depth_tiers == (1.0, 0.75, 0.5, 0.25) and cfg.tiers == ()
    assert units_at(0.25, 4) == 1 and units_at(0.75, 4) == 3 and units_at(0.1, 4) == 1


@pytest.mark.parametrize("overrides,match", [
    ({"client-tiers": "1x1,1x0"}, "client-tiers.*depth multiplier 0"),
    ({"client-tiers": "1x1,1xabc"}, "client-tiers.*not a number"),
    ({"client-tiers": "1x0.5"}, "client-tiers.*full model"),
    ({"client-tiers": "1x1,0.5x0.5"}, "client-tiers.*mixes width and depth"),
    ({"strategy": "ot"}, "client-tiers.*cannot aggregate clients of different depths"),
    ({"client-tiers": "", "strategy": "depthfl"}, "client-tiers.*needs depth tiers"),
    ({"model-depth": 1}, "client-tiers.*at least 2 blocks"),
    ({"ordered-dropout": "all"}, "ordered-dropout"),
    ({"tier-models": "prune"}, "tier-models.*width-tier option"),
    ({"mode": "warm-start"}, "client-tiers.*warm-start"),
])
def test_bad_depth_tier_configs_fail_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        parse_run_config({**TINY, "strategy": "depthfl", **overrides})


# ------------------------------------------------------------------------------------------ the multi-exit model
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_multi_exit_runs_the_tier_prefix_and_trains_only_the_arrays_it_holds(family):
    me = _me(family)
    x = torch.randn(5, *SHAPES[family])
    assert torch.allclose(me(x), me.base(x))                       # full depth: the base model itself
    assert me.exit_units == [1, 2, 3] and me.num_units == 4
    for k in (1, 2, 3, 4):
        me.set_active(k)
        outs = me.forward_exits(x)
        assert len(outs) == k and all(o.shape == (5, 10) for o in outs)
        assert torch.allclose(me(x), outs[-1])
        me.zero_grad()
        sum(o.sum() for o in outs).backward()
        held = set(held_keys(me, k))
        for name, p in me.named_parameters():   # gradients reach exactly the held parameters
            assert (p.grad is not None) == (name in held), (family, k, name)
    assert len(held_keys(me, 1)) < len(held_keys(me, 2)) < len(held_keys(me, 4)) == len(me.state_dict())
    with pytest.raises(ValueError, match="no classifier at 5 units"):
        me.set_active(5)


def test_a_model_with_one_unit_has_no_shallower_tier():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        depth_units(build_model("mlp", 10, (40,), width=8, depth=1))


def test_a_vit_depth_tier_computes_the_features_of_the_vit_with_its_later_blocks_removed():
    me = _me("vit", depths=(1, 0.5))
    x = torch.randn(4, 1, 40)
    pruned = copy.deepcopy(me.base)
    adapter_for(pruned).remove_blocks(pruned, [2, 3])           # the blocks a depth-0.5 client does not hold
    me.set_active(2)
    exit_head = me.exits["2"]
    feats = pruned.forward_features(x)                            # tokens after blocks 0, 1 (+ the model's norm)
    captured = {}
    h = exit_head.register_forward_pre_hook(lambda m, a: captured.setdefault("h", a[0]))
    me.eval()(x)
    h.remove()
    assert torch.allclose(pruned.norm(captured["h"]), feats, atol=1e-5)


# ------------------------------------------------------------------------------ aggregation and the local loss
def test_layerwise_average_over_the_clients_that_hold_each_array():
    g = _me().state_dict()
    deep = {k: torch.full_like(v, 1.0) for k, v in g.items()}
    shallow_keys = held_keys(_me(), 1)
    shallow = {k: torch.full_like(g[k], 4.0) for k in shallow_keys}
    out = aggregate_held(g, [deep, shallow], [1.0, 3.0])
    for k, v in out.items():
        if not v.is_floating_point():
            assert torch.equal(v, g[k])
        elif k in shallow_keys and k in deep:
            assert torch.allclose(v, torch.full_like(v, (1 + 3 * 4) / 4))   # both hold it: sample-weighted mean
        else:
            assert torch.allclose(v, torch.full_like(v, 1.0))               # only the deep client holds it
    unheld = aggregate_held(g, [shallow], [1.0])
    assert torch.equal(unheld["base.9.weight"], g["base.9.weight"])          # held by nobody: the global value
    with pytest.raises(ValueError, match="not a key of the global model"):
        aggregate_held(g, [{"nope": torch.zeros(1)}])


def test_depthfl_loss_is_the_exits_cross_entropy_plus_mutual_distillation():
    torch.manual_seed(0)
    z = [torch.randn(8, 10, requires_grad=True) for _ in range(3)]
    y = torch.randint(0, 10, (8,))
    ce = sum(F.cross_entropy(t, y) for t in z)
    assert torch.allclose(mutual_distillation_loss(z, y, self_distill=False), ce)
    with_sd = mutual_distillation_loss(z, y)
    assert with_sd > ce
    same = [z[0]] * 3   # identical exits: the mutual KL is 0
    assert torch.allclose(mutual_distillation_loss(same, y), 3 * F.cross_entropy(z[0], y))


# ------------------------------------------------------------------------------------------ Flower: the client side
def _context(node_config, run_config=None):
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config or {})


def test_client_depth_from_the_run_or_its_node_config_and_its_loaded_arrays():
    from fedfuse.flower.client_tiers import DEPTH_KEY, depth_tier, node_depth, node_tier

    depths = [1.0, 0.75, 0.5, 0.25]
    assert [node_depth(_context({"partition-id": p}), depths)[1] for p in range(5)] == [1.0, 0.75, 0.5, 0.25, 1.0]
    assert node_depth(_context({"partition-id": 0, "tier": "1x0.5"}), depths) == (0, 0.5)
    with pytest.raises(ValueError, match="node-config key 'tier'.*depth tier of the run"):
        node_depth(_context({"partition-id": 0, "tier": "1x0.3"}), depths)
    with pytest.raises(ValueError, match="node-config key 'tier'.*the run has none"):
        node_tier(_context({"partition-id": 0, "num-partitions": 2, "tier": "1x0.5"}))
    server = _me(seed=1)
    sent = {k: server.state_dict()[k] for k in held_keys(server, 2)}
    model, loss_fn, keys = depth_tier(_me(seed=2), {DEPTH_KEY: 2}, sent)
    assert model.active == 2 and set(keys) == set(sent)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sent.items())
    assert loss_fn(torch.randn(4, 40), torch.tensor([0, 1, 2, 3])).requires_grad
    with pytest.raises(ValueError, match="depth-3 model holds other arrays"):
        depth_tier(_me(), {DEPTH_KEY: 3}, sent)
    with pytest.raises(ValueError, match="no exit classifiers"):
        depth_tier(build_model("mlp", 10, (40,)), {DEPTH_KEY: 2}, None)


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("strategy", ["depthfl", "average"])
def test_two_round_depth_tier_run_inprocess(tmp_path, strategy):
    from simulations.runners.inprocess import run_inprocess

    out = run_inprocess({**TINY, "strategy": strategy, "output-dir": str(tmp_path), "run-name": "d"}, 4, echo=False)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed"
    last = res["rounds"][-1]
    assert last["valid-replies"] == 4 and last["rejected"] == [] and last["failures"] == []
    labels = {"1x1", "1x0.75", "1x0.5", "1x0.25"}
    assert set(last["tier-accuracy"]) == labels and set(last["tier-clients"]) == labels
    b = last["tier-bytes-sent"]   # each node receives only the blocks and exits its depth holds
    assert b["1x1"] > b["1x0.75"] > b["1x0.5"] > b["1x0.25"] > 0
    assert last["test-accuracy"] == pytest.approx(last["tier-accuracy"]["1x1"])
    assert last["test-accuracy"] > 0.15 and 0 < last["exit-ensemble-accuracy"] <= 1   # chance 0.1


@pytest.mark.slow
def test_flwr_run_two_round_depth_tiers(tmp_path):
    from simulations.runners.flwr_runner import run_app

    cfg = {**TINY, "strategy": "depthfl", "output-dir": str(tmp_path), "run-name": "depth"}
    outcome = run_app(cfg, num_supernodes=4, timeout=420, echo=False)
    assert outcome.ok, f"run {outcome.run_id} ended {outcome.status}: {outcome.details}\n{outcome.log[-4000:]}"
    last = json.loads((outcome.out_dir / "results.json").read_text())["rounds"][-1]
    assert last["valid-replies"] == 4 and last["rejected"] == []
    assert set(last["tier-accuracy"]) == {"1x1", "1x0.75", "1x0.5", "1x0.25"}


def test_depth_strategy_rejects_a_plain_model_and_a_reply_of_another_depth():
    from fedfuse.flower import build_strategy

    with pytest.raises(ValueError, match="MultiExit"):
        build_strategy("depthfl", model_fn=lambda: build_model("mlp", 10, (40,), depth=2), depths=(1.0, 0.5))
    s = build_strategy("depthfl", model_fn=_me, depths=(1.0, 0.75, 0.5, 0.25))
    s.tier_layout.node_depth = {1: 0.25}
    ref, _ = s.reply_reference(1, 1)
    assert set(ref) == set(held_keys(_me(), 1))
    assert isinstance(s.build_model({k: _me().state_dict()[k] for k in ref}), MultiExit)
    with pytest.raises(ValueError, match="no depth tier's keys"):
        s.build_model({k: v for k, v in _me().state_dict().items() if k != "exits.1.fc.bias"})
