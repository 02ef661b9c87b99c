"""Batched entropic OT (Sinkhorn–Knopp and its log-domain variant) in numpy / torch.

Sinkhorn distances, Cuturi, NeurIPS 2013 (arXiv 1306.0895); the iterations follow POT's ``ot.sinkhorn``.

Why not POT's own batched solver (``ot.batch.solve_batch(method="sinkhorn" | "log_sinkhorn")``, POT 0.9.6+):
it solves the same entropic problem but not with the same numbers, and OT fusion with ``solver="sinkhorn"``
must keep giving the same fused weights. The differences (``tests/test_ot_sinkhorn.py`` shows each one):

- iteration: POT's batch solver scales the rows first and starts from ones; ``ot.sinkhorn`` and this module
  scale the columns first and start from ``1/m``, ``1/n`` (log domain: zeros, columns first);
- stopping rule: POT's batch solver stops when the *row*-marginal error ``‖P 1 − a‖`` of the *worst* problem
  of the batch is below ``tol`` (checked every 10 iterations), so every problem iterates as long as the
  slowest one and a problem's plan depends on the other problems in its batch; here (as in ``ot.sinkhorn``)
  each problem stops on its own *column*-marginal error ``‖P^T 1 − b‖ < stop_thr`` and is frozen there, so
  a batched plan equals the plan of the problem solved alone;
- tolerance / cap defaults: ``tol=1e-5``, ``max_iter=10000`` there; ``stop_thr=1e-6``, ``num_iter=1000`` here;
- overflow: the plain-scaling batch solver has no fallback; here problems whose scalings under/overflow are
  re-solved in the log domain.

The plans agree to about the tolerance (1e-6) but are not bit-identical.
"""

from __future__ import annotations

import numpy as np
import torch


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
