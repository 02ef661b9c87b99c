"""``scripts/setup.sh``'s reuse check (issue 58, fast first contact): an up-to-date ``.venv`` is recognised from
files alone (its stamp, the ``fedfuse`` command and the interpreter it names, the packages' folders) without running
the environment's Python; a changed ``pyproject.toml`` or a missing package means a reinstall.

The script runs in a copy of the checkout's layout whose ``.venv/bin/python`` fails loudly if called at all."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flwr", "torch", "torchvision", "timm", "captum", "ot")
FMNIST = Path("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz")

pytestmark = pytest.mark.skipif(not FMNIST.exists() or shutil.which("sha256sum") is None,
                                reason="the set-up would try to install Fashion-MNIST first (apt), or no sha256sum")


def _checkout(tmp_path: Path) -> Path:
    """``scripts/setup.sh`` and ``pyproject.toml`` beside a fake ``.venv`` whose stamp is up to date."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\ntouch {tmp_path / 'python-was-run'}\nexit 1\n")
    fedfuse = venv / "bin" / "fedfuse"
    fedfuse.write_text(f"#!{python}\n")
    for exe in (python, fedfuse):
        exe.chmod(0o755)
    site = venv / "lib" / "python3.11" / "site-packages"
    for name in ("fedfuse-0.1.0.dist-info", *PACKAGES):
        (site / name).mkdir(parents=True)
    version = subprocess.run([sys.executable, "-c", "import sys; print(sys.version)"], capture_output=True,
                             text=True, check=True).stdout
    stamp = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + version.encode()).hexdigest()
    (venv / ".fedfuse-stamp").write_text(stamp + "\n")
    return tmp_path


def _setup(checkout: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}   # the stamp's interpreter: the one the stamp above was made with
    return subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)


def test_an_up_to_date_venv_is_reused_without_running_its_python(tmp_path):
    checkout = _checkout(tmp_path)
    res = _setup(checkout)
    assert res.returncode == 0 and res.stdout == "setup: reusing up-to-date .venv\n", res.stdout + res.stderr
    assert not (checkout / "python-was-run").exists()


@pytest.mark.parametrize("change", ["pyproject", "package", "interpreter"])
def test_a_stale_venv_is_reinstalled(tmp_path, change):
    """A changed ``pyproject.toml`` (the stamp differs), a package folder gone, or a ``fedfuse`` command naming an
    interpreter that is not there (the checkout moved): the script installs (here: the fake Python fails)."""
    checkout = _checkout(tmp_path)
    if change == "pyproject":
        with (checkout / "pyproject.toml").open("a") as f:
            f.write("\n# changed\n")
    elif change == "package":
        (checkout / ".venv" / "lib" / "python3.11" / "site-packages" / "torch").rmdir()
    else:
        (checkout / ".venv" / "bin" / "fedfuse").write_text("#!/nowhere/.venv/bin/python\n")
    res = _setup(checkout)
    assert "setup: installing fedfuse into .venv" in res.stdout and res.returncode != 0, res.stdout + res.stderr
    assert (checkout / "python-was-run").exists()
