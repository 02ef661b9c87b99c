"""Training the SuperNet: AdamW with a one-cycle schedule on the feature-reconstruction MSE (Foldable
SuperNets, arXiv 2410.19251)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from fedfuse.fusion.fs_merge.options import FSMergeOptions
from fedfuse.fusion.fs_merge.supernet import SuperNet


def _schedule(step: int, total: int, warmup: float) -> float:
    """One cycle: linear warm-up over ``warmup·total`` steps, then cosine decay to 0."""
    w = max(1, int(warmup * total))
    if step < w:
        return (step + 1) / w
    return 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, total - w)))


def _batch_loss(rec: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None, tw: torch.Tensor) -> torch.Tensor:
    """Per-sample weighted reconstruction MSE ``[B]``: ``rec``/``targets`` ``[B, T, d]``, ``mask`` ``[B, T]``."""
    err = ((rec - targets) ** 2).mean(-1)                                          # [B, T]
    if mask is not None:
        return (err * mask * tw).sum(1) / (mask * tw).sum(1).clamp_min(1e-12)
    return (err * tw).sum(1) / tw.sum()


@torch.no_grad()
def objective(net: SuperNet, pool: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
              target_weights: torch.Tensor, route: str = "folded", batch_size: int = 512) -> float:
    """The training objective of ``train_supernet`` over the whole ``pool`` (mean of the per-sample weighted
    MSE): the criterion by which the best state is kept."""
    tw = target_weights.to(targets.device)
    tot = 0.0
    for i in range(0, len(pool), batch_size):
        rec = net.reconstruct(pool[i:i + batch_size].to(targets.device), route)
        m = None if mask is None else mask[i:i + batch_size].to(targets.device)
        tot += float(_batch_loss(rec, targets[i:i + batch_size], m, tw).sum())
    return tot / len(pool)


@dataclass
class TrainResult:
    """What ``train_supernet`` did: ``epoch_losses`` (mean minibatch loss per epoch); the full-pool objective at
    the training start (``start_loss``) and of the exact start (``exact_loss``, ``nan`` without one); of the state
    kept (``best_loss``) and when it was reached (``best_step`` steps; 0 = a start was kept, ``kept_exact`` = it
    was the exact start); the ``steps`` run (fewer than asked after a converged stop); and whether a minibatch
    loss or a measured objective was non-finite (``diverged``: the caller raises rather than return the kept
    state); ``collapsed``: the checkpoints passed over because the merged features had collapsed to a constant."""

    epoch_losses: list[float]
    start_loss: float
    exact_loss: float
    best_loss: float
    best_step: int
    kept_exact: bool
    steps: int
    diverged: bool = False
    collapsed: list[int] = dataclasses.field(default_factory=list)


def _checkpoints(steps: int, count: int = 10) -> set[int]:
    """Steps (1-based, after the update) at which the full-pool objective is measured: ~``count`` evenly spaced
    ones and the last."""
    every = max(1, math.ceil(steps / count))
    return set(range(every, steps + 1, every)) | {steps}


def _min_improvement(loss: float) -> float:
    """A decrease of the objective that counts (more than float round-off): 1e-7 plus 1e-4 of the loss."""
    return 1e-7 + 1e-4 * abs(loss)


# a checkpoint whose merged features spread less than this fraction of the start's has collapsed: the reconstruction
# MSE's trivial minimum (every reconstruction the target mean, through U_final's offset) reached by constant features
COLLAPSE = 1e-3


@torch.no_grad()
def _spread(net: SuperNet, pool: torch.Tensor, route: str, rows: int = 256) -> float:
    """The merged pre-head features' mean per-dimension standard deviation on the first ``rows`` pool inputs."""
    x = pool[:rows].to(net.final.diag.device)
    return float(net.features(x, route).float().std(0).mean())


