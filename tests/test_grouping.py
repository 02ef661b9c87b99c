"""Grouping primitives of Neuron Interpolation (spec §1.3, §2.2): coordinates, k-means, Hungarian, targets."""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from fedfuse.fusion.grouping import (assignment_matrix, farthest_first_init, gram_coordinates, grouping_cost,
                                     hungarian_match, matching_labels, projected_coordinates, repair_empty,
                                     weighted_kmeans, weighted_targets)

torch.set_num_threads(1)


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two labelings define the same partition (up to renaming clusters)."""
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_gram_coordinates_preserve_distances():
    torch.manual_seed(0)
    z = torch.randn(200, 12, dtype=torch.float64)   # 12 neurons, 200 samples
    c = gram_coordinates(z.T @ z)
    assert c.shape[0] == 12 and c.shape[1] <= 12
    assert torch.allclose(torch.cdist(c, c), torch.cdist(z.T, z.T), atol=1e-8)


def _dist(c: torch.Tensor) -> torch.Tensor:
    return torch.cdist(c, c, compute_mode="donot_use_mm_for_euclid_dist")


@pytest.mark.parametrize("case", ["full-rank", "dead-neurons", "rank-deficient"])
def test_gram_coordinates_every_factorisation_keeps_the_distances(case):
    """Full rank: Cholesky; neurons that never fire: zero coordinates beside the Cholesky of the rest; fewer rows
    than neurons: the eigendecomposition (with its null directions dropped). The distances are the neurons' own."""
    torch.manual_seed(0)
    z = torch.randn(300 if case != "rank-deficient" else 20, 40, dtype=torch.float64)
    if case == "dead-neurons":
        z[:, [3, 17, 29]] = 0.0
    c = gram_coordinates(z.T @ z)
    assert torch.allclose(_dist(c), _dist(z.T), atol=1e-8)
    if case == "dead-neurons":
        assert torch.all(c[[3, 17, 29]] == 0)
    if case == "rank-deficient":
        assert c.shape[1] <= 20   # no more coordinates than the rank


@pytest.mark.parametrize("layout, samples, path", [("flat", 4, "outputs"), ("flat", 20, "gram"),
                                                  ("channels", 64, "gram")])
def test_output_coordinates_outputs_or_gram(layout, samples, path):
    """KF/HF's coordinates from the level outputs: the outputs themselves while they have no more rows than there
    are neurons, else the Gram matrix's (switching chunk by chunk); the same distances either way."""
    from types import SimpleNamespace

    from fedfuse.fusion.interpolation import _LevelStep, output_coordinates

    torch.manual_seed(0)
    shape = (3, 3) if layout == "channels" else ()
    h = [torch.randn(samples, 6, *shape), torch.randn(samples, 5, *shape)]   # two parents' level outputs
    step = SimpleNamespace(widths=[6, 5], rows=samples, chunk=3, h_par=h, layout=layout)
    step.zcat = lambda i, j: _LevelStep.zcat(step, i, j)
    c = output_coordinates(step)
    z = step.zcat(0, samples)
    assert c.shape[0] == 11
    if path == "outputs":
        assert torch.equal(c, z.T)
    assert torch.allclose(_dist(c), _dist(z.T), atol=1e-8)


def test_projected_coordinates_match_least_squares():
    torch.manual_seed(0)
    x = torch.randn(100, 6, dtype=torch.float64)
    z = torch.randn(100, 9, dtype=torch.float64)
    ls = projected_coordinates(x.T @ x, x.T @ z)
    ref = torch.linalg.lstsq(x, z).solution
    assert torch.allclose(ls.coef, ref, atol=1e-8)
    proj = x @ ref                                     # P z_j
    assert torch.allclose(torch.cdist(ls.coords, ls.coords), torch.cdist(proj.T, proj.T), atol=1e-8)


def test_kmeans_recovers_planted_clusters():
    torch.manual_seed(1)
    centres = torch.randn(5, 8) * 20
    truth = torch.arange(5).repeat_interleave(7)
    pts = centres[truth] + 0.1 * torch.randn(35, 8)
    for init in ("farthest", "kmeans++"):
        res = weighted_kmeans(pts, torch.ones(35), 5, init=init, restarts=3, seed=0)
        assert _same_partition(res.labels, truth), init
        assert res.cost == pytest.approx(grouping_cost(pts, torch.ones(35), res.labels, 5), rel=1e-6)


def test_kmeans_centres_are_weighted_means():
    pts = torch.tensor([[0.0], [1.0], [10.0], [11.0]])
    w = torch.tensor([3.0, 1.0, 1.0, 1.0])
    res = weighted_kmeans(pts, w, 2, restarts=2, seed=0)
    got = sorted(res.centres[:, 0].tolist())
    assert got == pytest.approx([0.25, 10.5])  # (3*0 + 1*1)/4 and (10+11)/2


def test_kmeans_importance_changes_grouping():
    # three points on a line, two clusters; pair costs are s_i s_j / (s_i + s_j) * distance^2
    pts = torch.tensor([[0.0], [5.0], [9.0]])
    light = weighted_kmeans(pts, torch.tensor([1.0, 1.0, 1.0]), 2, restarts=5, seed=0)
    assert _same_partition(light.labels, torch.tensor([0, 1, 1]))       # {5,9}: 8  <  {0,5}: 12.5
    heavy = weighted_kmeans(pts, torch.tensor([1.0, 1.0, 100.0]), 2, init="kmeans++", restarts=10, seed=0)
    assert _same_partition(heavy.labels, torch.tensor([0, 0, 1]))       # {5,9}: 15.8 > {0,5}: 12.5


