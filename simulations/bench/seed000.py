"""Seed 000 at CPU scale: heterogeneous ViT clients fused (vanilla OT, selective OT, neuron interpolation),
then structurally pruned (``fedfuse.pruning.prune``), against the parents, their ensemble, the best parent
pruned alone and KD into the same pruned architecture (issue 14).

    .venv/bin/python -m simulations.bench.seed000 --datasets mnist1d --partition full2 --seeds 0,1,2 \\
        --archs 64x4x4,128x8x6 --out results/seed000

Clients: one ViT per entry of ``--archs`` (``<embed>x<heads>x<depth>``), each from its own initialisation
(``clients.client_seed``), trained with the harness's one-shot recipe (``clients.train_client``: AdamW,
cosine, label smoothing 0.1, early stopping on the client's validation split) on its partition (``full2``:
every client sees the whole training pool; ``iid2``; ``dirichlet2``), cached under ``--cache``. The server
holds ``--fusion-size`` unlabeled samples from the public pool no client trains on. Phases: ``--phase train``
(only train/cache the clients), ``--phase all`` (train, fuse, prune, evaluate, time, write the tables).

Rows (each evaluated on the test split): every parent; the ensemble; ``ot`` (vanilla, EMD on activations,
CKA block matching where depths differ), ``ot[selective=true]`` (importance-conditioned transport) and
``kf-gradient`` (neuron interpolation) fused into the larger parent's architecture; each fused model
followed by pruning to (a) the larger parent's parameter count, (b) the smaller parent's, (c) 50 % of the
larger parent's MACs, with and without recovery (distillation of the parents' ensemble on the fusion set);
baselines: the best parent (by federated validation accuracy, never test) pruned the same way, and KD of
the ensemble into the pruned architecture. Columns: accuracy (mean ± sample std, ddof = 1, over seeds),
parameters, MACs (``torch.utils.flop_counter``; MACs = FLOPs / 2), CPU latency per batch as a ratio to the
larger parent (interleaved medians, one process, one thread).
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from fedfuse.data import FederatedData
from fedfuse.models import build_model
from fedfuse.training import evaluate

from simulations.bench.clients import _atomic_save, cell_config, client_seed, train_client
from simulations.bench.specs import parse_ints, parse_partition, split_list


def parse_arch(text: str) -> tuple[int, int, int]:
    """``"64x4x4"`` → ``(embed 64, heads 4, depth 4)``."""
    try:
        w, h, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"arch {text!r}: expected <embed>x<heads>x<depth>, e.g. 64x4x4") from None
    if w % h:
        raise ValueError(f"arch {text!r}: embed {w} not divisible by {h} heads")
    return w, h, d


def load_data(dataset: str, partition: str, seed: int, fusion_size: int, alpha: float) -> FederatedData:
    spec = parse_partition(partition)
    return FederatedData.build(dataset, spec.num_clients, spec.method, alpha=alpha, fusion_size=fusion_size,
                               fusion_source="public", seed=seed)


def get_parents(dataset: str, partition: str, seed: int, archs: list[tuple[int, int, int]], data: FederatedData,
                cache: Path, epochs: int, lr: float, alpha: float, log=print) -> list[dict]:
    """Train (or load) one client per arch; client ``pid`` gets arch ``archs[pid]`` and seed
    ``client_seed(cfg, pid)``. Returns dicts with ``model``, ``arch``, ``val`` accuracy, ``train_info``."""
    out = []
    for pid, (w, h, d) in enumerate(archs):
        cfg = cell_config(dataset, partition, "vit", seed, width=w, depth=d, epochs=epochs, lr=lr, alpha=alpha,
                          fusion_source="public", model_options={"num_heads": h})
        path = cache / cfg.key() / f"client{pid}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        model = build_model("vit", num_classes=data.num_classes, input_shape=data.input_shape, width=w, depth=d,
                            num_heads=h, seed=client_seed(cfg, pid))
        tr, va = data.client_data(pid, cfg.val_fraction, seed)
        rec = torch.load(path, weights_only=False) if path.exists() else None
        if rec is None:
            info = train_client(model, tr.x, tr.y, cfg.recipe(), seed=client_seed(cfg, pid), val=(va.x, va.y))
            rec = {"state": {k: v.cpu() for k, v in model.state_dict().items()}, "train_info": info}
            _atomic_save(rec, path)
            log(f"  {dataset}/{partition} seed {seed} client {pid} ({w}x{h}x{d}): trained in "
                f"{info['train-seconds']:.0f}s, {info['epochs']} epochs (best {info['best-epoch']}), "
                f"val acc {info['val-accuracy']:.3f}")
        model.load_state_dict(rec["state"])
        model.eval()
        out.append({"model": model, "arch": (w, h, d), "val": va, "train_info": rec["train_info"]})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default="mnist1d")
    ap.add_argument("--partition", default="full2")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--archs", default="64x4x4,128x8x6")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--fusion-size", type=int, default=300)
    ap.add_argument("--cache", default="results/cache/seed000")
    ap.add_argument("--out", default="results/seed000")
    ap.add_argument("--phase", default="all", choices=["train", "all"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    archs = [parse_arch(a) for a in split_list(args.archs)]
    seeds = parse_ints(args.seeds)
    for ds in split_list(args.datasets):
        for seed in seeds:
            data = load_data(ds, args.partition, seed, args.fusion_size, args.alpha)
            parents = get_parents(ds, args.partition, seed, archs, data, Path(args.cache), args.epochs, args.lr,
                                  args.alpha)
            accs = [float(evaluate(p["model"], data.test.x, data.test.y)["accuracy"]) for p in parents]
            print(f"{ds} seed {seed}: parents test acc {accs}", flush=True)
            if args.phase == "train":
                continue


if __name__ == "__main__":
    main()
