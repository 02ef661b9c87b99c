"""Compatibility shim: the strategies live in ``fedfuse.flower`` (import them from there).

``from server.strategies import build_strategy, STRATEGIES`` is part of the public API contract and
keeps working; a Flower app that has its own top-level ``server`` package imports ``fedfuse.flower``.
"""

from fedfuse.flower import *  # noqa: F401,F403
from fedfuse.flower import __all__  # noqa: F401
