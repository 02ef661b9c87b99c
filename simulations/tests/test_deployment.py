"""Real deployment on loopback: one ``flower-superlink`` and 2–3 ``flower-supernode`` processes.

Free ports, a private ``FLWR_HOME``, bounded waits, every process stopped by its PID
(``simulations/deployment.py``). Each SuperNode gets its own ``--node-config "partition-id=…
num-partitions=…"`` and builds its own partition; the app is submitted with ``flwr run . <connection>``.

- ``test_deployment_insecure_two_rounds`` (default suite): 2 SuperNodes, ``--insecure`` (explicit
  local-test opt-in), 2 rounds of KF-linear fusion; then a run with a missing fusion-set path must fail
  before any client work, naming the key.
- ``test_deployment_tls_and_node_auth`` (slow): the secure default: TLS with a generated CA, SuperLink
  ``--enable-supernode-auth``, 3 SuperNodes whose keys were registered with ``flwr supernode register``.
- ``test_deployment_timeout_and_disconnect`` (slow): in round 2 one SuperNode hangs past the round
  timeout and another is killed mid-round; the round completes with the remaining node, both failures
  are recorded with their node ids.
"""

import json
import os
import time

import pytest
import torch

from simulations.runners.deployment import Deployment
from tests.support.fault_app import write_fault_app


def _cfg(tmp_path, name, **kw):
    return {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "partitioning": "shards",
            "num-server-rounds": 2, "local-epochs": 2, "fusion-set-size": 100, "strategy": "kf-linear",
            "importance": "deeplift", "importance-samples": 64, "head-round": False, "output-dir": str(tmp_path),
            "run-name": name, **kw}


def _check_two_rounds(outcome, n, head_round=False):
    assert outcome.ok, f"run {outcome.run_id} ended {outcome.status}: {outcome.details}\n{outcome.log[-4000:]}"
    res = json.loads((outcome.out_dir / "results.json").read_text())
    rows = res["rounds"]
    assert [r["round"] for r in rows] == [0, 1, 2] + ([3] if head_round else [])
    if head_round:   # every SuperNode sent its statistics and scores through the deployment
        head = rows[3]["fusion-info"]["head-round"]
        assert head["valid"] == head["queried"] == n and head["rejected"] == [] and head["fallback"] is None
    last = rows[2]
    assert last["valid-replies"] == n and last["failures"] == [] and last["rejected"] == []
    assert last["test-accuracy"] > 0.3 and len(last["client-test-accuracy"]) == n
    assert last["client-score-seconds-mean"] > 0                  # scores computed on the SuperNodes
    assert (outcome.out_dir / "checkpoint" / "state.json").exists() and (outcome.out_dir / "DONE").exists()
    return res


@pytest.mark.slow  # real SuperLink + 2 SuperNodes: minutes on 2 cores (3 s reply polling, torch imports)
def test_deployment_insecure_two_rounds(tmp_path):
    t0 = time.perf_counter()
    with Deployment(2, tls=False, auth=False) as dep:
        outcome = dep.run(_cfg(tmp_path, "deploy", **{"min-train-nodes": 2}), timeout=420)
        _check_two_rounds(outcome, 2)
        # bad configuration: fails in the ServerApp before any message reaches a SuperNode
        bad = dep.run(_cfg(tmp_path, "bad", **{"fusion-set-path": str(tmp_path / "missing.npz")}), timeout=180,
                      check_config=False)  # skip the runner's preflight: the ServerApp's own check is tested
        assert bad.status == "finished:failed", (bad.status, bad.details)
        assert "fusion-set-path" in bad.log
        assert not (tmp_path / "bad").exists()
        for i in range(2):
            assert str(bad.run_id) not in dep.log_tail(f"supernode-{i}", 10**7)
    print(f"deployment test: {time.perf_counter() - t0:.0f}s")


@pytest.mark.slow
def test_deployment_tls_and_node_auth(tmp_path):
    with Deployment(3, tls=True, auth=True) as dep:
        assert "--enable-supernode-auth" in " ".join(dep.superlink.args)
        assert all("--insecure" not in " ".join(p.args) for p in [dep.superlink, *dep.supernodes])
        outcome = dep.run(_cfg(tmp_path, "deploy-tls", **{"min-train-nodes": 3, "head-round": True}), timeout=480)
        _check_two_rounds(outcome, 3, head_round=True)
        nodes = json.loads(dep.flwr("supernode", "list", "fedfuse-deploy", "--format", "json").stdout)["nodes"]
        assert len(nodes) == 3


@pytest.mark.slow
def test_deployment_timeout_and_disconnect(tmp_path):
    timeout = float(os.environ.get("FEDFUSE_TEST_ROUND_TIMEOUT", "120"))
    # node 1 and 2 hang in round 2 (node-config fault of the TEST-ONLY fault app); node 1 is then killed
    node_configs = [{}, {"fault": "sleep:900@2"}, {"fault": "sleep:900@2"}]
    app = write_fault_app(tmp_path / "app")
    with Deployment(3, tls=False, auth=False, node_configs=node_configs, app_dir=app) as dep:
        # dep.submit sends the config as given: the federation's size must match the SuperNodes' num-partitions
        cfg = _cfg(tmp_path, "deploy-faults", **{"num-clients": 3, "min-train-nodes": 1, "round-timeout": timeout,
                                                 "importance": "uniform"})
        dep.wait_for_nodes()
        run_id = dep.submit(cfg)
        ckpt = tmp_path / "deploy-faults" / "checkpoint" / "state.json"
        deadline = time.monotonic() + 300
        while not ckpt.exists():
            assert time.monotonic() < deadline, dep.logs_of(run_id)[-3000:]
            time.sleep(0.5)
        time.sleep(5)                      # round 2 messages delivered, node 1 is inside its ClientApp
        dep.kill_supernode(1)
        status, details = dep.wait(run_id, timeout=timeout + 240)
        log = dep.logs_of(run_id)
        assert status == "finished:completed", (status, details, log[-3000:])
    res = json.loads((tmp_path / "deploy-faults" / "results.json").read_text())
    r2 = res["rounds"][-1]
    assert r2["round"] == 2 and r2["valid-replies"] == 1 and r2["skipped"] is None
    assert len(r2["failures"]) == 2 and all(f["node-id"] > 0 for f in r2["failures"])
    assert {f.get("partition-id") for f in r2["failures"]} == {1, 2}   # learnt from their round-1 replies
    assert "no reply from node" in log or "failed" in log
    state = torch.load(tmp_path / "deploy-faults" / "global_model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
