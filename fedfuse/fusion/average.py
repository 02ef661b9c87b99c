"""Vanilla weight averaging (FedAvg's aggregation) and the prediction ensemble reference.

No paper section: these are the baselines every seed paper compares against (spec
``neuron-interpolation.md`` §6.6: vanilla averaging, ensemble).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedfuse.fusion import register


def average_state_dicts(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Weighted average of floating-point entries; integer buffers (BN counters) come from the first."""
    keys = list(states[0])
    for i, s in enumerate(states[1:], 1):
        if list(s) != keys:
            raise ValueError(f"average: model {i} has different parameter names than model 0")
        for k in keys:
            if s[k].shape != states[0][k].shape:
                raise ValueError(f"average: {k} has shape {tuple(s[k].shape)} in model {i} but "
                                 f"{tuple(states[0][k].shape)} in model 0 (different widths need a matching method)")
    out = {}
    for k in keys:
        if states[0][k].is_floating_point():
            out[k] = sum(w * s[k].double() for w, s in zip(weights, states)).to(states[0][k].dtype)
        else:
            out[k] = states[0][k].clone()
    return out


@register("average", needs_data=False)
def fuse_average(models, *, weights, **_) -> nn.Module:
    """Weighted parameter average of same-shape models (the vanilla / FedAvg baseline)."""
    fused = copy.deepcopy(models[0]).cpu()
    fused.load_state_dict(average_state_dicts([m.state_dict() for m in models], weights))
    return fused


class Ensemble(nn.Module):
    """Averages the members' softmax outputs; returns ``log`` of that average as logits.

    ``softmax(Ensemble(x)) == Σ_k w_k softmax(M_k(x))``. Input ``[N, ...]`` → ``[N, num_classes]``.
    """

    def __init__(self, models: list[nn.Module], weights: list[float] | None = None):
        super().__init__()
        self.members = nn.ModuleList(models)
        w = torch.tensor(weights if weights is not None else [1.0 / len(models)] * len(models))
        self.register_buffer("weights", w / w.sum())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = sum(w * m(x).softmax(-1) for w, m in zip(self.weights, self.members))
        return torch.log(probs.clamp_min(1e-12))


@register("ensemble", needs_data=False, same_architecture=False)
def fuse_ensemble(models, *, weights, uniform: bool = True, **_) -> nn.Module:
    """Prediction ensemble (a reference, not a fusion: inference costs ``len(models)`` forwards).

    Uniform member weights by default, as in the papers; ``uniform=False`` uses ``weights``.
    """
    members = [copy.deepcopy(m).cpu().eval() for m in models]
    return Ensemble(members, None if uniform else weights)
