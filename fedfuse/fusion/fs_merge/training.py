"""Training the SuperNet: AdamW with a one-cycle schedule on the feature-reconstruction MSE (spec
``fs-merge.md`` §1.5)."""

from __future__ import annotations

import math

import torch

from fedfuse.fusion.fs_merge.options import FSMergeOptions
from fedfuse.fusion.fs_merge.supernet import SuperNet


def _schedule(step: int, total: int, warmup: float) -> float:
    """One cycle: linear warm-up over ``warmup·total`` steps, then cosine decay to 0."""
    w = max(1, int(warmup * total))
    if step < w:
        return (step + 1) / w
    return 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, total - w)))


def train_supernet(net: SuperNet, pool: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
                   target_weights: torch.Tensor, cfg: FSMergeOptions, steps: int, gen: torch.Generator,
                   device: torch.device) -> list[float]:
    """AdamW on M/U/LN/U_final minimising the weighted reconstruction MSE.

    ``pool`` ``[N, *s]`` inputs, ``targets`` ``[N, T, d]`` (already scaled), ``mask`` ``[N, T]`` (1 = this
    sample is scored against target t; None = all), ``target_weights`` ``[T]``. Returns the per-epoch mean
    losses (an "epoch" is ``ceil(N / batch)`` steps).
    """
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, steps, cfg.warmup))
    n = len(pool)
    bs = min(cfg.batch_size, n)
    per_epoch = math.ceil(n / bs)
    losses, running, count = [], 0.0, 0
    perm, pos = torch.randperm(n, generator=gen), 0
    tw = target_weights.to(device)
    for step in range(steps):
        if pos >= n:
            perm, pos = torch.randperm(n, generator=gen), 0
        idx = perm[pos:pos + bs]
        pos += bs
        xb = pool[idx].to(device)
        rec = net.reconstruct(xb, cfg.route)                                      # [B, T, d]
        err = ((rec - targets[idx]) ** 2).mean(-1)                                 # [B, T]
        if mask is not None:
            m = mask[idx].to(device)
            loss = ((err * m * tw).sum(1) / (m * tw).sum(1).clamp_min(1e-12)).mean()
        else:
            loss = (err * tw).sum(1).mean() / tw.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running += float(loss.detach())
        count += 1
        if count == per_epoch or step == steps - 1:
            losses.append(running / count)
            running, count = 0.0, 0
    return losses


@torch.no_grad()
def reconstruction_loss(net: SuperNet, pool: torch.Tensor, targets: torch.Tensor, route: str = "folded",
                        batch_size: int = 512) -> float:
    """Mean squared reconstruction error of ``net`` over ``pool`` against ``targets`` ``[N, T, d]``."""
    tot = 0.0
    for i in range(0, len(pool), batch_size):
        rec = net.reconstruct(pool[i:i + batch_size].to(targets.device), route)
        tot += float(((rec - targets[i:i + batch_size]) ** 2).mean(-1).sum())
    return tot / (len(pool) * targets.shape[1])


def epochs_to_steps(cfg: FSMergeOptions, n_pool: int) -> int:
    """``cfg.epochs`` passes over a pool of ``n_pool`` inputs in steps, or ``cfg.steps`` when epochs is None."""
    if cfg.epochs is not None:
        return cfg.epochs * math.ceil(n_pool / min(cfg.batch_size, n_pool))
    return cfg.steps
