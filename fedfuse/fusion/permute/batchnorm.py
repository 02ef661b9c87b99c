"""BatchNorm statistics re-estimation after permutation fusion (REPAIR / Git Re-Basin)."""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.fusion.registry import MissingInputError


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())

@torch.no_grad()
def reset_bn_stats(model: nn.Module, inputs: torch.Tensor, *, batch_size: int = 256,
                   device: str | torch.device = "cpu") -> nn.Module:
    """Re-estimate every BatchNorm's running mean/var on ``inputs`` ``[N, *input_shape]`` (in place).

    Statistics are reset and accumulated as a cumulative average over the batches (momentum ``None``),
    as REPAIR / Git Re-Basin recommend after permutation fusion. Returns the model
    in eval mode.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return model.eval()
    if inputs is None or len(inputs) < 2:
        raise MissingInputError("reset_bn_stats: need at least 2 fusion inputs to re-estimate BatchNorm statistics")
    saved = [(m.momentum, m.track_running_stats) for m in bns]
    # only the norms in training mode: dropout and stochastic depth (EfficientNet, ConvNeXt) stay off, so the
    # statistics are those of the function the model computes at test time
    model.to(device).eval()
    for m in bns:
        m.train()
        m.reset_running_stats()
        m.momentum = None
    try:
        for s in range(0, len(inputs), batch_size):
            xb = inputs[s:s + batch_size]
            if len(xb) < 2:
                continue
            model(xb.to(device))
    finally:
        for m, (mom, _) in zip(bns, saved):
            m.momentum = mom
    return model.eval()
