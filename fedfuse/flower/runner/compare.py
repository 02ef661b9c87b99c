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
| client ensemble, uniform (final round) | the reference: averaged softmax of the last training round's client models |
| best client (final round) | the best of the last training round's client models on the same test set (if recorded) |
| fallback / guarded / skipped | rounds whose fusion fell back / the divergence guard used the average / skipped |

Every run that ends with the head round is shown both ways (``RunSummary.split_head``): its last training round's model
(as Flower users run FedAvg) and ``<label> + head round``. The baseline runs with the head round when the strategy does
(like for like), and the verdict line says what the strategy's aggregation adds on top of the baseline given the same
head round, with the numbers.

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
from fedfuse.config_layout import STRATEGY_OWN_PATHS
from fedfuse.flower.runner.console import head_round_record, rounds_text
from fedfuse.references import REFERENCE_LABELS, gap_recovered
from fedfuse.results import privacy_text

BASELINE = "fedavg"
HEAD_SUFFIX = " + head round"   # the label of a baseline's row with the head round (RunSummary.split_head)
# the run-config keys a strategy's own settings live in (``fedfuse.config_layout.STRATEGY_OWN_PATHS``): not carried
# over to the baseline, which runs with its own defaults
STRATEGY_ONLY_KEYS = STRATEGY_OWN_PATHS


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
    # a DP run: results.json "privacy" (the (epsilon, delta) account, every release's epsilon), or None
    privacy: dict[str, Any] | None = None

    @classmethod
    def load(cls, label: str, engine: str, out_dir: Path, error: str | None = None) -> "RunSummary":
        path = Path(out_dir) / "results.json"
        rows: list[dict[str, Any]] = []
        references = privacy = None
        if path.exists():
            res = json.loads(path.read_text())
            rows = list(res.get("rounds", []))
            references, privacy = res.get("one-shot-references"), res.get("privacy")
            if error is None and (res.get("error") or res.get("status") not in (None, "completed")):
                error = str(res.get("error") or f"status {res.get('status')!r}")
        elif error is None:
            error = f"no results.json in {out_dir}"
        return cls(label=label, engine=engine, rows=rows, error=error, out_dir=Path(out_dir), references=references,
                   privacy=privacy)

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
        plain = RunSummary(self.label, self.engine, self.rows[:cut], None, self.out_dir, self.references, self.privacy)
        return [plain, RunSummary(f"{self.label}{HEAD_SUFFIX}", self.engine, self.rows, None, self.out_dir,
                                  self.references, self.privacy)]

    def epsilon(self) -> float | None:
        """A DP run's ε at this row's model: after its last training round's release for a row without the head round
        (``split_head``'s first), the account's final ε with it; ``None`` without DP."""
        if not self.privacy or not isinstance(self.privacy.get("epsilon"), (int, float)):
            return None
        if self.head_round():
            return float(self.privacy["epsilon"])
        rounds = [r for r in self.privacy.get("per-release", []) if str(r.get("what", "")).startswith("round ")]
        return float(rounds[-1]["epsilon"]) if rounds else float(self.privacy["epsilon"])

    def privacy_cell(self) -> str:
        """The table's ``privacy (ε, δ)`` cell: ``(10.73, 1e-05)``, or ``none`` for a run without DP."""
        eps = self.epsilon()
        return "none" if eps is None else f"({eps:.2f}, {self.privacy.get('delta', float('nan')):g})"

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
        """The clients' ensemble's accuracy in the last training round (the head round trains none), else ``None``."""
        v = (self.last_trained_row() or {}).get("ensemble-accuracy")
        return float(v) if isinstance(v, (int, float)) else None

    def marked_rounds(self, key: str) -> list[int]:
        return [int(r["round"]) for r in self.rows if r.get(key)]

    def last_trained_row(self) -> dict[str, Any] | None:
        """The last training round's row (the head round's row excluded; ``None`` without one)."""
        rows = [r for r in self.rows if r.get("round", 0) > 0 and head_round_record(r) is None]
        return rows[-1] if rows else None

    def best_client_final(self) -> float | None:
        """The best client model's test accuracy in the last training round (``client-references``), else ``None``."""
        v = (self.last_trained_row() or {}).get("best-client-accuracy")
        return float(v) if isinstance(v, (int, float)) else None

    def head_round(self) -> bool:
        """Whether the run's last row with an accuracy is the head round."""
        rows = [r for r in self.rows if isinstance(r.get(self.metric), (int, float))]
        return len(rows) >= 2 and head_round_record(rows[-1]) is not None

    def head_round_number(self) -> int | None:
        """The head round's row number (``num-server-rounds + 1``) when the run ends with it, else ``None``."""
        return int(self.curve()[-1][0]) if self.head_round() else None


