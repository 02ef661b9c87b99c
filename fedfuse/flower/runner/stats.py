"""Mean ± sample standard deviation, the one way every table of fedfuse's runners and benchmarks reports spread.

The spread is the *sample* standard deviation (Bessel-corrected, ddof = 1) over seeds: with 3 seeds it is
√(3/2) ≈ 1.22 times the population value (ddof = 0). NaN values (a method that was n/a on some seed) are left
out and the count of values used is shown.
"""

from __future__ import annotations

import math
from typing import Iterable

DDOF = 1
STD_PHRASE = f"mean ± sample std (ddof={DDOF})"


def finite(values: Iterable[float]) -> list[float]:
    """The values that are not NaN / None."""
    return [float(v) for v in values if v is not None and v == v]


def mean_std(values: Iterable[float]) -> tuple[float, float, int]:
    """``(mean, sample std with ddof=1, count)`` of the non-NaN values; std is NaN with fewer than 2."""
    v = finite(values)
    n = len(v)
    if n == 0:
        return float("nan"), float("nan"), 0
    m = sum(v) / n
    if n < 2:
        return m, float("nan"), n
    return m, math.sqrt(sum((x - m) ** 2 for x in v) / (n - DDOF)), n


def format_mean_std(values: Iterable[float], scale: float = 1.0, digits: int = 1) -> str:
    """``"m ± s"`` (times ``scale``), ``"m"`` for a single value, ``"n/a"`` for none; ``" (k/n)"`` is
    appended when only k of n values were finite."""
    values = list(values)
    m, s, n = mean_std(values)
    if n == 0:
        return "n/a"
    text = f"{m * scale:.{digits}f}" if n < 2 else f"{m * scale:.{digits}f} ± {s * scale:.{digits}f}"
    return text + ("" if n == len(values) else f" ({n}/{len(values)})")
