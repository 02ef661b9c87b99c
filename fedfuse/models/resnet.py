"""Small ResNet (basic blocks) with BatchNorm or GroupNorm, for 1-D or 2-D inputs."""

from __future__ import annotations

import torch
from torch import nn


def _norm(kind: str, channels: int, one_d: bool) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm1d(channels) if one_d else nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(8, channels), channels)
    raise ValueError(f"norm must be 'batch' or 'group', got {kind!r}")


class BasicBlock(nn.Module):
    """``relu(norm(conv(relu(norm(conv(x))))) + shortcut(x))``; shortcut is a 1×1 conv + norm when shapes change."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, norm: str, one_d: bool):
        super().__init__()
        conv = nn.Conv1d if one_d else nn.Conv2d
        self.conv1 = conv(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(norm, out_ch, one_d)
        self.conv2 = conv(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.norm2 = _norm(norm, out_ch, one_d)
        # two ReLU modules, not one reused: captum's DeepLIFT hooks each nonlinearity once per forward
        self.relu1 = nn.ReLU()
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(conv(in_ch, out_ch, 1, stride=stride, bias=False), _norm(norm, out_ch, one_d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet(nn.Module):
    """``stem → stages of BasicBlocks → GlobalAvgPool → Linear``.

    Stage ``i`` has ``width * 2**i`` channels and ``blocks_per_stage`` blocks (stride 2 from stage 1 on).
    Input ``[N, C, L]`` or ``[N, C, H, W]``; output ``[N, num_classes]``.
    """

    def __init__(self, num_classes: int, input_shape: tuple[int, ...], width: int = 16, depth: int = 2,
                 blocks_per_stage: int = 1, norm: str = "batch"):
        super().__init__()
        if len(input_shape) not in (2, 3):
            raise ValueError(f"resnet needs input_shape (C, L) or (C, H, W), got {input_shape}")
        one_d = len(input_shape) == 2
        conv = nn.Conv1d if one_d else nn.Conv2d
        self.stem = nn.Sequential(conv(input_shape[0], width, 3, padding=1, bias=False),
                                  _norm(norm, width, one_d), nn.ReLU())
        blocks: list[nn.Module] = []
        in_ch = width
        for stage in range(depth):
            out_ch = width * 2 ** stage
            for b in range(blocks_per_stage):
                stride = 2 if (stage > 0 and b == 0) else 1
                blocks.append(BasicBlock(in_ch, out_ch, stride, norm, one_d))
                in_ch = out_ch
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool1d(1) if one_d else nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward_head(self, h: torch.Tensor) -> torch.Tensor:
        """``[N, C, *spatial]`` block output → logits ``[N, num_classes]``."""
        return self.fc(torch.flatten(self.pool(h), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.blocks(self.stem(x)))


def resnet(num_classes: int = 10, input_shape: tuple[int, ...] = (1, 8, 8), width: int = 16, depth: int = 2,
           blocks_per_stage: int = 1, norm: str = "batch") -> ResNet:
    return ResNet(num_classes, input_shape, width=width, depth=depth, blocks_per_stage=blocks_per_stage, norm=norm)
