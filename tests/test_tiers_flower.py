"""Capacity tiers on Flower (issue 13): tier assignment, per-node tier messages, tier strategies end to end."""

import json

import pytest
from flwr.app import Context, RecordDict

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.flower.tiers.client_tiers import node_tier, tier_model
from fedfuse.models import build_model, levels
from tests.support.shared_runs import TIERS as TINY   # the real run's config too (tiers_flwr_run)


def _context(node_config, run_config):
    return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config)


def test_tier_assignment_round_robin_and_node_config_override():
    rc = {"client-tiers": "1,0.5,0.25", "num-clients": 5, "strategy": "kf-linear"}
    assert [node_tier(_context({"partition-id": p, "num-partitions": 5}, rc))[1] for p in range(5)] == \
        [1.0, 0.5, 0.25, 1.0, 0.5]
    assert node_tier(_context({"partition-id": 0, "num-partitions": 5, "tier": 0.125}, rc)) == (0, 0.125)
    with pytest.raises(ValueError, match="node-config key 'tier'"):
        node_tier(_context({"partition-id": 0, "num-partitions": 5, "tier": "2"}, rc))
    assert node_tier(_context({"partition-id": 2, "num-partitions": 5}, {}))[1] == 1.0   # no tiers: full width


def test_bad_client_tiers_fail_in_preflight_naming_the_key():
    for tiers in ("1,0", "1,abc", "0.5,0.25", "1,1.5"):
        with pytest.raises(ConfigError, match="client-tiers"):
            parse_run_config({"client-tiers": tiers, "strategy": "kf-linear"})
    with pytest.raises(ConfigError, match="client-tiers.*cannot aggregate clients of different widths"):
        parse_run_config({"client-tiers": "1,0.5", "strategy": "fedavg"})
    with pytest.raises(ConfigError, match="tier-options.models"):
        parse_run_config({"client-tiers": "1,0.5", "strategy": "ot", "tier-models": "fuse"})
    assert parse_run_config({"client-tiers": "1, 0.5", "strategy": "heterofl"}).client_tiers == "1, 0.5"
    # sub-model averaging strategies take tiers; their tier models are slices (or distilled slices), never fused
    assert parse_run_config({"client-tiers": "1,0.5", "strategy": "average"}).strategy == "average"
    assert parse_run_config({"client-tiers": "1,0.5", "strategy": "feddf", "tier-models": "distill"})
    with pytest.raises(ConfigError, match="tier-options.models"):
        parse_run_config({"client-tiers": "1,0.5", "strategy": "average", "tier-models": "fuse"})


def test_client_builds_the_tier_it_is_sent():
    g = build_model("cnn", 10, (1, 40))
    small = tier_model(g, {"tier-width-mult": 0.25}, seed=0, input_shape=(1, 40))
    assert [lv.width for lv in levels(small)] == [4, 8, 10]
    assert tier_model(g, {}, seed=0, input_shape=(1, 40)) is g


@pytest.mark.parametrize("strategy,extra", [("kf-linear", {}), ("kf-linear", {"tier-models": "fuse"}),
                                            ("heterofl", {}), ("fedrolex", {}), ("average", {}), ("feddf", {}),
                                            ("average", {"tier-models": "distill"})])
