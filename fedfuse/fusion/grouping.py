"""Grouping of neurons for Neuron Interpolation: weighted k-means, Hungarian matching, weighted targets.

Paper: "Model Fusion via Neuron Interpolation" (arXiv 2507.00037): its representation cost (Theorem 1),
HF / KF grouping and k-means settings.

Every neuron of every parent is a data point. Its feature vector is its value at every fusion sample
and position (a column of ``Z [B*P, d^M]``). Those vectors are long (``B*P``), so the functions here
work on *coordinates*: any ``[M, r]`` matrix whose pairwise Euclidean distances equal the neurons'
distances. ``gram_coordinates`` builds them from the ``d^M × d^M`` Gram matrix ``Z^T Z`` (which can be
accumulated chunk by chunk over the fusion set, so ``Z`` is never held whole) and
``projected_coordinates`` builds them for the linear variants' projected outputs ``P z_j`` (from ``X^T X``;
``kernel_least_squares`` from ``X X^T`` when the design has fewer rows than columns).

All functions are pure (inputs are not modified), run on the tensors' device and take a ``seed``
where they make random choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from fedfuse.fusion.registry import IncompatibleModelsError


# ----------------------------------------------------------------------------------------------------
# coordinates
# ----------------------------------------------------------------------------------------------------

def gram_coordinates(gram: torch.Tensor, rtol: float = 1e-10) -> torch.Tensor:
    """Coordinates ``C [M, r]`` with ``C @ C.T == gram`` (up to round-off), ``r <= M``.

    Args:
        gram: ``[M, M]`` symmetric positive semi-definite Gram matrix ``Z^T Z`` of the neuron vectors.
        rtol: eigenvalues below ``rtol * max eigenvalue`` are dropped (they carry round-off only).
    Returns:
        ``[M, r]`` float64 tensor on ``gram``'s device; ``‖C_i − C_j‖ == ‖z_i − z_j‖``.
    """
    g = gram.double()
    g = 0.5 * (g + g.T)
    # a full-rank Gram (more fusion rows than neurons, e.g. a conv level's samples x positions) factors by Cholesky,
    # about 10 times cheaper than the eigendecomposition at M = 2048 and as exact (C C^T = G up to round-off: the
    # distances, all that grouping reads, are the same); a rank-deficient one (fewer rows than neurons) fails it and
    # takes the eigendecomposition, which also drops the null directions (r < M coordinates)
    # (neurons that never fire on the fusion set, zero rows and columns of G, get zero coordinates)
    diag = g.diagonal()
    live = diag > rtol * diag.max().clamp_min(1e-300)
    sub = g[live][:, live]
    chol, info = torch.linalg.cholesky_ex(sub)
    if int(info) == 0 and bool(torch.isfinite(chol).all()) and bool(
            (chol.diagonal() > (rtol * sub.diagonal().max()).clamp_min(1e-300).sqrt()).all()):
        out = g.new_zeros(g.shape[0], chol.shape[1])
        out[live] = chol
        return out
    evals, evecs = torch.linalg.eigh(g)
    keep = evals > rtol * evals.abs().max().clamp_min(1e-300)
    return evecs[:, keep] * evals[keep].sqrt()


@dataclass
class LeastSquares:
    """Per-neuron least-squares refit of parent outputs on a (fused) design matrix ``X [rows, cols]``.

    Attributes:
        coef: ``[cols, M]`` weights ``a_j`` with ``X a_j ≈ z_j`` (min-norm / ridge solution).
        coords: ``[M, r]`` coordinates of the projected outputs ``X a_j``: ``‖C_i − C_j‖ == ‖X a_i − X a_j‖``.
    """

    coef: torch.Tensor
    coords: torch.Tensor

    def weights(self, a: torch.Tensor) -> torch.Tensor:
        """The fit's weights of targets grouped by ``a [M, k]``: ``coef @ a`` ``[cols, k]`` (the dual-form fit of a
        wide level answers the same call without forming ``coef``)."""
        return self.coef @ a


def projected_coordinates(xtx: torch.Tensor, xtz: torch.Tensor, ridge: float = 0.0,
                          rcond: float = 1e-7) -> LeastSquares:
    """Least-squares weights and projected-output coordinates from accumulated normal equations.

    With ``G = X^T X = V Λ V^T`` the min-norm solution is ``a_j = V Λ^+ V^T X^T z_j`` and the projected
    output ``P z_j = X a_j`` has ``‖X a‖² = a^T G a``, so ``C = (Λ^{1/2} V^T A)^T`` are exact coordinates
    (clustering the projections ``P z_j`` is enough: the residual ``‖(I−P) z_j‖`` does not depend on the
    cluster and so never changes an assignment).

    Args:
        xtx: ``[cols, cols]`` ``X^T X``.
        xtz: ``[cols, M]`` ``X^T Z``.
        ridge: Tikhonov ``λ`` (absolute, added to every eigenvalue); 0 = min-norm pseudo-inverse.
        rcond: eigenvalues below ``rcond * max`` are treated as zero when ``ridge == 0``.
    Returns:
        ``LeastSquares`` with float64 ``coef [cols, M]`` and ``coords [M, r]``.
    """
    g = xtx.double()
    g = 0.5 * (g + g.T)
    evals, evecs = torch.linalg.eigh(g)
    top = evals.max().clamp_min(1e-300)
    keep = evals > (rcond * top if ridge == 0 else 0.0)
    lam, v = evals[keep], evecs[:, keep]
    b = v.T @ xtz.double()                                  # [r, M]
    coef = v @ (b / (lam + ridge)[:, None])                 # [cols, M]
    coords = (lam.sqrt()[:, None] * (v.T @ coef)).T         # [M, r]
    return LeastSquares(coef=coef, coords=coords)


@dataclass
class KernelLeastSquares:
    """The fit of ``projected_coordinates`` in its dual (kernel) form, for a design matrix ``X [rows, cols]`` with
    fewer rows than columns (a VGG's first classifier Linear reads 25,088 features of a few hundred fusion samples:
    its ``X^T X`` alone is 5 GB in float64, its ``X X^T`` a few MB).

    ``K = X X^T = U S U^T`` and ``X^T X = V Λ V^T`` share their non-zero eigenvalues (``V = X^T U S^{-1/2}``), so by
    the push-through identity ``(X^T X + λI)^{-1} X^T = X^T (X X^T + λI)^{-1}`` the weights of targets ``Z`` are
    ``X^T B`` with the *dual weights* ``B = U (S + λ)^{-1} U^T Z``, and the projected outputs ``X a_j`` have the
    coordinates ``(S (S + λ)^{-1} U^T Z)^T``: ``projected_coordinates``' own (same ``λ``, same eigenvalue cut-off, the
    same basis up to the eigenvectors' signs), from an ``rows × rows`` eigendecomposition.

    Attributes:
        u: ``[rows, r]`` kept eigenvectors of ``K``.
        s: ``[r]`` their eigenvalues.
        ridge: Tikhonov ``λ`` (absolute).
    """

    u: torch.Tensor
    s: torch.Tensor
    ridge: float

    def dual(self, z: torch.Tensor) -> torch.Tensor:
        """Dual weights ``B [rows, M]`` of targets ``z [rows, M]``: the fit's weights are ``X^T B``."""
        return self.u @ ((self.u.T @ z.double()) / (self.s + self.ridge)[:, None])

    def coords(self, z: torch.Tensor) -> torch.Tensor:
        """``[M, r]`` coordinates of the projected outputs ``X a_j`` of targets ``z [rows, M]``."""
        return ((self.s / (self.s + self.ridge))[:, None] * (self.u.T @ z.double())).T


