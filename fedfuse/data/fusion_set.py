"""The server's fusion set and the complete federated data setup (``FederatedData``).

The fusion set is a small sample of inputs the server uses to fuse client models. Two sources:

- ``"public"``: drawn from ``reserved``, a held-out slice of the training set that no client
  gets (a server with its own unlabelled public data).
- ``"client0"``: drawn from client 0's pool only, the skewed setting of the Neuron
  Interpolation paper (App. D): the server sees a single party's distribution.

Both draw class-balanced as far as the pool allows (the paper's ``sample_balanced_subset``):
round-robin over the classes present in the pool.

A fusion set can also come from a file (``fusion-set-path``, e.g. on a deployed SuperLink):
``load_fusion_file`` reads it and ``check_fusion_inputs`` checks it against what is known about the
dataset (shape, dtype, finite values, value scale of the loader's preprocessing).

``FederatedData.build`` must give identical results in every process (the ServerApp and each
ClientApp build it independently), so everything derives from the arguments and the seed.
"""

from __future__ import annotations

import functools
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.choices import FUSION_SET_SOURCES
from fedfuse.data.partition import PARTITIONERS, partition_indices, split_train_val
from fedfuse.data.sources import ArrayDataset, SourceInfo, load_source, source_info


def _balanced_sample(pool: np.ndarray, labels: np.ndarray, size: int, seed: int) -> np.ndarray:
    """Up to ``size`` indices from ``pool``, as class-balanced as possible, in random order.

    Each sample gets its rank within its class (after a seeded shuffle); taking samples by
    increasing rank fills every class equally until the small classes run out.
    """
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, 5])
    pool = rng.permutation(np.asarray(pool, dtype=np.int64))
    y = labels[pool]
    rank = np.empty(len(pool), dtype=np.int64)
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        rank[members] = np.arange(len(members))
    # Within one rank level, the order of classes is random, so the remainder (size mod
    # #classes) goes to random classes rather than always the lowest labels.
    class_tiebreak = rng.permutation(int(y.max()) + 1 if len(y) else 1)
    order = np.lexsort((class_tiebreak[y], rank)) if len(y) else np.empty(0, dtype=np.int64)
    chosen = pool[order[:size]]
    return rng.permutation(chosen)