def both_ways(runs: list[RunSummary]) -> list[RunSummary]:
    """``runs`` with every run that ends with the head round split into its trained model and ``<label> + head
    round`` (``RunSummary.split_head``); a run already split (or labelled ``... + head round``) is left as it is."""
    out: list[RunSummary] = []
    for run in runs:
        out += [run] if run.label.endswith(HEAD_SUFFIX) else run.split_head()
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def comparison_table(runs: list[RunSummary], baseline: str = BASELINE) -> str:
    """Markdown table of ``runs`` side by side (columns: module docstring), each run that ends with the head round
    both ways (``both_ways``); the reach column is measured against the run labelled ``baseline`` (absent or failed:
    ``-``)."""
    runs = both_ways(runs)
    ref = next((r for r in runs if r.label == baseline and r.final is not None), None)
    target = ref.final if ref else None
    # '(baseline)' only beside another strategy: a run of the baseline alone is not compared with anything
    compared = any(r.label not in (baseline, baseline + HEAD_SUFFIX) for r in runs)
    reach_head = f"first round ≥ {baseline}'s final" + (f" ({target:.4f})" if target is not None else "")
    private = any(r.privacy for r in runs)   # a DP run: its (epsilon, delta) on every row, this row's model's
    lines = [f"| strategy | engine | final accuracy | best (round) | {reach_head} | client ensemble, uniform (final round) | "
             "best client (final round) | fallback / guarded / skipped rounds |"
             + (" privacy (ε, δ) |" if private else ""), "|---|---|---|---|---|---|---|---|" + ("---|" if private else "")]
    for run in runs:
        name = run.label + (" (baseline)" if run.label == baseline and compared else "")
        if run.error or run.final is None:
            why = (run.error or ("no round has an accuracy (neither central test-accuracy nor federated-accuracy)"
                                 if run.rows else "no rounds")).splitlines()[0][:120]
            lines.append(f"| {name} | {run.engine} | failed: {why} | | | | | |" + (" |" if private else ""))
            continue
        best = run.best()
        head_at = run.head_round_number()
        reach = "-"
        if target is not None:
            k = run.first_round_reaching(target)
            reach = "head round" if k is not None and k == head_at else str(k) if k is not None else "never"
        counts = " / ".join(str(len(run.marked_rounds(k))) for k in ("fallback", "guard", "skipped"))
        fed = " (federated)" if run.federated else ""
        at = "head round" if best[0] == head_at else best[0]
        lines.append(f"| {name} | {run.engine} | {_f(run.final)}{fed} | {_f(best[1])} ({at}) | {reach} | "
                     f"{_f(run.ensemble_final())} | {_f(run.best_client_final())} | {counts} |"
                     + (f" {run.privacy_cell()} |" if private else ""))
    note = head_round_note(runs)
    return "\n".join(lines) + (f"\n\n{note}" if note else "")


def steps_title(runs: list[RunSummary]) -> str:
    """The line a comparison's plot titles carry about the runs' steps: ``"2 rounds + head round: the '+ head round'
    rows include it, the others end at round 2"``, or ``"2 rounds"`` when no run has the head round."""
    runs = both_ways(runs)
    trained = sorted({int(r.last_trained_row()["round"]) for r in runs if r.last_trained_row() is not None})
    if not trained:
        return ""
    if not any(r.head_round() and not r.error for r in runs):
        return rounds_text(trained[-1], False)
    last = "/".join(str(t) for t in trained)
    return f"{rounds_text(trained[-1], True)}: the ★ '{HEAD_SUFFIX.strip()}' rows include it, the others end at round {last}"


