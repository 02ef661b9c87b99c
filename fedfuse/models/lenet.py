"""LeNet-5 as NIID-Bench uses it, as a plain ``nn.Sequential`` (so every sequential fusion method takes it).

NIID-Bench ("Federated Learning on Non-IID Data Silos: An Experimental Study", Li et al., arXiv 2102.02079) and
Flower's ``baselines/niid_bench`` train this CNN on Fashion-MNIST / MNIST / CIFAR-10:
``Conv5×5(6) → ReLU → MaxPool2 → Conv5×5(16) → ReLU → MaxPool2 → Flatten → FC 120 → ReLU → FC 84 → ReLU → FC``.
"""

from __future__ import annotations

import math

from torch import nn

# NIID-Bench's widths at width=6: conv 6, conv 16, fc 120, fc 84 (each scaled with ``width / 6``)
_RATIOS = (1.0, 16 / 6, 20.0, 14.0)


def lenet_widths(width: int = 6) -> tuple[int, int, int, int]:
    """The four hidden widths (conv1, conv2, fc1, fc2) of a LeNet whose first convolution has ``width`` channels;
    ``ceil`` rounding, so a narrower LeNet's widths never exceed a wider one's."""
    return tuple(max(1, math.ceil(width * r - 1e-9)) for r in _RATIOS)  # type: ignore[return-value]


def lenet(num_classes: int = 10, input_shape: tuple[int, ...] = (1, 28, 28), width: int = 6, depth: int = 2,
          bias: bool = True) -> nn.Sequential:
    """NIID-Bench's LeNet-5 for ``(C, H, W)`` images; ``width=6`` is the published model (44,426 parameters on
    28×28 Fashion-MNIST). Input ``[N, C, H, W]``, output logits ``[N, num_classes]``.

    ``depth`` is the number of convolution stages and must be 2 (LeNet's fixed layout); ``width`` scales every
    hidden layer (see ``lenet_widths``).
    """
    if len(input_shape) != 3:
        raise ValueError(f"lenet needs image inputs (C, H, W), got input_shape {tuple(input_shape)}")
    if depth != 2:
        raise ValueError(f"lenet has 2 convolution stages (model-depth 2), got depth {depth}")
    c, h, w = (int(s) for s in input_shape)
    side = [(h - 4) // 2, (w - 4) // 2]
    side = [(s - 4) // 2 for s in side]
    if min(side) < 1:
        raise ValueError(f"lenet needs images of at least 16×16 pixels (two 5×5 convolutions and two 2×2 pools), "
                         f"got {h}×{w}")
    c1, c2, f1, f2 = lenet_widths(width)
    return nn.Sequential(
        nn.Conv2d(c, c1, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * side[0] * side[1], f1, bias=bias), nn.ReLU(),
        nn.Linear(f1, f2, bias=bias), nn.ReLU(),
        nn.Linear(f2, num_classes, bias=bias),
    )
