"""Node-local data: one file per SuperNode with that node's own (private) training and validation data.

A deployed SuperNode given node-config ``data-path`` trains on this file instead of slicing the public
dataset, so the data never has to exist anywhere else. Format (``.npz`` or ``.pt``/``.pth``):

=========== ====================== ==========================================================
key          shape / dtype          meaning
=========== ====================== ==========================================================
``x_train`` [N, *input_shape] float training inputs, preprocessed like the run's ``dataset``
                                    (the same shape and value scale: e.g. digits ``(1, 8, 8)``
                                    in [0, 1]; ``fedfuse.data.SOURCE_INFO``)
``y_train`` [N] int                 labels in ``[0, num_classes)``
``x_val``   [M, *input_shape] float optional validation inputs (importance scores, local eval)
``y_val``   [M] int                 optional, with ``x_val``
=========== ====================== ==========================================================

Without ``x_val``/``y_val`` the node holds out ``val-fraction`` of its training data (stratified, seeded).
A ``.pt`` file holds a dict of tensors with the same keys. Every array is checked when loaded (shape, dtype,
finite, value scale, label range; ``check_fusion_inputs``' rules) and a problem is a ``ValueError`` saying
what was found.

``write_node_data`` writes one such file; ``write_partition_files`` splits a named dataset into one file per
node (for trying a deployment with public data: each node then only ever sees its own file).

    .venv/bin/python -m fedfuse.data.node_data --dataset digits --num-partitions 3 --partitioning shards --out /tmp/nodes
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path

import numpy as np
import torch

from fedfuse.data.fusion_set import FederatedData, check_fusion_inputs
from fedfuse.data.partition import split_train_val
from fedfuse.data.sources import ArrayDataset, SourceInfo

NODE_DATA_SUFFIXES = (".npz", ".pt", ".pth")
NODE_DATA_KEYS = ("x_train", "y_train", "x_val", "y_val")


def _read(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise ValueError("file does not exist")
    if not path.is_file():
        raise ValueError("not a file")
    if path.suffix not in NODE_DATA_SUFFIXES:
        raise ValueError(f"unknown format {path.suffix!r}; expected one of {list(NODE_DATA_SUFFIXES)}")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: torch.from_numpy(z[k]) for k in z.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as exc:
            raise ValueError(f"not a readable .npz file ({type(exc).__name__}: {exc})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many kinds for a corrupt file
        raise ValueError(f"not a readable torch file ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") \
            from None
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"expected a dict of tensors with keys {list(NODE_DATA_KEYS)}, got {type(obj).__name__}")
    return {str(k): v for k, v in obj.items()}


def load_node_data(path: str | Path, *, num_classes: int, info: SourceInfo | None = None, dataset: str = "",
                   input_shape: tuple[int, ...] | None = None, val_fraction: float = 0.1,
                   seed: int = 0) -> tuple[ArrayDataset, ArrayDataset]:
    """``(train, val)`` of a node-local data file, checked against the dataset (``info`` / ``input_shape``).

    Raises ``ValueError`` saying what is wrong (the ClientApp prefixes the node-config key ``data-path``).
    """
    arrays = _read(Path(path).expanduser())
    unknown = sorted(set(arrays) - set(NODE_DATA_KEYS))
    missing = [k for k in ("x_train", "y_train") if k not in arrays]
    if missing or unknown:
        raise ValueError(f"holds arrays {sorted(arrays)}; expected x_train, y_train and optional x_val, y_val"
                         + (f" (missing {missing})" if missing else "") + (f" (unknown {unknown})" if unknown else ""))
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise ValueError("x_val and y_val go together: give both or neither")
    shape = tuple(input_shape) if input_shape is not None else None
    parts = {}
    for split in ("train", "val"):
        if f"x_{split}" not in arrays:
            continue
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        try:
            check_fusion_inputs(x, y, dataset=dataset, info=info, input_shape=shape, num_classes=num_classes)
        except ValueError as exc:
            raise ValueError(f"x_{split}/y_{split}: {exc}") from None
        shape = tuple(x.shape[1:])  # val must match train
        parts[split] = ArrayDataset(x.float().contiguous(), y.long().contiguous(), int(num_classes))
    train = parts["train"]
    if "val" in parts:
        return train, parts["val"]
    tr, va = split_train_val(np.arange(len(train)), train.y.numpy(), val_fraction, seed)
    return train.subset(tr), train.subset(va)


def write_node_data(path: str | Path, train: ArrayDataset, val: ArrayDataset | None = None) -> Path:
    """Write one node's data file (``.npz`` or ``.pt``; format in the module docstring); returns the path."""
    p = Path(path).expanduser()
    if p.suffix not in NODE_DATA_SUFFIXES:
        raise ValueError(f"node data file {p}: unknown format {p.suffix!r}; expected one of {list(NODE_DATA_SUFFIXES)}")
    arrays = {"x_train": train.x.float(), "y_train": train.y.long()}
    if val is not None and len(val):
        arrays.update(x_val=val.x.float(), y_val=val.y.long())
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".npz":
        np.savez_compressed(p, **{k: v.numpy() for k, v in arrays.items()})
    else:
        torch.save({k: v.contiguous() for k, v in arrays.items()}, p)
    return p


def write_partition_files(out_dir: str | Path, *, dataset: str, num_partitions: int, partitioning: str = "shards",
                          alpha: float = 0.5, classes_per_client: int = 0, val_fraction: float = 0.1,
                          public_fraction: float = 0.2, data_root: str = "", seed: int = 0,
                          test_fraction: float = 0.2, suffix: str = ".npz") -> list[Path]:
    """Split ``dataset`` as a run would (``FederatedData``: the public fusion pool held out, then partitioned)
    and write ``<out_dir>/node-<i><suffix>`` for each node; returns the paths."""
    data = FederatedData.build(dataset, num_partitions, partitioning, alpha=alpha,
                               classes_per_client=classes_per_client, fusion_source="public",
                               fusion_size=0, public_fraction=public_fraction, root=data_root, seed=seed, test_fraction=test_fraction)
    out = Path(out_dir).expanduser()
    return [write_node_data(out / f"node-{i}{suffix}", *data.client_data(i, val_fraction, seed))
            for i in range(num_partitions)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Split a dataset into one node-local data file per SuperNode "
                                             "(node-config data-path).")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--num-partitions", type=int, required=True)
    ap.add_argument("--partitioning", default="shards")
    ap.add_argument("--dirichlet-alpha", type=float, default=0.5)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--public-fraction", type=float, default=0.2)
    ap.add_argument("--data-root", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    for p in write_partition_files(a.out, dataset=a.dataset, num_partitions=a.num_partitions,
                                   partitioning=a.partitioning, alpha=a.dirichlet_alpha, val_fraction=a.val_fraction,
                                   public_fraction=a.public_fraction, data_root=a.data_root, seed=a.seed):
        print(p)


if __name__ == "__main__":
    main()
