"""Tier models by structured pruning that stay nested top-left slices of the global model (``tier-models='prune'``).

Capacity tiers are index slices of the global model: a client of tier ``r`` trains units ``0..⌈r·C⌉-1`` of every
hidden group, and its reply is averaged / fused back into exactly those positions (``fedfuse.hetero.submodel``;
the tier guard's history, commits 2c9d211 / ff2b60e: the tiers must stay nested slices of the global). Structured
pruning (``fedfuse.pruning.prune(global, target=tier)``) keeps the *most important* units instead, wherever they
are. Both are reconciled by a function-preserving permutation of the global model: pruning only *chooses which units
the slice keeps*.

``prune_order`` prunes tier by tier, widest narrow tier first, each from the next wider tier's model (the global
model for the widest, then the previous tier's slice), finds which units the pruned model kept
(``kept_units``: exact matching of the pruned tensors to the wider model's), and permutes the global model's units
so that those come first, in their order (the rest keep their relative order behind them). The permuted global
model computes the same function, and every tier's pruned model is exactly its top-left slice, nested in the wider
tiers' slices. Recovery (distilling the round's clients into a tier's slice) is the caller's (it changes the tier
model's weights, not which global units it holds).

Every round repeats the same architectures with new weights, so the per-round path does not prune at all:
``tier_kept_units`` takes the kept units from the importance ranking on a dependency graph built once per
architecture (``fedfuse.pruning.keep_indices``), after checking once per architecture that they are exactly the
units the pruned model keeps (else that architecture keeps pruning for real, e.g. ViT attention heads).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Mapping

import torch
from torch import nn

from fedfuse.hetero.submodel import SubModel, slice_state, submodel
from fedfuse.models import adapter_for
from fedfuse.pruning import keep_indices, prune_result


def _moved_to_front(view: torch.Tensor, axis: int) -> torch.Tensor:
    return view.movedim(axis, 0).reshape(view.shape[axis], -1)


def kept_units(wide: nn.Module, pruned: nn.Module, *, atol: float = 1e-6) -> dict[str, torch.Tensor]:
    """``{group: [units of pruned] int64}``: for every unit group of ``wide``'s permutation spec, the indices of the
    units of ``wide`` that ``pruned`` (``wide`` with units removed, nothing else changed: ``prune(..., recover=False)``)
    holds, in ``pruned``'s unit order.

    Groups are resolved in dependency order: a group is matched on the tensors whose other grouped axes are already
    resolved (e.g. an MLP's first layer rows, then the second layer's rows restricted to the kept columns), each
    pruned unit to the wide unit with the same entries (optimal assignment on the distances). ``ValueError`` when a
    pruned unit has no exact counterpart (the pruned model is not a sub-network of ``wide``).
    """
    from scipy.optimize import linear_sum_assignment

    adapter = adapter_for(wide)
    ws, ps = adapter.perm_spec(wide), adapter.perm_spec(pruned)
    wstate, pstate = wide.state_dict(), pruned.state_dict()
    if set(ws.groups) != set(ps.groups) or list(wstate) != list(pstate):
        raise ValueError("kept_units: the pruned model's layout differs from the wide model's (another depth?)")
    kept: dict[str, torch.Tensor] = {}
    pending = [g for g in ws.groups]
    while pending:
        progress = False
        for g in list(pending):
            wf, pf = [], []
            for key, entry in ws.entries.items():
                axes = [ax for ax in entry.axes if ax.group == g]
                if not axes:
                    continue
                others = [ax for ax in entry.axes if ax.group != g]
                if any(ax.group not in kept for ax in others) or len(axes) != 1:
                    continue
                wt, pt = wstate[key], pstate[key]
                if not wt.is_floating_point():
                    continue
                wv = wt.detach().reshape(entry.view or tuple(wt.shape)).double()
                pentry = ps.entries[key]
                pv = pt.detach().reshape(pentry.view or tuple(pt.shape)).double()
                for ax in others:
                    wv = wv.index_select(ax.axis, kept[ax.group])
                wf.append(_moved_to_front(wv, axes[0].axis))
                pf.append(_moved_to_front(pv, axes[0].axis))
            if not wf:
                continue
            wfeat, pfeat = torch.cat(wf, 1), torch.cat(pf, 1)
            if wfeat.shape[1] != pfeat.shape[1]:
                raise ValueError(f"kept_units: group {g!r}: the pruned tensors do not match the wide model's layout")
            dist = torch.cdist(pfeat, wfeat)
            rows, cols = linear_sum_assignment(dist.numpy())
            order = torch.as_tensor(cols[torch.as_tensor(rows).argsort().numpy()], dtype=torch.long)
            scale = float(wfeat.abs().max()) if wfeat.numel() else 1.0
            worst = float(dist[torch.arange(len(order)), order].max()) if len(order) else 0.0
            if worst > atol * max(1.0, scale) * max(1, pfeat.shape[1]) ** 0.5:
                raise ValueError(f"kept_units: group {g!r}: a pruned unit has no exact counterpart in the wide model "
                                 f"(distance {worst:.3g}); was the pruned model changed after pruning?")
            kept[g] = order
            pending.remove(g)
            progress = True
        if not progress:
            raise ValueError(f"kept_units: cannot resolve groups {pending} (no tensor indexes them alone)")
    return kept


def _group_of(spec, module_name: str, out: bool) -> str | None:
    """The permutation-spec group of ``module_name``'s output (``out``) or input channels, if one axis has it."""
    entry = spec.entries.get(f"{module_name}.weight")
    if entry is None or entry.view is not None:
        return None
    hits = [ax.group for ax in entry.axes if ax.axis == (0 if out else 1)]
    return hits[0] if len(hits) == 1 else None