def privacy_title(runs: list[RunSummary]) -> str:
    """The line a comparison's plot titles carry about differential privacy: each DP run's final ``(ε, δ)``
    (``fedfuse.results.privacy_text``), ``""`` when no run is private."""
    seen = [r for r in runs if r.privacy and not r.label.endswith(HEAD_SUFFIX)]
    if not seen:
        return ""
    texts = {privacy_text(r.privacy) for r in seen}
    if len(texts) == 1 and len(seen) == len([r for r in runs if not r.label.endswith(HEAD_SUFFIX)]):
        return texts.pop() + " (every run)" if len(seen) > 1 else texts.pop()
    return "; ".join(f"{r.label}: {privacy_text(r.privacy)}" for r in seen)


def head_round_note(runs: list[RunSummary]) -> str | None:
    """The line under a table whose rows differ by the head round: which rows include it (``<x> + head round``: after
    it, one more exchange after the last training round) and which end at their last training round (``None`` when no
    row has the head round)."""
    headed = [r for r in runs if r.head_round() and not r.error]
    if not headed:
        return None
    trained = sorted({int(r.last_trained_row()["round"]) for r in runs if r.last_trained_row() is not None})
    last = "round " + "/".join(str(t) for t in trained) if trained else "their last training round"
    rounds = rounds_text(trained[-1], True) if len(trained) == 1 else "training rounds + head round"
    plain = [r.label for r in runs if not r.head_round() and not r.error and r.final is not None]
    return (f"{rounds}: rows '<strategy>{HEAD_SUFFIX}' include the head round (one more exchange after {last}: the "
            "classifier solved from the clients' statistics)" + (
                f"; the other rows ({', '.join(plain)}) are the model of {last}, without it" if plain else ""))


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
    the fused model recovers; a line saying why when they are unavailable; ``None`` when the run has none. With the
    head round the references are measured against the fused round (round 1), like for like (none of them got the
    head round), and ``<run> + head round`` is its own row: its gain is one more exchange's, not the fusion's."""
    refs = run.references
    if not refs:
        return None
    if "unavailable" in refs:
        return f"one-shot references unavailable: {refs['unavailable']}"
    final = run.final
    n = len(refs.get("client-accuracy", {}))
    last_s = (run.rows[-1].get("fusion-seconds") if run.rows else None)
    head = ", then the head round" if run.rows and head_round_record(run.rows[-1]) is not None else ""
    sec = (lambda v: f"{v:.2f}" if isinstance(v, (int, float)) else "-")
    lines = [f"One-shot references: the same {n} client models on the server's test set (no extra client "
             f"training; {refs.get('seconds', 0.0):.1f}s on the server)", ""]
    compared = final   # what the references are measured against: like for like, none of them got the head round
    if head:   # the fused round (round 1) is the fusion's result; the head round is one more exchange, its own row
        r1 = next((r for r in run.rows if r.get("round") == 1), {})
        one = r1.get(run.metric)
        compared = one if isinstance(one, (int, float)) else None
        diff = "-" if final is None or compared is None else f"{compared - final:+.4f}"
        lines += [f"| model | test accuracy | {run.label}'s fused round minus it | seconds |", "|---|---|---|---|",
                  f"| **{run.label}, fused round** (round 1: this run's fused model; like every reference below, no "
                  f"head round) | {_f(compared)} | | {sec(r1.get('fusion-seconds'))} |",
                  f"| {run.label}{HEAD_SUFFIX} (one more exchange: the classifier solved from the clients' statistics; "
                  f"no reference below has it) | {_f(final)} | {diff} | {sec(last_s)} |"]
    else:
        lines += [f"| model | test accuracy | {run.label} minus it | seconds |", "|---|---|---|---|",
                  f"| **{run.label}** (this run's fused model) | {_f(final)} | | {sec(last_s)} |"]
    for r in refs.get("rows", []):
        label = REFERENCE_LABELS.get(r["key"], r["key"]) + (f" (client {r['partition-id']})" if "partition-id" in r
                                                            else "")
        if "accuracy" not in r:
            lines.append(f"| {label} | unavailable: {str(r.get('unavailable'))[:100]} | | |")
            continue
        diff = "-" if compared is None else f"{compared - r['accuracy']:+.4f}"
        if r.get("warning"):   # a distillation that collapsed to one prediction: the row says so
            label += " (collapsed: one class for almost every fusion-set input)"
        lines.append(f"| {label} | {_f(r['accuracy'])} | {diff} | {sec(r.get('seconds'))} |")
    acc = {r["key"]: r["accuracy"] for r in refs.get("rows", []) if "accuracy" in r}
    if final is not None and "best-client" in acc and "ensemble" in acc:
        best, ens = acc["best-client"], acc["ensemble"]
        one = next((r.get(run.metric) for r in run.rows if r.get("round") == 1), None) if head else None
        if head and isinstance(one, (int, float)):
            # the fused round's own part and the head round's: the head round's classifier is solved from the
            # clients' statistics (one more exchange), so its gain is not the fusion's: one line for both would credit
            # the fusion with it (docs/one-shot.md, "What a one-shot run prints")
            lines += ["", f"{run.label}'s fused round (round 1, {one:.4f}) {_gap_text(one, best, ens)}; the head round "
                          f"adds {final - one:+.4f} (the classifier solved from the clients' statistics), so the model "
                          f"after the head round ({final:.4f}) {_gap_text(final, best, ens)} (one seed)"]
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
    """One line: how far each strategy ends above or below the baseline (this seed only).

    When both the strategy and the baseline end with the head round (the default: like for like), the line leads with
    what the strategy's aggregation adds on top of the baseline given the same head round, then the same comparison
    before the head round, what the head round itself adds to each, and where the strategy's final model stands
    against its clients' ensemble and best client (its last training round). Otherwise: the final accuracy against the
    baseline's, with the head round's share of the strategy's gain when only the strategy had one."""
    runs = both_ways(runs)
    ref = next((r for r in runs if r.label == baseline and r.final is not None), None)
    if ref is None:
        return None
    headed = next((r for r in runs if r.label == baseline + HEAD_SUFFIX and r.final is not None), None)
    heads = {r.label[: -len(HEAD_SUFFIX)]: r for r in runs if r.label.endswith(HEAD_SUFFIX) and r is not headed
             and r.final is not None and not r.error}
    others = [r for r in runs if r is not ref and r is not headed and not r.label.endswith(HEAD_SUFFIX)
              and r.final is not None and not r.error]
    if not others:
        return None
    what = "final federated accuracy (clients' validation splits)" if ref.federated else "final accuracy"
    tail = " (one seed; mean ± std over seeds: `fedfuse compare` / fedfuse.flower.runner.sweep)"
    if headed is not None and all(r.label in heads for r in others):
        return f"{what}, given the same head round: " + "; ".join(
            _like_for_like(r, heads[r.label], ref, headed) for r in others) + tail
    parts = []
    for r in others:
        head = heads.get(r.label)
        end = head.final if head is not None else r.final
        parts.append(f"{r.label} {end - ref.final:+.4f}"
                     + (f" ({head.final - r.final:+.4f} of it from the head round)" if head is not None else ""))
    return f"{what} vs {baseline}: " + ", ".join(parts) + tail


