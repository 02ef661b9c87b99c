"""Distillation baselines on the fusion set: ``kd`` (multi-teacher KD) and ``lp`` (linear probing).

Spec ``neuron-interpolation.md`` §2.5 (the paper's KD and LP baselines) and §6.6:

- ``kd``: the whole model is one level. A student (a copy of model 0, or a fresh initialisation of its
  architecture) is trained on the fusion set to match the parents' averaged softmax at temperature
  ``τ`` (KL divergence, scaled by ``τ²``). Optional input augmentation of the fusion set.
- ``lp``: only model 0's classifier level is refit, against the ensemble's averaged softmax (τ = 1,
  KL); every other level keeps model 0's weights.

Both need only unlabeled fusion inputs.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion import register
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
    raise ValueError(f"kd: unknown augmentation {kind!r}; use 'none', 'noise' or 'mixup'")


def _distill(student: nn.Module, run, params: list[torch.nn.Parameter], inputs: torch.Tensor, teachers,
             *, epochs: int, lr: float, weight_decay: float, optimizer: str, batch_size: int, temperature: float,
             seed: int, device: torch.device, aug: str = "none", noise: float = 0.1) -> None:
    """Minimise ``τ² · KL(teacher ‖ student)`` over minibatches of ``inputs [B, ...]``.

    ``run`` maps a batch of ``inputs`` to student logits; ``teachers`` maps a batch to target probs.
    Eval mode throughout (no dropout; BatchNorm statistics of model 0 kept).
    """
    opt = make_optimizer(params, optimizer, lr, weight_decay)
    gen = torch.Generator().manual_seed(seed)
    student.eval()
    n = inputs.shape[0]
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, batch_size):
            xb = augment(inputs[perm[i:i + batch_size]].to(device), aug, gen, noise)
            with torch.no_grad():
                target = teachers(xb)
            logp = F.log_softmax(run(xb) / temperature, -1)
            loss = F.kl_div(logp, target, reduction="batchmean") * temperature ** 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


@register("kd", uses_scores=False)
def fuse_kd(models, *, fusion_inputs=None, weights=None, device=torch.device("cpu"), seed: int = 0,
            student: str = "model0", epochs: int = 50, lr: float = 1e-3, weight_decay: float = 0.0,
            optimizer: str = "adam", batch_size: int = 32, temperature: float = 1.0, augmentation: str = "none",
            noise: float = 0.1, **_) -> nn.Module:
    """Multi-teacher knowledge distillation on the fusion set (spec §2.5).

    Options: ``student`` ("model0" = copy of model 0, "fresh" = re-initialised architecture), ``epochs``,
    ``lr``, ``weight_decay``, ``optimizer``, ``batch_size``, ``temperature`` τ, ``augmentation``
    ("none" | "noise" | "mixup"; teachers are queried on the augmented inputs), ``noise``.
    """
    if fusion_inputs is None or len(fusion_inputs) == 0:
        raise ValueError("kd needs fusion_inputs (a non-empty unlabeled fusion set)")
    weights = weights or [1.0 / len(models)] * len(models)
    teachers = [copy.deepcopy(m).to(device).eval() for m in models]
    st = copy.deepcopy(models[0]).to(device)
    if student == "fresh":
        for mod in st.modules():
            if hasattr(mod, "reset_parameters") and any(True for _ in mod.parameters(recurse=False)):
                mod.reset_parameters()
    elif student != "model0":
        raise ValueError(f"kd: student must be 'model0' or 'fresh', got {student!r}")
    x = torch.as_tensor(fusion_inputs).float().to(device)
    _distill(st, st, list(st.parameters()), x, lambda xb: teacher_probs(teachers, xb, weights, temperature),
             epochs=epochs, lr=lr, weight_decay=weight_decay, optimizer=optimizer, batch_size=batch_size,
             temperature=temperature, seed=seed, device=device, aug=augmentation, noise=noise)
    return st.eval()


@register("lp", uses_scores=False)
def fuse_lp(models, *, fusion_inputs=None, weights=None, device=torch.device("cpu"), seed: int = 0,
            epochs: int = 100, lr: float = 1e-3, weight_decay: float = 0.0, optimizer: str = "adam",
            batch_size: int = 32, temperature: float = 1.0, **_) -> nn.Module:
    """Linear probing: refit only model 0's classifier level against the ensemble's averaged softmax.

    The classifier level's inputs (model 0's penultimate features ``[B, ...]``) are computed once; only
    the parameters of ``levels(model)[-1]`` train (KL, τ = 1 by default, spec §2.5).
    """
    if fusion_inputs is None or len(fusion_inputs) == 0:
        raise ValueError("lp needs fusion_inputs (a non-empty unlabeled fusion set)")
    weights = weights or [1.0 / len(models)] * len(models)
    x = torch.as_tensor(fusion_inputs).float().to(device)
    teachers = [copy.deepcopy(m).to(device).eval() for m in models]
    probs = teacher_probs(teachers, x, weights, temperature)
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
             lambda ib: probs[ib.long()], epochs=epochs, lr=lr, weight_decay=weight_decay, optimizer=optimizer,
             batch_size=batch_size, temperature=temperature, seed=seed, device=device)
    for p in st.parameters():
        p.requires_grad_(True)
    return st.eval()


__all__ = ["fuse_kd", "fuse_lp", "teacher_probs", "augment"]
