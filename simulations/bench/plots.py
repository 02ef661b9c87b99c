"""Plots of benchmark results (matplotlib, Agg backend)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from fedfuse.flower.runner.compare import round_curves  # noqa: F401  (the default run's plot)
from simulations.bench.stats import mean_std


def short_label(label: str) -> str:
    """Plot tick label: common NI options abbreviated so long variant names fit."""
    for pat, rep in [(r'head_target="probs"', "probs"), (r"head_weights=true", "hw"), (r"fused_width=", "w"),
                     (r"ridge=", "ridge"), (r"\((deep|unif|cond)[a-z]*", r"(\1")]:
        label = re.sub(pat, rep, label)
    return label


def accuracy_bars(acc: dict[tuple[str, str], list[float]], settings: list[str], order: list[str], path: Path,
                  references: dict[str, str] | None = None) -> None:
    """One panel per setting: horizontal bars (mean ± sample std, ddof=1, of ``acc[(label, setting)]`` in %)
    per row label in ``order``; ``references`` ``{label: legend}`` are drawn as vertical lines instead."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    references = references if references is not None else {"best-base": "best base", "ensemble": "ensemble"}
    bars = [o for o in order if o not in references or o == "ensemble"]
    ncol = min(3, len(settings))
    nrow = math.ceil(len(settings) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 0.28 * len(bars) * nrow + 1.5 * nrow), squeeze=False,
                             sharey=True)
    for i, (ax, st) in enumerate(zip(axes.flat, settings)):
        stats = [mean_std(acc.get((lab, st), [])) for lab in bars]
        means = [m * 100 if n else 0.0 for m, _, n in stats]
        stds = [s * 100 if n > 1 else 0.0 for _, s, n in stats]
        y = list(range(len(bars)))
        colors = ["tab:gray" if lab in ("ensemble", "average") else
                  "tab:orange" if lab.startswith(("kd", "lp")) else "tab:blue" for lab in bars]
        ax.barh(y, means, xerr=stds, color=colors, alpha=0.85)
        ax.set_yticks(y, [short_label(o) for o in bars], fontsize=7)
        if i == 0:
            ax.invert_yaxis()
        for (lab, legend), style in zip(references.items(), [dict(color="k", ls="--"), dict(color="tab:red", ls=":")]):
            m, _, n = mean_std(acc.get((lab, st), []))
            if n:
                ax.axvline(m * 100, lw=1, label=legend, **style)
        ax.set_title(st, fontsize=9)
        ax.set_xlabel("test accuracy (%), mean ± sample std")
        ax.legend(fontsize=6, loc="lower right")
    for ax in list(axes.flat)[len(settings):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

