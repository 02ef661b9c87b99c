"""Helpers shared by test modules (``tests/`` is on ``sys.path`` under pytest's default import mode)."""

import torch
from torch import nn

from fedfuse.models import build_model


def model_with_bn_stats(name, shape, kw, seed=0):
    """``build_model`` in eval mode; BatchNorm layers get non-trivial running statistics."""
    m = build_model(name, input_shape=shape, seed=seed, **kw)
    if any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in m.modules()):
        m.train()
        with torch.no_grad():
            for i in range(3):
                m(torch.randn(32, *shape, generator=torch.Generator().manual_seed(i)) * 2 + 0.5)
    return m.eval()
