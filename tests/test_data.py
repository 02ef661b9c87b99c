"""Tests of fedfuse.data: sources, partitions, fusion sets and FederatedData.

All offline and small: torchvision / Hugging Face loaders are exercised on tiny fake datasets the
tests write to tmp_path in those libraries' on-disk formats.
"""

from __future__ import annotations

import os

# Offline before anything imports `datasets` / huggingface_hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pickle
import random
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfuse.data import (
    PARTITIONERS,
    SOURCES,
    ArrayDataset,
    FederatedData,
    fusion_set,
    load_source,
    partition_indices,
    split_train_val,
)

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits():
    return load_source("digits", seed=0)


@pytest.fixture(scope="module")
def digits_labels(digits):
    return digits[0].y.numpy()


def _class_sets(labels, parts):
    return [set(np.unique(labels[p]).tolist()) for p in parts]


# ----------------------------------------------------------------------------- ArrayDataset
def test_array_dataset_basics():
    ds = ArrayDataset(torch.randn(6, 1, 2, 2), torch.tensor([0, 1, 1, 2, 2, 2]), num_classes=4)
    assert ds.input_shape == (1, 2, 2) and len(ds) == 6
    assert ds.class_counts() == [1, 2, 3, 0]
    sub = ds.subset(np.array([5, 0]))
    assert len(sub) == 2 and sub.y.tolist() == [2, 0] and torch.equal(sub.x[0], ds.x[5])
    x, y = ds[3]
    assert x.shape == (1, 2, 2) and int(y) == 2
    with pytest.raises(ValueError):
        ArrayDataset(torch.zeros(3, 2), torch.zeros(2, dtype=torch.long), 2)


# ---------------------------------------------------------------------------------- sources
def test_digits_shapes_and_split(digits):
    train, test = digits
    assert train.input_shape == (1, 8, 8) and train.x.dtype == torch.float32
    assert train.y.dtype == torch.int64 and train.num_classes == 10
    assert len(train) + len(test) == 1797 and abs(len(test) - 0.2 * 1797) <= 1
    assert 0.0 <= float(train.x.min()) and float(train.x.max()) <= 1.0
    # stratified: every class has about 20% of its samples in test
    frac = np.array(test.class_counts()) / (np.array(train.class_counts()) + np.array(test.class_counts()))
    assert np.all(np.abs(frac - 0.2) < 0.02)
    flat, _ = load_source("digits-flat", seed=0)
    assert flat.input_shape == (64,)
    assert torch.equal(flat.x, train.x.reshape(len(train), 64))  # same split, same order
    other, _ = load_source("digits", seed=1)
    assert not torch.equal(other.y, train.y)  # the seed changes the split


def test_synthetic_learnable():
    train, test = load_source("synthetic", seed=0)
    assert train.input_shape == (20,) and train.num_classes == 4 and len(train) + len(test) == 600
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    for _ in range(60):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(train.x), train.y).backward()
        opt.step()
    acc = (net(test.x).argmax(1) == test.y).float().mean().item()
    assert acc > 0.8, acc
    img, _ = load_source("synthetic", seed=0, image_shape=(1, 4, 5))
    assert img.input_shape == (1, 4, 5) and torch.equal(img.x.reshape(len(img), 20), train.x)


def test_unknown_source_and_option():
    with pytest.raises(ValueError, match="dataset") as e:
        load_source("no-such-data")
    assert "digits" in str(e.value) and "mnist1d" in str(e.value)  # lists the valid names
    with pytest.raises(ValueError, match="bogus"):
        load_source("digits", bogus=1)
    assert {"digits", "digits-flat", "mnist1d", "mnist1d-flat", "synthetic", "cifar10", "cifar100",
            "mnist", "fashion-mnist"} <= set(SOURCES)


