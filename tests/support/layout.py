"""The checkout as the product's tests see it: the product package, and the experiments beside it found by their
structure (a top-level package holding benchmarks: a ``bench`` subpackage), so that the tests which keep the product
apart from them (imports, command line, wheel, cited pages) never import or name them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = "fedfuse"
EXPERIMENTS: tuple[str, ...] = tuple(sorted(p.parent.parent.name for p in ROOT.glob("*/bench/__init__.py")))
