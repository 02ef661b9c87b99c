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
    rows are concatenated. The subsample is taken batch by batch as the rows are produced, so memory holds
    ``max_rows`` rows per hook point plus one batch's, not every row of the fusion set.
    """
    device = torch.device(device)
    model = model.to(device).eval()
    mods = dict(model.named_modules())
    store: dict[tuple[str, str, str], list[torch.Tensor]] = {}
    seen: dict[tuple[str, str, str], int] = {}   # rows produced so far per hook point
    batch = {"n": 0}                               # samples in the batch running now
    handles = []
    points = {pt for g in spec.groups.values() for pt in g.acts}

    def keep(pt, h: torch.Tensor) -> None:
        """Keep only this batch's rows of the fusion set's row subsample: the same rows as subsampling after the
        whole pass, without holding every row of every hook point (the memory bound of real-size models)."""
        rows = _rows(h, pt[2]).float()
        off, r = seen[pt], rows.shape[0]
        seen[pt] = off + r
        total = (r // batch["n"]) * len(inputs)   # rows per sample × samples
        if total > max_rows:
            idx = _subsample(total, max_rows, seed).to(rows.device)
            rows = rows[idx[(idx >= off) & (idx < off + r)] - off]
        elif rows.data_ptr() == h.data_ptr():
            rows = rows.clone()   # a view of the module's output, which an in-place activation after it overwrites
        store[pt].append(rows)

    for pt in points:
        path, where, layout = pt
        if path not in mods:
            raise IncompatibleModelsError(f"activations: module {path!r} not found")
        store[pt], seen[pt] = [], 0
        if where == "out":
            handles.append(mods[path].register_forward_hook(lambda _m, _i, o, pt=pt: keep(pt, o)))
        else:
            handles.append(mods[path].register_forward_pre_hook(lambda _m, i, pt=pt: keep(pt, i[0])))
    try:
        for s in range(0, len(inputs), batch_size):
            xb = inputs[s:s + batch_size]
            batch["n"] = len(xb)
            model(xb.to(device))
    finally:
        for h in handles:
            h.remove()
    out: dict[str, torch.Tensor] = {}
    for name, g in spec.groups.items():
        parts = [torch.cat(store[pt]) for pt in g.acts]
        out[name] = torch.cat(parts) if parts else torch.empty(0, g.size, device=device)
    return out
