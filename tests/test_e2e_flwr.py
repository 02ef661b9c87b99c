"""End to end: the real ``flwr run`` local simulation (SuperLink + Ray), checked through its results.

One run stays in the default suite (it costs ~1 min on 2 cores, most of it Ray start-up).
"""

import json

import pytest

from simulations.runners.flwr_runner import run_app


def _run(tmp_path, **overrides):
    cfg = {"dataset": "digits", "model": "mlp", "model-width": 32, "model-depth": 1, "num-clients": 3,
           "partitioning": "shards", "num-server-rounds": 2, "local-epochs": 3, "lr": 0.01,
           "fusion-set-size": 120, "min-train-nodes": 3, "output-dir": str(tmp_path), "run-name": "e2e",
           "importance": "deeplift", "importance-samples": 64, **overrides}
    outcome = run_app(cfg, num_supernodes=cfg["num-clients"], timeout=420, echo=False)
    assert outcome.ok, f"run {outcome.run_id} ended {outcome.status}: {outcome.details}\n{outcome.log[-4000:]}"
    return outcome, json.loads((outcome.out_dir / "results.json").read_text())


def test_flwr_run_multi_round_simulation(tmp_path):
    strategy = "kf-linear"
    outcome, res = _run(tmp_path, strategy=strategy)
    rounds = res["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]            # one row per round (+ the initial model)
    assert res["config"]["strategy"] == strategy
    last = rounds[-1]
    assert last["test-accuracy"] > 0.3                            # chance is 0.1 on 10 digits
    assert last["valid-replies"] == 3 and last["rejected"] == [] and last["failures"] == []
    assert last["ensemble-accuracy"] > 0.3 and len(last["client-test-accuracy"]) == 3
    assert last["client-score-seconds-mean"] > 0                  # clients computed importance scores
    for name in ("rounds.csv", "accuracy.png", "global_model.pt", "config.json", "DONE"):
        assert (outcome.out_dir / name).exists(), name


@pytest.mark.slow
def test_flwr_run_one_shot_fedavg(tmp_path):
    outcome, res = _run(tmp_path, strategy="fedavg", mode="one-shot", **{"num-server-rounds": 1})
    assert [r["round"] for r in res["rounds"]] == [0, 1]
