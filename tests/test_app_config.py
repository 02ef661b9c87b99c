"""The Flower app configuration shipped in the package (``fedfuse/flower/runner/app/pyproject.toml``): what
``fedfuse run`` / ``fedfuse compare`` use when fedfuse is installed without its repository. It must equal the
repository's ``[tool.flwr.app]`` and ``[tool.flwr.app.config]`` value for value, so that a run has the same
defaults installed or in a checkout; Flower must accept it as an app directory."""

import io
import tomllib
import zipfile
from pathlib import Path

from fedfuse.flower.runner import flwr_runner as paths

ROOT = Path(__file__).resolve().parents[1]


def _typed(table: dict) -> dict:
    """Values with their types (TOML ``1`` and ``1.0`` and ``true`` differ for Flower's run config)."""
    return {k: (_typed(v) if isinstance(v, dict) else (type(v).__name__, v)) for k, v in table.items()}


def test_packaged_app_config_equals_the_repositorys_value_for_value():
    repo = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packaged = tomllib.loads((paths.PACKAGE_APP_DIR / "pyproject.toml").read_text())
    hint = ("fedfuse/flower/runner/app/pyproject.toml must repeat the repository pyproject.toml's [tool.flwr.app] "
            "tables exactly: copy them over")
    # fab-include / fab-exclude describe the files of each folder (the checkout keeps results/ out of its FAB; the
    # packaged folder holds only its pyproject.toml): every other key is the same
    files_only = ("fab-include", "fab-exclude")
    assert _typed({k: v for k, v in packaged["tool"]["flwr"]["app"].items() if k not in files_only}) == \
        _typed({k: v for k, v in repo["tool"]["flwr"]["app"].items() if k not in files_only}), hint
    assert not set(files_only) & set(packaged["tool"]["flwr"]["app"]), "the packaged folder has no results/ to leave out"
    assert list(packaged["tool"]["flwr"]["app"]["config"]) == list(repo["tool"]["flwr"]["app"]["config"]), hint
    for key in ("name", "version"):
        assert packaged["project"][key] == repo["project"][key]
    assert set(packaged["tool"]) == {"flwr"} and set(packaged["tool"]["flwr"]) == {"app"}


def test_flower_accepts_the_packaged_app_dir_and_bundles_only_its_config():
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.config_utils import load_and_validate

    config, warnings = load_and_validate(paths.PACKAGE_APP_DIR / "pyproject.toml")
    assert config["tool"]["flwr"]["app"]["components"]["serverapp"] == paths.SERVER_APP and not warnings
    fab = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(paths.PACKAGE_APP_DIR)))
    assert sorted(fab.namelist()) == [".info/CONTENT", "pyproject.toml"]


def test_in_a_checkout_runs_use_the_checkout_and_both_app_dirs_fuse_the_same_config():
    from fedfuse.flower.runner.flwr_runner import ROOT as RUNNER_ROOT
    from fedfuse.flower.runner.inprocess import fused_run_config

    assert paths.CHECKOUT == ROOT and paths.APP_DIR == ROOT and RUNNER_ROOT == ROOT
    assert paths.is_fedfuse_app(ROOT) and paths.is_fedfuse_app(paths.PACKAGE_APP_DIR)
    assert not paths.is_fedfuse_app(ROOT / "examples" / "own-flower-app")
    assert paths.default_results_dir() == ROOT / "results"
    assert paths.results_dir_for(paths.PACKAGE_APP_DIR) == ROOT / "results"  # never inside the installation
    cfg = {"strategy": "fedavg", "num-server-rounds": 1, "fusion-options": "{ridge=1e-3}"}
    assert fused_run_config(cfg, paths.PACKAGE_APP_DIR) == fused_run_config(cfg, ROOT)
