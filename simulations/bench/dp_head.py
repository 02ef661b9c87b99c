"""The private head round against the non-private one and against no head (issue 45), in one process.

    python -m simulations.bench.dp_head --seeds 0,1,2 --clients 10,100,1000 --out results/dp-head

Per seed and federation size K: Fashion-MNIST (Debian's files), Dirichlet α over K clients, NIID-Bench's LeNet and
client recipe (SGD lr 0.01, momentum 0.9, batch 64), ``--rounds`` rounds of FedAvg (all clients, ``--epochs`` local
epochs, non-private: the model every head is solved on is the same), then on that global model:

- ``no head``: the FedAvg model;
- ``head``: the non-private head round (``head_statistics`` summed, ``solve_classifier``; ridge and LDA);
- ``bounded``: the clients' bounded statistics (clipped features, per-client means: each client weighs one) summed
  without noise, what ``secure-aggregation=true`` solves without DP;
- ``private ε``: the private head round of ``fedfuse.privacy`` (clipped, per-client mean statistics, Gaussian noise,
  AdaSSP ridge; clip = the median feature norm on the server's public fusion inputs; ``k``: the features' top-k
  principal directions on those inputs, ``dp-head-projection``; 0 = none) with the noise multiplier whose
  single release spends ε at δ = 1e-5 on the client-level account (``noise_for_epsilon``). The ε is the head
  round's alone; a DP run composes it with its training rounds' (``fedfuse.flower.trust.privacy.PrivacyAccount``).

The clients' check is not applied (each row is the head as solved), so the rows show what the check would choose
between. Test accuracy on the 10,000 test images; mean ± sample std over seeds in ``table.md``, per seed in
``per-seed.json``.
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from fedfuse.config import parse_run_config
from fedfuse.flower.trust.privacy import noise_for_epsilon
from fedfuse.fusion import fuse
from fedfuse.privacy import (feature_clip_bound, noisy_head_sum, private_head_statistics, public_projection,
                             raw_feature_head)
from fedfuse.progressive import HeadStatistics, head_statistics, solve_classifier, with_head
from fedfuse.task import client_round, federated_data, global_model
from fedfuse.training import evaluate

DELTA = 1e-5


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


def run_cell(seed: int, clients: int, args) -> dict:
    model = "lenet" if args.dataset == "fashion-mnist" else "mlp"
    cfg = parse_run_config({"dataset": args.dataset, "model": model, "num-clients": clients,
                            "partitioning": "dirichlet", "dirichlet-alpha": args.alpha, "optimizer": "sgd",
                            "lr": 0.01 if args.dataset == "fashion-mnist" else 0.1, "momentum": 0.9, "weight-decay": 1e-5, "batch-size": 64,
                            "local-epochs": args.epochs, "num-server-rounds": args.rounds, "seed": seed,
                            "val-fraction": 0.0, "fusion-set-size": 500})
    data = federated_data(cfg)
    g = global_model(cfg, data.num_classes, data.input_shape)
    splits = [data.client_data(pid, cfg.val_fraction, cfg.seed) for pid in range(clients)]
    splits = [(tr, va) for tr, va in splits if len(tr) > 0]   # Dirichlet 0.1 over 1,000 clients leaves some empty
    parts = [tr for tr, _ in splits]
    t0 = time.process_time()
    for r in range(1, args.rounds + 1):
        models, weights, _ = train_clients(cfg, g, splits, r)
        g = fuse("average", models, weights=weights)
    train_s = time.process_time() - t0
    acc = lambda m: evaluate(m, data.test.x, data.test.y, num_classes=data.num_classes)["accuracy"]  # noqa: E731
    row = {"seed": seed, "clients": clients, "non-empty clients": len(parts), "no head": acc(g),
           "train-cpu-s": train_s}
    t0 = time.process_time()
    stats = [head_statistics(g, tr.x, tr.y, data.num_classes) for tr in parts]
    for solver in ("ridge", "lda"):
        row[f"head {solver}"] = acc(with_head(copy.deepcopy(g), solve_classifier(stats, solver)))
    row["head-cpu-s"] = time.process_time() - t0
    for k in args.project:
        proj = public_projection(g, data.fusion_x, k)
        clip = feature_clip_bound(g, data.fusion_x, projection=proj)
        row[f"clip k={k}"] = clip
        t0 = time.process_time()
        bounded = [private_head_statistics(g, tr.x, tr.y, data.num_classes, clip, projection=proj) for tr in parts]
        row[f"private-stats-cpu-s k={k}"] = time.process_time() - t0
        if k == 0:   # the bounded statistics summed without noise: what secure-aggregation=true alone solves
            plain = HeadStatistics(sum(b.gram for b in bounded), sum(b.cross for b in bounded), len(bounded))
            for solver in ("ridge", "lda"):
                head = raw_feature_head(solve_classifier([plain], solver, ridge=1e-3), clip)
                row[f"bounded {solver}"] = acc(with_head(copy.deepcopy(g), head))
        gen = torch.Generator().manual_seed(seed * 1000 + clients)
        for eps in args.eps:
            sigma = noise_for_epsilon(eps, DELTA, 1, population=len(parts))
            noisy = noisy_head_sum(bounded, sigma, gen)
            for solver in ("ridge", "lda"):
                head = raw_feature_head(solve_classifier([noisy], solver, ridge=1e-3), clip, proj)
                row[f"private {solver} eps={eps:g} k={k}"] = acc(with_head(copy.deepcopy(g), head))
            row[f"sigma eps={eps:g}"] = sigma
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eps", default="1,4,8")
    ap.add_argument("--project", default="0", help="dimensions k of the public projection (0: none), comma-separated")
    ap.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist (LeNet) or mnist1d (MLP 64x2)")
    ap.add_argument("--out", default="results/dp-head")
    args = ap.parse_args(argv)
    args.eps = [float(e) for e in args.eps.split(",")]
    args.project = [int(k) for k in args.project.split(",")]
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for clients in [int(c) for c in args.clients.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            row = run_cell(seed, clients, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out / "per-seed.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    cols = ["no head", "head ridge", "head lda", "bounded ridge", "bounded lda"] + [f"private {s} eps={e:g} k={k}" for k in args.project
                                                    for e in args.eps for s in ("ridge", "lda")]
    lines = [f"{args.dataset}, {'LeNet' if args.dataset == 'fashion-mnist' else 'MLP 64x2'}, Dirichlet α {args.alpha}, {args.rounds} FedAvg rounds × {args.epochs} local "
             f"epochs (non-private), then the head; test accuracy %, mean ± sample std over seeds "
             f"{args.seeds}; private: client-level (ε, δ = {DELTA:g}) of the head round alone.", "",
             "| clients | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for clients in sorted({r["clients"] for r in rows}):
        sel = [r for r in rows if r["clients"] == clients]
        cells = []
        for c in cols:
            v = [100 * r[c] for r in sel]
            cells.append(f"{statistics.mean(v):.1f} ± {statistics.stdev(v):.1f}" if len(v) > 1 else f"{v[0]:.1f}")
        lines.append(f"| {clients} | " + " | ".join(cells) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
