"""Post-fusion refinement on the server's unlabeled fusion set: head calibration and ensemble distillation.

A fused (or averaged) model can be refined with what the server has: the client models (teachers) and an
unlabeled fusion set ``X [B, *input]``. Two steps, usable after any method (``fuse(..., refine=...)``,
the strategies' ``refine`` option):

- ``calibrate``: label-shift correction of the classifier's bias. The mean predicted class distribution
  of the model on ``X`` is moved to a target prior ``π`` (the federation's class frequencies, from the
  summed client class counts, or uniform) by the fixed-point iteration ``b ← b + log π − log q̄(b)`` with
  ``q̄(b) = mean_x softmax(f(x) + b)``. This is the prior-adjustment of Saerens, Latinne & Decaestecker,
  "Adjusting the Outputs of a Classifier to New a Priori Probabilities: A Simple Procedure" (Neural
  Computation 2002) with a known target prior, i.e. the logit adjustment of Menon et al., "Long-tail
  learning via logit adjustment" (arXiv 2007.07314) estimated on unlabeled data. Why it matters in FL:
  under label skew every client pushes the logits of the classes it does not hold down, so the average's
  classifier bias encodes a prior that no client and no test set has (see the multi-round section of
  ``simulations/README.md``). Only the classifier bias changes; the features are untouched.
- ``distill``: FedDF's server step (Lin et al., "Ensemble Distillation for Robust Model Fusion in
  Federated Learning", arXiv 2006.07242): the model (the student,
  initialised from the fused model) learns the teachers' weighted mean softmax on ``X`` with Adam,
  early-stopped on a held-out part of ``X`` by the KL to the ensemble. The best state *including the
  start* is kept, so distillation never returns a student that agrees less with the ensemble on the
  held-out part than the fused model did (and returns the fused model itself when the teachers agree
  with it: fixed point).

Both need only unlabeled inputs; neither modifies the teachers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.distillation import AUGMENTATIONS, _distill, holdout_split, teacher_probs
from fedfuse.fusion.registry import IncompatibleModelsError, MissingInputError, require
from fedfuse.models import levels
from fedfuse.training import predict_logits

REFINE_STEPS = ("calibrate", "distill")


def parse_refine(refine: str | None | tuple | list) -> tuple[str, ...]:
    """``"calibrate+distill"`` / ``"none"`` / ``None`` / a sequence → the tuple of steps, in order.

    Raises ``ValueError`` naming an unknown step.
    """
    if refine is None:
        return ()
    parts = [p.strip() for p in (refine.replace(",", "+").split("+") if isinstance(refine, str) else refine)]
    parts = [p for p in parts if p and p != "none"]
    for p in parts:
        if p not in REFINE_STEPS:
            import difflib

            close = difflib.get_close_matches(p, REFINE_STEPS, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"refine: unknown step {p!r}{hint}; use 'none' or steps of {REFINE_STEPS} joined by '+'")
    if len(set(parts)) != len(parts):
        raise ValueError(f"refine: a step is repeated in {refine!r}")
    return tuple(parts)


def classifier_bias(model: nn.Module) -> torch.nn.Parameter:
    """The bias ``[classes]`` of the model's classifier level (its adapter's last level).

    Raises ``IncompatibleModelsError`` when the classifier has no bias (nothing to calibrate).
    """
    head = levels(model)[-1]
    named = dict(model.named_parameters())
    biases = [named[n] for n in head.param_names if n.endswith("bias") and named[n].dim() == 1]
    if not biases:
        raise IncompatibleModelsError(f"calibrate: the classifier level {head.name!r} of {type(model).__name__} "
                                      "has no bias to calibrate")
    return biases[-1]


@torch.no_grad()
def calibrate_head(model: nn.Module, fusion_inputs: torch.Tensor, prior: torch.Tensor | None = None, *,
                   iters: int = 20, tol: float = 1e-4, min_gap: float = 0.0,
                   device: torch.device | str = "cpu") -> dict:
    """Shift the classifier bias so that the model's mean softmax on ``fusion_inputs`` equals ``prior``.

    Args:
        model: a ``fedfuse.models`` model (changed in place; eval mode).
        fusion_inputs: ``[B, *input]`` unlabeled inputs.
        prior: ``[classes]`` target class distribution (normalised here; zeros are floored at 1e-4 of the
            mass so a class no client holds keeps a finite bias); ``None`` = uniform.
        iters: at most this many fixed-point steps ``b ← b + log π − log q̄`` (each one forward pass of
            the frozen features, computed once: only the bias changes).
        tol: stop when ``max |log π − log q̄| < tol``.
        min_gap: leave the model unchanged when the gap before calibrating (max |q̄ − π|) is below this
            (``calibration-skipped`` = 1 in the result): small gaps are within what local training moves anyway.

    Returns ``{"calibration-shift": max |Δb|, "calibration-gap-before": ..., "calibration-gap-after": ...}``
    (gap = max absolute difference between the mean softmax and the prior).
    """
    if fusion_inputs is None or len(fusion_inputs) == 0:
        raise MissingInputError("calibrate needs fusion_inputs (a non-empty unlabeled fusion set)")
    model.eval()
    bias = classifier_bias(model)
    x = torch.as_tensor(fusion_inputs).float()
    z = predict_logits(model, x, device=device) - bias.detach().cpu()  # bias-free logits [B, C]: features fixed
    classes = z.shape[1]
    pi = torch.full((classes,), 1.0 / classes) if prior is None else \
        torch.as_tensor(prior, dtype=torch.float).flatten().cpu()
    if pi.numel() != classes or not bool(torch.isfinite(pi).all()) or bool((pi < 0).any()) or float(pi.sum()) <= 0:
        raise ValueError(f"calibrate: prior must be {classes} non-negative finite numbers, got {pi.tolist()}")
    pi = pi / pi.sum()
    pi = (pi + 1e-4) / (1 + 1e-4 * classes)
    b0 = bias.detach().cpu().clone()  # the iteration runs on CPU with the logits
    b = b0.clone()
    gap0 = float((torch.softmax(z + b, -1).mean(0) - pi).abs().max())
    if gap0 < min_gap:
        return {"calibration-shift": 0.0, "calibration-gap-before": gap0, "calibration-gap-after": gap0,
                "calibration-skipped": 1}
    for _ in range(iters):
        q = torch.softmax(z + b, -1).mean(0)
        step = pi.log() - q.clamp_min(1e-12).log()
        b = b + step
        if float(step.abs().max()) < tol:
            break
    b = b - (b - b0).mean()  # softmax is shift-invariant: keep the bias's mean where it was
    bias.copy_(b)
    gap1 = float((torch.softmax(z + b, -1).mean(0) - pi).abs().max())
    return {"calibration-shift": float((b - b0).abs().max()), "calibration-gap-before": gap0,
            "calibration-gap-after": gap1}


@dataclass(frozen=True)
class DistillRefineOptions:
    """Options of the ``distill`` refinement (FedDF's server step).

    Attributes:
        epochs: at most this many passes over the training part of the fusion set.
        lr: Adam learning rate (FedDF: 1e-3).
        batch_size: fusion samples per step.
        temperature: softmax temperature of teachers and student (loss scaled by τ²).
        holdout: fraction of the fusion set held out for early stopping (KL to the ensemble).
        patience: stop after this many epochs without a better held-out KL.
        augmentation: ``"none"`` | ``"mixup"`` (random pairs of fusion inputs mixed, λ ~ U(0, 1), the teachers
            asked again on the mixed batch) | ``"noise"``; the held-out KL that selects the state is always measured
            on the clean inputs. Mixup with τ 4 is what ``mode='one-shot'`` distils with (``fedfuse.plan``).
    """

    epochs: int = 50
    lr: float = 1e-3
    batch_size: int = 32
    temperature: float = 1.0
    holdout: float = 0.2
    patience: int = 5
    augmentation: Literal["none", "noise", "mixup"] = "none"

    def __post_init__(self) -> None:
        require(self.epochs >= 0, "epochs", ">= 0", self.epochs)
        require(self.lr > 0, "lr", "> 0", self.lr)
        require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)
        require(self.temperature > 0, "temperature", "> 0", self.temperature)
        require(0 < self.holdout < 1, "holdout", "in (0, 1)", self.holdout)
        require(self.patience >= 1, "patience", ">= 1", self.patience)
        require(self.augmentation in AUGMENTATIONS, "augmentation", f"one of {AUGMENTATIONS}", self.augmentation)


def kl_to(probs: torch.Tensor, logits: torch.Tensor, temperature: float = 1.0) -> float:
    """Mean ``KL(probs ‖ softmax(logits / τ))`` over the batch (``[B, C]`` each)."""
    return float(F.kl_div(F.log_softmax(logits / temperature, -1), probs, reduction="batchmean"))


def distill_ensemble(student: nn.Module, teachers: list[nn.Module], weights: list[float],
                     fusion_inputs: torch.Tensor, options: DistillRefineOptions = DistillRefineOptions(), *,
                     seed: int = 0, device: torch.device | str = "cpu") -> dict:
    """Distil the teachers' weighted softmax into ``student`` (in place) on ``fusion_inputs [B, *input]``.

    The fusion set is split (seeded) into a training part and a held-out part (``options.holdout``);
    after every epoch the held-out KL to the ensemble is measured and the best state, the initial one
    included, is kept; training stops after ``patience`` epochs without improvement. Eval mode throughout
    (BatchNorm statistics are not changed by the server's small set).

    Returns ``{"distill-epochs": run, "distill-best-epoch": 0 = start kept, "distill-kl-start": ...,
    "distill-kl-best": ...}``.
    """
    if fusion_inputs is None or len(fusion_inputs) < 2:
        raise MissingInputError("distill needs fusion_inputs (an unlabeled fusion set of at least 2 samples)")
    o = options
    device = torch.device(device)
    x = torch.as_tensor(fusion_inputs).float().to(device)
    student.to(device).eval()
    teachers = [t.to(device).eval() for t in teachers]
    x_tr, x_val = holdout_split(x, o.holdout, seed)
    # the distillation loop of kd/lp, selecting the state (start included) on the held-out part
    run: dict = {}
    _distill(student, student, list(student.parameters()), x_tr,
             lambda xb: teacher_probs(teachers, xb, weights, o.temperature), epochs=o.epochs, lr=o.lr,
             weight_decay=0.0, optimizer="adam", batch_size=o.batch_size, temperature=o.temperature, seed=seed,
             device=device, aug=o.augmentation, info=run, keep_best=True, select_inputs=x_val, patience=o.patience)
    student.eval()
    return {"distill-epochs": run["epochs_run"], "distill-best-epoch": run["best_epoch"],
            "distill-kl-start": run["initial_loss"], "distill-kl-best": run["best_loss"]}


def refine_model(model: nn.Module, steps: tuple[str, ...], *, teachers: list[nn.Module] | None,
                 weights: list[float] | None, fusion_inputs: torch.Tensor | None, prior: torch.Tensor | None = None,
                 distill_options: DistillRefineOptions = DistillRefineOptions(), seed: int = 0,
                 calibrate_min_gap: float = 0.0, device: torch.device | str = "cpu") -> dict:
    """Apply ``steps`` (``parse_refine``) to ``model`` in place, in order; returns their diagnostics.

    ``distill`` needs ``teachers`` (and ``weights``, uniform when ``None``); ``calibrate`` uses ``prior``
    (uniform when ``None``). Calibrating after distilling keeps the prior correction the ensemble would
    otherwise pull back.
    """
    info: dict = {}
    for step in steps:
        if step == "calibrate":
            info.update(calibrate_head(model, fusion_inputs, prior, min_gap=calibrate_min_gap, device=device))
        elif step == "distill":
            if not teachers:
                raise MissingInputError("refine 'distill' needs the client models as teachers")
            w = weights if weights is not None else [1.0 / len(teachers)] * len(teachers)
            info.update(distill_ensemble(model, teachers, w, fusion_inputs, distill_options, seed=seed,
                                         device=device))
    return info


__all__ = ["REFINE_STEPS", "parse_refine", "calibrate_head", "classifier_bias", "distill_ensemble",
           "DistillRefineOptions", "kl_to", "refine_model"]
