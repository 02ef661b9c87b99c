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
    sources = ["fedfuse/cli.py", "fedfuse/flower/runner/run.py", "tests/test_gitignore.py", "README.md",
               "docs/index.md", "docs/configuration.md", "pyproject.toml"]
    assert _ignored(sources) == set()


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_tracked_evidence_is_not_ignored_and_is_indexed():
    """The ignore rules tell the truth: no tracked file matches them, and every tracked results/ folder has its line
    in results/INDEX.md (scripts/results_index.py)."""
    res = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.split() == []
    tracked = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    index = (ROOT / "results" / "INDEX.md").read_text()
    folders = {"/".join(f.split("/")[:3] if f.split("/")[1] == "one_shot" and f.count("/") > 2 else f.split("/")[:2])
               for f in tracked if f != "results/INDEX.md"}
    assert [f for f in sorted(folders) if f"`{f}`" not in index] == []
