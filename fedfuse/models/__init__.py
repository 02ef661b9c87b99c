"""Model registry (timm-style factory functions), architecture adapters and fusion-level decomposition.

    model = build_model("mlp", num_classes=10, input_shape=(1, 8, 8), width=64, depth=2, seed=0)
    lv = levels(model)
    adapter_for(model).resize(model, width=32)     # the same family at another width/depth
    build_model("mlp", ..., width_mult=0.5)        # a capacity tier: every hidden width halved
    build_model("torchvision:resnet18", num_classes=10, input_shape=(1, 28, 28))   # a zoo model (fedfuse.models.zoo)
    build_model("timm:convnext_atto", num_classes=10, input_shape=(3, 32, 32))
"""

from __future__ import annotations

from torch import nn

from fedfuse.models.adapters import (ADAPTERS, Adapter, ModelConfig, UnsupportedModelError, adapter_for,
                                     check_width_mult, model_family, register_adapter, set_example_input)
from fedfuse.models.cnn import cnn
from fedfuse.models.factories import MODELS, build
from fedfuse.models.lenet import lenet
from fedfuse.models.levels import Level, level_outputs, levels, neuron_axis_sum, neurons_last, neurons_restore
from fedfuse.models.mlp import mlp
from fedfuse.models.resnet import ResNet, resnet
from fedfuse.models.zoo import Resized, is_zoo_name


def build_model(name: str, num_classes: int = 10, input_shape: tuple[int, ...] = (1, 8, 8), width: int | None = None,
                depth: int | None = None, seed: int = 0, width_mult: float | None = None, **options) -> nn.Module:
    """Build a registered model with deterministic initialisation for ``seed``.

    ``input_shape`` is ``(features,)`` for flat inputs, ``(C, L)`` for 1-D signals, ``(C, H, W)`` for
    images. ``width``/``depth`` default to each family's CPU-size setting. Extra ``options`` go to the
    factory (e.g. ``batchnorm=True`` for cnn, ``norm="group"`` for resnet, ``num_heads`` for vit).
    ``width_mult`` (> 0; ``None`` = 1): a capacity tier of that model, every hidden width scaled by the
    family's adapter (``Adapter.at_width_mult``: MLP hidden units, CNN/ResNet channels, ViT embedding width
    with heads and MLP width, head dim kept; ``ceil`` rounding, so a tier of ``width_mult`` is nested in the
    full model). The global torch RNG is left untouched.

    ``name`` ``'torchvision:<builder>'`` / ``'timm:<model>'``: that zoo model, randomly initialised (never pretrained
    weights), ``num_classes`` logits, its input fitted to ``input_shape`` (``fedfuse.models.zoo``: the input
    channels, and images below 32x32 upsampled by a parameter-free ``Resized`` wrapper; timm ViTs built for the
    image size with 4-pixel patches). Zoo models have their own size: ``width``/``depth`` must be ``None`` or 0,
    ``width_mult`` ``None`` or 1, no ``options`` (``ValueError`` naming them).
    """
    if width_mult is not None:
        check_width_mult(width_mult, "model: width_mult")
    kw = dict(options)
    if is_zoo_name(name):
        if width or depth:
            raise ValueError(f"model: zoo model {name!r} has its own size; width/depth (model-width/model-depth) "
                             f"scale fedfuse's own models only, got width={width}, depth={depth}")
        if width_mult not in (None, 1):
            raise ValueError(f"model: zoo model {name!r} has no capacity tiers (width_mult {width_mult})")
        width = depth = width_mult = None
    if width is not None:
        kw["width"] = width
    if depth is not None:
        kw["depth"] = depth
    model = build(name, num_classes, input_shape, seed=seed, **kw)
    if width_mult is None or width_mult == 1:
        return model
    return adapter_for(model).at_width_mult(model, width_mult, seed=seed, input_shape=tuple(input_shape))


__all__ = ["MODELS", "build_model", "levels", "Level", "level_outputs", "neurons_last", "neurons_restore",
           "neuron_axis_sum", "mlp", "cnn", "lenet", "resnet", "ResNet", "Resized", "is_zoo_name", "ADAPTERS", "Adapter", "ModelConfig",
           "UnsupportedModelError", "adapter_for", "model_family", "register_adapter", "check_width_mult",
           "set_example_input"]