def _points(d: float) -> str:
    return f"{100 * d:+.2f} points"


def _client_references(run: RunSummary) -> list[tuple[str, float]]:
    """``[(name, accuracy)]`` of the run's last training round's clients for the verdict: their ensemble (the stronger
    of the uniform one the rows record and, in a one-shot run, the one weighted by samples of its references) and the
    best client."""
    acc = {r["key"]: float(r["accuracy"]) for r in (run.references or {}).get("rows", [])
           if isinstance(r.get("accuracy"), (int, float))}
    ensembles = [(v, name) for v, name in ((run.ensemble_final(), "their ensemble"),
                                           (acc.get("ensemble"), "their ensemble (weighted by samples)"))
                 if v is not None]
    out = [(name, v) for v, name in sorted(ensembles, key=lambda e: e[0])[-1:]]
    best = run.best_client_final()
    best = acc.get("best-client") if best is None else best
    return out + ([("the best of them", best)] if best is not None else [])


def _like_for_like(run: RunSummary, run_head: RunSummary, base: RunSummary, base_head: RunSummary) -> str:
    """The verdict of one strategy against the baseline, both with the head round (see ``verdict``)."""
    a, b = run_head.final, base_head.final
    text = (f"{run.label} adds {_points(a - b)} on top of {base.label} ({run_head.label} {a:.4f} vs "
            f"{base_head.label} {b:.4f}); before the head round {_points(run.final - base.final)} "
            f"({run.final:.4f} vs {base.final:.4f}); the head round itself adds {_points(a - run.final)} to "
            f"{run.label} and {_points(b - base.final)} to {base.label}")
    refs = _client_references(run)
    last = (run.last_trained_row() or {}).get("round")
    if refs:
        text += (f"; {run_head.label} vs {run.label}'s clients of round {last}: " + ", ".join(
            f"{name} {v:.4f} ({_points(a - v)})" for name, v in refs))
    return text


