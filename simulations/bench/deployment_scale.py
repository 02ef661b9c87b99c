"""A real deployment with ResNet-18-size replies (issue 24): loopback SuperLink + 10 SuperNodes, TLS and SuperNode
authentication, every reply a model of ResNet-18's parameter count.

The model is fedfuse's ResNet at ``model-width=96 model-depth=4`` (one block per stage): 11.0 M parameters, a 42 MiB
float32 state — torchvision's ``resnet18`` has 11.2 M. Data: scikit-learn digits (8×8 images), Dirichlet α 0.5 over
the SuperNodes, each SuperNode building its own partition (``partition-id`` / ``num-partitions`` node config). The
strategy is the default ``auto`` with ``auto-fusion-epochs=0``, so every round builds its fusion candidates on the
server (FedDF distils the 10 clients on the fusion set) and the SuperNodes score them (one more exchange per round):
the longest server-side path of the default, under a ``round-timeout`` it must not stall.

Per round: the round's seconds, the server's aggregation (``fusion-seconds``: validation, candidates, the clients'
scoring of them), the clients' training and importance seconds, valid replies and failures; message sizes are the
global model's and the importance scores' float32 bytes (what each train message carries down and each reply up).

    .venv/bin/python -m simulations.bench.deployment_scale --out results/deployment-scale
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import json
from pathlib import Path

from simulations.bench.stats import mean
from simulations.bench.tables import markdown_table, write_json

ROOT = Path(__file__).resolve().parents[2]


def run_config(out: Path, nodes: int, rounds: int, timeout: float) -> dict:
    return {"dataset": "digits", "model": "resnet", "model-width": 96, "model-depth": 4, "num-clients": nodes,
            "partitioning": "dirichlet", "dirichlet-alpha": 0.5, "num-server-rounds": rounds, "local-epochs": 1,
            "min-train-nodes": nodes, "strategy": "auto", "auto-fusion-epochs": 0, "round-timeout": timeout,
            "output-dir": str(out / "runs"), "run-name": f"auto-resnet11m-n{nodes}-r{rounds}"}


def message_mib() -> tuple[float, float]:
    """The global model's float32 MiB (each train message down and each reply up) and the importance scores'."""
    import torch

    from fedfuse.models import build_model

    model = build_model("resnet", num_classes=10, input_shape=(1, 8, 8), width=96, depth=4)
    state = sum(v.numel() * 4 for v in model.state_dict().values()) / 2 ** 20
    units = sum(m.out_channels for m in model.modules() if isinstance(m, torch.nn.Conv2d))  # ≥ the scored units
    return state, units * 4 / 2 ** 20


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-timeout", type=float, default=600.0)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", default=str(ROOT / "results" / "deployment-scale"))
    a = ap.parse_args(argv)
    from simulations.runners.deployment import Deployment

    out = Path(a.out)
    cfg = run_config(out, a.nodes, a.rounds, a.round_timeout)
    run_dir = Path(cfg["output-dir"]) / cfg["run-name"]
    meta = run_dir / "bench.json"
    if not meta.exists():   # a finished run is read, not rerun
        with Deployment(a.nodes, tls=True, auth=True) as dep:
            outcome = dep.run(cfg, timeout=a.timeout)
        if not outcome.ok:
            raise SystemExit(f"deployment run {outcome.run_id} {outcome.status}: {outcome.details}\n"
                             f"{outcome.log[-4000:]}")
        meta.write_text(json.dumps({"run-seconds": outcome.seconds}))
    run_seconds = json.loads(meta.read_text())["run-seconds"]
    res = json.loads((run_dir / "results.json").read_text())
    rows = [r for r in res["rounds"] if r.get("round")]
    state_mib, score_mib = message_mib()
    table_rows = []
    for r in rows:
        info = r.get("fusion-info") or {}
        head = r["round"] > a.rounds   # the head round after the last training round (ridge statistics, no training)
        table_rows.append([f"{r['round']} (head round)" if head else r["round"], f"{r['round-seconds']:.0f}",
                           f"{r.get('fusion-seconds') or 0:.1f}",
                           "–" if head else f"{r.get('client-train-seconds-mean') or 0:.1f}",
                           "–" if head else r.get("valid-replies"), len(r.get("failures") or []),
                           info.get("select-choice", "–"),
                           f"{r['test-accuracy']:.3f}", f"{r.get('server-rss-mb') or 0:.0f}"])
    text = (f"# Loopback deployment, TLS + SuperNode auth: {a.nodes} SuperNodes, ResNet of 11.0 M parameters\n\n"
            + markdown_table(["round", "round s", "server aggregation s", "client train s (mean)",
                              "valid replies", "failures", "auto's choice",
                              "accuracy", "server RSS MiB"], table_rows)
            + f"\n\nMessages: the model {state_mib:.1f} MiB down and up per client per round, importance scores "
              f"≤ {score_mib:.3f} MiB up; {a.nodes} replies = {a.nodes * state_mib:.0f} MiB into the server per round. "
              f"Round timeout {a.round_timeout:.0f} s; mean training round "
              f"{mean(r['round-seconds'] for r in rows if r['round'] <= a.rounds):.0f} s; the whole run "
              f"{run_seconds:.0f} s (SuperNodes' start-up included). 10 SuperNodes and the SuperLink share this "
              f"machine's cores, so client seconds include waiting for a core. `auto` asks the clients for no "
              f"importance scores.\n\n"
              f"Command: `python -m simulations.bench.deployment_scale --nodes {a.nodes} --rounds {a.rounds} "
              f"--round-timeout {a.round_timeout:g}`\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    write_json({"config": cfg, "rows": rows, "run-seconds": run_seconds, "state-mib": state_mib}, out / "runs.json")
    print(text)


if __name__ == "__main__":
    main()
