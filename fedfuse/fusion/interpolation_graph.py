"""Closed-form neuron interpolation on any graph: ``hf-linear`` / ``kf-linear`` beyond chains of levels.

Paper: "Model Fusion via Neuron Interpolation" (arXiv 2507.00037), Algorithm 1 with linear level fits. Its levels
are a chain ``f = f^L ∘ … ∘ f^1``; a residual stream, a concatenation or a squeeze-excitation gate breaks the chain,
so ``fedfuse.fusion.interpolation`` refuses such models for its linear variants. This module keeps the paper's
two steps and reads them off the model's permutation groups (``fedfuse.models.adapters``, the generic reader
included) instead of off a chain:

1. **Grouping, per permutation group** (every axis one hidden unit touches, a whole residual stream at once), on
   the units' activations over the fusion set: HF matches model 1's units to model 0's (Hungarian on their
   correlation); KF clusters the units of every model by importance-weighted k-means (Lloyd, seeded with model
   0's units, so ``k`` = model 0's width). Block-structured groups (attention heads, GroupNorm groups) are matched
   block-preservingly as HF does. The models are moved into the fused units and averaged, per unit weighted by
   importance and by which models have a unit in the cluster.
2. **Least squares, per affine layer, in forward order** (Linear / Conv with ``groups=1``, the BatchNorm directly on
   its output folded in, as the chain variant does): inputs are the *fused* model's own inputs to the layer (its
   earlier layers already refitted), targets the importance-weighted mean of the parents' own outputs of that layer
   moved into the fused units (the classifier: the averaged raw logits). The ridge pulls towards the aligned
   average, so a layer whose inputs do not determine it keeps it. Other BatchNorms are re-estimated on the fusion
   set in their turn; layers without a closed form (depthwise / grouped convs, norms) keep the aligned average.

Fixed points: ``[m, m]`` and ``[m, P(m)]`` (``P`` a permutation of the groups) give ``m`` back when the fusion set
is the one ``m``'s BatchNorm statistics came from.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.design import design_matrix
from fedfuse.fusion.grouping import weighted_kmeans
from fedfuse.fusion.permute import (load_state, AlignedAverage, Map, apply_maps, build_spec, check_compatible,
                                    collect_activations, reset_bn_stats, standardize, state_on)
from fedfuse.fusion.rebasin import activation_matching, unit_weights_for
from fedfuse.fusion.registry import FusionOptionError, IncompatibleModelsError, MissingInputError
from fedfuse.models.adapters.base import BATCHNORMS
from fedfuse.models.adapters.graph import closed_form

_UNSUPPORTED = ("fused_width", "head_weights", "class_counts", "head_scores")


class _Stop(Exception):
    """Ends a forward pass once the hooked layer has been seen."""


def _check_options(opts, target) -> None:
    if target is not None:
        raise IncompatibleModelsError("linear neuron interpolation on a graph (residual / concatenating model) fuses "
                                      "into model 0's architecture; target= needs a chain model")
    defaults = type(opts)()
    bad = [f for f in _UNSUPPORTED if getattr(opts, f, None) != getattr(defaults, f, None)]
    if getattr(opts, "head_target", "logits") != "logits":
        bad.append("head_target")
    if getattr(opts, "match", "auto") not in ("auto", "identity"):
        bad.append("match")
    if bad:
        raise FusionOptionError(f"linear neuron interpolation on a graph model does not take option(s) {bad} (they "
                                "describe chain levels); leave them at their defaults")


def _group_maps(grouping, acts, specs, weights_units, opts, seed) -> list[dict[str, Map]]:
    """Per model, ``{group: Map}`` into the fused units (model 0's units for HF; model 0-seeded clusters for KF)."""
    n = len(acts)
    if getattr(opts, "match", "auto") == "identity":
        return [{g: Map.identity(grp.size) for g, grp in specs[0].groups.items()} for _ in range(n)]
    if grouping == "hf":
        return [{g: Map.identity(grp.size) for g, grp in specs[0].groups.items()}] + \
            [activation_matching(acts[k], acts[0], specs[k], specs[0]) for k in range(1, n)]
    maps: list[dict[str, Map]] = [{} for _ in range(n)]
    for g, grp in specs[0].groups.items():
        if grp.blocks > 1:   # heads / norm groups: block-preserving matching onto model 0
            maps[0][g] = Map.identity(grp.size)
            for k in range(1, n):
                maps[k][g] = activation_matching({g: acts[k][g]}, {g: acts[0][g]}, _only(specs[k], g),
                                                 _only(specs[0], g))[g]
            continue
        pts = torch.cat([standardize(acts[k][g].double()).t() for k in range(n)])   # [n·m, S]
        w = torch.cat([weights_units[k][g] for k in range(n)]).to(pts)
        res = weighted_kmeans(pts, w, grp.size, init=torch.arange(grp.size), seed=seed)
        labels = res.labels.cpu()
        for k in range(n):
            part = labels[k * grp.size:(k + 1) * grp.size]
            plan = torch.zeros(grp.size, grp.size, dtype=torch.float64)
            plan[torch.arange(grp.size), part] = 1.0
            maps[k][g] = Map.from_plan(plan)
    return maps


def _only(spec, g):
    out = copy.copy(spec)
    out.groups = {g: spec.groups[g]}
    return out


def _fold_pairs(model: nn.Module, x: torch.Tensor) -> dict[str, str]:
    """Affine layer → the BatchNorm that takes its output directly (one probe forward, tensor identity)."""
    outs: dict[int, str] = {}
    pairs: dict[str, str] = {}
    hs = []
    alive: list[torch.Tensor] = []   # held, so that no freed tensor's id is reused during the pass

    def produced(_m, _i, o, name):
        alive.append(o)
        outs.setdefault(id(o), name)

    def consumed(_m, i, name):
        if id(i[0]) in outs:
            pairs.setdefault(outs[id(i[0])], name)

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            hs.append(m.register_forward_hook(lambda _m, _i, o, name=name: produced(_m, _i, o, name)))
        elif type(m) in BATCHNORMS:
            hs.append(m.register_forward_pre_hook(lambda _m, i, name=name: consumed(_m, i, name)))
    try:
        with torch.no_grad():
            model(x[:2])
    finally:
        for h in hs:
            h.remove()
    return pairs


def _forward_order(model: nn.Module, x: torch.Tensor) -> tuple[list[str], set[str]]:
    """Module paths of the affine layers and BatchNorms in the order a forward pass first calls them, and the
    ones called more than once (shared: never refitted)."""
    order: list[str] = []
    seen: dict[str, int] = {}
    hs = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) or type(m) in BATCHNORMS:
            def hook(_m, _i, _o, name=name):
                seen[name] = seen.get(name, 0) + 1
                if seen[name] == 1:
                    order.append(name)
            hs.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x[:2])
    finally:
        for h in hs:
            h.remove()
    return order, {k for k, v in seen.items() if v > 1}


