"""Load benchmark (not a test): a ``flwr run`` simulation with many clients on few cores.

    python -m simulations.bench.load --clients 20,50 --rounds 4 --fraction-train 0.2

For each client count it runs the real Flower simulation (local SuperLink + Ray) with a tiny MLP, client
sampling ``fraction-train`` < 1 and KF-linear fusion, then reads the run's ``results.json`` and reports:

- rounds per minute (all rounds, and steady state: rounds 2.. without Ray/actor start-up);
- server peak RSS (``ru_maxrss`` of the process hosting the ServerApp; in simulation that process also
  drives Ray, so it is an upper bound of the ServerApp's own memory);
- per round: fusion seconds, central-evaluation seconds (global model + ensemble reference), client
  compute seconds (sum over the sampled clients of train + importance seconds) and their shares of the
  round's wall time (the rest is Flower/Ray framework time: messaging, ClientApp set-up, data building).

Writes ``<out>/load_benchmark.json`` and a markdown table to stdout.
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import json
import time
from pathlib import Path

from fedfuse.flower.runner.flwr_runner import ROOT, run_app


def summarize(res: dict, n_clients: int, wall: float) -> dict:
    rows = [r for r in res["rounds"] if r["round"] > 0]
    # round-seconds of round r runs from the previous evaluation's start to this one's: train + fusion + eval
    per_round = []
    for r in rows:
        k = r.get("valid-replies") or 0
        client = k * ((r.get("client-train-seconds-mean") or 0.0) + (r.get("client-score-seconds-mean") or 0.0))
        per_round.append({"round": r["round"], "seconds": r["round-seconds"], "sampled": k,
                          "fusion": r.get("fusion-seconds") or 0.0, "eval": r.get("eval-seconds") or 0.0,
                          "client-compute": client, "accuracy": r["test-accuracy"]})
    steady = [p for p in per_round if p["round"] > 1] or per_round
    tot = sum(p["seconds"] for p in steady)
    return {
        "clients": n_clients,
        "sampled-per-round": [p["sampled"] for p in per_round],
        "wall-seconds": wall,
        "rounds-per-minute-all": 60 * len(per_round) / sum(p["seconds"] for p in per_round),
        "rounds-per-minute-steady": 60 * len(steady) / tot,
        "first-round-seconds": per_round[0]["seconds"],
        "steady-round-seconds": tot / len(steady),
        "server-peak-rss-mb": max(r.get("server-peak-rss-mb") or 0 for r in res["rounds"]),
        "fusion-share": sum(p["fusion"] for p in steady) / tot,
        "eval-share": sum(p["eval"] for p in steady) / tot,
        "client-compute-share": sum(p["client-compute"] for p in steady) / tot,
        "fusion-seconds-mean": sum(p["fusion"] for p in steady) / len(steady),
        "final-accuracy": per_round[-1]["accuracy"],
        "per-round": per_round,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="20,50")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--fraction-train", type=float, default=0.2)
    ap.add_argument("--strategy", default="kf-linear")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--cpus-per-client", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "results" / "load_benchmark"))
    ap.add_argument("--timeout", type=float, default=1500)
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summaries = []
    for n in [int(x) for x in a.clients.split(",")]:
        cfg = {"dataset": "digits", "model": "mlp", "model-width": a.width, "model-depth": 1, "num-clients": n,
               "partitioning": "iid", "num-server-rounds": a.rounds, "local-epochs": 1, "fusion-set-size": 100,
               "strategy": a.strategy, "importance": "uniform", "fraction-train": a.fraction_train,
               "min-train-nodes": 2, "val-fraction": 0.1, "output-dir": str(out), "run-name": f"clients-{n}"}
        print(f"[load] {n} clients: flwr run with {n} SuperNodes, {a.rounds} rounds, fraction-train "
              f"{a.fraction_train} (timeout {a.timeout:.0f} s) ...", flush=True)
        t0 = time.perf_counter()
        outcome = run_app(cfg, num_supernodes=n, cpus_per_client=a.cpus_per_client, timeout=a.timeout, echo=False)
        wall = time.perf_counter() - t0
        print(f"[load] {n} clients: run {outcome.status} after {wall:.0f} s", flush=True)
        if not outcome.ok:
            print(f"{n} clients: run ended {outcome.status} {outcome.details}\n{outcome.log[-3000:]}")
            continue
        res = json.loads((outcome.out_dir / "results.json").read_text())
        s = summarize(res, n, wall)
        summaries.append(s)
        print(json.dumps({k: v for k, v in s.items() if k != "per-round"}), flush=True)
    (out / "load_benchmark.json").write_text(json.dumps(summaries, indent=2))
    print("\n| clients | sampled/round | rounds/min (steady) | rounds/min (all) | 1st round s | steady round s | "
          "server peak RSS MB | fusion share | eval share | client compute share | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(f"| {s['clients']} | {s['sampled-per-round'][0]} | {s['rounds-per-minute-steady']:.1f} | "
              f"{s['rounds-per-minute-all']:.1f} | {s['first-round-seconds']:.1f} | {s['steady-round-seconds']:.2f} | "
              f"{s['server-peak-rss-mb']:.0f} | {s['fusion-share']:.1%} | {s['eval-share']:.1%} | "
              f"{s['client-compute-share']:.1%} | {s['wall-seconds']:.0f} |")


if __name__ == "__main__":
    main()
