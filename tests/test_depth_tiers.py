"""Depth tiers (issue 26): ``<width>x<depth>`` tiers, the multi-exit global model, the sub-model a depth tier holds,
DepthFL's layer-wise average and local loss, per-node depth messages, depth-tier runs end to end."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.hetero.depth import (MultiExit, aggregate_held, depth_units, held_keys, layer_momentum,
                                  momentum_distill, multi_exit, mutual_distillation_loss, unit_arrays, units_at)
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
    ({"client-tiers": "1x1,0.5x0.5", "strategy": "inclusivefl"}, "strategy.*'inclusivefl'.*width x depth"),
    ({"client-tiers": "1x1,0.5x0.5", "strategy": "ot"}, "strategy.*'ot'.*width x depth"),
    ({"strategy": "rebasin"}, "client-tiers.*cannot aggregate clients of different depths"),
    ({"client-tiers": "", "strategy": "depthfl"}, "client-tiers.*needs depth tiers"),
    ({"model-depth": 1}, "client-tiers.*at least 2 blocks"),
    ({"ordered-dropout": "all"}, "ordered-dropout"),
    ({"tier-models": "prune"}, "tier-options.models.*width-tier option"),
    ({"mode": "warm-start", "warm-start-fusion": "kd", "warm-start-fusion-options": ""},
     "warm-start-options.fusion.*across depths.*'ot', 'feddf'"),
    ({"mode": "warm-start", "warm-start-fusion": "ot", "client-tiers": "1x1,0.5x0.5"},
     "warm-start-options.fusion.*'ot' aligns models of one width"),
    ({"refine": "distill"}, "refine.*one per depth"),
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
    from fedfuse.flower.tiers.client_tiers import DEPTH_KEY, depth_tier, node_depth, node_tier

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
@pytest.fixture(scope="module")
def depth_run(tmp_path_factory):
    """``depth_run(strategy)``: the results folder of a two-round depth-tier run of ``TINY`` on the in-process engine
    (the same ServerApp and ClientApp as ``flwr run``), made once per strategy for the tests below."""
    from fedfuse.flower.runner.inprocess import run_inprocess

    runs = {}

    def get(strategy):
        if strategy not in runs:
            runs[strategy] = run_inprocess({**TINY, "strategy": strategy, "run-name": "d",
                                            "output-dir": str(tmp_path_factory.mktemp(f"depth-{strategy}"))}, 4,
                                           echo=False)
        return runs[strategy]
    return get


@pytest.mark.parametrize("strategy", ["depthfl", "inclusivefl", "average"])
def test_two_round_depth_tier_run_inprocess(depth_run, strategy):
    out = depth_run(strategy)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed"
    last, head = next(r for r in res["rounds"] if r["round"] == 2), res["rounds"][-1]
    # then the head round: every classifier solved (the final one and every exit), each checked on its own by the
    # clients, through it; a classifier they score lower keeps its trained weights
    record = head["fusion-info"]["head-round"]
    assert head["round"] == 3 and record["valid"] == 4 and set(record["temperature"]) == {"", "1", "2", "3"}
    assert set(record["sites"]) == {"final", "1", "2", "3"} and record["kept"] == record["sites"]["final"]["kept"]
    assert all(set(s["client-accuracy"]) == {"before", "head"} for s in record["sites"].values())
    assert last["valid-replies"] == 4 and last["rejected"] == [] and last["failures"] == []
    labels = {"1x1", "1x0.75", "1x0.5", "1x0.25"}
    assert set(last["tier-accuracy"]) == labels and set(last["tier-clients"]) == labels
    b = last["tier-bytes-sent"]   # each node receives only the blocks and exits its depth holds
    assert b["1x1"] > b["1x0.75"] > b["1x0.5"] > b["1x0.25"] > 0
    assert last["test-accuracy"] == pytest.approx(last["tier-accuracy"]["1x1"])
    assert last["test-accuracy"] > 0.15 and 0 < last["exit-ensemble-accuracy"] <= 1   # chance 0.1


def test_two_round_depth_tiers_end_to_end(depth_run):
    """DepthFL's two-round run (the in-process run above; sub-models of their own shape per node through a real
    ``flwr run``: ``tests/test_tiers_flower.py``'s shared run, which the in-process engine's equality test compares
    against)."""
    res = json.loads((depth_run("depthfl") / "results.json").read_text())
    assert res["status"] == "completed"
    last = res["rounds"][-1]
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


# ------------------------------------------------------------------------- InclusiveFL (arXiv 2202.08036)
def test_momentum_distillation_rule_on_constructed_tensors():
    me = _me()   # MLP 40 -> 16 x 4: unit 1 is [16, 40], units 2-4 are [16, 16]
    layers = [unit_arrays(me, j)[0] for j in (1, 2)]
    assert layers[0] == {"layer.weight": "base.1.weight", "layer.bias": "base.1.bias"}
    deeper = {key: torch.full(me.state_dict()[key].shape, float(j)) for j, layer in enumerate(layers, 1)
              for key in layer.values()}
    m, skipped = layer_momentum(deeper, layers)
    assert set(m) == {"base.1.weight", "base.1.bias"}
    assert torch.equal(m["base.1.bias"], torch.full((16,), 1.5))      # mean of the two layers' biases
    assert torch.equal(m["base.1.weight"], torch.full((16, 40), 1.0))  # [16, 16] of layer 2 left out, said why
    assert skipped == ["base.1.weight: base.3.weight is (16, 16), not (16, 40)"]
    same = [unit_arrays(me, j)[0] for j in (2, 3, 4)]                   # equal shapes: the mean over all three
    m2, skipped2 = layer_momentum({k: torch.full((16,) * (2 if k.endswith("weight") else 1), float(j))
                                   for j, layer in enumerate(same, 2) for k in layer.values()}, same)
    assert skipped2 == [] and torch.equal(m2["base.3.weight"], torch.full((16, 16), 3.0))
    with pytest.raises(ValueError, match="holds no 'base.1.bias'"):
        layer_momentum({"base.1.weight": deeper["base.1.weight"]}, layers)

    torch.manual_seed(0)
    g = {k: torch.randn(v.shape) for k, v in me.state_dict().items() if k in held_keys(me, 1, own_exit=True)}
    state = {k: v + torch.randn(v.shape) for k, v in g.items()}
    out = momentum_distill(g, state, m, 0.2)
    for key in m:   # the top layer: (1 - beta) x its own update + beta x the momentum
        assert torch.allclose(out[key] - g[key], 0.8 * (state[key] - g[key]) + 0.2 * m[key], atol=1e-6)
    assert all(torch.equal(out[k], state[k]) for k in state if k not in m)
    still = momentum_distill(g, dict(g), m, 0.2)   # a client that did not move gets exactly beta x the momentum
    assert all(torch.allclose(still[k] - g[k], 0.2 * m[k], atol=1e-6) for k in m)
    assert all(torch.equal(momentum_distill(g, state, m, 0.0)[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="beta must be a number in \\[0, 1\\]"):
        momentum_distill(g, state, m, 1.5)
    with pytest.raises(ValueError, match="'base.3.bias' is not an array"):
        momentum_distill(g, state, {"base.3.bias": torch.zeros(16)}, 0.2)


def test_a_vit_top_block_pairs_by_name_and_its_embedding_takes_no_momentum():
    named, other = unit_arrays(_me("vit"), 1)
    assert "attn.qkv.weight" in named and named["attn.qkv.weight"] == "base.blocks.0.attn.qkv.weight"
    assert set(other) == {"base.cls_token", "base.pos_embed", "base.patch_embed.proj.weight",
                          "base.patch_embed.proj.bias"}
    me = _me()
    assert [k for k in held_keys(me, 2, own_exit=True) if k.startswith("exits.")] == ["exits.2.fc.weight",
                                                                                        "exits.2.fc.bias"]
    assert not any(k.startswith("exits.") for k in held_keys(me, 4, own_exit=True))


def _inclusive_round(beta):
    from fedfuse.flower.tiers.depth_tiers import DepthFLFedAvgStrategy, InclusiveFLStrategy
    from fedfuse.flower.round.replies import ClientUpdate

    def model_fn():   # the same global model every call (the exits' initialisation draws from torch's generator)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return _me()

    depths = (1.0, 0.75, 0.5, 0.25)
    s = InclusiveFLStrategy(model_fn=model_fn, depths=depths, mom_beta=beta)
    fedavg = DepthFLFedAvgStrategy(model_fn=model_fn, depths=depths)
    for strat in (s, fedavg):
        strat.tier_layout.node_depth = {1: 1.0, 2: 0.5, 3: 0.25}
    g = s.global_state()
    torch.manual_seed(1)
    updates = [ClientUpdate(n, n, {k: g[k] + torch.randn(g[k].shape) for k in s.layout.held[s.node_units(n)]}, None, 10, {})
               for n in (1, 2, 3)]
    return s, fedavg, g, updates


def test_inclusivefl_server_step_beta_0_is_depthfl_fedavg_and_beta_mixes_the_shallow_top_layer():
    s, fedavg, g, ups = _inclusive_round(0.0)
    step = s.momentum_distillation   # InclusiveFL's step, held by the depth-tier strategy
    assert step.update(g, ups, s.node_units) == [1, 3]   # tier 2's deeper tier (3 units) sent nothing: no momentum
    assert set(step.momentum[1]) == {"base.1.weight", "base.1.bias"}
    avg0, ref = s.average(ups), fedavg.average(ups)
    assert all(torch.equal(avg0[k], ref[k]) for k in ref)                 # beta 0: DepthFL-fedavg's average

    s, _, g, ups = _inclusive_round(0.2)
    s.momentum_distillation.update(g, ups, s.node_units)
    m = s.momentum_distillation.momentum[1]
    d2 = {k: ups[1].state[k] - g[k] for k in ups[1].state}               # the 2-unit client: the next deeper tier
    assert torch.allclose(m["base.1.bias"], (d2["base.1.bias"] + d2["base.3.bias"]) / 2, atol=1e-6)
    assert torch.allclose(m["base.1.weight"], d2["base.1.weight"], atol=1e-6)
    avg = s.average(ups)
    x = [u.state for u in ups]
    shallow_top = g["base.1.bias"] + 0.8 * (x[2]["base.1.bias"] - g["base.1.bias"]) + 0.2 * m["base.1.bias"]
    assert torch.allclose(avg["base.1.bias"], (x[0]["base.1.bias"] + x[1]["base.1.bias"] + shallow_top) / 3,
                          atol=1e-6)
    assert torch.allclose(avg["base.3.bias"], (x[0]["base.3.bias"] + x[1]["base.3.bias"]) / 2, atol=1e-6)
    assert torch.equal(avg["exits.1.fc.bias"], x[2]["exits.1.fc.bias"])   # each exit: its own tier's clients only
    with pytest.raises(ValueError, match="mom-beta must be a number in \\[0, 1\\]"):
        _inclusive_round(1.5)


def test_inclusivefl_options_and_client_fail_or_train_their_own_exit():
    from fedfuse.flower.tiers.client_tiers import DEPTH_KEY, OWN_EXIT_KEY, depth_tier

    assert parse_run_config({**TINY, "strategy": "inclusivefl", "mom-beta": 0.5}).mom_beta == 0.5
    with pytest.raises(ConfigError, match="'strategy-options.mom-beta' applies to strategy inclusivefl only"):
        parse_run_config({**TINY, "strategy": "depthfl", "mom-beta": 0.5})
    with pytest.raises(ConfigError, match="mom-beta"):
        parse_run_config({**TINY, "strategy": "inclusivefl", "mom-beta": 1.5})
    with pytest.raises(ConfigError, match="client-tiers.*needs depth tiers"):
        parse_run_config({**TINY, "strategy": "inclusivefl", "client-tiers": ""})
    server = _me(seed=1)
    sent = {k: server.state_dict()[k] for k in held_keys(server, 2, own_exit=True)}
    model, loss_fn, keys = depth_tier(_me(seed=2), {DEPTH_KEY: 2, OWN_EXIT_KEY: True}, sent)
    x, y = torch.randn(4, 40), torch.tensor([0, 1, 2, 3])
    assert set(keys) == set(sent) and torch.allclose(loss_fn(x, y), F.cross_entropy(model(x), y))
    with pytest.raises(ValueError, match="depth-2 model holds other arrays"):
        depth_tier(_me(), {DEPTH_KEY: 2, OWN_EXIT_KEY: True}, {k: server.state_dict()[k] for k in held_keys(server, 2)})


# ------------------------------------------------------------------------------------ one-shot: aligning depths
def _permuted_client(model: MultiExit, units: int, seed: int) -> MultiExit:
    """A copy of ``model`` holding ``units`` depth units with every hidden layer's units in another order (its
    exits' inputs with them): the same function, as a client trained from another initialisation could be."""
    from fedfuse.fusion.permute import build_spec, permute_model, random_perms

    spec = build_spec(model.base)
    perms = random_perms(spec, seed=seed)
    client = copy.deepcopy(model)
    client.base = permute_model(model.base, perms)
    lvls, du = model._levels(), depth_units(model.base)
    for e in model.exit_units:
        group = next(g for g, grp in spec.groups.items() if lvls[du[e - 1]].name in grp.levels)
        with torch.no_grad():
            client.exits[str(e)].fc.weight.copy_(model.exits[str(e)].fc.weight[:, perms[group]])
            if isinstance(model.exits[str(e)].norm, torch.nn.LayerNorm):   # a ViT exit's norm moves with the stream
                client.exits[str(e)].norm.weight.copy_(model.exits[str(e)].norm.weight[perms[group]])
                client.exits[str(e)].norm.bias.copy_(model.exits[str(e)].norm.bias[perms[group]])
    return client.set_active(units)


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_align_depths_undoes_the_clients_unit_orders_at_every_depth(family):
    """Sequential and residual families (a ResNet's stage streams, a ViT's one stream and its heads): a truncated
    client is matched on the activation points it holds."""
    from fedfuse.hetero.depth import align_depths

    ref = _me(family, seed=3).set_active(4).eval()
    x = torch.randn(200, *SHAPES[family], generator=torch.Generator().manual_seed(0))
    clients = [ref, _permuted_client(ref, 2, seed=1), _permuted_client(ref, 1, seed=2), _permuted_client(ref, 4, 5)]
    with torch.no_grad():   # each permuted client computes its exits' function unchanged
        for c in clients[1:]:
            assert torch.allclose(c(x), copy.copy(ref).set_active(c.active)(x), atol=1e-5)
        assert not all(torch.allclose(clients[1].state_dict()[k], v) for k, v in ref.state_dict().items())
    aligned = align_depths(clients, [c.active for c in clients], x)
    want = ref.state_dict()
    for c, state in zip(clients, aligned):
        for key in held_keys(ref, c.active):   # every array a client holds is back in the reference's units
            torch.testing.assert_close(state[key], want[key], rtol=0, atol=1e-6)
    # the layer-wise average of the aligned clients is the reference itself; of the unaligned ones it is not
    avg = aggregate_held(want, [{k: s[k] for k in held_keys(ref, c.active)} for c, s in zip(clients, aligned)])
    assert all(torch.allclose(avg[k], want[k], atol=1e-6) for k in want)
    plain = aggregate_held(want, [{k: c.state_dict()[k] for k in held_keys(ref, c.active)} for c in clients])
    assert not all(torch.allclose(plain[k], want[k], atol=1e-3) for k in want)


