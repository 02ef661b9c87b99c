"""Averaging of aligned state dicts (uniform or importance-weighted per unit)."""

from __future__ import annotations

import torch

from fedfuse.fusion.permute.spec import PermSpec


def average_aligned(states: list[dict[str, torch.Tensor]], weights: list[float],
                    unit_weights: list[dict[str, torch.Tensor]] | None = None,
                    spec: PermSpec | None = None) -> dict[str, torch.Tensor]:
    """Weighted average of aligned states (all in the reference's units).

    ``unit_weights`` (optional, one ``{group: [size]}`` dict per model, already in the reference's
    units) turn the average per unit: along an entry's first ``out`` axis unit ``j`` gets
    ``w_k u_k[j] / Σ_k' w_k' u_k'[j]`` (importance-weighted averaging); other tensors use ``weights``.
    Integer buffers come from the first state.
    """
    out = {}
    for k, ref in states[0].items():
        if not ref.is_floating_point():
            out[k] = ref.clone()
            continue
        e = spec.entries.get(k) if (spec is not None and unit_weights is not None) else None
        ax = next((a for a in e.axes if a.role == "out"), None) if e is not None else None
        if ax is None:   # accumulated in float64, in place (no temporary per model)
            acc = states[0][k].double() * weights[0]
            for w, st in zip(weights[1:], states[1:]):
                acc.add_(st[k].to(acc.device), alpha=w)
            out[k] = acc.to(ref.dtype)
            continue
        shape = list(e.view) if e.view is not None else list(ref.shape)
        if e.view is not None:
            shape[ax.axis] = spec.groups[ax.group].size
            if e.qkv and len(shape) == 3:
                shape[-1] = -1
        u = torch.stack([w * uw[ax.group].to(ref.device, torch.float64) for w, uw in zip(weights, unit_weights)])  # [K, size]
        u = u / u.sum(0, keepdim=True).clamp_min(1e-300)
        acc = 0
        for kk, s in enumerate(states):
            x = s[k].to(ref.device, torch.float64).reshape(shape)
            bshape = [1] * x.dim()
            bshape[ax.axis] = -1
            acc = acc + x * u[kk].reshape(bshape)
        out[k] = acc.reshape(ref.shape).to(ref.dtype)
    return out
