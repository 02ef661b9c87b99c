"""Plots of benchmark results (matplotlib, Agg backend)."""

from __future__ import annotations

import math
import re
from pathlib import Path

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


def round_curves(series: list[dict], path: Path, title: str = "") -> Path:
    """Test accuracy per round of several runs on one axis (the default run: the strategy next to FedAvg).

    Each ``series`` item: ``label``, ``points`` (``[(round, accuracy)]``, round 0 = the initial model) and
    optional ``fell_back`` / ``guarded`` / ``skipped`` (lists of rounds), marked on the curve (red ×, orange
    ring, grey diamond). Round ticks are integers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    marks = {"fell_back": dict(marker="x", color="red", markersize=12, markeredgewidth=2.5, ls="none",
                               label="fusion fell back"),
             "guarded": dict(marker="o", color="orange", fillstyle="none", markersize=13, markeredgewidth=2, ls="none",
                             label="guarded (weighted average used)"),
             "skipped": dict(marker="D", color="gray", fillstyle="none", markersize=10, ls="none",
                             label="round skipped (too few valid replies)")}
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labelled: set[str] = set()
    for s in series:
        pts = sorted(s["points"])
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, "o-", label=s["label"])
        acc = dict(pts)
        for key, style in marks.items():
            at = [(r, acc[r]) for r in s.get(key, []) if r in acc]
            if at:
                style = dict(style)
                if style["label"] in labelled:
                    style["label"] = "_nolegend_"
                labelled.add(style["label"])
                ax.plot(*zip(*at), zorder=5, **style)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
