"""The example's model and data: Flower's quickstart-pytorch ``Net``, unchanged, on scikit-learn's digits made
CIFAR-shaped (bundled, no download).

``Net`` is the CNN of Flower's ``examples/quickstart-pytorch`` (``pytorchexample/task.py``), as a user's app has it:
it takes 3-channel 32x32 images. The data is adapted to it, not the model to the data: each 8x8 grey digit is
upsampled (bilinear) to 32x32, repeated over 3 channels and normalised to [-1, 1] as the quickstart's
``Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))`` does with CIFAR-10.

Each client gets a label-skewed shard (the samples sorted by label, cut into ``num_partitions`` pieces);
the server holds a public, unlabeled fusion set and a labeled test set that no client sees.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def initial_model() -> Net:
    """The run's initial global ``Net``, the same in every process (seeded)."""
    torch.manual_seed(0)
    return Net()


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy((d.data / 16.0).astype(np.float32)).view(-1, 1, 8, 8)   # [1797, 1, 8, 8] in [0, 1]
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).clamp(0, 1).repeat(1, 3, 1, 1)
    x = ((x - 0.5) / 0.5).numpy()                                                # [1797, 3, 32, 32] in [-1, 1]
    y = d.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))
    return x[order], y[order]


def server_data(fusion_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fusion inputs [F, 3, 32, 32], test inputs [T, 3, 32, 32], test labels [T])``: the first 400 samples."""
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