def kernel_least_squares(kern: torch.Tensor, ridge: float = 0.0, rcond: float = 1e-7) -> KernelLeastSquares:
    """``projected_coordinates``' fit from the kernel ``K = X X^T [rows, rows]`` (see ``KernelLeastSquares``).

    Args:
        kern: ``[rows, rows]`` ``X X^T``.
        ridge: Tikhonov ``λ`` (absolute, added to every eigenvalue); 0 = min-norm pseudo-inverse.
        rcond: eigenvalues below ``rcond * max`` are treated as zero when ``ridge == 0``.
    """
    g = kern.double()
    g = 0.5 * (g + g.T)
    evals, evecs = torch.linalg.eigh(g)
    top = evals.max().clamp_min(1e-300)
    keep = evals > (rcond * top if ridge == 0 else 0.0)
    return KernelLeastSquares(u=evecs[:, keep], s=evals[keep], ridge=float(ridge))


# ----------------------------------------------------------------------------------------------------
# weighted k-means
# ----------------------------------------------------------------------------------------------------

@dataclass
class KMeansResult:
    """Result of ``weighted_kmeans``.

    Attributes:
        labels: ``[M]`` int64 cluster of every point, every cluster in ``0..k-1`` non-empty.
        centres: ``[k, D]`` weighted centroids.
        cost: weighted k-means cost ``Σ_j s_j ‖x_j − c_{label_j}‖²`` (float).
        iterations: Lloyd iterations of the kept run.
    """

    labels: torch.Tensor
    centres: torch.Tensor
    cost: float
    iterations: int