def _capture(model: nn.Module, path: str, x: torch.Tensor, want: str):
    """``want="in"``: the first input of module ``path``; ``"out"``: its output (the pass stops there)."""
    mod = model.get_submodule(path)
    box: list[torch.Tensor] = []

    def grab(_m, i, o=None):
        box.append(i[0] if want == "in" else o)
        raise _Stop

    h = mod.register_forward_pre_hook(grab) if want == "in" else mod.register_forward_hook(grab)
    try:
        with torch.no_grad():
            model(x)
    except _Stop:
        pass
    finally:
        h.remove()
    return box[0]


def _rows(t: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if isinstance(layer, nn.Linear) else t.movedim(1, -1).reshape(-1, t.shape[1])


def _folded(layer: nn.Module, norm: nn.Module | None) -> torch.Tensor:
    """``[cols, out]`` weights (bias last) of ``norm(layer(·))`` in eval mode."""
    w = layer.weight.detach().double().reshape(layer.weight.shape[0], -1)
    b = layer.bias.detach().double() if layer.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype,
                                                                                 device=w.device)
    if norm is not None:
        scale = (norm.weight.detach().double() if norm.weight is not None else torch.ones_like(b)) / \
            (norm.running_var.double() + norm.eps).sqrt()
        shift = norm.bias.detach().double() if norm.bias is not None else torch.zeros_like(b)
        w, b = w * scale[:, None], scale * (b - norm.running_mean.double()) + shift
    return torch.cat([w, b[:, None]], 1).t()


