"""Structured pruning: a new, physically smaller model of the same family (fewer heads, head dimensions, MLP
hidden units, channels and, where asked, whole residual blocks).

The idea comes from a paper abstract without a title or public code (multi-ViT fusion, conditional optimal
transport for selective alignment, then structured pruning): after fusing heterogeneous ViTs, prune redundant
heads, neurons and layers. This is fedfuse's own design of that pruning step: drop the heads and units of
lowest importance, drop whole blocks whose residual update is negligible on the fusion set (highest cosine
similarity between block input and output), then briefly fine-tune (here: distil on the fusion set). The
dependency tracking is Torch-Pruning's (``torch-pruning``, DepGraph: Fang et al., "DepGraph: Towards Any
Structural Pruning", CVPR 2023, arXiv 2301.12900), used with its
timm ViT recipe (heads as units via ``num_heads={qkv: heads}``, the classifier ignored, timm ``Attention``'s
stored sizes fixed after pruning).

    from fedfuse.pruning import prune, prune_result
    small = prune(model, params_ratio=0.5, fusion_inputs=X)                  # half the parameters
    small = prune(model, macs_ratio=0.5, fusion_inputs=X, recover=True)      # half the MACs, then distil
    small = prune(model, target=build_model("vit", ..., width_mult=0.5))      # exactly that tier's widths
    res = prune_result(model, params_ratio=0.5, scores=client_scores)         # model + achieved ratios (info)

How it works:

1. ``Adapter.pruning_spec`` (the family's adapter, the only code that knows its layout) names the classifier
   (its outputs are never pruned), the attention layers and their heads, raw parameters (a ViT's class token
   and position embedding) and the layers whose outputs the importance levels score.
2. Optional block removal (``prune_blocks``; Torch-Pruning has no depth API): the residual blocks the adapter
   calls removable are ranked by the mean cosine similarity of their input and output on ``fusion_inputs``;
   the most redundant are dropped (``Adapter.remove_blocks``), which equals skipping them.
3. Torch-Pruning's ``DependencyGraph`` gives the coupled channel groups (a residual stream is one group:
   embedding, every norm, every block's output and the layers reading it). Each group is ranked by the
   importance ``criterion`` (a Torch-Pruning ``Importance``): ``magnitude`` (group L2 norm), ``taylor``
   (``|w · ∂L/∂w|`` with L = KL from the ``teachers``' averaged softmax to the model on ``fusion_inputs``, no
   labels; without teachers or when they agree with the model, cross-entropy to the teachers' / the model's
   own hard predictions, since the KL gradient vanishes there) or ``scores`` (the clients' ``neuron_importance``
   dicts, ``ScoreImportance``; groups that no level scores, e.g. ViT heads and MLP units, use magnitude);
   ``auto`` is the family's best measured criterion (``Adapter.pruning_criterion``: magnitude for
   MLP/CNN/ResNet, Taylor for ViT; ``docs/measurements-fusion.md``).
   Attention groups are cut from the output projection's inputs: whole heads (``attention="heads"``, the
   default; head score = mean over its dims, the head dim kept) or head dimensions (``"head_dims"``, the same
   number in every head, each head its own best).
4. Every group keeps the same fraction ``k`` of its units (local ranking); ``k`` is found by bisection so that
   the parameter or MAC count hits the requested ratio (within ``tolerance``, relative); ``target=`` keeps
   exactly the target module's width in every group (and drops blocks to its depth).
5. ``Adapter.finish_pruning`` updates the stored sizes (timm ``Attention.num_heads/head_dim/attn_dim/scale``,
   ``VisionTransformer.embed_dim``); a shrunk head dim has its query rows rescaled so the attention logits keep
   their scale. Removing nothing returns the same function.
6. ``recover=True``: ``fedfuse.fusion.refine.distill_ensemble`` (FedDF's loop: the teachers' averaged softmax
   distilled on the fusion set, held-out early stopping, never worse there than the pruned start) with the
   ``teachers`` (default: the unpruned model).

MACs are counted by ``torch.utils.flop_counter.FlopCounterMode`` on one sample (attention matmuls included,
CPU fused attention too), multiply-accumulates = FLOPs / 2.
"""

from __future__ import annotations

import functools

import copy
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion import normalise_weights
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.fusion.refine import DistillRefineOptions, distill_ensemble
from fedfuse.fusion.registry import FusionOptionError, MissingInputError, parse_options, require
from fedfuse.models.adapters import PruningSpec, UnsupportedModelError, adapter_for
from fedfuse.training import resolve_device

log = logging.getLogger(__name__)

CRITERIA = ("auto", "magnitude", "taylor", "scores")


