"""Vanilla weight averaging (FedAvg's aggregation) and the prediction ensemble reference.

FedAvg: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data" (arXiv
1602.05629). No paper section: these are the baselines every fusion paper here compares against (vanilla
averaging, ensemble).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from fedfuse.fusion.permute.maps import load_plain
from fedfuse.fusion.registry import IncompatibleModelsError, NoOptions, register


def average_state_dicts(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Weighted average of floating-point entries; integer buffers (BN counters) come from the first."""
    keys = list(states[0])
    for i, s in enumerate(states[1:], 1):
        if list(s) != keys:
            raise IncompatibleModelsError(f"average: model {i} has different parameter names than model 0")
        for k in keys:
            if s[k].shape != states[0][k].shape:
                raise IncompatibleModelsError(f"average: {k} has shape {tuple(s[k].shape)} in model {i} but "
                                 f"{tuple(states[0][k].shape)} in model 0 (different widths need a matching method)")
    out = {}
    for k in keys:
        if states[0][k].is_floating_point():   # float64 accumulator, in place (no temporary per model); a copy
            acc = states[0][k].to(torch.float64, copy=True).mul_(weights[0])   # even of a float64 model's tensor
            for w, s in zip(weights[1:], states[1:]):
                acc.add_(s[k], alpha=w)
            out[k] = acc.to(states[0][k].dtype)
        else:
            out[k] = states[0][k].clone()
    return out


@register("average", options=NoOptions, needs_data=False, any_module=True)
def fuse_average(models, *, fusion_inputs, scores, weights, device, seed, options: NoOptions, info: dict) -> nn.Module:
    """Weighted parameter average of same-shape models (the vanilla / FedAvg baseline). Fixed point:
    averaging copies of one model returns that model."""
    fused = copy.deepcopy(models[0]).cpu()
    load_plain(fused, average_state_dicts([m.state_dict() for m in models], weights))
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


@dataclass(frozen=True)
class EnsembleOptions:
    """Options of ``ensemble``.

    Attributes:
        uniform: equal member weights, as in the papers; ``False`` uses the per-model ``weights``.
    """

    uniform: bool = True


@register("ensemble", options=EnsembleOptions, needs_data=False, same_architecture=False, mixed_widths=True,
          any_module=True)
def fuse_ensemble(models, *, fusion_inputs, scores, weights, device, seed, options: EnsembleOptions,
                  info: dict) -> nn.Module:
    """Prediction ensemble (a reference, not a fusion: inference costs ``len(models)`` forwards).

    Fixed point in probabilities: ``softmax`` of the ensemble of copies of one model is that model's.
    """
    members = [copy.deepcopy(m).cpu().eval() for m in models]
    return Ensemble(members, None if options.uniform else weights)
