"""The example's model and data: a small MLP on scikit-learn's 8x8 digits (bundled, no download).

Each client gets a label-skewed shard (the samples sorted by label, cut into ``num_partitions`` pieces);
the server holds a public, unlabeled fusion set and a labeled test set that no client sees.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def Net() -> nn.Module:  # noqa: N802 - a model factory, named like a class as in Flower's examples
    """64 -> 32 -> 10 MLP. An ``nn.Sequential`` of Linear/ReLU layers, so fedfuse can fuse it neuron by neuron."""
    torch.manual_seed(0)  # every process builds the same initial global model
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)  # [1797, 64] in [0, 1]
    y = d.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    return x[order], y[order]


def server_data(fusion_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fusion inputs [F, 64], test inputs [T, 64], test labels [T])``: the first 400 samples."""
    x, y = _digits()
    return torch.from_numpy(x[:fusion_size]), torch.from_numpy(x[200:400]), torch.from_numpy(y[200:400])


def client_data(partition_id: int, num_partitions: int):
    """``(x_train, y_train, x_val, y_val)`` of one client: a label-sorted shard of the remaining samples."""
    x, y = _digits()
    x, y = x[400:], y[400:]
    order = np.argsort(y, kind="stable")
    shard = np.array_split(order, num_partitions)[partition_id]
    shard = np.random.default_rng(partition_id).permutation(shard)
    n_val = max(1, len(shard) // 10)
    tr, va = shard[n_val:], shard[:n_val]
    t = torch.from_numpy
    return t(x[tr]), t(y[tr]), t(x[va]), t(y[va])


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float) -> float:
    """Plain local SGD (batch 32); returns the last epoch's mean loss."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        total = 0.0
        for idx in torch.randperm(len(x), generator=g).split(32):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
    model.eval()
    return total / len(x)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
