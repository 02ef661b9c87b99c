"""Label-based client partitions and stratified splits.

``partition_indices`` turns a label vector into one index array per client. It runs the
flwr-datasets partitioners on an in-memory ``datasets.Dataset`` holding two columns, ``label`` and
``idx`` (the original row number), so the rows each partitioner selects map straight back to
indices into ``labels``. Before that, the rows are permuted with the seed, because
``IidPartitioner`` shards contiguously and ``DirichletPartitioner`` / ``PathologicalPartitioner``
split each class in row order: without the permutation the seed would not change which samples a
client gets.

Methods (``PARTITIONERS``):

- ``iid``: ``IidPartitioner`` on the seed-permuted rows; sizes differ by at most one.
- ``dirichlet``: ``DirichletPartitioner(alpha, seed, self_balancing=False)``; per class, the
  shares come from Dir(alpha). ``min_partition_size`` defaults to ``min(10, N // (4 K))`` and,
  when left at its default, is relaxed (with a warning) instead of failing on small data.
- ``shards``: with ``classes_per_client == 0``, class-disjoint as in the Neuron Interpolation
  paper (App. D): classes shuffled by seed, ``np.array_split`` across clients, each client gets
  every sample of its classes. With ``classes_per_client = c > 0``: each client gets exactly c
  classes, client i the seed-permuted classes (i*c + j) mod C, so all classes are covered when
  K*c >= C and a class shared by several clients has its samples split evenly among them
  (``PathologicalPartitioner`` does the splitting).
- ``full``: every client gets every index (clients differ only by their training seed).

All results are sorted int64 arrays and are a pure function of (labels, arguments, seed).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from fedfuse.choices import PARTITIONINGS

PARTITIONERS: tuple[str, ...] = PARTITIONINGS  # the names are declared in fedfuse.config

# Distinct sub-streams of the user seed, so e.g. the row permutation and the class shuffle are
# not the same random numbers.
_STREAM_ROWS, _STREAM_CLASSES, _STREAM_SPLIT = 1, 2, 3


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, stream])


def _as_label_array(labels: np.ndarray | torch.Tensor | Sequence[int]) -> np.ndarray:
    """Labels as a 1-D int64 numpy array."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _hf_dataset(labels: np.ndarray, perm: np.ndarray):
    """In-memory ``datasets.Dataset`` with columns label / idx, rows in the order ``perm``."""
    import datasets  # lazy: heavy import

    return datasets.Dataset.from_dict({"label": labels[perm], "idx": perm})


def _collect(partitioner, num_partitions: int) -> list[np.ndarray]:
    """Row indices (``idx`` column) of every partition of a ready partitioner, sorted."""
    out = []
    for pid in range(num_partitions):
        part = partitioner.load_partition(pid)
        out.append(np.sort(np.asarray(part["idx"], dtype=np.int64)))
    return out


def _dirichlet(
    labels: np.ndarray, perm: np.ndarray, k: int, alpha: float, seed: int, min_size: int
) -> list[np.ndarray]:
    from flwr_datasets.partitioner import DirichletPartitioner

    p = DirichletPartitioner(
        num_partitions=k,
        partition_by="label",
        alpha=float(alpha),
        min_partition_size=int(min_size),
        self_balancing=False,
        shuffle=False,  # we sort the indices anyway
        seed=int(seed),
    )
    p.dataset = _hf_dataset(labels, perm)
    # The partitioner warns on every resampling attempt; we report the outcome once instead.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _collect(p, k)


def _disjoint_shards(labels: np.ndarray, k: int, seed: int) -> list[np.ndarray]:
    classes = np.unique(labels)
    if k > len(classes):
        raise ValueError(
            f"partitioning: 'shards' (class-disjoint) needs num_partitions <= number of classes; "
            f"got {k} partitions for {len(classes)} classes (set data-options.classes-per-client > 0 to allow "
            "shared classes)"
        )
    shuffled = _rng(seed, _STREAM_CLASSES).permutation(classes)
    groups = np.array_split(shuffled, k)
    return [np.flatnonzero(np.isin(labels, g)).astype(np.int64) for g in groups]