# ----------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class PruneOptions:
    """Options of ``prune`` beyond its named arguments (``prune(..., **options)``).

    Attributes:
        attention: ViT attention units: ``"heads"`` (whole heads, head dim kept) or ``"head_dims"`` (every
            head keeps the same number of its best dimensions).
        round_to: kept channel counts are multiples of this (fast matmul shapes; 1 = any count).
        tolerance: the achieved params/MACs ratio may differ from the requested one by this fraction of it
            (a warning and ``info["within_tolerance"] = False`` otherwise).
        search_steps: bisection steps on the kept fraction.
        block_similarity: with ``prune_blocks=True``, only blocks whose mean input/output cosine similarity on
            the fusion set is at least this are dropped.
        max_blocks: with ``prune_blocks=True``, drop at most this many blocks (``None``: no cap).
        batch_size: fusion samples per forward pass (importance, block similarity).
        input_shape: the model's input shape when no ``fusion_inputs`` are given and the adapter cannot tell.
    """

    attention: Literal["heads", "head_dims"] = "heads"
    round_to: int = 1
    tolerance: float = 0.05
    search_steps: int = 20
    block_similarity: float = 0.95
    max_blocks: int | None = None
    batch_size: int = 64
    input_shape: tuple | list | None = None

    def __post_init__(self) -> None:
        require(self.round_to >= 1, "round_to", ">= 1", self.round_to)
        require(0 < self.tolerance < 1, "tolerance", "in (0, 1)", self.tolerance)
        require(self.search_steps >= 1, "search_steps", ">= 1", self.search_steps)
        require(-1 <= self.block_similarity <= 1, "block_similarity", "in [-1, 1]", self.block_similarity)
        require(self.max_blocks is None or self.max_blocks >= 0, "max_blocks", ">= 0 or None", self.max_blocks)
        require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)


@dataclass
class PruneResult:
    """What one ``prune_result`` call produced: the pruned ``model`` (CPU, eval mode), diagnostics ``info``
    (achieved ``params``/``macs`` and their ratios to the unpruned model, ``criterion``, ``keep_fraction``,
    ``blocks_removed``, kept ``widths`` per group, recovery statistics) and the wall-clock ``seconds``."""

    model: nn.Module
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------- counting
def count_params(model: nn.Module) -> int:
    """Number of parameters (every ``nn.Parameter`` element)."""
    return sum(p.numel() for p in model.parameters())


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _custom_flops() -> dict:
    aten = torch.ops.aten
    out = {}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable"):
        op = getattr(aten, name, None)
        if op is not None:
            out[op] = _sdpa_cpu_flops
    return out


def count_macs(model: nn.Module, example: torch.Tensor) -> int:
    """Multiply-accumulates of one forward pass on ``example`` (``[1, *input_shape]`` for per-sample MACs):
    ``FlopCounterMode`` FLOPs / 2 (matmuls, convolutions, attention incl. CPU fused attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    was = model.training
    model.eval()
    try:
        with FlopCounterMode(display=False, custom_mapping=_custom_flops()) as fc, torch.no_grad():
            model(example)
    finally:
        model.train(was)
    return int(fc.get_total_flops()) // 2


# -------------------------------------------------------------------------------------------- importance
def _tp():
    import torch_pruning as tp  # imported when pruning (it imports a lot)

    return tp


def _out_channels(m: nn.Module) -> int:
    return m.out_features if isinstance(m, nn.Linear) else m.out_channels


def _in_channels(m: nn.Module) -> int:
    return m.in_features if isinstance(m, nn.Linear) else m.in_channels


def score_importance(DG, scores: Mapping[str, torch.Tensor], score_levels: Mapping[nn.Module, str], fallback):
    """A Torch-Pruning ``Importance`` from client importance scores (``neuron_importance`` dicts, keyed by
    ``levels()`` name; see ``ScoreImportance``)."""
    tp = _tp()

    class ScoreImportance(tp.importance.Importance):
        """A channel's importance = the mean, over the group's layers whose outputs a level scores, of that
        level's score (each level's scores divided by their mean, so levels weigh alike); groups that no level
        scores use ``fallback`` (magnitude)."""

        @torch.no_grad()
        def __call__(self, group):
            n = len(group[0].idxs)
            total, used = torch.zeros(n), 0
            for i, (dep, idxs) in enumerate(group):
                layer = dep.target.module
                if layer not in score_levels or not DG.is_out_channel_pruning_fn(dep.handler):
                    continue
                root = group[i].root_idxs
                if any(r is None for r in root):
                    continue
                name = score_levels[layer]
                if name not in scores:
                    continue
                s = torch.as_tensor(scores[name]).detach().float().cpu().flatten()
                s = s / s.mean().clamp_min(1e-12)
                sel = s[torch.as_tensor(idxs, dtype=torch.long)]
                total.scatter_add_(0, torch.as_tensor(root, dtype=torch.long), sel)
                used += 1
            if not used:
                return fallback(group)
            return total / used

    return ScoreImportance()


@torch.no_grad()
def _targets(model: nn.Module, x: torch.Tensor, teachers: list[nn.Module] | None, weights: list[float] | None,
             batch_size: int) -> torch.Tensor:
    if teachers:
        return teacher_probs(teachers, x, weights, batch_size=batch_size)
    out = torch.cat([model(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
    return F.one_hot(out.argmax(-1), out.shape[-1]).float()


def _taylor_gradients(model: nn.Module, x: torch.Tensor, teachers: list[nn.Module] | None,
                      weights: list[float] | None, batch_size: int) -> str:
    """Accumulate ``∂L/∂w`` on ``model`` for L = KL(teachers ‖ model) on ``x`` (mean over samples); when
    that gradient vanishes (no teachers, or teachers agreeing with the model) the loss is the cross-entropy to
    the hard predictions instead. Returns which loss was used."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)

    def run(targets: torch.Tensor) -> float:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, len(x), batch_size):
            logp = F.log_softmax(model(x[i:i + batch_size]), -1)
            loss = F.kl_div(logp, targets[i:i + batch_size], reduction="sum") / len(x)
            loss.backward()
            total += float(loss.detach())
        return total

    probs = _targets(model, x, teachers, weights, batch_size)
    kind = "kl-ensemble" if teachers else "ce-own-predictions"
    if run(probs) < 1e-6 and teachers:  # the teachers agree with the model: the KL gradient vanishes
        kind = "ce-ensemble-predictions"
        run(F.one_hot(probs.argmax(-1), probs.shape[-1]).float())
    return kind


