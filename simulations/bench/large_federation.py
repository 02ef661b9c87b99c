"""Federations of 100–1,000 clients (issue 24): real ``flwr run`` simulations, seconds per round split into
Flower/Ray, client and aggregation time, and the server's memory round by round.

Data: one MNIST-1D of 130,000 samples (``mnist1d``, seed 11; its 80/20 split: 104,000 train, 26,000 test), the
first 100,000 training samples shuffled (seed 0) and cut into ``N`` equal client files (``node-<i>.npz``, the
anchors' format: ``partition-files``), the last 4,000 the server's public fusion pool, 10,000 test samples the
central test set. The split is IID: this bench measures cost, not accuracy under skew.

Each run is a real ``flwr run`` (local SuperLink, Ray simulation engine, ``N`` virtual SuperNodes, one CPU per
client actor: two actors on this machine's two cores) with a tiny MLP (40-``--width``-10), one local epoch, Adam,
``--rounds`` rounds and ``fraction-train`` = ``per-round / N``; the head round is off (it is one more exchange after
the last round, not a training round). Per training round the ServerApp's rows give:

- ``round-seconds``: the round as the server sees it (Flower dispatch, the clients, the aggregation and the central
  evaluation of the global model; the clients' own test columns of the round before belong to ``eval-seconds``);
- ``fusion-seconds``: the strategy's ``aggregate_train`` (reply validation, aggregation, post-steps);
- ``client-train-seconds-mean`` / ``client-score-seconds-mean``: one client's training and importance scoring,
  reported by the clients; ``client wall`` = their sum over the round's clients / the number of actors;
- ``Flower/Ray`` = round − aggregation − client wall − the previous row's ``eval-seconds`` (what is left: message
  passing, Ray scheduling, the ClientApps' start-up and data loading, the central evaluation);
- ``server-rss-mb`` (current resident set of the ServerApp process) and ``server-peak-rss-mb``.

    .venv/bin/python -m simulations.bench.large_federation --clients 100,300,1000 --per-round 10,30,50 \\
        --strategies auto,ot --out results/large-federation
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from fedfuse.data.sources import _mnist1d_arrays
from simulations.bench.stats import mean
from simulations.bench.tables import markdown_table, write_json

ROOT = Path(__file__).resolve().parents[2]
TEST = 10_000


def write_splits(out: Path, clients: int, samples: int = 130_000) -> Path:
    """``<out>/mnist1d-n<clients>[-s<samples>]/``: ``node-<i>.npz`` (``x_train``, ``y_train``), ``test.npz``,
    ``public.npz``, from one MNIST-1D of ``samples`` (its 80 % train part: 10/13 of ``samples`` to the clients, the
    rest the public pool; at most 10,000 of its test part as the test set)."""
    folder = out / (f"mnist1d-n{clients}" + ("" if samples == 130_000 else f"-s{samples}"))
    if (folder / "DONE").exists():
        return folder
    d = _mnist1d_arrays({"num_samples": samples, "seed": 11})
    order = np.random.default_rng(0).permutation(len(d["y"]))
    train, public = order[:samples * 10 // 13], order[samples * 10 // 13:]
    folder.mkdir(parents=True, exist_ok=True)
    for i, idx in enumerate(np.array_split(train, clients)):
        np.savez(folder / f"node-{i}.npz", x_train=d["x"][idx], y_train=d["y"][idx])
    np.savez(folder / "public.npz", x=d["x"][public])
    np.savez(folder / "test.npz", x=d["x_test"][:TEST], y=d["y_test"][:TEST])
    (folder / "DONE").write_text("ok\n")
    return folder


def run_config(split: Path, clients: int, per_round: int, strategy: str, rounds: int, width: int, out: Path) -> dict:
    return {"dataset": "mnist1d-flat", "partition-files": str(split / "node-{partition-id}.npz"),
            "test-set-path": str(split / "test.npz"), "fusion-set-path": str(split / "public.npz"),
            "fusion-set-size": 300, "num-clients": clients, "fraction-train": per_round / clients,
            "min-train-nodes": per_round, "model": "mlp", "model-width": width, "model-depth": 1,
            "local-epochs": 1, "val-fraction": 0.0, "num-server-rounds": rounds, "head-round": False,
            "strategy": strategy, "seed": 0, "output-dir": str(out / "runs"),
            "run-name": f"{strategy}-n{clients}-k{per_round}-r{rounds}"}


def round_costs(rows: list[dict[str, Any]], actors: int) -> list[dict[str, float]]:
    """Per training round: seconds of the round, aggregation, client wall and Flower/Ray (module docstring)."""
    out = []
    for prev, r in zip(rows, rows[1:]):
        if not r.get("round"):
            continue
        clients = r.get("valid-replies") or 0
        per_client = (r.get("client-train-seconds-mean") or 0.0) + (r.get("client-score-seconds-mean") or 0.0)
        client_wall = clients * per_client / actors
        agg = r.get("fusion-seconds") or 0.0
        rnd = r["round-seconds"]
        out.append({"round": r["round"], "round-seconds": rnd, "aggregation": agg, "client-wall": client_wall,
                    "flower-ray": rnd - agg - client_wall - (prev.get("eval-seconds") or 0.0),
                    "clients": clients, "rss": r.get("server-rss-mb"), "peak-rss": r.get("server-peak-rss-mb"),
                    "accuracy": r.get("test-accuracy")})
    return out


def summarise(label: str, clients: int, per_round: int, costs: list[dict[str, float]], wall: float) -> dict:
    rss = [c["rss"] for c in costs if c["rss"] is not None]
    return {"label": label, "clients": clients, "per-round": per_round, "rounds": len(costs), "run-seconds": wall,
            "round-seconds": mean(c["round-seconds"] for c in costs),
            "aggregation": mean(c["aggregation"] for c in costs),
            "client-wall": mean(c["client-wall"] for c in costs),
            "flower-ray": mean(c["flower-ray"] for c in costs),
            "aggregation-share": mean(c["aggregation"] / c["round-seconds"] for c in costs),
            "rss-round2": rss[1] if len(rss) > 1 else None, "rss-last": rss[-1] if rss else None,
            "rss-growth": (rss[-1] / rss[1] - 1) if len(rss) > 1 else None,
            "peak-rss": costs[-1]["peak-rss"] if costs else None,
            "final-accuracy": costs[-1]["accuracy"] if costs else None, "per-round-costs": costs}


def table(rows: list[dict]) -> str:
    def f(v, fmt="{:.1f}"):
        return "–" if v is None else fmt.format(v)
    return markdown_table(
        ["strategy", "clients", "per round", "rounds", "s / round", "aggregation s (share)", "client wall s",
         "Flower/Ray s", "server RSS MiB round 2 → last (growth)", "peak RSS MiB", "accuracy", "flwr run s"],
        [[r["label"], r["clients"], r["per-round"], r["rounds"], f(r["round-seconds"]),
          f"{r['aggregation']:.2f} ({100 * r['aggregation-share']:.1f} %)", f(r["client-wall"]), f(r["flower-ray"]),
          f"{f(r['rss-round2'], '{:.0f}')} → {f(r['rss-last'], '{:.0f}')} ({f(r['rss-growth'] and 100 * r['rss-growth'], '{:+.1f}')} %)",
          f(r["peak-rss"], "{:.0f}"), f(r["final-accuracy"], "{:.3f}"), f(r["run-seconds"], "{:.0f}")]
         for r in rows])


def run_one(split: Path, clients: int, per_round: int, strategy: str, rounds: int, width: int, out: Path,
            actors: int, timeout: float) -> dict:
    """One ``flwr run`` (kept: a finished run is read, not rerun); raises when the run did not complete."""
    from fedfuse.flower.runner.flwr_runner import run_app

    cfg = run_config(split, clients, per_round, strategy, rounds, width, out)
    res = Path(cfg["output-dir"]) / cfg["run-name"] / "results.json"
    meta = res.parent / "bench.json"
    if not meta.exists():
        outcome = run_app(cfg, num_supernodes=clients, timeout=timeout, echo=False)
        if not outcome.ok or not res.exists():
            raise RuntimeError(f"{cfg['run-name']}: flwr run {outcome.status} {outcome.details}\n{outcome.log[-3000:]}")
        meta.write_text(json.dumps({"run-seconds": outcome.seconds}))
    rows = json.loads(res.read_text())["rounds"]
    costs = round_costs(rows, actors)
    if len(costs) != rounds:
        raise RuntimeError(f"{cfg['run-name']}: {len(costs)} of {rounds} training rounds recorded")
    return summarise(strategy, clients, per_round, costs, json.loads(meta.read_text())["run-seconds"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="100,300,1000")
    ap.add_argument("--per-round", default="10,30,50", help="clients sampled per round, one per --clients value")
    ap.add_argument("--strategies", default="auto,ot")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--actors", type=int, default=2, help="concurrent client actors (CPUs / 1 CPU per client)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", default=str(ROOT / "results" / "large-federation"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    clients = [int(c) for c in a.clients.split(",")]
    per_round = [int(k) for k in a.per_round.split(",")]
    if len(per_round) != len(clients):
        raise SystemExit("--per-round needs one value per --clients value")
    rows = []
    for n, k in zip(clients, per_round):
        split = write_splits(ROOT / "results" / "cache" / "large-federation", n)
        for strategy in a.strategies.split(","):
            rows.append(run_one(split, n, k, strategy, a.rounds, a.width, out, a.actors, a.timeout))
            print(table(rows[-1:]), flush=True)
    cmd = ("python -m simulations.bench.large_federation " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out"))
    text = (f"# Large federations: `flwr run` with {', '.join(map(str, clients))} clients\n\n" + table(rows) +
            f"\n\nMeans over the {a.rounds} training rounds; aggregation = the strategy's `aggregate_train`; client wall = "
            f"the round's client seconds / {a.actors} actors; Flower/Ray = the rest (module docstring).\n\n"
            f"Command: `{cmd}`\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    write_json(rows, out / "runs.json")
    print(text)


if __name__ == "__main__":
    main()
