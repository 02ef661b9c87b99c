"""Architecture adapters: one per model family, the only code that knows a family's layout.

    adapter = adapter_for(model)          # SequentialAdapter | ResNetAdapter | ViTAdapter | TorchvisionResNetAdapter
    adapter.levels(model)                 # fusion levels (NI)
    adapter.perm_spec(model, "tied")      # permutation groups (OT, Re-Basin, TransFusion)
    adapter.config(model); adapter.resize(model, width=..., depth=...)
    adapter.at_width_mult(model, 0.5)     # a capacity tier (heterogeneous clients)
    adapter.pruning_spec(model)           # what structured pruning must know (fedfuse.pruning)

``ADAPTERS`` maps family name → adapter, checked in order by ``adapter_for`` (timm-style registry;
``register_adapter`` adds a family).
"""

from __future__ import annotations

from torch import nn

from fedfuse.models.adapters.base import (AFFINE_LAYERS, BATCHNORMS, Adapter, Level, ModelConfig, PruningSpec,
                                          UnsupportedModelError, check_width_mult)
from fedfuse.models.adapters.permspec import Axis, Entry, Group, PermSpec
from fedfuse.models.adapters.graph import GraphAdapter, set_example_input
from fedfuse.models.adapters.resnet import ResNetAdapter
from fedfuse.models.adapters.sequential import SequentialAdapter
from fedfuse.models.adapters.torchvision_resnet import TorchvisionResNetAdapter
from fedfuse.models.adapters.vit import ViTAdapter

ADAPTERS: dict[str, Adapter] = {}


def register_adapter(adapter: Adapter) -> Adapter:
    """Add ``adapter`` under ``adapter.family`` (a family may be registered once)."""
    if not adapter.family:
        raise ValueError(f"register_adapter: {type(adapter).__name__} has no family name")
    if adapter.family in ADAPTERS:
        raise ValueError(f"register_adapter: family {adapter.family!r} is already registered")
    ADAPTERS[adapter.family] = adapter
    return adapter


# the generic reader comes last: it takes every model the hand-written families do not
for _adapter in (SequentialAdapter(), ResNetAdapter(), ViTAdapter(), TorchvisionResNetAdapter(), GraphAdapter()):
    register_adapter(_adapter)


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of ``model``'s family; ``UnsupportedModelError`` (a ``ValueError``) for other models."""
    # the generic reader (a fallback) last, also after families registered later
    for adapter in sorted(ADAPTERS.values(), key=lambda a: getattr(a, "fallback", False)):
        if adapter.matches(model):
            return adapter
    raise UnsupportedModelError(f"unsupported model type {type(model).__name__}; expected nn.Sequential, "
                                "fedfuse ResNet, torchvision ResNet or timm VisionTransformer")


def model_family(model: nn.Module) -> str:
    """``"sequential"`` | ``"resnet"`` | ``"vit"`` | ``"torchvision-resnet"`` | ``"graph"`` (any other ``nn.Module``:
    the generic structure reader, ``fedfuse.models.adapters.graph``)."""
    return adapter_for(model).family


__all__ = ["ADAPTERS", "Adapter", "AFFINE_LAYERS", "BATCHNORMS", "Level", "ModelConfig", "PruningSpec",
           "UnsupportedModelError",
           "PermSpec", "Group", "Axis", "Entry", "SequentialAdapter", "ResNetAdapter", "GraphAdapter", "set_example_input", "ViTAdapter", "TorchvisionResNetAdapter",
           "adapter_for", "model_family", "register_adapter",
           "check_width_mult"]
