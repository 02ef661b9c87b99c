"""Multi-layer perceptron as a plain ``nn.Sequential`` (so ``levels`` treats it like any outside MLP)."""

from __future__ import annotations

import math

from torch import nn


def mlp(num_classes: int = 10, input_shape: tuple[int, ...] = (64,), width: int = 64, depth: int = 2,
        bias: bool = True, batchnorm: bool = False) -> nn.Sequential:
    """``Flatten → [Linear(width) → (BN) → ReLU] × depth → Linear(num_classes)``.

    Input ``[N, *input_shape]``, output logits ``[N, num_classes]``.
    """
    if depth < 1:
        raise ValueError(f"model-depth must be >= 1 for mlp, got {depth}")
    layers: list[nn.Module] = [nn.Flatten()]
    in_features = math.prod(input_shape)
    for _ in range(depth):
        layers.append(nn.Linear(in_features, width, bias=bias))
        if batchnorm:
            layers.append(nn.BatchNorm1d(width))
        layers.append(nn.ReLU())
        in_features = width
    layers.append(nn.Linear(in_features, num_classes, bias=bias))
    return nn.Sequential(*layers)
