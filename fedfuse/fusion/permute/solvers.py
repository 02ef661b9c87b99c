"""Matching solvers: linear assignment (scipy), exact OT (POT) and batched Sinkhorn plans, and the
per-group solve (with head-preserving block plans, as in TransFusion) shared by
``ot``, ``rebasin`` and ``transfusion``."""

from __future__ import annotations

import numpy as np
import torch

from fedfuse.fusion.permute.maps import Map
from fedfuse.fusion.permute.sinkhorn import sinkhorn_batch, sinkhorn_log_batch
from fedfuse.fusion.permute.spec import Group
from fedfuse.fusion.registry import FusionOptionError, IncompatibleModelsError, NumericalFusionError


def assignment(score: torch.Tensor, maximize: bool = True) -> torch.Tensor:
    """Linear assignment on a square ``[m, m]`` score (scipy Hungarian); returns ``perm`` ``[m]`` with
    B unit ``j`` ← A unit ``perm[j]`` (rows are A's units, columns B's)."""
    from scipy.optimize import linear_sum_assignment

    s = score.detach().double().cpu().numpy()
    if s.shape[0] != s.shape[1]:
        raise IncompatibleModelsError(f"assignment needs a square matrix, got {s.shape}")
    if not np.isfinite(s).all():
        raise NumericalFusionError("assignment: score matrix has NaN/inf entries")
    r, c = linear_sum_assignment(s, maximize=maximize)
    perm = torch.empty(s.shape[1], dtype=torch.long)
    perm[torch.as_tensor(c)] = torch.as_tensor(r)
    return perm

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
        raise FusionOptionError(f"ot: sinkhorn reg must be > 0, got {reg}")
    c = torch.stack([x.detach().double().cpu() for x in costs]).numpy()
    if not np.isfinite(c).all():
        raise NumericalFusionError("ot: ground cost has NaN/inf entries")
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
    ``normalize``; :func:`sinkhorn_batch`, POT's Sinkhorn–Knopp iteration in numpy,
    log domain for ``reg < 0.02`` or on overflow).
    """
    c = cost.detach().double().cpu().numpy()
    if not np.isfinite(c).all():
        raise NumericalFusionError("ot: ground cost has NaN/inf entries")
    m_a, m_b = c.shape
    a_, b_ = _marginals(m_a, m_b, a, b)
    if normalize and c.max() > 0:
        c = c / c.max()
    if solver == "emd":
        import ot as pot

        p = pot.emd(a_, b_, np.ascontiguousarray(c), numItermax=1_000_000)
    elif solver == "sinkhorn":
        if reg <= 0:
            raise FusionOptionError(f"ot: sinkhorn reg must be > 0, got {reg}")
        p = _sinkhorn(c[None], a_[None], b_[None], reg, num_iter)[0]
    else:
        raise FusionOptionError(f"ot: unknown solver {solver!r}; choose 'emd' or 'sinkhorn'")
    return torch.as_tensor(p, dtype=torch.float64)

def blocked_plan(n_blocks: int, size_a: int, size_b: int, head_cost: torch.Tensor | None,
                 intra: "callable") -> tuple[torch.Tensor, torch.Tensor]:
    """Head-preserving plan ``[size_a, size_b]`` built from block matches.

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

def exact_block_costs(cost: torch.Tensor, H: int, H_b: int | None = None) -> torch.Tensor:
    """``[H, H_b]`` exact (EMD) transport cost between every A block ``i`` and B block ``j`` of ``cost``
    (``H`` blocks on A's side, ``H_b`` on B's, default ``H``; uniform marginals; a linear assignment per pair when
    the blocks are square)."""
    from scipy.optimize import linear_sum_assignment

    H_b = H if H_b is None else H_b
    m_a, m_b = cost.shape
    da, db = m_a // H, m_b // H_b
    c = cost.detach().double().cpu()
    out = torch.zeros(H, H_b, dtype=torch.float64)
    cn = c.numpy()
    for i in range(H):
        for j in range(H_b):
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
            raise IncompatibleModelsError(f"{group_a.name}: cannot preserve heads between {H} and {group_b.blocks} blocks")
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
