"""Mean ± sample standard deviation, the one way every benchmark table reports spread.

The spread is the *sample* standard deviation (Bessel-corrected, ddof = 1) over seeds: with 3 seeds it
is √(3/2) ≈ 1.22 times the population value (ddof = 0) that older one-shot tables printed. Every table
states it with ``std_note``. NaN values (a method that was n/a on some seed) are left out and the
count of values used is shown.
"""

from __future__ import annotations

from typing import Iterable

# one implementation, shared with the runners' tables (fedfuse compare)
from fedfuse.flower.runner.console import DDOF, STD_PHRASE, finite, format_mean_std, mean_std  # noqa: F401


def std_note(count: int, unit: str = "seed") -> str:
    """The sentence every table carries, e.g. ``mean ± sample std (ddof=1) over 3 seeds``."""
    plural = unit if count == 1 else unit + "s"
    extra = " (one value: no ±)" if count == 1 else ""
    return f"{STD_PHRASE} over {count} {plural}{extra}"


def mean(values: Iterable[float]) -> float:
    v = finite(values)
    return sum(v) / len(v) if v else float("nan")


def pct(values: Iterable[float], signed: bool = False, count: bool = True) -> str:
    """Fractions as a table cell in %: ``"m ± s (n=k)"`` (one value: ``"m (n=1)"``), ``signed`` for differences
    (``"+m"``), ``count=False`` without the ``(n=k)``; ``""`` for none."""
    v = list(values)
    if not v:
        return ""
    m, s, n = mean_std(v)
    text = f"{100 * m:+.1f}" if signed else f"{100 * m:.1f}"
    return text + (f" ± {100 * s:.1f}" if n > 1 else "") + (f" (n={n})" if count else "")


def paired(differences: Iterable[float]) -> str:
    """Per-seed differences as a table cell in points: ``pct(..., signed=True)`` and the values in seed order,
    ``"+m ± s (n=k) [+a, -b, ...]"``; ``""`` for none."""
    d = list(differences)
    return pct(d, signed=True) + " [" + ", ".join(f"{100 * x:+.1f}" for x in d) + "]" if d else ""
