"""Static batch normalisation (HeteroFL's sBN, arXiv 2010.01264 §3): BatchNorm running statistics are not
averaged across clients (a tier's statistics describe its own sub-network); they are re-estimated after
aggregation. fedfuse's server has an unlabeled fusion set, so the re-estimation runs there (no labels,
no client data): one pass in training mode with cumulative averaging (``momentum=None``)."""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.models.adapters import BATCHNORMS


@torch.no_grad()
def reestimate_batchnorm(model: nn.Module, inputs: torch.Tensor, batch_size: int = 256,
                         device: torch.device | str = "cpu") -> bool:
    """Recompute every BatchNorm's running mean/variance of ``model`` on ``inputs [B, *input_shape]``.

    Returns ``False`` (and changes nothing) when the model has no BatchNorm. Parameters are not touched;
    the model ends in eval mode on its original device.
    """
    bns = [m for m in model.modules() if isinstance(m, BATCHNORMS) and m.track_running_stats]
    if not bns:
        return False
    if inputs is None or len(inputs) == 0:
        raise ValueError("static BN: re-estimating BatchNorm statistics needs a non-empty fusion set")
    home = next(model.parameters()).device
    model.to(device)
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches
    model.train()
    x = torch.as_tensor(inputs).float()
    for i in range(0, len(x), batch_size):
        xb = x[i:i + batch_size]
        if len(xb) > 1 or i == 0:  # BN cannot take a batch of one in training mode (unless it is all there is)
            model(xb.to(device))
    for m, mom in zip(bns, saved):
        m.momentum = mom
    model.to(home).eval()
    return True


__all__ = ["reestimate_batchnorm"]