# one look per run of a comparison plot (colour, marker, line style): runs whose curves coincide (strategy 'auto' at
# few local epochs is FedAvg's average) stay distinguishable, and each is drawn slightly beside the others (_DODGE)
_LOOKS = (("C0", "o", "-"), ("C1", "s", "--"), ("C2", "^", "-."), ("C4", "v", ":"), ("C5", "P", "-"),
          ("C6", "X", "--"), ("C7", "d", "-."), ("C8", "<", ":"))
_DODGE = 0.1          # rounds between two runs' markers at the same round (the largest offset is under half a round)
HEAD_TICK = "head\nround"


def head_round_steps(series: list[dict]) -> tuple[dict[int, int], dict[int, int]]:
    """Which plotted points are a head round: ``({series index: round of its head-round point}, {index of a
    '<label> + head round' series: index of its twin without it})``.

    A series says so with ``head_round`` (``True``: its last point; an int: that round; ``False``: none). Otherwise it
    is read from the comparison's own rows: a series labelled ``<x> + head round ...`` whose points are those of the
    series labelled ``<x> ...`` plus one (``RunSummary.split_head``) has its head round at that last point, and every
    other series ending at that same round ends with the head round too (the runs of one comparison share their
    rounds)."""
    steps: dict[int, int] = {}
    twins: dict[int, int] = {}
    for i, s in enumerate(series):
        label, pts = s.get("label", ""), sorted(s.get("points", []))
        if HEAD_SUFFIX not in label or len(pts) < 2:
            continue
        plain = label.replace(HEAD_SUFFIX, "", 1)
        j = next((j for j, t in enumerate(series) if j != i and t.get("label") == plain
                  and sorted(t.get("points", [])) == pts[:-1]), None)
        if j is not None:
            twins[i] = j
            steps[i] = pts[-1][0]
    inferred = set(steps.values())
    for i, s in enumerate(series):
        pts = sorted(s.get("points", []))
        flag = s.get("head_round")
        if flag is False or not pts:
            steps.pop(i, None)
        elif flag is True:
            steps[i] = pts[-1][0]
        elif isinstance(flag, int):
            steps[i] = flag
        elif i not in steps and len(inferred) == 1 and len(pts) >= 2 and pts[-1][0] in inferred:
            steps[i] = pts[-1][0]
    return steps, twins


