"""Small timm ``VisionTransformer`` configurations that train on a CPU.

Images ``(C, H, W)`` use square patches; 1-D signals ``(C, L)`` (e.g. MNIST-1D) are viewed as
``1 × L`` images with ``1 × p`` patches by ``VisionTransformer1d``, still a timm ``VisionTransformer``.
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer


class VisionTransformer1d(VisionTransformer):
    """timm ViT over 1-D signals: input ``[N, C, L]`` is reshaped to ``[N, C, 1, L]``."""

    def forward_features(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if x.dim() == 3:
            x = x.unsqueeze(2)
        return super().forward_features(x, *args, **kwargs)


def vit_embed(model: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """Images ``[N, C, H, W]`` (or ``[N, C, L]``) → tokens ``[N, T, D]`` before the first block."""
    if x.dim() == 3:
        x = x.unsqueeze(2)
    x = model.patch_embed(x)
    x = model._pos_embed(x)
    x = model.patch_drop(x)
    return model.norm_pre(x)


def vit_head(model: VisionTransformer, h: torch.Tensor) -> torch.Tensor:
    """Tokens ``[N, T, D]`` after the last block → logits ``[N, num_classes]``."""
    return model.forward_head(model.norm(h))


def _default_patch(size: int) -> int:
    for p in (4, 2, 1):
        if size % p == 0 and size // p >= 2:
            return p
    return 1


def vit(num_classes: int = 10, input_shape: tuple[int, ...] = (1, 8, 8), width: int = 32, depth: int = 2,
        num_heads: int = 4, mlp_ratio: float = 2.0, patch_size: int | None = None, reg_tokens: int = 0,
        qkv_bias: bool = True) -> VisionTransformer:
    """A timm ``VisionTransformer`` with ``embed_dim=width`` and ``depth`` blocks, CLS-token pooling.

    Input ``[N, *input_shape]``; output ``[N, num_classes]``.
    """
    if width % num_heads:
        raise ValueError(f"vit: model-width {width} must be divisible by num_heads {num_heads}")
    common = dict(num_classes=num_classes, embed_dim=width, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
                  qkv_bias=qkv_bias, reg_tokens=reg_tokens, global_pool="token", class_token=True)
    if len(input_shape) == 2:
        c, length = input_shape
        p = patch_size or _default_patch(length)
        return VisionTransformer1d(img_size=(1, length), patch_size=(1, p), in_chans=c, **common)
    if len(input_shape) == 3:
        c, h, w = input_shape
        p = patch_size or _default_patch(min(h, w))
        return VisionTransformer(img_size=(h, w), patch_size=p, in_chans=c, **common)
    raise ValueError(f"vit needs input_shape (C, L) or (C, H, W), got {input_shape}")
