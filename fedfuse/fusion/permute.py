"""Neuron permutations and transport maps applied to the weights of each model family.

Shared machinery of ``ot`` (OTFusion, Singh & Jaggi, NeurIPS 2020, arXiv 1910.05653, and its
transformer extension, seed 000 / Imfeld et al., ICLR 2024: spec ``ot-transfusion-tofu.md`` §1.1,
§1.4, §1.6), ``rebasin`` (Git Re-Basin, Ainsworth et al., ICLR 2023: spec ``flower.md`` §5) and
``transfusion`` (seed 003, spec §2.3–§2.5, §2.8). Written from the specification, not from any
reference repository.

A model is described by a :class:`PermSpec`: *groups* of interchangeable units (the hidden units of an
MLP layer, the channels of a residual stream, the Q/K/V dimensions of an attention block, ...) and, for
every state-dict tensor, which of its axes are indexed by which group and in which *role*:

- ``"out"``: the tensor *produces* (or describes) the units, e.g. weight rows, biases, norm
  parameters, BN running statistics, position embeddings;
- ``"in"``: the tensor *consumes* the units, e.g. the columns of the next layer's weight.

A :class:`Map` for a group is a transport plan ``P`` ``[m_A, m_B]`` from the units of a model A to
those of the reference model B (a permutation is the special case of a 0/1 plan). Applying it moves
A's weights into B's unit order and width (§1.1 steps 1 and 5):

- out role: aligned unit ``j`` is the convex combination ``Σ_i P[i, j] / Σ_i' P[i', j] · unit_i``
  (column-normalised plan, the "proper marginals" rule for different widths, §1.6);
- in role: ``W_new[:, j] = Σ_i W[:, i] · P[i, j] / Σ_j' P[i, j']`` (row-normalised: every A unit's
  contribution is delivered in full, so a consumer sees the same total input).

For a permutation both rules are an exact re-indexing, so the permuted model computes the same function.

Class outputs are never grouped (FINDINGS.md failure mode #3); the model input is never grouped.
Residual constraints: ResNet blocks with an identity shortcut share the stream group of their input;
a shortcut conv starts a new stream group. timm ViTs have one stream group (``residual="tied"``,
exact) or one per residual position (``residual="untied"``, spec §2.4: the permuted model is then only
equivalent with explicit permuted skips, used for task-vector transport and OT residual policies).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fedfuse.models.levels import neurons_last

AFFINE = (nn.Linear, nn.Conv1d, nn.Conv2d)
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


# --------------------------------------------------------------------------------------------------
# Specification of a model's permutation symmetries
# --------------------------------------------------------------------------------------------------


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

    def entries_of(self, group: str) -> list[tuple[Entry, Axis]]:
        """All ``(entry, axis)`` pairs that touch ``group``."""
        out = []
        for e in self.entries.values():
            for ax in e.axes:
                if ax.group == group:
                    out.append((e, ax))
        return out


def _norm_entries(prefix: str, norm: nn.Module, group: Group, entries: dict[str, Entry]) -> None:
    """BatchNorm / GroupNorm / LayerNorm parameters (and BN running stats) along ``group`` (out role)."""
    if isinstance(norm, nn.GroupNorm):
        g = norm.num_groups
        blocks = 1 if g in (1, norm.num_channels) else g
        if blocks > 1:
            if group.blocks not in (1, blocks):
                raise ValueError(f"permute: {prefix} GroupNorm with {g} groups conflicts with {group.blocks}-block "
                                 f"structure of group {group.name}")
            group.blocks = blocks
    elif not isinstance(norm, (*BATCHNORMS, nn.LayerNorm)):
        raise ValueError(f"permute: unsupported normalisation {prefix} ({type(norm).__name__})")
    for key in ("weight", "bias", "running_mean", "running_var"):
        t = getattr(norm, key, None)
        if t is not None:
            entries[f"{prefix}.{key}"] = Entry(f"{prefix}.{key}", None, (Axis(group.name, 0, "out"),))


def _sequential_spec(model: nn.Sequential) -> PermSpec:
    children = list(model.named_children())
    affine = [i for i, (_, m) in enumerate(children) if isinstance(m, AFFINE)]
    if not affine:
        raise ValueError("permute: nn.Sequential has no Linear/Conv layer")
    groups: dict[str, Group] = {}
    entries: dict[str, Entry] = {}
    prev: Group | None = None
    classifier: tuple[str, ...] = ()
    for i, (name, m) in enumerate(children):
        if isinstance(m, BATCHNORMS):
            if i == 0 or not isinstance(children[i - 1][1], AFFINE):
                raise ValueError(f"permute: BatchNorm {name} must directly follow a Linear/Conv layer")
            continue
        if not isinstance(m, AFFINE):
            if any(True for _ in m.parameters()):
                raise ValueError(f"permute: unsupported parameterised module {name} ({type(m).__name__}) in "
                                 "nn.Sequential; only Linear/Conv1d/Conv2d (+BatchNorm) carry parameters")
            continue
        if isinstance(m, (nn.Conv1d, nn.Conv2d)) and m.groups != 1:
            raise ValueError(f"permute: grouped convolution {name} (groups={m.groups}) is not supported")
        w = m.weight
        in_axes: list[Axis] = []
        view = None
        if prev is not None:
            n_in = w.shape[1]
            if n_in == prev.size:
                in_axes = [Axis(prev.name, 1, "in")]
            elif isinstance(m, nn.Linear) and n_in % prev.size == 0:
                # Conv → Flatten → Linear: inputs are channel-major blocks of n_in / C features
                view = (w.shape[0], prev.size, n_in // prev.size)
                in_axes = [Axis(prev.name, 1, "in")]
            else:
                raise ValueError(f"permute: layer {name} takes {n_in} inputs, not a multiple of the previous "
                                 f"layer's {prev.size} units")
        has_bn = i + 1 < len(children) and isinstance(children[i + 1][1], BATCHNORMS)
        last = i == affine[-1]
        if last:  # class layer: inputs aligned, outputs (classes) never permuted
            entries[f"{name}.weight"] = Entry(f"{name}.weight", view, tuple(in_axes))
            classifier = tuple(k for k in (f"{name}.weight", f"{name}.bias") if getattr(m, k.split(".")[-1]) is not None)
            prev = None
            continue
        out_name = children[i + 1][0] if has_bn else name
        layout = "flat" if isinstance(m, nn.Linear) else "channels"
        g = Group(name=name, size=w.shape[0], kind="hidden", acts=[(out_name, "out", layout)], levels=[out_name])
        groups[g.name] = g
        entries[f"{name}.weight"] = Entry(f"{name}.weight", view, (Axis(g.name, 0, "out"), *in_axes))
        if m.bias is not None:
            entries[f"{name}.bias"] = Entry(f"{name}.bias", None, (Axis(g.name, 0, "out"),))
        if has_bn:
            _norm_entries(children[i + 1][0], children[i + 1][1], g, entries)
        prev = g
    return PermSpec("sequential", groups, entries, classifier)


def _resnet_spec(model: nn.Module) -> PermSpec:
    groups: dict[str, Group] = {}
    entries: dict[str, Entry] = {}
    stem_conv, stem_norm = model.stem[0], model.stem[1]
    s = Group("stem", stem_conv.out_channels, "stream", acts=[("stem", "out", "channels")], levels=["stem"])
    groups[s.name] = s
    entries["stem.0.weight"] = Entry("stem.0.weight", None, (Axis(s.name, 0, "out"),))
    _norm_entries("stem.1", stem_norm, s, entries)
    for i, blk in enumerate(model.blocks):
        p = f"blocks.{i}"
        h = Group(f"{p}.hidden", blk.conv1.out_channels, "hidden", acts=[(f"{p}.relu1", "out", "channels")])
        groups[h.name] = h
        entries[f"{p}.conv1.weight"] = Entry(f"{p}.conv1.weight", None, (Axis(h.name, 0, "out"), Axis(s.name, 1, "in")))
        _norm_entries(f"{p}.norm1", blk.norm1, h, entries)
        if isinstance(blk.shortcut, nn.Identity):
            out = s  # identity skip: the block's output permutation equals its input permutation
        else:
            out = Group(p, blk.conv2.out_channels, "stream")
            groups[out.name] = out
            entries[f"{p}.shortcut.0.weight"] = Entry(f"{p}.shortcut.0.weight", None,
                                                      (Axis(out.name, 0, "out"), Axis(s.name, 1, "in")))
            _norm_entries(f"{p}.shortcut.1", blk.shortcut[1], out, entries)
        entries[f"{p}.conv2.weight"] = Entry(f"{p}.conv2.weight", None, (Axis(out.name, 0, "out"), Axis(h.name, 1, "in")))
        _norm_entries(f"{p}.norm2", blk.norm2, out, entries)
        out.acts.append((p, "out", "channels"))
        out.levels.append(p)
        s = out
    entries["fc.weight"] = Entry("fc.weight", None, (Axis(s.name, 1, "in"),))
    return PermSpec("resnet", groups, entries, ("fc.weight", "fc.bias"))


def _is_identity(m: nn.Module | None) -> bool:
    return m is None or isinstance(m, nn.Identity)


def _vit_spec(model: nn.Module, residual: str = "tied") -> PermSpec:
    if residual not in ("tied", "untied"):
        raise ValueError(f"permute: residual must be 'tied' or 'untied', got {residual!r}")
    if getattr(model, "attn_pool", None) is not None:
        raise ValueError("permute: timm ViTs with attention pooling are not supported")
    if not _is_identity(getattr(model.patch_embed, "norm", None)):
        raise ValueError("permute: patch_embed.norm is not supported")
    D = model.embed_dim
    groups: dict[str, Group] = {}
    entries: dict[str, Entry] = {}
    positions: list[Group] = []

    def stream(pos_name: str) -> Group:
        if residual == "tied":
            if "stream" not in groups:
                groups["stream"] = Group("stream", D, "stream", levels=[])
                positions.append(groups["stream"])
            return groups["stream"]
        g = Group(f"stream.{pos_name}", D, "stream", position=len(positions))
        groups[g.name] = g
        positions.append(g)
        return g

    def vec(key: str, g: Group, axis: int = 0) -> None:
        entries[key] = Entry(key, None, (Axis(g.name, axis, "out"),))

    def lin(prefix: str, out_g: Group | None, in_g: Group | None, mod: nn.Linear, view=None, qkv=False) -> None:
        axes = []
        if out_g is not None:
            axes.append(Axis(out_g.name, 1 if view else 0, "out"))
        if in_g is not None:
            axes.append(Axis(in_g.name, 2 if view else 1, "in"))
        entries[f"{prefix}.weight"] = Entry(f"{prefix}.weight", view, tuple(axes), qkv=qkv)
        if mod.bias is not None and out_g is not None:
            entries[f"{prefix}.bias"] = Entry(f"{prefix}.bias", (3, out_g.size) if view else None,
                                              (Axis(out_g.name, 1 if view else 0, "out"),), qkv=qkv)

    s = stream("embed")
    s.acts.append(("norm_pre", "out", "tokens"))
    lin("patch_embed.proj", s, None, model.patch_embed.proj)
    for key in ("cls_token", "reg_token", "pos_embed"):
        if getattr(model, key, None) is not None:
            vec(key, s, 2)
    if not _is_identity(model.norm_pre):
        _norm_entries("norm_pre", model.norm_pre, s, entries)
    for b, blk in enumerate(model.blocks):
        p = f"blocks.{b}"
        attn = blk.attn
        if not (_is_identity(getattr(attn, "q_norm", None)) and _is_identity(getattr(attn, "k_norm", None))
                and _is_identity(getattr(attn, "norm", None))):
            raise ValueError(f"permute: {p}.attn has q/k norms or a scale norm (qk_norm); not supported")
        if not (hasattr(blk.mlp, "fc1") and hasattr(blk.mlp, "fc2")) or not _is_identity(getattr(blk.mlp, "norm", None)):
            raise ValueError(f"permute: {p}.mlp is not a plain fc1 → act → fc2 Mlp")
        if not hasattr(attn, "qkv"):
            raise ValueError(f"permute: {p}.attn has no fused qkv projection")
        s.levels.append(p) if residual == "tied" else None
        _norm_entries(f"{p}.norm1", blk.norm1, s, entries)
        a = Group(f"{p}.attn", D, "attn", blocks=attn.num_heads, acts=[(f"{p}.attn.qkv", "out", "qkv")])
        groups[a.name] = a
        lin(f"{p}.attn.qkv", a, s, attn.qkv, view=(3, D, D), qkv=True)
        s2 = stream(f"{b}.attn")
        s2.acts.append((f"{p}.norm2", "in", "tokens"))
        lin(f"{p}.attn.proj", s2, a, attn.proj)
        if not _is_identity(blk.ls1):
            vec(f"{p}.ls1.gamma", s2)
        _norm_entries(f"{p}.norm2", blk.norm2, s2, entries)
        hid = blk.mlp.fc1.out_features
        m = Group(f"{p}.mlp", hid, "mlp", acts=[(f"{p}.mlp.fc1", "out", "tokens")])
        groups[m.name] = m
        lin(f"{p}.mlp.fc1", m, s2, blk.mlp.fc1)
        s3 = stream(f"{b}.mlp")
        s3.acts.append((p, "out", "tokens"))
        if residual == "untied":
            s3.levels.append(p)
        lin(f"{p}.mlp.fc2", s3, m, blk.mlp.fc2)
        if not _is_identity(blk.ls2):
            vec(f"{p}.ls2.gamma", s3)
        s = s3
    for key in ("norm", "fc_norm"):
        mod = getattr(model, key, None)
        if not _is_identity(mod):
            _norm_entries(key, mod, s, entries)
    if isinstance(model.head, nn.Linear):
        lin("head", None, s, model.head)
        classifier = tuple(k for k in ("head.weight", "head.bias") if k in model.state_dict())
    else:
        classifier = ()
    # order groups in forward order: tied stream first, then per block attn, (positions,) mlp
    return PermSpec("vit", groups, entries, classifier)


def build_spec(model: nn.Module, residual: str = "tied") -> PermSpec:
    """The :class:`PermSpec` of ``model`` (``nn.Sequential`` MLP/CNN, fedfuse ``ResNet``, timm ViT).

    ``residual`` applies to ViTs: ``"tied"`` (one stream group) or ``"untied"`` (one per position).
    Raises ``ValueError`` naming the unsupported part otherwise.
    """
    from fedfuse.models.levels import model_family

    try:
        family = model_family(model)
    except ValueError as exc:
        raise ValueError(f"permute: {exc}") from None
    if family == "sequential":
        return _sequential_spec(model)
    if family == "resnet":
        return _resnet_spec(model)
    return _vit_spec(model, residual)


def check_compatible(spec_a: PermSpec, spec_b: PermSpec, state_a: dict, state_b: dict,
                     same_width: bool = False) -> None:
    """Raise ``ValueError`` unless A can be mapped onto B (same family, tensors, group structure).

    Ungrouped axes (inputs, classes, kernels) must agree; group sizes may differ unless ``same_width``.
    """
    if spec_a.family != spec_b.family:
        raise ValueError(f"models are of different families ({spec_a.family} vs {spec_b.family})")
    if list(state_a) != list(state_b):
        missing = sorted(set(state_a) ^ set(state_b))[:4]
        raise ValueError(f"models have different parameter names (e.g. {missing}); depth or layout differs")
    if list(spec_a.groups) != list(spec_b.groups):
        raise ValueError("models have different layer structure (permutation groups differ)")
    for g, ga in spec_a.groups.items():
        gb = spec_b.groups[g]
        if same_width and ga.size != gb.size:
            raise ValueError(f"group {g} has width {ga.size} in one model and {gb.size} in the other; this method "
                             "needs equal widths (use method 'ot' for different widths)")
        if ga.blocks != gb.blocks and ga.kind == "attn":
            raise ValueError(f"{g}: {ga.blocks} heads vs {gb.blocks} heads")
    for k, ta in state_a.items():
        tb = state_b[k]
        e = spec_a.entries.get(k)
        grouped = set()
        if e is not None:
            if e.view is not None:
                continue  # checked when mapped (views fix the ungrouped sizes)
            grouped = {ax.axis for ax in e.axes}
        if ta.dim() != tb.dim():
            raise ValueError(f"{k}: rank {ta.dim()} vs {tb.dim()}")
        for ax in range(ta.dim()):
            if ax not in grouped and ta.shape[ax] != tb.shape[ax]:
                raise ValueError(f"{k}: axis {ax} has size {ta.shape[ax]} vs {tb.shape[ax]} and is not a neuron axis "
                                 "(inputs, classes and kernels must match)")


# --------------------------------------------------------------------------------------------------
# Transport maps and their application
# --------------------------------------------------------------------------------------------------


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
        """Diagnostic (spec §1.11): mass on the diagonal / total mass (1 = identity alignment)."""
        if self.plan.shape[0] != self.plan.shape[1]:
            return float("nan")
        return float(torch.diagonal(self.plan).sum() / self.plan.sum())


def map_axis(t: torch.Tensor, axis: int, m: Map, role: str) -> torch.Tensor:
    """Re-index axis ``axis`` of ``t`` (size ``m_A``) into B's units (size ``m_B``) with map ``m``."""
    if t.shape[axis] != m.plan.shape[0]:
        raise ValueError(f"map of shape {m.shape} does not fit axis {axis} of size {t.shape[axis]}")
    if m.perm is not None:
        return t.index_select(axis, m.perm.to(t.device))
    mat = (m.out_map() if role == "out" else m.in_map()).to(device=t.device, dtype=t.dtype)
    return torch.tensordot(t, mat, dims=([axis], [0])).movedim(-1, axis)


