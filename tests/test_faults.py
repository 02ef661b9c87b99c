"""Faults and bad input in real Flower runs (fault injection is TEST-ONLY support: ``tests/support``).

- ``test_bad_config_*``: a bad strategy / dataset / fusion-set path fails before any client work,
  naming the key (no Flower needed: this is exactly what the ServerApp runs first).
- ``test_simulation_with_faulty_clients``: one ``flwr run`` simulation, 5 clients, 3 rounds, where
  client 1 crashes every round, client 2 sends NaN weights, client 3 sends a wrong shape (round 1),
  negative importance scores (round 2) and an absurd num-examples (round 3), fusion itself fails in
  round 2 (→ configured fallback: weighted averaging), and client 4 crashes in round 3 so that round
  has fewer valid replies than ``min-train-nodes`` (→ skipped with a clear message, not a crash).
  Timeouts and disconnects (a SuperNode killed mid-round) are in ``tests/test_deployment.py``.
  The run uses ``tests/support/fault_app.py`` (fedfuse's apps with ``fault_mod`` and
  ``FusionFaultStrategy`` installed) from a temporary app directory whose run config has ``test-faults``.
- ``test_fault_mod_*`` / ``test_fusion_fault_strategy_*``: the test support itself, without Ray.
"""

import json
import math
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.flower import STRATEGIES, build_strategy
from fedfuse.flower.server_app import setup
from fedfuse.fusion import FusionError
from fedfuse.models import build_model
from fedfuse.flower.runner.flwr_runner import run_app
from tests.support.fault_app import write_fault_app
from tests.support.faults import FAULTS_KEY, FusionFaultStrategy, fault_mod, parse_faults


@pytest.mark.parametrize("override,key", [
    ({"strategy": "fedmagic"}, "strategy"),
    ({"dataset": "imagenet-42"}, "dataset"),
    ({"round-timeout": 0}, "round-timeout"),
    ({"resume": True}, "run-name"),
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        parse_run_config(override, known_strategies=tuple(STRATEGIES))


def test_missing_fusion_set_path_fails_in_setup(tmp_path):
    cfg = parse_run_config({"fusion-set-path": str(tmp_path / "nope.npz"), "num-clients": 2, "model-width": 8},
                           known_strategies=tuple(STRATEGIES))
    with pytest.raises(ValueError, match="fusion-set-path"):
        setup(cfg)


def test_fault_spec_parsing():
    f = parse_faults("2:crash, 3:sleep:4.5@2,*:nan@3,fusion:error")
    assert [(x.target, x.kind, x.seconds, x.round) for x in f] == [
        ("2", "crash", 0.0, None), ("3", "sleep", 4.5, 2), ("*", "nan", 0.0, 3), ("fusion", "error", 0.0, None)]
    assert parse_faults("") == []
    for bad in ("2:boom", "x:crash", "fusion:nan", "3:sleep", "1:crash@x"):
        with pytest.raises(ValueError):
            parse_faults(bad)


def _train_msg(server_round):
    msg = Mock(spec=Message)
    msg.metadata = Mock(message_type="train")
    msg.content = RecordDict({"config": ConfigRecord({"server-round": server_round})})
    return msg


def _reply():
    state = build_model("mlp", 10, (1, 8, 8), width=8, depth=1).state_dict()
    reply = Mock(spec=Message)
    reply.has_error.return_value = False
    reply.content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord({"num-examples": 5}),
                                "importance": ArrayRecord({"1": Array(np.ones(8, np.float32))})})
    return reply


def _context(faults, pid=1, **node):
    return Context(run_id=1, node_id=7, node_config={"partition-id": pid, "num-partitions": 3, **node},
                   state=RecordDict(), run_config={"strategy": "average", FAULTS_KEY: faults})


def test_fault_mod_strips_the_key_and_injects_faults_per_round():
    seen = []

    def call_next(msg, context):
        seen.append(dict(context.run_config))
        return _reply()
    ctx = _context("1:crash@1,1:nan@2,*:neg-scores@3,2:crash")
    with pytest.raises(RuntimeError, match="injected ClientApp crash"):
        fault_mod(_train_msg(1), ctx, call_next)
    out = fault_mod(_train_msg(2), ctx, call_next)
    assert np.isnan(next(iter(out.content["arrays"].values())).numpy()).any()
    out = fault_mod(_train_msg(3), ctx, call_next)
    assert (out.content["importance"]["1"].numpy() < 0).all()
    out = fault_mod(_train_msg(4), ctx, call_next)   # no fault for partition 1 in round 4
    assert all(np.isfinite(a.numpy()).all() for a in out.content["arrays"].values())
    assert seen and all(FAULTS_KEY not in c for c in seen) and ctx.run_config[FAULTS_KEY]  # the app never sees it
    # node-config fault (deployment) wins
    with pytest.raises(RuntimeError, match="crash"):
        fault_mod(_train_msg(1), _context("", pid=0, fault="crash@1"), call_next)


