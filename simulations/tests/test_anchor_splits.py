"""The anchors' split recipe (``simulations.bench.anchor_splits``): the 20-client regime cells are only comparable
with stock Flower's 10-client splits if the recipe that makes them is the anchors' own."""

from pathlib import Path

import numpy as np
import pytest

from simulations.bench.anchor_cell import anchor_recipe
from simulations.bench.anchor_splits import ANCHORS, MIN_SAMPLES, dirichlet_parts, write_split


def test_dirichlet_parts_cover_the_train_set_once_with_a_minimum_per_client():
    y = np.random.default_rng(0).integers(0, 10, 2000)
    parts = dirichlet_parts(y, 20, 0.1, seed=3)
    joined = np.concatenate(parts)
    assert len(parts) == 20 and min(len(p) for p in parts) >= MIN_SAMPLES
    assert np.array_equal(np.sort(joined), np.arange(len(y)))          # every sample once
    assert all(np.all(np.diff(p) > 0) for p in parts)                  # stored in dataset order
    assert all(np.array_equal(a, b) for a, b in zip(parts, dirichlet_parts(y, 20, 0.1, seed=3)))   # seeded


@pytest.mark.skipif(not (ANCHORS / "mnist1d-a0.5-s1").is_dir(), reason="../shared/anchors not beside the checkout")
def test_ten_clients_reproduce_the_anchors_byte_for_byte(tmp_path: Path):
    mine = write_split(tmp_path, 10, 0.5, 1)
    theirs = ANCHORS / "mnist1d-a0.5-s1"
    for name in [f"node-{k}.npz" for k in range(10)] + ["test.npz"]:
        a, b = np.load(mine / name), np.load(theirs / name)
        assert sorted(a.files) == sorted(b.files)
        for key in b.files:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), f"{name}[{key}]"


def test_recipe_samples_per_round_of_the_federation():
    cfg = anchor_recipe(Path("/s"), Path("/p.npz"), "mnist1d", 0, 10, clients=20, per_round=8)
    assert (cfg["num-clients"], cfg["min-train-nodes"], cfg["fraction-train"]) == (20, 8, 0.4)
    assert anchor_recipe(Path("/s"), Path("/p.npz"), "mnist1d", 0, 10)["fraction-train"] == 1.0
