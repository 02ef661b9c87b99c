"""Model fusion methods behind one entry point.

    fused = fuse(method, models, fusion_inputs=X, scores=None, weights=None, device="cpu", seed=0, **options)

Each module of this package registers its methods with ``@register("name")``; every submodule is
imported when the package is, so ``METHODS`` always lists all of them. A method function has the
signature ``fn(models, *, fusion_inputs, scores, weights, device, seed, **options) -> nn.Module`` and
receives validated inputs: ``weights`` normalised to sum to 1 (float list, one per model), ``scores``
either ``None`` or one ``{level name: [width] tensor}`` dict per model, ``device`` a ``torch.device``.
Inputs are never modified; a method that cannot handle the models raises ``ValueError`` saying why.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

import torch
from torch import nn

from fedfuse.training import resolve_device

FusionFn = Callable[..., nn.Module]
METHODS: dict[str, FusionFn] = {}


def register(name: str, *, needs_data: bool = True, uses_scores: bool = False,
             same_architecture: bool = True) -> Callable[[FusionFn], FusionFn]:
    """Decorator adding a fusion function to ``METHODS`` under ``name``.

    The flags tell strategies what to send/expect: ``needs_data`` (uses ``fusion_inputs``),
    ``uses_scores`` (uses client importance scores), ``same_architecture`` (the result has model 0's
    architecture, so it can be broadcast as the next global model).
    """
    def deco(fn: FusionFn) -> FusionFn:
        if name in METHODS and METHODS[name] is not fn:
            raise RuntimeError(f"fusion method {name!r} registered twice")
        fn.needs_data = needs_data  # type: ignore[attr-defined]
        fn.uses_scores = uses_scores  # type: ignore[attr-defined]
        fn.same_architecture = same_architecture  # type: ignore[attr-defined]
        METHODS[name] = fn
        return fn
    return deco


def normalise_weights(weights, n: int) -> list[float]:
    """Per-model weights → non-negative floats summing to 1 (uniform when ``None``)."""
    if weights is None:
        return [1.0 / n] * n
    w = [float(v) for v in weights]
    if len(w) != n:
        raise ValueError(f"fuse: got {len(w)} weights for {n} models")
    if any(v < 0 or v != v for v in w) or sum(w) <= 0:
        raise ValueError(f"fuse: weights must be non-negative with a positive sum, got {w}")
    total = sum(w)
    return [v / total for v in w]


def fuse(method: str, models: list[nn.Module], fusion_inputs: torch.Tensor | None = None,
         scores: list[dict[str, torch.Tensor]] | None = None, weights=None, device: str | torch.device = "cpu",
         seed: int = 0, **options) -> nn.Module:
    """Fuse ``models`` (first = reference) into one model mapping ``[N, *input_shape]`` to logits.

    Args:
        method: a name in ``METHODS``.
        models: trained models of one family; not modified.
        fusion_inputs: unlabeled server fusion set ``[B, *input_shape]`` (ignored by data-free methods).
        scores: optional per-model importance dicts (``fedfuse.importance.neuron_importance`` output).
        weights: optional per-model weights (e.g. sample counts), normalised here.
        device: where the fusion computation runs (``"auto"`` picks CUDA when present).
        seed: seeds every random choice of the method.
    Returns:
        A new ``nn.Module`` on CPU in eval mode.
    """
    if method not in METHODS:
        raise ValueError(f"fuse: unknown method {method!r}; choose one of {sorted(METHODS)}")
    models = list(models)
    if not models:
        raise ValueError("fuse: no models given")
    if scores is not None and len(scores) != len(models):
        raise ValueError(f"fuse: got {len(scores)} score dicts for {len(models)} models")
    dev = resolve_device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        fused = METHODS[method](models, fusion_inputs=fusion_inputs, scores=scores,
                                weights=normalise_weights(weights, len(models)), device=dev, seed=seed, **options)
    return fused.cpu().eval()


def _import_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_import_all()

__all__ = ["fuse", "METHODS", "register", "normalise_weights"]