# ------------------------------------------------------------------------------------------------ groups
@dataclass
class _Unit:
    """One coupled channel group (Torch-Pruning ``Group``) as pruning sees it."""

    key: str               # root module name (+ ":heads" for attention)
    module: nn.Module      # root module of the pruning group
    fn: Any                # its Torch-Pruning pruning function
    size: int              # channels in root index space
    out: bool = True       # the root's output channels (else its input channels)
    heads: int = 0         # > 0: attention group; root space is head-major [heads, size // heads]
    qkv: nn.Module | None = None
    multiple: int = 1      # kept channels must be a multiple of this (GroupNorm groups in the group)


def _graph(model: nn.Module, spec: PruningSpec, example: torch.Tensor):
    """Torch-Pruning dependency graph of ``model`` and its coupled groups as ``_Unit`` s (attention groups
    re-rooted at the output projection's inputs, as Torch-Pruning's own pruner does for timm)."""
    tp = _tp()
    unwrapped = [tp._helpers.UnwrappedParameters(parameters=p, pruning_dim=d) for p, d in spec.unwrapped]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DG = tp.DependencyGraph().build_dependency(model, example_inputs=example, unwrapped_parameters=unwrapped,
                                                   verbose=False)
    names = {m: n for n, m in model.named_modules()}
    units: list[_Unit] = []
    for group in DG.get_all_groups(ignored_layers=list(spec.ignored),
                                   root_module_types=(tp.ops.TORCH_CONV, tp.ops.TORCH_LINEAR)):
        qkv = next((dep.target.module for dep, _ in group
                    if dep.target.module in spec.num_heads and DG.is_out_channel_pruning_fn(dep.handler)), None)
        if qkv is not None:
            proj = spec.attention_out[qkv]
            units.append(_Unit(f"{names[proj]}:heads", proj, tp.prune_linear_in_channels, proj.in_features,
                               False, spec.num_heads[qkv], qkv))
        else:
            dep = group[0].dep
            multiple = 1
            for d, _ in group:
                if isinstance(d.target.module, nn.GroupNorm):
                    multiple = math.lcm(multiple, d.target.module.num_groups)
            units.append(_Unit(names[dep.target.module], dep.target.module, dep.handler, len(group[0].idxs),
                               DG.is_out_channel_pruning_fn(dep.handler), multiple=multiple))
    return DG, units


def _importances(model: nn.Module, spec: PruningSpec, example: torch.Tensor, criterion: str,
                 scores: Mapping[str, torch.Tensor] | None, score_levels: Mapping[nn.Module, str], graph=None,
                 groups=None) -> tuple[dict[str, torch.Tensor], list[_Unit]]:
    """Per-unit importance vectors (root index space) on ``model`` (gradients already accumulated for taylor)
    and the units; ``graph``: ``model``'s ``_graph`` and ``groups`` its every unit's full group (unit key ->
    Torch-Pruning ``Group``) when already built."""
    tp = _tp()
    DG, units = graph if graph is not None else _graph(model, spec, example)
    magnitude = tp.importance.GroupMagnitudeImportance(p=2)
    if criterion == "magnitude":
        imp = magnitude
    elif criterion == "taylor":
        imp = tp.importance.GroupTaylorImportance()
    else:
        imp = score_importance(DG, scores or {}, score_levels, magnitude)
    out = {}
    for u in units:
        group = groups[u.key] if groups is not None else DG.get_pruning_group(u.module, u.fn, list(range(u.size)))
        v = imp(group)
        if v is None or not bool(torch.isfinite(v).all()):
            v = magnitude(group)
        out[u.key] = (v if v is not None else torch.ones(u.size)).detach().float().cpu()
    return out, units


def _removal(u: _Unit, imp: torch.Tensor, keep) -> list[int]:
    """Root indices to remove from unit ``u`` to keep ``keep`` (channels, or ``(heads, head_dims)``)."""
    if not u.heads:
        if keep >= u.size:
            return []
        kept = set(torch.topk(imp, keep).indices.tolist())
        return [i for i in range(u.size) if i not in kept]
    hd = u.size // u.heads
    heads, dims = keep
    per_head = imp.view(u.heads, hd)
    kept_heads = torch.topk(per_head.mean(1), heads).indices.tolist() if heads < u.heads else range(u.heads)
    kept = set()
    for h in kept_heads:
        ds = torch.topk(per_head[h], dims).indices.tolist() if dims < hd else range(hd)
        kept.update(h * hd + d for d in ds)
    return [i for i in range(u.size) if i not in kept]


