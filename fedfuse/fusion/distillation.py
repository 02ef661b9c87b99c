"""Distillation baselines on the fusion set: ``kd`` (multi-teacher KD) and ``lp`` (linear probing).

The KD and LP baselines of "Model Fusion via Neuron Interpolation" (arXiv 2507.00037); multi-teacher
distillation after Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network" (arXiv 1503.02531).
Spec ``neuron-interpolation.md`` §2.5 (the paper's KD and LP baselines) and §6.6:

- ``kd``: the whole model is one level. A student (a copy of model 0, or a fresh initialisation of its
  architecture) is trained on the fusion set to match the parents' averaged softmax at temperature
  ``τ`` (KL divergence, scaled by ``τ²``). Optional input augmentation of the fusion set.
- ``lp``: only model 0's classifier level is refit, against the ensemble's averaged softmax (τ = 1,
  KL); every other level keeps model 0's weights.

Both need only unlabeled fusion inputs.
"""

from __future__ import annotations

from fedfuse.choices import OPTIMIZERS
import copy
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.registry import MissingInputError, register, require
from fedfuse.models.levels import levels as model_levels
from fedfuse.training import make_optimizer


@torch.no_grad()
def teacher_probs(models: list[nn.Module], x: torch.Tensor, weights: list[float], temperature: float = 1.0,
                  batch_size: int = 512) -> torch.Tensor:
    """Weighted average of ``softmax(logits / τ)`` over ``models``: ``x [B, ...]`` → ``[B, classes]``."""
    out = []
    for i in range(0, x.shape[0], batch_size):
        xb = x[i:i + batch_size]
        out.append(sum(w * (m(xb) / temperature).softmax(-1) for w, m in zip(weights, models)))
    return torch.cat(out)


def augment(x: torch.Tensor, kind: str, gen: torch.Generator, noise: float = 0.1) -> torch.Tensor:
    """Augment a batch ``x [b, ...]``: ``"noise"`` adds ``N(0, (noise·std)²)``, ``"mixup"`` mixes random
    pairs with λ ~ U(0, 1), ``"none"`` returns ``x``. Teachers are re-queried on the augmented batch."""
    if kind == "none":
        return x
    if kind == "noise":
        return x + noise * x.std() * torch.randn(x.shape, generator=gen).to(x)
    if kind == "mixup":
        perm = torch.randperm(x.shape[0], generator=gen).to(x.device)
        lam = torch.rand(x.shape[0], *([1] * (x.dim() - 1)), generator=gen).to(x)
        return lam * x + (1 - lam) * x[perm]
    raise ValueError(f"kd: unknown augmentation {kind!r}; use 'none', 'noise' or 'mixup'")  # options checked it


def _distill(student: nn.Module, run, params: list[torch.nn.Parameter], inputs: torch.Tensor, teachers,
             *, epochs: int, lr: float, weight_decay: float, optimizer: str, batch_size: int, temperature: float,
             seed: int, device: torch.device, aug: str = "none", noise: float = 0.1,
             info: dict | None = None) -> None:
    """Minimise ``τ² · KL(teacher ‖ student)`` over minibatches of ``inputs [B, ...]``.

    ``run`` maps a batch of ``inputs`` to student logits; ``teachers`` maps a batch to target probs.
    Eval mode throughout (no dropout; BatchNorm statistics of model 0 kept). ``info`` (optional) gets
    ``epochs`` and ``epoch_losses`` (mean loss per epoch).
    """
    opt = make_optimizer(params, optimizer, lr, weight_decay)
    gen = torch.Generator().manual_seed(seed)
    student.eval()
    n = inputs.shape[0]
    losses: list[float] = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        total = torch.zeros((), device=device)  # summed on device: no host sync per step
        for i in range(0, n, batch_size):
            xb = augment(inputs[perm[i:i + batch_size]].to(device), aug, gen, noise)
            with torch.no_grad():
                target = teachers(xb)
            logp = F.log_softmax(run(xb) / temperature, -1)
            loss = F.kl_div(logp, target, reduction="batchmean") * temperature ** 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach() * xb.shape[0]
        losses.append(float(total) / n)
    if info is not None:
        info.update(epochs=epochs, epoch_losses=losses)


@dataclass(frozen=True)
class DistillOptions:
    """Training options shared by ``kd`` and ``lp`` (minibatch KL distillation on the fusion set).

    Attributes:
        epochs: passes over the fusion set.
        lr, weight_decay, optimizer: the optimiser (``fedfuse.training.make_optimizer``).
        batch_size: fusion samples per step.
        temperature: softmax temperature τ of teachers and student (the loss is scaled by τ²).
    """

    epochs: int = 50
    lr: float = 1e-3
    weight_decay: float = 0.0
    optimizer: Literal[OPTIMIZERS] = "adam"
    batch_size: int = 32
    temperature: float = 1.0

    def __post_init__(self) -> None:
        require(self.epochs >= 0, "epochs", ">= 0", self.epochs)
        require(self.lr > 0, "lr", "> 0", self.lr)
        require(self.weight_decay >= 0, "weight_decay", ">= 0", self.weight_decay)
        require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)
        require(self.temperature > 0, "temperature", "> 0", self.temperature)


