"""Glue between a validated ``RunConfig`` and the library: data, models, client work.

Used by the Flower ClientApp/ServerApp (which only add messaging) and by plain-Python runners, so
that a simulation and a benchmark build exactly the same data and models from the same config.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from fedfuse import tofu
from fedfuse.config import RunConfig, data_options, read_fusion_set
from fedfuse.data import FederatedData
from fedfuse.hetero.depth import multi_exit
from fedfuse.importance import neuron_importance, uniform_importance
from fedfuse.models import build_model
from fedfuse.training import evaluate, train


def federated_data(cfg: RunConfig, num_clients: int | None = None):
    """The run's ``FederatedData`` (deterministic: every process builds the identical one)."""
    return FederatedData.build(**data_options(cfg, num_clients))


def global_model(cfg: RunConfig, num_classes: int, input_shape: tuple[int, ...], seed: int | None = None) -> nn.Module:
    """The run's architecture, initialised with ``seed`` (default: the run seed). With depth tiers
    (``client-tiers`` ``<width>x<depth>``) it carries an exit classifier after every tier's depth
    (``fedfuse.hetero.depth.MultiExit``)."""
    seed = cfg.seed if seed is None else seed
    model = build_model(cfg.model, num_classes=num_classes, input_shape=tuple(input_shape), width=cfg.model_width,
                        depth=cfg.model_depth, seed=seed)
    if not cfg.depth_tiers:
        return model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        return multi_exit(model, cfg.depth_tiers, num_classes)


def client_init_seed(cfg: RunConfig, partition_id: int) -> int:
    """Independent initialisation per client for one-shot fusion (the papers' setting)."""
    return cfg.seed * 1000 + partition_id + 1


def load_fusion_inputs(path: str, *, dataset: str = "", input_shape: tuple[int, ...] | None = None,
                       num_classes: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fusion set from a ``.pt``/``.npz`` file (``fusion-set-path``), checked against ``dataset`` and the given
    shape (``fedfuse.config.read_fusion_set``); ``ConfigError`` naming the key and the path otherwise.

    Returns ``(x float32 [B, *input_shape], y int64 [B] or None)``.
    """
    return read_fusion_set(path, dataset=dataset, input_shape=input_shape, num_classes=num_classes)


def client_round(cfg: RunConfig, model: nn.Module, train_set, val_set, *, need_importance: bool,
                 device: torch.device, seed: int, epochs: int | None = None, lr: float | None = None,
                 proximal_mu: float = 0.0, forward=None, loss_fn=None) -> dict[str, Any]:
    """One client's local work: train (``epochs``: ``None`` = ``local-epochs``; 0 = not at all), evaluate, score
    neurons.

    ``forward``: the training forward (``fedfuse.training.train``'s; capacity tiers' ordered dropout); ``loss_fn``:
    the batch loss (``train``'s; depth tiers' loss over every exit).

    ``proximal_mu`` > 0 adds FedProx's proximal term ``mu/2 · ||w - w_global||²`` to the local loss
    (``fedfuse.training.train``; the server's FedProx strategy sends it as ``proximal-mu``).

    Returns ``{"state": state dict, "scores": {level: [W]} | None, "metrics": {...}}``.
    """
    if cfg.tofu_r > 0:  # Token Fusion for local training/evaluation only (importance suspends it)
        tofu.apply(model, r=cfg.tofu_r)
    epochs = cfg.local_epochs if epochs is None else int(epochs)
    stats = train(model, train_set.x, train_set.y, epochs=epochs, batch_size=cfg.batch_size,
                  optimizer=cfg.optimizer, lr=lr or cfg.lr, weight_decay=cfg.weight_decay, device=device, seed=seed,
                  proximal_mu=proximal_mu, momentum=cfg.momentum, forward=forward, loss_fn=loss_fn)
    train_metrics = evaluate(model, train_set.x, train_set.y, num_classes=train_set.num_classes, device=device)
    if epochs == 0:   # a model that arrives trained (a node's own model-path): its loss as it is
        stats["train-loss"] = float(train_metrics["loss"])
    eval_set = val_set if len(val_set) > 0 else train_set
    val_metrics = evaluate(model, eval_set.x, eval_set.y, num_classes=eval_set.num_classes, device=device)
    t0 = time.perf_counter()
    scores = None
    if need_importance:
        n = min(cfg.importance_samples, len(eval_set))
        if cfg.importance == "uniform":
            scores = uniform_importance(model)
        else:
            scores = neuron_importance(model, eval_set.x[:n], eval_set.y[:n], method=cfg.importance, device=device)
    score_seconds = time.perf_counter() - t0
    if cfg.tofu_r > 0:
        tofu.remove(model)  # weights are untouched by ToFu; the reply is a plain model
    model.cpu()
    metrics = {
        "num-examples": len(train_set),
        "train-loss": float(stats["train-loss"]),
        "train-accuracy": float(train_metrics["accuracy"]),
        "val-accuracy": float(val_metrics["accuracy"]),
        "val-loss": float(val_metrics["loss"]),
        "train-seconds": float(stats["train-seconds"]),
        "score-seconds": float(score_seconds),
        "class-counts": [int(c) for c in train_set.class_counts()],
    }
    return {"state": model.state_dict(), "scores": scores, "metrics": metrics}
