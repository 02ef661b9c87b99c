"""Distillation baselines on the fusion set: ``kd`` (multi-teacher KD) and ``lp`` (linear probing).

The KD and LP baselines of "Model Fusion via Neuron Interpolation" (arXiv 2507.00037); multi-teacher
distillation after Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network" (arXiv 1503.02531).
As baselines:

- ``kd``: the whole model is one level. A student (a copy of model 0, or a fresh initialisation of its
  architecture) is trained on the fusion set to match the parents' averaged softmax at temperature
  ``τ`` (KL divergence, scaled by ``τ²``). Optional input augmentation of the fusion set.
- ``lp``: only model 0's classifier level is refit, against the ensemble's averaged softmax (τ = 1,
  KL); every other level keeps model 0's weights.

Both need only unlabeled fusion inputs. Both keep the best state on the fusion-set KL, the start included
(``keep_best``, default on; see ``_distill``): never worse there than model 0, and copies of one model are a
fixed point.
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


#: the input augmentations of a distillation (``augment``)
AUGMENTATIONS = ("none", "noise", "mixup")


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


@torch.no_grad()
def _kl_on(run, inputs: torch.Tensor, targets: list[torch.Tensor], temperature: float, device: torch.device,
           batch_size: int) -> float:
    """``τ² · KL(target ‖ student)`` averaged over all of ``inputs [B, ...]`` (targets precomputed per batch)."""
    total = 0.0
    for j, i in enumerate(range(0, inputs.shape[0], batch_size)):
        logp = F.log_softmax(run(inputs[i:i + batch_size].to(device)) / temperature, -1)
        total += float(F.kl_div(logp, targets[j], reduction="sum"))
    return total * temperature ** 2 / max(inputs.shape[0], 1)


@torch.no_grad()
def _targets(teachers, x: torch.Tensor, batch_size: int, device: torch.device) -> torch.Tensor:
    """The teachers' target probabilities ``[B, classes]`` for all of ``x [B, ...]``, in batches."""
    if x.shape[0] == 0:
        return torch.empty(0, device=device)
    return torch.cat([teachers(x[i:i + batch_size].to(device)) for i in range(0, x.shape[0], batch_size)])


