"""Issue 60 item 11: ``flwr run examples/own-flower-app`` (a plain ``flwr run``, no SuperLink address) leaves
Flower's managed local SuperLink and its SuperExec running afterwards, by Flower's design (the next ``flwr run``
reuses it). Nothing said so or stopped them. Now the example's README and its ServerApp's last line say so, and
``fedfuse stop-superlink`` stops that SuperLink and everything it started, by PID (its ``--log-file`` under the
Flower home), touching no other SuperLink.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedfuse.cli import main as fedfuse_main
from fedfuse.flower.runner.flwr_runner import _alive, descendants, local_superlink_pids

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own-flower-app"

# a stand-in for `flower-superlink` (its name is what the scan reads): starts a stand-in SuperExec, then waits
FAKE_SUPERLINK = """import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "flower-superexec"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _fake_superlink(tmp_path: Path, home: Path, log_file: Path) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "bin" / "flower-superlink"
    script.parent.mkdir(exist_ok=True)
    script.write_text(FAKE_SUPERLINK)
    proc = subprocess.Popen([sys.executable, str(script), "--insecure", "--simulation", "--log-file", str(log_file),
                             "--database", str(home / "local-superlink" / "state.db")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_stop_superlink_stops_the_local_superlink_and_what_it_started_and_nothing_else(tmp_path, capsys):
    home, other = tmp_path / "flwr-home", tmp_path / "other-home"
    managed, exec_pid = _fake_superlink(tmp_path, home, home / "local-superlink" / "superlink.log")
    # a SuperLink of another Flower home, and one a user started with other files under the same home: left alone
    foreign, foreign_child = _fake_superlink(tmp_path, other, other / "local-superlink" / "superlink.log")
    users, users_child = _fake_superlink(tmp_path, home, home / "my-deployment" / "superlink.log")
    try:
        assert local_superlink_pids(home) == [managed.pid]
        assert exec_pid in descendants(managed.pid)
        assert fedfuse_main(["stop-superlink", "--flwr-home", str(home)]) == 0
        out = capsys.readouterr().out
        assert f"stopped the local SuperLink of {home}" in out and str(managed.pid) in out and str(exec_pid) in out
        managed.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(exec_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(exec_pid), "the SuperExec it started must be stopped too"
        assert all(_alive(p) for p in (foreign.pid, foreign_child, users.pid, users_child))
        assert fedfuse_main(["stop-superlink", "--flwr-home", str(home)]) == 0
        assert f"no local SuperLink of {home} is running" in capsys.readouterr().out
    finally:
        for proc, child in ((managed, exec_pid), (foreign, foreign_child), (users, users_child)):
            for pid in (child, proc.pid):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            proc.wait()


def test_the_example_readme_says_the_superlink_stays_and_how_to_stop_it():
    readme = (EXAMPLE / "README.md").read_text()
    assert "fedfuse stop-superlink" in readme and "keeps running" in readme
    assert "fedfuse stop-superlink" in (EXAMPLE / "own_app" / "server_app.py").read_text()


@pytest.mark.slow   # the README's own command, a real plain `flwr run` (Flower starts its local SuperLink)
def test_flwr_run_of_the_example_then_stop_superlink_leaves_nothing_running(example_flwr_run):
    # the session's shared run of the example (tests/support/shared_runs.py), which test_example_app checks too
    home, res = example_flwr_run.home, example_flwr_run.completed
    try:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert (example_flwr_run.out_dir / "results.json").exists(), res.stdout[-3000:]
        assert "fedfuse stop-superlink" in res.stdout
        left = local_superlink_pids(home)
        assert left, "plain flwr run leaves its local SuperLink running (Flower's design); this test checks the stop"
        tree = [q for p in left for q in [p, *descendants(p)]]
        out = subprocess.run([sys.executable, "-m", "fedfuse.cli", "stop-superlink", "--flwr-home", str(home)],
                             cwd=str(ROOT), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "stopped the local SuperLink" in out.stdout, out.stdout + out.stderr
        assert [p for p in tree if _alive(p)] == [] and local_superlink_pids(home) == []
    finally:
        subprocess.run([sys.executable, "-m", "fedfuse.cli", "stop-superlink", "--flwr-home", str(home)],
                       cwd=str(ROOT), capture_output=True, timeout=120)