def round_curves(series: list[dict], path: Path, title: str = "", ylabel: str = "test accuracy") -> Path:
    """Test accuracy per round of several runs (the default run: the strategy next to FedAvg), and every run's final
    accuracy beside it, each row visible.

    Each ``series`` item: ``label``, ``points`` (``[(round, accuracy)]``, round 0 = the initial model), optional
    ``fell_back`` / ``guarded`` / ``skipped`` (lists of rounds, marked on the curve: red ×, orange ring, grey diamond),
    ``head_round`` (``head_round_steps``), ``ensemble`` / ``best_client`` (the clients' ensemble's and the best client's
    accuracy in the last training round: dashed reference lines and rows). Left panel: one curve per run, each with
    its own colour, marker and line style and drawn a little beside the others, so that identical curves stay
    visible; the head round is its own step after the last training round (shaded, tick 'head round'), reached by a
    dotted segment and marked with a star; a ``<x> + head round`` series that repeats ``<x>``'s rounds is drawn as
    that step only. Right panel: every row's final accuracy (a training run's last round, a run with the head round
    both before and after it, the references), labelled with its value. Round ticks are integers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, twins = head_round_steps(series)
    drawn = [i for i, s in enumerate(series) if s.get("points")]
    style = _curve_style(series, drawn, twins)
    fig, (ax, side) = plt.subplots(1, 2, figsize=(10.4, 4.4), gridspec_kw={"width_ratios": [1.45, 1]})
    finals, last_training = _draw_runs(ax, series, drawn, steps, twins, style)
    finals += _reference_lines(ax, series)
    _round_axis(ax, sorted(set(steps.values())), last_training)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    else:   # nothing to draw: say so on the figure rather than leave it empty
        ax.text(0.5, 0.5, "no round has an accuracy", ha="center", va="center", transform=ax.transAxes)
    _final_rows(side, finals)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


#: the marks of a run's special rounds on its curve (``round_curves``)
_ROUND_MARKS = {"fell_back": dict(marker="x", color="red", markersize=12, markeredgewidth=2.5, ls="none",
                                  label="fusion fell back"),
                "guarded": dict(marker="o", color="orange", fillstyle="none", markersize=13, markeredgewidth=2,
                                ls="none", label="guarded (weighted average used)"),
                "skipped": dict(marker="D", color="gray", fillstyle="none", markersize=10, ls="none",
                                label="round skipped (too few valid replies)")}


def _curve_style(series: list[dict], drawn: list[int], twins: dict[int, int]) -> dict[str, Any]:
    """Each drawn run's offset, head-round star offset, look, marker size and line width (``round_curves``): each run
    a little beside the others (a share of the axis, so that it shows on long runs too), its head-round star further
    apart inside the head round's band; markers and lines thinner run by run, so that a run drawn over an identical
    one leaves a ring of it visible; a ``<x> + head round`` twin takes ``<x>``'s look."""
    last_round = max((r for s in series for r, _ in s.get("points", [])), default=1)
    dodge = min(max(_DODGE, 0.012 * last_round), 0.8 / max(len(drawn), 1))
    plain = [i for i in drawn if i not in twins]
    look = {i: _LOOKS[k % len(_LOOKS)] for k, i in enumerate(plain)}
    for i, j in twins.items():
        look[i] = look.get(j, _LOOKS[0])
    return {"offset": {i: (k - (len(drawn) - 1) / 2) * dodge for k, i in enumerate(drawn)},
            "star": {i: (k - (len(drawn) - 1) / 2) * min(0.22, 0.8 / max(len(drawn), 1)) for k, i in enumerate(drawn)},
            "plain": plain, "look": look,
            "size": {i: max(9.0 - 2.5 * k, 3.5) for k, i in enumerate(plain)},
            "width": {i: max(2.6 - 0.9 * k, 0.9) for k, i in enumerate(plain)}}


def _draw_runs(ax: Any, series: list[dict], drawn: list[int], steps: dict[int, int], twins: dict[int, int],
               style: dict[str, Any]) -> tuple[list[tuple[str, float, tuple, bool]], int]:
    """One curve per run (its head round a dotted step to a star), its special rounds marked; ``(the right panel's
    rows, the last training round drawn)``. A ``<x> + head round`` twin is drawn as that step only."""
    offset, star, look = style["offset"], style["star"], style["look"]
    labelled: set[str] = set()
    finals: list[tuple[str, float, tuple, bool]] = []   # (row label, accuracy, look, head round) of the right panel
    last_training = 0
    for i in drawn:
        s = series[i]
        pts = sorted(s["points"])
        color, marker, ls = look[i]
        dx = offset[i]
        head_at = steps.get(i)
        train = [(r, a) for r, a in pts if head_at is None or r != head_at]
        head_pt = next(((r, a) for r, a in pts if r == head_at), None)
        base = s["label"]
        if i in twins:   # '<x> + head round': only its head round differs from <x>'s curve
            j = twins[i]
            prev = sorted(series[j]["points"])[-1]
            ax.plot([prev[0] + offset[j], head_pt[0] + star[i]], [prev[1], head_pt[1]], ls=":", color=color, lw=1.3)
            ax.plot([head_pt[0] + star[i]], [head_pt[1]], ls="none", marker="*", markersize=15, color=color,
                    markeredgecolor="black", markeredgewidth=0.6, zorder=6, label=base)
            finals.append((_run_name(base) + HEAD_SUFFIX if HEAD_SUFFIX not in _run_name(base) else _run_name(base),
                           head_pt[1], look[i], True))
            continue
        if train:
            xs, ys = zip(*train)
            ax.plot([x + dx for x in xs], ys, ls=ls, marker=marker, color=color, markersize=style["size"][i],
                    lw=style["width"][i], label=base, zorder=3 + style["plain"].index(i) * 0.1)
            last_training = max(last_training, train[-1][0])
        if head_pt is not None:
            if train:
                ax.plot([train[-1][0] + dx, head_pt[0] + star[i]], [train[-1][1], head_pt[1]], ls=":", color=color,
                        lw=1.3)
            ax.plot([head_pt[0] + star[i]], [head_pt[1]], ls="none", marker="*", markersize=15, color=color,
                    markeredgecolor="black", markeredgewidth=0.6, zorder=6)
        name = _run_name(base)
        if train and train[-1][0] > 0:
            finals.append((f"{name}, round {train[-1][0]}", train[-1][1], look[i], False))
        if head_pt is not None:
            finals.append((f"{name}{HEAD_SUFFIX}", head_pt[1], look[i], True))
        acc = dict(pts)
        for key, mark in _ROUND_MARKS.items():
            at = [(r + dx, acc[r]) for r in s.get(key, []) if r in acc]
            if at:
                mark = dict(mark)
                if mark["label"] in labelled:
                    mark["label"] = "_nolegend_"
                labelled.add(mark["label"])
                ax.plot(*zip(*at), zorder=5, **mark)
    return finals, last_training


