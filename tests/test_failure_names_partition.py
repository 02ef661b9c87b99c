"""A node whose ClientApp fails before it ever replied validly is named by its partition id, on the console and in
``rounds.csv`` / ``results.json`` (issue 60: the deployment misuse study's ``crash`` case logged "partition ?"):
fedfuse's ClientApp raises its handlers' errors again with ``partition <id>: `` in front
(``client_app.name_partition_mod``) and the server reads it from the error reply."""

import json

import pytest

import csv

from fedfuse.flower.round.replies import partition_in_reason
from fedfuse.flower.runner.inprocess import run_app_inprocess
from tests.support.fault_app import client_app, server_app, write_fault_app

RUN = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 3,
       "partitioning": "shards", "num-server-rounds": 2, "local-epochs": 1, "fusion-set-size": 60,
       "strategy": "fedavg", "min-train-nodes": 2, "head-round": False}


def test_partition_in_reason():
    assert partition_in_reason("<class 'RuntimeError'>:<'partition 7: ValueError: no data'>") == 7
    assert partition_in_reason("ClientApp stopped responding.") is None


@pytest.mark.parametrize("round_", [1, 2])
def test_a_node_failing_in_its_first_round_is_named_by_its_partition(tmp_path, round_, caplog):
    app = write_fault_app(tmp_path / "app")
    out = run_app_inprocess({**RUN, "test-faults": f"1:crash@{round_}", "output-dir": str(tmp_path),
                             "run-name": "r"}, echo=False, app_dir=app, client_app=client_app, server=server_app)
    assert out.ok, out.details
    rows = json.loads((tmp_path / "r" / "results.json").read_text())["rounds"]
    failures = rows[round_]["failures"]
    assert [f.get("partition-id") for f in failures] == [1], failures
    assert "partition 1: RuntimeError: fedfuse test fault" in failures[0]["reason"]
    assert "(partition 1) failed" in out.log and "(partition ?)" not in out.log
    with open(tmp_path / "r" / "rounds.csv") as f:
        row = {r["round"]: r for r in csv.DictReader(f)}[str(round_)]
    assert "partition 1" in row["failure-reasons"], row["failure-reasons"]
