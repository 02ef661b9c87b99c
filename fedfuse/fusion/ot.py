"""OT fusion: align every client to the reference with layer-wise optimal transport, then average.

Papers: OTFusion (Singh & Jaggi, "Model Fusion via Optimal Transport", NeurIPS 2020, arXiv 1910.05653) and
its transformer extension (Imfeld et al., "Transformer Fusion with Optimal Transport", ICLR 2024, arXiv 2310.05719). Implemented: the layer-wise transport primitive, the ground
cost from activations or weights, exact EMD or Sinkhorn plans, the transport-map flow through LayerNorm,
Q/K/V/out projections, MLP and residual connections (with the residual policies), n > 2 models against one
anchor (every tensor with the same model weights, unlike the reference code's α) and different widths
fused into the anchor's width with column-normalised maps. Written fresh from the papers (POT for the
solvers).

For each model ``k ≥ 1`` (A) and the anchor model 0 (B), groups are visited in forward order; each
gets a ground cost between A's and B's units,

- ``cost="activations"``: Euclidean distance between the units' (z-scored, ``standardize``) activation
  vectors over (sample, position/token) rows of the fusion set;
- ``cost="weights"``: Euclidean distance between unit-normalised weight rows (incoming weights, biases,
  norm parameters), A's inputs already moved by the maps of earlier groups;

and a plan ``P`` (``solver="emd"`` exact, ``"sinkhorn"`` entropic with ``reg`` on the max-normalised
cost) with uniform marginals or, with ``marginals="importance"``, the clients' importance scores.
Attention groups are head-preserving by default (head pairing by the units' OT cost, plans inside
matched heads); ``head_preserving=False`` gives the reference code's cross-head plans. The class layer
is aligned on its inputs only (transporting its outputs would permute the classes of clients that saw
different classes). Residual streams of timm ViTs: ``residual="tied"``
(one plan for the whole stream, exact under permutations) or the reference policies ``"mean"``,
``"no_resid"``, ``"only_resid"`` over per-position plans (the transformer paper's residual policies). Finally the aligned models are
averaged with ``weights``, BN statistics are re-estimated on the fusion set, and an optional short
fine-tuning stage runs (off by default).
"""

from __future__ import annotations

import copy
import time
import typing
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fedfuse.fusion.registry import IncompatibleModelsError, MissingInputError, register, require
from fedfuse.fusion.permute import (load_state, AlignedAverage, Map, PermSpec, activation_cost, apply_maps, block_paths,
                                    build_spec, check_compatible, collect_activations, marginal_from_scores,
                                    solve_group, standardize, state_on, weight_cost, weight_features)
from fedfuse.fusion.rebasin import AlignOptions, finish
from fedfuse.fusion.selective import fuse_selective

ResidualPolicy = Literal["tied", "mean", "no_resid", "only_resid"]
POLICIES = typing.get_args(ResidualPolicy)


def ot_align(model_a: nn.Module, model_b: nn.Module, *, fusion_inputs=None, cost: str = "activations",
             solver: str = "emd", reg: float = 0.05, residual: str = "tied", head_preserving: bool = True,
             scores_a=None, scores_b=None, std: bool = True, max_rows: int = 4096, acts_b=None, spec_b=None,
             seed: int = 0, device="cpu") -> tuple[dict, dict[str, Map], PermSpec, PermSpec]:
    """Maps moving model A onto anchor B; returns ``(aligned state of A in B's shapes, maps, spec_a, spec_b)``."""
    layout = "tied" if residual == "tied" else "untied"
    spec_a = build_spec(model_a, layout)
    spec_b = spec_b or build_spec(model_b, layout)
    state_a, state_b = state_on(model_a, device), state_on(model_b, device)
    check_compatible(spec_a, spec_b, state_a, state_b)
    if cost == "activations":
        acts_a = collect_activations(model_a, spec_a, fusion_inputs, max_rows=max_rows, seed=seed, device=device)
        if std:
            acts_a = {g: standardize(v) for g, v in acts_a.items()}
        if acts_b is None:
            acts_b = collect_activations(model_b, spec_b, fusion_inputs, max_rows=max_rows, seed=seed, device=device)
            if std:
                acts_b = {g: standardize(v) for g, v in acts_b.items()}
    maps: dict[str, Map] = {}
    prev_stream: Map | None = None
    for g, ga in spec_a.groups.items():
        gb = spec_b.groups[g]
        if cost == "activations":
            c = activation_cost(acts_a[g], acts_b[g], std=False)  # standardised once above
        else:
            fa, fb = weight_features(state_a, state_b, spec_a, spec_b, g, maps, ("out",), require_mapped=True)
            c = weight_cost(fa, fb)
        a = marginal_from_scores(scores_a, ga)
        b = marginal_from_scores(scores_b, gb)
        if (a is None) != (b is None):
            a = b = None
        m = solve_group(c, ga, gb, solver=solver, reg=reg, a=a, b=b, head_preserving=head_preserving)
        if ga.position is not None:  # untied ViT residual stream: combine with the skip path's map
            if prev_stream is not None and residual != "no_resid":
                if residual == "only_resid":
                    m = prev_stream
                elif residual == "mean":
                    m = Map.from_plan(0.5 * (prev_stream.plan / prev_stream.plan.sum() + m.plan / m.plan.sum()))
            prev_stream = m
        maps[g] = m
    return apply_maps(state_a, spec_a, spec_b, maps, state_b), maps, spec_a, spec_b


