"""Optional short server-side fine-tuning after fusion (off by default; reported separately).

The OT papers (seed 000 / Imfeld et al.; OTFusion, Singh & Jaggi 2020) recover accuracy after fusion
with "a surprisingly short finetuning" (spec ``ot-transfusion-tofu.md`` §1.8, §1.11, §5). The server's
fusion set is *unlabeled*, so the targets here are the **ensemble's soft labels**: the weighted mean
of the client models' softmax outputs (FedDF-style distillation, ``flower.md`` §5), at temperature
``temperature``. Defence against collapsing to the fusion set's classes (FINDINGS.md failure mode #1):
the soft targets cover every class the clients predict, and an L2 pull towards the fused weights
(``anchor``) keeps the closed-form fusion as the prior. Used through the ``finetune=dict(...)`` option
of ``ot``, ``rebasin`` and ``transfusion``; not registered as a method.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.training import make_optimizer


@torch.no_grad()
def ensemble_soft_labels(models: list[nn.Module], inputs: torch.Tensor, weights: list[float] | None = None, *,
                         temperature: float = 1.0, batch_size: int = 256, device="cpu") -> torch.Tensor:
    """Weighted mean of the members' ``softmax(logits / T)``: ``[N, num_classes]`` on CPU."""
    weights = weights or [1.0 / len(models)] * len(models)
    outs = []
    for s in range(0, len(inputs), batch_size):
        xb = inputs[s:s + batch_size].to(device)
        p = sum(w * m.to(device).eval()(xb).div(temperature).softmax(-1) for w, m in zip(weights, models))
        outs.append(p.float().cpu())
    return torch.cat(outs)


def finetune_fused(fused: nn.Module, teachers: list[nn.Module], inputs: torch.Tensor, *, weights=None,
                   epochs: int = 5, lr: float = 1e-3, batch_size: int = 64, temperature: float = 1.0,
                   anchor: float = 1e-3, optimizer: str = "adam", device="cpu", seed: int = 0) -> dict[str, float]:
    """Distil the ensemble of ``teachers`` into ``fused`` (in place) on the unlabeled ``inputs``.

    Loss per batch: ``T² · KL(ensemble soft labels ‖ softmax(fused / T)) + anchor · ‖θ − θ_fused‖²``.
    BatchNorm layers train in train mode (their statistics keep adapting to the fusion set).
    Returns ``{"finetune-loss": last epoch's mean loss, "finetune-seconds": wall time}``.
    """
    if epochs < 0 or lr <= 0 or batch_size < 1 or temperature <= 0:
        raise ValueError(f"finetune: need epochs >= 0, lr > 0, batch_size >= 1, temperature > 0; got epochs={epochs}, "
                         f"lr={lr}, batch_size={batch_size}, temperature={temperature}")
    t0 = time.perf_counter()
    targets = ensemble_soft_labels(teachers, inputs, weights, temperature=temperature, device=device)
    fused.to(device).train()
    start = [p.detach().clone() for p in fused.parameters()]
    opt = make_optimizer(fused.parameters(), optimizer, lr)
    gen = torch.Generator().manual_seed(seed)
    last = float("nan")
    n = len(inputs)
    with torch.enable_grad():
        for _ in range(epochs):
            perm = torch.randperm(n, generator=gen)
            tot, cnt = 0.0, 0
            for s in range(0, n, batch_size):
                idx = perm[s:s + batch_size]
                if len(idx) < 2:
                    continue
                xb, tb = inputs[idx].to(device), targets[idx].to(device)
                logp = F.log_softmax(fused(xb) / temperature, -1)
                loss = F.kl_div(logp, tb, reduction="batchmean") * temperature ** 2
                if anchor > 0:
                    loss = loss + anchor * sum(((p - q) ** 2).sum() for p, q in zip(fused.parameters(), start))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tot += float(loss.detach()) * len(idx)
                cnt += len(idx)
            last = tot / max(cnt, 1)
    fused.eval()
    return {"finetune-loss": last, "finetune-seconds": time.perf_counter() - t0}
