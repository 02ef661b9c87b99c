"""Averaging of aligned state dicts (uniform or importance-weighted per unit), as a stream.

The matching methods (``ot``, ``rebasin``, ``transfusion``) align one client at a time onto the reference; adding
each aligned state to ``AlignedAverage`` as it is made keeps one float64 accumulator instead of every client's
aligned state, so their memory does not grow with the number of clients (docs/scaling.md, "Streamed aligned
averages").
"""

from __future__ import annotations

import torch

from fedfuse.fusion.permute.spec import PermSpec


class AlignedAverage:
    """Running weighted average of aligned states (all in the reference's units), one state at a time.

    ``add(state, weight, unit_weights)``; ``result()`` gives the average in the first state's dtypes and devices.
    With ``unit_weights`` (a ``{group: [size]}`` dict per state, already in the reference's units; ``spec`` the
    reference's permutation spec) the average runs per unit: along an entry's first ``out`` axis unit ``j`` of
    state ``k`` gets ``w_k u_k[j] / Σ_k' w_k' u_k'[j]`` (importance-weighted averaging); other tensors use the
    weights, which are the final coefficients (normalised by the caller, as ``fuse`` does); integer buffers come from
    the first state.
    """

    def __init__(self, spec: PermSpec | None = None, per_unit: bool = False):
        self.spec = spec if per_unit else None
        self.num: dict[str, torch.Tensor] = {}    # Σ w (u) x, float64
        self.den: dict[str, torch.Tensor] = {}    # Σ w u per unit (per-unit entries only)
        self.first: dict[str, torch.Tensor] | None = None

    def _unit_axis(self, k: str, ref: torch.Tensor):
        """(axis, group, view shape) of entry ``k``'s first ``out`` axis when it is averaged per unit, else None."""
        e = self.spec.entries.get(k) if self.spec is not None else None
        ax = next((a for a in e.axes if a.role == "out"), None) if e is not None else None
        if ax is None:
            return None
        shape = list(e.view) if e.view is not None else list(ref.shape)
        if e.view is not None:
            shape[ax.axis] = self.spec.groups[ax.group].size
            if e.qkv and len(shape) == 3:
                shape[-1] = -1
        return ax.axis, ax.group, shape

    def add(self, state: dict[str, torch.Tensor], weight: float,
            unit_weights: dict[str, torch.Tensor] | None = None) -> None:
        if self.spec is not None and unit_weights is None:
            raise ValueError("AlignedAverage: per-unit averaging needs every state's unit_weights")
        if self.first is None:
            self.first = state
        for k, t in state.items():
            if not self.first[k].is_floating_point():
                continue
            dev = self.first[k].device
            unit = self._unit_axis(k, self.first[k])
            if unit is None:   # accumulated in float64, in place (no temporary per model)
                if k in self.num:
                    self.num[k].add_(t.to(dev), alpha=weight)
                else:
                    self.num[k] = t.to(dev, torch.float64) * weight
                continue
            axis, group, shape = unit
            u = weight * unit_weights[group].to(dev, torch.float64)
            x = t.to(dev, torch.float64).reshape(shape)
            bshape = [1] * x.dim()
            bshape[axis] = -1
            if k in self.num:
                self.num[k].add_(x * u.reshape(bshape))
                self.den[k].add_(u)
            else:
                self.num[k], self.den[k] = x * u.reshape(bshape), u.clone()

    def result(self) -> dict[str, torch.Tensor]:
        if self.first is None:
            raise ValueError("AlignedAverage: no state was added")
        out = {}
        for k, ref in self.first.items():
            if not ref.is_floating_point():
                out[k] = ref.clone()
            elif k in self.den:
                axis, _, _ = self._unit_axis(k, ref)
                bshape = [1] * self.num[k].dim()
                bshape[axis] = -1
                out[k] = (self.num[k] / self.den[k].clamp_min(1e-300).reshape(bshape)).reshape(ref.shape).to(ref.dtype)
            else:
                out[k] = self.num[k].to(ref.dtype)
        return out


def average_aligned(states: list[dict[str, torch.Tensor]], weights: list[float],
                    unit_weights: list[dict[str, torch.Tensor]] | None = None,
                    spec: PermSpec | None = None) -> dict[str, torch.Tensor]:
    """Weighted average of aligned states (all in the reference's units): ``AlignedAverage`` over a list.

    ``unit_weights`` (optional, one ``{group: [size]}`` dict per model, already in the reference's
    units) turn the average per unit: along an entry's first ``out`` axis unit ``j`` gets
    ``w_k u_k[j] / Σ_k' w_k' u_k'[j]`` (importance-weighted averaging); other tensors use ``weights``.
    Integer buffers come from the first state.
    """
    avg = AlignedAverage(spec, per_unit=spec is not None and unit_weights is not None)
    for i, (w, st) in enumerate(zip(weights, states)):
        avg.add(st, w, unit_weights[i] if unit_weights is not None else None)
    return avg.result()


__all__ = ["AlignedAverage", "average_aligned"]