def map_entry(t: torch.Tensor, e: Entry, maps: dict[str, Map], spec_a: PermSpec, spec_b: PermSpec,
              skip: str | None = None) -> torch.Tensor:
    """Map every grouped axis of tensor ``t`` (A's shape) except group ``skip``; returns the (B-shaped
    when nothing is skipped) tensor in float64. Axes whose group has no map yet raise ``KeyError``."""
    x = t.detach().to(torch.float64)
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
        if ga.size != gb.size:  # keep q·k / sqrt(head_dim) on scale when head dims differ (§1.6)
            x = x.clone()
            x[0] = x[0] * math.sqrt((ga.size / ga.blocks) / (gb.size / gb.blocks))
    return x


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
            raise ValueError(f"{k}: mapped tensor has {x.numel()} elements, reference has {ref.numel()}")
        out[k] = x.reshape(ref.shape).to(ref.dtype)
    return out


def permute_model(model: nn.Module, perms: dict[str, torch.Tensor], residual: str = "tied") -> nn.Module:
    """A copy of ``model`` with units permuted: ``perms`` maps group name → ``[m]`` long tensor
    (new unit ``j`` = old unit ``perm[j]``); unnamed groups stay in place. Function-preserving for
    ``residual="tied"`` when block-structured groups get block-structured permutations."""
    import copy

    spec = build_spec(model, residual)
    for g in perms:
        if g not in spec.groups:
            raise ValueError(f"permute_model: unknown group {g!r}; groups are {list(spec.groups)}")
    maps = {g: Map.from_perm(perms[g]) if g in perms else Map.identity(grp.size) for g, grp in spec.groups.items()}
    new = copy.deepcopy(model)
    state = model.state_dict()
    new.load_state_dict(apply_maps(state, spec, spec, maps, state))
    return new


