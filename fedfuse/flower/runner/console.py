"""How the runners show what they do: the quiet console (one line per round, the warnings that matter, everything
else in a log file), progress bars of long work and the one format of a spread over seeds (mean ± sample std).

A ``flwr run`` of the default config prints ~130 lines (Flower's strategy banner, Ray notices, the
aggregated-metrics dump); a user wants to see the rounds go by and hear about anything that went wrong.
``QuietConsole`` is the ``on_line`` handler of both engines (``flwr_runner.run_app``,
``inprocess.run_app_inprocess``): every line goes to the run's ``run.log``; the console shows

- one line per round (``format_round``), built from the ServerApp's INFO line ``fedfuse round N: ...``
  (logged after each round's evaluation) and that round's row of ``results.json`` (loss, ensemble, fallback / guard / skipped /
  rejected / failure marks);
- every ERROR line, and every WARNING line from fedfuse (fusion fallback, divergence guard, rejected
  replies, failed or silent nodes: ``is_user_warning``);
- at the end, how many other (Flower/Ray) warnings the log holds, so nothing disappears unsaid.

``verbose=True`` prints nothing itself (the engine echoes every line) and only writes the log.

**Progress** of long work (sweeps, benchmarks, training many clients): a ``tqdm`` bar on a terminal, nothing otherwise.

    for cell in progress(cells, desc="sweep", unit="run"):
        ...
        progress_print(f"sweep: {name}: done")      # a line above the bar (plain print without a bar)

The bar (elapsed, rate and ETA) is drawn on stdout only when stdout is a terminal, so logs, CI output and
``| tee`` captures hold the per-step lines alone. ``FEDFUSE_PROGRESS=0`` turns it off, ``=1`` forces it.

**Spread**: mean ± sample standard deviation, the one way every table of fedfuse's runners and benchmarks reports spread.

The spread is the *sample* standard deviation (Bessel-corrected, ddof = 1) over seeds: with 3 seeds it is
√(3/2) ≈ 1.22 times the population value (ddof = 0). NaN values (a method that was n/a on some seed) are left
out and the count of values used is shown.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO, TypeVar
from fedfuse.results import rounds_text  # noqa: F401  (the console's, tables' and plots' count of a run's steps)
import math
from typing import Iterable

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
LOG_LINE = re.compile(r"^\s*(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s?(.*)$", re.S)
ROUND_LINE = re.compile(r"^fedfuse round (\d+): ")          # the ServerApp's INFO line after each evaluation
PLAN_PREFIX = "fedfuse plan: "                                # the ServerApp's INFO line per choice of the run's plan
ROUND_ACCURACY = re.compile(r"test-accuracy ([0-9.eE+-]+|nan)")
# WARNING messages fedfuse itself logs (fedfuse.flower.*, the in-process grid): shown on the console. Every
# log(WARNING, ...) in fedfuse starts with one of them (tests/test_default_run.py scans the sources)
USER_PREFIXES = ("fedfuse", "aggregate_train", "strategy ", "LocalGrid", "configure_train", "ClientApp", "auto: ",
                 "robust screen")
USER_WORDS = ("fell back", "fallback", "guard", "rejected", "failed", "no reply", "diverged", "timed out", "timeout")
PY_WARNING = re.compile(r"\b[A-Za-z]*Warning: ")
# a Python warning raised in fedfuse's own code ("/.../fedfuse/data/partition.py:149: UserWarning: ...")
FEDFUSE_PY_WARNING = re.compile(r"[/\\]fedfuse[/\\][^:]*\.py:\d+: ([A-Za-z]*Warning: .*)$")
MAX_WARNING_CHARS = 400


def strip_ansi(line: str) -> str:
    return ANSI.sub("", line)


def parse_log_line(line: str) -> tuple[str, str]:
    """``(level, message)`` of a Flower log line (``"WARNING :   text"``, colours stripped); ``("", line)``
    for anything else (flwr's own CLI output, Ray or Python warnings, traceback lines)."""
    text = strip_ansi(line).rstrip("\n")
    m = LOG_LINE.match(text)
    return (m.group(1), m.group(2).strip()) if m else ("", text.strip())


def is_user_warning(message: str) -> bool:
    """A WARNING the user must see: one fedfuse logs (prefix) or one about a fallback, the guard, a rejected
    reply or a failed node (Flower's own start-up notices and Ray's go to the log only)."""
    low = message.lower()
    return message.startswith(USER_PREFIXES) or any(w in low for w in USER_WORDS)


def classify(line: str) -> tuple[str, str]:
    """``(kind, text)``: kind ``round`` (text = the round number), ``error``, ``warning`` (shown), or ``log``
    (log file only; ``hidden-warning`` for a WARNING line that is not shown)."""
    level, message = parse_log_line(line)
    if level == "INFO":
        m = ROUND_LINE.match(message)
        if m:
            return "round", m.group(1)
        if message.startswith(PLAN_PREFIX):   # a choice the run's plan made for the user (fedfuse.plan): shown
            return "plan", message[len(PLAN_PREFIX):]
        return "log", message
    if level in ("ERROR", "CRITICAL"):
        return "error", message
    if level == "WARNING":
        return ("warning", message) if is_user_warning(message) else ("hidden-warning", message)
    if not level and PY_WARNING.search(message):  # a Python/Ray warning printed by a Flower process
        own = FEDFUSE_PY_WARNING.search(message)   # fedfuse's own: shown, never counted as Flower/Ray's
        return ("warning", own.group(1)) if own else ("hidden-warning", message)
    return "log", message


def _num(v: Any, fmt: str = "{:.4f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def round_marks(row: dict[str, Any]) -> list[str]:
    """The marks of a results row: ``fell back (<kind>)``, ``guarded``, ``skipped``, ``rejected N``, ``failures N``."""
    marks = []
    if row.get("fallback"):
        marks.append(f"FELL BACK ({str(row['fallback']).split(':', 1)[0]})")
    if row.get("guard"):
        marks.append("GUARDED (average used)")
    if row.get("skipped"):
        marks.append("SKIPPED")
    for key in ("rejected", "failures"):
        v = row.get(key)
        n = len(v) if isinstance(v, (list, tuple)) else v if isinstance(v, int) and not isinstance(v, bool) else 0
        if n:
            marks.append(f"{key} {n}")
    return marks


def head_round_record(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """The head round's record when results row ``row`` is the head round (``head-round=true``), else ``None``."""
    info = (row or {}).get("fusion-info")
    return (info.get("head-round") or {}) if isinstance(info, dict) and "head-round" in info else None


def head_round_text(head: dict[str, Any], after: Any = None) -> str:
    """What the head round's line adds after its numbers: the classifier solved, or why the model before it stayed,
    with the clients' scores (a DP run's scores are noised: the solved head must beat the model before by the check's
    margin, ``check-margin``, which the line names, so that the numbers never read as a contradiction)."""
    where = f"after round {after}: " if after is not None else ""
    if head.get("kept") != "before":
        return f"({where}the classifier solved from the clients' statistics)"
    acc = head.get("client-accuracy") if isinstance(head.get("client-accuracy"), dict) else {}
    solved, before = acc.get("head"), acc.get("before")
    margin = head.get("check-margin")
    stays = f"the model of round {after} stays" if after is not None else "the model before it stays"
    if isinstance(margin, (int, float)) and margin > 0 and isinstance(solved, (int, float)) \
            and isinstance(before, (int, float)):
        return (f"(solved head not kept: under DP the clients' noised scores must show it better by the check's "
                f"margin {margin:.4f}; they give {solved:.4f} for it vs {before:.4f} before ({solved - before:+.4f}): "
                f"{stays})")
    if isinstance(solved, (int, float)) and isinstance(before, (int, float)):
        return (f"(solved head not kept: the clients score it lower, {solved:.4f} vs {before:.4f} before: {stays})")
    return f"(solved head not kept: the clients scored the model before it higher: {stays})"


def format_round(row: dict[str, Any], num_rounds: int | None = None, label: str = "") -> str:
    """One console line of a results row, e.g.
    ``average  round 2/3  acc 0.5571  loss 1.6934  ensemble 0.3482  [GUARDED (average used)]``; ``num_rounds``: the
    run's training rounds. The head round's row is its own step, ``head round`` (not ``round 4/4``), and says
    after which round it ran."""
    rnd = row.get("round", "?")
    head = head_round_record(row)
    where = ("head round" if head is not None else f"round {rnd}/{num_rounds}" if num_rounds else f"round {rnd}")
    parts = [f"{label:<10}" if label else "", f"{where:<11}"]
    if row.get("test-accuracy") is not None or row.get("federated-accuracy") is None:
        parts += [f"acc {_num(row.get('test-accuracy'))}", f"loss {_num(row.get('test-loss'))}"]
    if row.get("federated-accuracy") is not None:  # evaluation='federated'/'both': the clients' validation splits
        parts += [f"federated acc {_num(row.get('federated-accuracy'))}", f"loss {_num(row.get('federated-loss'))}",
                  f"({row.get('federated-clients')} clients)"]
    if row.get("ensemble-accuracy") is not None:
        parts.append(f"ensemble {_num(row.get('ensemble-accuracy'))}")
    if row.get("choice"):   # strategy 'auto': the aggregation the round's clients chose
        parts.append(f"chose {row['choice']}")
    if head is not None:
        parts.append(head_round_text(head, rnd - 1 if isinstance(rnd, int) else None))
    if rnd == 0:
        parts.append("(initial model)")
    marks = round_marks(row)
    if marks:
        parts.append("[" + ", ".join(marks) + "]")
    return "  ".join(p for p in parts if p)


def results_row(results_path: Path | None, round_number: int) -> dict[str, Any] | None:
    """Row ``round_number`` of a (possibly still growing) ``results.json``; ``None`` when not readable yet."""
    if results_path is None:
        return None
    try:
        rows = json.loads(results_path.read_text()).get("rounds", [])
    except (OSError, ValueError):
        return None
    return next((r for r in rows if r.get("round") == round_number), None)


class QuietConsole:
    """``on_line`` handler of a run: every line to ``log``; on ``out`` the round lines, the warnings that matter
    and the errors (nothing on ``out`` when ``verbose``: the engine echoes everything itself).

    Args:
        log: the run's log file (text, line-buffered or flushed by the caller).
        results_path: the run's ``results.json`` (rows are read from it as each round line arrives).
        num_rounds: training rounds of the run (for ``round 2/3``; the head round's line says ``head round``).
        label: the strategy, first column of each round line.
        verbose: only log.
        out: the console (stdout).
    """

    def __init__(self, log: TextIO, results_path: Path | None, num_rounds: int | None = None, label: str = "",
                 verbose: bool = False, out: TextIO | None = None) -> None:
        self.log, self.results_path, self.num_rounds, self.label = log, results_path, num_rounds, label
        self.verbose, self.out = verbose, out or sys.stdout
        self.hidden_warnings = 0
        self.rounds_seen: list[int] = []

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def __call__(self, line: str) -> None:
        text_line = strip_ansi(line)  # the log file without terminal colour codes
        self.log.write(text_line if text_line.endswith("\n") else text_line + "\n")
        kind, text = classify(line)
        if kind == "hidden-warning":
            self.hidden_warnings += 1
        if self.verbose:
            return
        if kind == "round":
            n = int(text)
            self.rounds_seen.append(n)
            row = results_row(self.results_path, n)
            if row is None:  # results.json not readable: the log line's own accuracy
                m = ROUND_ACCURACY.search(strip_ansi(line))
                row = {"round": n, "test-accuracy": float(m.group(1)) if m else None}
            self.say(format_round(row, self.num_rounds, self.label))
        elif kind == "plan":
            self.say(f"{'':<10}  plan: {text}" if self.label else f"plan: {text}")
        elif kind in ("warning", "error"):
            level = "ERROR" if kind == "error" else "WARNING"
            if len(text) > MAX_WARNING_CHARS:
                text = text[:MAX_WARNING_CHARS] + " … (full text in run.log)"
            self.say(f"{'':<10}  {level}: {text}" if self.label else f"{level}: {text}")

    def hidden_note(self, log_path: Path) -> str | None:
        """``"N other warnings (Flower/Ray) in <log>"`` when the console held some back."""
        if self.verbose or not self.hidden_warnings:
            return None
        return f"{self.hidden_warnings} other warning(s) from Flower/Ray are in {log_path}"


# ---------------------------------------------------------------- progress of long work
T = TypeVar("T")


def progress_enabled() -> bool:
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
    if not progress_enabled():
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
    if progress_enabled():
        from tqdm import tqdm

        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(text, flush=True)


# ---------------------------------------------------------------- spread
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
