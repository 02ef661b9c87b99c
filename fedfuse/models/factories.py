"""The model families' factory functions by name, and a seeded build of one (timm-style: one table, small entry
points). ``fedfuse.models.build_model`` adds capacity tiers (``width_mult``) on top through the family's adapter;
the adapters build their family at another size through ``build`` here, so the two never import each other.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fedfuse.models.cnn import cnn
from fedfuse.models.lenet import lenet
from fedfuse.models.mlp import mlp
from fedfuse.models.resnet import resnet
from fedfuse.models.zoo import build_zoo, is_zoo_name


def _vit(**kw) -> nn.Module:
    from fedfuse.models.vit import vit  # deferred: timm, imported only when a ViT is asked for

    return vit(**kw)


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "cnn": cnn, "lenet": lenet, "resnet": resnet, "vit": _vit}


def build(name: str, num_classes: int, input_shape: tuple[int, ...], seed: int = 0, **kw) -> nn.Module:
    """``MODELS[name](num_classes=..., input_shape=..., **kw)`` initialised from ``seed``; the global torch RNG is
    left untouched. ``ValueError`` names an unknown ``name``.

    ``name`` ``torchvision:<builder>`` / ``timm:<model>``: that zoo model, randomly initialised and fitted to
    ``input_shape`` (``fedfuse.models.zoo.build_zoo``); it takes no options (its size is its own)."""
    zoo = is_zoo_name(name)
    if not zoo and name not in MODELS:
        raise ValueError(f"model: unknown model {name!r}; choose one of {sorted(MODELS)} or 'torchvision:<name>' / "
                         "'timm:<name>'")
    if zoo and kw:
        raise ValueError(f"model: zoo model {name!r} has its own size and takes no options, got {sorted(kw)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if zoo:
            return build_zoo(name, num_classes, tuple(input_shape))
        return MODELS[name](num_classes=num_classes, input_shape=tuple(input_shape), **kw)