def test_one_shot_depth_tier_ot_run_inprocess(tmp_path):
    """One-shot depth tiers with ``ot`` (aligned layer-wise average, then the ensemble distilled into every exit), then
    the head round solving every exit's classifier: the run completes with every tier's classifier above chance."""
    from fedfuse.flower.runner.inprocess import run_inprocess

    cfg = {**TINY, "mode": "one-shot", "num-server-rounds": 1, "local-epochs": 3, "strategy": "ot",
           "output-dir": str(tmp_path), "run-name": "d"}
    out = run_inprocess(cfg, 4, echo=False)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed", res.get("error")
    fused, last = next(r for r in res["rounds"] if r["round"] == 1), res["rounds"][-1]
    assert fused["valid-replies"] == 4 and "exit-distill" in json.dumps(fused["fusion-info"])
    head = last["fusion-info"]["head-round"]   # round 2: the head round, every node answering for every exit
    assert head["valid"] == 4 and head["rejected"] == [] and set(head["temperature"]) == {"", "1", "2", "3"}
    assert set(last["tier-accuracy"]) == set(fused["tier-accuracy"])
    if head["kept"] == "head":   # the tiers' evaluation reads the head round's model, not the fused one
        assert last["tier-accuracy"] != fused["tier-accuracy"]
    assert min(last["tier-accuracy"].values()) > 0.15   # chance 0.1