def _reference_lines(ax: Any, series: list[dict]) -> list[tuple[str, float, tuple, bool]]:
    """The clients' ensemble and the best client of the first run that has them: dashed lines, and their rows."""
    rows = []
    for key, what, ls in (("ensemble", "clients' ensemble", "--"), ("best_client", "best client", "-.")):
        owner = next((s for s in series if isinstance(s.get(key), (int, float))), None)
        if owner is not None:
            label = f"{what} ({_run_name(owner['label'])}'s last round)"
            ax.axhline(float(owner[key]), color="0.35", ls=ls, lw=1.0, label=label, zorder=1)
            rows.append((label, float(owner[key]), ("0.35", "|", ls), False))
    return rows


def _round_axis(ax: Any, head_steps: list[int], last_training: int) -> None:
    """Integer round ticks; the head round as its own step (shaded, its own tick) when a run has one."""
    from matplotlib.ticker import MaxNLocator

    if not head_steps:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        return
    h = head_steps[-1]
    ax.axvspan(h - 0.5, h + 0.5, color="0.92", zorder=0)
    ax.plot([], [], ls="none", marker="*", markersize=12, color="white", markeredgecolor="black",
            label="after the head round (classifier solved from the clients' statistics)")
    train_ticks = [int(t) for t in MaxNLocator(integer=True, nbins=8).tick_values(0, max(last_training, 1))
                   if 0 <= t <= min(last_training, h - 1)]
    ax.set_xticks(train_ticks + [h])
    ax.set_xticklabels([str(t) for t in train_ticks] + [HEAD_TICK])
    ax.set_xlim(-0.5, h + 0.5)


def _run_name(label: str) -> str:
    """A series label without its engine (``'auto (flwr run)'`` → ``'auto'``)."""
    return label.rsplit(" (", 1)[0] if label.endswith(")") and " (" in label else label


def _final_rows(ax: Any, finals: list[tuple[str, float, tuple, bool]]) -> None:
    """The right panel of ``round_curves``: one row per final accuracy, highest on top, a dot (a star after the head
    round) in its run's colour and its value; the axis spans the rows' values (not 0 to 1), so differences of a point
    show."""
    if not finals:
        ax.axis("off")
        return
    rows = sorted(finals, key=lambda f: f[1])
    lo, hi = min(f[1] for f in rows), max(f[1] for f in rows)
    pad = max(0.02, 0.08 * (hi - lo))
    for y, (label, value, (color, marker, _), head) in enumerate(rows):
        ax.plot([lo - pad, value], [y, y], color="0.85", lw=1, zorder=1)
        ax.plot([value], [y], ls="none", marker="*" if head else marker, markersize=13 if head else 7, color=color,
                markeredgecolor="black" if head else color, markeredgewidth=0.6, zorder=3)
        ax.annotate(f"{value:.4f}", (value, y), xytext=(9, 0), textcoords="offset points", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f[0] for f in rows], fontsize=7)
    ax.set_xlim(lo - pad, hi + 2.2 * pad)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("final accuracy of every row", fontsize=8)