def random_perms(spec: PermSpec, seed: int = 0, heads: bool = True) -> dict[str, torch.Tensor]:
    """Random permutation per group; block-structured groups get a random block order composed with
    random within-block orders (TransFusion's P_attn structure, spec §2.3) when ``heads``."""
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


# --------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _subsample(n: int, k: int, seed: int) -> torch.Tensor:
    """Sorted random ``k`` of ``range(n)`` (seeded by ``seed + n``); cached, since every model of a
    fusion draws the same rows."""
    gen = torch.Generator().manual_seed(seed + n)
    return torch.randperm(n, generator=gen)[:k].sort().values


def _rows(h: torch.Tensor, layout: str) -> torch.Tensor:
    """Module output → ``[samples, units]`` (``levels.neurons_last`` plus the fused-QKV layout)."""
    if layout == "qkv":
        d = h.shape[-1] // 3
        return h.reshape(-1, 3, d).transpose(0, 1).reshape(-1, d)
    return neurons_last(h, layout)


@torch.no_grad()
def collect_activations(model: nn.Module, spec: PermSpec, inputs: torch.Tensor, *, max_rows: int = 4096,
                        batch_size: int = 256, seed: int = 0, device: str | torch.device = "cpu",
                        per_position: bool = False) -> dict[str, torch.Tensor]:
    """Unit activations per group: ``{group: [S, size]}`` (float32, on ``device``).

    Rows are (sample, position/token) pairs of the fusion set; each hook point contributes at most
    ``max_rows`` rows, subsampled with a generator seeded by ``seed`` so that two models fed the same
    ``inputs`` get corresponding rows. With several hook points (a tied residual stream, q/k/v) the
    rows are concatenated.
    """
    device = torch.device(device)
    model = model.to(device).eval()
    mods = dict(model.named_modules())
    store: dict[tuple[str, str, str], list[torch.Tensor]] = {}
    handles = []
    points = {pt for g in spec.groups.values() for pt in g.acts}
    for pt in points:
        path, where, layout = pt
        if path not in mods:
            raise ValueError(f"activations: module {path!r} not found")
        store[pt] = []
        if where == "out":
            handles.append(mods[path].register_forward_hook(
                lambda _m, _i, o, pt=pt: store[pt].append(_rows(o, pt[2]).float())))
        else:
            handles.append(mods[path].register_forward_pre_hook(
                lambda _m, i, pt=pt: store[pt].append(_rows(i[0], pt[2]).float())))
    try:
        for s in range(0, len(inputs), batch_size):
            model(inputs[s:s + batch_size].to(device))
    finally:
        for h in handles:
            h.remove()
    out: dict[str, torch.Tensor] = {}
    for name, g in spec.groups.items():
        parts = []
        for pt in g.acts:
            rows = torch.cat(store[pt])
            if len(rows) > max_rows:
                rows = rows[_subsample(len(rows), max_rows, seed).to(rows.device)]
            parts.append(rows)
        out[name] = torch.cat(parts) if parts else torch.empty(0, g.size, device=device)
    return out