@torch.no_grad()
def _write(layer: nn.Module, norm: nn.Module | None, coef: torch.Tensor) -> None:
    w, b = coef[:-1].t(), coef[-1]
    layer.weight.copy_(w.reshape(layer.weight.shape).to(layer.weight.dtype))
    if norm is None:
        layer.bias.copy_(b.to(layer.bias.dtype))
        return
    if layer.bias is not None:
        layer.bias.copy_(b.to(layer.bias.dtype))
        b = torch.zeros_like(b)
    norm.running_mean.zero_()
    norm.running_var.fill_(1.0 - norm.eps)
    norm.weight.fill_(1.0)
    norm.bias.copy_(b.to(norm.bias.dtype))


@torch.no_grad()
def _reestimate(model: nn.Module, path: str, x: torch.Tensor, chunk: int) -> None:
    bn = model.get_submodule(path)
    bn.reset_running_stats()
    mom = bn.momentum
    bn.momentum = None
    bn.train()
    try:
        for s in range(0, len(x), chunk):
            if len(x[s:s + chunk]) > 1:
                _capture(model, path, x[s:s + chunk], "out")
    finally:
        bn.momentum = mom
        bn.eval()


CACHE_BYTES = 1 << 30   # the parents' targets of every layer kept between the fits up to this size (float64)


def _mean_target(outs: list[torch.Tensor], layer: nn.Module, group: str | None, maps, unit_w, weights) -> torch.Tensor:
    """The importance-weighted mean of the parents' outputs of one layer, each moved into the fused units:
    ``[rows, units]`` float64 (the classifier's: the weighted mean of the logits)."""
    num = den = None
    for k, out in enumerate(outs):
        t = _rows(out, layer).double()
        if group is not None:
            m = maps[k][group]
            t = t.index_select(1, m.perm.to(t.device)) if m.perm is not None else t @ m.out_map().to(t)
            u = (weights[k] * unit_w[k][group]).to(t)
        else:
            u = torch.full((t.shape[1],), float(weights[k]), dtype=t.dtype, device=t.device)
        num = t * u if num is None else num + t * u
        den = u.clone() if den is None else den + u
    return num / den.clamp_min(1e-300)


@torch.no_grad()
def _cached_targets(parents, fits, maps, unit_w, weights, x, chunk, budget: int):
    """Every fitted layer's mean target per chunk, from one forward pass of each parent per chunk (the parents never
    change); ``None`` when they would take more than ``budget`` bytes (the fits then rerun the parents per layer)."""
    if not fits:
        return {}
    sizes: dict[str, int] = {}
    hs = [parents[0].get_submodule(site).register_forward_hook(
        lambda _m, _i, o, path=path: sizes.__setitem__(path, o[:1].numel()))
        for _, path, site, _, _ in fits]
    try:
        parents[0](x[:1])
    finally:
        for h in hs:
            h.remove()
    if sum(sizes.values()) * len(x) * 8 > budget:
        return None
    cache: dict[str, list[torch.Tensor]] = {f[1]: [] for f in fits}
    for s in range(0, len(x), chunk):
        xb = x[s:s + chunk]
        outs: dict[str, list[torch.Tensor]] = {f[1]: [] for f in fits}
        for p in parents:
            # a copy: an in-place activation after the module (ReLU6(inplace=True)) would overwrite its output
            hs = [p.get_submodule(site).register_forward_hook(
                lambda _m, _i, o, path=path: outs[path].append(o.detach().clone()))
                  for _, path, site, _, _ in fits]
            try:
                p(xb)
            finally:
                for h in hs:
                    h.remove()
        for _, path, site, group, _ in fits:
            cache[path].append(_mean_target(outs[path], parents[0].get_submodule(path), group, maps, unit_w,
                                            weights))
    return cache


