"""Parity of fedfuse's batched Sinkhorn (``fedfuse.fusion.permute.sinkhorn``) with POT's batched solver
(``ot.batch.solve_batch``, POT >= 0.9.6) and POT's per-problem ``ot.sinkhorn``.

Documents why fedfuse keeps its own solver: POT's batch solver is the same fixed point but a different
iteration (row scaling first, ones as the start), a different stopping rule (the *row*-marginal error of the
*worst* problem of the batch, so every problem runs as long as the slowest) and a different default tolerance,
so its plans differ from ours (and from a problem solved alone) by up to the tolerance — not bit-identical,
and fused weights of the default options must be. Ours equals POT's per-problem ``ot.sinkhorn`` iteration
(up to float rounding of the matrix products) and gives every problem of a batch the plan it gets alone.
"""

from __future__ import annotations

import numpy as np
import ot
import pytest

from fedfuse.fusion.permute.sinkhorn import sinkhorn_batch, sinkhorn_log_batch

solve_batch = pytest.importorskip("ot.batch").solve_batch

REG, TOL = 0.05, 1e-6


def _problems(B: int = 4, m: int = 6, n: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    c = rng.random((B, m, n))
    c /= c.max(axis=(1, 2), keepdims=True)
    c[0] *= 0.1                         # a flat cost: this problem converges after a few iterations
    return c, np.full((B, m), 1.0 / m), np.full((B, n), 1.0 / n)


def test_ours_solves_each_problem_as_if_alone():
    c, a, b = _problems()
    batch = sinkhorn_batch(c, a, b, REG, stop_thr=TOL)
    alone = np.stack([sinkhorn_batch(c[i:i + 1], a[i:i + 1], b[i:i + 1], REG, stop_thr=TOL)[0] for i in range(len(c))])
    assert np.array_equal(batch, alone)


def test_ours_follows_pot_sinkhorn_per_problem():
    c, a, b = _problems()
    ours = sinkhorn_batch(c, a, b, REG, stop_thr=TOL)
    pot = np.stack([ot.sinkhorn(a[i], b[i], c[i], REG, numItermax=1000, stopThr=TOL) for i in range(len(c))])
    np.testing.assert_allclose(ours, pot, rtol=0, atol=1e-15)   # same iteration, same stopping point


def test_pot_batch_differs_in_stopping_rule_and_result():
    c, a, b = _problems()
    ours = sinkhorn_batch(c, a, b, REG, stop_thr=TOL)
    pot = solve_batch(M=c, reg=REG, a=a, b=b, max_iter=1000, tol=TOL, method="sinkhorn", reg_type="entropy")
    # the same entropic OT problem: both plans are close ...
    np.testing.assert_allclose(pot.plan, ours, rtol=0, atol=10 * TOL)
    # ... but not bit-identical: POT scales rows first and stops on the row marginals, ours (as ot.sinkhorn)
    # scales columns first and stops on the column marginals
    assert not np.array_equal(pot.plan, ours)
    assert np.abs(pot.plan.sum(2) - a).max() > np.abs(ours.sum(2) - a).max()
    assert np.abs(ours.sum(1) - b).max() > np.abs(pot.plan.sum(1) - b).max()
    # POT stops the batch on its worst problem: a problem's plan depends on the others in its batch
    alone = solve_batch(M=c[:1], reg=REG, a=a[:1], b=b[:1], max_iter=1000, tol=TOL, method="sinkhorn",
                        reg_type="entropy")
    assert alone.log["n_iter"] < pot.log["n_iter"]
    assert not np.array_equal(alone.plan[0], pot.plan[0])


def test_pot_batch_log_domain_differs_too():
    c, a, b = _problems()
    ours = sinkhorn_log_batch(c, a, b, REG, stop_thr=TOL)
    pot = solve_batch(M=c, reg=REG, a=a, b=b, max_iter=1000, tol=TOL, method="log_sinkhorn", reg_type="entropy")
    np.testing.assert_allclose(pot.plan, ours, rtol=0, atol=10 * TOL)
    assert not np.array_equal(pot.plan, ours)
