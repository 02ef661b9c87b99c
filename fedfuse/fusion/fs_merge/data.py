"""FS-Merge training data: augmented copies of the fusion set (as the paper trains), the opt-in
synthesised inputs of the collapse defence, and the scaled feature targets."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.fs_merge.options import FSMergeOptions
from fedfuse.fusion.fs_merge.supernet import Features
from fedfuse.fusion.registry import FusionOptionError


def augment_inputs(x: torch.Tensor, copies: int, gen: torch.Generator, mixup: float = 0.5,
                   noise: float = 0.05) -> torch.Tensor:
    """A fixed set of ``copies`` augmented versions of every input: ``[B, *s]`` → ``[B·copies, *s]``.

    Per copy: a random shift (images ``(C,H,W)``: up to 1/8 of the side, reflect padding; signals ``(C,L)``:
    up to L/16), Gaussian noise (``noise`` × the data std) and, with probability 1/2, MixUp with another
    input (weight λ ~ U[1 − mixup, 1] on the original). Flat inputs skip the shift.
    """
    if copies <= 0 or len(x) == 0:
        return x[:0]
    out = []
    std = x.std().clamp_min(1e-6)
    for _ in range(copies):
        a = x.clone()
        if a.dim() == 4:
            h, w = a.shape[-2:]
            ph, pw = max(1, h // 8), max(1, w // 8)
            pad = F.pad(a, (pw, pw, ph, ph), mode="reflect" if min(h, w) > max(ph, pw) else "replicate")
            dy = torch.randint(0, 2 * ph + 1, (len(a),), generator=gen)
            dx = torch.randint(0, 2 * pw + 1, (len(a),), generator=gen)
            a = torch.stack([pad[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(len(a))])
        elif a.dim() == 3:
            length = a.shape[-1]
            p = max(1, length // 16)
            pad = F.pad(a, (p, p), mode="replicate")
            dx = torch.randint(0, 2 * p + 1, (len(a),), generator=gen)
            a = torch.stack([pad[i, :, dx[i]:dx[i] + length] for i in range(len(a))])
        if mixup > 0 and len(a) > 1:
            lam = 1.0 - mixup * torch.rand(len(a), generator=gen)           # λ ~ U[1 − mixup, 1]
            use = torch.rand(len(a), generator=gen) < 0.5
            lam = torch.where(use, lam, torch.ones_like(lam)).reshape(-1, *[1] * (a.dim() - 1))
            other = a[torch.randperm(len(a), generator=gen)]
            a = lam * a + (1 - lam) * other
        a = a + noise * std * torch.randn(a.shape, generator=gen)
        out.append(a)
    return torch.cat(out)


def synthesize_inputs(model: nn.Module, pool: torch.Tensor, count: int, gen: torch.Generator, *, steps: int = 40,
                      lr: float = 0.05, proximity: float = 0.05, temperature: float = 0.5,
                      batch_size: int = 256) -> torch.Tensor:
    """Collapse defence: ``count`` inputs ``[count, *s]`` on which ``model`` predicts the classes *it* knows.

    Target classes are drawn from ``p_c ∝ (mean_x softmax(model(x))_c)^temperature`` over ``pool`` (so a client
    trained on other classes than the pool's still gets its own classes); starting points are pool samples;
    Adam on the inputs minimises ``CE(model(x), c) + proximity·‖x − x₀‖²/σ²`` (σ = pool std), with inputs kept
    inside the pool's value range.
    """
    if count <= 0:
        return pool[:0]
    dev = next(model.parameters()).device
    with torch.no_grad():
        probs = torch.cat([model(pool[i:i + batch_size].to(dev)).float().softmax(-1).cpu()
                           for i in range(0, len(pool), batch_size)]).mean(0)
    p = probs.clamp_min(1e-12) ** temperature
    cls = torch.multinomial(p / p.sum(), count, replacement=True, generator=gen)
    start = pool[torch.randint(0, len(pool), (count,), generator=gen)]
    sigma = pool.std().clamp_min(1e-6)
    lo, hi = pool.min(), pool.max()
    out = []
    for i in range(0, count, batch_size):
        x0 = start[i:i + batch_size].to(dev)
        c = cls[i:i + batch_size].to(dev)
        x = x0.clone().requires_grad_(True)
        opt = torch.optim.Adam([x], lr=lr * float(sigma))
        for _ in range(steps):
            loss = F.cross_entropy(model(x), c) + proximity * ((x - x0) ** 2).mean() / sigma ** 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                x.clamp_(lo, hi)
        out.append(x.detach().cpu())
    return torch.cat(out)


@torch.no_grad()
def target_features(models: list[nn.Module], x: torch.Tensor, device: torch.device,
                    batch_size: int = 512) -> torch.Tensor:
    """Pre-head features of every model on ``x``: ``[N, n, d]`` (on ``device``)."""
    outs = []
    for m in models:
        f = Features(copy.deepcopy(m)).float().to(device).eval()
        outs.append(torch.cat([f(x[i:i + batch_size].to(device)).float() for i in range(0, len(x), batch_size)]))
    return torch.stack(outs, 1)


@dataclass
class _Prepared:
    pool: torch.Tensor            # [N, *s] inputs (originals, augmented copies, synthesised)
    targets: torch.Tensor         # [N, n, d] scaled targets, on device
    mask: torch.Tensor | None     # [N, n] per-task mask or None
    scales: list[float]           # per-model target scale s_k
    means: torch.Tensor | None = None   # [n, d] per-model feature means μ_k (targets are centred)


def prepare_data(models: list[nn.Module], x: torch.Tensor, cfg: FSMergeOptions, device: torch.device,
                 gen: torch.Generator) -> _Prepared:
    """Fusion pool = originals + ``augment`` fixed copies (+ ``synth`` inverted inputs per client), targets and
    centred, per-model scaled targets ``s_k (f_k − μ_k)`` with ``s_k = 1 / std(f_k)``, so every model's features count
    equally and the loss measures the feature *variation* (uncentred post-ReLU features
    let a constant output score a low loss; the centre is folded back into the head bias)."""
    x = x.detach().float().cpu()
    tid = None
    if cfg.task_ids is not None:
        tid = torch.as_tensor(cfg.task_ids).long().cpu()
        if tid.shape != (len(x),) or tid.min() < 0 or tid.max() >= len(models):
            raise FusionOptionError(f"fs-merge: task_ids must be [{len(x)}] ints in [0, {len(models)})")
    aug = augment_inputs(x, cfg.augment, gen)
    pool = torch.cat([x, aug])
    tids = None if tid is None else torch.cat([tid, tid.repeat(cfg.augment)])
    synth = cfg.synth
    if synth > 0:
        extra, extra_t = [], []
        for k, m in enumerate(models):
            mk = copy.deepcopy(m).float().to(device).eval()
            for prm in mk.parameters():
                prm.requires_grad_(False)
            extra.append(synthesize_inputs(mk, pool, synth, gen, steps=cfg.synth_steps))
            extra_t.append(torch.full((synth,), k))
        pool = torch.cat([pool, *extra])
        if tids is not None:
            tids = torch.cat([tids, *extra_t])
    targets = target_features(models, pool, device)
    mu = targets.mean(0)                                                   # [n, d]
    rms = (targets - mu).pow(2).mean(dim=(0, 2)).sqrt().clamp_min(1e-8)    # [n]
    scales = (1.0 / rms).tolist()
    targets = (targets - mu) / rms[None, :, None]
    mask = None if tids is None else F.one_hot(tids, len(models)).float()
    return _Prepared(pool, targets, mask, scales, mu)