def _pathological(
    labels: np.ndarray, perm: np.ndarray, k: int, classes_per_client: int, seed: int
) -> list[np.ndarray]:
    from flwr_datasets.partitioner import PathologicalPartitioner

    classes = np.unique(labels)
    if classes_per_client > len(classes):
        raise ValueError(
            f"partitioning: classes_per_client={classes_per_client} exceeds the number of "
            f"classes ({len(classes)})"
        )
    # flwr-datasets' "deterministic" mode gives partition m the classes m, m+1, ... (mod C),
    # so K clients x c classes would only ever touch K + c - 1 classes. Instead we ask it for
    # K*c single-class sub-partitions (sub-partition m gets class m mod C; each class's samples
    # are array_split evenly among the sub-partitions holding it) and give client i the
    # sub-partitions i*c .. i*c + c - 1, i.e. classes (i*c + j) mod C: all classes are covered
    # whenever K*c >= C and every class is shared by as few clients as possible. Class ids are
    # relabelled by a seeded permutation so the assignment depends on the seed.
    c = int(classes_per_client)
    rank = np.empty(classes.max() + 1, dtype=np.int64)
    rank[_rng(seed, _STREAM_CLASSES).permutation(classes)] = np.arange(len(classes))
    p = PathologicalPartitioner(
        num_partitions=k * c,
        partition_by="label",
        num_classes_per_partition=1,
        class_assignment_mode="deterministic",
        shuffle=False,
        seed=int(seed),
    )
    import datasets

    p.dataset = datasets.Dataset.from_dict({"label": rank[labels[perm]], "idx": perm})
    with warnings.catch_warnings():
        # flwr-datasets' own "classes will NOT be used" warning names a parameter that does
        # not exist; we warn below in our terms instead.
        warnings.simplefilter("ignore")
        sub = _collect(p, k * c)
    parts = [np.sort(np.concatenate(sub[i * c : (i + 1) * c])) for i in range(k)]
    if k * classes_per_client < len(classes):
        used = np.unique(np.concatenate([labels[q] for q in parts]))
        warnings.warn(
            f"shards: {k} clients x {classes_per_client} classes each cannot cover all "
            f"{len(classes)} classes; classes {sorted(set(classes.tolist()) - set(used.tolist()))} "
            "are given to no client",
            stacklevel=3,
        )
    return parts


