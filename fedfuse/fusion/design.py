"""The design matrix of an affine layer (Linear / Conv1d / Conv2d) on its input: the rows of the closed-form
least-squares fits of neuron interpolation (``fedfuse.fusion.interpolation`` and its graph variant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.registry import IncompatibleModelsError


def _conv_geometry(layer: nn.Module) -> tuple[tuple, tuple, tuple, tuple]:
    if layer.groups != 1:
        raise IncompatibleModelsError(f"linear neuron interpolation: grouped convolution ({type(layer).__name__}, "
                                      f"groups={layer.groups}) is not supported")
    if isinstance(layer.padding, str) or layer.padding_mode != "zeros":
        raise IncompatibleModelsError("linear neuron interpolation: conv padding must be explicit integers with "
                                      "zero padding")
    if isinstance(layer, nn.Conv1d):
        return ((1, layer.kernel_size[0]), (1, layer.dilation[0]), (0, layer.padding[0]), (1, layer.stride[0]))
    return layer.kernel_size, layer.dilation, layer.padding, layer.stride


def design_matrix(layer: nn.Module, u: torch.Tensor, bias: bool) -> torch.Tensor:
    """Rows of the affine map ``layer`` applied to its input ``u``.

    Args:
        layer: ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d``.
        u: the layer's input ``[N, in]`` (Linear) or ``[N, C, L]`` / ``[N, C, H, W]`` (conv).
        bias: append a column of ones.
    Returns:
        ``[N*P, cols]`` with ``cols = in_features`` or ``C*k`` (+1); rows ordered like ``neurons_last``
        of the layer's output, so ``design @ W.T`` reproduces the output.
    """
    if isinstance(layer, nn.Linear):
        d = u.reshape(-1, layer.in_features)
    elif isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        k, dil, pad, stride = _conv_geometry(layer)
        x = u.unsqueeze(2) if isinstance(layer, nn.Conv1d) else u
        cols = F.unfold(x, kernel_size=k, dilation=dil, padding=pad, stride=stride)  # [N, C*k, P]
        d = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    else:
        raise IncompatibleModelsError(f"linear neuron interpolation: unsupported layer {type(layer).__name__}")
    if bias:
        d = torch.cat([d, torch.ones(d.shape[0], 1, dtype=d.dtype, device=d.device)], 1)
    return d


__all__ = ["design_matrix"]
