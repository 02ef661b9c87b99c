"""The default run's comparison: a strategy next to a baseline (FedAvg) on the same split and seed.

``baseline_config`` turns a run config into the baseline's (same data, split, seed, training; the
strategy-specific keys dropped); ``RunSummary.load`` reads a finished run's ``results.json``;
``comparison_table`` is the side-by-side markdown table printed at the end of ``fedfuse run``; ``round_curves``
plots the runs' accuracy per round (``comparison.png``):

| column | meaning |
|---|---|
| final accuracy | central test accuracy of the global model after the last round; with ``evaluation='federated'`` (no
server test set) the clients' sample-weighted accuracy on their validation splits, marked ``(federated)`` |
| best (round) | the highest test accuracy over rounds 1.., and its round |
| first round ≥ <baseline>'s final | first round (1..) whose accuracy reaches the baseline's final accuracy; ``never`` |
| client ensemble, uniform (final round) | the reference: averaged softmax of that round's client models (if recorded) |
| fallback / guarded / skipped | rounds whose fusion fell back / the divergence guard used the average / skipped |

The baseline runs with the head round when the strategy does (like for like); its row without the head round (as Flower
users run FedAvg) and its row with it (``<baseline> + head round``) come from that one run, and the verdict line says
what the strategy's aggregation adds on top of the latter.

A one-shot run adds ``references_table``: its fused model next to the references the server computed from the same
client models (``fedfuse.references``: best and mean client, weighted ensemble, one-shot FedAvg, KD, FedDF), drawn
as bars on ``comparison.png`` instead of the one-round curves (``reference_bars``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfuse.config import canonical
from fedfuse.flower.runner.console import head_round_record
from fedfuse.references import REFERENCE_LABELS, gap_recovered

BASELINE = "fedavg"
HEAD_SUFFIX = " + head round"   # the label of a baseline's row with the head round (RunSummary.split_head)
# run-config keys that only some strategies read: not carried over to the baseline (FedAvg reads none of them;
# fedfuse.config rejects most of them for fedavg)
STRATEGY_ONLY_KEYS = ("fusion-options", "strategy-options.fusion-rounds", "strategy-options.refine",
                      "strategy-options.refine-prior", "strategy-options.divergence-guard", "strategy-options.server-lr",
                      "strategy-options.server-momentum", "strategy-options.proximal-mu", "tier-options.models",
                      "tier-options.ordered-dropout")


def baseline_config(run_config: dict[str, Any], baseline: str = BASELINE, *, output_dir: str | None = None,
                    run_name: str | None = None) -> dict[str, Any]:
    """``run_config`` for ``baseline``: the same keys (dataset, split, seed, clients, training) except the
    strategy, the strategy-only keys (``STRATEGY_ONLY_KEYS``) and the head round; ``output-dir``/``run-name`` when given. A warm
    start's baseline runs from scratch (``mode='multi-round'``, no warm-start keys)."""
    cfg = {k: v for k, v in canonical(run_config).items() if k not in STRATEGY_ONLY_KEYS}
    cfg["strategy"] = baseline
    # like for like: the baseline ends with the head round when the strategy does (the key's default: on), so one run
    # gives FedAvg as Flower users run it (its training rounds) and FedAvg + the head round (its last row):
    # ``RunSummary.split_head`` makes them two rows, and the verdict says what the aggregation adds on top of the latter
    cfg["head-round"] = bool(run_config.get("head-round", True))
    if cfg.get("mode") == "warm-start":   # the baseline of a warm start is FedAvg from scratch (docs/warm-start.md)
        cfg = {k: v for k, v in cfg.items() if not k.startswith("warm-start-options.")}
        cfg["mode"] = "multi-round"
    if output_dir is not None:
        cfg["output-dir"] = output_dir
    if run_name is not None:
        cfg["run-name"] = run_name
    return cfg


