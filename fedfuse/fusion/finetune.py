"""Optional short server-side fine-tuning after fusion (off by default; reported separately).

The OT papers (Imfeld et al., "Transformer Fusion with Optimal Transport", arXiv 2310.05719; OTFusion,
Singh & Jaggi 2020, arXiv 1910.05653) recover accuracy after fusion with "a surprisingly short finetuning". The server's
fusion set is *unlabeled*, so the targets here are the **ensemble's soft labels**: the weighted mean
of the client models' softmax outputs (FedDF-style distillation), at temperature
``temperature``. Defence against collapsing to the fusion set's classes (a known failure mode on a skewed fusion set):
the soft targets cover every class the clients predict, and an L2 pull towards the fused weights
(``anchor``) keeps the closed-form fusion as the prior. Used through the ``finetune=dict(...)`` option
of ``ot``, ``rebasin`` and ``transfusion``; not registered as a method.
"""

from __future__ import annotations

from fedfuse.choices import OPTIMIZERS
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.registry import parse_options, require
from fedfuse.training import make_optimizer


@dataclass(frozen=True)
class FinetuneOptions:
    """The ``finetune`` option of ``ot``, ``rebasin`` and ``transfusion`` (see ``finetune_fused``).

    Attributes:
        epochs: passes over the fusion set.
        lr, optimizer: the optimiser (``fedfuse.training.make_optimizer``).
        batch_size: fusion samples per step.
        temperature: softmax temperature of the ensemble targets and the fused model.
        anchor: weight of the L2 pull ``‖θ − θ_fused‖²`` towards the closed-form fusion.
    """

    epochs: int = 5
    lr: float = 1e-3
    batch_size: int = 64
    temperature: float = 1.0
    anchor: float = 1e-3
    optimizer: Literal[OPTIMIZERS] = "adam"

    def __post_init__(self) -> None:
        require(self.epochs >= 0, "finetune.epochs", ">= 0", self.epochs)
        require(self.lr > 0, "finetune.lr", "> 0", self.lr)
        require(self.batch_size >= 1, "finetune.batch_size", ">= 1", self.batch_size)
        require(self.temperature > 0, "finetune.temperature", "> 0", self.temperature)
        require(self.anchor >= 0, "finetune.anchor", ">= 0", self.anchor)


def finetune_options(value: Any) -> FinetuneOptions | None:
    """Normalise a ``finetune`` option value: ``None``/``False``/``0`` → off, ``True`` → defaults, a positive
    int ``N`` → ``N`` epochs with the other defaults, a table → validated ``FinetuneOptions``."""
    if isinstance(value, FinetuneOptions) or value is None:
        return value
    if isinstance(value, bool):
        return FinetuneOptions() if value else None
    if isinstance(value, int):
        require(value >= 0, "finetune", "a table of options, true or an epoch count >= 0", value)
        return FinetuneOptions(epochs=value) if value else None
    if isinstance(value, dict):
        return parse_options("finetune", FinetuneOptions, value, what="option 'finetune'") if value else None
    raise ValueError(f"option 'finetune' must be a table of options, true or an epoch count, got {value!r}")


def run_finetune(fused: nn.Module, teachers: list[nn.Module], inputs: torch.Tensor, options: FinetuneOptions, *,
                 weights=None, device="cpu", seed: int = 0) -> dict[str, float]:
    """``finetune_fused`` with validated ``FinetuneOptions``."""
    return finetune_fused(fused, teachers, inputs, weights=weights, device=device, seed=seed,
                          **dataclasses.asdict(options))


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
