"""Keep a fused global model's units where the capacity tiers expect them.

Tier models are index slices of the global model (HeteroFL's top-left slices, FedRolex's windows): a client
of tier ``r`` trains *units* ``0..⌈r·C⌉-1`` of every hidden group. Neuron-interpolation fusion (kf-linear,
kf-gradient: "Model Fusion via Neuron Interpolation", arXiv 2507.00037) builds the fused model's units from
k-means clusters in an arbitrary order, so after fusion unit ``i`` of the global model is no longer the unit
the narrow tiers trained: the narrow tiers' slice of the fused model is barely related to the one they trained,
so every round sends them an unrelated sub-network and their accuracy drifts down
(``docs/measurements-fusion.md``).

``align_to_anchor`` permutes the fused model's units onto an *anchor* of the global architecture whose
units do correspond to the tiers' (the HeteroFL sub-model average of the same replies): Git Re-Basin weight
matching (Ainsworth et al., "Git Re-Basin: Merging Models modulo Permutation Symmetries", arXiv 2209.04836),
a function-preserving permutation of the fused model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedfuse.fusion.permute import apply_maps, build_spec, check_compatible
from fedfuse.fusion.rebasin import weight_matching


def align_to_anchor(model: nn.Module, anchor: nn.Module, *, seed: int = 0, max_iter: int = 30) -> tuple[nn.Module, dict]:
    """``(permuted copy of model, info)``: ``model``'s hidden units permuted to match ``anchor``'s (same
    architecture, e.g. ``[256, 40]`` / ``[256, 256]`` / ``[10, 256]`` for an MLP 256×2 on MNIST-1D).

    The permuted model computes the same function as ``model``. ``info``: ``anchor-objective`` (weight-matching
    objective ⟨anchor, permuted⟩), ``anchor-moved`` (fraction of units that changed position).
    """
    spec_m, spec_a = build_spec(model), build_spec(anchor)
    sm, sa = model.state_dict(), anchor.state_dict()
    check_compatible(spec_m, spec_a, sm, sa, same_width=True)
    maps, match = weight_matching(sm, sa, spec_m, spec_a, max_iter=max_iter, seed=seed)
    out = copy.deepcopy(model)
    out.load_state_dict(apply_maps(sm, spec_m, spec_a, maps, sa))
    moved, total = 0, 0
    for m in maps.values():
        perm = m.perm if m.perm is not None else m.plan.argmax(0)   # anchor unit j <- model unit perm[j]
        moved += int((perm != torch.arange(len(perm))).sum())
        total += len(perm)
    return out.eval(), {"anchor-objective": float(match["objective"]), "anchor-moved": moved / max(1, total)}


__all__ = ["align_to_anchor"]
