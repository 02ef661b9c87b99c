"""Run the fedfuse Flower app with ``flwr run`` (local simulation engine, Ray) safely and check it; where the app
and the results are (below).

What this takes care of:
- a private ``FLWR_HOME`` per run, runtime dependency installation off, no update check/telemetry;
- the managed local SuperLink on free ports (``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` /
  ``FLWR_LOCAL_CONTROL_API_PORT``), so it never reuses someone else's SuperLink, and stopped by PID;
- ``flwr run --stream`` exits 0 even when the run failed: the status is read with ``flwr list``;
- one torch thread per process and ``OMP_WAIT_POLICY=PASSIVE``.

**Where the app and the results are**: where every runner finds the Flower app's configuration and where results go by default.

A Flower app is a directory whose ``pyproject.toml`` declares ``[tool.flwr.app]`` (publisher, the ServerApp and
ClientApp components) and ``[tool.flwr.app.config]`` (the run-config defaults): ``flwr run <dir>`` bundles it
into a FAB, and the in-process engine reads the defaults from it (``flwr.common.config.get_fused_config_from_dir``).

- In a fedfuse checkout (this package imported from ``<checkout>/fedfuse``, whose ``pyproject.toml`` declares
  fedfuse's ServerApp) the app directory is the checkout (``CHECKOUT``): ``flwr run`` bundles the checkout's
  code, and results go to ``<checkout>/results``.
- Installed from a wheel there is no checkout: the app directory is ``PACKAGE_APP_DIR``, the ``app/pyproject.toml``
  shipped inside this package. Its ``[tool.flwr.app]`` and ``[tool.flwr.app.config]`` equal the repository's value
  for value (``tests/test_app_config.py``), so a run has the same defaults either way. Its FAB holds that file
  only; the ServerApp and ClientApp processes import fedfuse from the installation. Results go to ``./results``
  under the working directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from fedfuse.config import ConfigError, canonical, config_notes, preflight
from fedfuse.processes import (alive as _alive, default_flwr_home, descendants, kill_tree,  # noqa: F401  (names
                               local_superlink_pids, signal_and_wait as _signal_and_wait,  # kept importable here)
                               stop_local_superlink, superlink_pids as _superlink_pids)
from fedfuse.results import clear_run_results, mark_interrupted
from fedfuse.run_control import OWNER_ENV, RunInterrupted, run_folder, signal_name_of, signals_deferred
import tomllib

# ---------------------------------------------------------------- where the app and the results are
PACKAGE_APP_DIR = Path(__file__).resolve().parent / "app"
SERVER_APP = "fedfuse.flower.server_app:app"


def find_checkout() -> Path | None:
    """The fedfuse checkout this package was imported from (its ``pyproject.toml`` names fedfuse's ServerApp
    as the Flower app's ``serverapp``), else ``None`` (an installed package)."""
    root = Path(__file__).resolve().parents[3]
    try:
        app = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return None
    components = app.get("components") if isinstance(app, dict) else None
    return root if isinstance(components, dict) and components.get("serverapp") == SERVER_APP else None


CHECKOUT = find_checkout()
APP_DIR = CHECKOUT or PACKAGE_APP_DIR  # the app directory runs use unless given another


def is_fedfuse_app(app_dir: str | Path) -> bool:
    """Whether ``app_dir`` is fedfuse's own Flower app (the checkout or the packaged app directory), whose run
    config ``fedfuse.config`` checks; a test or example app declares keys of its own."""
    resolved = Path(app_dir).resolve()
    return resolved == APP_DIR or resolved == PACKAGE_APP_DIR


def takes_fedfuse_config(app_dir: str | Path) -> bool:
    """Whether ``app_dir``'s run config is fedfuse's layout (fedfuse's app, or a copy that declares its option
    tables, e.g. a test app with one key more): the runners bring a config for it to the canonical form
    (``fedfuse.config.canonical``) before Flower, which refuses keys its pyproject does not declare, reads it."""
    if is_fedfuse_app(app_dir):
        return True
    try:
        config = tomllib.loads((Path(app_dir) / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return False
    return isinstance(config, dict) and isinstance(config.get("strategy-options"), dict)


def default_results_dir() -> Path:
    """``<checkout>/results`` in a checkout, else ``./results`` of the working directory."""
    return CHECKOUT / "results" if CHECKOUT else Path.cwd().resolve() / "results"


def results_dir_for(app_dir: str | Path) -> Path:
    """Where a run of ``app_dir`` writes when its run config names no ``output-dir``: ``<app_dir>/results``,
    except for the packaged app directory (inside the installation): ``default_results_dir()``."""
    resolved = Path(app_dir).resolve()
    return default_results_dir() if resolved == PACKAGE_APP_DIR else resolved / "results"


# the default Flower app directory: the checkout in a checkout (its root, as ever), else the app directory
# shipped in the package (fedfuse.flower.runner.flwr_runner)
ROOT = APP_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flwr_env(flwr_home: Path) -> dict[str, str]:
    """Environment for ``flwr`` commands: private home, free local-SuperLink ports, quiet and offline."""
    env = os.environ.copy()
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.update({
        "FLWR_HOME": str(flwr_home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "HF_DATASETS_OFFLINE": env.get("HF_DATASETS_OFFLINE", "1"),
        "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "FEDFUSE_TORCH_THREADS": env.get("FEDFUSE_TORCH_THREADS", "1"),
        "RAY_DEDUP_LOGS": "0",
        OWNER_ENV: str(os.getpid()),   # the ServerApp writes in the folder this process holds (run_control)
    })
    if CHECKOUT is not None:  # the Flower processes import fedfuse from the checkout (installed: from the installation)
        env["PYTHONPATH"] = str(CHECKOUT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    text = str(v)
    # flwr's --run-config parser takes "..." or '...' without escapes: a value holding double quotes
    # (e.g. fusion-options='{match="balanced"}') goes as a TOML literal string
    if '"' in text or "\\" in text:
        if "'" in text or "\n" in text:
            raise ValueError(f"run config value {text!r} cannot be passed to flwr run: it holds both quote kinds")
        return f"'{text}'"
    return json.dumps(text)  # a TOML basic string


def run_config_arg(cfg: dict[str, Any], app_dir: str | Path | None = None) -> str:
    """``cfg`` as one ``flwr run --run-config`` string. With ``app_dir`` a fedfuse app (``takes_fedfuse_config``),
    the config is first brought to its layered form (``fedfuse.config.canonical``): a SuperLink refuses a key the
    app's pyproject does not declare ("Invalid run configuration"), so former flat spellings must not reach it."""
    if app_dir is not None and takes_fedfuse_config(app_dir):
        cfg = canonical(cfg)
    return " ".join(f"{k}={toml_value(v)}" for k, v in cfg.items())


def stop_superlink(flwr_home: Path, timeout: float = 15.0) -> None:
    """Stop our managed SuperLink by PID: SIGTERM, then SIGKILL it and whatever it left behind: its process tree
    (SuperExec, the ServerApp, Ray) as it was, and any process still carrying ``FLWR_HOME=<flwr_home>`` in its
    environment (``home_pids``: one that left the tree, e.g. a Ray daemon whose parent died)."""
    pids = _superlink_pids(flwr_home)
    tree = [q for p in pids for q in [p, *descendants(p)]]
    _signal_and_wait(pids, signal.SIGTERM, timeout)
    kill_tree([q for q in tree if _alive(q)], timeout=timeout)
    kill_tree(home_pids(flwr_home), timeout=timeout)


def home_pids(flwr_home: Path) -> list[int]:
    """PIDs of live processes (this user's, not this one) whose environment holds ``FLWR_HOME=<flwr_home>``: every
    process a run with that private home started (``flwr_env`` gives it to each)."""
    needle = b"\0FLWR_HOME=" + str(flwr_home).encode() + b"\0"
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            environ = b"\0" + (d / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ + b"\0" and _alive(int(d.name)):
            pids.append(int(d.name))
    return pids


def start_local_superlink(flwr_home: Path, env: dict[str, str], timeout: float = 180.0) -> subprocess.Popen:
    """Start the simulation SuperLink that ``flwr run`` would start, with a longer start-up wait.

    ``flwr`` gives its managed SuperLink 15 s to come up, too little on a loaded 2-core machine; a
    SuperLink already healthy on the configured port is reused by ``flwr run``.
    """
    import urllib.request

    runtime = flwr_home / "local-superlink"
    runtime.mkdir(parents=True, exist_ok=True)
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    cmd = ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
           "--control-api-address", f"127.0.0.1:{env['FLWR_LOCAL_CONTROL_API_PORT']}", "--host", "127.0.0.1",
           "--port", port, "--log-file", str(runtime / "superlink.log"), "--database", str(runtime / "state.db")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {proc.returncode}; see {runtime / 'superlink.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"flower-superlink not healthy after {timeout:.0f}s")


@dataclass
class RunOutcome:
    run_id: int | None
    status: str
    details: str
    out_dir: Path
    log: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


def federation_size(cfg: dict[str, Any], num_supernodes: int | None) -> int:
    """The number of SuperNodes of a simulation, with ``cfg``'s ``num-clients`` set to it (``cfg`` is changed).

    As in Flower, ``num-supernodes`` is the federation's size: SuperNode ``i`` of ``n`` gets node config
    ``partition-id=i num-partitions=n``, and fedfuse's ClientApp trains partition ``i`` of ``num-clients``, so the two
    are one number. ``None`` (not given): ``num-clients`` (the app's default 4 when the config leaves it out); given
    alone, it sets ``num-clients``; given with a different ``num-clients``, a ``ConfigError`` naming both (not a run
    that trains some of the partitions, or none: every ClientApp refuses a node config that disagrees). Below 1, a
    ``ConfigError`` too."""
    if num_supernodes is None:
        n = cfg.get("num-clients", 4)
        n = n if isinstance(n, int) and not isinstance(n, bool) else 4   # a bad value: the config check names it
        cfg.setdefault("num-clients", n)
        return n
    if isinstance(num_supernodes, bool) or not isinstance(num_supernodes, int) or num_supernodes < 1:
        raise ConfigError(f"--num-supernodes {num_supernodes!r}: a federation needs at least 1 SuperNode (default: "
                          "run-config num-clients)")
    clients = cfg.get("num-clients")
    if isinstance(clients, int) and not isinstance(clients, bool) and clients != num_supernodes:
        raise ConfigError(f"--num-supernodes {num_supernodes} but run-config num-clients={clients}: each SuperNode "
                          f"holds one of the num-clients partitions, so these are one number; give one of them, or "
                          f"the same value to both")
    cfg.setdefault("num-clients", num_supernodes)
    return num_supernodes


def check_app_config(cfg: dict[str, Any], app_dir: Path, check_config: bool | None) -> None:
    """``fedfuse.config.preflight`` of the full run config before any Flower process starts; by default for
    the fedfuse app only (a test app with its own keys, e.g. fault injection, checks its own)."""
    if check_config is None:
        check_config = is_fedfuse_app(app_dir)
    if check_config:
        with config_notes():   # what the check resolved is the ServerApp's to say (logged once, recorded)
            preflight(cfg)


def run_app(run_config: dict[str, Any], *, num_supernodes: int | None = None, cpus_per_client: float = 1.0,
            gpus_per_client: float = 0.0, timeout: float = 900.0, echo: bool = True,
            app_dir: Path = ROOT, keep_home: bool = False, check_config: bool | None = None,
            on_line: Callable[[str], None] | None = None) -> RunOutcome:
    """``flwr run <app_dir>`` with ``run_config`` overrides; returns the run status and results dir.

    Every line ``flwr run --stream`` prints is kept (``RunOutcome.log``), echoed when ``echo``, and handed to
    ``on_line`` when given (the runners' quiet console: ``fedfuse.flower.runner.console``).

    ``run_config`` should hold ``output-dir`` (absolute) and ``run-name``; both are filled in when
    missing (``paths.results_dir_for(app_dir)``, a timestamped name). ``num_supernodes`` and the config's
    ``num-clients`` are one number (``federation_size``). The whole config is checked first (``check_app_config``):
    a ``fedfuse.config.ConfigError`` is raised before any SuperLink starts.

    The run holds its folder (``fedfuse.run_control.run_folder``: another run in it raises ``RunFolderBusy``, a
    ``ValueError``, before any SuperLink starts) and, unless ``resume``, starts it afresh
    (``fedfuse.results.clear_run_results``). Interrupted (Ctrl-C, or SIGTERM under ``interrupt_signals``), it stops
    every process it started (``flwr run``, the SuperLink and its tree, whatever else carries its ``FLWR_HOME``),
    marks ``results.json`` ``interrupted`` at the last completed round and raises ``RunInterrupted``.
    """
    cfg = canonical(run_config) if takes_fedfuse_config(app_dir) else dict(run_config)
    cfg.setdefault("output-dir", str(results_dir_for(app_dir)))
    chosen = "run-name" in cfg
    cfg.setdefault("run-name", f"run-{time.strftime('%Y%m%d-%H%M%S')}")
    n = federation_size(cfg, num_supernodes)
    check_app_config(cfg, app_dir, check_config)
    with run_folder(cfg["output-dir"], str(cfg["run-name"]), chosen_by_user=chosen) as name:
        cfg["run-name"] = name
        out_dir = Path(cfg["output-dir"]) / name
        if not cfg.get("resume"):
            clear_run_results(out_dir)
        return _run_flwr(cfg, n, out_dir, cpus_per_client=cpus_per_client, gpus_per_client=gpus_per_client,
                         timeout=timeout, echo=echo, app_dir=app_dir, keep_home=keep_home, on_line=on_line)


def interrupted_run(exc: BaseException, out_dir: Path, num_rounds: int | None = None) -> RunInterrupted:
    """After every process of an interrupted run has stopped: ``results.json`` marked ``interrupted`` at the last
    completed round (``fedfuse.results.mark_interrupted``); the ``RunInterrupted`` to raise, saying so."""
    sig = signal_name_of(exc)
    return RunInterrupted(sig, out_dir=out_dir, after_round=mark_interrupted(out_dir, sig), num_rounds=num_rounds)


def _run_flwr(cfg: dict[str, Any], n: int, out_dir: Path, *, cpus_per_client: float, gpus_per_client: float,
              timeout: float, echo: bool, app_dir: Path, keep_home: bool,
              on_line: Callable[[str], None] | None) -> RunOutcome:
    """``run_app``'s body, in its held folder."""
    home = Path(tempfile.mkdtemp(prefix="fedfuse-flwr-home-"))
    env = flwr_env(home)
    cpus = int(cpus_per_client) if float(cpus_per_client).is_integer() else cpus_per_client
    fed = f"num-supernodes={n} client-resources-num-cpus={cpus} client-resources-num-gpus={gpus_per_client}"
    cmd = ["flwr", "run", str(app_dir), "--run-config", run_config_arg(cfg), "--federation-config", fed, "--stream"]
    t0 = time.perf_counter()
    lines: list[str] = []
    run_id = None
    proc: subprocess.Popen | None = None
    interrupted: BaseException | None = None
    try:
        start_local_superlink(home, env)
        proc = subprocess.Popen(cmd, env=env, cwd=str(app_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            if on_line is not None:
                on_line(line)
            if run_id is None:
                m = re.search(r"run (\d+)", line)
                if m and "start" in line.lower():
                    run_id = int(m.group(1))
            if time.monotonic() > deadline:
                proc.kill()
                lines.append(f"fedfuse: timed out after {timeout:.0f}s\n")
                break
        proc.wait(timeout=30)
        status, details = "unknown", ""
        if run_id is not None:
            res = subprocess.run(["flwr", "list", "--run-id", str(run_id), "--format", "json"], env=env,
                                 cwd=str(app_dir), capture_output=True, text=True, timeout=60)
            try:
                info = json.loads(res.stdout)
                runs = info.get("runs") or []
                if runs:
                    status = str(runs[0].get("status", "unknown"))
                    details = str(runs[0].get("status-details", runs[0].get("sub-status", "")))
            except json.JSONDecodeError:
                details = res.stdout[-2000:] + res.stderr[-2000:]
        else:
            details = "no run id in the output of flwr run: " + "".join(lines)[-1500:]
    except KeyboardInterrupt as exc:   # Ctrl-C, or SIGTERM/SIGHUP under run_control.interrupt_signals
        interrupted = exc
    finally:
        with signals_deferred() as late:   # a second Ctrl-C must not leave the SuperLink running
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            stop_superlink(home)
            if not keep_home:
                shutil.rmtree(home, ignore_errors=True)
    if interrupted is not None:
        raise interrupted_run(interrupted, out_dir) from None
    if late:   # a signal while the finished run's processes were being stopped: its results stand, the command stops
        raise RunInterrupted(late[0])
    return RunOutcome(run_id=run_id, status=status, details=details, out_dir=out_dir, log="".join(lines),
                      seconds=time.perf_counter() - t0)
