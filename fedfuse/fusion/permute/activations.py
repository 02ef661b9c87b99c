"""Unit activations of every permutation group on the fusion set (for activation-based matching)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from fedfuse.fusion.permute.spec import PermSpec
from fedfuse.fusion.registry import IncompatibleModelsError
from fedfuse.models.levels import neurons_last


@functools.lru_cache(maxsize=64)
def _subsample(n: int, k: int, seed: int) -> torch.Tensor:
    """Sorted random ``k`` of ``range(n)`` (seeded by ``seed + n``); cached, since every model of a
    fusion draws the same rows."""
    gen = torch.Generator().manual_seed(seed + n)
    return torch.randperm(n, generator=gen)[:k].sort().values

def _rows(h: torch.Tensor, layout: str) -> torch.Tensor:
    """Module output → ``[samples, units]`` (``levels.neurons_last`` plus the fused-QKV layout)."""
    if layout == "qkv":
        d = h.shape[-1] // 3
        return h.reshape(-1, 3, d).transpose(0, 1).reshape(-1, d)
    return neurons_last(h, layout)

@torch.no_grad()
def collect_activations(model: nn.Module, spec: PermSpec, inputs: torch.Tensor, *, max_rows: int = 4096,
                        batch_size: int = 256, seed: int = 0, device: str | torch.device = "cpu",
                        per_position: bool = False) -> dict[str, torch.Tensor]:
    """Unit activations per group: ``{group: [S, size]}`` (float32, on ``device``).

    Rows are (sample, position/token) pairs of the fusion set; each hook point contributes at most
    ``max_rows`` rows, subsampled with a generator seeded by ``seed`` so that two models fed the same
    ``inputs`` get corresponding rows. With several hook points (a tied residual stream, q/k/v) the
    rows are concatenated.
    """
    device = torch.device(device)
    model = model.to(device).eval()
    mods = dict(model.named_modules())
    store: dict[tuple[str, str, str], list[torch.Tensor]] = {}
    handles = []
    points = {pt for g in spec.groups.values() for pt in g.acts}
    for pt in points:
        path, where, layout = pt
        if path not in mods:
            raise IncompatibleModelsError(f"activations: module {path!r} not found")
        store[pt] = []
        if where == "out":
            handles.append(mods[path].register_forward_hook(
                lambda _m, _i, o, pt=pt: store[pt].append(_rows(o, pt[2]).float())))
        else:
            handles.append(mods[path].register_forward_pre_hook(
                lambda _m, i, pt=pt: store[pt].append(_rows(i[0], pt[2]).float())))
    try:
        for s in range(0, len(inputs), batch_size):
            model(inputs[s:s + batch_size].to(device))
    finally:
        for h in handles:
            h.remove()
    out: dict[str, torch.Tensor] = {}
    for name, g in spec.groups.items():
        parts = []
        for pt in g.acts:
            rows = torch.cat(store[pt])
            if len(rows) > max_rows:
                rows = rows[_subsample(len(rows), max_rows, seed).to(rows.device)]
            parts.append(rows)
        out[name] = torch.cat(parts) if parts else torch.empty(0, g.size, device=device)
    return out
