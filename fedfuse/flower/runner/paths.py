"""Where the runners find the Flower app's configuration and where results go by default.

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

import tomllib
from pathlib import Path

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