def _sq_dists(points: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """``[M, k]`` squared Euclidean distances (matmul form, clamped at 0)."""
    # ‖p‖² − 2 p·c + ‖c‖², written into the one [M, k] product (the same values as the expression, in a quarter of
    # its memory: M × k is 8192 neurons × 4096 centres on a VGG's classifier)
    d = (2 * points) @ centres.T
    return d.neg_().add_((points * points).sum(1, keepdim=True)).add_((centres * centres).sum(1)[None]).clamp_min_(0)


def farthest_first_init(points: torch.Tensor, k: int, generator: torch.Generator,
                        dists: torch.Tensor | None = None) -> torch.Tensor:
    """Farthest-first seeding (as the paper's reference linear KF code): a random point, then repeatedly the
    point farthest from the chosen centres. ``dists`` = optional precomputed ``[M, M]`` squared
    distances (shared across restarts). Returns ``[k]`` point indices."""
    m = points.shape[0]
    first = int(torch.randint(m, (1,), generator=generator).item())
    row = (lambda j: dists[j]) if dists is not None else (lambda j: _sq_dists(points, points[j:j + 1])[:, 0])
    chosen = torch.empty(k, dtype=torch.long, device=points.device)
    chosen[0] = first
    dmin = row(first).clone()
    dmin[first] = -1.0
    for i in range(1, k):
        nxt = dmin.argmax()  # stays on device: no host sync per step
        chosen[i] = nxt
        dmin = torch.minimum(dmin, row(nxt))
        dmin[nxt] = -1.0  # never pick a chosen point twice (duplicates have distance 0 but are distinct)
    return chosen


def kmeanspp_init(points: torch.Tensor, weights: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """Weighted k-means++ seeding: sample ``∝ s_j · D(x_j)²``. Returns ``[k]`` distinct point indices."""
    m = points.shape[0]
    w = weights.double().cpu()
    first = int(torch.multinomial(w / w.sum(), 1, generator=generator).item())
    chosen = [first]
    dmin = _sq_dists(points, points[first:first + 1])[:, 0].double().cpu()
    for _ in range(1, k):
        p = w * dmin
        p[chosen] = 0.0
        if p.sum() <= 0:  # all remaining points coincide with a centre: take any unchosen one
            p = torch.ones(m, dtype=torch.float64)
            p[chosen] = 0.0
        nxt = int(torch.multinomial(p / p.sum(), 1, generator=generator).item())
        chosen.append(nxt)
        dmin = torch.minimum(dmin, _sq_dists(points, points[nxt:nxt + 1])[:, 0].double().cpu())
    return torch.tensor(chosen, device=points.device)


def weighted_centroids(points: torch.Tensor, weights: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """``[k, D]`` centroids ``Σ_{j∈R_k} s_j x_j / Σ_{j∈R_k} s_j`` (zero rows for empty clusters)."""
    num = torch.zeros(k, points.shape[1], dtype=points.dtype, device=points.device)
    num.index_add_(0, labels, points * weights[:, None])
    den = torch.zeros(k, dtype=points.dtype, device=points.device).index_add_(0, labels, weights)
    return num / den.clamp_min(1e-300)[:, None]


def repair_empty(labels: torch.Tensor, point_cost: torch.Tensor, k: int) -> torch.Tensor:
    """Give every empty cluster one point: the point with the largest weighted distance to its centre
    among clusters with more than one member. ``labels [M]``, ``point_cost [M]``; returns
    new ``[M]`` labels."""
    labels = labels.clone()
    cost = point_cost.clone()
    counts = torch.bincount(labels, minlength=k)
    for c in torch.nonzero(counts == 0).flatten().tolist():
        movable = counts[labels] > 1
        cand = torch.where(movable, cost, torch.full_like(cost, -1.0))
        j = int(cand.argmax().item())
        if cand[j] < 0:
            raise ValueError("k-means: more clusters than points")
        counts[labels[j]] -= 1
        labels[j] = c
        counts[c] += 1
        cost[j] = -1.0  # a point moved once stays put in this repair pass
    return labels


def _lloyd(points: torch.Tensor, weights: torch.Tensor, centres: torch.Tensor, max_iter: int, tol: float,
           patience: int) -> KMeansResult:
    k = centres.shape[0]
    history: list[float] = []
    labels = None
    it = 0
    p_sq = (points * points).sum(1, keepdim=True)  # ‖x_j‖², shared by every iteration
    for it in range(1, max_iter + 1):
        d = ((2 * points) @ centres.T).neg_().add_(p_sq).add_((centres * centres).sum(1)[None]).clamp_min_(0)
        new_labels = d.argmin(1)
        point_cost = weights * d.gather(1, new_labels[:, None])[:, 0]
        if int(torch.bincount(new_labels, minlength=k).min()) == 0:
            new_labels = repair_empty(new_labels, point_cost, k)
        centres = weighted_centroids(points, weights, new_labels, k)
        # cost of the new centres: O(M·D) on the assigned centre only (no second M×k distance matrix)
        cost = float((weights * ((points - centres[new_labels]) ** 2).sum(1)).sum())
        history.append(cost)
        converged = labels is not None and torch.equal(new_labels, labels)
        labels = new_labels
        # early stop: cost fell less than `tol` (relative) over the last `patience` iterations
        if converged or (len(history) > patience and history[-1 - patience] - cost <= tol * abs(history[-1 - patience])):
            break
    return KMeansResult(labels=labels, centres=centres, cost=history[-1], iterations=it)


def weighted_kmeans(points: torch.Tensor, weights: torch.Tensor, k: int, *, init: str | torch.Tensor = "farthest",
                    restarts: int = 10, max_iter: int = 100, tol: float = 0.05, patience: int = 3,
                    seed: int = 0) -> KMeansResult:
    """Importance-weighted Lloyd k-means of neurons (KF grouping).

    Minimises ``Σ_j s_j ‖x_j − c_{k(j)}‖²`` with every cluster non-empty.

    Args:
        points: ``[M, D]`` neuron coordinates (e.g. ``gram_coordinates`` rows), float32/64, any device.
        weights: ``[M]`` non-negative importance scores ``s_j`` (positive sum).
        k: number of clusters (fused width), ``1 <= k <= M``.
        init: ``"farthest"`` (farthest-first, the reference linear KF), ``"kmeans++"`` (weighted
            k-means++, the paper), or an index tensor ``[k]`` of points to seed the centres with
            (e.g. one model's neurons; then a single run, as in the reference gradient KF).
        restarts: independent seeded runs; the lowest-cost one is kept.
        max_iter: Lloyd iterations per run.
        tol, patience: stop when the cost fell by less than ``tol`` (relative) over ``patience`` iterations.
        seed: seeds the initialisations.
    Returns:
        ``KMeansResult`` (labels ``[M]``, centres ``[k, D]``, cost).
    """
    m = points.shape[0]
    if not 1 <= k <= m:
        raise IncompatibleModelsError(f"k-means: need 1 <= k <= number of neurons, got k={k} for {m} neurons "
                                      "(a fused width larger than the parents' total width leaves clusters empty)")
    if weights.shape != (m,) or bool((weights < 0).any()) or float(weights.sum()) <= 0:
        raise ValueError("k-means: weights must be [M], non-negative, with a positive sum")
    points = points.double()
    weights = weights.to(points).double().clamp_min(1e-300)  # zero-score points still get assigned
    gen = torch.Generator().manual_seed(seed)
    if isinstance(init, torch.Tensor):
        idx = init.to(points.device).long()
        if idx.shape != (k,):
            raise ValueError(f"k-means: seed indices must be [k]={k}, got {tuple(idx.shape)}")
        return _lloyd(points, weights, points[idx].clone(), max_iter, tol, patience)
    best: KMeansResult | None = None
    # pairwise distances once for all farthest-first restarts (M x M is small next to Z)
    dists = _sq_dists(points, points) if init == "farthest" and m <= 8192 else None
    for _ in range(max(1, restarts)):
        if init == "farthest":
            idx = farthest_first_init(points, k, gen, dists)
        elif init == "kmeans++":
            idx = kmeanspp_init(points, weights, k, gen)
        else:
            raise ValueError(f"k-means: unknown init {init!r}; use 'farthest', 'kmeans++' or an index tensor")
        res = _lloyd(points, weights, points[idx].clone(), max_iter, tol, patience)
        if best is None or res.cost < best.cost:
            best = res
    assert best is not None
    return best


# ----------------------------------------------------------------------------------------------------
# Hungarian matching (HF)
# ----------------------------------------------------------------------------------------------------

def hungarian_match(points_a: torch.Tensor, points_b: torch.Tensor, weights_a: torch.Tensor | None = None,
                    weights_b: torch.Tensor | None = None, cost: str = "exact") -> torch.Tensor:
    """One-to-one matching of two equal-width sets of neurons (HF grouping).

    Args:
        points_a: ``[W, D]`` coordinates of model A's neurons.
        points_b: ``[W, D]`` coordinates of model B's neurons (same coordinate system).
        weights_a, weights_b: ``[W]`` importance scores (uniform when ``None``).
        cost: ``"exact"`` = the two-member cluster's grouping cost
            ``s_i s_j / (s_i + s_j) · ‖z_i − z_j‖²`` (minimising it minimises the representation cost);
            ``"distance"`` = plain squared distance (the paper's cheaper heuristic).
    Returns:
        ``[W]`` int64 tensor ``perm`` on CPU: neuron ``i`` of A is matched with neuron ``perm[i]`` of B.
    """
    if points_a.shape != points_b.shape:
        raise IncompatibleModelsError(f"Hungarian matching needs two equal-width sets, got "
                                      f"{tuple(points_a.shape)} and {tuple(points_b.shape)}")
    d = _sq_dists(points_a.double(), points_b.double())
    if cost == "exact":
        w = points_a.shape[0]
        sa = (weights_a if weights_a is not None else torch.ones(w)).double().to(d.device)
        sb = (weights_b if weights_b is not None else torch.ones(w)).double().to(d.device)
        d = d * (sa[:, None] * sb[None, :]) / (sa[:, None] + sb[None, :]).clamp_min(1e-300)
    elif cost != "distance":
        raise ValueError(f"Hungarian matching: unknown cost {cost!r}; use 'exact' or 'distance'")
    rows, cols = linear_sum_assignment(d.cpu().numpy())
    perm = np.empty(len(rows), dtype=np.int64)
    perm[rows] = cols
    return torch.from_numpy(perm)


def balanced_kmeans(points: torch.Tensor, weights: torch.Tensor, widths: list[int], *, init: int = 0,
                    max_iter: int = 30) -> torch.Tensor:
    """Importance-weighted k-means where every cluster holds exactly one neuron of every model.

    The Hungarian (HF) grouping generalised to ``n`` equal-width models: matching to a barycenter.
    Centres start as model ``init``'s neurons; each iteration assigns every model's neurons one-to-one
    to the centres (``linear_sum_assignment`` on ``s_j ‖x_j − c_k‖²``) and moves each centre to the
    importance-weighted mean of its members, until no assignment changes. Clusters therefore never
    absorb several neurons of one model (which, summed into the next level's prior, inflates weights
    round after round in multi-round FL).

    Args:
        points: ``[Σ widths, D]`` neuron coordinates, models concatenated in order.
        weights: ``[Σ widths]`` importance scores (positive).
        widths: every model's width; all equal (= the number of clusters ``k``).
        init: the model whose neurons seed the centres (and keep their order).
        max_iter: assignment rounds at most.
    Returns:
        ``[Σ widths]`` int64 labels on ``points.device``; model ``init``'s neuron ``i`` gets label ``i``.
    """
    from scipy.optimize import linear_sum_assignment

    k = widths[0]
    if any(w != k for w in widths):
        raise IncompatibleModelsError(f"balanced k-means needs equal widths, got {widths}")
    x = points.double()
    s = weights.double().to(x.device)
    offs = [sum(widths[:m]) for m in range(len(widths))]
    labels = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    labels[offs[init]:offs[init] + k] = torch.arange(k, device=x.device)
    centres = x[offs[init]:offs[init] + k].clone()
    prev = None
    for _ in range(max_iter):
        for m, o in enumerate(offs):
            if m == init and prev is None:
                continue  # first pass: model ``init`` defines the centres
            xm, sm = x[o:o + k], s[o:o + k]
            cost = sm[:, None] * torch.cdist(xm, centres).pow(2)        # [k neurons, k centres]
            rows, cols = linear_sum_assignment(cost.cpu().numpy())
            labels[o + torch.as_tensor(rows, device=x.device)] = torch.as_tensor(cols, device=x.device)
        mass = torch.zeros(k, dtype=x.dtype, device=x.device).index_add_(0, labels, s)
        centres = torch.zeros_like(centres).index_add_(0, labels, s[:, None] * x) / mass[:, None]
        if prev is not None and torch.equal(prev, labels):
            break
        prev = labels.clone()
    return labels


def matching_labels(perm: torch.Tensor) -> torch.Tensor:
    """Cluster labels ``[2W]`` for the concatenation ``[A neurons, B neurons]`` from an HF ``perm [W]``:
    pair ``k`` = (A's neuron ``k``, B's neuron ``perm[k]``), so the fused neurons keep A's order."""
    w = perm.shape[0]
    lab_b = torch.empty(w, dtype=torch.long)
    lab_b[perm] = torch.arange(w)
    return torch.cat([torch.arange(w), lab_b])


# ----------------------------------------------------------------------------------------------------
# targets
# ----------------------------------------------------------------------------------------------------

def assignment_matrix(labels: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    """``A [M, k]`` with ``A[j, c] = s_j / Σ_{i∈R_c} s_i`` if ``j ∈ R_c`` else 0 (Theorem 1's weighted mean).

    ``Z [N, M] @ A`` is the importance-weighted target ``T [N, k]``; every column of ``A`` sums to 1.
    """
    m = labels.shape[0]
    w = weights.double().to(labels.device)
    den = torch.zeros(k, dtype=torch.float64, device=labels.device).index_add_(0, labels, w)
    if bool((den <= 0).any()):
        raise ValueError("targets: a cluster has zero total importance or no member")
    a = torch.zeros(m, k, dtype=torch.float64, device=labels.device)
    a[torch.arange(m, device=labels.device), labels] = w / den[labels]
    return a


def weighted_targets(z: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
    """Targets ``T [N, k]``: ``T[:, c] = Σ_{j∈R_c} s_j z[:, j] / Σ_{j∈R_c} s_j`` for ``z [N, M]``."""
    a = assignment_matrix(labels.to(z.device), weights.to(z.device), k).to(z.dtype)
    return z @ a


def grouping_cost(points: torch.Tensor, weights: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Weighted grouping error ``Σ_j s_j ‖x_j − T_{k(j)}‖²`` of a labelling (Theorem 1's second term)."""
    p = points.double()
    w = weights.double().to(p.device)
    c = weighted_centroids(p, w, labels.to(p.device), k)
    return float((w * ((p - c[labels]) ** 2).sum(1)).sum())


__all__ = ["gram_coordinates", "projected_coordinates", "LeastSquares", "kernel_least_squares", "KernelLeastSquares",
           "weighted_kmeans", "KMeansResult", "farthest_first_init", "kmeanspp_init", "weighted_centroids",
           "repair_empty", "hungarian_match", "matching_labels", "assignment_matrix", "weighted_targets",
           "grouping_cost"]
