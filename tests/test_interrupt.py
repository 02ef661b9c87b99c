"""Issue 60 item 3: Ctrl-C (SIGINT) or SIGTERM on ``fedfuse run`` / ``bash scripts/run.sh``.

Before: a raw ``KeyboardInterrupt`` traceback, ``results.json`` without a status and ``run.log`` stopping mid-round;
after SIGTERM the run's ``flower-superlink`` and ``flower-superexec`` kept running with parent 1. Now the run ends
with one line (exit status 128 + the signal), ``results.json`` says ``"status": "interrupted"`` at its last completed
round (the checkpoint's), ``resume=true`` continues it, and every process the runner started is stopped
(``fedfuse.run_control``, ``flwr_runner.stop_superlink``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedfuse.flower.runner.flwr_runner import _alive, descendants
from fedfuse.run_control import LOCK_NAME

ROOT = Path(__file__).resolve().parents[1]
TINY = ("dataset='digits' model='mlp' model-width=16 model-depth=1 num-clients=2 partitioning='iid' "
        "local-epochs=1 strategy='fedavg' head-round=false")


def _server_round(msg) -> int | None:
    for record in msg.content.config_records.values():
        if "server-round" in record:
            return int(record["server-round"])
    return None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_ends_in_one_line_marked_interrupted_and_resumes(tmp_path, monkeypatch, capsys, sig):
    from fedfuse.flower.client_app import app as client_app
    from fedfuse.flower.runner import inprocess, run

    def interrupting_client(msg, context):   # the signal arrives while round 2 trains (as Ctrl-C would)
        if _server_round(msg) == 2:
            os.kill(os.getpid(), sig)
        return client_app(msg, context)

    monkeypatch.setattr(inprocess, "_default_client_app", lambda: interrupting_client)
    argv = ["--engine", "inprocess", "--no-compare", "--run-config",
            f"{TINY} num-server-rounds=3 output-dir='{tmp_path}' run-name='stopped'"]
    code = run.main(argv)
    out = capsys.readouterr()
    assert code == 128 + sig
    err = [line for line in out.err.splitlines() if line.strip()]
    assert "Traceback" not in out.err + out.out and len(err) == 1, out.err
    assert err[0].startswith(f"fedfuse: interrupted ({sig.name}) during fedavg's run: {tmp_path}/stopped/results.json"
                             " says status 'interrupted' after round 1 of 3"), err[0]
    assert "after round 1 of 3" in err[0] and "run-name='stopped' resume=true" in err[0]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL   # the handlers are given back

    folder = tmp_path / "stopped"
    res = json.loads((folder / "results.json").read_text())
    assert res["status"] == "interrupted"
    assert res["interrupted"]["signal"] == sig.name and res["interrupted"]["after-round"] == 1
    assert [r["round"] for r in res["rounds"]] == [0, 1]
    assert json.loads((folder / "checkpoint" / "state.json").read_text())["round"] == 1
    assert not (folder / "DONE").exists() and not (folder / LOCK_NAME).exists()
    assert "interrupted by" in (folder / "run.log").read_text().splitlines()[-1]

    monkeypatch.setattr(inprocess, "_default_client_app", lambda: client_app)
    code = run.main(argv[:-1] + [argv[-1] + " resume=true"])
    assert code == 0, capsys.readouterr().err
    res = json.loads((folder / "results.json").read_text())
    assert res["status"] == "completed" and "interrupted" not in res
    assert [r["round"] for r in res["rounds"]] == [0, 1, 2, 3] and res["resumed-from-rounds"] == [1]
    assert (folder / "DONE").exists()


@pytest.mark.slow   # one real `flwr run` (SuperLink + Ray), stopped with SIGTERM as `timeout` would
def test_sigterm_on_fedfuse_run_stops_every_process_it_started(tmp_path):
    cmd = [sys.executable, "-m", "fedfuse.flower.runner.run", "--no-compare", "--run-config",
           f"{TINY} num-server-rounds=40 output-dir='{tmp_path}' run-name='term'"]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ckpt = tmp_path / "term" / "checkpoint" / "state.json"
    started: set[int] = set()
    deadline = time.monotonic() + 420
    try:
        while not ckpt.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no round-1 checkpoint in time"
            started.update(descendants(proc.pid))
            time.sleep(0.5)
        started.update(descendants(proc.pid))
        names = {Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[:2].__repr__() for p in started if _alive(p)}
        assert any(b"flower-superlink" in n.encode() for n in names), names
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("fedfuse: interrupted (SIGTERM)"), err[-3000:]
    left = sorted(p for p in started if _alive(p))
    assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
    res = json.loads((tmp_path / "term" / "results.json").read_text())
    assert res["status"] == "interrupted" and res["interrupted"]["signal"] == "SIGTERM"
    done = res["interrupted"]["after-round"]
    assert done >= 1 and [r["round"] for r in res["rounds"]] == list(range(done + 1))