def _kept_by_ranking(wide: nn.Module, tier: nn.Module, **options: Any) -> tuple[dict[str, torch.Tensor] | None, str]:
    """``kept_units(wide, prune(wide, target=tier, ...))`` without pruning (``fedfuse.pruning.keep_indices``: the
    same ranking on a cached dependency graph), or ``None`` when the pruning groups do not map one-to-one onto the
    permutation spec's groups (e.g. attention heads) or the ranking refuses the call (``tier_kept_units`` then prunes
    for real, which raises what is wrong with the arguments)."""
    options = {k: v for k, v in options.items() if k != "seed"}   # the ranking draws nothing
    try:
        units, criterion = keep_indices(wide, tier, **options)
    except ValueError:
        return None, ""
    spec = adapter_for(wide).perm_spec(wide)
    names = {m: n for n, m in wide.named_modules()}
    kept: dict[str, torch.Tensor] = {}
    for module, out, idx in units.values():
        g = _group_of(spec, names[module], out)
        if g is None or (g in kept and not torch.equal(kept[g], idx)):
            return None, criterion
        kept[g] = idx
    return (kept if set(kept) == set(spec.groups) else None), criterion


# (wide shapes, tier shapes, criterion) -> whether the ranking path reproduced the pruned model's units there
_RANKING_CHECKED: dict[tuple, bool] = {}


def _shapes(model: nn.Module) -> tuple:
    return tuple((k, tuple(v.shape)) for k, v in model.state_dict().items())


def tier_kept_units(wide: nn.Module, tier: nn.Module, **options: Any) -> tuple[dict[str, torch.Tensor], str, bool]:
    """``(kept units per group, criterion, ranked)``: the units of ``wide`` that structured pruning to ``tier``
    keeps (``kept_units`` of ``prune_result(wide, target=tier, **options)``).

    The per-round path: the units come from the importance ranking alone (``_kept_by_ranking``: no pruned copy, no
    MAC counting, the dependency graph built once per architecture). The first call per architecture pair and
    criterion also prunes for real and compares; where the two differ (or the ranking cannot map its groups) that
    pair always prunes for real (``ranked`` = ``False``)."""
    kept, criterion = _kept_by_ranking(wide, tier, **options)
    key = (_shapes(wide), _shapes(tier), criterion)
    if kept is not None and _RANKING_CHECKED.get(key):
        return kept, criterion, True
    res = prune_result(wide, target=tier, **options)
    pruned = kept_units(wide, res.model)
    if key not in _RANKING_CHECKED:
        _RANKING_CHECKED[key] = kept is not None and set(kept) == set(pruned) and all(
            torch.equal(kept[g], pruned[g]) for g in pruned)
    return pruned, res.info.get("criterion"), False


def permutation_layout(model: nn.Module, perms: Mapping[str, torch.Tensor]) -> SubModel:
    """A full-size ``SubModel`` whose ``slice_state`` permutes ``model``'s units: group ``g``'s new unit ``i`` is old
    unit ``perms[g][i]`` (groups not in ``perms`` keep their order). Function-preserving (the permutation spec's)."""
    spec = adapter_for(model).perm_spec(model)
    state = model.state_dict()
    positions = {}
    for key, t in state.items():
        entry = spec.entries.get(key)
        pos = torch.arange(t.numel()).reshape(entry.view or tuple(t.shape) if entry is not None else tuple(t.shape))
        if entry is not None:
            for ax in entry.axes:
                if ax.group in perms:
                    pos = pos.index_select(ax.axis, perms[ax.group])
        positions[key] = pos.reshape(t.shape)
    return SubModel(positions, {k: tuple(v.shape) for k, v in state.items()})


