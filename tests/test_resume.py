"""Checkpoint and resume: kill the server mid-run, resume with ``resume=true``, get the same results.

Two real ``flwr run`` simulation runs (slow): a run stopped with killing its SuperLink by PID (the ServerApp dies
with it) right after the round-1 checkpoint is written, and that run resumed. The resumed run must run only the
remaining rounds and end with the same per-round test accuracy and the same global weights as an uninterrupted
reference run (same seeds; clients seed by the true round), made on the in-process engine: the same ServerApp and
ClientApp, with the same numbers as ``flwr run`` (``tests/test_inprocess_engine.py``).
"""

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from fedfuse.results import load_checkpoint, save_checkpoint
from fedfuse.flower.runner.flwr_runner import (_superlink_pids, flwr_env, kill_tree, run_app, run_config_arg,
                                    start_local_superlink, stop_superlink)
from fedfuse.flower.runner.inprocess import run_app_inprocess
from tests.support.fault_app import write_fault_app

BASE = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 3,
        "partitioning": "shards", "num-server-rounds": 3, "local-epochs": 1, "fusion-set-size": 80,
        "strategy": "kf-linear", "importance": "uniform", "min-train-nodes": 3, "head-round": False}


def test_checkpoint_is_atomic_and_picks_the_committed_model(tmp_path):
    a = {"w": torch.zeros(2)}
    b = {"w": torch.ones(2)}
    save_checkpoint(tmp_path, 1, a, {"rows": [1]})
    save_checkpoint(tmp_path, 2, b, {"rows": [1, 2]})
    run_state, state = load_checkpoint(tmp_path)
    assert run_state["round"] == 2 and torch.equal(state["w"], b["w"])
    # a crash after the model rename but before state.json: state still says 2, model file is round 3
    (tmp_path / "checkpoint" / "global_model.pt").replace(tmp_path / "checkpoint" / "global_model.prev.pt")
    torch.save({"round": 3, "state_dict": {"w": torch.full((2,), 3.0)}}, tmp_path / "checkpoint" / "global_model.pt")
    run_state, state = load_checkpoint(tmp_path)
    assert run_state["round"] == 2 and torch.equal(state["w"], b["w"])
    assert not list((tmp_path / "checkpoint").glob("*.tmp"))
    assert load_checkpoint(tmp_path / "nothing") is None


def _interrupted_run(cfg: dict, app_dir: Path, timeout: float = 420.0) -> int:
    """Submit a run of ``app_dir``, wait for its round-1 checkpoint, then kill the SuperLink (and its
    ServerApp) by PID."""
    home = Path(tempfile.mkdtemp(prefix="fedfuse-flwr-home-"))
    env = flwr_env(home)
    ckpt = Path(cfg["output-dir"]) / cfg["run-name"] / "checkpoint" / "state.json"
    try:
        start_local_superlink(home, env)  # flwr's own start-up wait (15 s) is too short on a loaded machine
        res = subprocess.run(["flwr", "run", str(app_dir), "--run-config", run_config_arg(cfg, app_dir),
                              "--federation-config", "num-supernodes=3 client-resources-num-cpus=1", "--format",
                              "json"], env=env, cwd=str(app_dir), capture_output=True, text=True, timeout=120)
        run_id = int(json.loads(res.stdout)["run-id"])
        deadline = time.monotonic() + timeout
        while not ckpt.exists():
            assert time.monotonic() < deadline, "no round-1 checkpoint in time"
            time.sleep(0.3)
        # the server machine dies: SIGKILL our SuperLink (found by PID: its --log-file is under our
        # FLWR_HOME) and every descendant (SuperExec, ServerApp/simulation, Ray). A SIGTERM or `flwr stop`
        # lets the ServerApp run on for a while, long enough to finish the run on a fast machine.
        kill_tree(_superlink_pids(home))
        assert run_id > 0
        return json.loads(ckpt.read_text())["round"]
    finally:
        stop_superlink(home)
        shutil.rmtree(home, ignore_errors=True)


def _wait_for_the_killed_run(output_dir: Path, run_name: str, timeout: float = 90.0) -> None:
    """The killed run's ServerApp process (``flwr-simulation``, a child of the SuperExec that notices its parent's
    death by polling) may outlive the SIGKILL of the SuperLink's tree by seconds, holding the run folder; a resume
    started then is refused (``RunFolderBusy``: the right answer while it lives). Wait until it is gone."""
    from fedfuse.run_control import RunFolderBusy, claim_run_folder, release_run_folder

    deadline = time.monotonic() + timeout
    while True:
        try:
            claim_run_folder(output_dir, run_name, on_note=lambda text: None)
        except RunFolderBusy:
            assert time.monotonic() < deadline, f"the killed run still holds {output_dir / run_name}"
            time.sleep(0.5)
            continue
        release_run_folder(output_dir, run_name)
        return


@pytest.mark.slow
def test_kill_server_mid_run_and_resume(tmp_path):
    ref = run_app_inprocess({**BASE, "output-dir": str(tmp_path), "run-name": "reference"}, echo=False)
    assert ref.ok, ref.log[-3000:]

    cfg = {**BASE, "output-dir": str(tmp_path), "run-name": "resumed"}
    # rounds 2 and 3 hang 15 s in every client (TEST-ONLY fault app; results unaffected): time to kill it
    done = _interrupted_run({**cfg, "test-faults": "*:sleep:15@2,*:sleep:15@3"}, write_fault_app(tmp_path / "app"))
    assert done in (1, 2)
    out = tmp_path / "resumed"
    assert not (out / "DONE").exists()
    _wait_for_the_killed_run(tmp_path, "resumed")

    res = run_app({**cfg, "resume": True}, timeout=420, echo=False)
    assert res.ok, res.log[-3000:]
    assert f"resuming {out} after round {done} of 3" in res.log

    a = json.loads((tmp_path / "reference" / "results.json").read_text())
    b = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in b["rounds"]] == [0, 1, 2, 3]
    assert b["resumed-from-rounds"] == [done]
    assert [h["round"] for h in b["strategy-history"]] == [1, 2, 3]
    for ra, rb in zip(a["rounds"], b["rounds"]):
        assert ra["test-accuracy"] == pytest.approx(rb["test-accuracy"], abs=1e-9), (ra["round"], ra, rb)
    wa = torch.load(tmp_path / "reference" / "global_model.pt", weights_only=True)
    wb = torch.load(out / "global_model.pt", weights_only=True)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k