def _apply(model: nn.Module, plan: dict[str, Any], importance: dict[str, torch.Tensor], example: torch.Tensor) -> dict:
    """Prune ``model`` in place to ``plan`` (unit key → kept count / (heads, head dims)); returns the heads kept."""
    adapter = adapter_for(model)
    spec = adapter.pruning_spec(model)
    DG, units = _graph(model, spec, example)
    heads: dict[nn.Module, int] = {}
    for u in units:
        if u.key not in plan:
            continue
        remove = _removal(u, importance[u.key], plan[u.key])
        if u.heads:
            heads[u.qkv] = plan[u.key][0]
        if not remove:
            continue
        group = DG.get_pruning_group(u.module, u.fn, remove)
        if not DG.check_pruning_group(group):
            raise UnsupportedModelError(f"prune: Torch-Pruning refused to cut group {u.key!r} to {plan[u.key]}")
        group.prune()
    adapter.finish_pruning(model, heads)
    return heads


# ------------------------------------------------------------------------------------------------ blocks
@torch.no_grad()
def block_similarity(model: nn.Module, fusion_inputs: torch.Tensor, batch_size: int = 64) -> dict[int, float]:
    """Mean cosine similarity between each removable residual block's input and output on ``fusion_inputs``
    (per sample, all positions flattened): 1 = the block changes nothing. Keys: block indices
    (``Adapter.removable_blocks``)."""
    adapter = adapter_for(model)
    blocks = adapter.removable_blocks(model)
    mods = adapter.blocks(model)
    sums = {i: 0.0 for i in blocks}
    hooks = []

    def hook(i):
        def fn(_mod, args, out):
            sums[i] += float(F.cosine_similarity(args[0].flatten(1).double(), out.flatten(1).double(), dim=1).sum())
        return fn

    for i in blocks:
        hooks.append(mods[i].register_forward_hook(hook(i)))
    was = model.training
    model.eval()
    try:
        for s in range(0, len(fusion_inputs), batch_size):
            model(fusion_inputs[s:s + batch_size])
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return {i: v / max(len(fusion_inputs), 1) for i, v in sums.items()}