@pytest.mark.parametrize("mode,model,want", [("multi-round", "mlp", "average"), ("one-shot", "mlp", "ot"),
                                             ("one-shot", "cnn", "ot"), ("one-shot", "resnet", "ot"),
                                             ("one-shot", "vit", "feddf")])
def test_the_depth_tier_default_aligns_one_shot_clients(mode, model, want):
    """strategy='auto' with depth tiers: the layer-wise average in multi-round FL; in one-shot mode (clients from their
    own initialisations, whose plain average is at chance) 'ot' where measured best (MLP, CNN, ResNet), else 'feddf'."""
    cfg = {**TINY, "strategy": "auto", "mode": mode, "model": model,
           **({"num-server-rounds": 1} if mode == "one-shot" else {})}
    with pytest.warns(UserWarning, match=f"uses '{want}'"):
        assert parse_run_config(cfg).strategy == want


# ------------------------------------------------------------------------------- width x depth tiers
WXD = "1x1,1x0.5,0.5x0.5"


def test_width_x_depth_config_parses_widths_and_fails_naming_the_key():
    cfg = parse_run_config({**TINY, "strategy": "average", "client-tiers": WXD})
    assert cfg.depth_tiers == (1.0, 0.5, 0.5) and cfg.depth_tier_widths == (1.0, 1.0, 0.5) and cfg.tiers == ()
    assert parse_run_config({**TINY, "strategy": "depthfl"}).depth_tier_widths == (1.0,) * 4
    # ordered dropout is a width x depth option; with depth tiers at full width it stays refused
    parse_run_config({**TINY, "strategy": "average", "client-tiers": WXD, "ordered-dropout": "off",
                      "ordered-dropout-draw": "uniform"})
    with pytest.raises(ConfigError, match="'tier-options.ordered-dropout'.*full width"):
        parse_run_config({**TINY, "strategy": "average", "ordered-dropout": "off"})
    with pytest.raises(ConfigError, match="'tier-options.ordered-dropout-draw'.*needs capacity tiers with ordered dropout"):
        parse_run_config({**TINY, "strategy": "average", "client-tiers": WXD, "ordered-dropout": "off",
                          "ordered-dropout-draw": "width"})
    # one-shot: ot aligns models of one width, so the default distils
    with pytest.warns(UserWarning, match="uses 'feddf'"):
        assert parse_run_config({**TINY, "strategy": "auto", "client-tiers": WXD, "mode": "one-shot",
                                 "num-server-rounds": 1}).strategy == "feddf"


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_a_narrow_multi_exit_is_the_top_left_slice_of_the_global_one(family):
    from fedfuse.hetero import slice_state
    from fedfuse.hetero.depth import exit_submodel

    me = _me(family, depths=(1, 0.5))
    narrow = me.at_width_mult(0.5, input_shape=SHAPES[family])
    assert narrow.exit_units == me.exit_units and narrow.num_units == me.num_units
    sub = exit_submodel(me, narrow)
    state = slice_state(me.state_dict(), sub)
    narrow.load_state_dict(state)   # every array of the narrow model, of its shape
    w = me.state_dict()["exits.2.fc.weight"]   # [classes, level width]: its first inputs
    assert torch.equal(state["exits.2.fc.weight"], w[:, :narrow.state_dict()["exits.2.fc.weight"].shape[1]])
    assert 0 < sub.held_fraction() < 0.5
    narrow.set_active(2).eval()
    assert narrow(torch.randn(3, *SHAPES[family])).shape == (3, 10)
    with pytest.raises(ValueError, match="exits"):
        exit_submodel(me, _me(family, depths=(1, 0.75)).at_width_mult(0.5, input_shape=SHAPES[family]))


