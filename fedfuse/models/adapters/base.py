"""What every architecture adapter provides, and the pieces adapters share.

An adapter (one per architecture family: ``sequential`` MLP/CNN stacks, fedfuse ``ResNet``, timm
``VisionTransformer``) is the only place that knows how a family's modules are laid out. Fusion code
asks it for

- ``levels(model)``: the fusion levels (``fedfuse.models.levels``; Neuron Interpolation),
- ``perm_spec(model, residual)``: the permutation symmetries (``fedfuse.models.adapters.permspec``)
  that OT fusion, Git Re-Basin and TransFusion align,
- ``pre_logits(model, x)`` / ``classifier(model)`` / ``set_classifier(model, linear)``: the features
  before the class layer and the class layer itself,
- ``config(model)`` / ``build(config, seed)`` / ``resize(model, width, depth, seed)``: the model's
  width/depth description and the same family at another width/depth (heterogeneous clients, pruning),
- ``pruning_spec(model)`` / ``finish_pruning(model, num_heads)`` / ``blocks(model)`` / ``removable_blocks(model)`` /
  ``remove_blocks(model, indices)``: what structured pruning (``fedfuse.pruning``) must know about the
  family (classifier, attention heads, raw parameters, which layers the importance levels score) and how to
  keep the model consistent after Torch-Pruning cut its tensors or whole blocks were dropped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from fedfuse.models.factories import build

# the layers whose output neurons are fusion units, and the norms that may follow them (one definition)
AFFINE_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


class UnsupportedModelError(ValueError):
    """A model (or a part of it) that no adapter can describe; the message names the module and why."""


def check_width_mult(width_mult: float, what: str = "width_mult") -> float:
    """``width_mult`` as a float > 0 (a capacity tier's width multiplier); ``ValueError`` naming ``what``."""
    if isinstance(width_mult, bool) or not isinstance(width_mult, (int, float)) or not (
            math.isfinite(width_mult) and width_mult > 0):
        raise ValueError(f"{what} must be a number > 0 (a width multiplier such as 0.5), got {width_mult!r}")
    return float(width_mult)


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
        module_input: the level output is ``module``'s first *input*, not its output (the generic reader's
            levels whose value no module returns, e.g. ``F.relu(x + block(x))``, read where the next module
            takes it).
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
    module_input: bool = False

    @property
    def affine(self) -> bool:
        """True when the level is ``norm(layer(pre(h)))`` with parameter-free ``pre``/``post``."""
        return self.layer is not None


