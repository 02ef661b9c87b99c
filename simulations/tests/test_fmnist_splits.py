"""The Fashion-MNIST benchmark's client splits (``simulations.bench.fmnist_splits``): NIID-Bench's Dirichlet and
#C=k algorithms and Flower's fedavgm-baseline LDA split, checked on made labels (no data files needed)."""

import numpy as np
import pytest

from simulations.bench.fmnist_splits import partition

Y = np.repeat(np.arange(10), 600)   # 6,000 labels, 600 a class


def _covers_disjointly(parts):
    flat = np.concatenate(parts)
    assert len(flat) == len(Y) and len(np.unique(flat)) == len(Y)


def test_dirichlet_split_covers_every_sample_once_with_the_minimum_size():
    parts = partition(Y, "dir0.5", 10, seed=0)
    _covers_disjointly(parts)
    assert min(len(p) for p in parts) >= 10
    assert parts[0].tolist() == partition(Y, "dir0.5", 10, seed=0)[0].tolist()   # seeded


@pytest.mark.parametrize("k", [1, 2, 3])
def test_label_quantity_split_gives_each_client_k_classes(k):
    parts = partition(Y, f"c{k}", 10, seed=1)
    assert all(len(np.unique(Y[p])) == k for p in parts)
    assert all(i % 10 in np.unique(Y[p]) for i, p in enumerate(parts))   # client i holds class i mod 10


def test_lda_split_is_equal_sized_and_more_skewed_at_smaller_alpha():
    def skew(parts):   # mean share of a client's largest class
        return np.mean([np.bincount(Y[p], minlength=10).max() / len(p) for p in parts])

    mild, harsh = partition(Y, "lda1", 20, seed=0), partition(Y, "lda0.01", 20, seed=0)
    for parts in (mild, harsh):
        _covers_disjointly(parts)
        assert {len(p) for p in parts} == {300}
    assert skew(harsh) > skew(mild) + 0.2


def test_unknown_partition_is_named():
    with pytest.raises(ValueError, match="lda<alpha>"):
        partition(Y, "zipf", 10, seed=0)