def test_two_round_tier_run_inprocess(tmp_path, strategy, extra):
    from fedfuse.flower.runner.inprocess import run_inprocess

    out = run_inprocess({**TINY, **extra, "strategy": strategy, "output-dir": str(tmp_path), "run-name": "t"}, 3,
                        echo=False)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed"
    *_, last, head = res["rounds"]   # the last training round, then the head round (head-round=true, the default)
    # every node got its tier's model: all replies valid against their tier's shapes
    assert last["valid-replies"] == 3 and last["rejected"] == [] and last["failures"] == []
    assert set(last["tier-accuracy"]) == {"1", "0.5", "0.25"}
    assert last["tier-clients"] == {"1": 1, "0.5": 1, "0.25": 1}
    b = last["tier-bytes-sent"]
    assert b["1"] > b["0.5"] > b["0.25"] > 0
    assert last["test-accuracy"] == pytest.approx(last["tier-accuracy"]["1"])
    assert last["test-accuracy"] > 0.15                              # chance 0.1 (MNIST-1D, 2 short rounds)
    assert set(last["tier-val-accuracy"]) == {"1", "0.5", "0.25"}
    assert set(last["tier-train-seconds"]) == {"1", "0.5", "0.25"}
    import csv

    with (out / "rounds.csv").open() as f:
        csv_last = list(csv.DictReader(f))[-2]   # the last training round's row
    for t in ("1", "0.5", "0.25"):   # the tier records as rounds.csv columns
        assert float(csv_last[f"tier-{t}-test-accuracy"]) == pytest.approx(last["tier-accuracy"][t])
        assert int(csv_last[f"tier-{t}-clients"]) == 1 and float(csv_last[f"tier-{t}-bytes-sent"]) > 0
    assert all(s > 0 for s in last["tier-train-seconds"].values())
    # the head round: every tier's classifier solved from every node's statistics, each checked by the clients
    record = head["fusion-info"]["head-round"]
    assert head["round"] == 3 and record["valid"] == 3 and record["rejected"] == [] and record["fallback"] is None
    assert set(record["tiers"]) == {"1", "0.5", "0.25"} and record["kept"] == record["tiers"]["1"]["kept"]
    assert all(set(t["client-accuracy"]) == {"before", "head"} for t in record["tiers"].values())
    assert head["test-accuracy"] == pytest.approx(head["tier-accuracy"]["1"])   # tier 1 is the global model
    for t, tier in record["tiers"].items():
        if tier["kept"] == "before":   # a tier the clients score lower with its solved head keeps its model
            assert head["tier-accuracy"][t] == pytest.approx(last["tier-accuracy"][t])
    # every narrower tier's final model is saved beside the global one, in its tier's architecture
    import torch

    for t in ("0.5", "0.25"):
        state = torch.load(out / f"tier-{t}_model.pt")
        small = tier_model(build_model("mlp", 10, (40,), width=32, depth=1), {"tier-width-mult": float(t)}, seed=0,
                           input_shape=(40,))
        small.load_state_dict(state)
        assert small[1].out_features == int(32 * float(t))   # Flatten, then the hidden Linear


@pytest.mark.slow
def test_flwr_run_two_round_tiers(tiers_flwr_run):
    """kf-linear over width tiers through a real ``flwr run`` (the session's shared run, ``tiers_flwr_run``: the
    in-process engine's equality test compares against it too)."""
    assert tiers_flwr_run.config == {**TINY, "strategy": "kf-linear"} and tiers_flwr_run.num_supernodes == 3
    res = tiers_flwr_run.results
    last = res["rounds"][-1]
    assert last["valid-replies"] == 3 and last["rejected"] == []
    assert set(last["tier-accuracy"]) == {"1", "0.5", "0.25"}


def _strategy(name, model="mlp", model_kw=None, **kw):
    import torch

    from fedfuse.flower.tiers.tiered import build_tier_strategy

    shape = (40,) if model == "mlp" else (1, 40)
    return build_tier_strategy(name, tiers=(1.0, 0.5, 0.25), input_shape=shape,
                               model_fn=lambda: build_model(model, 10, shape, width=16, depth=2, **(model_kw or {})),
                               fusion_inputs=torch.randn(32, *shape), **kw)


def test_width_scaler_only_with_normalisation_layers_and_tiered_defaults():
    # HeteroFL's scaler (x 1/r in training) goes with static BN; an MLP without BN would see its logits x 16 at r=1/4
    assert _strategy("heterofl").width_scaler is False
    assert _strategy("heterofl", model="cnn").width_scaler is False
    assert _strategy("heterofl", model="cnn", model_kw={"batchnorm": True}).width_scaler is True
    assert _strategy("heterofl", width_scaler=True).width_scaler is True
    avg = _strategy("average")
    assert avg.refine_steps == () and avg.momentum_step.momentum == 0.5 and avg.anchor
    assert _strategy("feddf").momentum_step.momentum == 0.0
    with pytest.raises(ValueError, match="tier_models='fuse'"):
        _strategy("average", tier_models="fuse")


