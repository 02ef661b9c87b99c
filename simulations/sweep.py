"""Sweep strategies × partitionings × seeds through real ``flwr run`` simulations; markdown table.

    python -m simulations.sweep --strategies fedavg,kf-linear --partitions shards,dirichlet \
        --seeds 0,1,2 --run-config "num-server-rounds=5 dataset='mnist1d'" --out results/sweep

Each cell is the final-round central test accuracy, mean ± std over seeds; a second table gives
the first round reaching 90% of that strategy's final accuracy (rounds-to-target). Every run's own
results folder is kept under ``--out``; ``sweep.json`` holds all rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tomllib
from pathlib import Path

from simulations.flwr_runner import ROOT, run_app
from simulations.run import parse_overrides


def mean_std(vals: list[float]) -> str:
    if not vals:
        return "n/a"
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    return f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals):.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategies", default="fedavg,average")
    ap.add_argument("--partitions", default="shards,dirichlet")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--run-config", default="")
    ap.add_argument("--out", default=str(ROOT / "results" / "sweep"))
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = parse_overrides(args.run_config)
    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    rows = []
    for strategy in args.strategies.split(","):
        for part in args.partitions.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                name = f"{strategy}-{part}-s{seed}"
                cfg = {**base, "strategy": strategy, "partitioning": part, "seed": seed, "output-dir": str(out),
                       "run-name": name}
                n = int(cfg.get("num-clients", defaults["num-clients"]))
                outcome = run_app(cfg, num_supernodes=n, timeout=args.timeout, echo=False)
                row = {"strategy": strategy, "partitioning": part, "seed": seed, "status": outcome.status,
                       "seconds": outcome.seconds}
                res = outcome.out_dir / "results.json"
                if outcome.ok and res.exists():
                    rounds = json.loads(res.read_text())["rounds"]
                    row["accuracy-per-round"] = [r["test-accuracy"] for r in rounds]
                    row["final-accuracy"] = rounds[-1]["test-accuracy"]
                    row["ensemble-accuracy"] = rounds[-1].get("ensemble-accuracy")
                print(f"sweep: {name}: {row['status']} final={row.get('final-accuracy')}", flush=True)
                rows.append(row)
                (out / "sweep.json").write_text(json.dumps(rows, indent=2))
    parts = args.partitions.split(",")
    lines = ["| strategy | " + " | ".join(parts) + " |", "|---|" + "---|" * len(parts)]
    lines_r = list(lines)
    for strategy in args.strategies.split(","):
        cells, cells_r = [], []
        for part in parts:
            sel = [r for r in rows if r["strategy"] == strategy and r["partitioning"] == part and "final-accuracy" in r]
            cells.append(mean_std([r["final-accuracy"] for r in sel]))
            reach = []
            for r in sel:
                target = 0.9 * r["final-accuracy"]
                reach.append(next(i for i, a in enumerate(r["accuracy-per-round"]) if a >= target))
            cells_r.append(mean_std([float(v) for v in reach]))
        lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
        lines_r.append(f"| {strategy} | " + " | ".join(cells_r) + " |")
    table = ("Final test accuracy (mean ± std over seeds)\n\n" + "\n".join(lines) +
             "\n\nFirst round reaching 90% of the final accuracy\n\n" + "\n".join(lines_r) + "\n")
    (out / "table.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
