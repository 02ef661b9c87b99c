"""VGG-style CNN as a plain ``nn.Sequential`` (1-D inputs use Conv1d, images Conv2d)."""

from __future__ import annotations

from torch import nn


def cnn(num_classes: int = 10, input_shape: tuple[int, ...] = (1, 8, 8), width: int = 16, depth: int = 2,
        batchnorm: bool = False, bias: bool = True) -> nn.Sequential:
    """``[Conv3 → (BN) → ReLU → MaxPool2] × depth → GlobalAvgPool → Flatten → Linear``.

    Channels double every stage starting at ``width``. ``input_shape`` is ``(C, L)`` or ``(C, H, W)``;
    input ``[N, *input_shape]``, output ``[N, num_classes]``.
    """
    if len(input_shape) not in (2, 3):
        raise ValueError(f"cnn needs input_shape (C, L) or (C, H, W), got {input_shape}")
    one_d = len(input_shape) == 2
    conv, bn, pool, gap = ((nn.Conv1d, nn.BatchNorm1d, nn.MaxPool1d, nn.AdaptiveAvgPool1d) if one_d
                           else (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AdaptiveAvgPool2d))
    spatial = min(input_shape[1:])
    layers: list[nn.Module] = []
    in_ch = input_shape[0]
    for i in range(depth):
        out_ch = width * 2 ** i
        layers.append(conv(in_ch, out_ch, kernel_size=3, padding=1, bias=bias))
        if batchnorm:
            layers.append(bn(out_ch))
        layers.append(nn.ReLU())
        if spatial >= 4:  # pool only while there is something left to pool
            layers.append(pool(2))
            spatial //= 2
        in_ch = out_ch
    layers += [gap(1), nn.Flatten(), nn.Linear(in_ch, num_classes, bias=bias)]
    return nn.Sequential(*layers)