def compose(fns: list[Callable]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``h ↦ fns[-1](…fns[0](h))``."""
    def run(h: torch.Tensor) -> torch.Tensor:
        for fn in fns:
            h = fn(h)
        return h
    return run


def has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=True))


def is_identity(m: nn.Module | None) -> bool:
    return m is None or isinstance(m, nn.Identity)


@dataclass(frozen=True)
class ModelConfig:
    """What ``fedfuse.models.build_model`` needs to build a model of this shape.

    Attributes:
        family: ``"sequential"`` | ``"resnet"`` | ``"vit"``.
        name: the ``build_model`` name (``"mlp"``, ``"cnn"``, ``"resnet"``, ``"vit"``).
        num_classes: classifier outputs.
        input_shape: an input shape the model takes, ``(features,)``, ``(C, L)`` or ``(C, H, W)``. Read
            from the layers; where they do not fix it (the spatial size of a CNN), the smallest shape
            that gives the same layers.
        width: MLP hidden width, CNN/ResNet channels of the first stage, ViT embedding width.
        depth: MLP hidden layers, CNN/ResNet stages, ViT blocks.
        options: the factory's other keyword arguments (``batchnorm``, ``norm``, ``num_heads``, ...).
    """

    family: str
    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    width: int
    depth: int
    options: dict[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


@dataclass
class PruningSpec:
    """What structured pruning (``fedfuse.pruning``, Torch-Pruning's dependency graph) needs to know about a
    model; given by its family's adapter (``Adapter.pruning_spec``).

    Attributes:
        ignored: modules whose *output* units are never pruned (the classifier).
        num_heads: fused Q/K/V ``nn.Linear`` → number of heads (heads are pruning units; their output rows are
            ``[q | k | v]``, each head-major).
        attention_out: fused Q/K/V layer → the output projection whose *inputs* are the heads' outputs,
            head-major (``h · head_dim + d``); attention groups are ranked and cut from that side.
        unwrapped: raw ``nn.Parameter`` s outside prunable layers and the dimension holding their channels
            (a ViT's class token and position embedding: dim 2).
        score_levels: layer → name of the ``levels()`` level whose neurons are that layer's output units (so
            client importance scores, keyed by level name, can rank its channels).
    """

    ignored: list[nn.Module] = field(default_factory=list)
    num_heads: dict[nn.Module, int] = field(default_factory=dict)
    attention_out: dict[nn.Module, nn.Module] = field(default_factory=dict)
    unwrapped: list[tuple[nn.Parameter, int]] = field(default_factory=list)
    score_levels: dict[nn.Module, str] = field(default_factory=dict)


class Adapter:
    """Base class of the architecture adapters (see the module docstring); subclasses set ``family``."""

    family: str = ""
    # the importance criterion ``fedfuse.pruning``'s ``criterion="auto"`` uses for this family: the best
    # measured one (docs/measurements-fusion.md); "taylor" falls back to "magnitude" without fusion inputs
    pruning_criterion: str = "magnitude"

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` belongs to this family."""
        raise NotImplementedError

    # ---- structure views used by fusion code
    def levels(self, model: nn.Module) -> list[Level]:
        """Ordered fusion levels; the last is the classifier."""
        raise NotImplementedError

    def perm_spec(self, model: nn.Module, residual: str = "tied"):
        """The ``PermSpec`` (permutation groups and tensor axes) of ``model``."""
        raise NotImplementedError

    def pre_logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Features before the class layer: ``[N, *input_shape]`` → ``[N, d]``."""
        raise NotImplementedError

    def classifier(self, model: nn.Module) -> nn.Linear:
        """The class layer (``[N, d]`` → ``[N, num_classes]``)."""
        raise NotImplementedError

    def set_classifier(self, model: nn.Module, layer: nn.Linear) -> None:
        """Replace the class layer in place (its output count may change)."""
        raise NotImplementedError

    # ---- depth (selective OT fuses models of different depths: fedfuse.fusion.selective)
    def block_paths(self, model: nn.Module) -> list[str]:
        """Module paths of the model's repeated residual blocks, in forward order (families whose depth
        is a sequence of interchangeable blocks); ``UnsupportedModelError`` for the others."""
        raise UnsupportedModelError(f"{self.family!r} models have no interchangeable blocks; models of different "
                                    "depths cannot be block-matched")

    def with_blocks(self, model: nn.Module, indices: list[int]) -> nn.Module:
        """A view of ``model`` whose blocks are ``model``'s blocks ``indices`` (in that order; repeats allowed),
        **sharing** the module objects (no copy): its state dict names the chosen blocks by their new positions,
        and hooks registered on it fire when ``model`` itself runs. Families without blocks raise."""
        raise UnsupportedModelError(f"{self.family!r} models have no interchangeable blocks")

    # ---- the family at other sizes
    def config(self, model: nn.Module, input_shape: tuple[int, ...] | None = None) -> ModelConfig:
        """Width, depth and the other factory settings of ``model``; ``input_shape`` (when known) replaces
        the one read from the layers."""
        raise NotImplementedError

    def build(self, config: ModelConfig, seed: int = 0) -> nn.Module:
        """A freshly initialised model for ``config`` (``build_model`` with its fields)."""
        if config.family != self.family:
            raise UnsupportedModelError(f"{type(self).__name__}.build: config is for family {config.family!r}, "
                                        f"not {self.family!r}")
        return build(config.name, config.num_classes, config.input_shape, seed=seed, width=config.width,
                     depth=config.depth, **config.options)

    def resized_config(self, config: ModelConfig, width: int | None, depth: int | None) -> ModelConfig:
        """``config`` at another width/depth (families that scale more than one knob override this)."""
        return config.replace(width=config.width if width is None else int(width),
                              depth=config.depth if depth is None else int(depth))

    def scaled_width(self, config: ModelConfig, width_mult: float) -> int:
        """The width of ``config`` at multiplier ``width_mult``: ``ceil(width_mult · width)`` (HeteroFL's
        rule, "HeteroFL: Computation and Communication Efficient Federated Learning for Heterogeneous
        Clients", arXiv 2010.01264: the first ⌈r·C⌉ units). Families whose width has structure (ViT heads)
        override this."""
        return max(1, math.ceil(check_width_mult(width_mult) * config.width - 1e-9))

    def at_width_mult(self, model: nn.Module, width_mult: float, seed: int = 0,
                      input_shape: tuple[int, ...] | None = None) -> nn.Module:
        """A freshly initialised model of ``model``'s family at ``width_mult`` × its width (every hidden
        width of the family scales with it: MLP hidden units, CNN/ResNet channels of every stage, ViT
        embedding width with heads and MLP width; depth kept). ``width_mult=1`` rebuilds the same shapes."""
        cfg = self.config(model, input_shape)
        return self.build(self.resized_config(cfg, self.scaled_width(cfg, width_mult), None), seed=seed)

    def resize(self, model: nn.Module, width: int | None = None, depth: int | None = None, seed: int = 0,
               input_shape: tuple[int, ...] | None = None) -> nn.Module:
        """A freshly initialised model of ``model``'s family and settings at another ``width``/``depth``
        (``None`` keeps the current value). ``input_shape``: the inputs the model takes, where its layers do
        not fix them (a CNN's spatial size decides its pooling)."""
        for key, value in (("width", width), ("depth", depth)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"resize: {key} must be a positive int, got {value!r}")
        return self.build(self.resized_config(self.config(model, input_shape), width, depth), seed=seed)

    # ---- structured pruning (fedfuse.pruning)
    def pruning_spec(self, model: nn.Module) -> PruningSpec:
        """``PruningSpec`` of ``model``: by default only the classifier is protected and the affine levels'
        layers carry the level scores."""
        spec = PruningSpec(ignored=[self.classifier(model)])
        for lv in self.levels(model)[:-1]:
            if lv.layer is not None:
                spec.score_levels[lv.layer] = lv.name
        return spec

    def finish_pruning(self, model: nn.Module, num_heads: dict[nn.Module, int]) -> None:
        """Make ``model``'s own bookkeeping match its tensors after Torch-Pruning cut them (in place);
        ``num_heads``: the fused Q/K/V layers' head counts after pruning. Families whose modules store
        widths as attributes (timm attention) override this."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's residual blocks in forward order (``[]`` for families without them)."""
        return []

    def removable_blocks(self, model: nn.Module) -> list[int]:
        """Indices (in ``blocks(model)``) of the residual blocks whose removal equals skipping them (input and
        output of the same shape, identity shortcut); none for families without residual blocks."""
        return []

    def remove_blocks(self, model: nn.Module, indices: list[int]) -> None:
        """Drop the residual blocks ``indices`` (of ``removable_blocks``) in place, renumbering the rest."""
        if indices:
            raise UnsupportedModelError(f"remove_blocks: {self.family!r} models have no removable residual blocks")
