"""Fusion levels: the ordered blocks of a model whose output neurons are matched.

The Neuron Interpolation paper (seed 001, spec ``neuron-interpolation.md`` §1.1, §2.4) writes a model
as ``f = f^L ∘ … ∘ f^1``; each ``f^l`` is a *level*. ``levels(model)`` returns that decomposition with
stable names, output widths and a ``run`` callable per level so that fusion code can feed a level the
output of the (fused) previous level:

    h = x
    for lv in levels(model):
        h = lv.run(h)          # h == model(x) after the last level

Supported: plain ``nn.Sequential`` stacks of Linear/Conv(+BatchNorm) layers and parameter-free ops
(fedfuse's ``mlp`` and ``cnn`` are such stacks), fedfuse's ``ResNet`` and any timm
``VisionTransformer`` (built by fedfuse or not).

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

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

AFFINE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


@dataclass
class Level:
    """One fusion level of a model.

    Attributes:
        name: stable name (module path of the level's output module, or of its block).
        width: number of neurons (output features / channels / embedding dims).
        kind: ``"affine"`` | ``"block"`` | ``"classifier"``.
        layout: ``"flat"`` | ``"channels"`` | ``"tokens"``.
        module: module whose forward output *is* the level output (hook and captum target).
        run: maps the previous level's output (model input for level 0) to this level's output.
        param_names: names (as in ``model.named_parameters()``) of the parameters this level owns.
        layer: for affine levels, the Linear/Conv whose output neurons are the level's neurons.
        norm: for affine levels, the BatchNorm right after ``layer`` (or ``None``).
        pre: for affine levels, the parameter-free ops applied to the previous output before ``layer``.
        post: parameter-free ops after ``layer``/``norm`` that still belong to this level (trailing
            ops of the last level only; identity otherwise).
    """

    name: str
    width: int
    kind: str
    layout: str
    module: nn.Module
    run: Callable[[torch.Tensor], torch.Tensor]
    param_names: list[str] = field(default_factory=list)
    layer: nn.Module | None = None
    norm: nn.Module | None = None
    pre: Callable[[torch.Tensor], torch.Tensor] | None = None
    post: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def affine(self) -> bool:
        """True when the level is ``norm(layer(pre(h)))`` with parameter-free ``pre``/``post``."""
        return self.layer is not None


def _compose(fns: list[Callable]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(h: torch.Tensor) -> torch.Tensor:
        for fn in fns:
            h = fn(h)
        return h
    return run


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=True))


def _layout_of(layer: nn.Module) -> str:
    return "flat" if isinstance(layer, nn.Linear) else "channels"


def _sequential_levels(model: nn.Sequential, prefix: str = "") -> list[Level]:
    """Split a flat ``nn.Sequential`` at every Linear/Conv layer (BatchNorm joins its layer)."""
    children = list(model.named_children())
    out: list[Level] = []
    pending: list[nn.Module] = []  # parameter-free ops waiting for the next affine layer
    i = 0
    while i < len(children):
        name, m = children[i]
        if isinstance(m, AFFINE_LAYERS):
            layer, layer_name = m, name
            norm, out_name, out_mod = None, name, m
            if i + 1 < len(children) and isinstance(children[i + 1][1], BATCHNORMS):
                out_name, norm = children[i + 1]
                out_mod = norm
                i += 1
            params = [f"{prefix}{layer_name}.{p}" for p, _ in layer.named_parameters()]
            if norm is not None:
                params += [f"{prefix}{out_name}.{p}" for p, _ in norm.named_parameters()]
            pre = _compose(list(pending))
            fns = [pre, layer] + ([norm] if norm is not None else [])
            width = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
            out.append(Level(name=f"{prefix}{out_name}", width=width, kind="affine", layout=_layout_of(layer),
                             module=out_mod, run=_compose(fns), param_names=params, layer=layer, norm=norm,
                             pre=pre))
            pending = []
        elif _has_params(m):
            raise ValueError(f"levels: unsupported parameterised module {prefix}{name} ({type(m).__name__}) "
                             "in nn.Sequential; only Linear/Conv1d/Conv2d (+BatchNorm) carry parameters")
        else:
            pending.append(m)
        i += 1
    if not out:
        raise ValueError("levels: nn.Sequential has no Linear/Conv layer")
    last = out[-1]
    last.kind = "classifier"
    if pending:  # trailing parameter-free ops (e.g. a final Softmax) stay part of the classifier level
        post = _compose(list(pending))
        inner = last.run
        last.post = post
        last.run = lambda h, inner=inner, post=post: post(inner(h))
    return out


def _resnet_levels(model: nn.Module) -> list[Level]:
    out = [Level(name="stem", width=model.stem[0].out_channels, kind="block", layout="channels", module=model.stem,
                 run=model.stem, param_names=[f"stem.{p}" for p, _ in model.stem.named_parameters()])]
    for i, block in enumerate(model.blocks):
        out.append(Level(name=f"blocks.{i}", width=block.conv2.out_channels, kind="block", layout="channels",
                         module=block, run=block,
                         param_names=[f"blocks.{i}.{p}" for p, _ in block.named_parameters()]))
    pre = _compose([model.pool, lambda h: torch.flatten(h, 1)])
    out.append(Level(name="fc", width=model.fc.out_features, kind="classifier", layout="flat", module=model.fc,
                     run=model.forward_head, param_names=[f"fc.{p}" for p, _ in model.fc.named_parameters()],
                     layer=model.fc, pre=pre))
    return out


def _vit_levels(model: nn.Module) -> list[Level]:
    from fedfuse.models.vit import vit_embed, vit_head  # local import: timm is heavy

    blocks = list(model.blocks)
    if not blocks:
        raise ValueError("levels: timm VisionTransformer with depth 0 has no levels")
    named = dict(model.named_parameters())
    embed_params = [n for n in named if not n.startswith(("blocks.", "norm.", "fc_norm.", "head.", "attn_pool."))]
    out: list[Level] = []
    for i, block in enumerate(blocks):
        params = [n for n in named if n.startswith(f"blocks.{i}.")]
        if i == 0:
            run = (lambda x, b=block: b(vit_embed(model, x)))
            params = embed_params + params
        else:
            run = block
        out.append(Level(name=f"blocks.{i}", width=model.embed_dim, kind="block", layout="tokens", module=block,
                         run=run, param_names=params))
    head_params = [n for n in named if n.startswith(("norm.", "fc_norm.", "head.", "attn_pool."))]
    out.append(Level(name="head", width=model.num_classes, kind="classifier", layout="flat", module=model.head,
                     run=lambda h: vit_head(model, h), param_names=head_params))
    return out


def model_family(model: nn.Module) -> str:
    """``"sequential"`` | ``"resnet"`` | ``"vit"``: the architecture families fusion code decomposes.

    Raises ``ValueError`` for any other model type.
    """
    from fedfuse.models.resnet import ResNet

    if isinstance(model, nn.Sequential):
        return "sequential"
    if isinstance(model, ResNet):
        return "resnet"
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:  # pragma: no cover - timm is a hard dependency
        VisionTransformer = ()  # type: ignore[assignment]
    if isinstance(model, VisionTransformer):
        return "vit"
    raise ValueError(f"unsupported model type {type(model).__name__}; expected nn.Sequential, "
                     "fedfuse ResNet or timm VisionTransformer")


def levels(model: nn.Module) -> list[Level]:
    """The ordered fusion levels of ``model``; the last one is the classifier.

    Raises ``ValueError`` for architectures it cannot decompose.
    """
    try:
        family = model_family(model)
    except ValueError as exc:
        raise ValueError(f"levels: {exc}") from None
    return {"sequential": _sequential_levels, "resnet": _resnet_levels, "vit": _vit_levels}[family](model)


def level_outputs(model: nn.Module, x: torch.Tensor, upto: int | None = None) -> list[torch.Tensor]:
    """Outputs of levels ``0..upto`` (all when ``None``) for input ``x`` ``[N, *input_shape]``.

    Token Fusion, if applied to a ViT, is suspended: level outputs of different models must have the
    same token count to be matched.
    """
    if getattr(model, "_tofu_state", None) is not None:
        from fedfuse.tofu import suspended

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