def test_narrow_copy_and_which_narrower_widths_read_each_classifier():
    """``narrow_copy``: the model as a width × depth node receives it (the slice of every array); ``classifier_readers``:
    the narrower widths holding each classifier (exits at or below their depth, the final one at full depth)."""
    from fedfuse.hetero import slice_state
    from fedfuse.hetero.depth import classifier_readers, exit_submodel, narrow_copy

    me = _me("mlp", depths=(1, 0.5))
    narrow = narrow_copy(me, 0.5, SHAPES["mlp"])
    want = slice_state(me.state_dict(), exit_submodel(me, narrow))
    assert all(torch.equal(v, want[k]) for k, v in narrow.state_dict().items())
    same = narrow_copy(me, 1)
    assert same is not me and all(torch.equal(v, me.state_dict()[k]) for k, v in same.state_dict().items())
    assert classifier_readers(me, [(1, 1), (1, 0.5), (0.5, 0.5)]) == {"2": [0.5]}
    assert classifier_readers(me, [(1, 1), (0.5, 1), (0.25, 0.5)]) == {"": [0.5], "2": [0.25, 0.5]}
    assert classifier_readers(me, [(1, 1), (1, 0.5)]) == {}


def test_width_x_depth_average_is_per_entry_over_the_nodes_that_hold_it():
    g = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "n": torch.tensor(7)}
    full = {"a": torch.ones(2, 3), "b": torch.full((4,), 2.0)}
    narrow = {"a": torch.full((1, 2), 5.0)}   # the top-left [1, 2] of "a"; no "b" (a shallower tier)
    pos = {"a": torch.tensor([[0, 1]])}
    out = aggregate_held(g, [full, narrow], [1.0, 3.0], [None, pos])
    want = torch.ones(2, 3)
    want[0, :2] = (1 * 1 + 3 * 5) / 4
    assert torch.allclose(out["a"], want) and torch.equal(out["b"], full["b"]) and out["n"] == 7
    # without positions: DepthFL's layer-wise average, as before
    assert torch.equal(aggregate_held(g, [full], [1.0])["a"], full["a"])
    with pytest.raises(ValueError, match="sub-model"):
        aggregate_held(g, [{"a": torch.ones(2, 2)}], [1.0], [pos])