def train_supernet(net: SuperNet, pool: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
                   target_weights: torch.Tensor, cfg: FSMergeOptions, steps: int, gen: torch.Generator,
                   device: torch.device) -> TrainResult:
    """AdamW on M/U/LN/U_final minimising the weighted reconstruction MSE; in place.

    ``pool`` ``[N, *s]`` inputs, ``targets`` ``[N, T, d]`` (already scaled), ``mask`` ``[N, T]`` (1 = this
    sample is scored against target t; None = all), ``target_weights`` ``[T]``.

    Best state (``cfg.keep_best``, default): the full-pool objective (``objective``) is measured for the training
    start, for the exact start (``SuperNet.exact_start_``: the body as initialised with an exact reconstruction
    of every model that agrees with it; when the net has one) and at ~10 checkpoints (the last step included);
    ``net`` ends at the state with the lowest one (a decrease within float round-off, ``_min_improvement``, keeps
    the earlier state). So the result is never worse on the reconstruction objective than either start; copies
    of one model give objective 0 at the exact start, which is returned unchanged (the fixed point: copies of a model fuse back to it), not a
    state AdamW's normalised steps on round-off gradients moved away. Training stops once the kept objective is
    within ``_min_improvement`` of its lower bound 0 (no later state could be kept: an exact shortcut, no step
    at all for agreeing models). Training itself runs from the paper's start (``U_final = I``), as without
    ``keep_best``: starting it at the exact start measurably lowered accuracy (stuck near model 0). A checkpoint
    whose merged features have collapsed to a constant (spread below ``COLLAPSE`` of the start's: the objective's
    trivial minimum, each reconstruction the target mean through the offset; measured on MobileNetV2 clients) is
    never kept; its step is listed in ``collapsed``.
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
    start = exact = best = float("nan")
    best_state, best_step, kept_exact = None, 0, False
    collapsed: list[int] = []
    if cfg.keep_best:
        start_state = net.snapshot()
        start = best = objective(net, pool, targets, mask, target_weights, cfg.route)
        spread0 = _spread(net, pool, cfg.route)
        best_state = start_state
        if net.has_exact_start:
            net.exact_start_()
            exact = objective(net, pool, targets, mask, target_weights, cfg.route)
            if math.isfinite(exact) and (not math.isfinite(best) or exact < best - _min_improvement(best)):
                best, best_state, kept_exact = exact, net.snapshot(), True
            net.restore(start_state)
    checks = _checkpoints(steps) if cfg.keep_best else set()
    done, diverged = 0, False
    for step in range(steps):
        if cfg.keep_best and best - _min_improvement(best) < 0:
            break  # converged: the MSE is >= 0, so no later state could count as better and be kept
        done += 1
        if pos >= n:
            perm, pos = torch.randperm(n, generator=gen), 0
        idx = perm[pos:pos + bs]
        pos += bs
        xb = pool[idx].to(device)
        rec = net.reconstruct(xb, cfg.route)                                      # [B, T, d]
        m = None if mask is None else mask[idx].to(device)
        loss = _batch_loss(rec, targets[idx], m, tw).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running += float(loss.detach())
        diverged = diverged or not math.isfinite(running)
        count += 1
        if count == per_epoch or step == steps - 1:
            losses.append(running / count)
            running, count = 0.0, 0
        if step + 1 in checks:
            cur = objective(net, pool, targets, mask, target_weights, cfg.route)
            diverged = diverged or not math.isfinite(cur)
            if math.isfinite(cur) and _spread(net, pool, cfg.route) < COLLAPSE * spread0:
                collapsed.append(step + 1)   # the objective's trivial minimum: constant features, U_final's offset
                continue
            if math.isfinite(cur) and (not math.isfinite(best) or cur < best - _min_improvement(best)):
                best, best_step, best_state, kept_exact = cur, step + 1, net.snapshot(), False
    if count:                                                   # a partial epoch before a converged stop
        losses.append(running / count)
    if cfg.keep_best and (best_step < done or kept_exact):
        net.restore(best_state)
    return TrainResult(losses, start, exact, best, best_step if cfg.keep_best else done, kept_exact, done, diverged,
                       collapsed)


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
