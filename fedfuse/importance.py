"""Neuron importance scores per fusion level (captum), as used by Neuron Interpolation.

Paper: "Model Fusion via Neuron Interpolation" (arXiv 2507.00037), its importance scores. A score is the absolute attribution of a level's output neuron, summed over positions/tokens and
averaged over samples, plus 1e-8 so that none is exactly zero:

    s_j = (1/N) Σ_n Σ_p |A[n, j, p]| + 1e-8

Attributions target each sample's true label, with an all-zero input baseline (captum's default);
Conductance uses ``n_steps=10``. Clients compute these on their own validation data and send them with
their weights; the server can also compute them on its fusion set.
"""

from __future__ import annotations

import warnings

from fedfuse.choices import IMPORTANCE
import torch
from torch import nn

from fedfuse.models.adapters.graph import set_example_input
from fedfuse.models.levels import Level, levels as model_levels, neuron_axis_sum
from fedfuse.tofu import suspended

IMPORTANCE_METHODS = IMPORTANCE  # one list: fedfuse.choices
EPS = 1e-8


def uniform_importance(model: nn.Module) -> dict[str, torch.Tensor]:
    """All-ones scores (equivalent to the paper's 1/n up to scale), one vector per level."""
    return {lv.name: torch.ones(lv.width) for lv in model_levels(model)}


def neuron_importance(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor | None = None,
                      method: str = "deeplift", batch_size: int = 64, n_steps: int = 10,
                      device: str | torch.device = "cpu", levels: list[Level] | None = None) -> dict[str, torch.Tensor]:
    """One non-negative score per neuron per level.

    Args:
        model: a model ``levels`` can decompose; it is not modified (eval mode is restored after).
        inputs: ``[N, *input_shape]`` scoring data (the client's validation split).
        targets: ``[N]`` int labels to attribute (required except for ``"uniform"``).
        method: ``"uniform"`` | ``"conductance"`` | ``"deeplift"``.
        batch_size: samples per captum call (bounds memory; Conductance uses ``n_steps`` × that).
    Returns:
        ``{level name: [width] float32 tensor on CPU}``, every entry >= 1e-8.
    """
    if method not in IMPORTANCE_METHODS:
        raise ValueError(f"importance: unknown method {method!r}; choose one of {list(IMPORTANCE_METHODS)}")
    if len(inputs):
        set_example_input(model, inputs)   # the generic reader traces a user's model on these inputs' shape
    if method == "uniform":
        return uniform_importance(model)
    if targets is None:
        raise ValueError("importance: method %r needs targets (labels) for the attribution" % method)
    if len(inputs) == 0:
        raise ValueError("importance: no scoring samples")
    if method == "deeplift":
        shared = reused_nonlinearities(model, inputs[:2].to(device))
        if shared:
            # captum's DeepLIFT keeps one input/output per nonlinearity module and refuses a module applied twice
            # (Flower's quickstart Net applies one MaxPool2d after both convolutions); Conductance has no such
            # limit, so it scores these models, and says so
            warnings.warn(f"importance: DeepLIFT cannot score {type(model).__name__}: module(s) {shared} are applied "
                          "more than once in one forward pass; scoring with 'conductance' instead (set importance="
                          "'conductance' to silence this, or give each use its own module)", RuntimeWarning,
                          stacklevel=2)
            method = "conductance"
    # Token Fusion (if a client applied it) must be off: every model's level outputs need the same tokens
    with suspended(model):
        return _attribute(model, inputs, targets, method, batch_size, n_steps, device, levels)


@torch.no_grad()
def reused_nonlinearities(model: nn.Module, x: torch.Tensor) -> list[str]:
    """Paths of the parameter-free leaf modules (activations, pooling) that one forward pass of ``model`` on ``x``
    calls more than once: captum's DeepLIFT cannot attribute through them."""
    calls: dict[str, int] = {}
    hooks = [m.register_forward_hook(lambda _m, _i, _o, p=p: calls.__setitem__(p, calls.get(p, 0) + 1))
             for p, m in model.named_modules()
             if p and not any(True for _ in m.children()) and not any(True for _ in m.parameters(recurse=False))]
    was = model.training
    model.eval()
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
        model.train(was)
    return sorted(p for p, n in calls.items() if n > 1)


def _attribute(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, method: str, batch_size: int,
               n_steps: int, device, levels: list[Level] | None) -> dict[str, torch.Tensor]:
    from captum.attr import LayerConductance, LayerDeepLift  # heavy import, only when scoring

    was_training = model.training
    model.eval()
    model.to(device)
    lvs = levels if levels is not None else model_levels(model)
    sums = {lv.name: torch.zeros(lv.width, dtype=torch.float64) for lv in lvs}
    n = 0
    try:
        for start in range(0, len(inputs), batch_size):
            xb = inputs[start:start + batch_size].to(device)
            yb = targets[start:start + batch_size].to(device).long()
            for lv in lvs:
                if method == "conductance":
                    algo = LayerConductance(model, lv.module)
                    attr = algo.attribute(xb, target=yb, n_steps=n_steps, attribute_to_layer_input=lv.module_input)
                else:
                    algo = LayerDeepLift(model, lv.module)
                    attr = algo.attribute(xb, target=yb, attribute_to_layer_input=lv.module_input)
                if isinstance(attr, tuple):
                    attr = attr[0]
                sums[lv.name] += neuron_axis_sum(attr.detach().abs(), lv.layout).sum(0).double().cpu()
            n += len(xb)
    finally:
        model.train(was_training)
    return {name: (s / n).float() + EPS for name, s in sums.items()}