def test_mnist1d_shapes_cache_and_global_rng(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDFUSE_CACHE", str(tmp_path))
    np.random.seed(123)
    random.seed(7)
    np_before, py_before = np.random.get_state(), random.getstate()
    train, test = load_source("mnist1d")
    np_after = np.random.get_state()
    assert np_after[0] == np_before[0] and np.array_equal(np_after[1], np_before[1])
    assert np_after[2:] == np_before[2:]
    assert random.getstate() == py_before
    assert train.x.shape == (4000, 1, 40) and test.x.shape == (1000, 1, 40)
    assert train.x.dtype == torch.float32 and train.num_classes == 10
    assert sorted(set(train.y.tolist())) == list(range(10))
    assert list(tmp_path.glob("mnist1d_*.npz")) and not list(tmp_path.glob("*.tmp"))
    import mnist1d.data

    def no_regeneration(*a, **k):
        raise AssertionError("second load must come from the .npz cache")

    monkeypatch.setattr(mnist1d.data, "make_dataset", no_regeneration)
    flat, flat_test = load_source("mnist1d-flat")
    assert flat.x.shape == (4000, 40) and torch.equal(flat.x, train.x[:, 0, :])
    assert torch.equal(flat_test.y, test.y)


# ----------------------------------------------------------------------- torchvision fakes
def _write_fake_cifar10(root: Path, n_per_batch: int = 6) -> None:
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for j, name in enumerate(names):
        labels = [(j + i) % 10 for i in range(n_per_batch)]
        data = rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8)
        data[:, 0] = 255 * (j % 2)  # a known pixel (channel 0, row 0, col 0)
        with open(d / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels}, f)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)


def test_fake_cifar10_through_torchvision(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as tv_cifar

    _write_fake_cifar10(tmp_path)
    # torchvision verifies md5 sums of the real archive's files; a fake cannot match them.
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda path, md5=None: os.path.isfile(path))
    train, test = load_source("cifar10", root=str(tmp_path))
    assert train.x.shape == (30, 3, 32, 32) and test.x.shape == (6, 3, 32, 32)
    assert train.y.dtype == torch.int64 and train.num_classes == 10
    assert test.y.tolist() == [(5 + i) % 10 for i in range(6)]
    assert float(train.x.max()) <= 1.0 and float(train.x.min()) >= 0.0
    # batch 1 (j=0) has pixel 0 = 0, batch 2 (j=1) has 255 -> 1.0, in CHW layout
    assert float(train.x[0, 0, 0, 0]) == 0.0 and float(train.x[6, 0, 0, 0]) == 1.0
    small, _ = load_source("cifar10", root=str(tmp_path), limit=10, normalize=True)
    assert len(small) == 10
    assert torch.allclose(small.x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4)


def _write_idx(path: Path, arr: np.ndarray) -> None:
    magic = 0x0800 | arr.ndim  # 0x08 = unsigned byte
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", s) for s in arr.shape))
        f.write(arr.astype(np.uint8).tobytes())


def test_fake_mnist_through_torchvision(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for prefix, n in (("train", 12), ("t10k", 5)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    train, test = load_source("mnist", root=str(tmp_path))
    assert train.x.shape == (12, 1, 28, 28) and test.x.shape == (5, 1, 28, 28)
    assert train.y.tolist() == [i % 10 for i in range(12)] and test.y.dtype == torch.int64
    assert 0.0 <= float(train.x.min()) and float(train.x.max()) <= 1.0


def test_torchvision_missing_root_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="download=True"):
        load_source("cifar10", root="")
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_source("fashion-mnist", root=str(tmp_path), download=False)


def test_idx_files_read_directly(tmp_path):
    """Debian's layout: the four gzipped idx files in one folder, read without torchvision."""
    import gzip

    rng = np.random.default_rng(2)
    for prefix, n in (("train", 14), ("t10k", 6)):
        for kind, arr in (("images-idx3", rng.integers(0, 256, (n, 28, 28))), ("labels-idx1", np.arange(n) % 10)):
            plain = tmp_path / f"{prefix}-{kind}-ubyte"
            _write_idx(plain, arr)
            with open(plain, "rb") as f, gzip.open(str(plain) + ".gz", "wb") as g:
                g.write(f.read())
            plain.unlink()
    train, test = load_source("fashion-mnist", root=str(tmp_path), download=False)
    assert train.x.shape == (14, 1, 28, 28) and test.x.shape == (6, 1, 28, 28)
    assert train.y.tolist() == [i % 10 for i in range(14)] and float(train.x.max()) <= 1.0
    from fedfuse.data.sources import read_idx

    raw = read_idx(str(tmp_path / "t10k-labels-idx1-ubyte.gz"))
    assert raw.dtype == np.uint8 and raw.tolist() == [i % 10 for i in range(6)]


def test_idx_file_with_a_wrong_header_or_size_is_named(tmp_path):
    from fedfuse.data.sources import read_idx

    bad = tmp_path / "x-idx1-ubyte"
    bad.write_bytes(b"PK\x03\x04junk")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(str(bad))
    short = tmp_path / "y-idx1-ubyte"
    short.write_bytes(struct.pack(">I", 0x0801) + struct.pack(">I", 10) + bytes(3))
    with pytest.raises(ValueError, match="declares shape"):
        read_idx(str(short))


@pytest.mark.skipif(not os.path.isdir("/usr/share/datasets/fashion-mnist"),
                    reason="Debian's dataset-fashion-mnist is not installed (scripts/setup.sh installs it)")
def test_real_fashion_mnist_from_the_debian_package():
    train, test = load_source("fashion-mnist")
    assert train.x.shape == (60000, 1, 28, 28) and test.x.shape == (10000, 1, 28, 28)
    assert train.class_counts() == [6000] * 10 and test.class_counts() == [1000] * 10
    assert 0.0 == float(train.x.min()) and float(train.x.max()) == 1.0


# ------------------------------------------------------------------------------ HF on disk
def _fake_hf(tmp_path: Path, rgb: bool = True):
    import datasets
    from PIL import Image

    rng = np.random.default_rng(2)

    def make(n):
        shape = (6, 6, 3) if rgb else (6, 6)
        imgs = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for _ in range(n)]
        return imgs, [i % 3 for i in range(n)]

    feats = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=list("abc"))})
    tr_imgs, tr_y = make(12)
    te_imgs, te_y = make(6)
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"img": tr_imgs, "label": tr_y}, features=feats),
        "test": datasets.Dataset.from_dict({"img": te_imgs, "label": te_y}, features=feats),
    })
    path = tmp_path / "hfdd"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dd.save_to_disk(str(path))
    return dd, path, tr_imgs


