"""Client splits made with the anchors' own recipe, for federations the anchors do not ship (e.g. 20 clients).

``../shared/anchors/README.md`` documents how stock Flower FedAvg's splits were made; this writes the same format
(``node-<i>.npz`` with ``x_train``/``y_train``, ``test.npz`` with ``x``/``y``) for any number of clients:

- MNIST-1D: ``mnist1d`` with ``num_samples=12000``, ``seed=11``, other arguments at their defaults; the package's
  80/20 split (9,600 train, 2,400 test);
- per class (label order) the class's indices shuffled, proportions p ~ Dir(α·1_K) over the K clients, cut at
  ``floor(cumsum(p)·n_c)``, ``numpy.random.default_rng(seed)``; the whole draw repeated until every client has at
  least 20 samples; each client's samples stored in dataset order (indices sorted).

With 10 clients it reproduces the anchors' files byte for byte (``--check``), so 20-client splits made here are
the anchors' recipe and nothing else.

    .venv/bin/python -m simulations.bench.anchor_splits --clients 20 --out results/cache/anchor-splits
    .venv/bin/python -m simulations.bench.anchor_splits --check
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fedfuse.data.sources import _mnist1d_arrays

ROOT = Path(__file__).resolve().parents[2]
ANCHORS = ROOT.parent / "shared" / "anchors" / "splits"
MIN_SAMPLES = 20


def dirichlet_parts(y: np.ndarray, num_clients: int, alpha: float, seed: int, *,
                    sort: bool = True) -> list[np.ndarray]:
    """The anchors' Dirichlet label split: per client its train indices, sorted (the anchors' files), or in the
    order the draw assigns them (``sort=False``, as the progressive bench's cells were made)."""
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    while True:
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = np.flatnonzero(y == c)
            rng.shuffle(idx)
            p = rng.dirichlet(alpha * np.ones(num_clients))
            cuts = np.floor(np.cumsum(p) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= MIN_SAMPLES:
            out = [np.asarray(p, dtype=np.int64) for p in parts]
            return [np.sort(p) for p in out] if sort else out


def write_split(out: Path, num_clients: int, alpha: float, seed: int) -> Path:
    """Write ``<out>/mnist1d-c<K>-a<α>-s<seed>/`` (node files and ``test.npz``); returns the folder."""
    d = _mnist1d_arrays({"num_samples": 12000, "seed": 11})
    folder = out / f"mnist1d-c{num_clients}-a{alpha:g}-s{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    for k, idx in enumerate(dirichlet_parts(d["y"], num_clients, alpha, seed)):
        np.savez(folder / f"node-{k}.npz", x_train=d["x"][idx], y_train=d["y"][idx])
    np.savez(folder / "test.npz", x=d["x_test"], y=d["y_test"])
    return folder


def check(tmp: Path) -> None:
    """Rebuild the anchors' 10-client MNIST-1D splits and compare them with the shipped files, array by array."""
    for alpha in (0.1, 0.5):
        for seed in (0, 1, 2):
            mine = write_split(tmp, 10, alpha, seed)
            theirs = ANCHORS / f"mnist1d-a{alpha:g}-s{seed}"
            for name in [f"node-{k}.npz" for k in range(10)] + ["test.npz"]:
                a, b = np.load(mine / name), np.load(theirs / name)
                for key in b.files:
                    if a[key].dtype != b[key].dtype or not np.array_equal(a[key], b[key]):
                        raise SystemExit(f"{theirs.name}/{name}[{key}] differs from the recipe's")
            print(f"{theirs.name}: identical")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--alphas", default="0.1,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default=str(ROOT / "results" / "cache" / "anchor-splits"))
    ap.add_argument("--check", action="store_true", help="rebuild the anchors' 10-client splits and compare")
    args = ap.parse_args(argv)
    if args.check:
        check(Path(args.out) / "check")
        return
    for alpha in (float(a) for a in args.alphas.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            folder = write_split(Path(args.out), args.clients, alpha, seed)
            sizes = [len(np.load(folder / f"node-{k}.npz")["y_train"]) for k in range(args.clients)]
            print(f"{folder}: client sizes {min(sizes)}..{max(sizes)}")


if __name__ == "__main__":
    main()