@dataclass
class RunSummary:
    """One finished run as the comparison sees it."""

    label: str                      # the strategy (row name)
    engine: str                     # "flwr run" or "in-process"
    rows: list[dict[str, Any]] = field(default_factory=list)  # results.json rounds (round 0 = initial model)
    error: str | None = None        # why the run has no usable result
    out_dir: Path | None = None
    # one-shot mode: results.json "one-shot-references" (fedfuse.references), or None
    references: dict[str, Any] | None = None

    @classmethod
    def load(cls, label: str, engine: str, out_dir: Path, error: str | None = None) -> "RunSummary":
        path = Path(out_dir) / "results.json"
        rows: list[dict[str, Any]] = []
        references = None
        if path.exists():
            res = json.loads(path.read_text())
            rows = list(res.get("rounds", []))
            references = res.get("one-shot-references")
            if error is None and (res.get("error") or res.get("status") not in (None, "completed")):
                error = str(res.get("error") or f"status {res.get('status')!r}")
        elif error is None:
            error = f"no results.json in {out_dir}"
        return cls(label=label, engine=engine, rows=rows, error=error, out_dir=Path(out_dir), references=references)

    @property
    def metric(self) -> str:
        """The accuracy the comparison reads: ``test-accuracy`` (central) when any round has it, else
        ``federated-accuracy`` (``evaluation='federated'``: the clients' validation splits)."""
        for key in ("test-accuracy", "federated-accuracy"):
            if any(isinstance(r.get(key), (int, float)) and r.get("round", 0) > 0 for r in self.rows):
                return key
        return "test-accuracy"

    @property
    def federated(self) -> bool:
        return self.metric == "federated-accuracy"

    def split_head(self) -> list["RunSummary"]:
        """``[self]`` without a head round; otherwise ``[the run without its head-round row (labelled as it is),
        the whole run labelled '<label> + head round']``: FedAvg as Flower users run it and FedAvg with fedfuse's
        post-step, from one run."""
        rows = [r for r in self.rows if isinstance(r.get(self.metric), (int, float))]
        if self.error or len(rows) < 2 or head_round_record(rows[-1]) is None:
            return [self]
        cut = self.rows.index(rows[-1])
        plain = RunSummary(self.label, self.engine, self.rows[:cut], None, self.out_dir, self.references)
        return [plain, RunSummary(f"{self.label}{HEAD_SUFFIX}", self.engine, self.rows, None, self.out_dir,
                                  self.references)]

    def curve(self) -> list[tuple[int, float]]:
        """``[(round, accuracy)]`` of rounds with an accuracy (``metric``), round 0 (initial model) included."""
        key = self.metric
        return [(int(r["round"]), float(r[key])) for r in self.rows if isinstance(r.get(key), (int, float))]

    @property
    def final(self) -> float | None:
        c = self.curve()
        return c[-1][1] if c and c[-1][0] > 0 else None

    def best(self) -> tuple[int, float] | None:
        c = [(r, a) for r, a in self.curve() if r > 0]
        return max(c, key=lambda ra: (ra[1], -ra[0])) if c else None

    def first_round_reaching(self, target: float) -> int | None:
        """First round ≥ 1 with accuracy ≥ ``target`` (``None``: never)."""
        return next((r for r, a in self.curve() if r > 0 and a >= target - 1e-9), None)

    def ensemble_final(self) -> float | None:
        last = [r for r in self.rows if r.get("round", 0) > 0]
        v = last[-1].get("ensemble-accuracy") if last else None
        return float(v) if isinstance(v, (int, float)) else None

    def marked_rounds(self, key: str) -> list[int]:
        return [int(r["round"]) for r in self.rows if r.get(key)]


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def comparison_table(runs: list[RunSummary], baseline: str = BASELINE) -> str:
    """Markdown table of ``runs`` side by side (columns: module docstring); the reach column is measured
    against the run labelled ``baseline`` (absent or failed: ``-``)."""
    ref = next((r for r in runs if r.label == baseline and r.final is not None), None)
    target = ref.final if ref else None
    reach_head = f"first round ≥ {baseline}'s final" + (f" ({target:.4f})" if target is not None else "")
    lines = [f"| strategy | engine | final accuracy | best (round) | {reach_head} | client ensemble, uniform (final round) | "
             "fallback / guarded / skipped rounds |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        name = run.label + (" (baseline)" if run.label == baseline else "")
        if run.error or run.final is None:
            why = (run.error or ("no round has an accuracy (neither central test-accuracy nor federated-accuracy)"
                                 if run.rows else "no rounds")).splitlines()[0][:120]
            lines.append(f"| {name} | {run.engine} | failed: {why} | | | | |")
            continue
        best = run.best()
        reach = "-"
        if target is not None:
            k = run.first_round_reaching(target)
            reach = str(k) if k is not None else "never"
        counts = " / ".join(str(len(run.marked_rounds(k))) for k in ("fallback", "guard", "skipped"))
        fed = " (federated)" if run.federated else ""
        lines.append(f"| {name} | {run.engine} | {_f(run.final)}{fed} | {_f(best[1])} ({best[0]}) | {reach} | "
                     f"{_f(run.ensemble_final())} | {counts} |")
    return "\n".join(lines)


def reference_points(run: RunSummary) -> list[tuple[str, float]]:
    """``[(label, test accuracy)]`` of a one-shot run's computed references (``fedfuse.references``), in their
    order; ``[]`` without any."""
    rows = (run.references or {}).get("rows", [])
    return [(REFERENCE_LABELS.get(r["key"], r["key"]) + (f" (client {r['partition-id']})" if "partition-id" in r
                                                         else ""), float(r["accuracy"]))
            for r in rows if isinstance(r.get("accuracy"), (int, float))]


def references_table(run: RunSummary) -> str | None:
    """A one-shot run's fused model next to its references (``fedfuse.references``: best and mean client, weighted
    ensemble, one-shot FedAvg, KD, FedDF) on the same test set, with the share of the best-client-to-ensemble gap
    the fused model recovers; a line saying why when they are unavailable; ``None`` when the run has none."""
    refs = run.references
    if not refs:
        return None
    if "unavailable" in refs:
        return f"one-shot references unavailable: {refs['unavailable']}"
    final = run.final
    n = len(refs.get("client-accuracy", {}))
    fused_s = (run.rows[-1].get("fusion-seconds") if run.rows else None)
    head = ", then the head round" if run.rows and head_round_record(run.rows[-1]) is not None else ""
    lines = [f"One-shot references: the same {n} client models on the server's test set (no extra client "
             f"training; {refs.get('seconds', 0.0):.1f}s on the server)", "",
             f"| model | test accuracy | {run.label} minus it | seconds |", "|---|---|---|---|",
             f"| **{run.label}** (this run's fused model{head}) | {_f(final)} | | "
             f"{'-' if fused_s is None else f'{fused_s:.2f}'} |"]
    if head:   # head-round: the last training round's model too
        r1 = next((r for r in run.rows if r.get("round") == 1), {})
        one, one_s = r1.get(run.metric), r1.get("fusion-seconds")
        diff = "-" if final is None or one is None else f"{final - one:+.4f}"
        lines.append(f"| {run.label}, one-shot round (round 1) | {_f(one)} | {diff} | "
                     f"{'-' if one_s is None else f'{one_s:.2f}'} |")
    for r in refs.get("rows", []):
        label = REFERENCE_LABELS.get(r["key"], r["key"]) + (f" (client {r['partition-id']})" if "partition-id" in r
                                                            else "")
        if "accuracy" not in r:
            lines.append(f"| {label} | unavailable: {str(r.get('unavailable'))[:100]} | | |")
            continue
        diff = "-" if final is None else f"{final - r['accuracy']:+.4f}"
        sec = f"{r['seconds']:.2f}" if isinstance(r.get("seconds"), (int, float)) else "-"
        lines.append(f"| {label} | {_f(r['accuracy'])} | {diff} | {sec} |")
    acc = {r["key"]: r["accuracy"] for r in refs.get("rows", []) if "accuracy" in r}
    if final is not None and "best-client" in acc and "ensemble" in acc:
        best, ens = acc["best-client"], acc["ensemble"]
        one = next((r.get(run.metric) for r in run.rows if r.get("round") == 1), None) if head else None
        if head and isinstance(one, (int, float)):
            # the fused round's own part and the head round's: the head round's classifier is solved from the
            # clients' statistics (one more exchange), so its gain is not the fusion's: one line for both would credit
            # the fusion with it (docs/one-shot.md, "What a one-shot run prints")
            lines += ["", f"{run.label}'s fused round (round 1, {one:.4f}) {_gap_text(one, best, ens)}; the head round "
                          f"adds {final - one:+.4f} (the classifier solved from the clients' statistics), so the final "
                          f"model ({final:.4f}) {_gap_text(final, best, ens)} (one seed)"]
        else:
            lines += ["", f"{run.label} {_gap_text(final, best, ens)} (one seed)"]
    return "\n".join(lines)


def _gap_text(acc: float, best: float, ensemble: float) -> str:
    """Where ``acc`` stands between the best client and the clients' ensemble: the share of that gap it recovers, or,
    below the best client / above the ensemble, by how many points (the share of a small gap would read as thousands
    of percent)."""
    share = gap_recovered(acc, best, ensemble)
    if share is None:
        return "recovers - of the gap between the best client and the ensemble (the ensemble is not above the best client)"
    if share < 0:
        return f"is {100 * (best - acc):.1f} points below the best client"
    if share > 1:
        return (f"is {100 * (acc - ensemble):.1f} points above the clients' ensemble (which is "
                f"{100 * (ensemble - best):.1f} points above the best client)")
    return f"recovers {100 * share:.0f}% of the gap between the best client and the ensemble"


def verdict(runs: list[RunSummary], baseline: str = BASELINE) -> str | None:
    """One sentence: how far each strategy ends above or below the baseline (this seed only)."""
    ref = next((r for r in runs if r.label == baseline and r.final is not None), None)
    if ref is None:
        return None
    headed = next((r for r in runs if r.label == baseline + HEAD_SUFFIX and r.final is not None), None)
    others = [r for r in runs if r is not ref and r is not headed and r.final is not None and not r.error]
    parts = [f"{r.label} {r.final - ref.final:+.4f}" + _head_share(r) for r in others]
    if not parts:
        return None
    what = "final federated accuracy (clients' validation splits)" if ref.federated else "final accuracy"
    line = f"{what} vs {baseline}: " + ", ".join(parts)
    if headed is not None:   # what the aggregation adds on top of the baseline given the same head round
        own = [f"{r.label} {r.final - headed.final:+.4f}" for r in others if _head_share(r)]
        if own:
            line += (f"; vs {headed.label} (the same post-step given to {baseline}), the aggregation's own part: "
                     + ", ".join(own))
    return line + " (one seed; mean ± std over seeds: `fedfuse compare` / fedfuse.flower.runner.sweep)"


def _head_share(run: RunSummary) -> str:
    """`` (+x from the head round)`` when the run ended with a head round, so that the aggregation's share and the
    head round's are not mistaken for each other; empty otherwise."""
    key = run.metric
    rows = [r for r in run.rows if isinstance(r.get(key), (int, float))]
    if len(rows) < 2 or head_round_record(rows[-1]) is None:
        return ""
    return f" ({rows[-1][key] - rows[-2][key]:+.4f} of it from the head round)"


def round_curves(series: list[dict], path: Path, title: str = "", ylabel: str = "test accuracy") -> Path:
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
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:   # nothing to draw: say so on the figure rather than leave it empty
        ax.text(0.5, 0.5, "no round has an accuracy", ha="center", va="center", transform=ax.transAxes)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def reference_bars(run: RunSummary, path: Path, title: str = "") -> Path:
    """``comparison.png`` of a one-shot run: one horizontal bar per model, the fused one (highlighted) and its
    references (``reference_points``), sorted by test accuracy, each labelled with its accuracy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [(f"{run.label} (fused)", run.final)] if run.final is not None else []
    items = sorted(items + reference_points(run), key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(6.8, 0.45 * len(items) + 1.2))
    colors = ["C3" if label.endswith("(fused)") else "C0" for label, _ in items]
    bars = ax.barh([label for label, _ in items], [acc for _, acc in items], color=colors)
    for bar, (_, acc) in zip(bars, items):
        ax.text(acc + 0.01, bar.get_y() + bar.get_height() / 2, f"{acc:.3f}", va="center", fontsize=8)
    ax.set_xlim(0, 1.08)
    ax.set_xlabel("test accuracy (server test set)")
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title((title + "\n" if title else "") + "one-shot: the fused model and its references", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
