"""Checks of what models output on the fusion set, before and after a fusion (``fuse_result`` runs them).

- **Non-finite outputs**: finite weights can still overflow (weights × 1e25); an input model that maps the fusion set
  to NaN or infinite logits cannot be learnt from or aligned to (``check_teacher_outputs`` raises
  ``NumericalFusionError`` naming it), and a fused model that does is an error of the fusion.
- **A collapsed fused model** (``collapse_warning``): the fused model predicts one class for (almost) every
  fusion-set input while the input models' ensemble spreads its predictions over the classes. Its weights and
  outputs are finite, so nothing else catches it, and it sits at chance level: multi-teacher distillation into a
  BatchNorm network trained in eval mode was seen to end there (``kd`` on torchvision ResNet-18 clients at
  Dirichlet α 0.1, ``docs/fashion-mnist.md``; its state kept on the fusion-set KL, which a near-uniform output can
  lower below a confidently wrong start). Label-free: only the models' own predictions are compared.

Both read at most ``OUTPUT_CHECK_SAMPLES`` fusion-set samples; the input models' predictions come from the same
forward passes as the non-finite checks of both, so the collapse check costs no extra pass.
"""

from __future__ import annotations


import torch
from torch import nn

from fedfuse.fusion.registry import NumericalFusionError, warn_caller

#: fusion-set samples on which the input models' and the fused model's logits are checked
OUTPUT_CHECK_SAMPLES = 1024
#: a fused model has collapsed when its most predicted class takes at least this share of the checked samples (the
#: share ``fedfuse.results.dead_model`` reads a dead global model by) ...
COLLAPSED_SHARE = 0.8
#: ... while the models' ensemble gives its most predicted class at most this share
SPREAD_SHARE = 0.5
#: fewer checked samples than this judge no collapse (a share of a handful of inputs says nothing)
MIN_COLLAPSE_SAMPLES = 20


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of floating-point ``t`` is finite: a finite sum proves it in one pass without a mask (a NaN
    or an infinity makes the sum non-finite); only a non-finite sum (or an overflowing one) checks entry by entry."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def outputs_on(model: nn.Module, inputs: torch.Tensor, batch_size: int = 256) -> tuple[int, torch.Tensor | None]:
    """``(bad, probs)`` of ``model`` on ``inputs[:OUTPUT_CHECK_SAMPLES]`` (eval mode, no gradients; the model's
    train/eval flags are restored): ``bad`` = how many samples map to logits with a NaN or an infinity, ``probs``
    = the softmax ``[n, C]`` on CPU (``None`` when the outputs are not ``[n, C ≥ 2]`` logits, or some are not finite)."""
    flags = [(mod, mod.training) for mod in model.modules()]
    first = next((t for t in model.state_dict().values() if t.is_floating_point()), None)
    x = inputs[:OUTPUT_CHECK_SAMPLES]
    if first is not None:
        x = x.to(device=first.device, dtype=first.dtype)
    bad, probs = 0, []
    try:
        model.eval()
        with torch.no_grad():
            for i in range(0, x.shape[0], batch_size):
                out = model(x[i:i + batch_size])
                if not isinstance(out, torch.Tensor):
                    probs = None
                    continue
                if not all_finite(out):
                    bad += int((~torch.isfinite(out.reshape(out.shape[0], -1))).any(1).sum())
                if probs is not None and out.dim() == 2 and out.shape[1] >= 2:
                    probs.append(out.float().softmax(-1).cpu())
                else:
                    probs = None
    finally:
        for mod, training in flags:
            mod.training = training
    return bad, (torch.cat(probs) if probs and not bad else None)


def nonfinite_outputs(model: nn.Module, inputs: torch.Tensor, batch_size: int = 256) -> int:
    """How many of ``inputs`` (at most ``OUTPUT_CHECK_SAMPLES``) ``model`` maps to logits with a NaN or an infinity
    (eval mode, no gradients; the model's train/eval flags are restored)."""
    return outputs_on(model, inputs, batch_size)[0]


