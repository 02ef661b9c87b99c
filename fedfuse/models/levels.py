"""Fusion levels: the ordered blocks of a model whose output neurons are matched.

The Neuron Interpolation paper ("Model Fusion via Neuron Interpolation", arXiv 2507.00037) writes a model
as ``f = f^L ∘ … ∘ f^1``; each ``f^l`` is a *level*. ``levels(model)`` returns that decomposition with
stable names, output widths and a ``run`` callable per level so that fusion code can feed a level the
output of the (fused) previous level:

    h = x
    for lv in levels(model):
        h = lv.run(h)          # h == model(x) after the last level

Supported: plain ``nn.Sequential`` stacks of Linear/Conv(+BatchNorm) layers and parameter-free ops
(fedfuse's ``mlp`` and ``cnn`` are such stacks), fedfuse's ``ResNet`` and any timm
``VisionTransformer`` (built by fedfuse or not); each family's decomposition lives in its adapter
(``fedfuse.models.adapters``).

Level kinds:
- ``"affine"``: ``layer(pre(h))`` optionally followed by an eval-mode BatchNorm ``norm``; the level
  output is the pre-activation (the activation is part of the next level's ``pre``).
- ``"block"``: any differentiable block (residual block, transformer block, ResNet stem).
- ``"classifier"``: the last level; output logits ``[N, num_classes]``. It is also affine when
  ``layer`` is set.

Layouts say where the neurons sit in a level's output: ``"flat"`` ``[N, W]``, ``"channels"``
``[N, W, *spatial]``, ``"tokens"`` ``[N, T, W]``.
"""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.models.adapters import AFFINE_LAYERS, BATCHNORMS, Level, adapter_for, model_family
from fedfuse.tofu import suspended


def levels(model: nn.Module) -> list[Level]:
    """The ordered fusion levels of ``model`` (from its family's adapter); the last one is the classifier.

    Raises ``ValueError`` (``UnsupportedModelError``) for architectures it cannot decompose.
    """
    try:
        adapter = adapter_for(model)
    except ValueError as exc:
        raise type(exc)(f"levels: {exc}") from None
    return adapter.levels(model)


def level_outputs(model: nn.Module, x: torch.Tensor, upto: int | None = None) -> list[torch.Tensor]:
    """Outputs of levels ``0..upto`` (all when ``None``) for input ``x`` ``[N, *input_shape]``.

    Token Fusion, if applied to a ViT, is suspended: level outputs of different models must have the
    same token count to be matched.
    """
    if getattr(model, "_tofu_state", None) is not None:
        with suspended(model):
            return _level_outputs(model, x, upto)
    return _level_outputs(model, x, upto)


def _level_outputs(model: nn.Module, x: torch.Tensor, upto: int | None) -> list[torch.Tensor]:
    outs = []
    h = x
    for i, lv in enumerate(levels(model)):
        h = lv.run(h)
        outs.append(h)
        if upto is not None and i >= upto:
            break
    return outs


def neurons_last(h: torch.Tensor, layout: str) -> torch.Tensor:
    """Reshape a level output so neurons are the last axis: ``[N*P, W]`` (P = positions or tokens)."""
    if layout == "flat":
        return h.reshape(h.shape[0], -1)
    if layout == "channels":
        return h.movedim(1, -1).reshape(-1, h.shape[1])
    if layout == "tokens":
        return h.reshape(-1, h.shape[-1])
    raise ValueError(f"unknown layout {layout!r}")


def neurons_restore(z: torch.Tensor, layout: str, like: torch.Tensor) -> torch.Tensor:
    """Inverse of ``neurons_last``: ``[N*P, W']`` back to ``like``'s layout with ``W'`` neurons."""
    w = z.shape[-1]
    if layout == "flat":
        return z.reshape(like.shape[0], w)
    if layout == "channels":
        shape = (like.shape[0], *like.shape[2:], w)
        return z.reshape(shape).movedim(-1, 1)
    if layout == "tokens":
        return z.reshape(*like.shape[:-1], w)
    raise ValueError(f"unknown layout {layout!r}")


def neuron_axis_sum(a: torch.Tensor, layout: str) -> torch.Tensor:
    """Sum of a level-shaped tensor over everything but samples and neurons: ``[N, W]``."""
    if layout == "flat":
        return a.reshape(a.shape[0], -1)
    if layout == "channels":
        return a.reshape(a.shape[0], a.shape[1], -1).sum(-1)
    if layout == "tokens":
        return a.sum(1)
    raise ValueError(f"unknown layout {layout!r}")


__all__ = ["Level", "levels", "level_outputs", "neurons_last", "neurons_restore", "neuron_axis_sum", "model_family",
           "AFFINE_LAYERS", "BATCHNORMS"]
