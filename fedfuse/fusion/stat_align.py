"""Alignment before a statistics-weighted merge (``regmean`` / ``fisher`` with ``align=``).

RegMean (arXiv 2212.09849) and Fisher merging (arXiv 2111.09832) assume models fine-tuned from one shared
initialisation: unit ``j`` of one model is unit ``j`` of the other. Independently initialised clients (fedfuse's
one-shot mode) break that, and any per-coordinate merge of them is as poor as their plain average. This module moves
every model onto model 0's units first with Git Re-Basin's permutation matching (Ainsworth et al., "Git Re-Basin:
Merging Models modulo Permutation Symmetries", arXiv 2209.04836; ``fedfuse.fusion.rebasin``), function-preserving,
and moves each model's statistics with it, so the statistics a client computed on its own data in its own units
stay valid: a permutation ``P`` of a layer's input features maps its Gram matrix ``G`` to ``P G Pᵀ``, and a
diagonal Fisher moves exactly as the parameters it belongs to.
"""

from __future__ import annotations

import copy
from typing import Callable, Literal

import torch
from torch import nn

from fedfuse.fusion.permute import (Map, PermSpec, apply_maps, build_spec, check_compatible, collect_activations,
                                    load_state, map_entry, state_on)
from fedfuse.fusion.rebasin import activation_matching, weight_matching
from fedfuse.fusion.registry import IncompatibleModelsError, MissingInputError

Align = Literal["none", "weights", "activations"]
#: moves one model's statistics from its units (spec_a) into model 0's (spec_b) with the group maps
MoveStats = Callable[[dict, nn.Module, PermSpec, PermSpec, dict[str, Map]], dict]


def align_to_first(models: list[nn.Module], statistics: list[dict] | None, how: Align, *, fusion_inputs, device,
                   seed: int, info: dict, move: MoveStats, max_rows: int = 4096) -> tuple[list[nn.Module], list | None]:
    """``models`` with every model after the first permuted onto model 0's units (``how``: Git Re-Basin's
    ``"weights"`` or ``"activations"`` matching, the latter on ``fusion_inputs``), and their ``statistics`` moved
    with them by ``move``. ``how="none"`` returns the inputs. The inputs are not modified; ``info`` gets
    ``align`` and the per-model ``align-trace-ratio``. ``IncompatibleModelsError`` for models fedfuse cannot permute
    (no permutation spec) or of other widths; ``MissingInputError`` for activation matching without a fusion set."""
    if how == "none" or len(models) == 1:
        return models, statistics
    if how == "activations" and fusion_inputs is None:
        raise MissingInputError("align='activations' needs fusion_inputs (the fusion set); align='weights' needs "
                                "none")
    try:
        spec_b = build_spec(models[0])
    except ValueError as exc:
        raise IncompatibleModelsError(f"align={how!r}: model 0 cannot be permuted ({exc}); use align='none'") from None
    state_b = state_on(models[0], device)
    acts_b = (collect_activations(models[0], spec_b, fusion_inputs, max_rows=max_rows, seed=seed, device=device)
              if how == "activations" else None)
    out, moved = [models[0]], [statistics[0]] if statistics is not None else None
    info.update(align=how, **{"align-trace-ratio": []})
    for k, model in enumerate(models[1:], 1):
        spec_a = build_spec(model)
        state_a = state_on(model, device)
        try:
            check_compatible(spec_a, spec_b, state_a, state_b, same_width=True)
        except ValueError as exc:
            raise IncompatibleModelsError(f"align={how!r}: model {k} cannot be matched to model 0: {exc}") from None
        if how == "weights":
            maps, _ = weight_matching(state_a, state_b, spec_a, spec_b, seed=seed)
        else:
            acts_a = collect_activations(model, spec_a, fusion_inputs, max_rows=max_rows, seed=seed, device=device)
            maps = activation_matching(acts_a, acts_b, spec_a, spec_b)
        if any(m.perm is None for m in maps.values()):
            raise IncompatibleModelsError(f"align={how!r}: model {k}'s match is not a permutation")
        info["align-trace-ratio"].append({g: m.trace_ratio() for g, m in maps.items()})
        aligned = copy.deepcopy(models[0]).cpu()
        load_state(aligned, {k2: v.cpu() for k2, v in apply_maps(state_a, spec_a, spec_b, maps, state_b).items()})
        out.append(aligned.eval())
        if moved is not None:
            moved.append(move(statistics[k], model, spec_a, spec_b, maps))
    return out, moved


def input_permutation(key: str, weight: torch.Tensor, groups: int, spec_a: PermSpec, spec_b: PermSpec,
                      maps: dict[str, Map]) -> torch.Tensor | None:
    """Where each input feature of weight ``key`` (``[out, in/groups, *kernel]`` or ``[out, in]``, flattened per
    output row as ``in × kernel``) comes from after the maps: ``idx`` with aligned feature ``j`` = original feature
    ``idx[j]``; ``None`` when the weight's input is not permuted. Found by mapping a tensor that holds each feature's
    index in every row (the maps are permutations, so indices travel exactly)."""
    e = spec_a.entries.get(key)
    if e is None or not any(ax.role == "in" for ax in e.axes):
        return None
    if groups != 1:
        raise IncompatibleModelsError(f"align: {key!r} is a grouped convolution whose input channels are permuted; "
                                      "its Gram matrix cannot be moved (use align='none')")
    d = weight[0].numel()
    fake = torch.arange(d, dtype=torch.float64).repeat(weight.shape[0], 1).reshape(weight.shape)
    mapped = map_entry(fake, e, maps, spec_a, spec_b).reshape(weight.shape[0], d)
    idx = mapped[0].round().long()
    if not torch.equal(idx.sort().values, torch.arange(d)) or not torch.equal(mapped, mapped[:1].expand_as(mapped)):
        raise IncompatibleModelsError(f"align: {key!r}'s input features are not permuted as whole features")
    return idx


__all__ = ["Align", "align_to_first", "input_permutation"]
