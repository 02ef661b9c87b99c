"""Sub-models of a global model: which global entries a capacity tier's model holds, slicing, and the
count-weighted aggregation of tier models back into the global model (HeteroFL and FedRolex).

- HeteroFL (Diao, Ding & Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning
  for Heterogeneous Clients", arXiv 2010.01264): a tier of width multiplier ``r`` holds the *top-left*
  slice of every tensor: the first ``ceil(r·C)`` units of every hidden group (model inputs and class
  outputs are never sliced). ``window_indices(C, c, offset=0)``.
- FedRolex (Alam, Liu, Yan & Zhang, "FedRolex: Model-Heterogeneous Federated Learning with Rolling
  Sub-Model Extraction", arXiv 2212.01548): the window rolls by one unit per round: in round ``t`` a
  group of ``C`` units gives the tier the units ``(t + j) mod C`` for ``j < c``. ``offset=t``.
- Aggregation (both): every entry of the global tensor becomes the weighted mean over the clients whose
  sub-model holds it; entries no client holds keep their global value (count tensors of the reference
  code, Flower ``baselines/heterofl``).

Which tensor axes belong to which units comes from the family adapter's permutation spec
(``fedfuse.models.adapters.permspec``: groups of units and, per state-dict tensor, the axes they index),
so MLPs, CNNs, ResNets and ViTs (fused qkv viewed ``[3, D, D]``, heads kept whole) share one code path.
A sub-model's layout is a ``SubModel``: for every state-dict key, the flat positions in the global
tensor of the tier tensor's entries (``[*tier shape]`` int64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fedfuse.models import adapter_for


@dataclass
class SubModel:
    """Where a tier model's entries live in the global model.

    Attributes:
        positions: state-dict key → int64 tensor of the tier tensor's shape; entry ``i`` of the tier
            tensor is flat entry ``positions[key].flatten()[i]`` of the global tensor.
        global_shapes: state-dict key → the global tensor's shape.
        offset: the window offset it was built with (0 = HeteroFL's top-left slice).
    """

    positions: dict[str, torch.Tensor]
    global_shapes: dict[str, tuple[int, ...]]
    offset: int = 0

    def restricted_to(self, keys) -> "SubModel":
        """This layout over the state-dict ``keys`` only (e.g. a velocity that covers the parameters, not buffers)."""
        return SubModel({k: p for k, p in self.positions.items() if k in keys}, self.global_shapes, self.offset)

    def held_fraction(self) -> float:
        """Entries held / global entries (the tier's share of the global model's size)."""
        held = sum(p.numel() for p in self.positions.values())
        return held / max(1, sum(math.prod(s) for s in self.global_shapes.values()))


def window_indices(size: int, keep: int, offset: int = 0, block: int = 1) -> torch.Tensor:
    """The ``keep`` units of a group of ``size`` that a sub-model holds, ``[keep]`` int64.

    ``offset=0``: the first ``keep`` (HeteroFL). ``offset=t``: the window starting at unit ``t mod size``,
    wrapping around (FedRolex round ``t``). With ``block > 1`` (attention heads of ``block`` dims, GroupNorm
    groups) the window moves in whole blocks: it starts at block ``t mod (size / block)``.
    ``keep == size`` always gives ``0..size-1`` (the whole group, unrolled).
    """
    if not 0 < keep <= size:
        raise ValueError(f"sub-model: a group of {size} units cannot hold a window of {keep}")
    if keep == size or offset == 0:
        return torch.arange(keep)
    if block > 1 and size % block == 0 and keep % block == 0:
        nb = size // block
        start = (offset % nb) * block
    else:
        start = offset % size
    return (start + torch.arange(keep)) % size


def _group_block(group) -> int:
    """Units per structural block of a permutation group (head dim of an attention group), 1 if none."""
    return group.size // group.blocks if group.blocks > 1 and group.size % group.blocks == 0 else 1


def submodel(global_model: nn.Module, tier_model: nn.Module, offset: int = 0) -> SubModel:
    """The layout of ``tier_model`` (same family and depth, narrower hidden groups) inside ``global_model``.

    ``offset``: window offset of every group (0 = HeteroFL's top-left slice; FedRolex: the round).
    Raises ``ValueError`` naming the tensor when the tier model is not a sub-model of the global one.
    """
    adapter = adapter_for(global_model)
    if adapter_for(tier_model) is not adapter:
        raise ValueError(f"sub-model: {type(tier_model).__name__} is not of the global model's family "
                         f"({adapter.family})")
    gspec, tspec = adapter.perm_spec(global_model), adapter.perm_spec(tier_model)
    if set(gspec.groups) != set(tspec.groups):
        raise ValueError(f"sub-model: the tier model's unit groups {sorted(tspec.groups)} differ from the global "
                         f"model's {sorted(gspec.groups)} (another depth or layout)")
    index: dict[str, torch.Tensor] = {}
    for name, g in gspec.groups.items():
        t = tspec.groups[name]
        if t.size > g.size:
            raise ValueError(f"sub-model: group {name!r} has {t.size} units in the tier model but {g.size} in the "
                             "global model (a tier may not be wider than the global model)")
        index[name] = window_indices(g.size, t.size, offset, _group_block(g))
    gstate, tstate = global_model.state_dict(), tier_model.state_dict()
    if list(gstate) != list(tstate):
        raise ValueError("sub-model: the tier model's state-dict keys differ from the global model's")
    positions: dict[str, torch.Tensor] = {}
    for key, gt in gstate.items():
        tt = tstate[key]
        entry = gspec.entries.get(key)
        if entry is None:  # ungrouped (class-layer bias, BN counters): held whole
            if tuple(tt.shape) != tuple(gt.shape):
                raise ValueError(f"sub-model: {key!r} has shape {tuple(tt.shape)} in the tier model but "
                                 f"{tuple(gt.shape)} in the global model, and no unit group indexes it")
            positions[key] = torch.arange(gt.numel()).reshape(gt.shape)
            continue
        tentry = tspec.entries[key]
        gview = entry.view or tuple(gt.shape)
        tview = tentry.view or tuple(tt.shape)
        pos = torch.arange(gt.numel()).reshape(gview)
        for ax in entry.axes:
            pos = pos.index_select(ax.axis, index[ax.group])
        if tuple(pos.shape) != tuple(tview):
            raise ValueError(f"sub-model: {key!r} sliced from the global model has shape {tuple(pos.shape)}, the tier "
                             f"model's is {tuple(tview)}")
        positions[key] = pos.reshape(tt.shape)
    return SubModel(positions, {k: tuple(v.shape) for k, v in gstate.items()}, offset)


def slice_state(global_state: dict[str, torch.Tensor], sub: SubModel) -> dict[str, torch.Tensor]:
    """The tier model's state dict: the global entries at ``sub.positions`` (copies)."""
    out = {}
    for key, pos in sub.positions.items():
        g = global_state[key]
        if tuple(g.shape) != sub.global_shapes[key]:
            raise ValueError(f"sub-model: global {key!r} has shape {tuple(g.shape)}, the layout expects "
                             f"{sub.global_shapes[key]}")
        out[key] = g.reshape(-1)[pos.reshape(-1)].reshape(pos.shape).clone()
    return out


def aggregate_states(global_state: dict[str, torch.Tensor], states: list[dict[str, torch.Tensor]],
                     subs: list[SubModel], weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    """Count-weighted aggregation of sub-model states into the global state (HeteroFL / FedRolex).

    Every floating-point global entry becomes ``Σ_i w_i x_i / Σ_i w_i`` over the clients ``i`` whose sub-model
    ``subs[i]`` holds it (``weights`` ``None`` = 1 each: the paper's plain count); entries held by no client
    keep their global value. Integer buffers (BatchNorm counters) keep the global value. Returns new tensors.
    """
    if len(states) != len(subs):
        raise ValueError(f"aggregate: {len(states)} states for {len(subs)} sub-model layouts")
    w = [1.0] * len(states) if weights is None else [float(v) for v in weights]
    if len(w) != len(states) or any(not (v >= 0) for v in w):
        raise ValueError(f"aggregate: need one non-negative weight per state, got {weights}")
    out: dict[str, torch.Tensor] = {}
    for key, g in global_state.items():
        if not g.is_floating_point():
            out[key] = g.clone()
            continue
        for state, sub in zip(states, subs):
            if state[key].numel() != sub.positions[key].numel():
                raise ValueError(f"aggregate: {key!r} has {state[key].numel()} entries, its sub-model layout "
                                 f"{sub.positions[key].numel()}")
        out[key] = entry_mean(g, [(state[key], sub.positions[key], wi) for state, sub, wi in zip(states, subs, w)])
    return out


def entry_mean(g: torch.Tensor, holders: list[tuple[torch.Tensor, torch.Tensor | None, float]]) -> torch.Tensor:
    """``g`` with every entry replaced by ``Σ w v / Σ w`` over the ``(values, positions, w)`` that hold it
    (``positions``: the flat positions in ``g`` of ``values``' entries, ``None`` = all of ``g``); entries no holder
    holds keep their value. A new tensor of ``g``'s dtype."""
    acc = torch.zeros(g.numel(), dtype=torch.float64)
    cnt = torch.zeros(g.numel(), dtype=torch.float64)
    for val, pos, wi in holders:
        idx = pos.reshape(-1) if pos is not None else torch.arange(g.numel())
        acc.index_add_(0, idx, wi * val.detach().reshape(-1).double())
        cnt.index_add_(0, idx, torch.full((idx.numel(),), float(wi), dtype=torch.float64))
    flat = g.detach().reshape(-1).double().clone()
    held = cnt > 0
    flat[held] = acc[held] / cnt[held]
    return flat.reshape(g.shape).to(g.dtype)


__all__ = ["SubModel", "submodel", "window_indices", "slice_state", "aggregate_states", "entry_mean"]
