"""Faults and bad input in real Flower runs (fault injection is the TEST-ONLY ``test-faults`` knob).

- ``test_bad_config_*``: a bad strategy / dataset / fusion-set path fails before any client work,
  naming the key (no Flower needed: this is exactly what the ServerApp runs first).
- ``test_simulation_with_faulty_clients``: one ``flwr run`` simulation, 5 clients, 3 rounds, where
  client 1 crashes every round, client 2 sends NaN weights, client 3 sends a wrong shape (round 1),
  negative importance scores (round 2) and an absurd num-examples (round 3), fusion itself fails in
  round 2 (→ configured fallback: weighted averaging), and client 4 crashes in round 3 so that round
  has fewer valid replies than ``min-train-nodes`` (→ skipped with a clear message, not a crash).
  Timeouts and disconnects (a SuperNode killed mid-round) are in ``tests/test_deployment.py``.
"""

import json
import math

import pytest
import torch

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.faults import parse_faults
from server.app import setup
from server.strategies import STRATEGIES
from simulations.runners.flwr_runner import run_app


@pytest.mark.parametrize("override,key", [
    ({"strategy": "fedmagic"}, "strategy"),
    ({"dataset": "imagenet-42"}, "dataset"),
    ({"test-faults": "1:explode"}, "test-faults"),
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


FAULTS = "1:crash,2:nan,3:shape@1,3:neg-scores@2,3:num-examples@3,4:crash@3,fusion:error@2"


def test_simulation_with_faulty_clients(tmp_path):
    cfg = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 5,
           "partitioning": "iid", "num-server-rounds": 3, "local-epochs": 1, "fusion-set-size": 80,
           "strategy": "kf-linear", "importance": "uniform", "min-train-nodes": 2, "fusion-fallback": "average",
           "test-faults": FAULTS, "output-dir": str(tmp_path), "run-name": "faults"}
    outcome = run_app(cfg, num_supernodes=5, timeout=600, echo=False)
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
    assert {f["round"] for f in res["failures"]} == {1, 2, 3}

    # the global model is never replaced by a non-finite one, and it did learn
    state = torch.load(outcome.out_dir / "global_model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    assert r2["test-accuracy"] > 0.3 and not math.isnan(r2["test-accuracy"])
    # logged with node ids and reasons
    assert "injected ClientApp crash" in r1["failures"][0]["reason"]
    assert "rejected reply from node" in outcome.log and "contains NaN or Inf" in outcome.log
    assert "fell back to weighted averaging" in outcome.log and "round 3 skipped" in outcome.log