def teacher_predictions(method: str, models: list[nn.Module], fusion_inputs: torch.Tensor,
                        weights: list[float] | None = None) -> torch.Tensor | None:
    """Every input model maps the fusion set to finite logits (``NumericalFusionError`` naming the model otherwise:
    ``kd`` would distil a NaN loss for every epoch and return model 0 unchanged, ``feddf`` return non-finite outputs,
    silently); returns the ``weights``-averaged softmax's class per checked sample ``[n]`` (``None`` when the models'
    outputs are not class logits)."""
    n = min(len(fusion_inputs), OUTPUT_CHECK_SAMPLES)
    w = weights if weights is not None else [1.0 / len(models)] * len(models)
    probs = []
    for i, m in enumerate(models):
        bad, p = outputs_on(m, fusion_inputs)
        if bad:
            raise NumericalFusionError(f"fuse: model {i} maps {bad} of {n} fusion-set samples to non-finite logits "
                                       f"(finite weights, overflowing outputs); method {method!r} cannot learn from "
                                       "or align to it")
        probs.append(p)
    if any(p is None for p in probs) or len({p.shape for p in probs}) != 1:
        return None   # not comparable class outputs: no prediction
    return sum(wi * p for wi, p in zip(w, probs)).argmax(1)


def check_teacher_outputs(method: str, models: list[nn.Module], fusion_inputs: torch.Tensor) -> None:
    """Every input model maps the fusion set to finite logits: ``NumericalFusionError`` naming the model otherwise."""
    teacher_predictions(method, models, fusion_inputs)


def collapse_reason(fused: torch.Tensor, ensemble: torch.Tensor, num_classes: int) -> str | None:
    """Why the fused model's predictions ``fused [n]`` have collapsed against the ensemble's ``ensemble [n]`` (the
    classes per fusion-set sample), or ``None``: its most predicted class takes ≥ ``COLLAPSED_SHARE`` of the samples
    while the ensemble's takes ≤ ``SPREAD_SHARE`` (so a fusion set of one class, or models that all predict one
    class, never count as a collapse)."""
    n = int(fused.numel())
    if n < MIN_COLLAPSE_SAMPLES or ensemble.numel() != n:
        return None
    counts = torch.bincount(fused, minlength=num_classes)
    top = int(counts.argmax())
    share = float(counts[top]) / n
    ens_counts = torch.bincount(ensemble, minlength=num_classes)
    ens_share = float(ens_counts.max()) / n
    if share < COLLAPSED_SHARE or ens_share > SPREAD_SHARE:
        return None
    return (f"the fused model predicts class {top} for {share:.0%} of {n} fusion-set samples, where the models' "
            f"ensemble predicts {int((ens_counts > 0).sum())} classes (its most frequent on {ens_share:.0%}): it has "
            "collapsed to one prediction and is likely at chance level")


def collapse_warning(method: str, probs: torch.Tensor | None, ensemble: torch.Tensor | None, info: dict) -> None:
    """When the fused model, whose softmax on the checked fusion-set samples is ``probs [n, C]`` (``outputs_on``),
    has collapsed (``collapse_reason``) against the ensemble's predictions ``ensemble [n]``: a ``RuntimeWarning``
    and ``info["collapse-warning"]`` (the round's record, a bench's row) saying so. Nothing when either is ``None``
    (no class predictions to compare)."""
    if ensemble is None or probs is None or probs.shape[0] != ensemble.numel():
        return
    reason = collapse_reason(probs.argmax(1), ensemble, probs.shape[1])
    if reason is not None:
        message = (f"fusion method {method!r}: {reason} (another method, or for one that trains a lower lr or more "
                   "epochs, may avoid it)")
        info["collapse-warning"] = message
        warn_caller(message, RuntimeWarning)


__all__ = ["OUTPUT_CHECK_SAMPLES", "all_finite", "outputs_on", "nonfinite_outputs", "teacher_predictions",
           "check_teacher_outputs", "collapse_reason", "collapse_warning"]
