"""Run the default fedfuse simulation (or any config) through ``flwr run`` and summarise it.

    python -m simulations.runners.run                                   # pyproject defaults
    python -m simulations.runners.run --run-config "strategy='fedavg' num-server-rounds=5" --num-supernodes 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from simulations.runners.flwr_runner import ROOT, run_app


def parse_overrides(text: str) -> dict:
    """``"k1=v1 k2='s'"`` (TOML values, as ``flwr run --run-config``) → dict."""
    out = {}
    for item in text.split():
        if "=" not in item:
            raise SystemExit(f"--run-config: expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key] = tomllib.loads(f"v = {value}")["v"] if value else ""
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-config", default="", help="overrides, e.g. \"strategy='kf-linear' num-server-rounds=3\"")
    ap.add_argument("--num-supernodes", type=int, default=None, help="default: num-clients")
    ap.add_argument("--output-dir", default=str(ROOT / "results"))
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    cfg = parse_overrides(args.run_config)
    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg.setdefault("output-dir", str(Path(args.output_dir).resolve()))
    if "run-name" not in cfg:
        merged = {**defaults, **cfg}
        import time

        cfg["run-name"] = (f"{merged['strategy']}-{merged['dataset']}-{merged['model']}-{merged['partitioning']}-"
                           f"s{merged['seed']}-{time.strftime('%Y%m%d-%H%M%S')}")
    n = args.num_supernodes or int(cfg.get("num-clients", defaults["num-clients"]))
    outcome = run_app(cfg, num_supernodes=n, timeout=args.timeout)
    print(f"\nfedfuse: run {outcome.run_id} {outcome.status} in {outcome.seconds:.1f}s {outcome.details}")
    res = outcome.out_dir / "results.json"
    if not outcome.ok or not res.exists():
        print(f"fedfuse: run failed; no complete results at {outcome.out_dir}", file=sys.stderr)
        return 1
    rounds = json.loads(res.read_text())["rounds"]
    print(f"{'round':>5} {'test-acc':>9} {'ensemble':>9} {'best-client':>11} {'train-s':>8} {'score-s':>8} {'fusion-s':>9} {'round-s':>8}")
    for r in rounds:
        def f(k, w, fmt="{:.4f}"):
            v = r.get(k)
            return (fmt.format(v) if isinstance(v, (int, float)) else "-").rjust(w)
        print(f"{r['round']:>5} {f('test-accuracy', 9)} {f('ensemble-accuracy', 9)} {f('best-client-accuracy', 11)} "
              f"{f('client-train-seconds-mean', 8, '{:.2f}')} {f('client-score-seconds-mean', 8, '{:.2f}')} "
              f"{f('fusion-seconds', 9, '{:.3f}')} {f('round-seconds', 8, '{:.2f}')}")
    print(f"fedfuse: results in {outcome.out_dir} (results.json, rounds.csv, accuracy.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
