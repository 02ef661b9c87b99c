"""HeteroFL's width scaler: during training a tier of width multiplier ``r`` divides every hidden
layer's output by ``r``, so the next layer, which sums over ``r·C`` instead of ``C`` inputs, sees
activations of the global model's scale (Diao et al., "HeteroFL", arXiv 2010.01264, §3 "Scaler").
Evaluation runs without it (identity outside ``model.training``).

Implemented as forward hooks on every Linear/Conv except the classifier, so the model's structure and
state dict are unchanged (the server sees the usual arrays).
"""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from fedfuse.models import adapter_for
from fedfuse.models.adapters import AFFINE_LAYERS, check_width_mult


def attach_width_scaler(model: nn.Module, width_mult: float) -> list[RemovableHandle]:
    """Divide the training-mode outputs of ``model``'s hidden Linear/Conv layers by ``width_mult``.

    Returns the hook handles (``handle.remove()`` detaches them). ``width_mult == 1`` attaches nothing.
    """
    r = check_width_mult(width_mult, "width scaler: width_mult")
    if r == 1:
        return []
    head = adapter_for(model).classifier(model)

    def scale(module: nn.Module, inputs, output):
        return output / r if module.training else output

    return [m.register_forward_hook(scale) for m in model.modules()
            if isinstance(m, AFFINE_LAYERS) and m is not head]


__all__ = ["attach_width_scaler"]
