"""A default run's results folder never dirties ``git status``: every ``results/`` output is ignored (committed
benchmark tables/plots are added with ``git add -f`` and stay tracked)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ignored(paths: list[str]) -> set[str]:
    # --no-index: the ignore rules alone, whether or not a file of that name is tracked
    res = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode in (0, 1), res.stderr
    return set(res.stdout.split())


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_results_folders_are_ignored_and_sources_are_not():
    run = "results/average-digits-mlp-shards-s0-20260101-120000"
    outputs = [f"{run}/{name}" for name in ("accuracy.png", "comparison.png", "comparison.md", "rounds.csv",
                                            "results.json", "config.json", "run.log", "global_model.pt", "DONE")]
    outputs += [f"{run}/baseline-fedavg/accuracy.png", "results/sweep/table.md", "results/sweep/accuracy.png",
                "results/one_shot/mine/table.md", "examples/quickstart/results/run/accuracy.png"]
    assert _ignored(outputs) == set(outputs)
    sources = ["fedfuse/cli.py", "simulations/runners/run.py", "tests/test_gitignore.py", "README.md", "docs/index.md",
               "docs/configuration.md", "pyproject.toml"]
    assert _ignored(sources) == set()