def _permuted(state: dict[str, torch.Tensor], spec, perms: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``slice_state(state, permutation_layout(model, perms))`` on the values directly (``spec``: the model's
    permutation spec)."""
    out = {}
    for key, t in state.items():
        entry = spec.entries.get(key)
        if entry is None:
            out[key] = t
            continue
        v = t.reshape(entry.view or tuple(t.shape))
        for ax in entry.axes:
            if ax.group in perms:
                v = v.index_select(ax.axis, perms[ax.group])
        out[key] = v.reshape(t.shape)
    return out


def _front_permutation(size: int, front: torch.Tensor, within: int) -> torch.Tensor:
    """A permutation of ``range(size)``: ``front`` first (indices < ``within``), the rest of ``range(within)`` in
    order, then ``within..size-1`` unchanged."""
    chosen = set(front.tolist())
    rest = [i for i in range(within) if i not in chosen]
    return torch.cat([front.long(), torch.tensor(rest, dtype=torch.long), torch.arange(within, size)])


def _group_scores(model: nn.Module, scores: Mapping[str, torch.Tensor] | None) -> dict[str, str]:
    """``{level name: group}`` for the levels whose scores index exactly one group's units."""
    if not scores:
        return {}
    spec = adapter_for(model).perm_spec(model)
    out = {}
    for g, grp in spec.groups.items():
        for lv in grp.levels or ():
            if lv in scores and torch.as_tensor(scores[lv]).numel() == grp.size:
                out[lv] = g
    return out


def prune_order(global_model: nn.Module, tiers: Mapping[str, nn.Module] | list[nn.Module], *, scores: Mapping[str, torch.Tensor] | None = None,
                fusion_inputs: torch.Tensor | None = None, criterion: str = "auto", seed: int = 0,
                **prune_options: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """``(permuted global state, permutation per group, info)``: the global model's units reordered so that each
    tier's structured pruning keeps exactly its top-left slice (see the module docstring).

    Args:
        global_model: the global (widest) model; not modified.
        tiers: skeletons of the narrower tiers' architectures (weights ignored), any order, as a list or a dict
            (name → skeleton, the names key ``info``); each must be a sub-model of the next wider one
            (``fedfuse.hetero.submodel``).
        scores: global-width importance scores (level name → ``[width]``), e.g. the round's clients' aggregated
            ``neuron_importance``; used by ``criterion='scores'`` (and by ``'auto'`` where the family's best is
            scores); permuted along with the units for the narrower tiers.
        fusion_inputs, criterion, seed, prune_options: ``fedfuse.pruning.prune_result``'s (no recovery here).
    Returns:
        ``perms[g][i]`` = the old index of the unit now at position ``i`` of group ``g``. ``info``:
        ``{tier name (list: its index): {"kept-moved": fraction of the tier's units that were not already in its slice,
        "criterion": ..., "seconds": ...}}``.
    """
    adapter = adapter_for(global_model)
    spec = adapter.perm_spec(global_model)
    sizes = {g: grp.size for g, grp in spec.groups.items()}
    named = dict(tiers) if isinstance(tiers, Mapping) else {str(i): m for i, m in enumerate(tiers)}
    order = sorted(named.items(), key=lambda kv: -sum(p.numel() for p in kv[1].parameters()))
    state = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
    perms = {g: torch.arange(n) for g, n in sizes.items()}
    level_group = _group_scores(global_model, scores)
    cur_scores = {lv: torch.as_tensor(scores[lv]).float().flatten().clone() for lv in level_group} if scores else None
    info: dict[str, Any] = {}
    wide_widths = dict(sizes)   # widths of the model the next tier is pruned from
    for i, (name, tier) in enumerate(order):
        t0 = time.perf_counter()
        wide = global_model   # the first tier is pruned from the global model (not modified), later ones from:
        if i > 0:             # the previous tier's slice of the (permuted) global
            skeleton = global_model if wide_widths == sizes else prev_skeleton
            wide = copy.deepcopy(skeleton)
            wide.load_state_dict(slice_state(state, submodel(global_model, skeleton)))
        wide_scores = None
        if cur_scores:
            wide_scores = {lv: s[:wide_widths[g]] for lv, s in cur_scores.items() for g in [level_group[lv]]}
        kept, used, ranked = tier_kept_units(wide, tier, scores=wide_scores, fusion_inputs=fusion_inputs,
                                             criterion=criterion, seed=seed, **prune_options)
        step = {g: _front_permutation(sizes[g], kept[g], wide_widths[g]) for g in sizes}
        state = _permuted(state, spec, step)
        perms = {g: perms[g][step[g]] for g in sizes}
        if cur_scores:
            cur_scores = {lv: s[step[level_group[lv]]] for lv, s in cur_scores.items()}
        tier_sizes = {g: len(kept[g]) for g in sizes}
        moved = sum(int((kept[g] >= tier_sizes[g]).sum()) for g in sizes)
        info[name] = {"kept-moved": moved / max(1, sum(tier_sizes.values())), "criterion": used,
                      "ranked": ranked, "seconds": time.perf_counter() - t0}
        wide_widths, prev_skeleton = tier_sizes, tier
    return state, perms, info


__all__ = ["kept_units", "permutation_layout", "prune_order", "tier_kept_units"]
