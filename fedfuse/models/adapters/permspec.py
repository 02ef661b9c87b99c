"""Data types describing a model's permutation symmetries (built by each family's adapter).

A model is described by a :class:`PermSpec`: *groups* of interchangeable units (the hidden units of an
MLP layer, the channels of a residual stream, the Q/K/V dimensions of an attention block, ...) and, for
every state-dict tensor, which of its axes are indexed by which group and in which *role*:

- ``"out"``: the tensor *produces* (or describes) the units, e.g. weight rows, biases, norm
  parameters, BN running statistics, position embeddings;
- ``"in"``: the tensor *consumes* the units, e.g. the columns of the next layer's weight.

Class outputs are never grouped; the model input is never grouped. How the groups are moved between
models (transport maps) is ``fedfuse.fusion.permute``'s business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fedfuse.models.adapters.base import BATCHNORMS, UnsupportedModelError


@dataclass
class Group:
    """A set of ``size`` interchangeable units.

    Attributes:
        name: stable group name.
        size: number of units (width).
        kind: ``"hidden"`` | ``"stream"`` | ``"attn"`` | ``"mlp"`` (informational; ``"attn"`` groups
            are the Q/K/V dims of one attention block, ``blocks`` heads of ``size // blocks`` dims).
        blocks: block structure: a function-preserving permutation must map each block (attention
            head, GroupNorm group) onto one block. 1 = unstructured.
        acts: where the units' activations are read: ``(module path, "out" | "in", layout)`` with layout
            ``"flat"`` ``[N, W]``, ``"channels"`` ``[N, W, *spatial]``, ``"tokens"`` ``[N, T, W]`` or
            ``"qkv"`` ``[N, T, 3W]`` (q, k, v stacked along samples).
        levels: ``fedfuse.models.levels`` level names whose importance scores describe these units.
        position: for untied residual streams, the index of the residual position (else ``None``).
    """

    name: str
    size: int
    kind: str = "hidden"
    blocks: int = 1
    acts: list[tuple[str, str, str]] = field(default_factory=list)
    levels: list[str] = field(default_factory=list)
    position: int | None = None


@dataclass(frozen=True)
class Axis:
    """Axis ``axis`` (of the entry's view) is indexed by ``group`` in role ``"out"`` or ``"in"``."""

    group: str
    axis: int
    role: str


@dataclass
class Entry:
    """How one state-dict tensor transforms: reshape to ``view`` (``None`` = as is), map ``axes``."""

    name: str
    view: tuple[int, ...] | None
    axes: tuple[Axis, ...]
    qkv: bool = False  # timm fused qkv (view [3, D, D_in]): q part rescaled for different head dims


@dataclass
class PermSpec:
    """Permutation symmetries of one model: ordered ``groups`` (forward order) and tensor ``entries``."""

    family: str
    groups: dict[str, Group]
    entries: dict[str, Entry]
    classifier: tuple[str, ...] = ()  # state-dict keys of the class layer (output axis never grouped)
    # concatenations: tensor → (axis, [(part name, start, stop)]); the matching methods see each part as a tensor
    # of its own (``fedfuse.fusion.permute.maps.state_on`` splits, ``load_state`` joins)
    splits: dict[str, tuple[int, list[tuple[str, int, int]]]] = field(default_factory=dict)

    def entries_of(self, group: str) -> list[tuple[Entry, Axis]]:
        """All ``(entry, axis)`` pairs that touch ``group``."""
        out = []
        for e in self.entries.values():
            for ax in e.axes:
                if ax.group == group:
                    out.append((e, ax))
        return out


def norm_entries(prefix: str, norm: nn.Module, group: Group, entries: dict[str, Entry]) -> None:
    """BatchNorm / GroupNorm / LayerNorm parameters (and BN running stats) along ``group`` (out role)."""
    if isinstance(norm, nn.GroupNorm):
        g = norm.num_groups
        blocks = 1 if g in (1, norm.num_channels) else g
        if blocks > 1:
            if group.blocks not in (1, blocks):
                raise UnsupportedModelError(f"permute: {prefix} GroupNorm with {g} groups conflicts with "
                                            f"{group.blocks}-block structure of group {group.name}")
            group.blocks = blocks
    elif not isinstance(norm, (*BATCHNORMS, nn.LayerNorm)):
        raise UnsupportedModelError(f"permute: unsupported normalisation {prefix} ({type(norm).__name__})")
    for key in ("weight", "bias", "running_mean", "running_var"):
        t = getattr(norm, key, None)
        if t is not None:
            entries[f"{prefix}.{key}"] = Entry(f"{prefix}.{key}", None, (Axis(group.name, 0, "out"),))