# --------------------------------------------------------------------------------------------------
# Solvers (POT for OT plans, scipy for assignments)
# --------------------------------------------------------------------------------------------------


def assignment(score: torch.Tensor, maximize: bool = True) -> torch.Tensor:
    """Linear assignment on a square ``[m, m]`` score (scipy Hungarian); returns ``perm`` ``[m]`` with
    B unit ``j`` ← A unit ``perm[j]`` (rows are A's units, columns B's)."""
    from scipy.optimize import linear_sum_assignment

    s = score.detach().double().cpu().numpy()
    if s.shape[0] != s.shape[1]:
        raise ValueError(f"assignment needs a square matrix, got {s.shape}")
    if not np.isfinite(s).all():
        raise ValueError("assignment: score matrix has NaN/inf entries")
    r, c = linear_sum_assignment(s, maximize=maximize)
    perm = torch.empty(s.shape[1], dtype=torch.long)
    perm[torch.as_tensor(c)] = torch.as_tensor(r)
    return perm


def sinkhorn_batch(cost: np.ndarray, a: np.ndarray, b: np.ndarray, reg: float, *, num_iter: int = 1000,
                   stop_thr: float = 1e-6) -> np.ndarray:
    """Entropic OT plans for a batch of problems: ``cost`` ``[B, m, n]``, marginals ``a`` ``[B, m]``,
    ``b`` ``[B, n]`` (float64) → plans ``[B, m, n]``.

    The same iteration as POT's ``ot.sinkhorn(method="sinkhorn")`` (Sinkhorn–Knopp scaling, marginal
    error ``‖P^T 1 − b‖`` checked every 10 iterations against ``stop_thr``, at most ``num_iter``
    iterations, each problem frozen once it has converged), vectorised over the batch in numpy: one
    call replaces B POT calls, whose per-call and per-iteration backend overhead dominated the fusion
    time of small models (the H head-pair solves of every attention block). Problems whose scaling
    under/overflows (small ``reg``) are re-solved in the log domain (:func:`sinkhorn_log_batch`).
    """
    B, m, n = cost.shape
    K = np.exp(cost / -reg)
    Kp = K / a[:, :, None]
    Kt = np.ascontiguousarray(K.transpose(0, 2, 1))
    u = np.full((B, m, 1), 1.0 / m)
    v = np.full((B, n, 1), 1.0 / n)
    # the whole batch iterates until every problem has converged (no per-iteration gathers); a
    # problem's scalings are frozen into (uo, vo) at its own stopping point, as if solved alone
    uo, vo = u[..., 0].copy(), v[..., 0].copy()
    active = np.ones(B, dtype=bool)
    bad = np.zeros(B, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for it in range(num_iter):
            u_prev, v_prev = u, v
            ktu = np.matmul(Kt, u)
            v = b[:, :, None] / ktu
            u = 1.0 / np.matmul(Kp, v)
            if it % 10 == 0 or not np.isfinite(u).all():
                broken = active & ((ktu == 0).any((1, 2)) | ~np.isfinite(u).all((1, 2)) | ~np.isfinite(v).all((1, 2)))
                if broken.any():  # keep the last finite scalings (as POT does), re-solve in the log domain
                    uo[broken], vo[broken] = u_prev[broken, :, 0], v_prev[broken, :, 0]
                    bad |= broken
                    active &= ~broken
                    u = np.where(broken[:, None, None], u_prev, u)
                    v = np.where(broken[:, None, None], v_prev, v)
                if it % 10 == 0:
                    marg = (np.matmul(Kt, u) * v)[..., 0]
                    done = active & (np.linalg.norm(marg - b, axis=1) < stop_thr)
                    uo[done], vo[done] = u[done, :, 0], v[done, :, 0]
                    active &= ~done
                if not active.any():
                    break
        uo[active], vo[active] = u[active, :, 0], v[active, :, 0]  # iteration cap reached
        plans = uo[:, :, None] * K * vo[:, None, :]
    bad |= ~np.isfinite(plans).all((1, 2)) | ~(plans.sum((1, 2)) > 0)
    if bad.any():
        plans[bad] = sinkhorn_log_batch(cost[bad], a[bad], b[bad], reg, num_iter=num_iter, stop_thr=stop_thr)
    return plans


def sinkhorn_log_batch(cost: np.ndarray, a: np.ndarray, b: np.ndarray, reg: float, *, num_iter: int = 1000,
                       stop_thr: float = 1e-6) -> np.ndarray:
    """Log-domain Sinkhorn (POT's ``method="sinkhorn_log"`` iteration), batched like :func:`sinkhorn_batch`."""
    mr = torch.from_numpy(np.ascontiguousarray(cost / -reg))
    loga, logb = torch.from_numpy(np.log(a)), torch.from_numpy(np.log(b))
    u = torch.zeros(loga.shape, dtype=torch.float64)
    v = torch.zeros(logb.shape, dtype=torch.float64)
    uo, vo = u.clone(), v.clone()
    active = torch.ones(len(mr), dtype=torch.bool)
    for it in range(num_iter):
        v = logb - torch.logsumexp(mr + u[:, :, None], dim=1)
        u = loga - torch.logsumexp(mr + v[:, None, :], dim=2)
        if it % 10 == 0:
            marg = torch.exp(mr + u[:, :, None] + v[:, None, :]).sum(1)
            done = active & (torch.linalg.vector_norm(marg - torch.exp(logb), dim=1) < stop_thr)
            uo[done], vo[done] = u[done], v[done]
            active &= ~done
            if not bool(active.any()):
                break
    uo[active], vo[active] = u[active], v[active]
    return torch.exp(mr + uo[:, :, None] + vo[:, None, :]).numpy()


def _marginals(m_a: int, m_b: int, a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    a_ = np.full(m_a, 1.0 / m_a) if a is None else a.detach().double().cpu().numpy()
    b_ = np.full(m_b, 1.0 / m_b) if b is None else b.detach().double().cpu().numpy()
    return a_ / a_.sum(), b_ / b_.sum()


def ot_plans(costs: list[torch.Tensor], *, solver: str = "sinkhorn", reg: float = 0.05, normalize: bool = True,
             num_iter: int = 1000) -> list[torch.Tensor]:
    """OT plans with uniform marginals for several costs (each max-normalised when ``normalize``).

    Same-shape Sinkhorn problems are solved in one :func:`sinkhorn_batch` call; other solvers fall
    back to one :func:`ot_plan` per cost.
    """
    if solver != "sinkhorn" or not costs or len({tuple(c.shape) for c in costs}) > 1:
        return [ot_plan(c, solver=solver, reg=reg, normalize=normalize, num_iter=num_iter) for c in costs]
    if reg <= 0:
        raise ValueError(f"ot: sinkhorn reg must be > 0, got {reg}")
    c = torch.stack([x.detach().double().cpu() for x in costs]).numpy()
    if not np.isfinite(c).all():
        raise ValueError("ot: ground cost has NaN/inf entries")
    if normalize:
        mx = c.max(axis=(1, 2), keepdims=True)
        c = np.where(mx > 0, c / np.where(mx > 0, mx, 1.0), c)
    B, m_a, m_b = c.shape
    a_, b_ = _marginals(m_a, m_b, None, None)
    p = _sinkhorn(c, np.tile(a_, (B, 1)), np.tile(b_, (B, 1)), reg, num_iter)
    return [torch.as_tensor(x, dtype=torch.float64) for x in p]


def _sinkhorn(c: np.ndarray, a: np.ndarray, b: np.ndarray, reg: float, num_iter: int) -> np.ndarray:
    if reg >= 0.02:  # exp(-C/reg) >= 2e-22 on a max-normalised cost: the plain scaling is stable
        return sinkhorn_batch(c, a, b, reg, num_iter=num_iter, stop_thr=1e-6)
    return sinkhorn_log_batch(c, a, b, reg, num_iter=num_iter, stop_thr=1e-6)


def ot_plan(cost: torch.Tensor, a: torch.Tensor | None = None, b: torch.Tensor | None = None, *,
            solver: str = "emd", reg: float = 0.05, normalize: bool = True, num_iter: int = 1000) -> torch.Tensor:
    """OT plan ``[m_A, m_B]`` for ground cost ``cost`` ``[m_A, m_B]``.

    ``a``/``b``: marginals (uniform when ``None``), each summing to 1. ``solver``: ``"emd"`` (exact,
    POT ``ot.emd``) or ``"sinkhorn"`` (entropic, with ``reg`` on the cost divided by its max when
    ``normalize``, spec §1.2–§1.3; :func:`sinkhorn_batch`, POT's Sinkhorn–Knopp iteration in numpy,
    log domain for ``reg < 0.02`` or on overflow).
    """
    c = cost.detach().double().cpu().numpy()
    if not np.isfinite(c).all():
        raise ValueError("ot: ground cost has NaN/inf entries")
    m_a, m_b = c.shape
    a_, b_ = _marginals(m_a, m_b, a, b)
    if normalize and c.max() > 0:
        c = c / c.max()
    if solver == "emd":
        import ot as pot

        p = pot.emd(a_, b_, np.ascontiguousarray(c), numItermax=1_000_000)
    elif solver == "sinkhorn":
        if reg <= 0:
            raise ValueError(f"ot: sinkhorn reg must be > 0, got {reg}")
        p = _sinkhorn(c[None], a_[None], b_[None], reg, num_iter)[0]
    else:
        raise ValueError(f"ot: unknown solver {solver!r}; choose 'emd' or 'sinkhorn'")
    return torch.as_tensor(p, dtype=torch.float64)


def blocked_plan(n_blocks: int, size_a: int, size_b: int, head_cost: torch.Tensor | None,
                 intra: "callable") -> tuple[torch.Tensor, torch.Tensor]:
    """Head-preserving plan ``[size_a, size_b]`` built from block matches (spec §2.3).

    ``intra(a, b)`` returns ``(plan [d_a, d_b] summing to 1, cost float)`` for A block ``a`` and B block
    ``b``. When ``head_cost`` ``[H, H]`` is ``None`` the block cost is the intra cost of every pair
    ("assignment" head matching, H² intra solves); otherwise ``head_cost`` (e.g. TransFusion's spectral
    distance) decides the pairing. Blocks are paired by a minimising Hungarian step; returns
    ``(plan, head_perm [H])`` with B head ``j`` ← A head ``head_perm[j]``; each block carries mass 1/H.
    """
    H = n_blocks
    da, db = size_a // H, size_b // H
    cache: dict[tuple[int, int], tuple[torch.Tensor, float]] = {}
    if head_cost is None:
        head_cost = torch.zeros(H, H, dtype=torch.float64)
        for i in range(H):
            for j in range(H):
                cache[(i, j)] = intra(i, j)
                head_cost[i, j] = cache[(i, j)][1]
    head_perm = assignment(head_cost, maximize=False)
    plan = torch.zeros(size_a, size_b, dtype=torch.float64)
    for j in range(H):
        i = int(head_perm[j])
        p = cache[(i, j)][0] if (i, j) in cache else intra(i, j)[0]
        plan[i * da:(i + 1) * da, j * db:(j + 1) * db] = p / p.sum().clamp_min(1e-300) / H
    return plan, head_perm


def marginal_from_scores(scores: dict[str, torch.Tensor] | None, group: Group, floor: float = 1e-3) -> torch.Tensor | None:
    """OT marginal ``[size]`` from importance scores of the group's levels (mean over levels), or
    ``None`` (uniform) when no score covers the group. A floor keeps every unit's mass positive."""
    if scores is None:
        return None
    vecs = [scores[lv].detach().double().cpu().flatten() for lv in group.levels if lv in scores]
    vecs = [v for v in vecs if len(v) == group.size]
    if not vecs:
        return None
    s = torch.stack(vecs).mean(0).clamp_min(0)
    s = s / s.sum().clamp_min(1e-300)
    s = s + floor / group.size
    return s / s.sum()


# --------------------------------------------------------------------------------------------------
# Averaging and BatchNorm re-estimation
# --------------------------------------------------------------------------------------------------


def average_aligned(states: list[dict[str, torch.Tensor]], weights: list[float],
                    unit_weights: list[dict[str, torch.Tensor]] | None = None,
                    spec: PermSpec | None = None) -> dict[str, torch.Tensor]:
    """Weighted average of aligned states (all in the reference's units).

    ``unit_weights`` (optional, one ``{group: [size]}`` dict per model, already in the reference's
    units) turn the average per unit: along an entry's first ``out`` axis unit ``j`` gets
    ``w_k u_k[j] / Σ_k' w_k' u_k'[j]`` (importance-weighted averaging); other tensors use ``weights``.
    Integer buffers come from the first state.
    """
    out = {}
    for k, ref in states[0].items():
        if not ref.is_floating_point():
            out[k] = ref.clone()
            continue
        e = spec.entries.get(k) if (spec is not None and unit_weights is not None) else None
        ax = next((a for a in e.axes if a.role == "out"), None) if e is not None else None
        if ax is None:
            out[k] = sum(w * s[k].double() for w, s in zip(weights, states)).to(ref.dtype)
            continue
        shape = list(e.view) if e.view is not None else list(ref.shape)
        if e.view is not None:
            shape[ax.axis] = spec.groups[ax.group].size
            if e.qkv and len(shape) == 3:
                shape[-1] = -1
        u = torch.stack([w * uw[ax.group].double() for w, uw in zip(weights, unit_weights)])  # [K, size]
        u = u / u.sum(0, keepdim=True).clamp_min(1e-300)
        acc = 0
        for kk, s in enumerate(states):
            x = s[k].double().reshape(shape)
            bshape = [1] * x.dim()
            bshape[ax.axis] = -1
            acc = acc + x * u[kk].reshape(bshape)
        out[k] = acc.reshape(ref.shape).to(ref.dtype)
    return out


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@torch.no_grad()
def reset_bn_stats(model: nn.Module, inputs: torch.Tensor, *, batch_size: int = 256,
                   device: str | torch.device = "cpu") -> nn.Module:
    """Re-estimate every BatchNorm's running mean/var on ``inputs`` ``[N, *input_shape]`` (in place).

    Statistics are reset and accumulated as a cumulative average over the batches (momentum ``None``),
    as REPAIR / Git Re-Basin recommend after permutation fusion (``flower.md`` §5). Returns the model
    in eval mode.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return model.eval()
    if inputs is None or len(inputs) < 2:
        raise ValueError("reset_bn_stats: need at least 2 fusion inputs to re-estimate BatchNorm statistics")
    saved = [(m.momentum, m.track_running_stats) for m in bns]
    model.to(device).train()
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    try:
        for s in range(0, len(inputs), batch_size):
            xb = inputs[s:s + batch_size]
            if len(xb) < 2:
                continue
            model(xb.to(device))
    finally:
        for m, (mom, _) in zip(bns, saved):
            m.momentum = mom
    return model.eval()


# --------------------------------------------------------------------------------------------------
# Per-group matching primitives shared by ot / rebasin / transfusion
# --------------------------------------------------------------------------------------------------


def entry_view(t: torch.Tensor, e: Entry, spec: PermSpec) -> torch.Tensor:
    """``t`` reshaped to the entry's view with this model's group sizes (float64)."""
    x = t.detach().to(torch.float64)
    if e.view is None:
        return x
    view = list(e.view)
    for ax in e.axes:
        view[ax.axis] = spec.groups[ax.group].size
    return x.reshape(view)


def weight_features(state_a: dict, state_b: dict, spec_a: PermSpec, spec_b: PermSpec, group: str,
                    maps: dict[str, Map], roles: tuple[str, ...] = ("out", "in"),
                    require_mapped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit weight features of ``group``: ``(F_A [m_A, F], F_B [m_B, F])`` with matching columns.

    Every tensor touching the group in one of ``roles`` contributes its slices along the group's axis;
    A's other grouped axes are first moved into B's units with ``maps``. With ``require_mapped``, tensors
    whose other groups have no map yet are left out (the sequential OTFusion pass); otherwise a missing
    map raises ``KeyError``.
    """
    fa, fb = [], []
    for e, ax in spec_a.entries_of(group):
        if ax.role not in roles or e.name not in state_a:
            continue
        others = [o.group for o in e.axes if o.group != group]
        if require_mapped and any(o not in maps for o in others):
            continue
        xa = map_entry(state_a[e.name], e, maps, spec_a, spec_b, skip=group)
        xb = entry_view(state_b[e.name], e, spec_b)
        fa.append(xa.movedim(ax.axis, 0).reshape(xa.shape[ax.axis], -1))
        fb.append(xb.movedim(ax.axis, 0).reshape(xb.shape[ax.axis], -1))
    if not fa:
        return (torch.zeros(spec_a.groups[group].size, 0, dtype=torch.float64),
                torch.zeros(spec_b.groups[group].size, 0, dtype=torch.float64))
    return torch.cat(fa, 1), torch.cat(fb, 1)


def exact_block_costs(cost: torch.Tensor, H: int) -> torch.Tensor:
    """``[H, H]`` exact (EMD) transport cost between every A block ``i`` and B block ``j`` of ``cost``
    (uniform marginals; a linear assignment per pair when the blocks are square)."""
    from scipy.optimize import linear_sum_assignment

    m_a, m_b = cost.shape
    da, db = m_a // H, m_b // H
    c = cost.detach().double().cpu()
    out = torch.zeros(H, H, dtype=torch.float64)
    cn = c.numpy()
    for i in range(H):
        for j in range(H):
            blk = cn[i * da:(i + 1) * da, j * db:(j + 1) * db]
            if da == db:
                r, k = linear_sum_assignment(blk)
                out[i, j] = float(blk[r, k].sum()) / da
            else:
                out[i, j] = float((ot_plan(torch.from_numpy(blk), solver="emd", normalize=False)
                                   * torch.from_numpy(blk)).sum())
    return out


def solve_group(cost: torch.Tensor, group_a: Group, group_b: Group, *, solver: str = "lap", reg: float = 0.05,
                a: torch.Tensor | None = None, b: torch.Tensor | None = None, head_preserving: bool = True,
                head_cost: torch.Tensor | None = None) -> Map:
    """Map for one group from a ground cost ``[m_A, m_B]`` (lower = more similar).

    ``solver``: ``"lap"`` (Hungarian permutation; falls back to ``"emd"`` for unequal sizes),
    ``"emd"`` (POT) or ``"sinkhorn"`` (batched, :func:`ot_plans`). Block-structured groups (attention heads, GroupNorm groups) get a
    head-preserving plan when ``head_preserving`` (:func:`blocked_plan`; ``head_cost`` ``[H, H]`` fixes
    the head pairing, e.g. TransFusion's spectral distance); marginals are then uniform.
    """
    m_a, m_b = cost.shape
    if solver == "lap" and m_a != m_b:
        solver = "emd"
    if solver == "lap" and (a is not None or b is not None):
        solver = "emd"  # non-uniform marginals need OT
    H = group_a.blocks

    def solve(c: torch.Tensor, aa=None, bb=None) -> torch.Tensor:
        if solver in ("lap", "emd") and c.shape[0] == c.shape[1] and aa is None and bb is None:
            # equal sizes, uniform marginals: the exact OT optimum is a permutation (Birkhoff), found
            # faster by the Hungarian method than by the network simplex
            return Map.from_perm(assignment(c, maximize=False)).plan
        return ot_plan(c, aa, bb, solver="emd" if solver == "lap" else solver, reg=reg)

    if H > 1 and head_preserving:
        if group_b.blocks != H or m_a % H or m_b % H:
            raise ValueError(f"{group_a.name}: cannot preserve heads between {H} and {group_b.blocks} blocks")
        da, db = m_a // H, m_b // H

        def intra(i: int, j: int) -> tuple[torch.Tensor, float]:
            c = cost[i * da:(i + 1) * da, j * db:(j + 1) * db]
            p = solve(c)
            p = p / p.sum()
            return p, float((p * c.double().cpu()).sum())

        if solver == "sinkhorn":
            if head_cost is None:
                # pair heads by their exact transport cost (H² cheap solves), then Sinkhorn only on the
                # H matched pairs, batched in one call
                head_cost = exact_block_costs(cost, H)
            head_perm = assignment(head_cost, maximize=False)
            blocks = [cost[int(head_perm[j]) * da:(int(head_perm[j]) + 1) * da, j * db:(j + 1) * db] for j in range(H)]
            plan = torch.zeros(m_a, m_b, dtype=torch.float64)
            for j, p in enumerate(ot_plans(blocks, solver="sinkhorn", reg=reg)):
                i = int(head_perm[j])
                plan[i * da:(i + 1) * da, j * db:(j + 1) * db] = p / p.sum().clamp_min(1e-300) / H
            return Map.from_plan(plan)
        if head_cost is None:  # brute-force head pairing by the exact within-head costs (vectorised)
            head_cost = exact_block_costs(cost, H)
        plan, _ = blocked_plan(H, m_a, m_b, head_cost, intra)
        return Map.from_plan(plan)
    return Map.from_plan(solve(cost, a, b))


def score_cost(score: torch.Tensor) -> torch.Tensor:
    """Similarity ``[m_A, m_B]`` → non-negative cost (``max - score``) for solvers that minimise."""
    score = score.double()
    return score.max() - score


def standardize(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """z-score each column (unit) of ``x`` ``[S, m]`` (spec §1.2 ``std: True``)."""
    std, mean = torch.std_mean(x, dim=0, keepdim=True)  # one pass over x
    return (x - mean) / (std + eps)
