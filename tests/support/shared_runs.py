"""Real ``flwr run`` simulations (SuperLink + Ray) that several tests assert on, each made once per session.

Most of a small ``flwr run`` is its fixed cost (a SuperLink, a Ray cluster, a Python process per virtual node), so
the tests that need the same real run share it through the session fixtures of ``tests/conftest.py``:

- ``e2e_flwr_run`` (``E2E``, the default strategy ``auto`` on 3 class-disjoint digits clients, 2 rounds, then the
  head round): ``tests/test_e2e_flwr.py``'s end-to-end checks (default suite) and, slow, the in-process engine's
  per-round numbers against it (``tests/test_inprocess_engine.py``);
- ``tiers_flwr_run`` (``TIERS`` with ``kf-linear``: width tiers 1 / 0.5 / 0.25 on MNIST-1D, then the head round):
  ``tests/test_tiers_flower.py``'s real-engine check and the in-process engine's per-round numbers against it;
- ``example_flwr_run`` (``examples/own-flower-app`` by its README's plain ``flwr run``, 2 SuperNodes, 2 rounds):
  ``tests/test_example_app.py``'s end-to-end checks and ``tests/test_stop_superlink.py``'s (the local SuperLink
  that run leaves, stopped by ``fedfuse stop-superlink``).

Session fixtures are per process: under pytest-xdist each worker that reaches a shared run's tests makes the run
again (and ``--dist loadgroup``'s ``xdist_group`` does not group with pytest 9.2 and pytest-xdist 3.8: the worker
renames ``item._nodeid``, which pytest 9.2's node ids no longer read).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own-flower-app"

# the end-to-end config: digits, a width-32 MLP, 3 class-disjoint clients, 2 rounds of 3 local epochs
E2E = {"dataset": "digits", "model": "mlp", "model-width": 32, "model-depth": 1, "num-clients": 3,
       "partitioning": "shards", "num-server-rounds": 2, "local-epochs": 3, "lr": 0.01,
       "fusion-set-size": 120, "min-train-nodes": 3, "importance": "deeplift", "importance-samples": 64}

# width tiers 1 / 0.5 / 0.25, one client each, MNIST-1D
TIERS = {"dataset": "mnist1d", "model": "mlp", "model-width": 32, "model-depth": 1, "num-clients": 3,
         "partitioning": "iid", "num-server-rounds": 2, "local-epochs": 1, "fusion-set-size": 120,
         "min-train-nodes": 3, "importance": "uniform", "client-tiers": "1,0.5,0.25"}


@dataclass
class SharedRun:
    """A finished real run: its ``RunOutcome``, its ``results.json``, the config it was given (without
    ``output-dir`` / ``run-name``) and its number of SuperNodes."""
    outcome: Any
    results: dict
    config: dict
    num_supernodes: int

    @property
    def out_dir(self) -> Path:
        return self.outcome.out_dir


def real_run(config: dict[str, Any], out: Path, name: str, num_supernodes: int) -> SharedRun:
    """``flwr run`` of fedfuse's app with ``config``; asserts it completed."""
    from fedfuse.flower.runner.flwr_runner import run_app

    outcome = run_app({**config, "output-dir": str(out), "run-name": name}, num_supernodes=num_supernodes,
                      timeout=420, echo=False)
    assert outcome.ok, f"run {outcome.run_id} ended {outcome.status}: {outcome.details}\n{outcome.log[-4000:]}"
    results = json.loads((outcome.out_dir / "results.json").read_text())
    return SharedRun(outcome, results, dict(config), num_supernodes)


@dataclass
class PlainRun:
    """A plain ``flwr run`` (Flower's managed local SuperLink, under ``home``): the finished ``flwr run --stream``
    process, the run's status from ``flwr list`` and its results folder."""
    home: Path
    completed: subprocess.CompletedProcess
    status: str
    out_dir: Path

    @property
    def ok(self) -> bool:
        return self.completed.returncode == 0 and self.status == "finished:completed"


def plain_example_run(work: Path) -> PlainRun:
    """``flwr run examples/own-flower-app --federation-config "num-supernodes=2" --stream`` as the example's README
    gives it (no SuperLink address: Flower starts its local SuperLink, which keeps running afterwards), in a private
    Flower home, writing to ``work/own-app``; 2 rounds."""
    from fedfuse.flower.runner.flwr_runner import flwr_env

    home = work / "flwr-home"
    env = flwr_env(home)
    res = subprocess.run(["flwr", "run", str(EXAMPLE), "--run-config",
                          f"output-dir='{work}' run-name='own-app' num-clients=2 num-server-rounds=2",
                          "--federation-config", "num-supernodes=2", "--stream"],
                         env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    status = "unknown"
    m = next((m for line in res.stdout.splitlines() if "start" in line.lower()   # as flwr_runner.run_app reads it
              for m in [re.search(r"run (\d+)", line)] if m), None)
    if m:
        listed = subprocess.run(["flwr", "list", "--run-id", m.group(1), "--format", "json"], env=env, cwd=str(ROOT),
                                capture_output=True, text=True, timeout=120)
        try:
            status = str((json.loads(listed.stdout).get("runs") or [{}])[0].get("status", "unknown"))
        except json.JSONDecodeError:
            status = "unknown: " + listed.stdout[-500:] + listed.stderr[-500:]
    return PlainRun(home, res, status, work / "own-app")


def stop_local_superlink(home: Path) -> None:
    """``fedfuse stop-superlink --flwr-home home`` (nothing to stop is fine)."""
    subprocess.run([sys.executable, "-m", "fedfuse.cli", "stop-superlink", "--flwr-home", str(home)], cwd=str(ROOT),
                   capture_output=True, timeout=120)