def graph_interpolation(models: list[nn.Module], *, grouping: str, fusion_inputs, scores, weights, device, seed,
                        opts, info: dict, target=None) -> nn.Module:
    """Linear neuron interpolation of ``models`` (any architecture with a permutation spec) into model 0's.

    Args:
        grouping: ``"hf"`` (two models, Hungarian) | ``"kf"`` (any number, k-means).
        fusion_inputs: ``[B, *input_shape]`` the unlabeled fusion set (required).
        scores: per model ``{level name: [width]}`` importance, or ``None`` (uniform).
        opts: the method's ``InterpolationOptions`` (``ridge``, ``head_ridge``, ``chunk_size``, ``match``).
    Returns the fused model (CPU, eval mode); ``info["graph"]``: refitted layers, folded and re-estimated norms,
    layers kept at the aligned average and why.
    """
    _check_options(opts, target)
    if fusion_inputs is None:
        raise MissingInputError(f"{grouping}-linear needs fusion_inputs (the unlabeled fusion set)")
    t0 = time.perf_counter()
    # float64 throughout: the fits solve for weights from forward passes, where float32 round-off would be
    # amplified by the conditioning of each layer's inputs
    dtype = next((q.dtype for q in models[0].parameters()), torch.float32)
    x = torch.as_tensor(fusion_inputs).to(device, torch.float64)
    parents = [copy.deepcopy(m).to(device, torch.float64).eval() for m in models]
    specs, maps, unit_w, fused = _aligned_average(parents, grouping, x, scores, weights, device, seed, opts)
    chunk = int(getattr(opts, "chunk_size", 512) or 512)
    if any(type(m) in BATCHNORMS or isinstance(m, nn.modules.batchnorm._BatchNorm) for m in fused.modules()):
        reset_bn_stats(fused, x, device=device)
    steps, report, classifier = _refit_plan(fused, specs[0], x)
    fits = [st for st in steps if st[0] == "fit"]
    cache = _cached_targets(parents, fits, maps, unit_w, weights, x, chunk, budget=CACHE_BYTES)
    report["targets_cached"] = cache is not None
    for st in steps:
        if st[0] == "bn":
            _reestimate(fused, st[1], x, chunk)
            report["reestimated"].append(st[1])
            continue
        _refit(fused, st, parents, x, chunk, cache, maps, unit_w, weights, opts, head=st[1] == classifier)
        report["refit"].append(st[1])
        if st[4]:
            report["folded"].append(st[4])
    info["graph"] = report
    info["grouping"] = grouping
    info["seconds"] = time.perf_counter() - t0
    fused = fused.to(dtype)
    for q in fused.parameters():
        q.requires_grad_(True)
    return fused.cpu().eval()


def _aligned_average(parents: list[nn.Module], grouping: str, x: torch.Tensor, scores, weights, device, seed, opts):
    """``(specs, maps, unit weights, fused)``: every parent's units grouped onto model 0's (``grouping``) and the
    importance-weighted aligned average loaded into a copy of model 0 (the start every layer is refitted from)."""
    specs = [build_spec(p) for p in parents]
    states = [state_on(p, device) for p in parents]
    for k in range(1, len(parents)):
        try:
            check_compatible(specs[k], specs[0], states[k], states[0], same_width=True)
        except ValueError as err:
            raise IncompatibleModelsError(f"{grouping}-linear on a graph model: model {k} cannot be grouped with model "
                                          f"0: {err}") from None
    acts = [collect_activations(p, s, x, seed=seed, device=device) for p, s in zip(parents, specs)]
    ident = [{g: Map.identity(grp.size) for g, grp in s.groups.items()} for s in specs]
    own_units = [unit_weights_for(scores[k] if scores is not None else None, specs[k], ident[k])
                 for k in range(len(parents))]
    maps = _group_maps(grouping, acts, specs, own_units, opts, seed)
    avg = AlignedAverage(specs[0], per_unit=True)
    unit_w: list[dict[str, torch.Tensor]] = []
    for k, p in enumerate(parents):
        u = unit_weights_for(scores[k] if scores is not None else None, specs[k], maps[k])
        u = {g: v * (maps[k][g].plan.sum(0) > 0).to(v) for g, v in u.items()}   # clusters without a unit of k
        unit_w.append(u)
        avg.add(apply_maps(states[k], specs[k], specs[0], maps[k], states[0]), weights[k], u)
    fused = copy.deepcopy(parents[0])
    load_state(fused, avg.result())
    fused.eval()
    return specs, maps, unit_w, fused