def test_fusion_fault_strategy_makes_fusion_fall_back_in_chosen_rounds():
    def model_fn():
        return build_model("mlp", 10, (1, 8, 8), width=8, depth=1, seed=0)

    def replies():
        out = []
        for nid, seed in [(1, 1), (2, 2)]:
            m = Mock(spec=Message)
            m.metadata = Mock(src_node_id=nid)
            m.has_error.return_value = False
            state = build_model("mlp", 10, (1, 8, 8), width=8, depth=1, seed=seed).state_dict()
            m.content = RecordDict({"arrays": ArrayRecord(state),
                                    "metrics": MetricRecord({"num-examples": 10, "partition-id": nid})})
            out.append(m)
        return out
    inner = build_strategy("average", model_fn=model_fn)
    wrapped = FusionFaultStrategy(inner, rounds={2})
    assert wrapped.aggregate_train(1, replies())[0] is not None and inner.history[-1]["fallback"] is None
    arrays, _ = wrapped.aggregate_train(2, replies())
    assert arrays is None and "injected fusion failure in round 2" in inner.history[-1]["fallback"]
    # a strategy without a fusion step: aggregation itself raises (the run fails loudly)
    with pytest.raises(FusionError, match="round 1"):
        FusionFaultStrategy(FedAvg(), rounds=None).aggregate_train(1, [])


FAULTS = "1:crash,2:nan,3:shape@1,3:neg-scores@2,3:num-examples@3,4:crash@3,fusion:error@2"


def test_simulation_with_faulty_clients(tmp_path):
    cfg = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 5,
           "partitioning": "iid", "num-server-rounds": 3, "local-epochs": 1, "fusion-set-size": 80,
           "strategy": "kf-linear", "importance": "uniform", "min-train-nodes": 2, "fusion-fallback": "average",
           "test-faults": FAULTS, "output-dir": str(tmp_path), "run-name": "faults", "head-round": False}
    outcome = run_app(cfg, num_supernodes=5, timeout=600, echo=False, app_dir=write_fault_app(tmp_path / "app"))
    assert outcome.ok, f"run {outcome.run_id} ended {outcome.status}: {outcome.details}\n{outcome.log[-4000:]}"
    res = json.loads((outcome.out_dir / "results.json").read_text())
    rows = {r["round"]: r for r in res["rounds"]}
    assert sorted(rows) == [0, 1, 2, 3]

    r1, r2, r3 = rows[1], rows[2], rows[3]
    # round 1: the crash is a failure with its node id; NaN and wrong shape are rejected before fusion
    assert r1["valid-replies"] == 2 and r1["fallback"] is None and r1["skipped"] is None
    assert len(r1["failures"]) == 1 and r1["failures"][0]["node-id"] > 0 and r1["failures"][0]["code"] == 2
    reasons1 = " | ".join(x["reason"] for x in r1["rejected"])
    assert len(r1["rejected"]) == 2 and "NaN" in reasons1 and "shape" in reasons1, reasons1
    # round 2: negative scores rejected; fusion raised -> weighted averaging, and it says so
    assert "negative" in " ".join(x["reason"] for x in r2["rejected"])
    assert r2["fallback"].startswith("average") and "injected fusion failure" in r2["fallback"]
    # round 3: absurd num-examples rejected, two crashes -> 1 valid reply < 2: skipped, model unchanged
    assert "num-examples" in " ".join(x["reason"] for x in r3["rejected"])
    assert len(r3["failures"]) == 2 and "fewer than the minimum 2" in r3["skipped"]
    assert r3["test-accuracy"] == r2["test-accuracy"]
    assert res["skipped-rounds"] == [3]
    assert res["fallbacks"] == 1 and res["fallback-rounds"] == [2] and res["status"] == "completed"
    csv_header = (outcome.out_dir / "rounds.csv").read_text().splitlines()[0].split(",")
    assert "fallback" in csv_header
    assert {f["round"] for f in res["failures"]} == {1, 2, 3}

    # the global model is never replaced by a non-finite one, and it did learn
    state = torch.load(outcome.out_dir / "global_model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert r2["test-accuracy"] > 0.3 and not math.isnan(r2["test-accuracy"])
    # logged with node ids and reasons
    assert "injected ClientApp crash" in r1["failures"][0]["reason"]
    assert "rejected reply from node" in outcome.log and "contains NaN or Inf" in outcome.log
    assert "fell back to weighted averaging" in outcome.log and "round 3 skipped" in outcome.log
