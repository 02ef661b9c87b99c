"""Multi-round FL in one process (no Flower): a fast diagnostic loop for fusion strategies.

    python -m simulations.bench.multiround_inprocess --dataset mnist1d --alpha 0.5 --width 128 --epochs 3 \
        --rounds 10 --method kf-linear --options '{"match": "balanced"}'

Mirrors one ``flwr run`` multi-round simulation (same ``FederatedData``, ``client_round``, seeds and
sample-count weights as ``fedfuse/flower/client_app.py`` / ``fedfuse/flower/fusion_strategy.py``, all clients
every round) without Ray, so a 20-round run takes seconds. Prints per round: the global model's test accuracy,
the weighted average and the (weighted) probability ensemble of that round's clients (references), every
parameter's norm and the fraction of dead ReLU units per hidden layer — what showed that fusing
every round inflates weights (``simulations/README.md``). Reported accuracies come from the real
Flower sweeps (``python -m fedfuse.flower.runner.sweep``); this loop is for diagnosis.
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import copy
import json

import torch

from fedfuse.config import parse_run_config
from fedfuse.fusion import fuse
from fedfuse.task import client_round, federated_data, global_model
from fedfuse.training import evaluate


def dead_fractions(model: torch.nn.Module, x: torch.Tensor) -> list[float]:
    """Fraction of units of each ReLU in an ``nn.Sequential`` that are zero on every input ``x``."""
    out = []
    h = x
    with torch.no_grad():
        for mod in model:
            h = mod(h)
            if isinstance(mod, torch.nn.ReLU):
                out.append(float(((h > 0).float().mean(0) == 0).float().mean()))
    return out


def train_clients(cfg, g: torch.nn.Module, splits: list, server_round: int,
                  need_importance: bool = False) -> tuple[list[torch.nn.Module], list[int], list[dict]]:
    """One round of local training in-process: each ``(train, val)`` split trains a copy of ``g`` (``client_round``,
    seeded per client and round); the trained models, their sample counts and ``client_round``'s outputs."""
    models, weights, outs = [], [], []
    for pid, (tr, va) in enumerate(splits):
        m = copy.deepcopy(g)
        o = client_round(cfg, m, tr, va, need_importance=need_importance, device=torch.device("cpu"),
                         seed=cfg.seed * 7919 + pid * 131 + server_round)
        m.load_state_dict(o["state"])
        models.append(m)
        weights.append(o["metrics"]["num-examples"])
        outs.append(o)
    return models, weights, outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=3, help="local epochs per round")
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--method", default="kf-linear", help="a fusion method, or fedavg")
    ap.add_argument("--options", default="{}", help="JSON fusion options")
    ap.add_argument("--importance", default="deeplift")
    ap.add_argument("--fusion-rounds", type=int, default=0, help="fuse in rounds 1..N only, then average")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = parse_run_config({"dataset": args.dataset, "num-clients": args.clients, "partitioning": "dirichlet",
                            "dirichlet-alpha": args.alpha, "num-server-rounds": args.rounds,
                            "local-epochs": args.epochs, "lr": args.lr, "model-width": args.width,
                            "seed": args.seed, "importance": args.importance})
    data = federated_data(cfg)
    g = global_model(cfg, data.num_classes, data.input_shape)
    options = json.loads(args.options)
    accs = []
    for r in range(1, args.rounds + 1):
        fusing = args.method != "fedavg" and not (args.fusion_rounds and r > args.fusion_rounds)
        splits = [data.client_data(pid, cfg.val_fraction, cfg.seed) for pid in range(cfg.num_clients)]
        models, weights, outs = train_clients(cfg, g, splits, r, need_importance=fusing)
        scores = [o["scores"] for o in outs]
        counts = [o["metrics"]["class-counts"] for o in outs]
        if fusing:
            extra = dict(options)
            if extra.get("head_weights"):
                extra["class_counts"] = counts
            g = fuse(args.method, models, fusion_inputs=data.fusion_x, scores=scores, weights=weights,
                     seed=cfg.seed + r, **extra)
        else:
            g = fuse("average", models, weights=weights)
        ev = lambda m: evaluate(m, data.test.x, data.test.y, num_classes=data.num_classes)["accuracy"]  # noqa: E731
        acc = ev(g)
        avg = ev(fuse("average", models, weights=weights)) if fusing else acc
        ens = ev(fuse("ensemble", models, weights=weights, uniform=False))
        norms = " ".join(f"{n}:{p.norm().item():.1f}" for n, p in g.named_parameters())
        dead = dead_fractions(g, data.test.x) if isinstance(g, torch.nn.Sequential) else []
        accs.append(acc)
        print(f"round {r:2d} {'fuse' if fusing else 'avg '} acc {acc:.3f} | clients' average {avg:.3f} "
              f"ensemble {ens:.3f} | norms {norms} | dead {[round(d, 2) for d in dead]}", flush=True)
    print("accuracy per round:", " ".join(f"{a:.3f}" for a in accs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
