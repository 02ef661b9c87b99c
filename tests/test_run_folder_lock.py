"""Issue 60 item 2: a run folder is owned by one run at a time, and what a run prints is its own.

Before: two runs started together with the same ``run-name`` shared one folder; both exited 0 and one printed the
other's numbers (it read back the ``results.json`` the other run had overwritten). Now the runners hold
``<output-dir>/<run-name>/.fedfuse.lock`` (``fedfuse.run_control``) for the whole run: a second run with that
run-name gets a one-line config error naming ``run-name`` before any client trains; a run-name the runner chose
itself takes a suffix; a lock left by a killed run is taken over with a note. A fresh run starts its folder afresh,
so a failed run never reports a previous run's numbers as its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedfuse.run_control import (LOCK_NAME, RunFolderBusy, claim_run_folder, holds_run_folder, release_run_folder,
                                 run_folder)

ROOT = Path(__file__).resolve().parents[1]
TINY = ("dataset='digits' model='mlp' model-width=16 model-depth=1 num-clients=2 partitioning='iid' "
        "num-server-rounds=1 local-epochs=1 strategy='fedavg' head-round=false")


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that holds ``folder`` (``claim_run_folder``) until killed; returned once it holds it."""
    code = ("import sys, time; from fedfuse.run_control import claim_run_folder; "
            "claim_run_folder(sys.argv[1], sys.argv[2]); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder.parent), folder.name], cwd=str(ROOT),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_folder_held_by_another_run_is_refused_naming_run_name_and_the_owner(tmp_path):
    holder = _holder(tmp_path / "same")
    try:
        with pytest.raises(RunFolderBusy) as err:
            claim_run_folder(tmp_path, "same")
        assert isinstance(err.value, ValueError)
        text = str(err.value)
        assert text.startswith("run-name 'same':") and f"pid {holder.pid}" in text and "choose another run-name" in text
        assert not holds_run_folder(tmp_path / "same")
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the dead holder's lock: the folder is taken over, with a note naming the dead pid
    notes: list[str] = []
    assert claim_run_folder(tmp_path, "same", on_note=notes.append) == "same"
    try:
        assert len(notes) == 1 and f"pid {holder.pid}" in notes[0] and "no longer runs" in notes[0]
        owner = json.loads((tmp_path / "same" / LOCK_NAME).read_text())
        assert owner["pid"] == os.getpid()
    finally:
        release_run_folder(tmp_path, "same")
    assert not (tmp_path / "same" / LOCK_NAME).exists()


def test_the_lock_is_reentrant_in_one_thread_and_released_with_the_last_hold(tmp_path):
    with run_folder(tmp_path, "r") as name:
        assert name == "r" and holds_run_folder(tmp_path / "r")
        with run_folder(str(tmp_path), "r"):   # the engine inside `fedfuse run` takes its folder again
            assert holds_run_folder(tmp_path / "r")
        assert holds_run_folder(tmp_path / "r") and (tmp_path / "r" / LOCK_NAME).exists()
    assert not holds_run_folder(tmp_path / "r") and not (tmp_path / "r" / LOCK_NAME).exists()


def test_a_run_name_the_runner_chose_takes_a_suffix_instead_of_sharing(tmp_path):
    holder = _holder(tmp_path / "auto-20261204-100000")
    try:
        name = claim_run_folder(tmp_path, "auto-20261204-100000", chosen_by_user=False)
        assert name == "auto-20261204-100000-2"
        # a folder an earlier run wrote is never reused for a runner-chosen name either
        (tmp_path / "auto-20261204-100000-3").mkdir()
        assert claim_run_folder(tmp_path, "auto-20261204-100000", chosen_by_user=False) == "auto-20261204-100000-4"
        release_run_folder(tmp_path, "auto-20261204-100000-4")
        release_run_folder(tmp_path, name)
    finally:
        holder.kill()
        holder.wait()


def test_fedfuse_run_into_a_folder_another_run_holds_is_a_config_error_before_anything_runs(tmp_path, capsys):
    from fedfuse.flower.runner import run

    folder = tmp_path / "shared"
    holder = _holder(folder)
    try:
        t0 = time.monotonic()
        with pytest.raises(SystemExit) as exit_:
            run.main(["--engine", "inprocess", "--no-compare", "--run-config",
                      f"{TINY} output-dir='{tmp_path}' run-name='shared'"])
        assert exit_.value.code == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedfuse: config error: run-name 'shared':"), err
    assert f"pid {holder.pid}" in err[0]
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME], "nothing of the refused run may be written"
    assert time.monotonic() - t0 < 60


def test_a_fresh_run_reports_only_its_own_results(tmp_path, monkeypatch, capsys):
    """A previous run's results.json in the folder (seed 1, final 0.9471) and a run that fails before writing any:
    the runner says the run failed with no results, never the other run's numbers."""
    from fedfuse.flower.runner import inprocess, run

    folder = tmp_path / "again"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"config": {"seed": 1}, "status": "completed", "rounds": [
        {"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.9471, "ensemble-accuracy": 0.6435}]}))
    (folder / "DONE").write_text("ok\n")

    def server_that_fails(grid, context):
        raise RuntimeError("the ServerApp of this run fails before round 0")

    monkeypatch.setattr(inprocess, "_default_server", lambda: server_that_fails)
    code = run.main(["--engine", "inprocess", "--no-compare", "--run-config",
                     f"{TINY} output-dir='{tmp_path}' run-name='again'"])
    out = capsys.readouterr()
    assert code == 1
    assert "0.9471" not in out.out + out.err and "0.6435" not in out.out + out.err
    assert f"no results at {folder}" in out.err
    assert not (folder / "results.json").exists() and not (folder / "DONE").exists()
    assert not (folder / LOCK_NAME).exists()


def test_the_server_app_writes_under_its_runners_lock_and_takes_its_own_otherwise(tmp_path, monkeypatch):
    """``app_run_folder`` (``run_server``'s hold): a ServerApp started by the runner holding the folder writes under
    that lock; one that a plain ``flwr run`` started takes the lock itself, and is refused when another run holds it."""
    from fedfuse.run_control import OWNER_ENV, app_run_folder

    folder = tmp_path / "served"
    holder = _holder(folder)
    try:
        monkeypatch.setenv(OWNER_ENV, str(holder.pid))   # started by the runner that holds the folder
        with app_run_folder(folder):
            assert not holds_run_folder(folder)
        monkeypatch.setenv(OWNER_ENV, "1")   # started by someone else: the folder is another run's
        with pytest.raises(RunFolderBusy, match=r"run-name 'served'"):
            with app_run_folder(folder):
                pytest.fail("a ServerApp must not write in a folder another run holds")
    finally:
        holder.kill()
        holder.wait()
    with app_run_folder(folder, on_note=lambda text: None):   # nobody holds it (the holder died): the ServerApp's own
        assert holds_run_folder(folder)
        with app_run_folder(folder):   # in-process: the runner in this process holds it
            assert holds_run_folder(folder)
    assert not holds_run_folder(folder) and not (folder / LOCK_NAME).exists()