def baseline_runs(run: RunSummary) -> list[RunSummary]:
    """The comparison's baseline runs written inside ``run``'s folder (``<run>/baseline-<strategy>/``, as
    ``fedfuse run`` writes them), each both ways (``RunSummary.split_head``); only those written after ``run`` finished
    (a folder left by an earlier command of the same run name is not this comparison's)."""
    if run.out_dir is None or not (Path(run.out_dir) / "results.json").exists():
        return []
    finished = (Path(run.out_dir) / "results.json").stat().st_mtime
    out: list[RunSummary] = []
    for d in sorted(Path(run.out_dir).glob("baseline-*")):
        res = d / "results.json"
        if res.exists() and res.stat().st_mtime >= finished:
            out += RunSummary.load(d.name[len("baseline-"):], "in-process", d).split_head()
    return [r for r in out if not r.error and r.final is not None]


def reference_bars(run: RunSummary, path: Path, title: str = "", others: list[RunSummary] | None = None) -> Path:
    """``comparison.png`` of a one-shot run: one horizontal bar per model, sorted by test accuracy, each labelled with
    its accuracy: the fused one (highlighted; with the head round both ways: the fused round and ``+ head round``, a
    hatched bar with a star), the comparison's baseline runs (``others``, default ``baseline_runs(run)``; FedAvg and
    ``FedAvg + head round``) and the references (``reference_points``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items: list[tuple[str, float, str]] = []   # (label, accuracy, kind: fused | head | baseline | baseline-head | ref)
    if run.final is not None:
        if run.head_round():
            r1 = next((r for r in run.rows if r.get("round") == 1), {})
            one, choice = r1.get(run.metric), r1.get("choice")   # strategy 'auto': the fusion the clients chose
            if isinstance(one, (int, float)):
                items.append((f"{run.label}{f' ({choice})' if choice else ''}, fused round (round 1)", float(one),
                              "fused"))
            items.append((f"{run.label}{HEAD_SUFFIX}", run.final, "head"))
        else:
            items.append((f"{run.label} (fused)", run.final, "fused"))
    for other in (baseline_runs(run) if others is None else both_ways(list(others))):
        if other.final is None or other.error:
            continue
        head = other.label.endswith(HEAD_SUFFIX)
        label = other.label if head else f"{other.label}, round {other.curve()[-1][0]}"
        items.append((label, other.final, "baseline-head" if head else "baseline"))
    items = sorted(items + [(label, acc, "ref") for label, acc in reference_points(run)], key=lambda kv: kv[1])
    fig, ax = plt.subplots(figsize=(6.8, 0.45 * len(items) + 1.2))
    colors = {"fused": "C3", "head": "C3", "baseline": "C1", "baseline-head": "C1", "ref": "C0"}
    bars = ax.barh([label for label, _, _ in items], [acc for _, acc, _ in items],
                   color=[colors[kind] for _, _, kind in items])
    for bar, (_, acc, kind) in zip(bars, items):
        if kind in ("head", "baseline-head"):   # the head round is its own step: hatched, a star at its end
            bar.set_hatch("//")
            bar.set_edgecolor("black")
            ax.plot([acc], [bar.get_y() + bar.get_height() / 2], ls="none", marker="*", markersize=11,
                    color=colors[kind], markeredgecolor="black", markeredgewidth=0.6)
        ax.text(acc + (0.035 if kind in ("head", "baseline-head") else 0.015), bar.get_y() + bar.get_height() / 2,
                f"{acc:.3f}", va="center", fontsize=8)
    from matplotlib.patches import Patch
    present = {kind.split("-")[0] for _, _, kind in items}
    fused_what = f"{run.label}: this run's fused model" + (", its fused round" if "head" in present else "")
    handles = [Patch(color=colors[k], label=text) for k, text in (
        ("fused", fused_what),
        ("baseline", "the baseline's run (same clients, lr, epochs)"),
        ("ref", "references from the same client models (no head round)"))
        if k in present or (k == "fused" and "head" in present)]
    if any(kind in ("head", "baseline-head") for _, _, kind in items):   # not the fusion's: one more exchange
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//",
                             label="+ head round: one more exchange after it (not the fusion's gain)"))
    if len(handles) > 1:
        # under the axes: inside, it hid the shortest bars' values
        ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    ax.set_xlim(0, 1.1)
    ax.set_xlabel("test accuracy (server test set)")
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    what = "one-shot: the fused model and its references"
    if any(kind in ("head", "baseline-head") for _, _, kind in items):
        what += "; hatched ★: after the head round"
    ax.set_title((title + "\n" if title else "") + what, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path)
