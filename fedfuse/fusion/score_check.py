"""Do a model's importance scores agree with its weights? A cheap server-side check on the fusion set.

A client's importance scores (conductance, DeepLIFT, ...) decide which of its units neuron interpolation keeps and how
OT and Re-Basin weight them. After ``normalise_scores`` a client can no longer take more say than its sample count
gives it, but it can still place its say on units its own model does not use. Any attribution method gives a unit
that cannot move the model's output a score of about zero; so a model whose scores put most of their mass on such
units did not compute them from its weights.

A unit is *inert* when the model's logits do not depend on it anywhere on the fusion set: the gradient of the logits'
squared norm with respect to the unit's output is (numerically) zero on every fusion sample. That covers a dead ReLU
unit (its activation's gradient is zero), a unit whose outgoing weights are zero, and a unit whose path to the logits
is cut further on. One forward and one backward pass per model over the fusion set; any family ``levels`` knows.

``score_inconsistency`` returns the reason a model's scores fail the check, or ``None``: its scores at some level put
more than ``max_share`` of their mass on inert units, and more than twice the inert units' share of the level (uniform
scores never fail).
"""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.models.levels import levels, neurons_last


def inert_units(model: nn.Module, inputs: torch.Tensor, *, rel_tol: float = 1e-6,
                device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """``{level name: bool [width]}``: the units of every fusion level on which the logits do not depend.

    Args:
        model: a model ``levels`` can decompose; used in eval mode on ``device``, its parameters untouched (pass a
            copy if its device or mode matter to the caller).
        inputs: ``[B, *input_shape]`` fusion inputs.
        rel_tol: a unit is inert when its largest absolute gradient over ``inputs`` is at most ``rel_tol`` × the
            largest of its level.
    """
    model = model.to(device).eval()
    lvs = levels(model)
    outs: list[torch.Tensor] = []
    with torch.enable_grad():
        h = inputs.to(device)
        for lv in lvs:
            h = lv.run(h)
            h.retain_grad()
            outs.append(h)
        (0.5 * h.float().pow(2).sum()).backward()
    model.zero_grad(set_to_none=True)
    inert = {}
    for lv, out in zip(lvs, outs):
        g = neurons_last(out.grad.detach().abs(), lv.layout).amax(0)
        inert[lv.name] = g <= rel_tol * float(g.max().clamp_min(torch.finfo(g.dtype).tiny))
    return inert


def score_inconsistency(model: nn.Module, scores: dict[str, torch.Tensor], inputs: torch.Tensor, *,
                        max_share: float = 0.5, device: str | torch.device = "cpu") -> str | None:
    """Why ``scores`` (level name → ``[width]``) cannot be ``model``'s own importance on ``inputs``, or ``None``.

    They fail when, at some level, more than ``max_share`` of their (non-negative) mass and more than twice the inert
    units' share of the level's units sit on units the logits do not depend on (``inert_units``).
    """
    inert = inert_units(model, inputs, device=device)
    for name, s in scores.items():
        mask = inert.get(name)
        if mask is None or not bool(mask.any()):
            continue
        s = torch.as_tensor(s, dtype=torch.float32).reshape(-1).clamp_min(0).to(mask.device)
        total = float(s.sum())
        if total <= 0:
            continue
        share, frac = float(s[mask].sum()) / total, float(mask.float().mean())
        if share > max_share and share > 2 * frac:
            return (f"importance scores at level {name!r} put {share:.0%} of their mass on the {int(mask.sum())} of its "
                    f"{mask.numel()} units that the model's output does not depend on (on the fusion set); scores "
                    "computed from these weights give them about none")
    return None


__all__ = ["inert_units", "score_inconsistency"]
