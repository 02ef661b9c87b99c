"""Options of ``fs-merge`` and ``fs-merge-seq`` (one schema for both) and their per-family defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class FSMergeOptions:
    """Options shared by ``fs-merge`` and ``fs-merge-seq`` (defaults for CPU-size models; the paper's ViT-B
    defaults are in the package docstring).

    Attributes:
        rank: low-rank size of every M/U (hidden-width ViT matrices get ``rank·h/d``), ``"full"`` for a dense
            residual; ``None`` → ``"full"`` for MLPs (paper E.1), 8 for ViTs.
        init: ``"first"`` (SuperNet == model 0), ``"average"`` (folds to the weight average) or ``"random"``;
            ``fs-merge-seq`` takes ``"first"`` only (each stage starts at the previous merge).
        steps: optimiser steps (of the last stage for ``fs-merge-seq``); ``epochs`` (passes over the augmented
            pool) overrides it.
        lr: AdamW learning rate; ``None`` → 1e-3 for MLPs (1e-2 killed ReLUs with 4 clients), 1e-2 for ViTs.
        weight_decay, batch_size, warmup: AdamW weight decay, batch size, warm-up fraction of the one-cycle schedule.
        augment: fixed augmented copies per fusion input.
        heads: ``"shared"`` (one head of the original size) or ``"multi"`` (``n·C`` outputs, one block per model).
        route: ``"folded"`` (single-width reparameterisation) or ``"wide"`` (the paper's n·d-wide SuperNet).
        synth, synth_steps: opt-in collapse defence: inputs synthesised per client by inverting its model, and
            the gradient steps per input (0 = off).
        task_ids: ``[B]`` client id per fusion input → per-task loss instead of the all-clients loss.
        stage_steps: ``fs-merge-seq`` steps of each intermediate stage (``None`` → ``steps // 4``).
        keep_best: end (each stage) at the state with the lowest full-pool reconstruction objective among the
            training start, the exact start (the initial body with an exact reconstruction of every model that
            agrees with it) and ~10 checkpoints: never worse than either start, and copies of one model come back
            unchanged (fixed point); off = the last step's state (the paper's procedure).
    """

    rank: int | Literal["full"] | None = None
    init: Literal["first", "average", "random"] = "first"
    steps: int = 600
    epochs: int | None = None
    lr: float | None = None
    weight_decay: float = 1e-3
    batch_size: int = 128
    augment: int = 4
    heads: Literal["shared", "multi"] = "shared"
    route: Literal["folded", "wide"] = "folded"
    synth: int = 0
    synth_steps: int = 40
    task_ids: list[int] | torch.Tensor | None = None
    warmup: float = 0.05
    stage_steps: int | None = None
    keep_best: bool = True

    def __post_init__(self) -> None:
        if self.rank is not None and self.rank != "full" and self.rank < 0:
            raise ValueError(f"fs-merge: rank must be an int >= 0 or 'full', got {self.rank!r}")
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"fs-merge: {name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("epochs", "stage_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"fs-merge: {name} must be a positive int or None, got {getattr(self, name)!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"fs-merge: lr must be > 0, got {self.lr!r}")
        if self.weight_decay < 0:
            raise ValueError(f"fs-merge: weight_decay must be >= 0, got {self.weight_decay!r}")
        if not 0 <= self.warmup <= 1:
            raise ValueError(f"fs-merge: warmup (fraction of the steps) must be in [0, 1], got {self.warmup!r}")
        if self.augment < 0:
            raise ValueError(f"fs-merge: augment (augmented copies per input) must be an int >= 0, got {self.augment!r}")
        if self.synth < 0:
            raise ValueError(f"fs-merge: synth (synthesised inputs per client) must be an int >= 0, got {self.synth!r}")
        if self.synth_steps < 0:
            raise ValueError(f"fs-merge: synth_steps must be an int >= 0, got {self.synth_steps!r}")


def resolve_defaults(options: FSMergeOptions, kind: str) -> FSMergeOptions:
    """Fill ``rank`` / ``lr`` left at ``None`` with the CPU-size defaults of the structure ``kind``
    (``"mlp"``, ``"vit"`` or ``"graph"``: any other model, the MLP's)."""
    rank = options.rank if options.rank is not None else ("full" if kind in ("mlp", "graph") else 8)
    lr = options.lr if options.lr is not None else (1e-3 if kind in ("mlp", "graph") else 1e-2)
    return dataclasses.replace(options, rank=rank, lr=lr)