def test_kmeans_every_cluster_nonempty_and_k_equals_m():
    pts = torch.zeros(6, 3)                                  # all identical: naive Lloyd empties clusters
    res = weighted_kmeans(pts, torch.ones(6), 4, restarts=1, seed=0)
    assert torch.bincount(res.labels, minlength=4).min() >= 1
    pts = torch.randn(5, 3)
    res = weighted_kmeans(pts, torch.ones(5), 5, restarts=1, seed=0)
    assert sorted(res.labels.tolist()) == [0, 1, 2, 3, 4] and res.cost == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="1 <= k"):
        weighted_kmeans(pts, torch.ones(5), 6)


def test_kmeans_seeded_from_one_models_neurons_keeps_its_order():
    torch.manual_seed(2)
    a = torch.randn(6, 4) * 10
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    b = a[perm] + 0.01 * torch.randn(6, 4)
    res = weighted_kmeans(torch.cat([a, b]), torch.ones(12), 6, init=torch.arange(6))
    assert res.labels[:6].tolist() == list(range(6))          # cluster k holds model A's neuron k
    assert res.labels[6:].tolist() == perm.tolist()           # and its match in B


def test_repair_empty_moves_the_costliest_point():
    labels = torch.tensor([0, 0, 0, 1])
    cost = torch.tensor([0.1, 5.0, 0.2, 9.0])  # point 3 is alone in cluster 1: not movable
    new = repair_empty(labels, cost, 3)
    assert new.tolist() == [0, 2, 0, 1]


def test_farthest_first_distinct():
    pts = torch.tensor([[0.0], [0.0], [5.0], [9.0]])
    idx = farthest_first_init(pts, 4, torch.Generator().manual_seed(0))
    assert sorted(idx.tolist()) == [0, 1, 2, 3]


def test_hungarian_recovers_permutation():
    torch.manual_seed(3)
    a = torch.randn(10, 20)
    perm = torch.randperm(10)
    b = a[perm] + 0.01 * torch.randn(10, 20)
    got = hungarian_match(a, b)
    # neuron i of A is B's neuron j with perm[j] == i
    assert torch.equal(perm[got], torch.arange(10))
    labels = matching_labels(got)
    assert torch.equal(labels[:10], torch.arange(10)) and torch.equal(labels[10:][got], torch.arange(10))


def test_hungarian_exact_cost_is_optimal_and_uses_scores():
    torch.manual_seed(4)
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    sa, sb = torch.rand(4) + 0.1, torch.rand(4) + 0.1

    def total(p):
        return sum(float(sa[i] * sb[p[i]] / (sa[i] + sb[p[i]]) * ((a[i] - b[p[i]]) ** 2).sum()) for i in range(4))

    best = min(itertools.permutations(range(4)), key=total)
    got = hungarian_match(a, b, sa, sb, cost="exact").tolist()
    assert total(got) == pytest.approx(total(best))
    # the matching depends on the scores: a near-zero-score neuron costs almost nothing wherever it goes
    a2 = torch.tensor([[0.0], [1.0]])
    b2 = torch.tensor([[0.0], [1.0]])
    assert hungarian_match(a2, b2).tolist() == [0, 1]
    with pytest.raises(ValueError):
        hungarian_match(torch.randn(3, 2), torch.randn(4, 2))


def test_weighted_targets_follow_theorem_1():
    z = torch.tensor([[1.0, 3.0, 10.0], [2.0, 6.0, 20.0]])     # 2 samples, 3 neurons
    labels = torch.tensor([0, 0, 1])
    s = torch.tensor([3.0, 1.0, 5.0])
    t = weighted_targets(z, labels, s, 2)
    assert torch.allclose(t, torch.tensor([[1.5, 10.0], [3.0, 20.0]]))   # (3*1+1*3)/4 = 1.5
    # raising a neuron's importance moves its cluster's target toward it
    t2 = weighted_targets(z, labels, torch.tensor([1.0, 3.0, 5.0]), 2)
    assert t2[0, 0] == pytest.approx(2.5) and t2[0, 0] > t[0, 0]
    a = assignment_matrix(labels, s, 2)
    assert torch.allclose(a.sum(0), torch.ones(2, dtype=a.dtype))


def test_balanced_kmeans_recovers_per_model_permutations():
    from fedfuse.fusion.grouping import balanced_kmeans

    g = torch.Generator().manual_seed(0)
    centres = torch.randn(6, 4, generator=g) * 5
    perms = [torch.arange(6)] + [torch.randperm(6, generator=g) for _ in range(3)]
    pts = torch.cat([centres[p] + 0.1 * torch.randn(6, 4, generator=g) for p in perms])
    labels = balanced_kmeans(pts, torch.rand(24, generator=g) + 0.5, [6, 6, 6, 6])
    for m, p in enumerate(perms):
        lab = labels[6 * m:6 * m + 6]
        assert torch.equal(lab, p)                      # neuron i of model m sits in centre p[i]
        assert sorted(lab.tolist()) == list(range(6))   # one neuron of every model per cluster
    with pytest.raises(ValueError, match="equal widths"):
        balanced_kmeans(pts[:11], torch.ones(11), [6, 5])