@dataclass(frozen=True)
class OTOptions(AlignOptions):
    """Options of ``ot`` (plus ``reset_bn`` and ``finetune`` of ``AlignOptions``).

    Attributes:
        cost: ``"activations"`` | ``"weights"`` (``None`` = activations when a fusion set is given).
        solver: ``"emd"`` (exact; permutations for equal widths) | ``"sinkhorn"`` (entropic, soft plans).
        reg: Sinkhorn ε on the max-normalised cost (0.05–0.1 works); must be > 0 for ``"sinkhorn"``.
        marginals: ``"uniform"`` | ``"importance"`` (the clients' per-unit scores as OT marginals).
        residual: ViT residual policy ``"tied"`` | ``"mean"`` | ``"no_resid"`` | ``"only_resid"``.
        head_preserving: head-structured attention plans (default) or cross-head (reference code).
        std: z-score activations per unit before the cost.
        max_rows: activation rows per hook point.
        anchor: index of the model whose architecture the fused model takes (the OT reference B; default
            model 0). Another anchor, and models of different depths (ViTs: blocks matched by CKA on the
            fusion set), run through ``fedfuse.fusion.selective`` (``residual="tied"``, activation cost).
        selective: importance-conditioned ("selective" / conditional) transport, ``fedfuse.fusion.selective``:
            mass ∝ unit importance, heads as units, low-importance / unmatched units keep the anchor's
            values. The options below apply only with ``selective=true``.
        importance: ``"auto"`` (the clients' scores where they cover a group, else a Taylor score
            ``|a·∂KL(ensemble‖model)/∂a|`` on the fusion set) | ``"taylor"`` | ``"activation"`` (mean
            ``|a|``) | ``"uniform"`` (every unit equal: ordinary OT plans with balanced transport).
        transport: ``"partial"`` (POT ``ot.partial``: only ``mass`` of the importance mass moves) |
            ``"unbalanced"`` (POT ``ot.unbalanced``, marginal penalty ``reg_m``) | ``"balanced"``.
        mass: fraction of the importance mass that partial transport moves, in (0, 1] (1 = balanced).
        reg_m: marginal relaxation of unbalanced transport (> 0; larger = closer to balanced).
        min_importance: units below this multiple of their group's mean importance get no mass (stay
            unmatched, the anchor's values kept); 0 = none excluded.
    """

    cost: Literal["activations", "weights"] | None = None
    solver: Literal["emd", "sinkhorn"] = "emd"
    reg: float = 0.05
    marginals: Literal["uniform", "importance"] = "uniform"
    residual: ResidualPolicy = "tied"
    head_preserving: bool = True
    std: bool = True
    max_rows: int = 4096
    anchor: int = 0
    selective: bool = False
    importance: Literal["auto", "taylor", "activation", "uniform"] = "auto"
    transport: Literal["partial", "unbalanced", "balanced"] = "partial"
    mass: float = 0.7
    reg_m: float = 1.0
    min_importance: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.anchor >= 0, "anchor", ">= 0", self.anchor)
        require(0 < self.mass <= 1, "mass", "in (0, 1]", self.mass)
        require(self.reg_m > 0, "reg_m", "> 0", self.reg_m)
        require(self.min_importance >= 0, "min_importance", ">= 0", self.min_importance)
        require(self.solver != "sinkhorn" or self.reg > 0, "reg", "> 0 for solver='sinkhorn'", self.reg)
        require(self.max_rows >= 1, "max_rows", ">= 1", self.max_rows)

    def reads_client_scores(self) -> bool:
        """Importance marginals and selective transport (``importance="auto"``) read the clients' scores
        (``MethodSpec.reads_client_scores``)."""
        return self.marginals == "importance" or (self.selective and self.importance == "auto")


