"""Fashion-MNIST client splits with NIID-Bench's partition algorithms, written as node files both fedfuse and a
stock Flower app read, so every row of the Fashion-MNIST tables trains on byte-identical client data.

NIID-Bench ("Federated Learning on Non-IID Data Silos: An Experimental Study", Li et al., arXiv 2102.02079; Flower's
``baselines/niid_bench``, ``dataset_preparation.py``) partitions the 60,000 training images:

- ``dir<β>``: per class, proportions p ~ Dir(β·1_n); a client already holding N/n samples gets no more
  (its p is zeroed, the rest renormalised); cut at ``int(cumsum(p)·n_c)``; the whole draw repeated until every
  client holds at least 10 samples.
- ``c<k>`` (#C=k, quantity-based label imbalance): client i holds class ``i mod 10`` and k-1 other distinct
  classes drawn at random; each class's images are shuffled and split equally among the clients holding it.
- ``iid``: a random permutation cut into n equal parts.

Flower's ``baselines/fedavgm`` (Hsu et al., "Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification", arXiv 1909.06335) partitions with ``create_lda_partitions`` instead:

- ``lda<α>``: every client draws its class mix q ~ Dir(c·1_10) and then its (equal) share of samples one at a time:
  a class from q, renormalised over the classes not yet used up, and an image of that class not yet taken. The
  baseline passes ``c = α · num_classes`` (its ``datasets.partition``), so its "α = 0.1" is a Dir(1.0) per class;
  Hsu et al. define q ~ Dir(α·p) with p the uniform prior, Dir(α/10) per class, a 100x more skewed draw. ``lda<α>``
  follows the Flower baseline (c = 10·α) so its numbers are comparable; ``lda<α>`` with α/100 gives Hsu's.

Here ``numpy.random.default_rng(seed)`` draws the split (NIID-Bench's baseline fixes seed 42 for every trial; these
tables vary it with the run seed). Before partitioning, a **public pool** of ``--public`` images (default 1,000) is
held out from the training images with a fixed draw (the same pool for every split): the server's fusion set,
disjoint from every client. The clients therefore share 59,000 images, not 60,000. The test set is the full 10,000.

Files: ``<out>/fmnist-<part>-n<clients>-s<seed>/node-<i>.npz`` (``x_train`` float32 [N, 1, 28, 28] in [0, 1],
``y_train`` int64), ``test.npz`` (``x``, ``y``) and ``<out>/fmnist-public<size>.npz`` (``x``, and ``y`` for
diagnostics only: fedfuse reads ``x``).

    .venv/bin/python -m simulations.bench.fmnist_splits --parts dir0.5,c2 --clients 10 --seeds 0,1,2 --out results/cache/fmnist-splits
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

MIN_SAMPLES = 10     # NIID-Bench's min_require_size
PUBLIC_SEED = 20261128


def dirichlet_niid(y: np.ndarray, num_clients: int, beta: float, rng: np.random.Generator) -> list[np.ndarray]:
    """NIID-Bench's Dirichlet split (``partition_data`` with ``noniid-labeldir``): per client its indices."""
    n, classes = len(y), np.unique(y)
    while True:
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = np.flatnonzero(y == c)
            rng.shuffle(idx)
            p = rng.dirichlet(np.repeat(beta, num_clients))
            p = np.array([pj * (len(b) < n / num_clients) for pj, b in zip(p, parts)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for b, chunk in zip(parts, np.split(idx, cuts)):
                b.extend(chunk.tolist())
        if min(len(b) for b in parts) >= MIN_SAMPLES:
            return [np.asarray(b, dtype=np.int64) for b in parts]


def label_quantity(y: np.ndarray, num_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """NIID-Bench's #C=k split (``noniid-#label<k>``): per client its indices."""
    classes = np.unique(y)
    held = []
    for i in range(num_clients):
        have = [int(classes[i % len(classes)])]
        while len(have) < k:
            c = int(rng.choice(classes))
            if c not in have:
                have.append(c)
        held.append(have)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in classes:
        holders = [i for i, have in enumerate(held) if int(c) in have]
        if not holders:
            continue
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        for i, chunk in zip(holders, np.array_split(idx, len(holders))):
            parts[i].extend(chunk.tolist())
    return [np.asarray(b, dtype=np.int64) for b in parts]


def lda_equal(y: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator,
              eps: float = 1e-5) -> list[np.ndarray]:
    """Flower's fedavgm baseline split (``create_lda_partitions`` with ``concentration = alpha * classes``): equal
    client sizes, every client's samples drawn without replacement from its Dirichlet class mix; per client its
    indices."""
    classes = np.unique(y)
    mixes = rng.dirichlet(np.repeat(alpha * len(classes), len(classes)), size=num_clients)
    pools = [list(rng.permutation(np.flatnonzero(y == c))) for c in classes]
    sizes = [len(y) // num_clients + (i < len(y) % num_clients) for i in range(num_clients)]
    parts = []
    for q0, size in zip(mixes, sizes):
        chosen = []
        for _ in range(size):
            alive = np.array([len(p) > 0 for p in pools])
            q = np.where(alive, q0 + eps, 0.0)   # the baseline's eps keeps a class with q = 0 drawable
            c = rng.choice(len(classes), p=q / q.sum())
            chosen.append(pools[c].pop())
        parts.append(np.asarray(chosen, dtype=np.int64))
    return parts


def iid(y: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.asarray(b, dtype=np.int64) for b in np.array_split(rng.permutation(len(y)), num_clients)]


def partition(y: np.ndarray, part: str, num_clients: int, seed: int) -> list[np.ndarray]:
    """``part``: ``iid``, ``dir<β>``, ``c<k>`` or ``lda<α>``."""
    rng = np.random.default_rng(seed)
    if part == "iid":
        return iid(y, num_clients, rng)
    if part.startswith("lda"):
        return lda_equal(y, num_clients, float(part[3:]), rng)
    if part.startswith("dir"):
        return dirichlet_niid(y, num_clients, float(part[3:]), rng)
    if part.startswith("c") and part[1:].isdigit():
        return label_quantity(y, num_clients, int(part[1:]), rng)
    raise ValueError(f"partition {part!r}: expected iid, dir<beta>, c<k> or lda<alpha>")


def _data():
    from fedfuse.data.sources import load_source

    train, test = load_source("fashion-mnist", download=False)
    return train.x.numpy(), train.y.numpy(), test.x.numpy(), test.y.numpy()


def public_split(y: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(public pool indices, client pool indices): a fixed draw of ``size`` training images held out."""
    perm = np.random.default_rng(PUBLIC_SEED).permutation(len(y))
    return np.sort(perm[:size]), np.sort(perm[size:])


def write_splits(out: Path, parts: list[str], clients: int, seeds: list[int], public: int = 1000) -> list[Path]:
    """Write every (part, seed) folder not yet written and the public pool; returns the folders."""
    out.mkdir(parents=True, exist_ok=True)
    x, y, xt, yt = _data()
    pub, pool = public_split(y, public)
    pub_path = out / f"fmnist-public{public}.npz"
    if not pub_path.exists():
        np.savez(pub_path, x=x[pub], y=y[pub])
    folders = []
    for part in parts:
        for seed in seeds:
            folder = out / f"fmnist-{part}-n{clients}-s{seed}"
            folders.append(folder)
            if (folder / "split.json").exists():
                continue
            folder.mkdir(parents=True, exist_ok=True)
            chunks = partition(y[pool], part, clients, seed)
            counts = []
            for i, local in enumerate(chunks):
                idx = pool[np.sort(local)]
                np.savez(folder / f"node-{i}.npz", x_train=x[idx], y_train=y[idx].astype(np.int64))
                counts.append(np.bincount(y[idx], minlength=10).tolist())
            np.savez(folder / "test.npz", x=xt, y=yt.astype(np.int64))
            (folder / "split.json").write_text(json.dumps({"part": part, "clients": clients, "seed": seed,
                                                           "public": public, "class-counts": counts}))
    return folders


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="dir0.5,c2")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--public", type=int, default=1000)
    ap.add_argument("--out", default="results/cache/fmnist-splits")
    a = ap.parse_args(argv)
    for f in write_splits(Path(a.out), a.parts.split(","), a.clients, [int(s) for s in a.seeds.split(",")], a.public):
        counts = json.loads((f / "split.json").read_text())["class-counts"]
        print(f, "samples per client:", [sum(c) for c in counts])


if __name__ == "__main__":
    main()
