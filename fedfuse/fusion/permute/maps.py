"""Transport maps between the units of two models, and applying them to state dicts.

A :class:`Map` for a permutation group (``fedfuse.models.adapters.permspec``) is a transport plan ``P``
``[m_A, m_B]`` from the units of a model A to those of the reference model B (a permutation is the
special case of a 0/1 plan). Applying it moves A's weights into B's unit order and width (OTFusion,
arXiv 1910.05653):

- out role: aligned unit ``j`` is the convex combination ``Σ_i P[i, j] / Σ_i' P[i', j] · unit_i``
  (column-normalised plan, the "proper marginals" rule for different widths);
- in role: ``W_new[:, j] = Σ_i W[:, i] · P[i, j] / Σ_j' P[i, j']`` (row-normalised: every A unit's
  contribution is delivered in full, so a consumer sees the same total input).

For a permutation both rules are an exact re-indexing, so the permuted model computes the same function.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from fedfuse.fusion.permute.spec import Entry, PermSpec, build_spec
from fedfuse.models.adapters import adapter_for
from fedfuse.fusion.registry import IncompatibleModelsError


@dataclass
class Map:
    """Transport plan ``plan`` ``[m_A, m_B]`` (non-negative) from A's units to B's; ``perm`` ``[m_B]``
    (B unit ``j`` ← A unit ``perm[j]``) when the plan is a permutation."""

    plan: torch.Tensor
    perm: torch.Tensor | None = None

    @staticmethod
    def from_perm(perm: torch.Tensor) -> "Map":
        """Hard permutation map; ``perm`` ``[m]`` long."""
        perm = torch.as_tensor(perm, dtype=torch.long).cpu()
        m = len(perm)
        plan = torch.zeros(m, m, dtype=torch.float64)
        plan[perm, torch.arange(m)] = 1.0
        return Map(plan, perm)

    @staticmethod
    def identity(m: int) -> "Map":
        return Map.from_perm(torch.arange(m))

    @staticmethod
    def from_plan(plan: torch.Tensor, tol: float = 1e-9) -> "Map":
        """Wrap a plan ``[m_A, m_B]``; detects plans that are (scaled) permutations."""
        plan = plan.detach().to(torch.float64).cpu().clamp_min(0)
        if plan.shape[0] == plan.shape[1]:
            nz = plan > tol * plan.max().clamp_min(1e-300)
            if bool((nz.sum(0) == 1).all()) and bool((nz.sum(1) == 1).all()):
                return Map.from_perm(nz.to(torch.int64).argmax(0))
        return Map(plan, None)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.plan.shape)  # type: ignore[return-value]

    def out_map(self) -> torch.Tensor:
        """Column-normalised plan ``[m_A, m_B]``: each B unit is a convex combination of A units."""
        return self.plan / self.plan.sum(0, keepdim=True).clamp_min(1e-300)

    def in_map(self) -> torch.Tensor:
        """Row-normalised plan ``[m_A, m_B]``: each A unit's input contribution is delivered in full."""
        return self.plan / self.plan.sum(1, keepdim=True).clamp_min(1e-300)

    def inverse(self) -> "Map":
        """The map from B to A (transposed plan)."""
        if self.perm is not None:
            return Map.from_perm(torch.argsort(self.perm))
        return Map(self.plan.t().contiguous(), None)

    def trace_ratio(self) -> float:
        """Diagnostic: mass on the diagonal / total mass (1 = identity alignment)."""
        if self.plan.shape[0] != self.plan.shape[1]:
            return float("nan")
        return float(torch.diagonal(self.plan).sum() / self.plan.sum())

