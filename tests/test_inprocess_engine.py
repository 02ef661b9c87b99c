"""The in-process engine (``fedfuse.flower.runner.inprocess``): Flower's ``Grid`` contract, the run config as
``flwr run`` builds it, the real ServerApp/ClientApp end to end, and (slow) the same per-round numbers as the real
``flwr run``s other tests assert on (``tests/support/shared_runs.py``)."""

import json

import pytest
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.config import get_fused_config_from_dir, parse_config_args
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from fedfuse.flower.runner.flwr_runner import ROOT, run_config_arg
from fedfuse.flower.runner.inprocess import (LocalGrid, fused_run_config, run_app_inprocess, run_inprocess,
                                           task_identity)
from tests.support.shared_runs import E2E

RUN_ID = 7

# the e2e test's tiny config (tests/test_e2e_flwr.py): digits, 3 class-disjoint clients, 2 rounds
TINY = {**E2E, "head-round": False}


def _echo_app() -> ClientApp:
    """A ClientApp that replies with its partition id and a per-node counter kept in its Context's state;
    partition 1 raises, partition 2 returns a non-reply."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if pid == 1:
            raise RuntimeError("boom on partition 1")
        if pid == 2:
            return msg  # the instruction itself: not a reply
        calls = int(context.state["calls"]["n"]) + 1 if "calls" in context.state else 1
        context.state["calls"] = ConfigRecord({"n": calls})
        value = float(msg.content["config"]["x"])
        msg.content["config"]["x"] = -1.0  # mutating the received copy must not reach the server's message
        return Message(RecordDict({"metrics": MetricRecord({"pid": pid, "calls": calls, "x": value,
                                                            "nodes": context.node_config["num-partitions"]})}),
                       reply_to=msg)

    return app


def _send(grid: LocalGrid, x: float = 3.0, timeout: float | None = None) -> tuple[list[Message], list[Message]]:
    with task_identity(RUN_ID, SUPERLINK_NODE_ID, 1):
        msgs = [Message(RecordDict({"config": ConfigRecord({"x": x})}), nid, "train", group_id="1")
                for nid in grid.get_node_ids()]
        return msgs, list(grid.send_and_receive(msgs, timeout=timeout))


def test_local_grid_replies_carry_a_real_grids_metadata():
    grid = LocalGrid(_echo_app(), {"k": 1}, num_nodes=4, run_id=RUN_ID)
    ids = list(grid.get_node_ids())
    assert len(set(ids)) == 4 and SUPERLINK_NODE_ID not in ids and ids != [0, 1, 2, 3]
    assert [grid.contexts[n].node_config for n in ids] == [{"partition-id": i, "num-partitions": 4} for i in range(4)]
    assert all(grid.contexts[n].run_config == {"k": 1} and grid.contexts[n].node_id == n for n in ids)
    msgs, replies = _send(grid)
    assert len(replies) == 4
    by_ins = {m.metadata.message_id: m for m in msgs}
    assert all(mid for mid in by_ins) and len(by_ins) == 4          # the grid set the instruction ids
    for reply in replies:
        md = reply.metadata
        ins = by_ins[md.reply_to_message_id]
        assert md.src_node_id == ins.metadata.dst_node_id and md.dst_node_id == SUPERLINK_NODE_ID
        assert md.run_id == RUN_ID and md.group_id == "1" and md.message_type == "train"
        assert md.message_id and md.message_id not in by_ins
    ok = {grid.partition_of(r.metadata.src_node_id): r for r in replies if not r.has_error()}
    assert sorted(ok) == [0, 3]
    assert ok[3].content["metrics"]["x"] == 3.0 and ok[3].content["metrics"]["nodes"] == 4
    assert all(m.content["config"]["x"] == 3.0 for m in msgs)       # the client got a copy, not the object


def test_local_grid_turns_client_failures_into_error_replies():
    grid = LocalGrid(_echo_app(), {}, num_nodes=3, run_id=RUN_ID)
    _, replies = _send(grid)
    errors = {grid.partition_of(r.metadata.src_node_id): r.error for r in replies if r.has_error()}
    assert sorted(errors) == [1, 2]
    assert errors[1].code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION and "boom on partition 1" in errors[1].reason
    assert "ClientAppException" in errors[1].reason
    assert errors[2].code == ErrorCode.UNKNOWN and "not a reply" in errors[2].reason


def test_local_grid_keeps_node_state_and_drops_late_replies():
    grid = LocalGrid(_echo_app(), {}, num_nodes=1, run_id=RUN_ID)
    _send(grid)
    _, replies = _send(grid)
    assert replies[0].content["metrics"]["calls"] == 2                 # the node's Context persisted
    _, late = _send(grid, timeout=0.0)                                # every call takes > 0 s
    assert late == [] and grid.client_seconds and len(grid.client_seconds) == 3


def test_local_grid_rejects_messages_a_superlink_would_reject():
    grid = LocalGrid(_echo_app(), {}, num_nodes=2, run_id=RUN_ID)
    with task_identity(RUN_ID, SUPERLINK_NODE_ID, 1), pytest.raises(ValueError, match="unknown node"):
        grid.push_messages([Message(RecordDict(), 12345, "train")])
    with task_identity(RUN_ID + 1, SUPERLINK_NODE_ID, 1), pytest.raises(ValueError, match="run"):
        grid.push_messages([Message(RecordDict(), grid.get_node_ids()[0], "train")])


def test_run_config_is_fused_like_flwr_run():
    cfg = {"strategy": "kf-linear", "lr": 0.2, "num-server-rounds": 30, "fusion-options": '{match="balanced"}',
           "resume": True}
    fused = fused_run_config(cfg)
    assert fused == get_fused_config_from_dir(ROOT, parse_config_args([run_config_arg(cfg)]))
    assert fused["lr"] == 0.2 and fused["num-server-rounds"] == 30 and fused["resume"] is True
    assert fused["fusion-options"] == '{match="balanced"}' and fused["model"] == "mlp"   # a pyproject default
    with pytest.raises(ValueError, match="num-round"):
        fused_run_config({"num-round": 3})


def test_inprocess_run_writes_the_results_folder(tmp_path):
    out = run_inprocess({**TINY, "strategy": "fedavg", "output-dir": str(tmp_path), "run-name": "ip"}, 3,
                        echo=False)
    assert out == tmp_path / "ip"
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and [r["round"] for r in res["rounds"]] == [0, 1, 2]
    assert res["config"]["strategy"] == "fedavg" and res["config"]["num-clients"] == 3
    last = res["rounds"][-1]
    assert last["valid-replies"] == 3 and last["failures"] == [] and last["test-accuracy"] > 0.3
    for name in ("rounds.csv", "accuracy.png", "global_model.pt", "config.json", "DONE"):
        assert (out / name).exists(), name
    assert 0 < last["ensemble-accuracy"] <= 1 and len(last["client-test-accuracy"]) == 3


def test_client_references_off_drops_the_per_round_reference_columns_only(tmp_path):
    """``client-references=false`` (cross-device runs: a test pass per reply outweighs one local epoch): no
    ensemble / per-client test columns, the same global model as with them (they only read the replies)."""
    runs = {}
    for on in (True, False):
        out = run_inprocess({**TINY, "strategy": "fedavg", "client-references": on, "output-dir": str(tmp_path),
                             "run-name": f"refs-{on}"}, 3, echo=False)
        runs[on] = json.loads((out / "results.json").read_text())["rounds"]
    assert "ensemble-accuracy" in runs[True][-1]
    for row in runs[False][1:]:
        assert not {"ensemble-accuracy", "client-test-accuracy", "best-client-accuracy"} & set(row), row
    assert [r["test-accuracy"] for r in runs[False]] == [r["test-accuracy"] for r in runs[True]]


def test_inprocess_client_crash_is_a_recorded_failure_not_a_server_crash(tmp_path):
    from tests.support.fault_app import client_app, server_app, write_fault_app

    cfg = {**TINY, "strategy": "fedavg", "min-train-nodes": 2, "local-epochs": 1, "test-faults": "1:crash@2",
           "output-dir": str(tmp_path), "run-name": "crash"}
    outcome = run_app_inprocess(cfg, num_supernodes=3, echo=False, app_dir=write_fault_app(tmp_path / "app"),
                                client_app=client_app, server=server_app)
    assert outcome.ok, outcome.details
    res = json.loads((outcome.out_dir / "results.json").read_text())
    r1, r2 = res["rounds"][1], res["rounds"][2]
    assert r1["failures"] == [] and r1["valid-replies"] == 3
    assert r2["valid-replies"] == 2 and [f["partition-id"] for f in r2["failures"]] == [1]
    assert r2["failures"][0]["code"] == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "ClientAppException" in r2["failures"][0]["reason"]


def test_inprocess_failed_run_raises_with_the_servers_error(tmp_path):
    from tests.support.fault_app import client_app, server_app, write_fault_app

    cfg = {**TINY, "strategy": "kf-linear", "importance": "uniform", "local-epochs": 1, "num-server-rounds": 1,
           "test-faults": "fusion:error", "output-dir": str(tmp_path), "run-name": "fails"}
    with pytest.raises(RuntimeError, match="fusion never succeeded"):
        run_inprocess(cfg, 3, echo=False, app_dir=write_fault_app(tmp_path / "app"), client_app=client_app,
                      server=server_app)
    res = json.loads((tmp_path / "fails" / "results.json").read_text())
    assert res["status"] == "failed"


@pytest.mark.slow
@pytest.mark.parametrize("shared", ["e2e", "tiers"])
def test_inprocess_engine_matches_flwr_run(tmp_path, request, shared):
    """Same config, both engines: the same test accuracy (and loss) every round. The real runs are the session's
    shared ones (``tests/support/shared_runs.py``): ``e2e``, the default strategy ``auto`` (FedAvg's average at 3
    local epochs) on the e2e config, then the head round; ``tiers``, kf-linear fusion over width tiers 1 / 0.5 /
    0.25 (a sub-model of its own shape per node), then the head round."""
    real = request.getfixturevalue(f"{shared}_flwr_run")
    local = run_inprocess({**real.config, "output-dir": str(tmp_path / "inprocess"), "run-name": shared},
                          real.num_supernodes, echo=False)
    a = real.results["rounds"]
    b = json.loads((local / "results.json").read_text())["rounds"]
    assert len(a) == len(b) == real.config["num-server-rounds"] + 2   # the initial model, the rounds, the head round
    assert [r["test-accuracy"] for r in b] == [r["test-accuracy"] for r in a]
    assert [r["test-loss"] for r in b] == pytest.approx([r["test-loss"] for r in a], rel=1e-6)
    assert [r.get("client-test-accuracy") for r in b] == [r.get("client-test-accuracy") for r in a]
    assert [r.get("tier-accuracy") for r in b] == [r.get("tier-accuracy") for r in a]


def test_local_grid_hosts_a_subset_of_the_partitions():
    grid = LocalGrid(_echo_app(), {}, num_nodes=10, run_id=RUN_ID, partitions=[0, 3, 6, 9])
    ids = list(grid.get_node_ids())
    assert [grid.contexts[n].node_config for n in ids] == [{"partition-id": p, "num-partitions": 10} for p in (0, 3, 6, 9)]
    assert sorted(grid.partition_of(n) for n in ids) == [0, 3, 6, 9]
    for bad in ([], [0, 0], [10]):
        with pytest.raises(ValueError, match="partitions"):
            LocalGrid(_echo_app(), {}, num_nodes=10, run_id=RUN_ID, partitions=bad)


def test_a_run_that_trains_itself_to_chance_fails_loudly(tmp_path):
    """lr=50 drives the model to chance level while its weights stay finite: the run is a failure with the reason,
    not a 'completed' run at 0.098 (the divergence guard only sees non-finite or far-off fused models)."""
    cfg = {**TINY, "strategy": "fedavg", "lr": 50.0, "optimizer": "sgd", "num-server-rounds": 2, "head-round": False,
           "output-dir": str(tmp_path), "run-name": "dead"}
    with pytest.raises(RuntimeError, match="dead after round.*chance level.*lower lr"):
        run_inprocess(cfg, 3, echo=False)
    res = json.loads((tmp_path / "dead" / "results.json").read_text())
    assert res["status"] == "failed" and "chance level" in res["error"]
    assert not (tmp_path / "dead" / "DONE").exists()