def test_hf_save_to_disk_dataset_dict(tmp_path):
    dd, path, tr_imgs = _fake_hf(tmp_path)
    train, test = load_source("hf:fake/tiny", root=str(path))
    assert train.x.shape == (12, 3, 6, 6) and test.x.shape == (6, 3, 6, 6)
    assert train.num_classes == 3 and train.y.tolist() == [i % 3 for i in range(12)]
    expected = torch.from_numpy(np.array(tr_imgs[4])).permute(2, 0, 1).float() / 255.0
    assert torch.allclose(train.x[4], expected)


def test_hf_single_split_grayscale(tmp_path):
    import datasets

    dd, _, _ = _fake_hf(tmp_path, rgb=False)
    single = tmp_path / "single"
    ds = datasets.concatenate_datasets([dd["train"], dd["test"]]).rename_column("label", "fine_label")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.save_to_disk(str(single))
    train, test = load_source("hf:x", root=str(single), test_fraction=1 / 3, seed=0)
    assert train.x.shape == (12, 1, 6, 6) and test.x.shape == (6, 1, 6, 6)  # auto-detected keys
    assert sorted(test.class_counts()) == [2, 2, 2]  # stratified split of the single split
    with pytest.raises(ValueError, match="label"):
        load_source("hf:x", root=str(single), label_key="nope")


# ------------------------------------------------------------------------------ partitions
def test_unknown_partitioning(digits_labels):
    with pytest.raises(ValueError, match="partitioning"):
        partition_indices(digits_labels, 3, "nope")
    assert PARTITIONERS == ("iid", "dirichlet", "shards", "full")


@pytest.mark.parametrize("k", [2, 3, 4])
def test_shards_class_disjoint_and_covering(digits_labels, k):
    parts = partition_indices(digits_labels, k, "shards", seed=0)
    sets = _class_sets(digits_labels, parts)
    for i in range(k):
        for j in range(i + 1, k):
            assert not sets[i] & sets[j]
    assert set().union(*sets) == set(range(10))
    sizes = sorted(len(s) for s in sets)
    assert sizes[-1] - sizes[0] <= 1  # np.array_split of the classes
    # each client holds every sample of its classes
    for p, s in zip(parts, sets):
        assert len(p) == int(np.isin(digits_labels, list(s)).sum())
    assert len(np.concatenate(parts)) == len(digits_labels)


