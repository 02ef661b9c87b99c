"""Per-unit features and costs for matching: weight features, standardisation, ground costs between two
models' units (activations or weights), similarity → cost, and OT marginals from importance scores.

The ground costs are shared by ``ot`` and its selective variant (``fedfuse.fusion.selective``), so both
import them from here rather than from each other."""

from __future__ import annotations

import torch

from fedfuse.fusion.permute.maps import Map, entry_view, map_entry
from fedfuse.fusion.permute.spec import Group, PermSpec
from fedfuse.fusion.registry import IncompatibleModelsError


def _weight_slices(state_a: dict, state_b: dict, spec_a: PermSpec, spec_b: PermSpec, group: str,
                   maps: dict[str, Map], roles: tuple[str, ...], require_mapped: bool, b_cache: dict | None = None,
                   dtype: torch.dtype = torch.float64):
    """Per tensor touching ``group`` in one of ``roles``: ``(A's slices [m_A, F_e], B's slices [m_B, F_e])`` along the
    group's axis, A's other grouped axes moved into B's units with ``maps`` (``dtype``). B's slices are kept in
    ``b_cache`` per (entry, axis) when one is given: B never moves while A is matched onto it."""
    for e, ax in spec_a.entries_of(group):
        if ax.role not in roles or e.name not in state_a:
            continue
        if require_mapped and any(o.group not in maps for o in e.axes if o.group != group):
            continue
        xa = map_entry(state_a[e.name], e, maps, spec_a, spec_b, skip=group, dtype=dtype)
        xb = b_cache.get((e.name, ax.axis)) if b_cache is not None else None
        if xb is None:
            xb = entry_view(state_b[e.name], e, spec_b, dtype)
            xb = xb.movedim(ax.axis, 0).reshape(xb.shape[ax.axis], -1)
            if b_cache is not None:
                b_cache[(e.name, ax.axis)] = xb
        yield xa.movedim(ax.axis, 0).reshape(xa.shape[ax.axis], -1), xb


def weight_features(state_a: dict, state_b: dict, spec_a: PermSpec, spec_b: PermSpec, group: str,
                    maps: dict[str, Map], roles: tuple[str, ...] = ("out", "in"),
                    require_mapped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-unit weight features of ``group``: ``(F_A [m_A, F], F_B [m_B, F])`` with matching columns.

    Every tensor touching the group in one of ``roles`` contributes its slices along the group's axis;
    A's other grouped axes are first moved into B's units with ``maps``. With ``require_mapped``, tensors
    whose other groups have no map yet are left out (the sequential OTFusion pass); otherwise a missing
    map raises ``KeyError``.
    """
    pairs = list(_weight_slices(state_a, state_b, spec_a, spec_b, group, maps, roles, require_mapped))
    if not pairs:
        return (torch.zeros(spec_a.groups[group].size, 0, dtype=torch.float64),
                torch.zeros(spec_b.groups[group].size, 0, dtype=torch.float64))
    return torch.cat([a for a, _ in pairs], 1), torch.cat([b for _, b in pairs], 1)


def weight_score(state_a: dict, state_b: dict, spec_a: PermSpec, spec_b: PermSpec, group: str,
                 maps: dict[str, Map], roles: tuple[str, ...] = ("out", "in"), require_mapped: bool = False,
                 b_cache: dict | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``F_A F_Bᵀ [m_A, m_B]`` (in ``dtype``, float64 by default) for the features of ``weight_features``, without
    building them.

    The product is summed tensor by tensor, so no ``[m, F]`` concatenation of every tensor touching the group is
    copied, and B's slices are reused across calls through ``b_cache`` (kept in ``dtype``). Weight matching
    (``fedfuse.fusion.rebasin.weight_matching``) calls this once per group per sweep.
    """
    score = None
    for xa, xb in _weight_slices(state_a, state_b, spec_a, spec_b, group, maps, roles, require_mapped, b_cache,
                                 dtype):
        score = xa @ xb.t() if score is None else score.addmm_(xa, xb.t())
    if score is None:
        dev = next(iter(state_a.values())).device if state_a else None
        return torch.zeros(spec_a.groups[group].size, spec_b.groups[group].size, dtype=dtype, device=dev)
    return score


def activation_cost(xa: torch.Tensor, xb: torch.Tensor, std: bool = True) -> torch.Tensor:
    """Ground cost ``[m_A, m_B]``: Euclidean distance between unit activation vectors ``x [S, m]``."""
    if xa.shape[0] != xb.shape[0]:
        raise IncompatibleModelsError(f"activation rows differ ({xa.shape[0]} vs {xb.shape[0]}); inputs/tokens "
                                      "must match")
    if std:
        xa, xb = standardize(xa), standardize(xb)
    xa, xb = xa.double(), xb.double()
    sq = (xa * xa).sum(0)[:, None] + (xb * xb).sum(0)[None, :] - 2.0 * (xa.t() @ xb)  # Gram form: one matmul
    return sq.clamp_min(0).sqrt().cpu()


def weight_cost(fa: torch.Tensor, fb: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Ground cost ``[m_A, m_B]``: Euclidean distance between (unit-normalised) weight rows ``f [m, F]``."""
    if fa.shape[1] == 0:
        return torch.zeros(fa.shape[0], fb.shape[0], dtype=torch.float64)
    if normalize:
        fa = fa / fa.norm(dim=1, keepdim=True).clamp_min(1e-12)
        fb = fb / fb.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return torch.cdist(fa, fb)


def score_cost(score: torch.Tensor) -> torch.Tensor:
    """Similarity ``[m_A, m_B]`` → non-negative cost (``max - score``) for solvers that minimise."""
    score = score.double()
    return score.max() - score

def standardize(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """z-score each column (unit) of ``x`` ``[S, m]``."""
    std, mean = torch.std_mean(x, dim=0, keepdim=True)  # one pass over x
    return (x - mean) / (std + eps)

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
