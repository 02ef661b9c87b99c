"""Processes found and stopped by PID, read from ``/proc`` (Linux), with the standard library only.

The runners stop what they started by PID, never by name (``fedfuse.flower.runner.flwr_runner.stop_superlink``: the
SuperLink whose ``--log-file`` lies under the run's private Flower home, and its process tree). ``fedfuse
stop-superlink`` stops the local SuperLink that a plain ``flwr run`` leaves running (``stop_local_superlink``); it
imports this module only, so the command starts without torch or Flower.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def superlink_pids(flwr_home: Path) -> list[int]:
    """PIDs of SuperLinks whose ``--log-file`` lives under ``flwr_home`` (ours, and only ours)."""
    pids = []
    needle = str(flwr_home)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [c.decode(errors="replace") for c in cmd]
        if any("flower-superlink" in a for a in args[:2]) and any(needle in a for a in args):
            pids.append(int(d.name))
    return pids


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first level first), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def signal_and_wait(pids: list[int], sig: int, timeout: float) -> None:
    """Send ``sig`` to every pid, then wait (bounded) until none is alive."""
    for q in pids:
        try:
            os.kill(q, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(q) for q in pids):
        time.sleep(0.2)


def kill_tree(pids: list[int], timeout: float = 15.0) -> None:
    """SIGKILL processes we started and all their descendants (a crashed machine), then reap/wait."""
    signal_and_wait([q for p in pids for q in [p, *descendants(p)]], signal.SIGKILL, timeout)


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def default_flwr_home() -> Path:
    """The Flower home a plain ``flwr`` command uses: ``$FLWR_HOME``, else ``~/.flwr`` (as ``flwr`` reads it)."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")


def local_superlink_pids(flwr_home: Path | None = None) -> list[int]:
    """PIDs of the SuperLink that a plain ``flwr run`` starts for a local simulation and leaves running (Flower's
    managed local SuperLink: ``--log-file <flwr_home>/local-superlink/superlink.log``); ``flwr_home`` defaults to
    ``default_flwr_home()``. Only that SuperLink: not one a user started with other files under the same home."""
    home = Path(flwr_home) if flwr_home is not None else default_flwr_home()
    log_file = str(home / "local-superlink" / "superlink.log")
    pids = []
    for pid in superlink_pids(home):
        try:
            args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if any(a == log_file or a == f"--log-file={log_file}" for a in args):
            pids.append(pid)
    return pids


def stop_local_superlink(flwr_home: Path | None = None, timeout: float = 15.0) -> list[int]:
    """Stop, by PID, the local SuperLink a plain ``flwr run`` left running (``local_superlink_pids``) and every
    process it started (SuperExec, a ServerApp, Ray): SIGTERM to the SuperLink, then SIGKILL to whatever of its tree
    is left. Returns the PIDs of that tree (``[]``: none was running)."""
    pids = local_superlink_pids(flwr_home)
    tree = [q for p in pids for q in [p, *descendants(p)]]
    signal_and_wait(pids, signal.SIGTERM, timeout)
    kill_tree([q for q in tree if alive(q)], timeout=timeout)
    return tree


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and state(pid) != "Z"