def test_width_x_depth_node_tier_from_the_run_or_its_node_config():
    from fedfuse.flower.tiers.client_tiers import node_width_depth

    depths, widths = [1.0, 0.5, 0.5], [1.0, 1.0, 0.5]
    assert [node_width_depth(_context({"partition-id": p}), depths, widths)[1:] for p in range(4)] == \
        [(1.0, 1.0), (1.0, 0.5), (0.5, 0.5), (1.0, 1.0)]
    assert node_width_depth(_context({"partition-id": 0, "tier": "0.25x0.5"}), depths, widths) == (0, 0.25, 0.5)
    with pytest.raises(ValueError, match="node-config key 'tier'.*depth one of"):
        node_width_depth(_context({"partition-id": 0, "tier": "0.5x0.3"}), depths, widths)


def test_width_x_depth_client_trains_nested_widths_over_its_exits_and_only_its_entries():
    from fedfuse.flower.tiers.client_tiers import DEPTH_KEY, OD_DRAW_KEY, OD_KEY, TIER_KEY, depth_tier, tier_model
    from fedfuse.hetero import slice_state
    from fedfuse.hetero.depth import exit_submodel

    server = _me(depths=(1, 0.5), seed=1)
    config = {DEPTH_KEY: 2, TIER_KEY: 0.5, OD_KEY: [0.25], OD_DRAW_KEY: "uniform"}
    model = tier_model(_me(depths=(1, 0.5), seed=2), config, seed=0, input_shape=(40,))
    sent = {k: v for k, v in slice_state(server.state_dict(), exit_submodel(server, model)).items()
            if k in held_keys(model, 2)}
    model, loss_fn, keys = depth_tier(model, config, sent, base=server, seed=3, input_shape=(40,))
    assert model.active == 2 and set(keys) == set(sent) and model.state_dict()["base.1.weight"].shape[0] == 8
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 40), torch.randint(0, 10, (16,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(12):
        opt.zero_grad()
        loss_fn(x, y).backward()
        opt.step()
    od = next(c.cell_contents for c in loss_fn.__closure__ if type(c.cell_contents).__name__ == "OrderedDropout")
    assert od.draws[0] > 0 and od.draws[1] > 0   # its own width and the nested 0.25 both trained
    after = model.state_dict()
    assert not torch.equal(after["base.1.weight"], before["base.1.weight"])
    # arrays beyond its depth are untouched (not held, not trained)
    assert all(torch.equal(after[k], before[k]) for k in after if k not in keys)
    with pytest.raises(ValueError, match="narrower than the node's tier"):
        depth_tier(tier_model(_me(depths=(1, 0.5)), config, seed=0, input_shape=(40,)), {**config, OD_KEY: [0.5]},
                   None, base=server)


def test_width_x_depth_strategy_sends_each_node_its_slice_and_validates_its_shapes():
    from fedfuse.flower.tiers.depth_tiers import build_depth_strategy as build_strategy

    fn = lambda: _me(depths=(1, 0.5))   # noqa: E731
    with pytest.raises(ValueError, match="'inclusivefl' cannot aggregate width x depth"):
        build_strategy("inclusivefl", model_fn=fn, depths=(1.0, 0.5), widths=(1.0, 0.5))
    s = build_strategy("average", model_fn=fn, depths=(1.0, 0.5, 0.5), widths=(1.0, 1.0, 0.5), input_shape=(40,))
    assert s.ordered_dropout == "all" and s.ordered_dropout_draw == "width"
    assert build_strategy("depthfl", model_fn=fn, depths=(1.0, 0.5), widths=(1.0, 0.5)).ordered_dropout == "off"
    assert build_strategy("average", model_fn=fn, depths=(1.0, 0.5)).ordered_dropout == "off"   # no narrow tier
    s.tier_layout.node_depth, s.tier_layout.node_tier = {1: 0.5, 2: 0.5}, {1: 1.0, 2: 0.5}
    ref1, _ = s.reply_reference(1, 1)
    ref2, _ = s.reply_reference(1, 2)
    assert set(ref1) == set(ref2) == set(held_keys(fn(), 2))
    assert ref1["base.1.weight"][0] == (16, 40) and ref2["base.1.weight"][0] == (8, 40)
    narrow = fn().at_width_mult(0.5)
    state = {k: narrow.state_dict()[k] for k in ref2}
    m = s.build_model(state)
    assert isinstance(m, MultiExit) and m.active == 2 and m.state_dict()["base.1.weight"].shape == (8, 40)
    full = s.global_state()
    sliced = s.layout.state(full, 0.5, 2)
    assert torch.equal(sliced["base.1.weight"], full["base.1.weight"][:8])


@pytest.mark.parametrize("strategy", ["average", "depthfl"])
def test_two_round_width_x_depth_run_inprocess(tmp_path, strategy):
    from fedfuse.flower.runner.inprocess import run_inprocess

    cfg = {**TINY, "strategy": strategy, "client-tiers": WXD, "output-dir": str(tmp_path), "run-name": "wd"}
    out = run_inprocess(cfg, 4, echo=False)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed"
    last = next(r for r in res["rounds"] if r["round"] == 2)
    assert last["valid-replies"] == 4 and last["rejected"] == [] and last["failures"] == []
    labels = {"1x1", "1x0.5", "0.5x0.5"}
    assert set(last["tier-accuracy"]) == labels and set(last["tier-clients"]) == labels
    b = last["tier-bytes-sent"]   # the narrow shallow node receives the slice of the shallow tier's arrays
    assert b["1x1"] / 2 > b["1x0.5"] > b["0.5x0.5"] > 0   # partitions 0 and 3 are full
    assert last["test-accuracy"] > 0.15   # chance 0.1
    # the head round checks each classifier of the full width, and the narrow width's own exit (the one its tier
    # uses) solved on its own features and checked at its width; the narrow tier's result is its own model's
    head = next(h for h in res["strategy-history"] if h.get("post-step") == "head-round")["fusion-info"]["head-round"]
    assert set(head["sites"]) == {"final", "2"} and set(head["tiers"]) == {"1", "0.5"}
    narrow = head["tiers"]["0.5"]["sites"]
    assert set(narrow) == {"2"} and set(narrow["2"]["client-accuracy"]) == {"before", "head"}
    assert narrow["2"]["kept"] == ("head" if narrow["2"]["client-accuracy"]["head"]
                                   >= narrow["2"]["client-accuracy"]["before"] else "before")
    final = res["rounds"][-1]
    assert set(final["tier-accuracy"]) == labels and final["tier-accuracy"]["0.5x0.5"] > 0.15


@pytest.mark.parametrize("tiers,fusion", [("1x1,1x0.75,1x0.5,1x0.25", "ot"), (WXD, "feddf")])
def test_warm_start_across_depth_tiers_inprocess(tmp_path, tiers, fusion):
    """mode='warm-start' with depth tiers: round 1 combines the clients' own models of several depths (and widths)
    with the depth strategy's one-shot aggregation (the default's choice, warned), then multi-round FL goes on."""
    from fedfuse.flower.runner.inprocess import run_inprocess

    cfg = {**TINY, "strategy": "average", "client-tiers": tiers, "mode": "warm-start", "num-server-rounds": 3,
           "warm-start-epochs": 3, "output-dir": str(tmp_path), "run-name": "w"}
    with pytest.warns(UserWarning, match=f"warm-start-options.fusion.*{fusion!r}"):
        assert parse_run_config(cfg).warm_start_fusion == fusion
    out = run_inprocess(cfg, 4, echo=False)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed", res.get("error")
    first, last = res["strategy-history"][0], next(r for r in res["rounds"] if r["round"] == 3)
    assert first["method"] == f"warm-start:{fusion}" and first["valid"] == 4
    assert "exit-distill" in json.dumps(first["fusion-info"])   # both distil the ensemble into every exit
    assert sorted(p.name for p in (out / "warm-start").glob("client-*.pt")) == [f"client-{i}.pt" for i in range(4)]
    assert last["valid-replies"] == 4 and min(last["tier-accuracy"].values()) > 0.15   # chance 0.1


# ------------------------------------------------------------------------- every family x every tier shape lives
@pytest.mark.parametrize("tiers", ["1x1,1x0.5", "1x1,0.5x1", "1x1,1x0.5,0.5x0.5"])
@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet", "vit"])   # lenet: the sequential family (needs 16x16+)
def test_every_model_family_survives_every_tier_shape(tmp_path, model, tiers):
    """Two rounds of the tiered default (``average``, server momentum 0.5) on digits (IID: one client holds the
    deepest, widest tier, so its exit learns from one client's data): the global model's test loss
    stays finite and its accuracy above chance for every family and tier shape. ResNet depth tiers used to die in
    round 2 (the momentum step extrapolated BatchNorm's running variance below zero) and ResNet width tiers to
    crash (the pruned units' permutation of the velocity asked for its BatchNorm buffers)."""
    from fedfuse.flower.runner.inprocess import run_inprocess

    size = {"resnet": {"model-width": 16}}.get(model, {"model-width": 32})
    cfg = {"dataset": "digits", "model": model, **size, "client-tiers": tiers, "num-clients": 3,
           "partitioning": "iid", "num-server-rounds": 2, "local-epochs": 2,
           "importance": "uniform", "head-round": False, "strategy": "average", "output-dir": str(tmp_path),
           "run-name": "t"}
    out = run_inprocess(cfg, 3, echo=False)
    last = json.loads((out / "results.json").read_text())["rounds"][-1]
    assert last["round"] == 2 and math.isfinite(last["test-loss"]), last
    assert last["test-accuracy"] > 0.2, last   # chance 0.1


def test_width_x_depth_narrow_models_get_static_batchnorm_on_the_fusion_set():
    """A narrower width's model (evaluated each round, and the head round's own model of that width) has its
    BatchNorm statistics re-estimated on the fusion set (HeteroFL's static BN, as width tiers' models): the
    aggregate's are averaged over nodes of other widths. Without a fusion set it stays the global model's slice."""
    from fedfuse.flower.tiers.depth_tiers import build_depth_strategy as build_strategy
    from fedfuse.hetero import reestimate_batchnorm
    from fedfuse.hetero.depth import multi_exit, narrow_copy

    fn = lambda: multi_exit(build_model("resnet", 10, (1, 8, 8), width=8, depth=2, seed=1), [1, 0.5], 10)  # noqa: E731
    x = torch.rand(40, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    s = build_strategy("average", model_fn=fn, depths=(1.0, 0.5), widths=(1.0, 0.5), input_shape=(1, 8, 8))
    model = fn()
    plan = s.head_plan(model, 3, one_shot=False)   # no fusion set: the slice as it is
    sliced = narrow_copy(model, 0.5, (1, 8, 8))
    key = next(k for k in sliced.state_dict() if k.endswith("running_var"))
    assert torch.equal(plan.models[0.5].state_dict()[key], sliced.state_dict()[key])
    s.fusion_inputs = x
    plan = s.head_plan(model, 3, one_shot=False)
    want = reestimate_batchnorm(sliced.set_active(sliced.num_units), x) and sliced
    got = plan.models[0.5]
    assert got.active == sliced.active and plan.sites[0.5] == ("1",)
    assert all(torch.allclose(got.state_dict()[k], want.state_dict()[k]) for k in want.state_dict()
               if "running" in k)
    assert not torch.equal(got.state_dict()[key], narrow_copy(model, 0.5, (1, 8, 8)).state_dict()[key])
    assert plan.models[1.0] is model   # the full width keeps the aggregate's statistics
