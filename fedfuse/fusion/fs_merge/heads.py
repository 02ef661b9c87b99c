"""Folding the class heads onto the merged features (Foldable SuperNets, arXiv 2410.19251: one shared head or one per model)."""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.fusion.fs_merge.matrices import split_blocks
from fedfuse.models.adapters import adapter_for


@torch.no_grad()
def fold_heads(body: nn.Module, heads: list[tuple[torch.Tensor, torch.Tensor | None]],
               final: torch.Tensor, scales: list[float], weights: list[float], mode: str,
               means: torch.Tensor | None = None) -> nn.Module:
    """Attach the folded classifier to ``body``.

    ``heads[k] = (W_k [C, d], b_k [C])`` of the model whose features are reconstructed by block k of
    ``final`` ``[d, T·d]``; ``scales[k]`` and ``means[k]`` (``[T, d]`` or None) are the target scale and centre
    used in training (the reconstruction of model k is ``s_k (f_k − μ_k)``, so head k gets bias ``b_k + W_k μ_k``). ``mode="shared"``: ``W = Σ_k w_k W_k F_kᵀ / s_k`` (one head, Option A);
    ``mode="multi"``: ``[n·C, d]`` stacked heads (joint accuracy = argmax over all).
    """
    blocks = split_blocks(final, "U", len(heads))
    if means is not None:
        heads = [(w, (0 if b is None else b) + w @ mu.to(w)) for (w, b), mu in zip(heads, means.cpu())]
    folded = [(w @ (fk / s).t(), b) for (w, b), fk, s in zip(heads, blocks, scales)]
    has_bias = folded[0][1] is not None
    adapter = adapter_for(body)
    lin = adapter.classifier(body)
    if mode == "shared":
        new = nn.Linear(lin.in_features, lin.out_features, bias=has_bias)
        new.weight.copy_(sum(wk * w for wk, (w, _) in zip(weights, folded)))
        if has_bias:
            new.bias.copy_(sum(wk * b for wk, (_, b) in zip(weights, folded)))
    else:
        c = lin.out_features
        new = nn.Linear(lin.in_features, c * len(heads), bias=has_bias)
        new.weight.copy_(torch.cat([w for w, _ in folded], 0))
        if has_bias:
            new.bias.copy_(torch.cat([b for _, b in folded], 0))
    new = new.to(lin.weight.device)
    adapter.set_classifier(body, new)
    return body


def heads_of(models: list[nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(W [C, d], b [C] | None)`` of every model's class layer (float32, CPU)."""
    out = []
    for m in models:
        lin = adapter_for(m).classifier(m)
        out.append((lin.weight.detach().float().cpu(), None if lin.bias is None else lin.bias.detach().float().cpu()))
    return out