def state_on(model: nn.Module, device: torch.device | str, spec: PermSpec | None = None) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every tensor on ``device`` (the fusion device): the weight-matching methods
    compute on it, whatever device each caller's model sits on (a view of the tensors already there, a copy
    otherwise; the model itself is not moved). Tensors a concatenation shares between groups come split into their
    parts (``PermSpec.splits``: the generic reader's specs), as the spec's entries name them."""
    state = {k: v.to(device) for k, v in model.state_dict().items()}
    if spec is None and _may_split(model):
        spec = build_spec(model)
    return split_state(state, spec) if spec is not None and spec.splits else state


def _may_split(model: nn.Module) -> bool:
    return adapter_for(model).family == "graph"


def split_state(state: dict[str, torch.Tensor], spec: PermSpec) -> dict[str, torch.Tensor]:
    """``state`` with every tensor of ``spec.splits`` replaced, in place in the order, by its parts."""
    out = {}
    for k, v in state.items():
        if k in spec.splits:
            axis, parts = spec.splits[k]
            for name, lo, hi in parts:
                out[name] = v.narrow(axis, lo, hi - lo)
        else:
            out[k] = v
    return out


def join_state(state: dict[str, torch.Tensor], spec: PermSpec | None) -> dict[str, torch.Tensor]:
    """The inverse of ``split_state``: parts concatenated back into their tensors."""
    if spec is None or not spec.splits:
        return state
    part_of = {name: k for k, (_, parts) in spec.splits.items() for name, _, _ in parts}
    out = {}
    for k, v in state.items():
        whole = part_of.get(k)
        if whole is None:
            out[k] = v
        elif whole not in out:
            axis, parts = spec.splits[whole]
            out[whole] = torch.cat([state[name] for name, _, _ in parts], axis)
    return out


def load_state(model: nn.Module, state: dict[str, torch.Tensor], spec: PermSpec | None = None) -> nn.Module:
    """``model.load_state_dict`` of a state that ``state_on`` may have split (joined first); returns ``model``."""
    if spec is None and _may_split(model):
        spec = build_spec(model)
    return load_plain(model, join_state(state, spec))


def load_plain(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """``model.load_state_dict(state)`` keeping the modules' state versions (``_metadata``) of ``model``'s own state
    dict: a module that migrates old checkpoints (torchvision MNASNet) refuses a state without them; returns
    ``model``."""
    meta = getattr(model.state_dict(), "_metadata", None)
    if meta is not None and getattr(state, "_metadata", None) is None:
        state = OrderedDict(state)
        state._metadata = meta
    model.load_state_dict(state)
    return model

def map_axis(t: torch.Tensor, axis: int, m: Map, role: str) -> torch.Tensor:
    """Re-index axis ``axis`` of ``t`` (size ``m_A``) into B's units (size ``m_B``) with map ``m``."""
    if t.shape[axis] != m.plan.shape[0]:
        raise IncompatibleModelsError(f"map of shape {m.shape} does not fit axis {axis} of size {t.shape[axis]}")
    if m.perm is not None:
        return t.index_select(axis, m.perm.to(t.device))
    mat = (m.out_map() if role == "out" else m.in_map()).to(device=t.device, dtype=t.dtype)
    return torch.tensordot(t, mat, dims=([axis], [0])).movedim(-1, axis)

def map_entry(t: torch.Tensor, e: Entry, maps: dict[str, Map], spec_a: PermSpec, spec_b: PermSpec,
              skip: str | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Map every grouped axis of tensor ``t`` (A's shape) except group ``skip``; returns the (B-shaped
    when nothing is skipped) tensor in float64 (or ``dtype``). Axes whose group has no map yet raise ``KeyError``."""
    x = t.detach().to(dtype)
    if e.view is not None:
        view = list(e.view)
        for ax in e.axes:
            view[ax.axis] = spec_a.groups[ax.group].size
        if e.qkv:
            view[-1] = -1 if len(view) == 3 else view[-1]
        x = x.reshape(view)
    for ax in e.axes:
        if ax.group == skip:
            continue
        x = map_axis(x, ax.axis, maps[ax.group], ax.role)
    if e.qkv and skip is None:
        a_grp = next(ax.group for ax in e.axes if spec_a.groups[ax.group].kind == "attn")
        ga, gb = spec_a.groups[a_grp], spec_b.groups[a_grp]
        if ga.size != gb.size:  # keep q·k / sqrt(head_dim) on scale when head dims differ
            x = x.clone()
            x[0] = x[0] * math.sqrt((ga.size / ga.blocks) / (gb.size / gb.blocks))
    return x

def entry_view(t: torch.Tensor, e: Entry, spec: PermSpec, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``t`` reshaped to the entry's view with this model's group sizes (float64, or ``dtype``)."""
    x = t.detach().to(dtype)
    if e.view is None:
        return x
    view = list(e.view)
    for ax in e.axes:
        view[ax.axis] = spec.groups[ax.group].size
    return x.reshape(view)

def apply_maps(state_a: dict[str, torch.Tensor], spec_a: PermSpec, spec_b: PermSpec, maps: dict[str, Map],
               like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model A's state moved into model B's units: every entry mapped; shapes and dtypes of ``like``
    (B's state). Tensors without grouped axes are copied from A. Returns a new state dict."""
    out = {}
    for k, t in state_a.items():
        e = spec_a.entries.get(k)
        if e is None or not t.is_floating_point():
            out[k] = t.detach().clone()
            continue
        x = map_entry(t, e, maps, spec_a, spec_b)
        ref = like[k]
        if x.numel() != ref.numel():
            raise IncompatibleModelsError(f"{k}: mapped tensor has {x.numel()} elements, reference has {ref.numel()}")
        out[k] = x.reshape(ref.shape).to(ref.dtype)
    return out

def permute_model(model: nn.Module, perms: dict[str, torch.Tensor], residual: str = "tied") -> nn.Module:
    """A copy of ``model`` with units permuted: ``perms`` maps group name → ``[m]`` long tensor
    (new unit ``j`` = old unit ``perm[j]``); unnamed groups stay in place. Function-preserving for
    ``residual="tied"`` when block-structured groups get block-structured permutations."""
    spec = build_spec(model, residual)
    for g in perms:
        if g not in spec.groups:
            raise IncompatibleModelsError(f"permute_model: unknown group {g!r}; groups are {list(spec.groups)}")
    maps = {g: Map.from_perm(perms[g]) if g in perms else Map.identity(grp.size) for g, grp in spec.groups.items()}
    new = copy.deepcopy(model)
    state = state_on(model, "cpu", spec)
    return load_state(new, apply_maps(state, spec, spec, maps, state), spec)

def random_perms(spec: PermSpec, seed: int = 0, heads: bool = True) -> dict[str, torch.Tensor]:
    """Random permutation per group; block-structured groups get a random block order composed with
    random within-block orders (TransFusion's P_attn structure) when ``heads``."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, g in spec.groups.items():
        if g.blocks > 1 and heads:
            d = g.size // g.blocks
            order = torch.randperm(g.blocks, generator=gen)
            out[name] = torch.cat([order[h] * d + torch.randperm(d, generator=gen) for h in range(g.blocks)])
        else:
            out[name] = torch.randperm(g.size, generator=gen)
    return out
