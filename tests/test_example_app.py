"""``examples/own-flower-app`` (a user's own Flower app with its own pyproject, ClientApp and ServerApp, using a
fedfuse strategy with non-default record keys and fedfuse's reply helper) run end to end with ``flwr run``: the
session's shared run of the example by its README's command (``example_flwr_run``, ``tests/support/shared_runs.py``;
``tests/test_stop_superlink.py`` stops the SuperLink it leaves)."""

import json

import pytest

from tests.support.shared_runs import EXAMPLE


@pytest.mark.slow  # one real `flwr run` (SuperLink + Ray): ~1 min on 2 cores, most of it start-up
def test_own_flower_app_runs_end_to_end_with_a_fedfuse_strategy(example_flwr_run):
    run = example_flwr_run
    assert run.ok, f"flwr run ended {run.status}\n{run.completed.stdout[-3000:]}{run.completed.stderr[-3000:]}"
    res = json.loads((run.out_dir / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [0, 1, 2]
    assert res["rounds"][-1]["test-accuracy"] > 0.5                  # chance 0.1; label-skewed halves
    assert [(h["method"], h["valid"], h["rejected"], h["fallback"]) for h in res["strategy-history"]] == \
        [("kf-linear", 2, [], None)] * 2                             # every reply accepted, fused, no fallback
    metrics = res["train-metrics"]["2"]
    assert len(metrics["class-counts"]) == 10 and "train-loss" in metrics   # calibrate asked for class counts


@pytest.mark.parametrize("strategy", ["kf-linear", "ot", "fs-merge"])
def test_own_flower_app_inprocess(tmp_path, monkeypatch, strategy):
    """The same app's ClientApp and ServerApp on the in-process engine (Flower's wire format, no Ray): fast; the
    quickstart ``Net`` unchanged, fused by alignment methods (issue 57), no round falling back."""
    import sys

    from fedfuse.flower.runner.inprocess import run_app_inprocess

    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m == "own_app" or m.startswith("own_app.")]:
        monkeypatch.delitem(sys.modules, name)
    from own_app.client_app import app as client_app
    from own_app.server_app import main as server_main

    cfg = {"output-dir": str(tmp_path), "run-name": "own-app", "num-clients": 2, "num-server-rounds": 2,
           "strategy": strategy}
    outcome = run_app_inprocess(cfg, num_supernodes=2, app_dir=EXAMPLE, check_config=False, echo=False,
                                client_app=client_app, server=server_main)
    assert outcome.ok, outcome.details
    res = json.loads((tmp_path / "own-app" / "results.json").read_text())
    assert res["rounds"][-1]["test-accuracy"] > 0.5
    assert all(h["valid"] == 2 and h["fallback"] is None for h in res["strategy-history"])