def fusion_set(
    train: ArrayDataset,
    *,
    size: int,
    source: str,
    partitions: list[np.ndarray] | None,
    reserved: np.ndarray | None,
    seed: int,
    return_labels: bool = False,
    strict: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Draw the server's fusion set from ``train``.

    Args:
        train: the full training set.
        size: number of samples wanted.
        source: ``"public"`` (from ``reserved``) or ``"client0"`` (from ``partitions[0]``).
        partitions: client index arrays into ``train`` (needed for ``client0``).
        reserved: held-out index array into ``train`` (needed for ``public``).
        seed: sampling seed.
        return_labels: also return the labels (for server-side importance scores).
        strict: warn when the pool holds fewer than ``size`` samples (``False``: ``size`` is an upper bound, the
            run config's default ``fusion-set-size``, which takes the whole pool of a small dataset).

    Returns:
        x [M, *input_shape] float32 with M = min(size, pool size), or (x, y [M] int64).
        Warns (never raises) when the pool holds fewer than ``size`` samples and ``strict``.
    """
    if source not in FUSION_SET_SOURCES:
        raise ValueError(
            f"fusion-set-source: unknown source {source!r}; valid: {', '.join(FUSION_SET_SOURCES)}"
        )
    if source == "public":
        pool = np.asarray(reserved if reserved is not None else [], dtype=np.int64)
    else:
        pool = np.asarray(partitions[0] if partitions else [], dtype=np.int64)
    size = max(int(size), 0)
    if len(pool) < size and strict:
        warnings.warn(
            f"fusion set: {source!r} pool holds {len(pool)} samples, fewer than the "
            f"{size} requested; using all of them",
            stacklevel=2,
        )
    idx = _balanced_sample(pool, train.y.numpy(), size, seed) if size and len(pool) else np.empty(0, np.int64)
    t = torch.as_tensor(idx, dtype=torch.long)
    x = train.x[t]
    return (x, train.y[t]) if return_labels else x


FUSION_FILE_SUFFIXES = (".pt", ".pth", ".npz")
# slack on the value-scale checks: float rounding of [0, 1] data; a standardised set far outside it
_UNIT_SLACK = 1e-3
_STANDARD_MAX_ABS, _STANDARD_STD = 50.0, (0.05, 20.0)


def load_fusion_file(path: str | Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Read a fusion set saved as ``.pt``/``.pth`` (a tensor, or ``{"x": tensor, "y": tensor}``) or ``.npz``
    (array ``x``, optional ``y``). Returns ``(x [B, *input_shape], y [B] or None)`` with the stored dtypes.

    Raises ``ValueError`` saying what is wrong (missing file, unknown suffix, unreadable, wrong content).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError("file does not exist")
    if not p.is_file():
        raise ValueError("not a file")
    if p.suffix not in FUSION_FILE_SUFFIXES:
        raise ValueError(f"unknown format {p.suffix!r}; expected one of {list(FUSION_FILE_SUFFIXES)}")
    if p.suffix == ".npz":
        try:
            with np.load(p, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as exc:
            raise ValueError(f"not a readable .npz file ({type(exc).__name__}: {exc})") from None
        if "x" not in arrays:
            raise ValueError(f"the .npz holds arrays {sorted(arrays)}; expected 'x' (inputs) and optional 'y'")
        y = arrays.get("y")
        return torch.from_numpy(arrays["x"]), (torch.from_numpy(y) if y is not None else None)
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many kinds (pickle, zip, runtime) for a corrupt file
        raise ValueError(f"not a readable torch file ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") \
            from None
    if isinstance(obj, dict):
        if "x" not in obj:
            raise ValueError(f"the saved dict has keys {sorted(map(str, obj))}; expected 'x' (inputs) and optional 'y'")
        x, y = obj["x"], obj.get("y")
    else:
        x, y = obj, None
    if not isinstance(x, torch.Tensor) or not (y is None or isinstance(y, torch.Tensor)):
        raise ValueError(f"expected tensors, got x: {type(x).__name__}, y: {type(y).__name__}")
    return x, y


def check_fusion_inputs(x: torch.Tensor, y: torch.Tensor | None = None, *, dataset: str = "",
                        info: SourceInfo | None = None, input_shape: tuple[int, ...] | None = None,
                        num_classes: int | None = None) -> None:
    """Check fusion inputs ``x [B, *input_shape]`` (and labels ``y [B]``) against the dataset.

    ``info`` is the dataset's ``SourceInfo`` (``None`` when only known after loading); ``input_shape`` /
    ``num_classes`` override it. Checks: non-empty, floating point, shape, finite values, the value scale of
    the loader's preprocessing (``[0, 1]`` or standardised), label dtype, length and range.
    Raises ``ValueError`` saying what was found and what was expected.
    """
    shape = tuple(input_shape) if input_shape is not None else (info.input_shape if info else None)
    classes = num_classes if num_classes is not None else (info.num_classes if info else None)
    name = f"dataset {dataset!r}" if dataset else "the dataset"
    scale = f"; {name} inputs are {info.scale_text()}" if info else ""
    if x.dim() < 2 or x.shape[0] == 0:
        raise ValueError(f"expected inputs [B, *input_shape] with B >= 1, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"inputs have dtype {x.dtype}; expected floating point{scale}")
    if shape is not None and tuple(x.shape[1:]) != shape:
        raise ValueError(f"inputs have shape {tuple(x.shape[1:])} per sample; {name} has {shape}")
    xf = x.double()
    if not torch.isfinite(xf).all():
        raise ValueError(f"inputs hold {int((~torch.isfinite(xf)).sum())} non-finite values (NaN/Inf)")
    lo, hi = float(xf.min()), float(xf.max())
    if info is not None and info.scale == "unit" and (lo < -_UNIT_SLACK or hi > 1 + _UNIT_SLACK):
        raise ValueError(f"values span [{lo:g}, {hi:g}], expected [0, 1]{scale}")
    if info is not None and info.scale == "standard" and xf.numel() > 1:
        std = float(xf.std())
        if max(abs(lo), abs(hi)) > _STANDARD_MAX_ABS or not _STANDARD_STD[0] <= std <= _STANDARD_STD[1]:
            raise ValueError(f"values span [{lo:g}, {hi:g}] with std {std:.3g}, not on the expected scale{scale}")
    if y is None:
        return
    if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"labels y have dtype {y.dtype}; expected integers")
    if tuple(y.shape) != (x.shape[0],):
        raise ValueError(f"labels y have shape {tuple(y.shape)}; expected ({x.shape[0]},), one per input")
    if classes is not None and len(y) and (int(y.min()) < 0 or int(y.max()) >= classes):
        raise ValueError(f"labels y span [{int(y.min())}, {int(y.max())}]; {name} has classes 0..{classes - 1}")


def _freeze(v: Any) -> Any:
    """Hashable version of an option value (lists -> tuples, dicts -> sorted item tuples)."""
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(w)) for k, w in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(w) for w in v)
    return v


@dataclass(frozen=True, eq=False)
class FederatedData:
    """Complete, deterministic federated data setup. Treat it as read-only: ``build`` caches it.

    Attributes:
        train / test: the source's splits (x [N, *input_shape] float32, y [N] int64).
        partitions: one sorted index array into ``train`` per client (its train + val pool).
        reserved: indices of ``train`` held out for the server ("public" fusion pool); empty
            when the fusion source is ``client0``. Disjoint from every partition.
        fusion_x: [F, *input_shape] server fusion inputs; fusion_y: [F] their labels.
        num_classes, input_shape: of the task.
        config: the arguments ``build`` was called with (for logs / summary).
    """

    train: ArrayDataset
    test: ArrayDataset
    partitions: list[np.ndarray]
    reserved: np.ndarray
    fusion_x: torch.Tensor
    fusion_y: torch.Tensor
    num_classes: int
    input_shape: tuple
    config: dict = field(default_factory=dict, compare=False)

    @property
    def num_clients(self) -> int:
        return len(self.partitions)

    def client_data(self, pid: int, val_fraction: float, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
        """(train, val) ArrayDatasets of client ``pid``: a stratified split of its pool.

        The split seed mixes ``seed`` with ``pid`` so that clients sharing a pool (``full``
        partitioning) still get different validation samples.
        """
        if not 0 <= pid < len(self.partitions):
            raise ValueError(f"partition id {pid} out of range [0, {len(self.partitions)})")
        split_seed = int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, pid]).generate_state(1)[0])
        tr, va = split_train_val(self.partitions[pid], self.train.y.numpy(), val_fraction, split_seed)
        return self.train.subset(tr), self.train.subset(va)

    def summary(self) -> dict:
        """Sizes and per-client class counts (JSON-serialisable)."""
        y = self.train.y.numpy()

        def counts(idx: np.ndarray) -> list[int]:
            return np.bincount(y[idx], minlength=self.num_classes)[: self.num_classes].tolist()

        return {
            **{k: v for k, v in self.config.items() if isinstance(v, (str, int, float, bool))},
            "num_clients": self.num_clients,
            "num_classes": self.num_classes,
            "input_shape": list(self.input_shape),
            "train_size": len(self.train),
            "test_size": len(self.test),
            "reserved_size": int(len(self.reserved)),
            "client_sizes": [int(len(p)) for p in self.partitions],
            "client_class_counts": [counts(p) for p in self.partitions],
            "fusion_size": int(len(self.fusion_y)),
            "fusion_class_counts": torch.bincount(self.fusion_y, minlength=self.num_classes)[
                : self.num_classes
            ].tolist(),
        }

    @classmethod
    def build(
        cls,
        dataset: str,
        num_clients: int,
        partitioning: str,
        *,
        alpha: float = 0.5,
        classes_per_client: int = 0,
        fusion_size: int = 300,
        fusion_source: str = "public",
        public_fraction: float = 0.1,
        root: str = "",
        seed: int = 0,
        test_fraction: float = 0.2,
        fusion_size_strict: bool = True,
        **source_options,
    ) -> "FederatedData":
        """Load ``dataset``, partition it over ``num_clients`` and draw the fusion set.

        With ``fusion_source == "public"`` a stratified ``public_fraction`` of train is first
        held out as ``reserved`` and only the rest is partitioned. ``fusion_size_strict``: warn when the pool holds
        fewer than ``fusion_size`` samples (``False`` for the run config's default size, an upper bound). Same
        arguments -> identical result in any process; repeated calls in one process return the cached object.
        """
        if partitioning not in PARTITIONERS:
            raise ValueError(
                f"partitioning: unknown method {partitioning!r}; valid: {', '.join(PARTITIONERS)}"
            )
        if fusion_source not in FUSION_SET_SOURCES:
            raise ValueError(
                f"fusion-set-source: unknown source {fusion_source!r}; valid: {', '.join(FUSION_SET_SOURCES)}"
            )
        args = dict(
            dataset=dataset, num_clients=int(num_clients), partitioning=partitioning,
            alpha=float(alpha), classes_per_client=int(classes_per_client),
            fusion_size=int(fusion_size), fusion_source=fusion_source,
            public_fraction=float(public_fraction), root=str(root), seed=int(seed),
            test_fraction=float(test_fraction), fusion_size_strict=bool(fusion_size_strict),
        )
        try:
            key = (tuple(sorted(args.items())), _freeze(source_options))
            hash(key)
        except TypeError:  # unhashable option value: build without caching
            return cls._build(args, source_options)
        return _cached_build(key)

    @classmethod
    def _build(cls, args: dict, source_options: dict) -> "FederatedData":
        seed = args["seed"]
        train, test = load_source(
            args["dataset"], root=args["root"], seed=seed, test_fraction=args["test_fraction"],
            **source_options,
        )
        labels = train.y.numpy()
        all_idx = np.arange(len(train), dtype=np.int64)
        if args["fusion_source"] == "public" and args["public_fraction"] > 0:
            # split_train_val returns (rest, held-out) with the held-out share stratified.
            pool, reserved = split_train_val(all_idx, labels, args["public_fraction"], seed + 1)
        else:
            pool, reserved = all_idx, np.empty(0, dtype=np.int64)
        local = partition_indices(
            labels[pool], args["num_clients"], args["partitioning"],
            alpha=args["alpha"], classes_per_client=args["classes_per_client"], seed=seed,
        )
        partitions = [pool[p] for p in local]  # back to indices into train (pool is sorted)
        if args["fusion_source"] == "public" and len(reserved) == 0:   # public-fraction=0: no fusion set at all
            fx, fy = train.x[:0], train.y[:0]
        else:
            fx, fy = fusion_set(
                train, size=args["fusion_size"], source=args["fusion_source"],
                partitions=partitions, reserved=reserved, seed=seed, return_labels=True,
                strict=args.get("fusion_size_strict", True),
            )
        return cls(
            train=train, test=test, partitions=partitions, reserved=reserved,
            fusion_x=fx, fusion_y=fy, num_classes=train.num_classes,
            input_shape=train.input_shape, config={**args, **source_options},
        )


@functools.lru_cache(maxsize=4)
def _cached_build(key) -> FederatedData:
    args, options = dict(key[0]), dict(key[1])
    return FederatedData._build(args, options)


def _save_xy(path: Path, x: torch.Tensor, y: torch.Tensor | None) -> Path:
    if path.suffix not in FUSION_FILE_SUFFIXES:
        raise ValueError(f"{path}: unknown format {path.suffix!r}; expected one of {list(FUSION_FILE_SUFFIXES)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npz":
        arrays = {"x": x.float().numpy()}
        if y is not None:
            arrays["y"] = y.long().numpy()
        np.savez_compressed(path, **arrays)
    else:
        torch.save({"x": x.float().contiguous(), **({"y": y.long().contiguous()} if y is not None else {})}, path)
    return path


def write_fusion_set_file(path: str | Path, *, dataset: str, size: int, seed: int = 0, source: str = "public",
                          public_fraction: float = 0.2, num_clients: int = 4, partitioning: str = "shards",
                          alpha: float = 0.5, classes_per_client: int = 0, data_root: str = "",
                          test_fraction: float = 0.2, with_labels: bool = True) -> Path:
    """Write the server fusion set of a run to ``path`` (``.npz``: ``x`` [B, *input_shape] float32 and ``y`` [B]
    int64; ``.pt``: ``{"x", "y"}``), preprocessed exactly as the run's loader does (``fusion-set-path`` then
    passes the value-scale check). Arguments mirror the run-config keys (``fusion-set-size`` = ``size``,
    ``fusion-set-source``, ``public-fraction``, ...); ``source="public"`` draws from the held-out pool no client's
    partition uses, so the file matches a simulation with the same keys. Labels are only needed for server-side
    importance (``with_labels=False`` writes the inputs only). Returns the path."""
    data = FederatedData.build(dataset, num_clients, partitioning, alpha=alpha, classes_per_client=classes_per_client,
                               fusion_size=size, fusion_source=source, public_fraction=public_fraction,
                               root=data_root, seed=seed, test_fraction=test_fraction)
    info = source_info(dataset)
    check_fusion_inputs(data.fusion_x, data.fusion_y, dataset=dataset, info=info, num_classes=data.num_classes)
    return _save_xy(Path(path).expanduser(), data.fusion_x, data.fusion_y if with_labels else None)


def write_test_set_file(path: str | Path, *, dataset: str, seed: int = 0, data_root: str = "",
                        test_fraction: float = 0.2) -> Path:
    """Write the dataset's test split (``x``, ``y``; the fusion-set file format) for ``test-set-path``: a server
    that evaluates centrally without holding the training data. Returns the path."""
    train, test = load_source(dataset, root=data_root, seed=seed, test_fraction=test_fraction)
    return _save_xy(Path(path).expanduser(), test.x, test.y)


@dataclass(frozen=True, eq=False)
class ServerData:
    """What the ServerApp holds when the clients keep all training data (node-config ``data-path``): the task
    (``num_classes``, ``input_shape``) and its two files, the fusion set (``fusion_x [F, *input_shape]``,
    ``fusion_y [F]`` or ``None``) and the central test set (``test``). The same attributes as
    ``FederatedData`` for what a server reads."""

    test: ArrayDataset
    fusion_x: torch.Tensor
    fusion_y: torch.Tensor | None
    num_classes: int
    input_shape: tuple
