"""A real Flower deployment on one machine: one ``flower-superlink``, N ``flower-supernode`` processes.

Used by ``simulations/tests/test_deployment.py`` and runnable by hand. Everything the tests need to stay safe:
free loopback ports, a private ``FLWR_HOME``, bounded waits, and every process started here stopped by
its PID (each is started in its own session, so its process group holds exactly the children it
spawned: the SuperLink's ServerApp and the SuperNodes' ClientApp processes).

Secure by default: ``tls=True`` generates a CA and a server certificate (``deploy/gen_certs.py``),
``auth=True`` starts the SuperLink with ``--enable-supernode-auth`` and registers each SuperNode's
public key with ``flwr supernode register`` before the SuperNode starts. ``tls=False`` (``--insecure``)
is an explicit opt-in for local tests only.

    from simulations.runners.deployment import Deployment
    with Deployment(num_supernodes=3, tls=True, auth=True) as dep:
        outcome = dep.run({"strategy": "kf-linear", "num-server-rounds": 2, ...})

Command line (one machine; prints the results directory):

    .venv/bin/python -m simulations.runners.deployment --supernodes 3 --run-config "num-server-rounds=2"
    .venv/bin/python -m simulations.runners.deployment --insecure --no-auth ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedfuse.config import canonical
from fedfuse.flower.runner.flwr_runner import (ROOT, RunOutcome, check_app_config, descendants, flwr_env,  # noqa: F401
                                             free_port, kill_tree, run_config_arg, toml_value)
from fedfuse.flower.runner.flwr_runner import takes_fedfuse_config

CONNECTION = "fedfuse-deploy"


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


class Deployment:
    """SuperLink + SuperNodes on loopback; ``run`` submits the app with ``flwr run . <connection>``."""

    def __init__(self, num_supernodes: int = 2, *, tls: bool = True, auth: bool = True,
                 node_configs: list[dict[str, Any]] | None = None, app_dir: Path = ROOT,
                 work_dir: str | Path | None = None, start_timeout: float = 60.0):
        if auth and not tls:
            raise ValueError("SuperNode authentication needs TLS (flower-superlink --enable-supernode-auth)")
        self.n = num_supernodes
        self.tls, self.auth = tls, auth
        self.node_configs = node_configs or [{} for _ in range(num_supernodes)]
        self.app_dir = Path(app_dir)
        self._own_work = work_dir is None
        self.work = Path(work_dir or tempfile.mkdtemp(prefix="fedfuse-deploy-"))
        self.home = self.work / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = flwr_env(self.home)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self.superlink: subprocess.Popen | None = None
        self.supernodes: list[subprocess.Popen | None] = []
        self.certs: dict[str, Path] = {}
        self.keys: list[tuple[Path, Path]] = []
        self.logs: dict[str, Path] = {}

    # ----------------------------------------------------------------------------- processes
    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = self.work / f"{name}.log"
        self.logs[name] = log
        fh = open(log, "w")  # noqa: SIM115 - closed in stop()
        proc = subprocess.Popen(cmd, env=self.env, cwd=str(self.work), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        proc._fedfuse_log = fh  # type: ignore[attr-defined]
        return proc

    def _tls_flags_superlink(self) -> list[str]:
        if not self.tls:
            return ["--insecure"]
        return ["--ssl-ca-certfile", str(self.certs["ca"]), "--ssl-certfile", str(self.certs["cert"]),
                "--ssl-keyfile", str(self.certs["key"])]

    def _write_connection(self) -> None:
        lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
                 f'address = "{self.address}"']
        lines.append("insecure = true" if not self.tls else f"root-certificates = {toml_value(str(self.certs['ca']))}")
        (self.home / "config.toml").write_text("\n".join(lines) + "\n")

    def _wait_port(self, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.superlink is not None and self.superlink.poll() is not None:
                raise RuntimeError(f"flower-superlink exited with {self.superlink.returncode}:\n{self.log_tail('superlink')}")
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"flower-superlink did not listen on {self.address} within {timeout:.0f}s")

    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A ``flwr`` CLI command against this deployment (private FLWR_HOME)."""
        return subprocess.run([_bin("flwr"), *args], env=self.env, cwd=str(self.app_dir), capture_output=True,
                              text=True, timeout=timeout)

    def start(self) -> "Deployment":
        if self.tls:
            sys.path.insert(0, str(ROOT / "deploy"))
            from gen_certs import generate  # deploy/gen_certs.py

            self.certs = generate(self.work / "certs")
        cmd = [_bin("flower-superlink"), "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-runtime-dependency-installation", *self._tls_flags_superlink()]
        if self.auth:
            cmd.append("--enable-supernode-auth")
        self.superlink = self._spawn("superlink", cmd)
        self._wait_port(self.start_timeout)
        self._write_connection()
        if self.auth:
            sys.path.insert(0, str(ROOT / "deploy"))
            from gen_node_keys import generate as gen_keys  # deploy/gen_node_keys.py

            self.keys = gen_keys(self.work / "keys", self.n)
            for i, (_, pub) in enumerate(self.keys):
                res = self.flwr("supernode", "register", str(pub), CONNECTION, "--name", f"node-{i}")
                if res.returncode != 0:
                    raise RuntimeError(f"flwr supernode register failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
        for i in range(self.n):
            self.supernodes.append(self.start_supernode(i))
        return self

    def node_config(self, i: int) -> str:
        cfg = {"partition-id": i, "num-partitions": self.n, **self.node_configs[i]}
        return " ".join(f"{k}={toml_value(v)}" for k, v in cfg.items())

    def start_supernode(self, i: int) -> subprocess.Popen:
        cmd = [_bin("flower-supernode"), "--superlink", self.address, "--port", str(free_port()),
               "--node-config", self.node_config(i)]
        cmd += ["--root-certificates", str(self.certs["ca"])] if self.tls else ["--insecure"]
        if self.auth:
            cmd += ["--auth-supernode-private-key", str(self.keys[i][0])]
        return self._spawn(f"supernode-{i}", cmd)

    @staticmethod
    def _kill(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
        """Stop one process we started, and its process group (its own session), by PID."""
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # children (ServerApp / ClientApp processes) may outlive the leader
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        fh = getattr(proc, "_fedfuse_log", None)
        if fh is not None:
            fh.close()

    def kill_supernode(self, i: int) -> None:
        """Simulate a node that disconnects mid-round: SIGKILL the SuperNode and its ClientApp."""
        proc = self.supernodes[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.supernodes:
            self._kill(proc)
        self._kill(self.superlink)
        if self._own_work and not os.environ.get("FEDFUSE_KEEP_DEPLOY"):
            shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> "Deployment":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.logs.get(name)
        return path.read_text(errors="replace")[-chars:] if path and path.exists() else ""

    # ----------------------------------------------------------------------------- runs
    def wait_for_nodes(self, timeout: float = 180.0) -> None:
        """Wait until every SuperNode is registered and online (``flwr supernode list``)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                res = self.flwr("supernode", "list", CONNECTION, "--format", "json", timeout=90)
            except subprocess.TimeoutExpired:  # a slow CLI on a loaded machine: try again until the deadline
                continue
            last = res.stdout
            try:
                nodes = json.loads(res.stdout).get("nodes", [])
                online = [n for n in nodes if str(n.get("status", "")).lower() == "online"]
                if len(online) >= self.n:
                    return
            except json.JSONDecodeError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"SuperNodes not all online after {timeout:.0f}s: {last[-1500:]}")

    def submit(self, run_config: dict[str, Any]) -> int:
        """``flwr run <app> <connection>`` without streaming; returns the run id."""
        res = self.flwr("run", str(self.app_dir), CONNECTION, "--run-config", run_config_arg(run_config, self.app_dir),
                        "--format", "json", timeout=120)
        try:
            return int(json.loads(res.stdout)["run-id"])
        except (json.JSONDecodeError, KeyError, ValueError):
            m = re.search(r"run[ -]id\D+(\d+)", res.stdout + res.stderr, re.I) or \
                re.search(r"run (\d+)", res.stdout + res.stderr)
            if m:
                return int(m.group(1))
            raise RuntimeError(f"flwr run failed (rc {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")

    def status(self, run_id: int) -> tuple[str, str]:
        try:
            res = self.flwr("list", CONNECTION, "--run-id", str(run_id), "--format", "json", timeout=90)
        except subprocess.TimeoutExpired:
            return "unknown", "flwr list timed out"
        try:
            runs = json.loads(res.stdout).get("runs") or []
        except json.JSONDecodeError:
            return "unknown", res.stdout[-1000:] + res.stderr[-1000:]
        if not runs:
            return "unknown", ""
        return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", runs[0].get("sub-status", "")))

    def wait(self, run_id: int, timeout: float = 300.0, poll: float = 2.0) -> tuple[str, str]:
        """Wait until the run has finished (bounded); returns ``(status, details)``."""
        deadline = time.monotonic() + timeout
        status, details = "unknown", ""
        while time.monotonic() < deadline:
            status, details = self.status(run_id)
            if status.startswith("finished"):
                return status, details
            time.sleep(poll)
        try:
            self.flwr("stop", str(run_id), CONNECTION, timeout=90)
        except subprocess.TimeoutExpired:
            pass
        return status, f"timed out after {timeout:.0f}s ({details})"

    def logs_of(self, run_id: int) -> str:
        try:
            res = self.flwr("log", str(run_id), CONNECTION, "--show", timeout=120)
        except subprocess.TimeoutExpired as exc:
            return f"flwr log timed out: {exc}"
        return res.stdout + res.stderr

    def run(self, run_config: dict[str, Any], timeout: float = 300.0, check_config: bool | None = None) -> RunOutcome:
        """Submit the app, wait for the run to finish, return its status, logs and results dir.

        The whole config is checked first (``flwr_runner.check_app_config``; ``ConfigError`` names the key)."""
        # the canonical layout (option tables as dotted keys): Flower refuses keys its pyproject does not declare
        cfg = canonical(run_config) if takes_fedfuse_config(self.app_dir) else dict(run_config)
        cfg.setdefault("output-dir", str((self.app_dir / "results").resolve()))
        cfg.setdefault("run-name", f"deploy-{time.strftime('%Y%m%d-%H%M%S')}")
        cfg.setdefault("num-clients", self.n)
        check_app_config(cfg, self.app_dir, check_config)
        t0 = time.perf_counter()
        self.wait_for_nodes()
        run_id = self.submit(cfg)
        status, details = self.wait(run_id, timeout)
        return RunOutcome(run_id=run_id, status=status, details=details,
                          out_dir=Path(cfg["output-dir"]) / cfg["run-name"], log=self.logs_of(run_id),
                          seconds=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description="Run fedfuse on a loopback SuperLink + SuperNodes deployment.")
    ap.add_argument("--supernodes", type=int, default=2)
    ap.add_argument("--insecure", action="store_true", help="no TLS (local tests only)")
    ap.add_argument("--no-auth", action="store_true", help="no SuperNode authentication")
    ap.add_argument("--run-config", default="", help='e.g. "num-server-rounds=2 strategy=\'kf-linear\'"')
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    from fedfuse.flower.runner.run import overrides_or_exit, preflight_or_exit

    overrides = overrides_or_exit(a.run_config)
    overrides.setdefault("num-clients", a.supernodes)
    preflight_or_exit(overrides)  # before any SuperLink / SuperNode starts
    with Deployment(a.supernodes, tls=not a.insecure, auth=not (a.no_auth or a.insecure)) as dep:
        out = dep.run(overrides, timeout=a.timeout, check_config=False)
        print(out.log[-4000:])
        print(f"run {out.run_id}: {out.status} {out.details} in {out.seconds:.0f}s; results in {out.out_dir}")
        sys.exit(0 if out.ok else 1)


if __name__ == "__main__":
    main()
