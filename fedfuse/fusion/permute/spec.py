"""The permutation spec of a model (from its family's adapter) and the compatibility check of two specs.

The data types (``PermSpec``, ``Group``, ``Entry``, ``Axis``) and every family's spec builder live in
``fedfuse.models.adapters``; this module is the fusion-side entry point.
"""

from __future__ import annotations

from torch import nn

from fedfuse.fusion.registry import FusionOptionError, IncompatibleModelsError
from fedfuse.models.adapters import UnsupportedModelError, adapter_for
from fedfuse.models.adapters.permspec import Axis, Entry, Group, PermSpec

RESIDUALS = ("tied", "untied")


def build_spec(model: nn.Module, residual: str = "tied") -> PermSpec:
    """The :class:`PermSpec` of ``model`` (``nn.Sequential`` MLP/CNN, fedfuse ``ResNet``, timm ViT).

    ``residual`` applies to ViTs: ``"tied"`` (one stream group) or ``"untied"`` (one per position).
    Raises ``IncompatibleModelsError`` (a ``ValueError``) naming the unsupported part otherwise.
    """
    if residual not in RESIDUALS:
        raise FusionOptionError(f"permute: residual must be 'tied' or 'untied', got {residual!r}")
    try:
        adapter = adapter_for(model)
    except UnsupportedModelError as exc:
        raise IncompatibleModelsError(f"permute: {exc}") from None
    try:
        return adapter.perm_spec(model, residual)
    except UnsupportedModelError as exc:
        raise IncompatibleModelsError(str(exc)) from None


def block_paths(model: nn.Module) -> list[str]:
    """Paths of ``model``'s interchangeable residual blocks (its adapter's ``block_paths``; ``[]`` for a model
    no adapter describes or a family without such blocks). ``ot`` and selective OT use them to tell models
    of different depths apart and to block-match them."""
    try:
        return adapter_for(model).block_paths(model)
    except UnsupportedModelError:
        return []


def check_compatible(spec_a: PermSpec, spec_b: PermSpec, state_a: dict, state_b: dict,
                     same_width: bool = False) -> None:
    """Raise ``IncompatibleModelsError`` (a ``ValueError``) unless A can be mapped onto B (same family, tensors, group structure).

    Ungrouped axes (inputs, classes, kernels) must agree; group sizes may differ unless ``same_width``.
    """
    if spec_a.family != spec_b.family:
        raise IncompatibleModelsError(f"models are of different families ({spec_a.family} vs {spec_b.family})")
    if list(state_a) != list(state_b):
        missing = sorted(set(state_a) ^ set(state_b))[:4]
        raise IncompatibleModelsError(f"models have different parameter names (e.g. {missing}); depth or layout differs")
    if list(spec_a.groups) != list(spec_b.groups):
        raise IncompatibleModelsError("models have different layer structure (permutation groups differ)")
    for g, ga in spec_a.groups.items():
        gb = spec_b.groups[g]
        if same_width and ga.size != gb.size:
            raise IncompatibleModelsError(f"group {g} has width {ga.size} in one model and {gb.size} in the other; this method "
                             "needs equal widths (use method 'ot' for different widths)")
        if ga.blocks != gb.blocks and ga.kind == "attn":
            raise IncompatibleModelsError(f"{g}: {ga.blocks} heads vs {gb.blocks} heads")
    for k, ta in state_a.items():
        tb = state_b[k]
        e = spec_a.entries.get(k)
        grouped = set()
        if e is not None:
            if e.view is not None:
                continue  # checked when mapped (views fix the ungrouped sizes)
            grouped = {ax.axis for ax in e.axes}
        if ta.dim() != tb.dim():
            raise IncompatibleModelsError(f"{k}: rank {ta.dim()} vs {tb.dim()}")
        for ax in range(ta.dim()):
            if ax not in grouped and ta.shape[ax] != tb.shape[ax]:
                raise IncompatibleModelsError(f"{k}: axis {ax} has size {ta.shape[ax]} vs {tb.shape[ax]} and is not a neuron axis "
                                 "(inputs, classes and kernels must match)")
