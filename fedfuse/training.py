"""Training and evaluation loops shared by clients, the server and the benchmarks."""

from __future__ import annotations

import math
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` → CUDA when present (respecting ``CUDA_VISIBLE_DEVICES``), else CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def limit_threads(n: int | None = None) -> None:
    """Cap torch CPU threads (several torch processes share few cores under Ray, and oversubscribed threads slow every one down)."""
    n = n or int(os.environ.get("FEDFUSE_TORCH_THREADS", "1"))
    torch.set_num_threads(max(1, n))


def _fusable(params: list) -> bool:
    """Whether torch's fused Adam kernel takes ``params`` (floating tensors, all on one CPU or CUDA device)."""
    devices = {p.device for p in params}
    return bool(params) and len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda") and all(
        p.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) for p in params)


def make_optimizer(params, name: str = "adam", lr: float = 1e-3, weight_decay: float = 0.0,
                   momentum: float = 0.9) -> torch.optim.Optimizer:
    """The optimiser ``name`` (``adam`` | ``adamw`` | ``sgd`` with ``momentum``, 0.9 unless given) over ``params``.

    Adam and AdamW use torch's fused kernel where it applies (the same update in one pass over every parameter
    instead of a Python loop of per-tensor operations: a ResNet-18's step is about 7 times faster on one CPU
    thread, which the server's level fits and distillation pay at every minibatch; docs/scaling.md)."""
    if name in ("adam", "adamw"):
        params = list(params)
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        fused = all(isinstance(p, torch.Tensor) for p in params) and _fusable(params)   # not param groups
        return cls(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {}))
    if name == "sgd":
        if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ValueError(f"optimizer: sgd momentum must be in [0, 1), got {momentum!r}")
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"optimizer: unknown optimizer {name!r}; choose adam, adamw or sgd")


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 1, batch_size: int = 32,
          optimizer: str = "adam", lr: float = 1e-3, weight_decay: float = 0.0, device: str | torch.device = "cpu",
          seed: int = 0, proximal_mu: float = 0.0, momentum: float = 0.9,
          forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
    """Supervised cross-entropy training in place. ``x`` ``[N, *input_shape]``, ``y`` ``[N]``.

    ``forward``: the batch's logits instead of ``model(xb)`` (e.g. ``fedfuse.hetero.OrderedDropout``, which
    trains a nested sub-model of ``model`` per batch); it must compute them from ``model``'s parameters.
    ``loss_fn(xb, yb)``: the batch loss instead of the cross-entropy of the logits (e.g. DepthFL's loss over every
    exit classifier, ``fedfuse.hetero.depth.mutual_distillation_loss``).

    ``proximal_mu > 0`` adds FedProx's proximal term ``mu/2 · ||w - w_start||²`` to every batch loss (Li et
    al., "Federated Optimization in Heterogeneous Networks", arXiv 1812.06127, Eq. 2), where ``w_start`` are
    the trainable parameters as the model arrives (the global model in multi-round FL); ``0`` is plain
    training (the same code path, bit for bit).

    Returns ``{"train-loss": mean cross-entropy of the last epoch (without the proximal term),
    "train-seconds": wall time}``.
    """
    if not (isinstance(proximal_mu, (int, float)) and math.isfinite(proximal_mu) and proximal_mu >= 0):
        raise ValueError(f"train: proximal_mu must be a finite number >= 0, got {proximal_mu!r}")
    device = resolve_device(device)
    model.to(device).train()
    opt = make_optimizer(model.parameters(), optimizer, lr, weight_decay, momentum)
    # FedProx anchor: a detached copy of the weights before the first local step
    anchor = ([(p, p.detach().clone()) for p in model.parameters() if p.requires_grad] if proximal_mu > 0 else [])
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    last = float("nan")
    n = len(x)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        total, count = 0.0, 0
        for start in range(0, n, batch_size):
            idx = perm[start:start + batch_size]
            if len(idx) < 2 and n >= 2:  # BatchNorm cannot train on a single sample
                continue
            xb, yb = x[idx].to(device), y[idx].to(device)
            opt.zero_grad(set_to_none=True)
            if loss_fn is not None:
                loss = loss_fn(xb, yb)
            else:
                loss = F.cross_entropy(forward(xb) if forward is not None else model(xb), yb)
            objective = loss
            if anchor:
                objective = loss + 0.5 * proximal_mu * sum((p - p0).pow(2).sum() for p, p0 in anchor)
            objective.backward()
            opt.step()
            total += loss.item() * len(idx)
            count += len(idx)
        last = total / max(count, 1)
    model.eval()
    return {"train-loss": last, "train-seconds": time.perf_counter() - t0}


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, *, batch_size: int = 512,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """Logits ``[N, num_classes]`` on CPU (model put in eval mode)."""
    device = resolve_device(device)
    model.to(device).eval()
    outs = [model(x[i:i + batch_size].to(device)).float().cpu() for i in range(0, len(x), batch_size)]
    return torch.cat(outs) if outs else torch.empty(0)


def metrics_from_logits(logits: torch.Tensor, y: torch.Tensor, num_classes: int | None = None,
                        probabilities: bool = False) -> dict[str, float | list[float]]:
    """Accuracy, cross-entropy loss and per-class accuracy (NaN for absent classes → reported as -1).

    ``probabilities=True`` when ``logits`` are already class probabilities (e.g. an ensemble's).
    """
    num_classes = num_classes or logits.shape[1]
    if len(y) == 0:
        return {"accuracy": float("nan"), "loss": float("nan"), "per-class-accuracy": [-1.0] * num_classes}
    if probabilities:
        loss = F.nll_loss(torch.log(logits.clamp_min(1e-12)), y).item()
    else:
        loss = F.cross_entropy(logits, y).item()
    pred = logits.argmax(1)
    per_class = []
    for c in range(num_classes):
        mask = y == c
        per_class.append(float((pred[mask] == c).float().mean()) if mask.any() else -1.0)
    return {"accuracy": float((pred == y).float().mean()), "loss": loss, "per-class-accuracy": per_class}


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, num_classes: int | None = None,
             batch_size: int = 512, device: str | torch.device = "cpu") -> dict[str, float | list[float]]:
    """Accuracy, loss and per-class accuracy of ``model`` on ``(x [N, ...], y [N])``."""
    return metrics_from_logits(predict_logits(model, x, batch_size=batch_size, device=device), y, num_classes)
