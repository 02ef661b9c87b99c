"""Deployment with private data on loopback: one ``flower-superlink`` and 3 ``flower-supernode`` processes, each
SuperNode training on its own node-local file only (node-config ``data-path``), the ServerApp holding only the
fusion-set and test-set files (``fusion-set-path``, ``test-set-path``). Every process is stopped by its PID
(``simulations.runners.deployment.Deployment``)."""

import json

import pytest

from fedfuse.data import write_fusion_set_file, write_partition_files, write_test_set_file
from simulations.runners.deployment import Deployment


@pytest.mark.slow  # real SuperLink + 3 SuperNodes: minutes on 2 cores
def test_three_supernodes_with_node_local_files(tmp_path):
    nodes = write_partition_files(tmp_path / "nodes", dataset="digits", num_partitions=3, partitioning="shards")
    fusion = write_fusion_set_file(tmp_path / "server" / "fusion.npz", dataset="digits", size=100, seed=0)
    test = write_test_set_file(tmp_path / "server" / "test.npz", dataset="digits", seed=0)
    cfg = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 3,
           "num-server-rounds": 2, "local-epochs": 2, "importance-samples": 64, "min-train-nodes": 3,
           "fusion-set-path": str(fusion), "test-set-path": str(test), "output-dir": str(tmp_path / "results"),
           "run-name": "private",
           "strategy": "average"}   # calibrate with the class-count prior: the nodes are asked for their counts
    with Deployment(3, tls=False, auth=False, node_configs=[{"data-path": str(p)} for p in nodes]) as dep:
        outcome = dep.run(cfg, timeout=480)
        assert outcome.ok, f"run {outcome.run_id} ended {outcome.status}: {outcome.details}\n{outcome.log[-4000:]}"
    res = json.loads((outcome.out_dir / "results.json").read_text())
    last = res["rounds"][2]   # the last training round; the head round follows it (class shards: 2 rounds of a
    assert [r["round"] for r in res["rounds"]] == [0, 1, 2, 3]   # width-16 MLP stay near 0.3 without it)
    assert last["valid-replies"] == 3 and last["rejected"] == [] and last["failures"] == []
    assert last["test-accuracy"] > 0.2 and len(last["client-test-accuracy"]) == 3
    head = res["rounds"][3]
    assert head["fusion-info"]["head-round"]["valid"] == 3 and head["test-accuracy"] > 0.3
    assert last["fusion-info"]["prior"] == "class-counts"        # calibrate asked the nodes for their counts
    assert json.loads((outcome.out_dir / "config.json").read_text())["fusion-set-samples"] == 100