def holdout_split(x: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, ...]`` split (seeded permutation) into a fit part and a held-out part of ``round(fraction · B)``
    samples, at least 1 and at most ``B − 1``: ``(x_fit, x_held)``."""
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed)).to(x.device)
    n_held = min(x.shape[0] - 1, max(1, int(round(fraction * x.shape[0]))))
    return x[perm[n_held:]], x[perm[:n_held]]


def _min_improvement(loss: float) -> float:
    """What counts as a real decrease of the selection KL: more than float32 round-off (KL(p‖p) evaluates to
    ±1e-8, not 0) — 1e-6 nats plus 1e-4 of the loss. Smaller changes keep the earlier state."""
    return 1e-6 + 1e-4 * abs(loss)


def _distill(student: nn.Module, run, params: list[torch.nn.Parameter], inputs: torch.Tensor, teachers,
             *, epochs: int, lr: float, weight_decay: float, optimizer: str, batch_size: int, temperature: float,
             seed: int, device: torch.device, aug: str = "none", noise: float = 0.1,
             info: dict | None = None, keep_best: bool = True, select_inputs: torch.Tensor | None = None,
             patience: int | None = None) -> None:
    """Minimise ``τ² · KL(teacher ‖ student)`` over minibatches of ``inputs [B, ...]``, in place.

    ``run`` maps a batch of ``inputs`` to student logits ``[b, classes]``; ``teachers`` maps a batch to target
    probs ``[b, classes]``; only ``params`` are updated. Eval mode throughout (no dropout; BatchNorm statistics
    of model 0 kept).

    Best-state guarantee (``keep_best=True``, the default): the *selection loss* — ``τ² · KL(teacher ‖ student)``
    on the clean (un-augmented) ``select_inputs`` (default: ``inputs``, the fusion set) — is measured before
    training and after every epoch, and ``params`` end at the state with the lowest one, the start included
    (a decrease within float round-off, ``_min_improvement``, keeps the earlier state). So the returned student is **never worse on that KL than its start**; in
    particular when the teachers agree with the start (copies of one model), the start is the optimum and is
    returned unchanged (Adam's normalised steps on ~zero gradients would otherwise move it). With a held-out
    ``select_inputs`` this is early-stopping model selection; ``patience`` (epochs without a strict
    improvement, ``None`` = train all ``epochs``) stops training early. Training also stops once the selection
    loss is within ``_min_improvement`` of its lower bound 0 (no later state could be kept): an exact shortcut,
    e.g. no epoch at all for agreeing teachers.

    ``info`` (optional) gets ``epochs`` (requested), ``epochs_run``, ``epoch_losses`` (mean training loss per
    epoch) and, with ``keep_best``, ``initial_loss`` (selection loss at the start), ``selection_losses`` (after
    each epoch), ``best_loss`` and ``best_epoch`` (0 = the start was kept).
    """
    if patience is not None and patience < 1:
        raise ValueError(f"distillation: patience must be >= 1 epochs or None, got {patience!r}")
    if patience is not None and not keep_best:
        raise ValueError("distillation: patience stops on the selection loss, which needs keep_best=True")
    opt = make_optimizer(params, optimizer, lr, weight_decay)
    gen = torch.Generator().manual_seed(seed)
    student.eval()
    n = inputs.shape[0]
    losses: list[float] = []
    sel_losses: list[float] = []
    sel_bs = max(batch_size, 256)
    # teachers are fixed: on un-augmented inputs their targets are computed once, not once per epoch (k teacher
    # forward passes saved per epoch; the same targets up to float round-off of the batch size)
    cached = _targets(teachers, inputs, sel_bs, device) if aug == "none" else None
    if keep_best:
        sel_x = inputs if select_inputs is None else select_inputs
        sel_all = cached if select_inputs is None and cached is not None else _targets(teachers, sel_x, sel_bs, device)
        sel_t = list(sel_all.split(sel_bs))
        best_loss = initial = _kl_on(run, sel_x, sel_t, temperature, device, sel_bs)
        best_state, best_epoch = [p.detach().clone() for p in params], 0
    for epoch in range(1, epochs + 1):
        if keep_best and best_loss - _min_improvement(best_loss) < 0:
            break  # converged: KL >= 0, so no later state could count as better and be kept
        perm = torch.randperm(n, generator=gen)
        total = torch.zeros((), device=device)  # summed on device: no host sync per step
        for i in range(0, n, batch_size):
            idx = perm[i:i + batch_size]
            xb = augment(inputs[idx].to(device), aug, gen, noise)
            if cached is not None:
                target = cached[idx.to(cached.device)]
            else:
                with torch.no_grad():
                    target = teachers(xb)
            logp = F.log_softmax(run(xb) / temperature, -1)
            loss = F.kl_div(logp, target, reduction="batchmean") * temperature ** 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach() * xb.shape[0]
        losses.append(float(total) / n)
        if keep_best:
            sel = _kl_on(run, sel_x, sel_t, temperature, device, sel_bs)
            sel_losses.append(sel)
            if sel < best_loss - _min_improvement(best_loss):
                best_loss, best_epoch = sel, epoch
                best_state = [p.detach().clone() for p in params]
            elif patience is not None and epoch - best_epoch >= patience:
                break
    if keep_best:
        with torch.no_grad():
            for p, b in zip(params, best_state):
                p.copy_(b)
    if info is not None:
        info.update(epochs=epochs, epochs_run=len(losses), epoch_losses=losses)
        if keep_best:
            info.update(initial_loss=initial, selection_losses=sel_losses, best_loss=best_loss, best_epoch=best_epoch)


@dataclass(frozen=True)
class DistillOptions:
    """Training options shared by ``kd`` and ``lp`` (minibatch KL distillation on the fusion set).

    Attributes:
        epochs: passes over the fusion set.
        lr, weight_decay, optimizer: the optimiser (``fedfuse.training.make_optimizer``).
        batch_size: fusion samples per step.
        temperature: softmax temperature τ of teachers and student (the loss is scaled by τ²).
        keep_best: end at the state with the lowest ``τ²·KL(ensemble ‖ student)`` on the (clean) fusion set
            among the start and every epoch, so the result is never worse there than the start; off = the
            last epoch's state.
    """

    epochs: int = 50
    lr: float = 1e-3
    weight_decay: float = 0.0
    optimizer: Literal[OPTIMIZERS] = "adam"
    batch_size: int = 32
    temperature: float = 1.0
    keep_best: bool = True

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
        holdout: fraction of the fusion set held out (seeded) to select the state on, by its KL to the ensemble
            (0 = select on the whole fusion set, which the student also trains on: no early stopping).
        patience: with ``holdout``, stop after this many epochs without a better held-out KL (``None``: all
            ``epochs``).
    """

    student: Literal["model0", "fresh"] = "model0"
    augmentation: Literal["none", "noise", "mixup"] = "none"
    noise: float = 0.1
    holdout: float = 0.0
    patience: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.noise >= 0, "noise", ">= 0", self.noise)
        require(0 <= self.holdout < 1, "holdout", "in [0, 1)", self.holdout)
        require(self.patience is None or self.patience >= 1, "patience", ">= 1 or None", self.patience)
        require(self.patience is None or (self.holdout > 0 and self.keep_best), "patience",
                "used with holdout > 0 and keep_best", self.patience)


