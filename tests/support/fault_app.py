"""TEST-ONLY Flower app: fedfuse's own ServerApp/ClientApp with fault injection installed.

- ``client_app``: ``fedfuse.flower.client_app.make_client_app(mods=[fault_mod])``;
- ``server_app``: fedfuse's ``run_server`` with the strategy wrapped by ``FusionFaultStrategy`` when the
  run config's ``test-faults`` has ``fusion:error`` entries. Both strip ``test-faults`` from the
  ``Context`` before the product sees it (the product's run config does not know the key).

``write_fault_app(dest)`` lays out a runnable copy of the app under ``dest`` whose ``pyproject.toml``
points its components here and declares ``test-faults``; ``flwr run <dest>`` then runs with faults.
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedfuse.flower.client_app import make_client_app
from fedfuse.flower.server_app import run_server
from tests.support.faults import FAULTS_KEY, FusionFaultStrategy, fault_mod, fusion_fault_rounds, without_faults_key

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = {"serverapp": "tests.support.fault_app:server_app", "clientapp": "tests.support.fault_app:client_app"}

client_app = make_client_app(mods=[fault_mod])
server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    faults = str(context.run_config.get(FAULTS_KEY, "") or "")
    rounds = fusion_fault_rounds(faults)

    def wrap(strategy, _context):
        return strategy if rounds == set() else FusionFaultStrategy(strategy, rounds)

    run_server(grid, without_faults_key(context), wrap_strategy=wrap)


def write_fault_app(dest: Path) -> Path:
    """Copy the app (``fedfuse``, ``tests/support``) to ``dest`` with a pyproject whose components are
    this module's apps and whose run config declares ``test-faults``; returns ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "fedfuse", dest / "fedfuse", ignore=ignore, dirs_exist_ok=True)
    shutil.copytree(ROOT / "tests" / "support", dest / "tests" / "support", ignore=ignore, dirs_exist_ok=True)
    text = (ROOT / "pyproject.toml").read_text()
    for name, ref in COMPONENTS.items():
        text, n = re.subn(rf'(?m)^{name}\s*=\s*".*"$', f'{name} = "{ref}"', text)
        if n != 1:
            raise RuntimeError(f"pyproject.toml: no single '{name} = ...' line under [tool.flwr.app.components]")
    # the checkout's fab-include / fab-exclude keep its results/ out of the FAB; this copy has no results/, and Flower
    # refuses an exclude pattern that matches no file
    text = re.sub(r'(?m)^fab-(include|exclude)\s*=.*\n', "", text)
    if FAULTS_KEY not in tomllib.loads(text)["tool"]["flwr"]["app"]["config"]:
        text = text.replace("[tool.flwr.app.config]\n",
                            f'[tool.flwr.app.config]\n{FAULTS_KEY} = ""  # TEST ONLY (tests/support/faults.py)\n', 1)
    (dest / "pyproject.toml").write_text(text)
    return dest
