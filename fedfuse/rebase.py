"""Task-vector transport between base releases (TransFusion use (b), data-free).

Paper: "Update Your Transformer to the Latest Release: Re-Basin of Task Vectors" (TransFusion, arXiv
2505.22697): ``θ̃_B^ft = θ_B + α·π(τ)``; untied residual permutations are allowed here because only π(τ) is
added to the plain θ_B; every task-vector tensor is permuted along its axes (the classifier head's input axis
follows the last stream permutation). Use: re-basing a client's update or the global model's onto a new
backbone release without data.

    from fedfuse.rebase import transport, task_vector
    tau = task_vector(finetuned, base_a)                    # θ_A^ft − θ_A
    new_model = transport(tau, base_a, base_b, alpha=1.0)   # θ_B + α·π(τ), a copy of base_b
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from fedfuse.fusion.permute import Map, apply_maps, build_spec, check_compatible
from fedfuse.fusion.rebasin import weight_matching
from fedfuse.fusion.registry import IncompatibleModelsError
from fedfuse.fusion.transfusion import transfusion_match


def task_vector(finetuned: nn.Module, base: nn.Module) -> dict[str, torch.Tensor]:
    """``τ = θ_ft − θ_base`` over floating-point state entries (same architecture required)."""
    sf, sb = finetuned.state_dict(), base.state_dict()
    if list(sf) != list(sb):
        raise ValueError("task_vector: the fine-tuned model and the base have different parameter names")
    out = {}
    for k, v in sf.items():
        if v.shape != sb[k].shape:
            raise ValueError(f"task_vector: {k} has shape {tuple(v.shape)} vs {tuple(sb[k].shape)} in the base")
        if v.is_floating_point():
            out[k] = (v.detach() - sb[k].detach()).clone()
    return out


def match_bases(from_base: nn.Module, to_base: nn.Module, *, residual: str = "untied", max_iter: int = 100,
                seed: int = 0, order: str = "random", top_k: int | None = None, intra: bool = True,
                method: str = "transfusion") -> tuple[dict[str, Map], object, object]:
    """Permutations π from ``from_base`` (θ_A) onto ``to_base`` (θ_B), computed from weights only.

    ``method``: ``"transfusion"`` (spectral head pairing + intra-head matching) or ``"rebasin"``
    (brute-force head pairing, Git Re-Basin weight matching). Returns ``(maps, spec_a, spec_b)``.
    """
    spec_a, spec_b = build_spec(from_base, residual), build_spec(to_base, residual)
    sa, sb = from_base.state_dict(), to_base.state_dict()
    check_compatible(spec_a, spec_b, sa, sb, same_width=True)
    if method == "transfusion":
        maps, _ = transfusion_match(sa, sb, spec_a, spec_b, max_iter=max_iter, order=order, seed=seed, top_k=top_k,
                                    intra=intra)
    elif method == "rebasin":
        maps, _ = weight_matching(sa, sb, spec_a, spec_b, max_iter=max_iter, order=order, seed=seed)
    else:
        raise ValueError(f"transport: method must be 'transfusion' or 'rebasin', got {method!r}")
    return maps, spec_a, spec_b


def permute_task_vector(tau: dict[str, torch.Tensor], maps: dict[str, Map], spec_a, spec_b,
                        like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """π(τ): every tensor of ``tau`` permuted along its grouped axes (linear in τ)."""
    full = {k: (tau[k] if k in tau else torch.zeros_like(v)) for k, v in like.items() if v.is_floating_point()}
    moved = apply_maps(full, spec_a, spec_b, maps, like)
    return {k: moved[k] for k in tau}


def transport(task_vector: dict[str, torch.Tensor], from_base: nn.Module, to_base: nn.Module, alpha: float = 1.0,
              *, residual: str = "untied", method: str = "transfusion", head: str = "delta", max_iter: int = 100,
              seed: int = 0, maps: dict[str, Map] | None = None, return_maps: bool = False):
    """Move a fine-tuning delta from base θ_A onto base θ_B: returns a copy of ``to_base`` with
    ``θ_B + α·π(τ)``, π found by data-free TransFusion matching of θ_A onto θ_B.

    Args:
        task_vector: ``{state key: delta}`` with θ_A's shapes (e.g. :func:`task_vector`, a client's update
            or the global model's); keys must be floating-point state entries of ``from_base``.
        from_base, to_base: θ_A and θ_B, the same architecture (widths, heads, depth, head size).
        alpha: task-vector scale (1 in the paper's main tables); 0 returns ``to_base``'s weights.
        residual: ``"untied"`` (per-position stream permutations, the paper's choice) or ``"tied"``.
        method: ``"transfusion"`` or ``"rebasin"`` matching.
        head: ``"delta"`` (the class head moves like any tensor: θ_B.head + α·π(τ.head)) or
            ``"absolute"`` (the head is carried over: π(θ_A.head + τ.head)).
        maps: reuse permutations from an earlier call (``return_maps=True``); one π serves every task
            vector fine-tuned from θ_A.
    Returns:
        The transported model (and the maps when ``return_maps``).
    """
    if not isinstance(task_vector, dict):
        raise ValueError(f"transport: task_vector must be a dict of tensors (see fedfuse.rebase.task_vector), got "
                         f"{type(task_vector).__name__}")
    if not isinstance(alpha, (int, float)) or not math.isfinite(float(alpha)):
        raise ValueError(f"transport: alpha must be a finite number, got {alpha!r}")
    if head not in ("delta", "absolute"):
        raise ValueError(f"transport: head must be 'delta' or 'absolute', got {head!r}")
    sa, sb = from_base.state_dict(), to_base.state_dict()
    for k, v in task_vector.items():
        if k not in sa:
            raise ValueError(f"transport: task-vector key {k!r} is not a parameter of from_base")
        if not sa[k].is_floating_point():
            raise ValueError(f"transport: task-vector key {k!r} is not a floating-point tensor")
        if tuple(v.shape) != tuple(sa[k].shape):
            raise ValueError(f"transport: task-vector entry {k} has shape {tuple(v.shape)}, from_base has "
                             f"{tuple(sa[k].shape)}")
    try:
        if maps is None:
            maps, spec_a, spec_b = match_bases(from_base, to_base, residual=residual, max_iter=max_iter, seed=seed,
                                               method=method)
        else:
            spec_a, spec_b = build_spec(from_base, residual), build_spec(to_base, residual)
            check_compatible(spec_a, spec_b, sa, sb, same_width=True)
    except ValueError as err:
        raise IncompatibleModelsError(f"transport: bases are incompatible: {err}") from None
    moved = permute_task_vector(task_vector, maps, spec_a, spec_b, sb)
    new_state = {k: v.clone() for k, v in sb.items()}
    for k, d in moved.items():
        new_state[k] = (sb[k].double() + float(alpha) * d.double()).to(sb[k].dtype)
    if head == "absolute":
        ft_head = {k: sa[k] + task_vector.get(k, torch.zeros_like(sa[k])) for k in spec_a.classifier}
        full = {k: v for k, v in sa.items()}
        full.update(ft_head)
        moved_full = apply_maps(full, spec_a, spec_b, maps, sb)
        for k in spec_a.classifier:
            new_state[k] = moved_full[k].to(sb[k].dtype)
    out = copy.deepcopy(to_base)
    out.load_state_dict(new_state)
    return (out, maps) if return_maps else out