@dataclass(frozen=True)
class LPOptions(DistillOptions):
    """Options of ``lp`` (``DistillOptions`` with 100 epochs by default)."""

    epochs: int = 100


def _fusion_tensor(method: str, fusion_inputs) -> torch.Tensor:
    if fusion_inputs is None or len(fusion_inputs) == 0:
        raise MissingInputError(f"{method} needs fusion_inputs (a non-empty unlabeled fusion set)")
    return torch.as_tensor(fusion_inputs).float()


PAPER_KD = ('Multi-teacher knowledge distillation into the global architecture on the fusion set (Hinton et al., '
            '"Distilling the Knowledge in a Neural Network", arXiv 1503.02531).')
@register("kd", paper=PAPER_KD, options=KDOptions, uses_scores=False, mixed_widths=True, any_module=True, any_target=True)
def fuse_kd(models, *, fusion_inputs, scores, weights, device, seed, options: KDOptions, info: dict,
            target: nn.Module | None = None) -> nn.Module:
    """Multi-teacher knowledge distillation on the fusion set: the student (model 0's copy or
    a fresh initialisation of its architecture) learns the teachers' weighted mean softmax at τ.
    Teachers may have any architecture. With ``keep_best`` (default) the student ends at its best state on
    the fusion-set KL, its start included, so it is never worse there than model 0 (``student="model0"``).
    Fixed point: copies of one model (any weights) make model 0 the optimum, and it is returned unchanged.
    ``target`` (``fuse(..., target=)``): the student is that freshly initialised architecture instead."""
    o = options
    teachers = [copy.deepcopy(m).to(device).eval() for m in models]
    st = (target if target is not None else copy.deepcopy(models[0])).to(device)
    if o.student == "fresh" and target is None:
        for mod in st.modules():
            if hasattr(mod, "reset_parameters") and any(True for _ in mod.parameters(recurse=False)):
                mod.reset_parameters()
    x = _fusion_tensor("kd", fusion_inputs).to(device)
    x_sel = None
    if o.holdout > 0:
        if x.shape[0] < 2:
            raise MissingInputError("kd: holdout needs a fusion set of at least 2 samples")
        x, x_sel = holdout_split(x, o.holdout, seed)
    _distill(st, st, list(st.parameters()), x, lambda xb: teacher_probs(teachers, xb, weights, o.temperature),
             epochs=o.epochs, lr=o.lr, weight_decay=o.weight_decay, optimizer=o.optimizer, batch_size=o.batch_size,
             temperature=o.temperature, seed=seed, device=device, aug=o.augmentation, noise=o.noise, info=info,
             keep_best=o.keep_best, select_inputs=x_sel, patience=o.patience)
    return st.eval()


PAPER_LP = ("Linear probing: model 0's classifier refit on the fusion set against the ensemble's averaged softmax.")
@register("lp", paper=PAPER_LP, options=LPOptions, uses_scores=False, mixed_widths=True)
def fuse_lp(models, *, fusion_inputs, scores, weights, device, seed, options: LPOptions, info: dict) -> nn.Module:
    """Linear probing: refit only model 0's classifier level against the ensemble's averaged softmax.

    The classifier level's inputs (model 0's penultimate features ``[B, ...]``) are computed once; only
    the parameters of ``levels(model)[-1]`` train (KL, τ = 1 by default). Teachers may have
    any architecture; model 0 must be a ``fedfuse.models`` family (its levels are needed). With ``keep_best``
    (default) the head ends at its best state on the fusion-set KL, the start included: copies of one model
    give that model back unchanged (fixed point).
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
             info=info, keep_best=o.keep_best)
    for p in st.parameters():
        p.requires_grad_(True)
    return st.eval()


__all__ = ["fuse_kd", "fuse_lp", "teacher_probs", "augment", "AUGMENTATIONS", "holdout_split", "DistillOptions", "KDOptions", "LPOptions"]
