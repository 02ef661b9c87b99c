"""Sweep strategies × partitionings × seeds through ``flwr run`` simulations (or in-process); markdown table.

    fedfuse compare --strategies fedavg,kf-linear --partitions shards,dirichlet \
        --seeds 0,1,2 --run-config "num-server-rounds=5 dataset='mnist1d'" --out results/sweep

(``python -m fedfuse.flower.runner.sweep`` is the same command.)

A strategy may carry its own run-config overrides: ``--strategies "fedavg,kf-linear[fusion-rounds=3]"``
(``key=value`` pairs inside the brackets, as in ``--run-config``; the label with brackets names the table
row). Every cell's config is checked (``fedfuse.config.preflight``) before the first run starts.

Each cell is the final-round central test accuracy, mean ± sample std (ddof 1) over seeds; a second table gives
the first round reaching 90% of that strategy's final accuracy; a third the first round reaching the
``--reference`` strategy's final accuracy *of the same seed* (rounds-to-reference: "reaches FedAvg's
final accuracy in fewer rounds"; never = the run did not reach it, counted as the last round + 1 and
marked). ``accuracy.png`` plots the test accuracy per round, mean ± std over seeds, per partitioning.
Every run's own results folder is kept under ``--out``; ``sweep.json`` holds all rows;
``--tables-only`` re-renders table and plot from an existing ``sweep.json``. On a terminal a progress bar
(runs done, ETA) sits under the one line per finished run (``fedfuse.flower.runner.console``).

``--engine flwr`` (default) runs each cell as a real ``flwr run`` (SuperLink + Ray); ``--engine inprocess``
runs the same ServerApp body and ClientApp in this process on a ``LocalGrid``
(``fedfuse.flower.runner.inprocess``: no Ray, no transport; the same numbers with ``fraction-train=1``), for
large matrices on few cores. Each row records its ``engine``.

Capacity tiers (``client-tiers``): rows keep every round's ``tier-accuracy`` and the last round's bytes per
tier; ``tiers.md`` / ``tiers.png`` give, per partitioning, the global and every tier model's final accuracy,
the bytes sent to each tier per round and the server's aggregation seconds (fusion + tier-model derivation,
median over rounds) with its ratio to ``--timing-reference``'s (``heterofl``) of the same seed. Two
sweep-only keys may sit in a strategy's brackets: ``sweep-partitions='0,3,6,9'`` runs a federation of only
those partition ids of ``num-clients`` (same splits; ``--engine inprocess`` only; e.g. "only the full-width
clients" FedAvg) and ``sweep-as-tier=0.25`` puts a run without tiers into that tier's column of ``tiers.md``
(e.g. "everyone at the smallest tier": ``fedavg[model-width=64 sweep-as-tier=0.25]``; a width × depth tier is
quoted: ``sweep-as-tier='0.5x0.5'``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from fedfuse.config import ConfigError
from fedfuse.flower.runner.run import (ENGINE_HELP, ENGINES, config_error_exit, overrides_or_exit, parse_run_config_arg,
                                       preflight_or_exit, run_with_engine, split_list)
from fedfuse.flower.runner.flwr_runner import default_results_dir
from fedfuse.flower.runner.console import progress, progress_print
from fedfuse.flower.runner.run import run_failure
from fedfuse.flower.runner.console import format_mean_std
from fedfuse.hetero import tier_name
from fedfuse.hetero.tiers import parse_tier_pair, tier_sort_key
from fedfuse.results import head_round_row, rounds_text


def mean_std(vals: list[float]) -> str:
    """``"m ± s"`` with the harness's sample std (ddof 1), 3 decimals."""
    return format_mean_std(vals, digits=3)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", default="fedavg,average")
    ap.add_argument("--partitions", default="shards,dirichlet")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--run-config", default="")
    ap.add_argument("--out", default=str(default_results_dir() / "sweep"),
                    help="results folder (default: results/sweep of the checkout; installed: ./results/sweep)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per flwr run (engine flwr)")
    ap.add_argument("--engine", choices=ENGINES, default="flwr", help=ENGINE_HELP)
    ap.add_argument("--reference", default="fedavg", help="strategy whose final accuracy the others must reach")
    ap.add_argument("--tables-only", action="store_true", help="re-render from --out/sweep.json, run nothing")
    ap.add_argument("--timing-reference", default="heterofl",
                    help="capacity tiers: strategy whose aggregation seconds the others' are a ratio to")
    args = ap.parse_args(argv)
    seeds = seeds_or_exit(args.seeds)
    out = Path(args.out).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise config_error_exit(ConfigError(f"--out {args.out!r}: cannot create the results folder: "
                                            f"{exc.strerror or exc}")) from None
    # rows of earlier sweeps into the same --out are kept (a rerun of a cell replaces its row)
    rows = json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").exists() else []
    if args.tables_only:
        return render(rows, split_strategies(args.strategies), args.partitions.split(","), args.reference, out,
                      args.run_config, args.timing_reference)
    base = overrides_or_exit(args.run_config)
    labels = split_strategies(args.strategies)
    cells = []  # every cell's config is checked before the first run starts
    for label in labels:
        try:
            strategy, extra = parse_strategy(label)
            hosted, as_tier = sweep_keys(extra)
        except ConfigError as exc:
            raise config_error_exit(exc) from None
        if hosted is not None and args.engine != "inprocess":
            raise config_error_exit(ConfigError(f"--strategies {label!r}: sweep-partitions needs --engine inprocess"))
        for part in args.partitions.split(","):
            for seed in seeds:
                name = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{label}-{part}-s{seed}").strip("_")
                cfg = {**base, **extra, "strategy": strategy, "partitioning": part, "seed": seed,
                       "output-dir": str(out), "run-name": name}
                n = preflight_or_exit(cfg).num_clients
                if hosted is not None and not all(0 <= p < n for p in hosted):
                    raise config_error_exit(ConfigError(f"--strategies {label!r}: sweep-partitions {hosted} not all "
                                                        f"in [0, num-clients={n})"))
                cells.append((label, part, seed, name, cfg, n, hosted, as_tier))
    for label, part, seed, name, cfg, n, hosted, as_tier in progress(cells, desc="sweep", unit="run"):
        outcome = run_with_engine(args.engine, cfg, num_supernodes=n, timeout=args.timeout, echo=False,
                                  check_config=False, partitions=hosted)
        row = {"strategy": label, "partitioning": part, "seed": seed, "engine": args.engine,
               "status": outcome.status, "seconds": outcome.seconds,
               "run-config": {k: v for k, v in cfg.items() if k != "output-dir"}}
        if hosted is not None:
            row["partitions"] = hosted
        if as_tier is not None:
            row["as-tier"] = as_tier
        res = outcome.out_dir / "results.json"
        results = json.loads(res.read_text()) if res.exists() else None
        failure = run_failure(results) if results is not None else None
        if failure:  # the app reported a failed run (e.g. fusion never succeeded): no accuracy for the table
            row["status"], row["error"] = "failed", failure
        elif not outcome.ok or results is None:  # engine-level failure: keep the run's log so it can be diagnosed
            log_path = out / f"{name}.log"
            log_path.write_text(outcome.log)
            tail = [ln for ln in outcome.log.splitlines() if ln.strip()][-3:]
            row["error"] = f"{outcome.details or 'no results.json'} (log: {log_path}; last lines: {' | '.join(tail)[-400:]})"
        else:
            rounds = results["rounds"]
            row["accuracy-per-round"] = [r["test-accuracy"] for r in rounds]
            row["final-accuracy"] = rounds[-1]["test-accuracy"]
            head = head_round_row(rounds)   # the head round: its own step, the last row; the table says so
            row["head-round"] = head is not None
            if head is not None and len(rounds) >= 2:
                row["final-accuracy-before-head-round"] = rounds[-2]["test-accuracy"]
            row["ensemble-accuracy"] = rounds[-1].get("ensemble-accuracy")
            row["best-client-accuracy"] = rounds[-1].get("best-client-accuracy")
            row["fallback-rounds"] = [r["round"] for r in rounds if r.get("fallback")]
            row["skipped-rounds"] = [r["round"] for r in rounds if r.get("skipped")]
            row["guarded-rounds"] = [r["round"] for r in rounds if r.get("guard")]
            row.update(tier_fields(results, outcome.out_dir))
        progress_print(f"sweep: {name}: {row['status']} final={row.get('final-accuracy')} ({outcome.seconds:.0f}s)"
                       f"{' fallback rounds ' + str(row['fallback-rounds']) if row.get('fallback-rounds') else ''}"
                       f"{' error: ' + row['error'] if row.get('error') else ''}")
        rows = [r for r in rows if (r["strategy"], r["partitioning"], r["seed"]) != (label, part, seed)]
        rows.append(row)
        (out / "sweep.json").write_text(json.dumps(rows, indent=2))
    return render(rows, labels, args.partitions.split(","), args.reference, out, args.run_config,
                  args.timing_reference)


