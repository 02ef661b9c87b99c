"""Capacity tiers of a model the generic reader describes: the same architecture at ``r`` × the width of every
permutation group, made by structured pruning of a freshly initialised copy along the reader's own groups.

HeteroFL ("HeteroFL: Computation and Communication Efficient Federated Learning for Heterogeneous Clients",
arXiv 2010.01264) gives a client of tier ``r`` the first ``⌈r·C⌉`` units of every hidden group, so a tier model is
the top-left slice of the global one (``fedfuse.hetero.submodel``). fedfuse cannot rebuild a user's model at another
width (it does not know the constructor), but it does not need to: Torch-Pruning's ``DependencyGraph`` (Fang et al.,
"DepGraph: Towards Any Structural Pruning", CVPR 2023, arXiv 2301.12900), which the reader already groups units
with, removes units ``⌈r·C⌉ … C−1`` of each group from every layer they touch, so the narrow model has exactly the
groups of the wide one, narrower. Groups the reader left in place (``spec.frozen``: grouped convolutions, fused
attention projections) keep their width.

A forward that hard-codes a width (the quickstart ``Net``'s ``x.view(-1, 16 * 5 * 5)``) cannot run narrower: the
pruned copy is run on the example input and refused with ``UnsupportedModelError`` naming what failed.
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from torch import nn

from fedfuse.models.adapters.base import UnsupportedModelError, check_width_mult


def _reinit(model: nn.Module, seed: int) -> None:
    """A fresh initialisation of every module that can reset itself (seeded), BatchNorm statistics included."""
    torch.manual_seed(seed)
    for m in model.modules():
        if hasattr(m, "reset_parameters") and callable(m.reset_parameters):
            m.reset_parameters()
        if hasattr(m, "reset_running_stats") and callable(m.reset_running_stats):
            m.reset_running_stats()


def narrowed(model: nn.Module, width_mult: float, groups: dict[str, int], classifier: str,
             example: torch.Tensor, seed: int = 0) -> nn.Module:
    """A freshly initialised copy of ``model`` whose permutation groups ``groups`` (name = the path of the module
    Torch-Pruning roots the group at → width) keep their first ``⌈width_mult · width⌉`` units.

    ``example``: one input batch ``[N, *shape]`` (the reader's example). Raises ``UnsupportedModelError`` when the
    narrow copy does not run (a width written into ``forward``) or a group cannot be cut.
    """
    import torch_pruning as tp

    r = check_width_mult(width_mult)
    narrow = copy.deepcopy(model).cpu().eval()
    _reinit(narrow, seed)
    if r == 1:
        return narrow
    names = {m: n for n, m in narrow.named_modules()}
    cls = narrow.get_submodule(classifier)
    x = example.detach().cpu().to(next(narrow.parameters()).dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dg = tp.DependencyGraph().build_dependency(narrow, example_inputs=x)
        plan = []
        for grp in dg.get_all_groups(ignored_layers=[cls]):
            dep = grp.items[0].dep
            name = names.get(dep.target.module)
            if name in groups:
                size = len(grp.items[0].idxs)
                keep = max(1, math.ceil(r * size - 1e-9))
                plan.append((dep.target.module, dep.handler, list(range(keep, size)), name))
        for module, handler, idxs, name in plan:
            if not idxs:
                continue
            try:
                group = dg.get_pruning_group(module, handler, idxs)
                group.prune()
            except Exception as exc:   # Torch-Pruning's own errors: say which group
                raise UnsupportedModelError(f"graph reader: cannot narrow group {name!r} of {type(model).__name__} "
                                            f"({type(exc).__name__}: {str(exc)[:160]})") from None
    try:
        with torch.no_grad():
            out = narrow(x)
    except Exception as exc:
        raise UnsupportedModelError(
            f"graph reader: {type(model).__name__} at width_mult {r} does not run ({type(exc).__name__}: "
            f"{str(exc)[:160]}); its forward likely hard-codes a width (e.g. x.view(-1, C*H*W): write "
            "torch.flatten(x, 1)); capacity tiers need a model whose forward follows its layers' sizes") from None
    if not isinstance(out, torch.Tensor) or out.shape[0] != x.shape[0]:
        raise UnsupportedModelError(
            f"graph reader: {type(model).__name__} at width_mult {r} returns shape "
            f"{tuple(getattr(out, 'shape', ()))} for {x.shape[0]} inputs; its forward likely hard-codes a width "
            "(e.g. x.view(-1, C*H*W): write torch.flatten(x, 1))")
    return narrow
