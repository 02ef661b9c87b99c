"""TransFusion: data-free, head-aware weight matching for transformers (and plain weight matching else).

Paper: "Update Your Transformer to the Latest Release: Re-Basin of Task Vectors" (TransFusion; Rinaldi et
al., ICML 2025, arXiv 2505.22697): transporting task vectors across pretrained releases with head-aware
permutations. Implemented: the weight-matching core (coordinate ascent with Hungarian steps), the
two-level attention alignment (inter-head spectral distance on singular values of the Q/K/V rows and
the output projection's column blocks, then intra-head assignment), residual connections (untied
per-position stream permutations for transport, tied for a valid plain ViT), the transport of every
task-vector tensor, and its use for fusion (align clients before averaging). Written from the paper,
not from the authors' code.

Use (a) is the fusion method ``transfusion`` here; use (b), moving a task vector onto a new base
release, is :func:`fedfuse.rebase.transport`, built on :func:`transfusion_match`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fedfuse.fusion.registry import IncompatibleModelsError, register, require
from fedfuse.fusion.permute import (load_state, AlignedAverage, PermSpec, apply_maps, build_spec, check_compatible,
                                    entry_view, state_on)
from fedfuse.fusion.rebasin import AlignOptions, finish, weight_matching


def head_blocks(t: torch.Tensor, axis: int, n_heads: int) -> list[torch.Tensor]:
    """Split ``t`` along ``axis`` into ``n_heads`` blocks, each returned as ``[d_k, rest]``."""
    x = t.movedim(axis, 0)
    d = x.shape[0] // n_heads
    return [x[h * d:(h + 1) * d].reshape(d, -1) for h in range(n_heads)]


def spectral_head_cost(state_a: dict, state_b: dict, spec_a: PermSpec, spec_b: PermSpec, group: str,
                       top_k: int | None = None, include_proj: bool = True) -> torch.Tensor:
    """Inter-head distance ``D [H_A, H_B]``.

    ``D_ij = Σ_W ‖σ(W_i^A) − σ(W_j^B)‖₂`` over the head blocks of Q, K, V rows (``[d_k, d_in]``) and,
    with ``include_proj``, the output projection's column blocks; ``σ`` are the top ``top_k`` singular
    values (default ``d_k``). Singular values ignore any permutation of rows or columns, so the distance
    needs no other alignment, and a head and its permuted copy are at distance 0.
    """
    ga = spec_a.groups[group]
    H = ga.blocks
    total = torch.zeros(H, H, dtype=torch.float64)
    for e, ax in spec_a.entries_of(group):
        if e.name not in state_a or (ax.role == "in" and not include_proj):
            continue
        xa, xb = entry_view(state_a[e.name], e, spec_a), entry_view(state_b[e.name], e, spec_b)
        if e.qkv and xa.dim() == 2:
            continue  # qkv bias: no spectrum
        if e.qkv and xa.dim() == 3:
            mats = [(xa[i], xb[i]) for i in range(3)]  # q, k, v: [D, D_in]; group axis is 0 after indexing
            gax = ax.axis - 1
        elif xa.dim() >= 2:
            mats, gax = [(xa, xb)], ax.axis
        else:
            continue  # biases carry no spectrum
        for ma, mb in mats:
            sa = torch.stack([torch.linalg.svdvals(blk) for blk in head_blocks(ma, gax, H)])
            sb = torch.stack([torch.linalg.svdvals(blk) for blk in head_blocks(mb, gax, H)])
            k = min(sa.shape[1], sb.shape[1], top_k or sa.shape[1])
            total += torch.cdist(sa[:, :k], sb[:, :k]).to(total)
    return total


def transfusion_match(state_a: dict, state_b: dict, spec_a: PermSpec, spec_b: PermSpec, *, max_iter: int = 100,
                      order: str = "random", seed: int = 0, top_k: int | None = None, include_proj: bool = True,
                      intra: bool = True, init: str = "sequential") -> tuple[dict, dict]:
    """Permutations moving A onto B: spectral inter-head pairing (fixed), then weight matching with
    intra-head refinement; returns ``(maps, info)`` (equal architectures required)."""
    head_costs = {g: spectral_head_cost(state_a, state_b, spec_a, spec_b, g, top_k, include_proj)
                  for g, grp in spec_a.groups.items() if grp.kind == "attn" and grp.blocks > 1}
    maps, info = weight_matching(state_a, state_b, spec_a, spec_b, max_iter=max_iter, init=init, order=order,
                                 seed=seed, head_preserving=True, head_costs=head_costs, intra=intra)
    info["head_costs"] = head_costs
    return maps, info


@dataclass(frozen=True)
class TransFusionOptions(AlignOptions):
    """Options of ``transfusion`` (plus ``reset_bn`` and ``finetune`` of ``AlignOptions``; both need a
    fusion set, which the matching itself never uses).

    Attributes:
        max_iter, order, init: weight-matching coordinate ascent (see ``weight_matching``).
        top_k: singular values per head block in the spectral head cost (``None`` = all, ``d_k``).
        include_proj: include the output projection's column blocks in the head cost.
        intra: refine the order within each head after the spectral head pairing.
    """

    max_iter: int = 100
    order: Literal["random", "forward", "backward"] = "random"
    top_k: int | None = None
    include_proj: bool = True
    intra: bool = True
    init: Literal["sequential", "identity"] = "sequential"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_iter >= 0, "max_iter", ">= 0", self.max_iter)
        require(self.top_k is None or self.top_k >= 1, "top_k", ">= 1 or None", self.top_k)


PAPER_TRANSFUSION = ("Data-free TransFusion alignment to model 0 (head-aware weight matching), then averaging.")
@register("transfusion", paper=PAPER_TRANSFUSION, options=TransFusionOptions, needs_data=False)
def fuse_transfusion(models, *, fusion_inputs, scores, weights, device, seed, options: TransFusionOptions,
                     info: dict) -> nn.Module:
    """Data-free TransFusion alignment of every model to model 0, then weighted averaging.

    Equal architectures are required (``IncompatibleModelsError`` otherwise). Fixed point: copies of one
    model match by the identity and average back to it. ``info``: per-model ``sweeps`` and
    ``trace_ratio`` per group, timings.
    """
    o = options
    t0 = time.perf_counter()
    ref = models[0]
    spec_b = build_spec(ref, "tied")
    state_b = state_on(ref, device)
    avg = AlignedAverage()   # each aligned state is added as it is made, then dropped
    avg.add(state_b, weights[0])
    info.update(trace_ratio=[], sweeps=[])
    for k, model in enumerate(models[1:], 1):
        spec_a = build_spec(model, "tied")
        state_a = state_on(model, device)
        try:
            check_compatible(spec_a, spec_b, state_a, state_b, same_width=True)
        except ValueError as err:
            raise IncompatibleModelsError(f"transfusion: model {k} cannot be matched to model 0: {err}") from None
        maps, tf = transfusion_match(state_a, state_b, spec_a, spec_b, max_iter=o.max_iter, order=o.order, seed=seed,
                                     top_k=o.top_k, include_proj=o.include_proj, intra=o.intra, init=o.init)
        info["sweeps"].append(tf["sweeps"])
        info["trace_ratio"].append({g: m.trace_ratio() for g, m in maps.items()})
        avg.add(apply_maps(state_a, spec_a, spec_b, maps, state_b), weights[k])
    fused = copy.deepcopy(ref).cpu()
    load_state(fused, avg.result())
    info["align_seconds"] = time.perf_counter() - t0
    return finish(fused, models, fusion_inputs, reset_bn=o.reset_bn, finetune=o.finetune, weights=weights,
                  device=device, seed=seed, info=info)
