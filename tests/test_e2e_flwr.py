"""End to end: the real ``flwr run`` local simulation (SuperLink + Ray), checked through its results.

Two real runs stay in the default suite (each costs ~30 s to 1 min on 2 cores, most of it Ray start-up): a
healthy multi-round run (the session's shared ``e2e_flwr_run``, ``tests/support/shared_runs.py``, which the
in-process engine's equality test compares against), and one whose fusion always fails (test support
``FusionFaultStrategy``), which must end as a failed run with the reason in ``results.json``. One-shot mode end to
end runs on the in-process engine (the same ServerApp/ClientApp; ``tests/test_inprocess_engine.py`` checks that the
two engines give the same numbers).
"""

import json

import pytest

from fedfuse.flower.runner.flwr_runner import run_app
from fedfuse.flower.runner.inprocess import run_app_inprocess
from fedfuse.flower.runner.run import report
from tests.support.fault_app import write_fault_app
from tests.support.shared_runs import E2E


def test_flwr_run_multi_round_simulation(e2e_flwr_run):
    from fedfuse.config import SCHEMA

    strategy = SCHEMA["strategy"].default   # the default strategy, as a new user runs it
    outcome, res = e2e_flwr_run.outcome, e2e_flwr_run.results
    assert "strategy" not in e2e_flwr_run.config   # the run leaves it to the default
    rounds = res["rounds"]
    # one row per round (+ the initial model), then the head round (on by default)
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert res["config"]["strategy"] == strategy and res["config"]["head-round"] is True
    last = rounds[2]
    assert last["test-accuracy"] > 0.3                            # chance is 0.1 on 10 digits
    assert last["valid-replies"] == 3 and last["rejected"] == [] and last["failures"] == []
    assert last["ensemble-accuracy"] > 0.3 and len(last["client-test-accuracy"]) == 3
    # the default 'auto': 3 local epochs < auto-fusion-epochs, so no fusion candidate, no vote: FedAvg's average
    assert strategy == "auto" and last["fusion-info"]["select-query"] is False
    assert last["fusion-info"]["select-choice"] == "fedavg" and last["fusion-info"]["select-clients"] == 0
    assert last["choice"] == last["fusion-info"]["select-choice"]
    # the head round: every node's statistics and its query.score_candidates scores reached the server through the
    # simulation engine
    head = rounds[3]["fusion-info"]["head-round"]
    assert head["valid"] == head["queried"] == 3 and head["rejected"] == [] and head["fallback"] is None
    assert head["kept"] in ("head", "before") and set(head["client-accuracy"]) == {"before", "head"}
    expected = rounds[2]["test-accuracy"] if head["kept"] == "before" else None
    assert expected is None or rounds[3]["test-accuracy"] == pytest.approx(expected)
    for name in ("rounds.csv", "accuracy.png", "global_model.pt", "config.json", "DONE"):
        assert (outcome.out_dir / name).exists(), name
    assert res["status"] == "completed" and res["error"] is None
    assert res["fallbacks"] == 0 and res["fallback-rounds"] == [] and last["fallback"] is None
    assert last["fusion-info"] is not None


def test_flwr_run_where_fusion_never_succeeds_fails_loudly(tmp_path, capsys):
    cfg = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 2,
           "partitioning": "iid", "num-server-rounds": 2, "local-epochs": 1, "fusion-set-size": 80,
           "min-train-nodes": 2, "strategy": "kf-linear", "importance": "uniform", "test-faults": "fusion:error",
           "output-dir": str(tmp_path), "run-name": "always-fails"}
    outcome = run_app(cfg, num_supernodes=2, timeout=420, echo=False, app_dir=write_fault_app(tmp_path / "app"))
    assert outcome.status == "finished:failed", (outcome.status, outcome.details, outcome.log[-3000:])
    res = json.loads((outcome.out_dir / "results.json").read_text())
    assert "no head round" in outcome.log and len(res["rounds"]) == 3   # no post-step after failed rounds
    assert res["status"] == "failed" and "fusion never succeeded" in res["error"], res.get("error")
    assert "injected fusion failure" in res["error"]
    assert res["fallbacks"] == 2 and res["fallback-rounds"] == [1, 2]
    assert [r["fallback"].split(":")[0] for r in res["rounds"][1:]] == ["previous", "previous"]
    assert "fusion never succeeded" in outcome.log and "keeping the previous global model" in outcome.log
    assert not (outcome.out_dir / "DONE").exists() and (outcome.out_dir / "accuracy.png").exists()
    assert report(outcome.out_dir, outcome.ok, outcome.status) == 1   # the runner exits non-zero
    assert "fusion never succeeded" in capsys.readouterr().err


def test_one_shot_fedavg_end_to_end(tmp_path):
    """One-shot mode, the e2e config, on the in-process engine (the same ServerApp and ClientApp as ``flwr run``)."""
    cfg = {**E2E, "strategy": "fedavg", "mode": "one-shot", "num-server-rounds": 1, "head-round": False,
           "output-dir": str(tmp_path), "run-name": "e2e"}
    outcome = run_app_inprocess(cfg, num_supernodes=cfg["num-clients"], echo=False)
    assert outcome.ok, f"run {outcome.run_id} ended {outcome.status}: {outcome.details}\n{outcome.log[-4000:]}"
    res = json.loads((outcome.out_dir / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [0, 1]