def test_tiered_average_is_the_heterofl_average_of_the_replies():
    import torch

    from fedfuse.flower.round.replies import ClientUpdate
    from fedfuse.hetero import aggregate_states

    s = _strategy("average", server_momentum=0.0)
    g = s.skeleton(1.0).state_dict()
    s._global = __import__("fedfuse.flower.round.protocol", fromlist=["state_to_record"]).state_to_record(g)
    ups = []
    for i, r in enumerate((1.0, 0.5, 0.25)):
        state = {k: torch.full_like(v, float(i + 1)) for k, v in s.skeleton(r).state_dict().items()}
        ups.append(ClientUpdate(node_id=i, partition_id=i, num_examples=10 * (i + 1), state=state, metrics={"tier": r},
                                scores=None, class_counts=None))
    res = s.fuse_updates(1, ups)
    want = aggregate_states(g, [u.state for u in ups], [s.layout(u.metrics["tier"], 0) for u in ups], [10, 20, 30])
    for k, v in res.model.state_dict().items():
        assert torch.allclose(v, want[k]), k


def test_tier_guard_replaces_a_diverged_tier_model_by_the_sub_model_average_slice():
    import torch

    from fedfuse.flower.round.replies import ClientUpdate
    from fedfuse.flower.round.protocol import state_to_record
    from fedfuse.hetero import slice_state

    s = _strategy("kf-linear", tier_models="fuse")
    torch.manual_seed(0)
    s.tier_layout.node_tier = {0: 1.0, 1: 0.5, 2: 0.25}
    ups = [ClientUpdate(node_id=i, partition_id=i, num_examples=10, state=s.skeleton(r).state_dict(),
                        metrics={"tier": r}, scores=None, class_counts=None) for i, r in enumerate((1.0, 0.5, 0.25))]
    for i, u in enumerate(ups):   # distinct client models
        u.state.update({k: torch.randn_like(v) * 0.3 for k, v in u.state.items()})
    s._global = state_to_record(s.skeleton(1.0).state_dict())
    good = slice_state(s.weighted_average(ups), s.layout(0.5, 0))
    s.tier_models_step.derived = {}
    s.tier_models_step.derived[0.5] = {k: v * 1e3 for k, v in good.items()}   # a blown-up tier model: guarded
    s.tier_models_step.derived[0.25] = slice_state(s.weighted_average(ups), s.layout(0.25, 0))   # the safe slice itself: kept
    kept = {k: v.clone() for k, v in s.tier_models_step.derived[0.25].items()}
    s.tier_models_step.guarded = {}
    s.guard_tiers(1, ups)
    assert set(s.tier_models_step.guarded) == {"0.5"} and "KL" in s.tier_models_step.guarded["0.5"]
    assert all(torch.equal(s.tier_models_step.derived[0.5][k], good[k]) for k in good)
    assert all(torch.equal(s.tier_models_step.derived[0.25][k], kept[k]) for k in kept)
    s.guard = False
    s.tier_models_step.derived[0.5] = {k: v * 1e3 for k, v in good.items()}
    s.tier_models_step.guarded = {}
    s.guard_tiers(1, ups)
    assert s.tier_models_step.guarded == {}


def test_a_guarded_tier_makes_the_round_use_the_sub_model_average():
    import torch

    from fedfuse.flower.round.replies import ClientUpdate
    from fedfuse.flower.round.protocol import state_to_record

    s = _strategy("kf-linear")
    s.tier_layout.node_tier = {0: 1.0, 1: 0.5, 2: 0.25}
    torch.manual_seed(0)
    ups = [ClientUpdate(node_id=i, partition_id=i, num_examples=10,
                        state={k: torch.randn_like(v) * 0.3 for k, v in s.skeleton(r).state_dict().items()},
                        metrics={"tier": r}, scores=None, class_counts=None) for i, r in enumerate((1.0, 0.5, 0.25))]
    s._global = state_to_record(s.skeleton(1.0).state_dict())
    average = s.weighted_average(ups)
    s._global = state_to_record({k: v * 1e3 for k, v in average.items()})   # a "fused" global whose slices diverged
    s.history.append({"round": 1})
    s.last_updates = ups
    s.derive_tier_models(1, ups)
    assert s.tier_models_step.guarded and s.tier_models_step._tier_fallback is not None
    import fedfuse.flower.round.protocol as base

    orig = base.RoundProtocol.aggregate_train
    base.RoundProtocol.aggregate_train = lambda self, rnd, replies: (self._global, None)
    try:
        arrays, _ = s.aggregate_train(1, [])
    finally:
        base.RoundProtocol.aggregate_train = orig
    got = arrays.to_torch_state_dict()
    assert all(torch.allclose(got[k], average[k]) for k in average)
    assert s.tier_models_step.derived == {} and "tier guard" in s.history[-1]["guard"] and s.tier_models_step._tier_fallback is None