PAPER_OT = ('Optimal-transport fusion (Singh & Jaggi, "Model Fusion via Optimal Transport", arXiv 1910.05653).')
@register("ot", paper=PAPER_OT, options=OTOptions, needs_data=False, uses_scores=True, mixed_widths=True, any_reference=True)
def fuse_ot(models, *, fusion_inputs, scores, weights, device, seed, options: OTOptions, info: dict,
            reference: nn.Module | None = None) -> nn.Module:
    """OTFusion of ``models`` (any widths, same depth/family) into model 0's architecture, or onto ``reference``
    (model 0's architecture) when given: every model is transported onto its units and the reference itself is
    not averaged in.

    Uses the fusion set when given (activation cost, BN re-estimation); without one, the weight cost.
    Fixed point: copies of one model are transported by the identity plan and average back to it.
    ``info``: ``cost``, ``solver``, per-model ``trace_ratio`` per group, timings (``finetune`` losses).
    """
    o = options
    cost = o.cost or ("activations" if fusion_inputs is not None else "weights")
    if cost == "activations" and fusion_inputs is None:
        raise MissingInputError("ot: cost='activations' needs fusion_inputs")
    if o.marginals == "importance" and scores is None:
        raise MissingInputError("ot: marginals='importance' needs scores (one dict per model)")
    t0 = time.perf_counter()
    selective = o.selective or o.anchor != 0 or len({len(block_paths(m)) for m in models}) > 1
    if reference is not None and selective:
        raise IncompatibleModelsError("ot: reference= aligns onto a separate model; it does not combine with "
                                      "selective=true, anchor > 0 or models of different depths")
    if selective:
        if cost != "activations":
            raise MissingInputError("ot: selective=true, anchor > 0 and models of different depths need the "
                                    "activation cost (fusion_inputs)")
        fused, moved = fuse_selective(models, fusion_inputs=fusion_inputs, scores=scores, weights=weights,
                                      device=device, seed=seed, opts=o, info=info)
        info.update(cost=cost, solver=o.solver, align_seconds=time.perf_counter() - t0)
        # copies of the anchor (nothing moved) keep its BatchNorm statistics: the fixed point
        reset = o.reset_bn if o.reset_bn is not None else (fusion_inputs is not None and moved)
        return finish(fused, models, fusion_inputs, reset_bn=reset, finetune=o.finetune, weights=weights,
                      device=device, seed=seed, info=info)
    ref = models[0] if reference is None else reference
    first = 1 if reference is None else 0   # the models transported onto ref (all of them when ref is a reference)
    layout = "tied" if o.residual == "tied" else "untied"
    spec_b = build_spec(ref, layout)
    acts_b = (collect_activations(ref, spec_b, fusion_inputs, max_rows=o.max_rows, seed=seed, device=device)
              if cost == "activations" else None)
    if acts_b is not None and o.std:
        acts_b = {g: standardize(v) for g, v in acts_b.items()}
    avg = AlignedAverage()   # each aligned state is added as it is made, then dropped
    if first:
        avg.add(state_on(ref, device), weights[0])
    info.update(cost=cost, solver=o.solver, trace_ratio=[], reference="model 0" if first else "given")
    for k, model in list(enumerate(models))[first:]:
        try:
            aligned, maps, _, _ = ot_align(
                model, ref, fusion_inputs=fusion_inputs, cost=cost, solver=o.solver, reg=o.reg, residual=o.residual,
                head_preserving=o.head_preserving, std=o.std, max_rows=o.max_rows, acts_b=acts_b, spec_b=spec_b,
                seed=seed, scores_a=scores[k] if o.marginals == "importance" else None,
                scores_b=scores[0] if o.marginals == "importance" and first else None, device=device)
        except ValueError as err:
            raise IncompatibleModelsError(f"ot: model {k} cannot be aligned to "
                                          f"{'model 0' if first else 'the reference'}: {err}") from None
        info["trace_ratio"].append({g: m.trace_ratio() for g, m in maps.items()})
        avg.add(aligned, weights[k])
        del aligned
    fused = copy.deepcopy(ref).cpu()
    load_state(fused, avg.result())
    info["align_seconds"] = time.perf_counter() - t0
    return finish(fused, models, fusion_inputs, reset_bn=o.reset_bn, finetune=o.finetune, weights=weights,
                  device=device, seed=seed, info=info)
