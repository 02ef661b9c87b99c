"""Run the default fedfuse simulation (or any config) through ``flwr run`` and summarise it.

    python -m simulations.runners.run                                   # pyproject defaults
    python -m simulations.runners.run --engine inprocess                # same apps in this process, no Ray
    python -m simulations.runners.run --run-config "strategy='fedavg' num-server-rounds=5" --num-supernodes 4
    python -m simulations.runners.run --run-config 'fusion-options="{head_weights=true, ridge=1e-3}"'

The whole run config is checked first (``fedfuse.config.preflight``, a few seconds, no Flower): a bad key
or value exits with status 2 and one line ``fedfuse: config error: ...`` naming the key, before any
SuperLink or Ray process starts. After the run, a table per round (with the fusion fallback of each
round); exit status 1 when ``flwr`` reports the run not completed or ``results.json`` says it failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from simulations.runners.cli import ENGINE_HELP, ENGINES, overrides_or_exit, preflight_or_exit, run_with_engine
from simulations.runners.flwr_runner import ROOT

_FALLBACK_WIDTH = 40


def summary_table(rounds: list[dict[str, Any]]) -> str:
    """One line per round: accuracies, timings and the fusion fallback (``-`` when the fusion succeeded)."""
    head = (f"{'round':>5} {'test-acc':>9} {'ensemble':>9} {'best-client':>11} {'train-s':>8} {'score-s':>8} "
            f"{'fusion-s':>9} {'round-s':>8}  fallback")
    lines = [head]
    for r in rounds:
        def f(k: str, w: int, fmt: str = "{:.4f}") -> str:
            v = r.get(k)
            return (fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-").rjust(w)

        fallback = r.get("fallback")
        fb = "-" if not fallback else str(fallback).splitlines()[0]
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


def report(out_dir: Path, flwr_ok: bool, flwr_status: str) -> int:
    """Print the summary of a finished run; 0 when it completed, 1 with the reason otherwise."""
    res = out_dir / "results.json"
    results = json.loads(res.read_text()) if res.exists() else None
    if results is None:
        print(f"fedfuse: run failed ({flwr_status}); no results at {out_dir}", file=sys.stderr)
        return 1
    rounds = results.get("rounds", [])
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
    print(f"fedfuse: results in {out_dir} (results.json, rounds.csv, accuracy.png)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-config", default="", help="overrides, e.g. \"strategy='kf-linear' num-server-rounds=3\"")
    ap.add_argument("--num-supernodes", type=int, default=None, help="default: num-clients")
    ap.add_argument("--output-dir", default=str(ROOT / "results"))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the flwr run (engine flwr)")
    ap.add_argument("--engine", choices=ENGINES, default="flwr", help=ENGINE_HELP)
    args = ap.parse_args(argv)
    cfg = overrides_or_exit(args.run_config)
    cfg.setdefault("output-dir", str(Path(args.output_dir).resolve()))
    checked = preflight_or_exit(cfg)  # everything knowable from the config, before Flower starts
    if "run-name" not in cfg:
        cfg["run-name"] = (f"{checked.strategy}-{checked.dataset}-{checked.model}-{checked.partitioning}-"
                           f"s{checked.seed}-{time.strftime('%Y%m%d-%H%M%S')}").replace(":", "_").replace("/", "_")
    n = args.num_supernodes or checked.num_clients
    outcome = run_with_engine(args.engine, cfg, num_supernodes=n, timeout=args.timeout, echo=True, check_config=False)
    print(f"\nfedfuse: run {outcome.run_id} ({args.engine}) {outcome.status} in {outcome.seconds:.1f}s "
          f"{outcome.details}")
    return report(outcome.out_dir, outcome.ok, f"{outcome.status} {outcome.details}".strip())


if __name__ == "__main__":
    sys.exit(main())
