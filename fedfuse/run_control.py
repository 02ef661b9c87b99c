"""A run's hold on its folder and on its end: one run per run folder, and an interrupted run that ends cleanly.

**One run per folder.** The runners (``fedfuse run``, ``fedfuse compare`` and the sweeps, ``flwr_runner.run_app``,
``inprocess.run_app_inprocess``) hold ``<output-dir>/<run-name>/.fedfuse.lock`` for the whole run
(``run_folder``): an exclusive ``flock`` on that file, which holds the owner's pid, host, start time and command.
A second run started with the same ``output-dir`` and ``run-name`` while the first one runs gets ``RunFolderBusy``
(a ``ValueError`` naming ``run-name`` and the owner's pid; the runners print it as their one-line config error)
before any Flower process starts or any client trains. A run-name the runner chose itself (the timestamped
default) takes a suffix instead (``-2``, ``-3``, ...): two runs started in the same second get two folders. The
kernel releases a ``flock`` when its process ends, however it ends, so a lock file left by a killed run is taken
over by the next run, with a note naming the dead owner's pid. Within one thread the lock is re-entrant
(``fedfuse run`` holds its folder while the engine it calls takes the same lock again).

**Interruption.** ``interrupt_signals`` turns SIGINT (Ctrl-C), SIGTERM and SIGHUP into ``RunInterrupted`` (a
``KeyboardInterrupt``) in the main thread, so that a runner's ``finally`` blocks run (without a handler SIGTERM
ends Python at once: no clean-up, the Flower processes left running). ``signals_deferred`` holds further signals
off while a runner stops what it started; the runners then mark the run ``interrupted`` in ``results.json``
(``fedfuse.results.mark_interrupted``) and raise ``RunInterrupted`` carrying the folder and the last completed
round. The command line prints it as one line and exits ``128 + signal``.

Standard library only: a test or a second process takes a lock without importing torch or Flower.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOCK_NAME = ".fedfuse.lock"
MAX_SUFFIX = 100   # a runner-chosen run-name tries <name>, <name>-2, ..., <name>-100

_held: dict[str, list[Any]] = {}   # lock path -> [fd, depth, owning thread id, folder created by the claim]
_held_mutex = threading.Lock()


class RunFolderBusy(ValueError):
    """The run folder is held by another run (the message names ``run-name``, the folder and the owner)."""


def _read_owner(fd: int) -> dict[str, Any]:
    try:
        text = os.pread(fd, 65536, 0).decode(errors="replace").strip()
        owner = json.loads(text) if text else {}
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "a run that is still starting"
    parts = [f"pid {owner.get('pid', '?')}"]
    if owner.get("host") and owner.get("host") != socket.gethostname():
        parts.append(f"on {owner['host']}")
    if owner.get("started"):
        parts.append(f"started {owner['started']}")
    text = " ".join(parts)
    return f"{text}: {owner['command']}" if owner.get("command") else text


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def _lock_file(path: Path) -> tuple[int, dict[str, Any]] | dict[str, Any]:
    """``(fd, previous owner)`` with ``path`` locked, or the current owner's record when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            return owner
        try:   # its owner may have released (and removed) it between our open and flock: lock the file now there
            st, now = os.fstat(fd), os.stat(path)
            same = (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            return fd, _read_owner(fd)
        os.close(fd)


def _take(folder: Path, run_name: str, on_note: Callable[[str], None]) -> bool:
    """Lock ``folder`` for this thread; ``False`` when another run holds it (``RunFolderBusy`` is the caller's)."""
    me = threading.get_ident()
    with _held_mutex:
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        path = _lock_path(folder)
        held = _held.get(path)
        if held is not None:
            if held[2] == me:
                held[1] += 1
                return True
            raise RunFolderBusy(f"run-name {run_name!r}: {folder} is in use by another run of this process "
                                f"(pid {os.getpid()}, another thread); choose another run-name (or output-dir)")
        got = _lock_file(Path(path))
        if isinstance(got, dict):
            return False
        fd, previous = got
        if previous:
            here = previous.get("host", socket.gethostname()) == socket.gethostname()
            alive = here and _pid_alive(previous.get("pid"))
            on_note(f"fedfuse: note: {folder} was left locked by {_describe(previous)}, which "
                    f"{'no longer holds it' if alive else 'no longer runs'}; this run takes the folder over")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        _held[path] = [fd, 1, me, created]
        return True


def _lock_path(folder: Path) -> str:
    return str(Path(folder).resolve() / LOCK_NAME)


def _release(folder: Path) -> None:
    with _held_mutex:
        path = _lock_path(folder)
        held = _held.get(path)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _held[path]
        try:
            os.unlink(path)   # removed while still locked: a run waiting on the old file sees it gone and retries
        except FileNotFoundError:
            pass
        os.close(held[0])
        if held[3]:   # a folder this claim created and nothing was written to (a run refused by its checks): removed
            try:
                os.rmdir(Path(path).parent)
            except OSError:
                pass


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def claim_run_folder(output_dir: str | Path, run_name: str, *, chosen_by_user: bool = True,
                     on_note: Callable[[str], None] = _stderr) -> str:
    """Lock ``<output_dir>/<run_name>`` for this run; the run-name it holds (``run_name``, or with a suffix when the
    runner chose the name and that folder is taken). Raises ``RunFolderBusy`` when the user chose the name and
    another run holds the folder. Pair every claim with ``release_run_folder`` (or use ``run_folder``)."""
    base = Path(output_dir)
    candidates = [run_name] if chosen_by_user else [run_name] + [f"{run_name}-{i}" for i in range(2, MAX_SUFFIX + 1)]
    for name in candidates:
        folder = base / name
        if not chosen_by_user and folder.exists():
            continue   # a folder of an earlier run: a runner-chosen name never reuses it
        if _take(folder, name, on_note):
            return name
        if chosen_by_user:
            owner = _owner_of(folder)
            raise RunFolderBusy(f"run-name {run_name!r}: {folder} is in use by another run ({_describe(owner)}); "
                                "two runs in one folder would overwrite each other's results: choose another run-name "
                                "(or output-dir), or wait for that run to end")
    raise RunFolderBusy(f"run-name {run_name!r}: {base} holds {MAX_SUFFIX} folders of that name in use or written; "
                        "give run-name")


def _owner_of(folder: Path) -> dict[str, Any]:
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        return _read_owner(fd)
    finally:
        os.close(fd)


def release_run_folder(output_dir: str | Path, run_name: str) -> None:
    """Give back a folder taken by ``claim_run_folder`` (the lock file is removed with the last release)."""
    _release(Path(output_dir) / run_name)


@contextmanager
def run_folder(output_dir: str | Path, run_name: str, *, chosen_by_user: bool = True,
               on_note: Callable[[str], None] = _stderr) -> Iterator[str]:
    """``claim_run_folder`` for the duration; yields the run-name held."""
    name = claim_run_folder(output_dir, run_name, chosen_by_user=chosen_by_user, on_note=on_note)
    try:
        yield name
    finally:
        release_run_folder(output_dir, name)


def holds_run_folder(folder: str | Path) -> bool:
    """Whether this process holds ``folder`` (``claim_run_folder``)."""
    with _held_mutex:
        return _lock_path(Path(folder)) in _held


OWNER_ENV = "FEDFUSE_RUN_FOLDER_OWNER"   # the pid of the runner that started a ServerApp (flwr_runner.flwr_env)


def _ancestors() -> list[int]:
    out, pid = [], os.getppid()
    while pid > 1 and len(out) < 64:
        out.append(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return out


@contextmanager
def app_run_folder(folder: str | Path, on_note: Callable[[str], None] = _stderr) -> Iterator[None]:
    """The ServerApp's hold on its run folder: none of its own when the runner that started it holds the folder
    (the same process: the in-process engine; or the lock's owner is the runner named by ``FEDFUSE_RUN_FOLDER_OWNER``
    in the environment, or an ancestor process); else it takes the lock itself (a plain ``flwr run``, a deployment), so
    that two such runs with the same ``run-name`` do not share the folder either (``RunFolderBusy``)."""
    folder = Path(folder)
    if holds_run_folder(folder):
        yield
        return
    pid = _owner_of(folder).get("pid")
    if pid is not None and (str(pid) == os.environ.get(OWNER_ENV) or pid in _ancestors()) and _pid_alive(pid):
        yield
        return
    with run_folder(folder.parent, folder.name, on_note=on_note):
        yield


# ------------------------------------------------------------------------------------------------ interruption
INTERRUPT_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class RunInterrupted(KeyboardInterrupt):
    """A run ended by a signal (Ctrl-C = SIGINT, SIGTERM, SIGHUP). ``out_dir``: the run's folder, whose
    ``results.json`` says ``"status": "interrupted"``; ``after_round``: its last completed (checkpointed) round."""

    def __init__(self, signal_name: str = "SIGINT", out_dir: Path | None = None, after_round: int | None = None,
                 num_rounds: int | None = None) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.out_dir = out_dir
        self.after_round = after_round
        self.num_rounds = num_rounds
        self.label: str | None = None   # the run's name on the console (the strategy), when a runner knows it

    def line(self, label: str | None = None, resume_hint: str | None = None) -> str:
        """The one line a command prints for it: what was interrupted, where its results stand, how to continue."""
        if self.out_dir is None:
            return f"fedfuse: interrupted ({self.signal_name}) before a run started or after the runs ended; nothing " \
                   "is left running"
        of = f" of {self.num_rounds}" if self.num_rounds else ""
        return (f"fedfuse: interrupted ({self.signal_name})" + (f" during {label}'s run" if label else "") +
                f": {self.out_dir / 'results.json'} says status 'interrupted' after round {self.after_round}{of} (its "
                f"last completed round, checkpointed); every process the run started is stopped; to continue: "
                + (resume_hint or "the same run with resume=true (same output-dir and run-name)"))

    @property
    def exit_status(self) -> int:
        """``128 + signal number`` (the shell's convention: 130 for Ctrl-C, 143 for SIGTERM)."""
        return 128 + int(getattr(signal.Signals, self.signal_name, signal.SIGINT))


def signal_name_of(exc: BaseException) -> str:
    """The signal that ``exc`` stands for: ``RunInterrupted``'s own, else SIGINT (a plain ``KeyboardInterrupt``)."""
    return exc.signal_name if isinstance(exc, RunInterrupted) else "SIGINT"


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise RunInterrupted(signal.Signals(signum).name)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def interrupt_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise ``RunInterrupted`` for the duration (main thread only; elsewhere a no-op),
    the previous handlers restored after."""
    if not _in_main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in INTERRUPT_SIGNALS}
    for s in INTERRUPT_SIGNALS:
        signal.signal(s, _raise_interrupted)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextmanager
def signals_deferred() -> Iterator[list[str]]:
    """While a runner stops what it started: a second Ctrl-C or SIGTERM must not cut the clean-up short. Signals
    that arrive are recorded (the yielded list) and otherwise ignored; the previous handlers are restored after."""
    arrived: list[str] = []
    if not _in_main_thread():
        yield arrived
        return
    saved = {s: signal.getsignal(s) for s in INTERRUPT_SIGNALS}
    for s in INTERRUPT_SIGNALS:
        signal.signal(s, lambda signum, frame: arrived.append(signal.Signals(signum).name))
    try:
        yield arrived
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
