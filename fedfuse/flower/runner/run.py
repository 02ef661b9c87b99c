"""The default run: fedfuse's strategy through ``flwr run``, then FedAvg on the same split and seed, side by side; and
the command line every runner shares (below).

    fedfuse run                                   # the app's run-config defaults + FedAvg baseline
    fedfuse run --no-compare                      # the strategy only
    fedfuse run --engine inprocess                # same apps in this process, no Ray
    fedfuse run --run-config "strategy='kf-linear' num-server-rounds=5" --num-supernodes 4
    fedfuse run --run-config 'fusion-options="{head_weights=true, ridge=1e-3}"'
    fedfuse run --verbose                         # every Flower/Ray line on the console

(``python -m fedfuse.flower.runner.run`` is the same command.) The Flower app is the checkout's ``pyproject.toml``
in a checkout, else the one shipped in the package (``fedfuse.flower.runner.flwr_runner``). The whole run config is checked first (``fedfuse.config.preflight``, a
few seconds, no Flower), the baseline's too: a bad key or value exits with status 2 and one line
``fedfuse: config error: ...`` naming the key, before any SuperLink or Ray process starts.

Then the configured strategy runs with ``--engine`` (default: a real ``flwr run``, SuperLink + Ray simulation)
into ``<output-dir>/<run-name>/``, and, unless ``--no-compare`` or the strategy is the baseline itself, the
``--baseline`` strategy (FedAvg; HeteroFL when ``client-tiers`` is set; DepthFL with depth tiers) runs with the same run config (same data, split, seed and training; the
strategy-only keys dropped, ``fedfuse.flower.runner.compare.baseline_config``) with ``--compare-engine``
(default ``inprocess``: the same ServerApp and ClientApp bodies on a Flower Grid in this process, identical
numbers, seconds instead of a minute) into ``<output-dir>/<run-name>/baseline-<baseline>/``.

Console (quiet by default, ``fedfuse.flower.runner.console``): one line per round (accuracy, loss, ensemble,
fallback / guard / skipped / rejected / failure marks), fedfuse's warnings and every error, then the
side-by-side table (``fedfuse.flower.runner.compare.comparison_table``). Every line of every run (Flower's and
Ray's logs, the per-round results dump) goes to ``run.log`` in the run's folder; ``--verbose`` shows it all.
Written next to the run's own results: ``comparison.md`` (the table) and ``comparison.png`` (both accuracy
curves). A one-shot run (``mode='one-shot'``) prints and writes its one-shot references too (``fedfuse.references``:
best and mean client, ensembles, one-shot FedAvg, KD, FedDF from the same client models; ``comparison.png`` shows
them as bars), and skips the default FedAvg run, whose one round is the 'one-shot FedAvg' reference.
Exit status 1 when a run did not complete (``flwr`` reports it failed or ``results.json`` says so).

**The command line every runner shares** (``run`` and ``sweep``): the check before Flower starts and the engine switch.

``--run-config`` is read by ``fedfuse.run_config_text.parse_run_config_arg`` (outside ``fedfuse.flower``, so that
``fedfuse run`` checks a run config before it imports Flower); ``flwr_runner.run_config_arg`` quotes the values
so that flwr's escape-less parser reads them back.

``preflight_or_exit`` runs ``fedfuse.config.preflight`` and turns a ``ConfigError`` into one line,
``fedfuse: config error: ...``, and exit status 2, before any SuperLink or Ray process exists.

``run_with_engine`` runs one config on either engine (``--engine flwr|inprocess`` of ``run`` and ``sweep``);
``split_list`` splits comma lists outside quotes and brackets (``--strategies``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any
from fedfuse.flower.runner.compare import (BASELINE, HEAD_SUFFIX, RunSummary, baseline_config, comparison_table,
                                           reference_bars, privacy_title, reference_points, references_table, round_curves,
                                           steps_title, verdict)
from fedfuse.flower.runner.console import QuietConsole, head_round_record, rounds_text
from fedfuse.flower.runner.flwr_runner import RunOutcome, federation_size
from fedfuse.flower.runner.flwr_runner import default_results_dir
from fedfuse.flower.trust.privacy import planned_epsilon
from fedfuse.results import privacy_text
from fedfuse.run_control import (RunFolderBusy, RunInterrupted, claim_run_folder, interrupt_signals,
                                 release_run_folder, signal_name_of)
from fedfuse.config import ConfigError, RunConfig, canonical, config_notes, preflight
from fedfuse.flower.runner.flwr_runner import run_app
from fedfuse.run_config_text import parse_run_config_arg, split_run_config  # noqa: F401  split_run_config: its old home

# ---------------------------------------------------------------- the command line every runner shares
EXIT_CONFIG_ERROR = 2


def split_list(text: str, sep: str = ",") -> list[str]:
    """Split ``text`` on ``sep`` outside quotes and ``[...]`` / ``{...}``; items stripped, empty ones dropped.

    ``"fedavg,kf-linear[fusion-options='{a=1, b=2}']"`` → ``["fedavg", "kf-linear[fusion-options='{a=1, b=2}']"]``.
    Shared by the sweep's strategy list and the benchmarks' comma lists.
    """
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == sep and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


def absolute_paths(cfg: dict[str, Any]) -> dict[str, Any]:
    """Relative ``output-dir`` / ``fusion-set-path`` / ``data-root`` taken from the caller's directory: the
    Flower processes run elsewhere."""
    out = dict(cfg)
    for key in ("output-dir", "fusion-set-path", "data-options.test-set-path", "data-root",
                "data-options.partition-files"):
        value = out.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            out[key] = str(Path(value).expanduser().resolve())
    return out


def config_error_exit(exc: ConfigError) -> "SystemExit":
    print(f"fedfuse: config error: {exc}", file=sys.stderr, flush=True)
    return SystemExit(EXIT_CONFIG_ERROR)


def preflight_or_exit(run_config: dict[str, Any]) -> RunConfig:
    """``fedfuse.config.preflight`` or exit with ``fedfuse: config error: ...`` (status 2)."""
    try:
        with config_notes():   # what the check resolved is the ServerApp's to say (logged once, recorded)
            return preflight(run_config)
    except ConfigError as exc:
        raise config_error_exit(exc) from None


def overrides_or_exit(text: str) -> dict[str, Any]:
    """``parse_run_config_arg`` + ``absolute_paths`` or exit with the one-line config error."""
    try:
        return absolute_paths(canonical(parse_run_config_arg(text)))
    except ConfigError as exc:
        raise config_error_exit(exc) from None


ENGINES = ("flwr", "inprocess")
ENGINE_HELP = ("flwr: a real `flwr run` (SuperLink + Ray simulation engine); inprocess: the same ServerApp body and "
               "ClientApp in this process on a LocalGrid (fedfuse.flower.runner.inprocess; no Ray, no transport, "
               "faster on small models: simulations/README.md, 'In-process engine'; same numbers with "
               "fraction-train=1)")


def run_with_engine(engine: str, run_config: dict[str, Any], *, num_supernodes: int, timeout: float, echo: bool,
                    check_config: bool | None = None, on_line=None, partitions: list[int] | None = None):
    """One run on ``engine`` (``ENGINES``); the ``flwr_runner.RunOutcome`` either way (``timeout`` bounds the
    ``flwr run`` process; the in-process engine holds each client call to the run's ``round-timeout``).
    ``on_line`` receives every log line of the run (``fedfuse.flower.runner.console.QuietConsole``).
    ``partitions``: host only these partition ids (in-process engine only; ``LocalGrid``)."""
    if partitions is not None and engine != "inprocess":
        raise ValueError("a subset of partitions (partitions=) needs engine 'inprocess'")
    if engine == "flwr":
        return run_app(run_config, num_supernodes=num_supernodes, timeout=timeout, echo=echo,
                       check_config=check_config, on_line=on_line)
    if engine == "inprocess":
        from fedfuse.flower.runner.inprocess import run_app_inprocess  # deferred: its import sets OMP_*, HF_* env

        return run_app_inprocess(run_config, num_supernodes=num_supernodes, echo=echo, check_config=check_config,
                                 on_line=on_line, partitions=partitions)
    raise ValueError(f"--engine: unknown engine {engine!r}; choose one of {list(ENGINES)}")


_FALLBACK_WIDTH = 40


def summary_table(rounds: list[dict[str, Any]]) -> str:
    """One line per round: accuracies, timings and the fusion fallback (``-`` when the fusion succeeded); the head
    round's row says ``head round`` there."""
    head = (f"{'round':>5} {'test-acc':>9} {'ensemble':>9} {'best-client':>11} {'train-s':>8} {'score-s':>8} "
            f"{'fusion-s':>9} {'round-s':>8}  fallback")
    lines = [head]
    for r in rounds:
        def f(k: str, w: int, fmt: str = "{:.4f}") -> str:
            v = r.get(k)
            return (fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-").rjust(w)

        fallback = r.get("fallback")
        fb = "-" if not fallback else str(fallback).splitlines()[0]
        if head_round_record(r) is not None:   # the head round is its own step after the training rounds
            fb = "head round" if fb == "-" else f"head round: {fb}"
        if len(fb) > _FALLBACK_WIDTH:
            fb = fb[: _FALLBACK_WIDTH - 1] + "…"
        lines.append(f"{r['round']:>5} {f('test-accuracy', 9)} {f('ensemble-accuracy', 9)} "
                     f"{f('best-client-accuracy', 11)} {f('client-train-seconds-mean', 8, '{:.2f}')} "
                     f"{f('client-score-seconds-mean', 8, '{:.2f}')} {f('fusion-seconds', 9, '{:.3f}')} "
                     f"{f('round-seconds', 8, '{:.2f}')}  {fb}")
    return "\n".join(lines)


def run_failure(results: dict[str, Any]) -> str | None:
    """The reason ``results.json`` gives for a failed run (``status`` other than ``completed`` or an
    ``error``), else ``None``."""
    status, error = results.get("status"), results.get("error")
    if error:
        return str(error)
    if status is not None and status != "completed":
        return f"status {status!r}"
    return None


def report(out_dir: Path, flwr_ok: bool, flwr_status: str, *, table: bool = True) -> int:
    """Print the summary of a finished run (the per-round table unless ``table=False``: the quiet console
    has shown the rounds already); 0 when it completed, 1 with the reason otherwise."""
    res = out_dir / "results.json"
    results = json.loads(res.read_text()) if res.exists() else None
    if results is None:
        print(f"fedfuse: run failed ({flwr_status}); no results at {out_dir}", file=sys.stderr)
        return 1
    rounds = results.get("rounds", [])
    if table:
        print(summary_table(rounds))
        for r in rounds:
            if r.get("fallback"):
                print(f"fedfuse: round {r['round']}: fusion fell back: {r['fallback']}")
    fallbacks = results.get("fallbacks")
    if fallbacks:
        count = fallbacks if isinstance(fallbacks, int) else len(fallbacks)
        print(f"fedfuse: {count} of {sum(1 for r in rounds if r.get('round', 0) > 0)} rounds fell back")
    failure = run_failure(results)
    if failure or not flwr_ok:
        print(f"fedfuse: run failed: {failure or flwr_status}; results at {out_dir}", file=sys.stderr)
        return 1
    if table:
        print(f"fedfuse: results in {out_dir} ({', '.join(existing(out_dir, RUN_FILES))})")
    return 0


RUN_FILES = ("results.json", "rounds.csv", "accuracy.png")


def existing(folder: Path, names) -> list[str]:
    """The files of ``names`` that ``folder`` holds, in that order (a failed run may have written none of them)."""
    return [name for name in names if (folder / name).is_file()]


ENGINE_NAMES = {"flwr": "flwr run", "inprocess": "in-process"}


def default_run_name(checked: Any) -> str:
    return (f"{checked.strategy}-{checked.dataset}-{checked.model}-{checked.partitioning}-"
            f"s{checked.seed}-{time.strftime('%Y%m%d-%H%M%S')}").replace(":", "_").replace("/", "_")


def execute(label: str, engine: str, cfg: dict[str, Any], *, num_supernodes: int, num_rounds: int, timeout: float,
            verbose: bool, head_round: bool = False, privacy: str = "") -> tuple[Any, int, Path]:
    """One run with its quiet console: every line to ``<out>/run.log``; returns (outcome, exit status, out dir).
    ``num_rounds``: the training rounds; ``head_round``: the run ends with the head round, its own step (the header
    says ``10 rounds + head round``); ``privacy``: a DP run's settings and planned ε for the header (``dp_header``);
    its final (ε, δ) is printed when the run ends."""
    out = Path(cfg["output-dir"]) / cfg["run-name"]
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "run.log"
    with log_path.open("a" if cfg.get("resume") else "w", buffering=1) as log:
        console = QuietConsole(log, out / "results.json", num_rounds, label, verbose)
        what = ("a real `flwr run`: SuperLink + Ray simulation, about a minute to start on 2 cores" if engine == "flwr"
                else "in-process engine: the same ServerApp/ClientApp on a Flower Grid, no Ray")
        print(f"{label}: {rounds_text(num_rounds, head_round)}, {num_supernodes} clients ({what})"
              + (f"; {privacy}" if privacy else ""), flush=True)
        if cfg.get("resume") and (out / "DONE").is_file():   # resume=true after the run completed: its results stand
            print(f"{label}: completed before (resume=true): its results in {out} are kept", flush=True)
            outcome = RunOutcome(run_id=None, status="finished:completed", details="completed before (resume=true)",
                                 out_dir=out, log="", seconds=0.0)
        else:
            try:
                outcome = run_with_engine(engine, cfg, num_supernodes=num_supernodes, timeout=timeout, echo=verbose,
                                          check_config=False, on_line=console)
            except KeyboardInterrupt as exc:   # the engine has stopped its processes and marked results.json
                stop = exc if isinstance(exc, RunInterrupted) else RunInterrupted(signal_name_of(exc))
                stop.label, stop.num_rounds = label, num_rounds
                log.write(f"\nfedfuse: {label}: interrupted by {stop.signal_name} after round {stop.after_round} "
                          f"(results.json status 'interrupted'; resume=true continues it)\n")
                raise stop from None
        status_line = (f"fedfuse: {label}: run {outcome.run_id} ({engine}) {outcome.status} in {outcome.seconds:.1f}s "
                       f"{outcome.details}").rstrip()
        log.write("\n" + status_line + "\n")
        res = out / "results.json"
        if res.exists():  # the full per-round results, for the log (and the console with --verbose)
            log.write(summary_table(json.loads(res.read_text()).get("rounds", [])) + "\n")
        if verbose:
            print("\n" + status_line)
        code = report(out, outcome.ok, f"{outcome.status} {outcome.details}".strip(), table=verbose)
        spent = json.loads(res.read_text()).get("privacy") if res.exists() else None
        if spent:   # a DP run: the account's (epsilon, delta), on the console and not only in run.log
            print(f"{'':<10}  {privacy_text(spent)} after {spent.get('releases')} releases (client-level, "
                  "RDP account; results.json 'privacy')", flush=True)
        note = console.hidden_note(log_path)
        if note:
            print(f"{'':<10}  ({note})")
    return outcome, code, out


def dp_header(checked: Any) -> str:
    """A DP run's header clause: its noise multiplier, clipping norm and δ, and the ε its account reaches when every
    release goes as configured (``fedfuse.flower.trust.privacy.planned_epsilon``); ``""`` without DP."""
    planned = planned_epsilon(checked)
    if planned is None:
        return ""
    return (f"differential privacy: noise multiplier {checked.dp_noise_multiplier:g}, clipping norm "
            f"{checked.dp_clipping_norm:g} ({checked.dp_clipping}-side), (ε, δ) = ({planned[0]:.2f}, "
            f"{checked.dp_delta:g}) planned over {planned[1]} releases")


def default_baseline(checked: Any) -> str:
    """FedAvg, or HeteroFL (sub-model averaging, FedAvg's counterpart for clients of different widths) when the
    run declares capacity tiers (``client-tiers``), DepthFL when they are depth tiers: FedAvg cannot aggregate
    them."""
    if checked.depth_tiers:
        return "depthfl"
    return "heterofl" if checked.client_tiers else BASELINE


def one_shot_references_replace_baseline(checked: Any) -> bool:
    """Whether the default FedAvg baseline run is redundant: a one-shot run without capacity tiers whose server
    computes the one-shot references (``one-shot-references`` not ``none``, a server test set), among them one-shot
    FedAvg (the weighted average of the same replies; a FedAvg run would train the same clients again)."""
    return (checked.mode == "one-shot" and checked.one_shot_references != "none" and not checked.client_tiers
            and checked.evaluation != "federated")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-config", default="", help="overrides, e.g. \"strategy='kf-linear' num-server-rounds=3\", "
                    "or a .toml file of keys (fedfuse config lists them)")
    ap.add_argument("--num-supernodes", type=int, default=None,
                    help="the federation's size, as in `flwr run`: run-config num-clients (default); given alone it "
                         "sets num-clients, with a different num-clients it is a config error")
    ap.add_argument("--output-dir", default=str(default_results_dir()),
                    help="default: results/ of the checkout; installed without one: ./results")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the flwr run (engine flwr)")
    ap.add_argument("--engine", choices=ENGINES, default="flwr", help=ENGINE_HELP)
    ap.add_argument("--baseline", default=None, help="strategy to compare with (default: fedavg; heterofl when "
                    "client-tiers is set, depthfl with depth tiers: FedAvg cannot aggregate clients of different widths or "
                    "depths)")
    ap.add_argument("--compare-engine", choices=ENGINES, default="inprocess",
                    help="engine of the baseline run (default inprocess: identical numbers to flwr run, no Ray)")
    ap.add_argument("--no-compare", action="store_true", help="run the configured strategy only, no baseline")
    ap.add_argument("--verbose", action="store_true", help="print every Flower/Ray log line and the results dump")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    cfg = overrides_or_exit(args.run_config)
    if args.num_supernodes is not None:   # one number with num-clients (flwr_runner.federation_size)
        try:
            federation_size(cfg, args.num_supernodes)
        except ConfigError as exc:
            raise config_error_exit(exc) from None
    cfg.setdefault("output-dir", str(Path(args.output_dir).resolve()))
    checked = preflight_or_exit(cfg)  # everything knowable from the config, before Flower starts
    chosen = "run-name" in cfg
    if not chosen:
        cfg["run-name"] = default_run_name(checked)
    with interrupt_signals():   # Ctrl-C, SIGTERM, SIGHUP: RunInterrupted (one line, every process stopped)
        try:
            try:   # the run folder is this command's for its whole length (fedfuse.run_control)
                cfg["run-name"] = claim_run_folder(cfg["output-dir"], cfg["run-name"], chosen_by_user=chosen)
            except RunFolderBusy as exc:
                raise config_error_exit(exc) from None
            try:
                return run_and_compare(args, cfg, checked)
            finally:
                release_run_folder(cfg["output-dir"], cfg["run-name"])
        except KeyboardInterrupt as exc:
            stop = exc if isinstance(exc, RunInterrupted) else RunInterrupted(signal_name_of(exc))
            hint = f"the same command with run-name='{cfg['run-name']}' resume=true added to --run-config"
            print(stop.line(stop.label, hint), file=sys.stderr, flush=True)
            return stop.exit_status


def run_and_compare(args: argparse.Namespace, cfg: dict[str, Any], checked: Any) -> int:
    """``main``'s run in its held folder: the strategy, then the baseline, then the comparison; the exit status."""
    out_dir = Path(cfg["output-dir"]) / cfg["run-name"]
    n = checked.num_clients
    default = args.baseline or default_baseline(checked)
    baseline = None if args.no_compare or checked.strategy == default else default
    if baseline and args.baseline is None and one_shot_references_replace_baseline(checked):
        print(f"fedfuse: one-shot: {baseline}'s one round is the weighted average of the same client models, the "
              "'one-shot FedAvg' row of the references printed at the end: no second training run "
              f"(--baseline {baseline} runs it anyway)", flush=True)
        baseline = None
    bcfg = None
    if baseline:
        bcfg = baseline_config(cfg, baseline, output_dir=str(out_dir), run_name=f"baseline-{baseline}")
        if checked.mode == "one-shot":   # the strategy's run computes the references already
            bcfg["report-options.one-shot-references"] = "none"
        try:
            preflight_or_exit(bcfg)
        except SystemExit:
            print(f"fedfuse: (that is the baseline {baseline!r}'s config; --no-compare skips it)", file=sys.stderr)
            raise
    print(f"fedfuse: {checked.strategy}" + (f" vs {baseline}" if baseline else "") +
          f" on {checked.dataset}/{checked.model}, {checked.partitioning} split, {checked.num_clients} clients, "
          f"seed {checked.seed}; results in {out_dir}", flush=True)
    outcome, code, _ = execute(checked.strategy, args.engine, cfg, num_supernodes=n,
                               num_rounds=checked.num_server_rounds, head_round=checked.head_round,
                               timeout=args.timeout, verbose=args.verbose, privacy=dp_header(checked))
    runs = [RunSummary.load(checked.strategy, ENGINE_NAMES[args.engine], out_dir,
                            error=None if outcome.ok else f"{outcome.status} {outcome.details}".strip())]
    if baseline and bcfg is not None:
        if code != 0:
            print(f"fedfuse: {checked.strategy} did not complete; {baseline} baseline not run", file=sys.stderr)
            return code
        b_outcome, b_code, b_out = execute(baseline, args.compare_engine, bcfg, num_supernodes=n,
                                           num_rounds=checked.num_server_rounds,
                                           head_round=bool(bcfg["head-round"]), timeout=args.timeout,
                                           verbose=args.verbose, privacy=dp_header(checked))
        runs += RunSummary.load(baseline, ENGINE_NAMES[args.compare_engine], b_out,
                                error=None if b_outcome.ok else f"{b_outcome.status} {b_outcome.details}".strip()
                                ).split_head()
        code = code or b_code
    write_comparison(runs, out_dir, baseline or default, title=(
        f"{checked.dataset}/{checked.model} · {checked.partitioning} · {checked.num_clients} clients · "
        f"seed {checked.seed}"))
    return code


def write_comparison(runs: list[RunSummary], out_dir: Path, baseline: str, title: str) -> None:
    """Print the side-by-side table; write ``comparison.md`` and ``comparison.png`` (both curves) in ``out_dir``. The
    title says the runs' steps (``steps_title``: which rows include the head round)."""
    steps = "\n".join(t for t in (steps_title(runs), privacy_title(runs)) if t)
    title = f"{title}\n{steps}" if steps else title
    table = comparison_table(runs, baseline)
    line = verdict(runs, baseline)
    refs = references_table(runs[0])   # a one-shot run's references (None otherwise)
    print("\n" + table)
    if line:
        print(line)
    if refs:
        print("\n" + refs)
    (out_dir / "comparison.md").write_text(f"{title}\n\n{table}\n" + (f"\n{line}\n" if line else "")
                                           + (f"\n{refs}\n" if refs else ""))
    series = [{"label": f"{r.label} ({r.engine})", "points": r.curve(), "fell_back": r.marked_rounds("fallback"),
               "guarded": r.marked_rounds("guard"), "skipped": r.marked_rounds("skipped"),
               # a run that ends with the head round says so (alone, or beside a baseline that failed, there is no
               # '+ head round' twin to read it from): its last point is drawn as the head round's own step
               **({"head_round": True} if r.head_round() and not r.label.endswith(HEAD_SUFFIX) else {})} for r in runs]
    if reference_points(runs[0]):   # one-shot: the fused model next to its references, as bars
        reference_bars(runs[0], out_dir / "comparison.png", title=title)
    else:   # evaluation='federated': the clients' accuracy on their validation splits (no server test set)
        federated = all(r.federated for r in runs if r.curve())
        round_curves(series, out_dir / "comparison.png", title=title,
                     ylabel="federated accuracy (clients' validation splits)" if federated and any(
                         r.curve() for r in runs) else "test accuracy")
    png = "the fused model and its references" if refs and reference_points(runs[0]) else "accuracy per round"
    written = existing(out_dir, ("comparison.png", "comparison.md", "run.log", "results.json", "rounds.csv"))
    files = [f"{name} ({png})" if name == "comparison.png" else name for name in written]
    print(f"fedfuse: results in {out_dir}: {', '.join(files)}"
          + (f"; {runs[1].label} in {runs[1].out_dir}" if len(runs) > 1 else ""))


if __name__ == "__main__":
    sys.exit(main())