def test_shards_errors_and_classes_per_client(digits_labels):
    with pytest.raises(ValueError, match="partitioning"):
        partition_indices(digits_labels, 11, "shards")
    parts = partition_indices(digits_labels, 5, "shards", classes_per_client=2, seed=0)
    sets = _class_sets(digits_labels, parts)
    assert all(len(s) == 2 for s in sets) and set().union(*sets) == set(range(10))
    flat = np.concatenate(parts)
    assert len(flat) == len(np.unique(flat)) == len(digits_labels)  # no sample twice
    other = partition_indices(digits_labels, 5, "shards", classes_per_client=2, seed=1)
    assert _class_sets(digits_labels, other) != sets
    # 3 clients x 4 classes: 2 classes are shared, their samples split evenly between holders
    parts = partition_indices(digits_labels, 3, "shards", classes_per_client=4, seed=0)
    sets = _class_sets(digits_labels, parts)
    assert all(len(s) == 4 for s in sets) and set().union(*sets) == set(range(10))
    flat = np.concatenate(parts)
    assert len(flat) == len(np.unique(flat)) == len(digits_labels)
    shared = [c for c in range(10) if sum(c in s for s in sets) == 2]
    assert len(shared) == 2
    for c in shared:
        n_c = [int((digits_labels[p] == c).sum()) for p, s in zip(parts, sets) if c in s]
        assert abs(n_c[0] - n_c[1]) <= 1
    with pytest.warns(UserWarning, match="no client"):
        partition_indices(digits_labels, 2, "shards", classes_per_client=3, seed=0)


def _skew(labels, parts, num_classes=10):
    """Mean total-variation distance between client and global class distributions."""
    glob = np.bincount(labels, minlength=num_classes) / len(labels)
    tv = [0.5 * np.abs(np.bincount(labels[p], minlength=num_classes) / len(p) - glob).sum() for p in parts]
    return float(np.mean(tv))


def test_dirichlet_skew_and_validity(digits_labels):
    low = partition_indices(digits_labels, 4, "dirichlet", alpha=0.1, seed=0)
    high = partition_indices(digits_labels, 4, "dirichlet", alpha=100.0, seed=0)
    for parts in (low, high):
        flat = np.concatenate(parts)
        assert len(flat) == len(np.unique(flat)) == len(digits_labels)
        assert all(np.all(np.diff(p) > 0) and p.dtype == np.int64 for p in parts)
        assert min(len(p) for p in parts) >= 10  # default min_partition_size
    assert _skew(digits_labels, low) > 0.4 and _skew(digits_labels, high) < 0.1


def test_dirichlet_small_data_does_not_crash():
    labels = np.arange(60) % 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = partition_indices(labels, 10, "dirichlet", alpha=0.1, seed=0)
    assert len(parts) == 10 and sum(len(p) for p in parts) == 60
    with pytest.raises(ValueError, match="min_partition_size"):
        partition_indices(labels, 10, "dirichlet", alpha=0.05, seed=0, min_partition_size=6)