@dataclass(frozen=True)
class KDOptions(DistillOptions):
    """Options of ``kd`` (``DistillOptions`` plus the student and the input augmentation).

    Attributes:
        student: ``"model0"`` = copy of model 0, ``"fresh"`` = model 0's architecture re-initialised.
        augmentation: ``"none"`` | ``"noise"`` | ``"mixup"`` (teachers are queried on the augmented inputs).
        noise: standard deviation of ``"noise"`` augmentation, relative to the batch's std.
    """

    student: Literal["model0", "fresh"] = "model0"
    augmentation: Literal["none", "noise", "mixup"] = "none"
    noise: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.noise >= 0, "noise", ">= 0", self.noise)


@dataclass(frozen=True)
class LPOptions(DistillOptions):
    """Options of ``lp`` (``DistillOptions`` with 100 epochs by default)."""

    epochs: int = 100


def _fusion_tensor(method: str, fusion_inputs) -> torch.Tensor:
    if fusion_inputs is None or len(fusion_inputs) == 0:
        raise MissingInputError(f"{method} needs fusion_inputs (a non-empty unlabeled fusion set)")
    return torch.as_tensor(fusion_inputs).float()


@register("kd", options=KDOptions, uses_scores=False, mixed_widths=True, any_module=True)
def fuse_kd(models, *, fusion_inputs, scores, weights, device, seed, options: KDOptions, info: dict) -> nn.Module:
    """Multi-teacher knowledge distillation on the fusion set (spec §2.5): the student (model 0's copy or
    a fresh initialisation of its architecture) learns the teachers' weighted mean softmax at τ.
    Teachers may have any architecture. Fixed point (``student="model0"``, no augmentation): copies of
    one model are already the optimum, so the student stays close to it (Adam's normalised steps on
    near-zero gradients still move it slightly)."""
    o = options
    teachers = [copy.deepcopy(m).to(device).eval() for m in models]
    st = copy.deepcopy(models[0]).to(device)
    if o.student == "fresh":
        for mod in st.modules():
            if hasattr(mod, "reset_parameters") and any(True for _ in mod.parameters(recurse=False)):
                mod.reset_parameters()
    x = _fusion_tensor("kd", fusion_inputs).to(device)
    _distill(st, st, list(st.parameters()), x, lambda xb: teacher_probs(teachers, xb, weights, o.temperature),
             epochs=o.epochs, lr=o.lr, weight_decay=o.weight_decay, optimizer=o.optimizer, batch_size=o.batch_size,
             temperature=o.temperature, seed=seed, device=device, aug=o.augmentation, noise=o.noise, info=info)
    return st.eval()


@register("lp", options=LPOptions, uses_scores=False, mixed_widths=True)
def fuse_lp(models, *, fusion_inputs, scores, weights, device, seed, options: LPOptions, info: dict) -> nn.Module:
    """Linear probing: refit only model 0's classifier level against the ensemble's averaged softmax.

    The classifier level's inputs (model 0's penultimate features ``[B, ...]``) are computed once; only
    the parameters of ``levels(model)[-1]`` train (KL, τ = 1 by default, spec §2.5). Teachers may have
    any architecture; model 0 must be a ``fedfuse.models`` family (its levels are needed).
    """
    o = options
    x = _fusion_tensor("lp", fusion_inputs).to(device)
    teachers = [copy.deepcopy(m).to(device).eval() for m in models]
    probs = teacher_probs(teachers, x, weights, o.temperature)
    st = copy.deepcopy(models[0]).to(device).eval()
    lvs = model_levels(st)
    head = lvs[-1]
    with torch.no_grad():
        h = x
        for lv in lvs[:-1]:
            h = lv.run(h)
    named = dict(st.named_parameters())
    params = [named[n] for n in head.param_names]
    for p in st.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    # index the precomputed features and the fixed targets together
    idx_feats = torch.arange(h.shape[0], device=device)
    _distill(st, lambda ib: head.run(h[ib.long()]), params, idx_feats.float(),
             lambda ib: probs[ib.long()], epochs=o.epochs, lr=o.lr, weight_decay=o.weight_decay,
             optimizer=o.optimizer, batch_size=o.batch_size, temperature=o.temperature, seed=seed, device=device,
             info=info)
    for p in st.parameters():
        p.requires_grad_(True)
    return st.eval()


__all__ = ["fuse_kd", "fuse_lp", "teacher_probs", "augment", "DistillOptions", "KDOptions", "LPOptions"]
