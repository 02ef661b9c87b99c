"""Git Re-Basin fusion: permutation matching of every client to the reference, then averaging.

Paper: Ainsworth, Hayase & Srinivasa, "Git Re-Basin: Merging Models modulo Permutation Symmetries",
ICLR 2023, arXiv 2209.04836 (and its weight-matching core as TransFusion reuses it). Written fresh from
the papers.

- *Weight matching*: maximise ``Σ_ℓ ⟨W_ℓ^B, P_ℓ W_ℓ^A P_{ℓ-1}ᵀ⟩`` by coordinate descent over the
  permutation groups (each step a linear assignment, ``scipy.optimize.linear_sum_assignment``, summing
  every tensor the group touches: its rows, the next layer's columns, biases, norm parameters), until a
  sweep improves nothing (≤ ``max_iter`` sweeps). Groups are visited in random order (seeded).
  Initialisation: the paper's identity, or (default, not in the paper) one sequential forward pass that
  matches each group on its rows given the inputs already matched.
- *Activation matching*: per group, maximise the cross-correlation of the units' activations on the
  fusion set (one assignment per group, no iteration).
- Attention heads (timm ViT) are matched head-preservingly: the head pairing minimises the best
  within-head assignment cost ("brute-force" head matching, TransFusion's ablation baseline),
  so permutations never mix heads and the permuted model computes the same function.
- Then (importance-)weighted averaging: model weights ``weights`` (e.g. client sample counts), and
  per-unit importance weights when ``scores`` are given.
- BatchNorm running statistics are re-estimated on the fusion set after fusion (the known failure of
  averaged BN statistics, themrzmaster/git-re-basin-pytorch#3).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fedfuse.fusion.finetune import FinetuneOptions, finetune_options, run_finetune
from fedfuse.fusion.registry import IncompatibleModelsError, MissingInputError, register, require
from fedfuse.fusion.permute import (load_state, AlignedAverage, Map, PermSpec, apply_maps, assignment, build_spec,
                                    check_compatible, collect_activations, has_batchnorm, reset_bn_stats, score_cost, solve_group,
                                    standardize, state_on, weight_score)


def _objective(score: torch.Tensor, m: Map) -> float:
    """``⟨score, plan⟩`` for a permutation map (score ``[m_A, m_B]``)."""
    return float((score.double().cpu() * m.plan).sum())


def weight_matching(state_a: dict, state_b: dict, spec_a: PermSpec, spec_b: PermSpec, *, max_iter: int = 100,
                    init: str = "sequential", order: str = "random", seed: int = 0, head_preserving: bool = True,
                    head_costs: dict[str, torch.Tensor] | None = None, intra: bool = True,
                    groups: list[str] | None = None) -> tuple[dict[str, Map], dict]:
    """Permutations moving model A onto model B by weight matching (coordinate descent).

    Args:
        state_a, state_b: state dicts of equal-width models with specs ``spec_a``/``spec_b``.
        init: ``"identity"`` (Ainsworth et al.) or ``"sequential"`` (one forward pass on rows).
        order: ``"random"`` (seeded), ``"forward"`` or ``"backward"`` group order per sweep.
        head_costs: optional fixed ``{group: [H, H]}`` head-pairing costs (TransFusion's spectral step);
            other block-structured groups use the brute-force head pairing.
        intra: with ``head_costs``, refine within-head orders (False keeps each head's natural order).
        groups: restrict matching to these groups (others stay identity).
    Returns:
        ``(maps {group: Map}, info {"sweeps": int, "objective": float})``.
    """
    names = list(spec_a.groups) if groups is None else list(groups)
    for g in spec_a.groups:
        if spec_a.groups[g].size != spec_b.groups[g].size:
            raise IncompatibleModelsError(f"weight matching needs equal widths; group {g} has {spec_a.groups[g].size} vs "
                             f"{spec_b.groups[g].size} units (use method 'ot' for different widths)")
    head_costs = head_costs or {}
    maps: dict[str, Map] = {}
    b_slices: dict = {}   # B's weight slices per (entry, axis), reused by every sweep (B does not move)
    # the scores' products in float32, A converted once (not once per tensor per group per sweep): about 1.7 times
    # faster than float64 on a CPU, and on 4 ResNet-18s every permutation equal to float64's (docs/scaling.md);
    # the objective and the assignment's costs stay float64
    state_a = {k: v.detach().float() if v.is_floating_point() else v for k, v in state_a.items()}

    def solve(g: str, roles, require_mapped) -> tuple[Map, torch.Tensor]:
        score = weight_score(state_a, state_b, spec_a, spec_b, g, maps, roles, require_mapped, b_slices,
                             dtype=torch.float32)
        ga, gb = spec_a.groups[g], spec_b.groups[g]
        if g in head_costs and not intra:
            d = ga.size // ga.blocks
            hp = assignment(head_costs[g], maximize=False)
            perm = torch.cat([hp[j] * d + torch.arange(d) for j in range(ga.blocks)])
            return Map.from_perm(perm), score
        m = solve_group(score_cost(score), ga, gb, solver="lap", head_preserving=head_preserving,
                        head_cost=head_costs.get(g))
        return m, score

    if init == "sequential":
        for g in names:
            maps[g], _ = solve(g, ("out",), True)
    elif init == "identity":
        pass
    else:
        raise ValueError(f"weight matching: init must be 'sequential' or 'identity', got {init!r}")
    for g, grp in spec_a.groups.items():
        maps.setdefault(g, Map.identity(grp.size))
    gen = torch.Generator().manual_seed(seed)
    sweeps, obj = 0, float("nan")
    # a group's score reads only the maps of the other groups on its tensors: while none of them has moved since the
    # group was last solved, solving it again gives the same answer, so it is skipped (exact; the last sweep, which
    # only confirms convergence, mostly skips)
    neighbours = {g: sorted({o.group for e, _ in spec_a.entries_of(g) for o in e.axes if o.group != g})
                  for g in names}
    moved = {g: 0 for g in spec_a.groups}
    solved: dict[str, tuple[tuple, float]] = {}   # group -> (its neighbours' move counts, objective) at its last solve
    for sweep in range(max_iter):
        if order == "random":
            seq = [names[i] for i in torch.randperm(len(names), generator=gen)]
        elif order == "forward":
            seq = names
        elif order == "backward":
            seq = names[::-1]
        else:
            raise ValueError(f"weight matching: order must be random, forward or backward, got {order!r}")
        improved = False
        sweeps = sweep + 1
        for g in seq:
            state = tuple(moved[o] for o in neighbours[g])
            if g in solved and solved[g][0] == state:
                obj = solved[g][1]
                continue
            new, score = solve(g, ("out", "in"), False)
            old_v, new_v = _objective(score, maps[g]), _objective(score, new)
            if new_v > old_v + 1e-12 * max(1.0, abs(old_v)):
                maps[g] = new
                moved[g] += 1
                improved = True
            obj = max(old_v, new_v)
            solved[g] = (state, obj)
        if not improved:
            break
    return maps, {"sweeps": sweeps, "objective": obj}


def activation_matching(acts_a: dict[str, torch.Tensor], acts_b: dict[str, torch.Tensor], spec_a: PermSpec,
                        spec_b: PermSpec, *, head_preserving: bool = True) -> dict[str, Map]:
    """Permutation per group maximising the correlation of activations ``[S, m]`` (standardised)."""
    maps = {}
    for g in spec_a.groups:
        za, zb = standardize(acts_a[g].double()), standardize(acts_b[g].double())
        corr = za.t() @ zb / max(1, len(za))
        maps[g] = solve_group(score_cost(corr), spec_a.groups[g], spec_b.groups[g], solver="lap",
                              head_preserving=head_preserving)
    return maps


def unit_weights_for(scores: dict[str, torch.Tensor] | None, spec: PermSpec, maps: dict[str, Map]) -> dict[str, torch.Tensor]:
    """Per-unit importance ``{group: [m_B]}`` of a model in the reference's units (ones where no score).

    Scores of a group's levels are averaged (raw scale, so that models compare unit by unit), then moved
    with the group's map.
    """
    out = {}
    for g, grp in spec.groups.items():
        vecs = [scores[lv].detach().double().cpu().flatten() for lv in grp.levels
                if scores is not None and lv in scores and scores[lv].numel() == grp.size]
        if vecs:
            s = torch.stack(vecs).mean(0).clamp_min(0) + 1e-12  # raw scale: compared across models
        else:
            s = torch.ones(grp.size, dtype=torch.float64)
        m = maps[g]
        out[g] = s.index_select(0, m.perm) if m.perm is not None else s @ m.out_map()
    return out


def finish(fused: nn.Module, models: list[nn.Module], fusion_inputs, *, reset_bn: bool | None,
           finetune: FinetuneOptions | None, weights, device, seed, info: dict) -> nn.Module:
    """Shared tail of ot/rebasin/transfusion: BN re-estimation, optional fine-tuning; timings into ``info``."""
    if reset_bn is None:
        reset_bn = fusion_inputs is not None
    if reset_bn and has_batchnorm(fused):
        if fusion_inputs is None:
            raise MissingInputError("reset_bn=True needs fusion_inputs to re-estimate BatchNorm statistics")
        t0 = time.perf_counter()
        reset_bn_stats(fused, fusion_inputs, device=device)
        info["bn_reset_seconds"] = time.perf_counter() - t0
    if finetune is not None:
        if fusion_inputs is None:
            raise MissingInputError("finetune needs fusion_inputs (the fusion set)")
        info["finetune"] = run_finetune(fused, models, fusion_inputs, finetune, weights=weights, device=device,
                                        seed=seed)
    return fused.cpu().eval()


@dataclass(frozen=True)
class AlignOptions:
    """Options shared by the align-then-average methods (``ot``, ``rebasin``, ``transfusion``).

    Attributes:
        reset_bn: re-estimate BatchNorm statistics on the fusion set after averaging (``None`` = when a
            fusion set is given).
        finetune: optional post-fusion distillation (``fedfuse.fusion.finetune``): a table of
            ``FinetuneOptions`` (``{epochs=3, lr=1e-3}``), ``true`` for the defaults or an epoch count;
            normalised to ``FinetuneOptions | None``.
    """

    reset_bn: bool | None = None
    finetune: FinetuneOptions | dict | bool | int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "finetune", finetune_options(self.finetune))


@dataclass(frozen=True)
class RebasinOptions(AlignOptions):
    """Options of ``rebasin``.

    Attributes:
        matching: ``"weights"`` | ``"activations"`` (``None`` = activations when a fusion set is given).
        max_iter, init, order: weight-matching coordinate descent (see ``weight_matching``).
        head_preserving: keep attention heads intact (required for function preservation).
        importance_weighted: with ``scores``, average each unit with per-unit importance weights.
        max_rows: activation rows per hook point.
    """

    matching: Literal["weights", "activations"] | None = None
    max_iter: int = 100
    init: Literal["sequential", "identity"] = "sequential"
    order: Literal["random", "forward", "backward"] = "random"
    head_preserving: bool = True
    importance_weighted: bool = True
    max_rows: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_iter >= 0, "max_iter", ">= 0", self.max_iter)
        require(self.max_rows >= 1, "max_rows", ">= 1", self.max_rows)

    def reads_client_scores(self) -> bool:
        """Scores weight the aligned average only with ``importance_weighted`` (``MethodSpec.reads_client_scores``)."""
        return self.importance_weighted


PAPER_REBASIN = ('Git Re-Basin alignment then averaging (Ainsworth et al., "Git Re-Basin: Merging Models modulo '
                 'Permutation Symmetries", arXiv 2209.04836).')
@register("rebasin", paper=PAPER_REBASIN, options=RebasinOptions, needs_data=False, uses_scores=True, any_reference=True)
def fuse_rebasin(models, *, fusion_inputs, scores, weights, device, seed, options: RebasinOptions,
                 info: dict, reference: nn.Module | None = None) -> nn.Module:
    """Git Re-Basin fusion of ``models`` into model 0's units (equal widths required), or into ``reference``'s
    units when given: then every model is matched onto it and the reference itself is not averaged in.

    Uses the fusion set when given (activation matching, BN re-estimation); without one, weight matching.
    Fixed point: copies of one model match by the identity and average back to it.
    ``info``: ``matching``, per-model ``trace_ratio`` per group, ``sweeps`` (weight matching), timings.
    """
    o = options
    matching = o.matching or ("activations" if fusion_inputs is not None else "weights")
    if matching == "activations" and fusion_inputs is None:
        raise MissingInputError("rebasin: activation matching needs fusion_inputs")
    t0 = time.perf_counter()
    ref = models[0] if reference is None else reference
    first = 1 if reference is None else 0   # the models matched onto ref (all of them when ref is a reference)
    spec_b = build_spec(ref)
    state_b = state_on(ref, device)
    acts_b = (collect_activations(ref, spec_b, fusion_inputs, max_rows=o.max_rows, seed=seed, device=device)
              if matching == "activations" else None)
    info.update(matching=matching, trace_ratio=[], reference="model 0" if first else "given")
    maps0 = {g: Map.identity(grp.size) for g, grp in spec_b.groups.items()}
    use_scores = scores is not None and o.importance_weighted
    avg = AlignedAverage(spec_b, per_unit=use_scores)   # each aligned state is added as it is made, then dropped
    if first:
        avg.add(state_b, weights[0], unit_weights_for(scores[0], spec_b, maps0) if use_scores else None)
    for k, model in list(enumerate(models))[first:]:
        spec_a = build_spec(model)
        state_a = state_on(model, device)
        try:
            check_compatible(spec_a, spec_b, state_a, state_b, same_width=True)
        except ValueError as err:
            raise IncompatibleModelsError(f"rebasin: model {k} cannot be matched to "
                                          f"{'model 0' if first else 'the reference'}: {err}") from None
        if matching == "weights":
            maps, wm = weight_matching(state_a, state_b, spec_a, spec_b, max_iter=o.max_iter, init=o.init,
                                       order=o.order, seed=seed, head_preserving=o.head_preserving)
            info.setdefault("sweeps", []).append(wm["sweeps"])
        else:
            acts_a = collect_activations(model, spec_a, fusion_inputs, max_rows=o.max_rows, seed=seed, device=device)
            maps = activation_matching(acts_a, acts_b, spec_a, spec_b, head_preserving=o.head_preserving)
        info["trace_ratio"].append({g: m.trace_ratio() for g, m in maps.items()})
        avg.add(apply_maps(state_a, spec_a, spec_b, maps, state_b), weights[k],
                unit_weights_for(scores[k], spec_a, maps) if use_scores else None)
    fused = copy.deepcopy(ref).cpu()
    load_state(fused, avg.result())
    info["align_seconds"] = time.perf_counter() - t0
    return finish(fused, models, fusion_inputs, reset_bn=o.reset_bn, finetune=o.finetune, weights=weights,
                  device=device, seed=seed, info=info)
