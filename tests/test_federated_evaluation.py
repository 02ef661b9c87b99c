"""Central evaluation optional: with ``evaluation='federated'`` the clients evaluate the global model on their
validation splits in Flower's evaluate round, the server holds no test set (with ``fusion-set-path`` it loads no
dataset at all), and results.json / rounds.csv / the console line report the federated accuracy."""

import csv
import json

import pytest
from flwr.app import MetricRecord, RecordDict

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.data import write_fusion_set_file
from fedfuse.flower import server_app
from fedfuse.flower.server_app import FederatedEvaluation
from fedfuse.flower.runner.console import format_round
from fedfuse.flower.runner.inprocess import run_inprocess

TINY = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 3,
        "partitioning": "iid", "num-server-rounds": 2, "local-epochs": 2, "min-train-nodes": 3,
        "importance-samples": 32, "head-round": False}   # the head round's federated row: test_progressive


def test_evaluation_key_rules():
    assert parse_run_config({}).evaluation == "central"
    assert parse_run_config({"evaluation": "both", "test-set-path": "/x.npz"}).evaluation == "both"
    with pytest.raises(ConfigError, match="'data-options.test-set-path' is read by central evaluation only"):
        parse_run_config({"evaluation": "federated", "test-set-path": "/x.npz"})
    with pytest.raises(ConfigError, match="val-fraction=0"):
        parse_run_config({"evaluation": "federated", "val-fraction": 0.0})
    with pytest.raises(ConfigError, match="'evaluation'"):
        parse_run_config({"evaluation": "clients"})


def test_federated_evaluation_weights_clients_by_samples():
    agg = FederatedEvaluation()
    contents = [RecordDict({"metrics": MetricRecord({"num-examples": n, "eval-accuracy": a, "eval-loss": l,
                                                      "partition-id": p})})
                for p, (n, a, l) in enumerate([(10, 0.5, 1.0), (30, 0.9, 0.2)])]
    rec = agg(contents, "num-examples")
    assert rec["federated-accuracy"] == pytest.approx(0.8) and rec["federated-loss"] == pytest.approx(0.4)
    row = agg.take()
    assert row["federated-clients"] == 2 and row["federated-examples"] == 40
    assert row["client-federated-accuracy"] == {"0": 0.5, "1": 0.9}
    assert agg.take() == {}   # one round's numbers, taken once


def test_federated_only_run_needs_no_server_dataset(tmp_path, monkeypatch):
    fusion = write_fusion_set_file(tmp_path / "server" / "fusion.npz", dataset="digits", size=80, seed=0)

    def no_dataset(*args, **kwargs):
        raise AssertionError("the server loaded the dataset")

    monkeypatch.setattr(server_app, "federated_data", no_dataset)   # the ServerApp's only dataset loader
    out = run_inprocess({**TINY, "evaluation": "federated", "fusion-set-path": str(fusion),
                         "output-dir": str(tmp_path / "results"), "run-name": "fed"}, 3, echo=False)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and [r["round"] for r in res["rounds"]] == [0, 1, 2]
    for row in res["rounds"][1:]:
        assert "test-accuracy" not in row and "ensemble-accuracy" not in row
        assert row["federated-clients"] == 3 and 0.3 < row["federated-accuracy"] <= 1
        assert set(row["client-federated-accuracy"]) == {"0", "1", "2"} and row["valid-replies"] == 3
    with (out / "rounds.csv").open() as f:
        last = list(csv.DictReader(f))[-1]
    assert float(last["federated-accuracy"]) == pytest.approx(res["rounds"][-1]["federated-accuracy"])
    assert {"client-0-federated-accuracy", "federated-loss"} <= set(last)
    line = format_round(res["rounds"][-1], 2, "average")
    assert "federated acc" in line and "(3 clients)" in line and "acc -" not in line
    assert (out / "accuracy.png").exists() and (out / "DONE").exists()


def test_both_reports_central_and_federated(tmp_path):
    out = run_inprocess({**TINY, "num-server-rounds": 1, "strategy": "fedavg", "evaluation": "both",
                         "output-dir": str(tmp_path), "run-name": "both"}, 3, echo=False)
    last = json.loads((out / "results.json").read_text())["rounds"][-1]
    assert last["test-accuracy"] > 0.3 and last["federated-clients"] == 3 and last["federated-accuracy"] > 0.3
    assert "federated acc" in format_round(last) and "acc " in format_round(last).split("federated")[0]