def seeds_or_exit(text: str) -> list[int]:
    """``--seeds`` (``"0,1,2"``) as integers, or the one-line config error (status 2) naming ``--seeds``."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds:
        raise config_error_exit(ConfigError(f"--seeds {text!r}: give comma-separated integers, e.g. --seeds 0,1,2"))
    return seeds


SWEEP_KEYS = ("sweep-partitions", "sweep-as-tier")


def sweep_keys(extra: dict) -> tuple[list[int] | None, str | None]:
    """Pop the sweep-only keys from a strategy's bracket overrides: ``(partition ids to host or None, tier
    label or None)``."""
    hosted, as_tier = extra.pop("sweep-partitions", None), extra.pop("sweep-as-tier", None)
    if hosted is not None:
        try:
            hosted = [int(p) for p in str(hosted).split(",") if p.strip()]
        except ValueError:
            raise ConfigError(f"sweep-partitions: {hosted!r} is not a comma-separated list of partition ids") from None
        if not hosted or len(set(hosted)) != len(hosted):
            raise ConfigError(f"sweep-partitions: {hosted!r}: give distinct partition ids")
    if as_tier is not None:
        try:
            # a width tier ('0.25') or a width x depth tier ('0.5x0.5', named as the depth-tier runs name it)
            w, d = parse_tier_pair(as_tier, key="sweep-as-tier")
            as_tier = tier_name(w) if "x" not in str(as_tier) else f"{tier_name(w)}x{tier_name(d)}"
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return hosted, as_tier


def tier_fields(results: dict, out_dir: Path) -> dict:
    """The capacity-tier fields of a sweep row from a run's ``results.json``: every round's ``tier-accuracy``,
    the last round's bytes sent per tier (``tier-bytes-sent``, ``tier-clients``; a run without tiers: the global
    model's bytes × the round's replies under ``"all"``), and per round the aggregation seconds
    (``fusion-seconds``) and the tier models' derivation seconds (``strategy-history``)."""
    rounds = [r for r in results["rounds"] if r.get("round", 0) > 0]
    out: dict = {}
    if any("tier-accuracy" in r for r in results["rounds"]):
        out["tier-accuracy-per-round"] = [r.get("tier-accuracy") for r in results["rounds"]]
        out["final-tier-accuracy"] = results["rounds"][-1].get("tier-accuracy")
    if rounds and rounds[-1].get("tier-bytes-sent"):
        out["tier-bytes-sent"], out["tier-clients"] = rounds[-1]["tier-bytes-sent"], rounds[-1].get("tier-clients")
    elif rounds and (out_dir / "global_model.pt").exists():
        import torch

        state = torch.load(out_dir / "global_model.pt", map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
        nbytes = sum(int(v.numel() * v.element_size()) for v in state.values() if hasattr(v, "numel"))
        k = int(rounds[-1].get("valid-replies") or 0)
        out["tier-bytes-sent"], out["tier-clients"] = {"all": nbytes * k}, {"all": k}
    out["fusion-seconds"] = [r.get("fusion-seconds") for r in rounds]
    if any(r.get("tier-train-seconds") for r in rounds):
        # one local epoch of the largest tier's clients, per round (the yardstick of "fusion time per round")
        epochs = max(1, int(results.get("config", {}).get("local-epochs", 1) or 1))
        out["largest-tier-epoch-seconds"] = [
            (max(t.items(), key=lambda kv: _tier_key(kv[0]))[1] / epochs) if t else None
            for t in (r.get("tier-train-seconds") for r in rounds)]
    derive = {h.get("round"): h.get("tier-derivation-seconds") for h in results.get("strategy-history") or []}
    out["tier-derivation-seconds"] = [derive.get(r.get("round")) for r in rounds]
    return out


def split_strategies(text: str) -> list[str]:
    """``"fedavg,kf-linear[fusion-options='{a=1, b=2}']"`` → labels, split on commas outside brackets/quotes."""
    return split_list(text)


def parse_strategy(label: str) -> tuple[str, dict]:
    """``"kf-linear[fusion-rounds=3 local-epochs=2]"`` → ``("kf-linear", {run-config overrides})``."""
    m = re.fullmatch(r"([^\[\]]+)(?:\[(.*)\])?", label.strip(), flags=re.S)
    if not m:
        raise ConfigError(f"--strategies: cannot parse {label!r}; use name or name[key=value ...]")
    return m.group(1).strip(), parse_run_config_arg(m.group(2) or "")


def rounds_to(acc_per_round: list[float], target: float) -> int | None:
    """First round (index into ``acc_per_round``, round 0 = the initial model) with accuracy ≥ ``target``."""
    return next((i for i, a in enumerate(acc_per_round) if a >= target - 1e-9), None)


def render(rows: list[dict], strategies: list[str], parts: list[str], reference: str, out: Path,
           run_config: str = "", timing_reference: str = "heterofl") -> int:
    """Write ``table.md`` and ``accuracy.png`` for ``rows`` (the ``sweep.json`` rows)."""
    head = ["| strategy | " + " | ".join(parts) + " |", "|---|" + "---|" * len(parts)]
    lines, lines_r, lines_ref = list(head), list(head), list(head)
    for strategy in strategies:
        cells, cells_r, cells_ref = [], [], []
        for part in parts:
            sel = [r for r in rows if r["strategy"] == strategy and r["partitioning"] == part and "final-accuracy" in r]
            cells.append(mean_std([r["final-accuracy"] for r in sel]))
            cells_r.append(mean_std([float(rounds_to(r["accuracy-per-round"], 0.9 * r["final-accuracy"]))
                                     for r in sel]))
            reach, never = [], 0
            for r in sel:
                ref = [q for q in rows if q["strategy"] == reference and q["partitioning"] == part
                       and q["seed"] == r["seed"] and "final-accuracy" in q]
                if not ref:
                    continue
                k = rounds_to(r["accuracy-per-round"], ref[0]["final-accuracy"])
                if k is None:
                    never += 1
                    k = len(r["accuracy-per-round"])
                reach.append(float(k))
            cells_ref.append(mean_std(reach) + (f" ({never} never)" if never else ""))
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
        lines_r.append(f"| {strategy} | " + " | ".join(cells_r) + " |")
        lines_ref.append(f"| {strategy} | " + " | ".join(cells_ref) + " |")
    seeds = sorted({r["seed"] for r in rows})
    headed = [r for r in rows if r.get("head-round")]
    steps, before = "", ""
    if headed:   # the head round is its own step: say which numbers include it, and give them without it too
        n = len(headed[0]["accuracy-per-round"]) - 2
        steps = (f" — after the head round ({rounds_text(n, True)}; every round count below counts the head round as "
                 f"round {n + 1})")
        lines_b = list(head)
        for strategy in strategies:
            cells = [mean_std([r["final-accuracy-before-head-round"] for r in rows if r["strategy"] == strategy
                               and r["partitioning"] == part and "final-accuracy-before-head-round" in r])
                     for part in parts]
            lines_b.append(f"| {strategy} | " + " | ".join(cells) + " |")
        before = (f"\n\nFinal test accuracy before the head round (round {n}, the last training round; mean ± sample "
                  "std, ddof 1, over seeds)\n\n" + "\n".join(lines_b))
    table = ((f"Run config: `{run_config}`; seeds {seeds}\n\n" if run_config else "") +
             f"Final test accuracy{steps} (mean ± sample std, ddof 1, over seeds)\n\n" + "\n".join(lines) + before +
             "\n\nFirst round reaching 90% of the strategy's own final accuracy\n\n" + "\n".join(lines_r) +
             f"\n\nFirst round reaching {reference}'s final accuracy (same seed)\n\n" + "\n".join(lines_ref) + "\n")
    table += "".join(summary_table(rows, strategies, part, reference) for part in parts)
    (out / "table.md").write_text(table)
    print(table)
    plot(rows, strategies, parts, out / "accuracy.png",
         title=run_config + (f"\n{rounds_text(n, True)}: the last point of each curve is the head round" if headed
                             else ""))
    if any("final-tier-accuracy" in r for r in rows):
        tiers = ((f"Run config: `{run_config}`; seeds {seeds}\n" if run_config else "") +
                 "".join(tier_table(rows, strategies, part, timing_reference) for part in parts))
        (out / "tiers.md").write_text(tiers)
        print(tiers)
        plot_tiers(rows, strategies, parts, out / "tiers.png", title=run_config)
    return 0


def _tier_key(name: str) -> tuple[float, float]:
    """``(width, depth)`` of a tier label (``"0.5"``, ``"1x0.5"``) to sort tiers, widest and deepest last; ``"all"``
    (a run without tiers) after every tier."""
    return (2.0, 2.0) if name == "all" else tier_sort_key(name)


def aggregation_seconds(row: dict) -> list[float]:
    """Per round: the server's aggregation seconds (fusion) + the tier models' derivation seconds."""
    fus, der = row.get("fusion-seconds") or [], row.get("tier-derivation-seconds") or []
    return [float(f) + float(d or 0.0) for f, d in zip(fus, der + [None] * (len(fus) - len(der))) if f is not None]


def epoch_ratios(row: dict) -> list[float]:
    """Per round: aggregation seconds / one local epoch of the widest tier's clients (same round)."""
    agg, ep = aggregation_seconds(row), row.get("largest-tier-epoch-seconds") or []
    return [a / e for a, e in zip(agg, ep) if e]


def tier_table(rows: list[dict], strategies: list[str], part: str, timing_reference: str = "heterofl") -> str:
    """Capacity tiers, one partitioning: global and every tier model's final test accuracy (mean ± sample std over
    seeds), MB sent per round to each tier (all its clients), and the aggregation seconds per round (median over
    rounds, then mean over seeds) with the ratio to ``timing_reference``'s median of the same seed."""
    import numpy as np

    sel_all = [r for r in rows if r["partitioning"] == part and "final-accuracy" in r and r["strategy"] in strategies]
    tiers = sorted({t for r in sel_all for t in (r.get("final-tier-accuracy") or {})} |
                   {r["as-tier"] for r in sel_all if r.get("as-tier")}, key=_tier_key, reverse=True)
    ref_med = {r["seed"]: float(np.median(aggregation_seconds(r))) for r in sel_all
               if r["strategy"] == timing_reference and aggregation_seconds(r)}
    head = (f"\n\nCapacity tiers, {part}: final test accuracy of the global model and of every tier's model (mean ± "
            f"sample std, ddof 1, over seeds); MB sent per round to each tier's clients (down-link; the replies "
            f"carry the same arrays back); aggregation = fusion + tier-model derivation seconds per round "
            f"(median over rounds, mean over seeds) and its ratio to {timing_reference}'s of the same seed. "
            f"A row without tiers shows its global model in the tier column it stands for ('as tier'), '—' "
            f"where that run has no model for the tier. 'best client' / 'ensemble': the last round's best single "
            f"client model and the uniform ensemble of the round's client models on the test split. 'per largest-tier "
            f"epoch': aggregation seconds / one local epoch of a client of the widest tier (its mean train seconds "
            f"/ local-epochs, same round, same process), median over rounds, mean over seeds.\n\n"
            f"| strategy | seeds | global | " + " | ".join(f"tier {t}" for t in tiers) +
            " | best client | ensemble | MB / round (" + " / ".join(tiers) + ") | aggregation s | ratio to " +
            timing_reference + " | per largest-tier epoch |\n|---|---|---|" + "---|" * len(tiers) +
            "---|---|---|---|---|---|\n")
    lines = []
    for strategy in strategies:
        sel = [r for r in sel_all if r["strategy"] == strategy]
        if not sel:
            continue
        cells = []
        for t in tiers:
            vals = [r["final-tier-accuracy"][t] for r in sel if t in (r.get("final-tier-accuracy") or {})]
            if not vals:
                vals = [r["final-accuracy"] for r in sel if r.get("as-tier") == t]
            cells.append(mean_std(vals) if vals else "—")
        mb = []
        for t in tiers:
            b = [r["tier-bytes-sent"].get(t, r["tier-bytes-sent"].get("all") if r.get("as-tier") == t else None)
                 for r in sel if r.get("tier-bytes-sent")]
            b = [v for v in b if v is not None]
            mb.append(f"{np.mean(b) / 1e6:.3f}" if b else "—")
        secs = {r["seed"]: float(np.median(aggregation_seconds(r))) for r in sel if aggregation_seconds(r)}
        ratio = [secs[s] / ref_med[s] for s in secs if s in ref_med and ref_med[s] > 0]
        extra = []
        for key in ("best-client-accuracy", "ensemble-accuracy"):
            vals = [r[key] for r in sel if isinstance(r.get(key), (int, float))]
            extra.append(mean_std(vals) if vals else "—")
        per_epoch = [float(np.median(v)) for v in (epoch_ratios(r) for r in sel) if v]
        lines.append(f"| {strategy} | {len(sel)} | {mean_std([r['final-accuracy'] for r in sel])} | " +
                     " | ".join(cells) + f" | {' | '.join(extra)} | {' / '.join(mb)} | " +
                     (f"{np.mean(list(secs.values())):.3f}" if secs else "") + " | " +
                     (f"{np.mean(ratio):.1f}×" if ratio else "") + " | " +
                     (f"{np.mean(per_epoch):.2f}×" if per_epoch else "") + " |")
    return head + "\n".join(lines) + "\n"


def plot_tiers(rows: list[dict], strategies: list[str], parts: list[str], path: Path, title: str = "") -> None:
    """Per partitioning, one panel per tier (the global model first): test accuracy per round, mean over seeds,
    one line per strategy (runs without tiers in the panel of their ``as-tier``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    tiers = sorted({t for r in rows for t in (r.get("final-tier-accuracy") or {})}, key=_tier_key, reverse=True)
    panels = ["global"] + [t for t in tiers if t != "1"]
    fig, axes = plt.subplots(len(parts), len(panels), figsize=(4.8 * len(panels), 3.8 * len(parts)), squeeze=False)
    for i, part in enumerate(parts):
        for j, panel in enumerate(panels):
            ax = axes[i][j]
            for strategy in strategies:
                curves = []
                for r in rows:
                    if r["strategy"] != strategy or r["partitioning"] != part or "accuracy-per-round" not in r:
                        continue
                    if panel == "global":
                        if r.get("as-tier") not in (None, "1"):
                            continue
                        curves.append(r["accuracy-per-round"])
                    elif r.get("tier-accuracy-per-round"):
                        curves.append([(d or {}).get(panel, np.nan) for d in r["tier-accuracy-per-round"]])
                    elif r.get("as-tier") == panel:
                        curves.append(r["accuracy-per-round"])
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                a = np.array([c[:n] for c in curves], dtype=float)
                ax.plot(np.arange(n), np.nanmean(a, 0), label=f"{strategy} (n={len(curves)})")
            ax.set_title(f"{part}: {'global model' if panel == 'global' else 'tier ' + panel + ' model'}")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("round")
            ax.set_ylabel("test accuracy")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def worst_drop(acc: list[float]) -> float:
    """Largest round-over-round fall of the test accuracy (0 when it never falls), rounds 1.. only."""
    return max([0.0] + [acc[i - 1] - acc[i] for i in range(2, len(acc))])


def summary_table(rows: list[dict], strategies: list[str], part: str, reference: str, at_round: int = 10) -> str:
    """The summary of one partitioning (the table of docs/multi-round.md, "Measured"): final and best accuracy,
    accuracy at ``at_round``, the first round reaching ``reference``'s final accuracy (same seed; mean over seeds),
    the worst round-over-round drop, the largest deficit of the mean curve below ``reference``'s mean curve (any
    round), and the rounds that fell back, were skipped or were guarded (summed over seeds)."""
    import numpy as np

    def curves(strategy):
        sel = [r for r in rows if r["strategy"] == strategy and r["partitioning"] == part and "accuracy-per-round" in r]
        return sel, (np.array([r["accuracy-per-round"] for r in sel]) if sel else None)

    _, ref = curves(reference)
    head = (f"\n\nSummary, {part} (mean ± sample std over seeds; 'reach' = first round with accuracy ≥ {reference}'s "
            f"final accuracy of the same seed, never = rounds+1; 'max deficit' = largest gap of the mean curve below "
            f"{reference}'s mean curve over rounds 1..)"
            + ("; 'final', 'best' and the rounds include the head round, the last round" if any(
                r.get("head-round") for r in rows if r["partitioning"] == part) else "") + "\n\n"
            f"| strategy | seeds | final | best | round {at_round} | reach | worst drop | max deficit | "
            f"fallback / skipped / guarded rounds | failed runs |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for strategy in strategies:
        sel, a = curves(strategy)
        failed = sum(1 for r in rows if r["strategy"] == strategy and r["partitioning"] == part
                     and r.get("status") != "finished:completed")
        if a is None or not len(sel):
            lines.append(f"| {strategy} | 0 | | | | | | | | {failed} |")
            continue
        reach = []
        for r in sel:
            refs = [q for q in rows if q["strategy"] == reference and q["partitioning"] == part and q["seed"] == r["seed"]
                    and "final-accuracy" in q]
            if refs:
                k = rounds_to(r["accuracy-per-round"], refs[0]["final-accuracy"])
                reach.append(float(len(r["accuracy-per-round"]) if k is None else k))
        deficit = ""
        if ref is not None and ref.shape[1] == a.shape[1]:
            deficit = f"{float(np.max(ref.mean(0)[1:] - a.mean(0)[1:])):.3f}"
        k = min(at_round, a.shape[1] - 1)
        counts = " / ".join(str(sum(len(r.get(key, [])) for r in sel))
                            for key in ("fallback-rounds", "skipped-rounds", "guarded-rounds"))
        lines.append(f"| {strategy} | {len(sel)} | {mean_std(list(a[:, -1]))} | {mean_std(list(a[:, 1:].max(1)))} | "
                     f"{mean_std(list(a[:, k]))} | {mean_std(reach) if reach else ''} | "
                     f"{mean_std([worst_drop(list(c)) for c in a])} | {deficit} | {counts} | {failed} |")
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], strategies: list[str], parts: list[str], path: Path, title: str = "") -> None:
    """Test accuracy per round, mean ± sample std (ddof 1) over seeds; one panel per partitioning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        for strategy in strategies:
            curves = [r["accuracy-per-round"] for r in rows
                      if r["strategy"] == strategy and r["partitioning"] == part and "accuracy-per-round" in r]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            a = np.array([c[:n] for c in curves])
            mu, sd = a.mean(0), (a.std(0, ddof=1) if len(a) > 1 else np.zeros(n))
            xs = np.arange(n)
            ax.plot(xs, mu, label=f"{strategy} (n={len(curves)})")
            ax.fill_between(xs, mu - sd, mu + sd, alpha=0.2)
        ax.set_title(part)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