def partition_indices(
    labels: np.ndarray | torch.Tensor,
    num_partitions: int,
    method: str,
    *,
    alpha: float = 0.5,
    classes_per_client: int = 0,
    seed: int = 0,
    min_partition_size: int | None = None,
) -> list[np.ndarray]:
    """Split sample indices across ``num_partitions`` clients by label.

    Args:
        labels: [N] integer class labels.
        num_partitions: number of clients K (>= 1).
        method: one of ``PARTITIONERS``.
        alpha: Dirichlet concentration (``dirichlet`` only); small = skewed.
        classes_per_client: ``shards`` only; 0 = class-disjoint split of all classes.
        seed: everything random derives from it.
        min_partition_size: ``dirichlet`` only; ``None`` = ``min(10, N // (4 K))``, relaxed
            automatically if it cannot be met.

    Returns:
        K sorted int64 arrays of indices into ``labels`` (for ``full`` each is ``arange(N)``).

    Raises:
        ValueError: unknown method (message names the key "partitioning") or impossible
            arguments (e.g. more class-disjoint shards than classes).
    """
    if method not in PARTITIONERS:
        raise ValueError(
            f"partitioning: unknown method {method!r}; valid: {', '.join(PARTITIONERS)}"
        )
    y = _as_label_array(labels)
    n, k = len(y), int(num_partitions)
    if k < 1:
        raise ValueError(f"partitioning: num_partitions must be >= 1, got {num_partitions}")
    if method == "full":
        return [np.arange(n, dtype=np.int64) for _ in range(k)]
    if n < k:
        raise ValueError(f"partitioning: {n} samples cannot fill {k} partitions")
    if k == 1:
        return [np.arange(n, dtype=np.int64)]
    if method == "shards" and classes_per_client <= 0:
        return _disjoint_shards(y, k, seed)

    perm = _rng(seed, _STREAM_ROWS).permutation(n).astype(np.int64)
    if method == "iid":
        from flwr_datasets.partitioner import IidPartitioner

        p = IidPartitioner(num_partitions=k)
        p.dataset = _hf_dataset(y, perm)
        return _collect(p, k)
    if method == "shards":
        return _pathological(y, perm, k, classes_per_client, seed)

    # dirichlet
    if alpha <= 0:
        raise ValueError(f"dirichlet-alpha must be > 0, got {alpha}")
    if min_partition_size is not None:
        try:
            return _dirichlet(y, perm, k, alpha, seed, min_partition_size)
        except ValueError as e:
            raise ValueError(
                f"partitioning: Dirichlet(alpha={alpha}) could not give every one of {k} "
                f"clients >= {min_partition_size} samples out of {n}; lower "
                f"min_partition_size, raise alpha or use fewer clients ({e})"
            ) from e
    # Default: a floor that small test sets can meet. If the partitioner's 10 resampling
    # attempts cannot meet it, relax it to 1 (also trying two seeds derived from ``seed``, still
    # deterministic) before accepting possibly-empty clients, rather than crash.
    auto = min(10, n // (4 * k))
    derived = [int(v) for v in np.random.SeedSequence([int(seed) & 0xFFFFFFFF, 9]).generate_state(2)]
    for floor, sd in [(auto, seed), (1, seed), (1, derived[0]), (1, derived[1]), (0, seed)]:
        try:
            parts = _dirichlet(y, perm, k, alpha, sd, floor)
        except ValueError:
            continue
        if floor < auto:
            smallest = min(len(q) for q in parts)
            warnings.warn(
                f"Dirichlet(alpha={alpha}) partitioning of {n} samples into {k} clients: "
                f"relaxed min_partition_size to {floor}; smallest client has {smallest} "
                f"samples{' (EMPTY client: raise alpha or use fewer clients)' if smallest == 0 else ''}",
                stacklevel=2,
            )
        return parts
    raise AssertionError("unreachable: min_partition_size=0 always succeeds")


def split_train_val(
    indices: np.ndarray,
    labels: np.ndarray | torch.Tensor,
    val_fraction: float,
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Split an index array into (train, val), stratified by label when possible.

    Args:
        indices: [M] int indices into ``labels``.
        labels: [N] labels of the whole dataset (indexed by ``indices``).
        val_fraction: fraction of ``indices`` for validation, in [0, 1).
        seed: split seed.

    Returns:
        (train_idx, val_idx): sorted int64 arrays partitioning ``indices``. Stratified with
        sklearn when every class has >= 2 members and both sides can hold every class;
        otherwise a seeded random split. ``val_fraction == 0`` gives an empty val array.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val/test fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(len(idx) * val_fraction))
    if n_val == 0 or len(idx) < 2:
        return np.sort(idx), np.empty(0, dtype=np.int64)
    n_val = min(n_val, len(idx) - 1)
    y = _as_label_array(labels)[idx]
    classes, counts = np.unique(y, return_counts=True)
    c = len(classes)
    if counts.min() >= 2 and c <= n_val <= len(idx) - c:
        from sklearn.model_selection import train_test_split

        tr, va = train_test_split(
            idx, test_size=n_val, stratify=y, random_state=int(seed) & 0xFFFFFFFF
        )
    else:  # stratification impossible (singleton classes / tiny split): plain random split
        perm = _rng(seed, _STREAM_SPLIT).permutation(len(idx))
        va, tr = idx[perm[:n_val]], idx[perm[n_val:]]
    return np.sort(tr).astype(np.int64), np.sort(va).astype(np.int64)