@pytest.mark.parametrize("method", ["iid", "dirichlet", "shards"])
def test_partition_determinism(digits_labels, method):
    a = partition_indices(digits_labels, 3, method, seed=5)
    b = partition_indices(torch.as_tensor(digits_labels), 3, method, seed=5)
    c = partition_indices(digits_labels, 3, method, seed=6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_balanced_and_full(digits_labels):
    n = len(digits_labels)
    parts = partition_indices(digits_labels, 7, "iid", seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
    assert len(np.unique(np.concatenate(parts))) == n
    # shuffled, not contiguous blocks: client 0 is spread over the whole index range
    assert parts[0].max() - parts[0].min() > n // 2
    assert _skew(digits_labels, parts) < 0.1
    full = partition_indices(digits_labels, 3, "full", seed=0)
    assert len(full) == 3 and all(np.array_equal(p, np.arange(n)) for p in full)


def test_split_train_val_stratified(digits_labels):
    idx = np.arange(0, len(digits_labels), 2)
    tr, va = split_train_val(idx, digits_labels, 0.2, seed=0)
    assert len(np.intersect1d(tr, va)) == 0 and np.array_equal(np.sort(np.concatenate([tr, va])), idx)
    assert abs(len(va) - 0.2 * len(idx)) <= 1
    counts = np.bincount(digits_labels[va], minlength=10)
    assert counts.min() >= 12 and counts.max() <= 17  # ~14.4 per class
    tr2, va2 = split_train_val(idx, digits_labels, 0.2, seed=0)
    assert np.array_equal(va, va2)
    # stratification impossible (singleton class): falls back to a random split
    tr3, va3 = split_train_val(np.arange(5), np.array([0, 0, 1, 1, 2]), 0.4, seed=0)
    assert len(va3) == 2 and len(tr3) == 3
    tr4, va4 = split_train_val(idx, digits_labels, 0.0, seed=0)
    assert len(va4) == 0 and np.array_equal(tr4, idx)


# -------------------------------------------------------------------------------- fusion set
def test_fusion_set_public_balanced_and_short_pool(digits):
    train = digits[0]
    y = train.y.numpy()
    reserved = np.arange(400)
    x, fy = fusion_set(train, size=100, source="public", partitions=None, reserved=reserved,
                       seed=0, return_labels=True)
    assert x.shape == (100, 1, 8, 8) and np.bincount(fy.numpy(), minlength=10).tolist() == [10] * 10
    x_only = fusion_set(train, size=100, source="public", partitions=None, reserved=reserved, seed=0)
    assert torch.equal(x_only, x)  # unlabeled variant: same inputs
    # every drawn row comes from the reserved pool
    pool_x = train.x[:400].reshape(400, -1)
    assert all(((pool_x - row.reshape(1, -1)).abs().sum(1) == 0).any() for row in x)
    # imbalanced pool: small class exhausted, the rest balanced
    pool = np.concatenate([np.flatnonzero(y == 0)[:3], np.flatnonzero(y == 1), np.flatnonzero(y == 2)])
    _, fy2 = fusion_set(train, size=33, source="public", partitions=None, reserved=pool, seed=1,
                        return_labels=True)
    assert np.bincount(fy2.numpy(), minlength=3)[:3].tolist() == [3, 15, 15]
    with pytest.warns(UserWarning, match="fewer"):
        small = fusion_set(train, size=50, source="public", partitions=None,
                           reserved=np.arange(20), seed=0)
    assert small.shape[0] == 20
    with pytest.warns(UserWarning):
        empty = fusion_set(train, size=5, source="public", partitions=None, reserved=None, seed=0)
    assert empty.shape == (0, 1, 8, 8)
    with pytest.raises(ValueError, match="fusion-set-source"):
        fusion_set(train, size=5, source="server", partitions=None, reserved=reserved, seed=0)


def test_fusion_set_client0_only_client0_classes(digits, digits_labels):
    train = digits[0]
    parts = partition_indices(digits_labels, 2, "shards", seed=0)
    _, fy = fusion_set(train, size=200, source="client0", partitions=parts, reserved=None,
                       seed=0, return_labels=True)
    c0 = set(np.unique(digits_labels[parts[0]]).tolist())
    assert set(fy.tolist()) == c0 and len(fy) == 200
    counts = np.bincount(fy.numpy(), minlength=10)[sorted(c0)]
    assert counts.max() - counts.min() <= 1


# ------------------------------------------------------------------------------ FederatedData
def test_build_public_structure_and_client_data():
    fd = FederatedData.build("digits", 4, "dirichlet", alpha=0.5, fusion_size=100, seed=0)
    n = len(fd.train)
    assert abs(len(fd.reserved) - 0.1 * n) <= 1
    flat = np.concatenate(fd.partitions)
    assert len(np.intersect1d(flat, fd.reserved)) == 0
    assert len(flat) == len(np.unique(flat)) == n - len(fd.reserved)
    assert fd.fusion_x.shape == (100, 1, 8, 8) and fd.input_shape == (1, 8, 8) and fd.num_classes == 10
    assert np.bincount(fd.fusion_y.numpy(), minlength=10).tolist() == [10] * 10
    tr, va = fd.client_data(1, val_fraction=0.2, seed=0)
    assert len(tr) + len(va) == len(fd.partitions[1]) and abs(len(va) - 0.2 * len(fd.partitions[1])) <= 1
    assert sorted(torch.cat([tr.y, va.y]).tolist()) == sorted(fd.train.y[fd.partitions[1]].tolist())
    s = fd.summary()
    assert s["client_sizes"] == [len(p) for p in fd.partitions]
    assert [sum(c) for c in s["client_class_counts"]] == s["client_sizes"]
    assert s["fusion_class_counts"] == [10] * 10 and s["dataset"] == "digits"
    with pytest.raises(ValueError):
        fd.client_data(4, 0.1, 0)


def test_build_client0_shards():
    fd = FederatedData.build("digits", 2, "shards", fusion_source="client0", fusion_size=300, seed=3)
    assert len(fd.reserved) == 0
    c0 = set(fd.train.y[fd.partitions[0]].tolist())
    assert set(fd.fusion_y.tolist()) == c0 and len(fd.fusion_y) == 300
    # full: every client gets the whole pool but different validation splits
    full = FederatedData.build("synthetic", 3, "full", fusion_size=20, seed=0)
    assert all(np.array_equal(p, full.partitions[0]) for p in full.partitions)
    assert not torch.equal(full.client_data(0, 0.2, 0)[1].x, full.client_data(1, 0.2, 0)[1].x)


def test_build_bad_names():
    with pytest.raises(ValueError, match="partitioning"):
        FederatedData.build("digits", 2, "bogus")
    with pytest.raises(ValueError, match="fusion-set-source"):
        FederatedData.build("digits", 2, "iid", fusion_source="bogus")
    with pytest.raises(ValueError, match="dataset"):
        FederatedData.build("bogus", 2, "iid")


def _fingerprint(fd: FederatedData) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in fd.partitions:
        h.update(p.tobytes())
    h.update(fd.reserved.tobytes())
    h.update(fd.fusion_x.numpy().tobytes())
    h.update(fd.fusion_y.numpy().tobytes())
    return h.hexdigest()


def test_build_deterministic_cached_and_across_processes():
    kw = dict(alpha=0.3, fusion_size=30, seed=11, num_samples=400, num_features=12, num_classes=4)
    a = FederatedData.build("synthetic", 3, "dirichlet", **kw)
    assert FederatedData.build("synthetic", 3, "dirichlet", **kw) is a  # in-process cache
    b = FederatedData._build(  # uncached rebuild in this process
        dict(dataset="synthetic", num_clients=3, partitioning="dirichlet", alpha=0.3,
             classes_per_client=0, fusion_size=30, fusion_source="public", public_fraction=0.1,
             root="", seed=11, test_fraction=0.2),
        dict(num_samples=400, num_features=12, num_classes=4),
    )
    assert _fingerprint(a) == _fingerprint(b)
    c = FederatedData.build("synthetic", 3, "dirichlet", **{**kw, "seed": 12})
    assert _fingerprint(c) != _fingerprint(a)
    # a fresh interpreter (as a ClientApp / ServerApp process would be) gets the same data
    code = (
        "import sys, hashlib; sys.path.insert(0, sys.argv[1]);"
        "from fedfuse.data import FederatedData;"
        "fd = FederatedData.build('synthetic', 3, 'dirichlet', alpha=0.3, fusion_size=30, seed=11,"
        " num_samples=400, num_features=12, num_classes=4);"
        "h = hashlib.sha256(); [h.update(p.tobytes()) for p in fd.partitions];"
        "h.update(fd.reserved.tobytes()); h.update(fd.fusion_x.numpy().tobytes());"
        "h.update(fd.fusion_y.numpy().tobytes()); print(h.hexdigest())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "random"}
    out = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True,
                         env=env, cwd=str(REPO), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == _fingerprint(a)


# ------------------------------------------------------------------------- metadata without loading
@pytest.mark.parametrize("name", ["digits", "digits-flat", "digits-std", "synthetic", "mnist1d", "mnist1d-flat"])
def test_source_info_matches_the_loaded_data(name):
    """What the config checks assume about a source (shape, classes, value scale) is what its loader gives."""
    from fedfuse.data import source_info

    info = source_info(name)
    train, test = load_source(name)
    assert train.input_shape == test.input_shape == info.input_shape
    assert train.num_classes == info.num_classes
    if info.scale == "unit":
        assert float(train.x.min()) >= 0.0 and float(train.x.max()) <= 1.0
    else:
        assert abs(float(train.x.mean())) < 0.5 and 0.5 < float(train.x.std()) < 2.0


def test_source_info_of_torchvision_and_hf():
    from fedfuse.data import source_info

    assert source_info("cifar10").input_shape == (3, 32, 32) and source_info("cifar100").num_classes == 100
    assert source_info("fashion-mnist").input_shape == (1, 28, 28) and source_info("mnist").scale == "unit"
    assert source_info("hf:uoft-cs/cifar10") is None  # only known once loaded
    with pytest.raises(ValueError, match="dataset"):
        source_info("bogus")


def test_fusion_file_roundtrip_and_checks(tmp_path, digits):
    from fedfuse.data import check_fusion_inputs, load_fusion_file, source_info

    np.savez(tmp_path / "f.npz", x=digits[0].x[:10].numpy(), y=digits[0].y[:10].numpy())
    x, y = load_fusion_file(tmp_path / "f.npz")
    assert torch.equal(x, digits[0].x[:10]) and torch.equal(y, digits[0].y[:10])
    check_fusion_inputs(x, y, dataset="digits", info=source_info("digits"))
    with pytest.raises(ValueError, match=r"expected \[0, 1\]"):
        check_fusion_inputs(x * 16, y, dataset="digits", info=source_info("digits"))