# --------------------------------------------------------------------------------------------- arguments
def _check_ratio(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1:
        raise ValueError(f"prune: {name} must be a number in (0, 1], got {value!r}")
    return float(value)


def _example(model: nn.Module, adapter, fusion_inputs: torch.Tensor | None, input_shape) -> torch.Tensor:
    if fusion_inputs is not None:
        return fusion_inputs[:1]
    if input_shape is not None:
        return torch.zeros(1, *[int(s) for s in input_shape])
    try:
        return torch.zeros(1, *adapter.config(model).input_shape)
    except UnsupportedModelError:
        raise MissingInputError("prune: cannot tell this model's input shape; pass fusion_inputs or "
                                "input_shape=") from None


def _plan_fraction(units: list[_Unit], k: float, o: PruneOptions) -> dict[str, Any]:
    plan = {}
    for u in units:
        if u.heads:
            hd = u.size // u.heads
            plan[u.key] = ((max(1, min(u.heads, round(k * u.heads))), hd) if o.attention == "heads"
                           else (u.heads, max(1, min(hd, round(k * hd)))))
        else:
            step = math.lcm(o.round_to, u.multiple)
            c = max(1, round(k * u.size / step)) * step
            plan[u.key] = min(u.size, c)
    return plan


def _plan_target(model: nn.Module, units: list[_Unit], target: nn.Module) -> dict[str, Any]:
    tmods = dict(target.named_modules())
    tspec = adapter_for(target).pruning_spec(target)
    tqkv = {proj: qkv for qkv, proj in tspec.attention_out.items()}
    mods = {m: n for n, m in model.named_modules()}
    plan = {}
    for u in units:
        name = mods[u.module]
        t = tmods.get(name)
        if t is None or type(t) is not type(u.module):
            raise ValueError(f"prune: target has no {type(u.module).__name__} {name!r} like the model's; target must "
                             "be the same family and layout (e.g. adapter_for(model).at_width_mult(model, 0.5))")
        if u.heads:
            if t not in tqkv:
                raise ValueError(f"prune: target layer {name!r} is not an attention output projection")
            h_t = tspec.num_heads[tqkv[t]]
            hd, hd_t = u.size // u.heads, t.in_features // h_t
            if h_t > u.heads or hd_t > hd:
                raise ValueError(f"prune: target is wider than the model at {name!r} ({h_t} heads × {hd_t} dims > "
                                 f"{u.heads} × {hd})")
            plan[u.key] = (h_t, hd_t)
        else:
            c = _out_channels(t) if u.out else _in_channels(t)
            if c > u.size:
                raise ValueError(f"prune: target is wider than the model at {name!r} ({c} > {u.size} channels)")
            plan[u.key] = c
    return plan


# ---------------------------------------------------------------------------------------------- pruning
@dataclass
class _Request:
    """The validated arguments of one ``prune_result`` call."""

    goal_name: str                       # "params_ratio" | "macs_ratio" | "target"
    params_ratio: float | None
    macs_ratio: float | None
    criterion: str                       # resolved: never "auto"
    n_blocks: int | None                 # prune_blocks given as a number of blocks
    wants_blocks: bool                   # prune_blocks asked for (True or a positive number)
    fusion_inputs: torch.Tensor | None   # float, None when empty
    options: PruneOptions

    @property
    def goal(self) -> float | None:
        """The requested params or MACs ratio (``None`` for ``target=``)."""
        return self.params_ratio if self.params_ratio is not None else self.macs_ratio


def _check_target(adapter, target: nn.Module) -> None:
    """``target`` must be a module of the model's family."""
    if not isinstance(target, nn.Module):
        raise ValueError(f"prune: target must be an nn.Module (an architecture of the model's family), got "
                         f"{type(target).__name__}")
    try:
        t_family = adapter_for(target).family
    except UnsupportedModelError:
        t_family = type(target).__name__
    if t_family != adapter.family:
        raise ValueError(f"prune: target is a {t_family!r} model, the model a {adapter.family!r} one; target must "
                         "be of the model's family")


def _check_scores(adapter, model: nn.Module, scores) -> None:
    """``scores`` must be a ``{level name: [width]}`` dict of ``model``'s levels."""
    if not isinstance(scores, Mapping):
        raise ValueError(f"prune: scores must be a dict (level name -> scores), got {type(scores).__name__}")
    widths = {lv.name: lv.width for lv in adapter.levels(model)}
    for name, s in scores.items():
        if name not in widths:
            raise ValueError(f"prune: scores has level {name!r}, not a level of this model ({list(widths)})")
        if torch.as_tensor(s).numel() != widths[name]:
            raise ValueError(f"prune: scores[{name!r}] has {torch.as_tensor(s).numel()} entries for "
                             f"{widths[name]} neurons")


def _check_request(model: nn.Module, params_ratio, macs_ratio, target, scores, fusion_inputs, criterion: str,
                   prune_blocks, recover, teachers, weights, options: Mapping[str, Any]) -> tuple[_Request, Any]:
    """Validate ``prune_result``'s arguments (``ValueError`` / ``FusionOptionError`` / ``MissingInputError``
    naming the argument) and resolve ``criterion="auto"``; returns the request and the model's adapter."""
    given = [n for n, v in (("params_ratio", params_ratio), ("macs_ratio", macs_ratio), ("target", target))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"prune: give exactly one of params_ratio, macs_ratio or target, got "
                         f"{' and '.join(given) if given else 'none'}")
    if params_ratio is not None:
        params_ratio = _check_ratio("params_ratio", params_ratio)
    if macs_ratio is not None:
        macs_ratio = _check_ratio("macs_ratio", macs_ratio)
    o: PruneOptions = parse_options("prune", PruneOptions, options, what="prune")
    if criterion not in CRITERIA:
        raise FusionOptionError(f"prune: criterion must be one of {list(CRITERIA)}, got {criterion!r}")
    if isinstance(prune_blocks, bool):
        n_blocks = None
    elif isinstance(prune_blocks, int) and prune_blocks >= 0:
        n_blocks = prune_blocks
    else:
        raise FusionOptionError(f"prune: prune_blocks must be a bool or a number of blocks >= 0, got {prune_blocks!r}")
    if not isinstance(recover, (bool, Mapping)):
        raise FusionOptionError(f"prune: recover must be a bool or a table of distillation options, got {recover!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"prune: model must be an nn.Module, got {type(model).__name__}")
    adapter = adapter_for(model)
    if target is not None:
        _check_target(adapter, target)
    if fusion_inputs is not None:
        fusion_inputs = torch.as_tensor(fusion_inputs).float()
        if len(fusion_inputs) == 0:
            fusion_inputs = None
    if criterion == "scores" and scores is None:
        raise MissingInputError("prune: criterion='scores' needs scores (a neuron_importance dict)")
    if criterion == "taylor" and fusion_inputs is None:
        raise MissingInputError("prune: criterion='taylor' needs fusion_inputs (its loss is the KL on the fusion set)")
    if recover is not False and fusion_inputs is None:
        raise MissingInputError("prune: recover needs fusion_inputs (distillation on the fusion set)")
    wants_blocks = (prune_blocks is True) or bool(n_blocks)
    if wants_blocks and fusion_inputs is None:
        raise MissingInputError("prune: prune_blocks needs fusion_inputs (block redundancy is measured on them)")
    if scores is not None:
        _check_scores(adapter, model, scores)
    if criterion == "auto":  # the family's best criterion (Adapter.pruning_criterion); Taylor needs data
        criterion = adapter.pruning_criterion
        if criterion == "taylor" and fusion_inputs is None or criterion == "scores" and scores is None:
            criterion = "magnitude"
    if teachers is not None and (not isinstance(teachers, (list, tuple)) or not teachers
                                 or not all(isinstance(t, nn.Module) for t in teachers)):
        raise ValueError("prune: teachers must be a non-empty list of nn.Modules (the ensemble)")
    if weights is not None and (teachers is None or len(weights) != len(teachers)):
        raise ValueError(f"prune: weights must give one weight per teacher ({len(teachers or [])}), got {weights!r}")
    req = _Request(goal_name=given[0], params_ratio=params_ratio, macs_ratio=macs_ratio, criterion=criterion,
                   n_blocks=n_blocks, wants_blocks=wants_blocks, fusion_inputs=fusion_inputs, options=o)
    return req, adapter


def _blocks_to_drop(work: nn.Module, adapter, target: nn.Module | None, x: torch.Tensor | None, req: _Request,
                    measure, info: dict) -> list[int]:
    """Step 1: the blocks to remove, most redundant first (highest input/output cosine similarity on the
    fusion set): down to ``target``'s depth, ``prune_blocks`` of them, or (``prune_blocks=True``) as many as
    ``block_similarity``, ``max_blocks`` and the requested ratio allow."""
    o = req.options
    depth = len(adapter.blocks(work))
    drop: list[int] = []
    if target is not None:
        t_depth = len(adapter.blocks(target))
        if t_depth > depth:
            raise ValueError(f"prune: target is deeper than the model ({t_depth} > {depth} blocks)")
        if t_depth < depth:
            if x is None:
                raise MissingInputError("prune: a shallower target needs fusion_inputs (the blocks to drop are "
                                        "chosen by redundancy on them)")
            sim = block_similarity(work, x, o.batch_size)
            if len(sim) < depth - t_depth or len(sim) != depth:
                raise ValueError(f"prune: target has {t_depth} blocks, the model {depth}, and this family's "
                                 "blocks cannot all be dropped (shape-changing blocks)")
            drop = sorted(sim, key=lambda i: -sim[i])[:depth - t_depth]
            info["block_similarity"] = sim
    elif req.wants_blocks:
        sim = block_similarity(work, x, o.batch_size)
        info["block_similarity"] = sim
        ranked = sorted(sim, key=lambda i: -sim[i])
        cap = max(depth - 1, 0)
        if req.n_blocks is not None:
            if req.n_blocks > min(len(ranked), cap):
                raise ValueError(f"prune: prune_blocks={req.n_blocks} but only {min(len(ranked), cap)} blocks can "
                                 "be dropped")
            drop = ranked[:req.n_blocks]
        else:
            limit = cap if o.max_blocks is None else min(cap, o.max_blocks)
            for i in ranked:
                if len(drop) >= limit or sim[i] < o.block_similarity:
                    break
                trial = copy.deepcopy(work)
                adapter.remove_blocks(trial, drop + [i])
                if measure(trial) < req.goal * (1 - o.tolerance):
                    break
                drop.append(i)
    return drop


def _search_fraction(build, measure, units: list[_Unit], goal: float, o: PruneOptions) -> tuple[float, nn.Module, dict]:
    """Step 3: bisection on the kept fraction ``k`` (every group keeps the same fraction of its units) for the
    requested ratio ``goal``; returns ``(k, pruned model, plan)`` of the closest ratio reached (the larger
    ``k`` on a tie). Plans that round to the same widths are built once."""
    seen: dict[tuple, float] = {}  # plan → achieved ratio
    best: tuple[float, float, nn.Module, dict] | None = None  # (|error|, k, model, plan)

    def evaluate(k: float) -> float:
        nonlocal best
        plan = _plan_fraction(units, k, o)
        sig = tuple(sorted((key, v) for key, v in plan.items()))
        if sig in seen:
            return seen[sig]
        m = build(plan)
        r = measure(m)
        seen[sig] = r
        err = abs(r - goal)
        if best is None or err < best[0] - 1e-12 or (abs(err - best[0]) <= 1e-12 and k > best[1]):
            best = (err, k, m, plan)
        return r

    lo, hi = 0.0, 1.0
    if evaluate(1.0) > goal:
        for _ in range(o.search_steps):
            mid = (lo + hi) / 2
            if evaluate(mid) >= goal:
                hi = mid
            else:
                lo = mid
            if best[0] <= 1e-3 * goal:
                break
    _, k, pruned, plan = best
    return k, pruned, plan


def _check_reached(info: dict, req: _Request, target: nn.Module | None, pruned: nn.Module) -> None:
    """Whether the achieved ratio is within ``tolerance`` (``info["within_tolerance"]``, a warning otherwise),
    or, for ``target=``, that the pruned model has exactly the target's shapes (``ValueError`` otherwise)."""
    if target is None:
        goal, o = req.goal, req.options
        got = info["params_ratio"] if req.params_ratio is not None else info["macs_ratio"]
        info["within_tolerance"] = abs(got - goal) <= o.tolerance * goal
        if not info["within_tolerance"]:
            what = "params_ratio" if req.params_ratio is not None else "macs_ratio"
            log.warning("prune: %s %.3f requested, %.3f reached (the closest the channel/head granularity allows)",
                        what, goal, got)
    else:
        mismatch = [k for k, v in target.state_dict().items()
                    if k not in pruned.state_dict() or pruned.state_dict()[k].shape != v.shape]
        if mismatch:
            raise ValueError(f"prune: could not reproduce the target architecture (differs at {mismatch[:3]})")


def _with_autograd(fn):
    """Run ``fn`` with autograd on, also when the caller is inside ``torch.no_grad()`` or ``torch.inference_mode()``
    (a common inference context): Torch-Pruning traces its dependency graph with autograd, and Taylor scores and
    recovery take gradients. Inference-mode tensors given as inputs are cloned into normal tensors."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.is_inference() else a for a in args)
            kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) and v.is_inference() else v)
                      for k, v in kwargs.items()}
            return fn(*args, **kwargs)
    return wrapper


# ------------------------------------------------------------------------------------ kept units, no model
class _ArchitectureGraph:
    """A private copy of one architecture with its Torch-Pruning dependency graph, built once and reused: each
    call loads the weights to rank into the copy in place (the graph holds its modules, so it stays valid)."""

    def __init__(self, model: nn.Module, example: torch.Tensor) -> None:
        self.model = copy.deepcopy(model).cpu().eval()
        self.spec = adapter_for(self.model).pruning_spec(self.model)
        self.score_levels = dict(self.spec.score_levels)
        self.example = example.detach().cpu()
        self.names = {m: n for n, m in self.model.named_modules()}
        self.graph = _graph(self.model, self.spec, self.example)
        DG, units = self.graph
        self.groups = {u.key: DG.get_pruning_group(u.module, u.fn, list(range(u.size))) for u in units}


_GRAPHS: dict[tuple, _ArchitectureGraph] = {}
_GRAPHS_KEPT = 8   # architectures kept (least recently used dropped)


def _architecture_key(model: nn.Module, example: torch.Tensor) -> tuple:
    return (type(model).__qualname__, tuple((k, tuple(v.shape)) for k, v in model.state_dict().items()),
            tuple(example.shape[1:]))


@_with_autograd
def keep_indices(model: nn.Module, target: nn.Module, *, scores: Mapping[str, torch.Tensor] | None = None,
                 fusion_inputs: torch.Tensor | None = None, criterion: str = "auto",
                 **options) -> tuple[dict[str, tuple[nn.Module, bool, torch.Tensor]], str]:
    """Which channels ``prune(model, target=target, ...)`` keeps, without building the pruned model.

    The same importance ranking and plan as ``prune_result`` with ``target=`` (same ``criterion`` resolution,
    same Torch-Pruning groups), on a per-architecture cached dependency graph, and no MAC counting or pruned
    copy: the per-round path of capacity tiers (``fedfuse.hetero.prune.prune_order``), where the architecture
    repeats every round and only the weights change.

    Args:
        model: the model to rank (not modified; its weights are copied into the cached graph's modules).
        target: a narrower architecture of the same family and depth (weights ignored).
        scores, fusion_inputs, criterion, options: as ``prune_result``'s.
    Returns:
        ``({group key: (root module of ``model``, out, kept)}, criterion)``: for every coupled channel group, its
        root layer (a module of ``model``), whether the group is the root's output (``True``) or input channels,
        and the kept root indices ``[kept] int64``, ascending (the order the pruned model holds them in); and the
        criterion used (``auto`` resolved).
    Raises:
        ValueError: what ``prune_result`` raises for these arguments; a target of another depth (use
        ``prune_result``, which drops blocks) or attention heads (their units are head-major: use
        ``prune_result``).
    """
    req, adapter = _check_request(model, None, None, target, scores, fusion_inputs, criterion, False, False, None,
                                  None, options)
    if len(adapter.blocks(target)) != len(adapter.blocks(model)):
        raise ValueError("keep_indices: target has another depth than the model; use prune_result (drops blocks)")
    example = _example(model, adapter, req.fusion_inputs, req.options.input_shape).cpu()
    key = _architecture_key(model, example)
    arch = _GRAPHS.pop(key, None)
    if arch is None:
        arch = _ArchitectureGraph(model, example)
    _GRAPHS[key] = arch
    while len(_GRAPHS) > _GRAPHS_KEPT:
        _GRAPHS.pop(next(iter(_GRAPHS)))
    work = arch.model
    with torch.no_grad():
        work.load_state_dict(model.state_dict())
    work.eval()
    if req.criterion == "taylor":
        _taylor_gradients(work, req.fusion_inputs, None, None, req.options.batch_size)
    try:
        importance, units = _importances(work, arch.spec, arch.example, req.criterion, scores, arch.score_levels,
                                         graph=arch.graph, groups=arch.groups)
    finally:
        work.zero_grad(set_to_none=True)
    plan = _plan_target(work, units, target)
    own = dict(model.named_modules())
    out = {}
    for u in units:
        if u.heads:
            raise ValueError("keep_indices: attention heads are not supported (head-major units); use prune_result")
        removed = set(_removal(u, importance[u.key], plan[u.key])) if u.key in plan else set()
        kept = torch.tensor([i for i in range(u.size) if i not in removed], dtype=torch.long)
        out[u.key] = (own[arch.names[u.module]], u.out, kept)
    return out, req.criterion


@_with_autograd
def prune_result(model: nn.Module, params_ratio: float | None = None, *, macs_ratio: float | None = None,
                 target: nn.Module | None = None, scores: Mapping[str, torch.Tensor] | None = None,
                 fusion_inputs: torch.Tensor | None = None, criterion: str = "auto", prune_blocks: bool | int = False,
                 recover: bool | Mapping[str, Any] = False, teachers: list[nn.Module] | None = None,
                 weights: list[float] | None = None, device: str | torch.device = "cpu", seed: int = 0,
                 **options) -> PruneResult:
    """Like ``prune`` but returns a ``PruneResult`` (model + achieved params/MACs and diagnostics + seconds)."""
    t0 = time.perf_counter()
    req, adapter = _check_request(model, params_ratio, macs_ratio, target, scores, fusion_inputs, criterion,
                                  prune_blocks, recover, teachers, weights, options)
    o, criterion = req.options, req.criterion
    dev = resolve_device(device)
    if teachers is not None:
        teachers = [copy.deepcopy(t).to(dev).eval() for t in teachers]
    w = normalise_weights(weights, len(teachers)) if teachers else None
    info: dict[str, Any] = {"criterion": criterion,
                            "requested": {req.goal_name: req.goal if req.goal is not None else "target"}}

    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        work = copy.deepcopy(model).to(dev).eval()
        x = req.fusion_inputs.to(dev) if req.fusion_inputs is not None else None
        example = _example(work, adapter, x, o.input_shape).to(dev)
        params0, macs0 = count_params(work), count_macs(work, example)
        score_levels = dict(adapter.pruning_spec(work).score_levels)  # before any block is renumbered

        def measure(m: nn.Module) -> float:
            return count_params(m) / params0 if req.macs_ratio is None else count_macs(m, example) / macs0

        # ---- 1. blocks
        drop = _blocks_to_drop(work, adapter, target, x, req, measure, info)
        if drop:
            adapter.remove_blocks(work, drop)
        info["blocks_removed"] = sorted(drop)

        # ---- 2. importance
        spec = adapter.pruning_spec(work)
        if criterion == "taylor":
            info["taylor_loss"] = _taylor_gradients(work, x, teachers, w, o.batch_size)
        importance, units = _importances(work, spec, example, criterion, scores, score_levels)
        work.zero_grad(set_to_none=True)

        # ---- 3. plan and prune
        def build(plan) -> nn.Module:
            m = copy.deepcopy(work)
            _apply(m, plan, importance, example)
            return m

        if target is not None:
            plan = _plan_target(work, units, target)
            pruned, k = build(plan), None
        else:
            k, pruned, plan = _search_fraction(build, measure, units, req.goal, o)
        pruned = pruned.eval()
        info["keep_fraction"] = k
        info["widths"] = {key: (list(v) if isinstance(v, tuple) else v) for key, v in plan.items()}

        # ---- 4. recovery
        if recover is not False:
            ropts = parse_options("prune", DistillRefineOptions, recover if isinstance(recover, Mapping) else {},
                                  what="prune: recover")
            tch = teachers if teachers else [copy.deepcopy(model).to(dev).eval()]
            tw = w if teachers else [1.0]
            info["recover"] = distill_ensemble(pruned, tch, tw, x, ropts, seed=seed, device=dev)

        params1, macs1 = count_params(pruned), count_macs(pruned, example)
    info.update(params_before=params0, params=params1, params_ratio=params1 / params0, macs_before=macs0, macs=macs1,
                macs_ratio=macs1 / macs0)
    _check_reached(info, req, target, pruned)
    pruned = pruned.cpu().eval()
    for p in pruned.parameters():
        p.requires_grad_(True)
    return PruneResult(model=pruned, info=info, seconds=time.perf_counter() - t0)


def prune(model: nn.Module, params_ratio: float | None = None, *, macs_ratio: float | None = None,
          target: nn.Module | None = None, scores: Mapping[str, torch.Tensor] | None = None,
          fusion_inputs: torch.Tensor | None = None, criterion: str = "auto", prune_blocks: bool | int = False,
          recover: bool | Mapping[str, Any] = False, teachers: list[nn.Module] | None = None,
          weights: list[float] | None = None, device: str | torch.device = "cpu", seed: int = 0,
          **options) -> nn.Module:
    """Structured pruning of ``model`` into a new, physically smaller module of its family.

    Args:
        model: an ``nn.Sequential`` MLP/CNN, a fedfuse ``ResNet`` or a timm ``VisionTransformer``; not modified.
        params_ratio: keep this fraction (0, 1] of the parameters (±``tolerance``), or
        macs_ratio: keep this fraction of the multiply-accumulates per sample, or
        target: prune to exactly this module's architecture (same family and layout, no wider anywhere, its
            weights ignored), e.g. ``build_model(..., width_mult=0.5)`` or a shallower ViT. Exactly one of the three.
        scores: optional client importance (``neuron_importance`` dict, level name → scores).
        fusion_inputs: unlabeled server data ``[B, *input_shape]`` (Taylor importance, block redundancy, recovery).
        criterion: ``"magnitude"`` | ``"taylor"`` | ``"scores"`` | ``"auto"`` (the family's best measured
            criterion, ``Adapter.pruning_criterion``: Taylor for ViTs when there are fusion inputs, magnitude
            otherwise; ``docs/measurements-fusion.md``).
        prune_blocks: ``True`` drops the most redundant residual blocks (input/output cosine similarity on the
            fusion set ≥ ``block_similarity``) while the model stays at or above the requested size; an int drops
            exactly that many; ``False`` none.
        recover: ``True`` (or a table of ``DistillRefineOptions``: epochs, lr, batch_size, temperature, holdout,
            patience) distils the ``teachers`` (default: the unpruned model) into the pruned model on
            ``fusion_inputs`` with held-out early stopping.
        teachers, weights: the ensemble for the Taylor loss and for recovery, and its weights.
        device: where pruning and recovery run (CUDA when given; nothing requires it).
        seed: seeds the recovery split and any random choice.
        **options: ``PruneOptions`` (attention, round_to, tolerance, search_steps, block_similarity, max_blocks,
            batch_size, input_shape); an unknown key raises ``FusionOptionError`` (a ``ValueError``) naming it.
    Returns:
        A new ``nn.Module`` on CPU in eval mode mapping ``[N, *input_shape]`` to logits; ``adapter_for`` and
        ``levels`` work on it.
    Raises:
        ValueError naming the argument: a ratio outside (0, 1], none or more than one of params_ratio /
        macs_ratio / target, a target of another family or wider than the model, an unknown option.
    """
    return prune_result(model, params_ratio, macs_ratio=macs_ratio, target=target, scores=scores,
                        fusion_inputs=fusion_inputs, criterion=criterion, prune_blocks=prune_blocks, recover=recover,
                        teachers=teachers, weights=weights, device=device, seed=seed, **options).model


__all__ = ["prune", "prune_result", "keep_indices", "PruneResult", "PruneOptions", "CRITERIA", "count_params", "count_macs",
           "block_similarity", "score_importance"]