def _refit_plan(fused: nn.Module, spec0, x: torch.Tensor) -> tuple[list[tuple], dict, str | None]:
    """``(steps, report, classifier path)``: in forward order, ``("bn", path)`` (a norm re-estimated) or ``("fit",
    path, site, group, norm path)`` (a layer refitted in closed form, its BN folded into it), and in ``report["kept"]``
    each layer kept at the aligned average with why."""
    order, shared = _forward_order(fused, x)
    pairs = _fold_pairs(fused, x)
    folded = set(pairs.values())
    out_group = {}
    for name, e in spec0.entries.items():
        name = name.split("@")[0]   # a part of a tensor a concatenation splits (its input axis): same outputs
        for ax in e.axes:
            if ax.role == "out" and ax.axis == 0 and e.view is None and name.endswith(".weight"):
                out_group[name[:-len(".weight")]] = ax.group
    classifier = spec0.classifier[0][:-len(".weight")] if spec0.classifier else None
    report: dict[str, Any] = {"refit": [], "folded": [], "reestimated": [], "kept": {}}
    steps: list[tuple] = []   # in forward order: ("bn", path) | ("fit", path, site, group, norm path)
    for path in order:
        mod = fused.get_submodule(path)
        if type(mod) in BATCHNORMS:
            if path not in folded:
                steps.append(("bn", path))
            continue
        group = out_group.get(path)
        why = ("called more than once" if path in shared else None) or \
            (None if closed_form(mod) else "no closed form (grouped/depthwise conv or padding mode)") or \
            (None if group is not None or path == classifier else "its outputs are in no permutation group")
        norm_path = pairs.get(path)
        norm = fused.get_submodule(norm_path) if norm_path else None
        if norm is not None and (norm.weight is None or norm.bias is None):
            norm_path = None   # a BN without affine parameters cannot hold the folded shift
        if why is None and norm_path is None and mod.bias is None:
            why = "no bias to hold the fitted shift"
        if why is not None:
            report["kept"][path] = why
            if norm_path is not None and norm_path in folded:
                steps.append(("bn", norm_path))   # its BN is then re-estimated like any other
            continue
        steps.append(("fit", path, norm_path or path, group, norm_path))
    return steps, report, classifier


def _refit(fused: nn.Module, step: tuple, parents: list[nn.Module], x: torch.Tensor, chunk: int, cache, maps, unit_w,
           weights, opts, head: bool) -> None:
    """Refit one layer of ``fused`` (a ``("fit", ...)`` step) in closed form: the ridge regression, on the fusion set,
    of the parents' mean aligned outputs at its site on its inputs in ``fused``, towards its current (folded) weights;
    ``head_ridge`` for the classifier."""
    _, path, site, group, norm_path = step
    mod = fused.get_submodule(path)
    norm = fused.get_submodule(norm_path) if norm_path else None
    xtx = xty = None
    for c, s in enumerate(range(0, len(x), chunk)):
        xb = x[s:s + chunk]
        d = design_matrix(mod, _capture(fused, path, xb, "in"), True).double()
        tb = cache[path][c] if cache is not None else _mean_target(
            [_capture(p, site, xb, "out") for p in parents], mod, group, maps, unit_w, weights)
        xtx = d.t() @ d if xtx is None else xtx + d.t() @ d
        xty = d.t() @ tb if xty is None else xty + d.t() @ tb
    ridge = getattr(opts, "head_ridge", None) if head else None
    ridge = getattr(opts, "ridge", 1e-3) if ridge is None else ridge
    lam = max(float(ridge), 1e-12) * float(torch.diagonal(xtx).mean().clamp_min(1e-12))
    prior = _folded(mod, norm).to(xtx)
    coef = torch.linalg.solve(xtx + lam * torch.eye(len(xtx), dtype=xtx.dtype, device=xtx.device), xty + lam * prior)
    _write(mod, norm, coef)


__all__ = ["graph_interpolation"]
