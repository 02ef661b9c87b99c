"""Progress of long work (sweeps, benchmarks, training many clients): a ``tqdm`` bar on a terminal, nothing otherwise.

    for cell in progress(cells, desc="sweep", unit="run"):
        ...
        progress_print(f"sweep: {name}: done")      # a line above the bar (plain print without a bar)

The bar (elapsed, rate and ETA) is drawn on stdout only when stdout is a terminal, so logs, CI output and
``| tee`` captures hold the per-step lines alone. ``FEDFUSE_PROGRESS=0`` turns it off, ``=1`` forces it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def enabled() -> bool:
    """Whether bars are drawn: ``FEDFUSE_PROGRESS`` (0/1) if set, else whether stdout is a terminal."""
    forced = os.environ.get("FEDFUSE_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def progress(items: Iterable[T], *, desc: str = "", unit: str = "it", total: int | None = None,
             leave: bool = True) -> Iterator[T] | Iterable[T]:
    """``items`` with a ``tqdm`` bar (ETA) on a terminal; ``items`` unchanged otherwise."""
    if not enabled():
        return items
    from tqdm import tqdm

    try:  # on a pseudo-terminal of size 0x0 (script, some containers/IDEs) tqdm draws nothing (rows 0 hide every bar)
        size = os.get_terminal_size(sys.stdout.fileno())
        sized = size.columns > 0 and size.lines > 0
    except (OSError, ValueError, AttributeError):
        sized = False
    return tqdm(items, desc=desc, unit=unit, total=total, leave=leave, file=sys.stdout, dynamic_ncols=sized,
                ncols=None if sized else 100, nrows=None if sized else 24)


def progress_print(text: str) -> None:
    """Print a line without breaking an active bar (``tqdm.write``); a plain flushed print otherwise."""
    if enabled():
        from tqdm import tqdm

        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(text, flush=True)
