"""The installed product works without the repository: the wheel is built, installed into a fresh virtual
environment, and ``fedfuse`` is run from a folder outside the checkout with ``PYTHONPATH`` unset.

The fresh environment gets the wheel only (``--no-deps``); its dependencies (torch, flwr, ...) come from the test's
own environment through a ``.pth`` line, which adds that ``site-packages`` as a plain path: the editable install of
fedfuse there (a ``.pth`` of its own) is not processed, so neither the checkout's ``fedfuse`` nor its
experiments' package is importable; the test asserts both. The wheel is built with the project's build backend
(hatchling; from the package index through pip's build isolation when it is not installed).

Checked: the wheel's files (the Flower app configuration shipped in the package, no experiments), ``fedfuse --help``,
``fedfuse run`` (in-process engine, one round, default results folder ``./results``), ``fedfuse compare`` (one
strategy, one seed, one round) and ``fedfuse bench`` (an unknown command: the experiments are not the product's); slow: ``fedfuse run`` on
the real ``flwr run`` engine, whose Flower processes (SuperLink, ServerApp, Ray workers) run on the fresh
environment's interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

from tests.support.layout import EXPERIMENTS

ROOT = Path(__file__).resolve().parents[1]
TINY = ("num-clients=2 num-server-rounds=1 local-epochs=1 model-width=16 model-depth=1 fusion-set-size=60 "
        "importance='uniform'")
# Flower's console scripts the `flwr run` engine starts by name (flwr_runner.flwr_env puts the interpreter's bin/
# first on PATH); copied into the fresh environment with its interpreter in the shebang
FLOWER_SCRIPTS = ("flwr", "flower-superlink", "flower-superexec", "flower-supernode", "flwr-serverapp",
                  "flwr-clientapp", "flwr-simulation")


def _build_wheel(out: Path) -> Path:
    # the build backend is a dev dependency (scripts/setup.sh installs it): the build needs no network
    assert importlib.util.find_spec("hatchling") is not None, "hatchling (a dev dependency) is not installed"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out),
           str(ROOT)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"pip wheel failed:\n{(res.stdout + res.stderr)[-4000:]}"
    wheels = list(out.glob("fedfuse-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(wheel, venv, env, cwd)``: the wheel installed into a fresh venv, an environment without PYTHONPATH and
    with that venv first on PATH, and an empty working folder outside the repository."""
    work = tmp_path_factory.mktemp("wheel")
    assert not work.resolve().is_relative_to(ROOT)
    wheel = _build_wheel(work / "dist")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    shared = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "zz_fedfuse_test_dependencies.pth").write_text("".join(f"{p}\n" for p in shared))
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                          "--quiet", str(wheel)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    here_bin = Path(sys.executable).parent
    for name in FLOWER_SCRIPTS:   # flwr[simulation] installs them next to the interpreter
        src = here_bin / name
        assert src.exists(), f"Flower's console script {name} is not next to {sys.executable}"
        body = src.read_text().split("\n", 1)[1]
        (venv / "bin" / name).write_text(f"#!{py}\n{body}")
        (venv / "bin" / name).chmod(0o755)
    drop = {here_bin.resolve()}
    path = [str(venv / "bin")] + [p for p in os.environ.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() not in drop]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    # a short TMPDIR: Ray puts AF_UNIX sockets under it (<TMPDIR>/ray/session_<time>_<pid>/sockets/plasma_store), at
    # most 107 bytes; under pytest's basetemp (/tmp/pytest-of-root/pytest-144/wheel0/tmp) that is 107 with a 5-digit
    # pid, over with a 6-digit one or pytest-xdist's popen-gwN/ (Ray: "AF_UNIX path length cannot exceed 107 bytes")
    tmp = Path(tempfile.mkdtemp(prefix="ffw-"))
    env.update({"PATH": os.pathsep.join(path), "TMPDIR": str(tmp), "FEDFUSE_PROGRESS": "0",
                "OMP_WAIT_POLICY": "PASSIVE", "FEDFUSE_TORCH_THREADS": "1", "MPLBACKEND": "Agg",
                "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0",
                "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"})
    cwd = work / "user"
    cwd.mkdir()
    try:
        yield wheel, venv, env, cwd
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fedfuse(installed, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    _, venv, env, cwd = installed
    return subprocess.run([str(venv / "bin" / "fedfuse"), *args], cwd=str(cwd), env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_wheel_ships_the_product_and_its_flower_app_config_only(installed):
    wheel = installed[0]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        shipped = zf.read("fedfuse/flower/runner/app/pyproject.toml")
    assert shipped == (ROOT / "fedfuse" / "flower" / "runner" / "app" / "pyproject.toml").read_bytes()
    for module in ("run", "sweep", "flwr_runner", "inprocess", "compare", "console"):
        assert f"fedfuse/flower/runner/{module}.py" in names, module
    assert "fedfuse/cli.py" in names and "fedfuse/flower/strategies.py" in names
    assert EXPERIMENTS and not [n for n in names if n.startswith((*(f"{e}/" for e in EXPERIMENTS), "tests/",
                                                                    "scripts/", "results/"))]
    assert not [n for n in names if n.startswith("server/")], "the wheel installs a top-level 'server' package"
    assert "fedfuse = fedfuse.cli:main" in entry_points


def test_installed_fedfuse_runs_and_compares_outside_the_repository(installed):
    _, venv, env, cwd = installed
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import importlib.util, sys, fedfuse; print(fedfuse.__file__); "
                            "print(*(importlib.util.find_spec(e) for e in sys.argv[1:]))", *EXPERIMENTS],
                           cwd=str(cwd), env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    where, *experiments = probe.stdout.split()
    assert Path(where).resolve().is_relative_to(venv.resolve()), where   # the wheel's fedfuse, not the checkout's
    assert EXPERIMENTS and experiments == ["None"] * len(EXPERIMENTS)    # the experiments are not there

    res = _fedfuse(installed, "--help")
    assert res.returncode == 0 and "compare" in res.stdout and "run" in res.stdout, res.stderr

    res = _fedfuse(installed, "run", "--engine", "inprocess", "--no-compare", "--run-config", f"{TINY} run-name='solo'")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = cwd / "results" / "solo"                                       # default results folder: ./results
    for name in ("results.json", "rounds.csv", "run.log", "comparison.md", "comparison.png"):
        assert (out / name).exists(), name
    results = json.loads((out / "results.json").read_text())
    # one round, then the head round (the shipped app config's defaults)
    assert results["status"] == "completed" and [r["round"] for r in results["rounds"]] == [0, 1, 2]
    assert results["config"]["strategy"] == "auto" and results["config"]["head-round"] is True
    assert not list(venv.rglob("results.json"))                         # nothing written into the installation

    res = _fedfuse(installed, "compare", "--strategies", "fedavg", "--partitions", "iid", "--seeds", "0",
                   "--engine", "inprocess", "--run-config", TINY, "--out", "sweep")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((cwd / "sweep" / "sweep.json").read_text())
    assert [(r["strategy"], r["partitioning"], r["seed"], r["status"]) for r in rows] == [
        ("fedavg", "iid", 0, "finished:completed")]
    assert (cwd / "sweep" / "table.md").exists() and (cwd / "sweep" / "accuracy.png").exists()

    res = _fedfuse(installed, "bench", "one-shot")  # the experiments are not a command of the product
    assert res.returncode == 2 and "unknown command 'bench'" in res.stderr
    assert not any(e in res.stderr for e in EXPERIMENTS)


@pytest.mark.slow
def test_installed_fedfuse_run_on_the_flwr_engine_outside_the_repository(installed):
    """A real ``flwr run`` (SuperLink + Ray) of the packaged app directory, from the wheel alone."""
    _, venv, env, cwd = installed
    res = _fedfuse(installed, "run", "--no-compare", "--timeout", "600", "--run-config", f"{TINY} run-name='flwr'",
                   timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads((cwd / "results" / "flwr" / "results.json").read_text())
    assert results["status"] == "completed" and [r["round"] for r in results["rounds"]] == [0, 1, 2]
    assert shutil.which("fedfuse", path=env["PATH"]) == str(venv / "bin" / "fedfuse")
