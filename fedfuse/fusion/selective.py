"""Selective (conditional) OT fusion: importance-conditioned transport, heads as units, depth matching.

The idea (conditional OT aligns only the informative components — crucial heads, key normalisation
parameters — and bypasses the rest, so heterogeneous ViTs of different sizes can be fused) comes from a
paper abstract without public code; this is fedfuse's own design of it, written on fedfuse's OT machinery (``fedfuse.fusion.permute``: permutation specs from the
adapters, activation collection, maps; POT for the unbalanced / partial solvers). It is ``ot``'s
``selective=True`` mode (``fuse("ot", models, fusion_inputs=X, selective=True)``); ``ot`` also routes
models of different depths here (vanilla transport with block matching).

For each model ``A`` ≠ the anchor ``B`` (``models[anchor]``, whose architecture the fused model takes):

1. **Depth matching** (when depths differ; families with interchangeable blocks, i.e. ViTs): linear CKA
   between every block output of A and of B on the fusion set (tokens as samples), then the
   order-preserving matching of ``min(L_A, L_B)`` block pairs with the largest total CKA (dynamic
   programming). A deeper A contributes only its matched blocks (the others are bypassed); B's blocks
   without a partner stay the anchor's. ``adapter.with_blocks`` gives A's depth-matched view (sharing A's
   modules, so hooks on it see A's own forward pass).
2. **Importance** per unit of every permutation group (residual-stream channels, i.e. LayerNorm channels
   and embeddings; the Q/K/V dims of each attention block; MLP hidden units): the clients' scores where
   they cover a group (``importance="auto"``), else a Taylor score on the unlabeled fusion set,
   ``mean |a · ∂KL(ensemble ‖ model)/∂a|`` over (sample, token) rows (the parents' averaged softmax is the
   target; no labels), falling back to the mean activation magnitude where the gradient vanishes (a model
   that *is* the ensemble). ``"activation"`` and ``"uniform"`` select those directly.
3. **Conditional transport.** Units below ``min_importance`` × the group's mean importance get no mass
   (they stay unmatched); the others get mass ∝ importance. The plan is then ``transport="balanced"``
   (exact OT / Sinkhorn between the importance marginals), ``"partial"`` (POT ``ot.partial``: only the
   cheapest ``mass`` fraction moves, so weakly matching, low-mass units stay unmatched) or ``"unbalanced"``
   (POT ``ot.unbalanced.mm_unbalanced`` / ``sinkhorn_unbalanced`` with marginal penalty ``reg_m``).
   **Heads are units**: attention groups first get a head-level plan (the same transport over heads,
   with head importance = the sum of its units' and head cost = the exact within-head transport cost),
   then an exact within-head plan for every matched head pair; head counts may differ.
4. **Fusion.** A's weights are moved into B's units by the plans (``apply_maps``: column-normalised
   outputs, row-normalised inputs, so unmatched A units are dropped). Every element of every tensor is
   then ``(w_B·B + Σ_A w_A·r_A·Ã) / (w_B + Σ_A w_A·r_A)`` where ``r_A`` is the product, over the tensor's
   grouped axes, of the fraction of each B unit's importance mass that A matched (1 = fully matched,
   0 = unmatched): **unmatched components are the anchor's**. With every importance equal and balanced
   transport every plan is ``ot``'s and every ``r = 1``: selective OT reduces to ordinary OT.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.permute import (load_state, Map, activation_cost, apply_maps, assignment, block_paths, build_spec,
                                    exact_block_costs, ot_plan, solve_group, standardize, state_on)
from fedfuse.fusion.permute.activations import _rows, _subsample
from fedfuse.fusion.permute.features import marginal_from_scores
from fedfuse.fusion.permute.spec import Group, PermSpec
from fedfuse.fusion.registry import FusionOptionError, IncompatibleModelsError, NumericalFusionError
from fedfuse.models.adapters import UnsupportedModelError, adapter_for


# ------------------------------------------------------------------------------------------- hooks
def _modules_by_path(model: nn.Module) -> dict[str, nn.Module]:
    return dict(model.named_modules(remove_duplicate=False))


def _hook_points(path_model: nn.Module, spec: PermSpec, store: dict, keep_grad: bool) -> list:
    """Register hooks for every act point of ``spec`` on ``path_model``'s modules (which may be shared
    with the model that actually runs); outputs / inputs go to ``store[point]``."""
    mods = _modules_by_path(path_model)
    handles = []
    for pt in {pt for g in spec.groups.values() for pt in g.acts}:
        path, where, _ = pt
        if path not in mods:
            raise IncompatibleModelsError(f"selective ot: module {path!r} not found")
        store[pt] = []

        def keep(t: torch.Tensor, pt=pt) -> None:
            if keep_grad and t.requires_grad:
                t.retain_grad()
            store[pt].append(t)

        if where == "out":
            handles.append(mods[path].register_forward_hook(lambda _m, _i, o, keep=keep: keep(o)))
        else:
            handles.append(mods[path].register_forward_pre_hook(lambda _m, i, keep=keep: keep(i[0])))
    return handles


@torch.no_grad()
def activations(run_model: nn.Module, path_model: nn.Module, spec: PermSpec, x: torch.Tensor, *,
                max_rows: int, seed: int, device, batch_size: int = 256) -> dict[str, torch.Tensor]:
    """``{group: [S, size]}`` like ``permute.collect_activations``, with hooks placed by ``path_model``'s
    paths while ``run_model`` runs (a depth-matched view's groups read its source model's blocks)."""
    store: dict = {}
    handles = _hook_points(path_model, spec, store, keep_grad=False)
    try:
        for s in range(0, len(x), batch_size):
            run_model(x[s:s + batch_size].to(device))
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, g in spec.groups.items():
        parts = []
        for pt in g.acts:
            rows = torch.cat([_rows(t, pt[2]).float() for t in store[pt]])
            if len(rows) > max_rows:
                rows = rows[_subsample(len(rows), max_rows, seed).to(rows.device)]
            parts.append(rows)
        out[name] = torch.cat(parts) if parts else torch.empty(0, g.size)
    return out


def taylor_importance(run_model: nn.Module, path_model: nn.Module, spec: PermSpec, x: torch.Tensor,
                      target: torch.Tensor, *, device, batch_size: int = 128) -> tuple[dict, dict]:
    """Per-unit ``(taylor, activation)`` importance ``{group: [size]}`` on the fusion set.

    taylor: ``mean |a · ∂L/∂a|`` with ``L = KL(target ‖ softmax(model(x)))`` summed over samples (``target``
    ``[N, C]`` the ensemble's probabilities); activation: ``mean |a|``. Rows = (sample, token) pairs.
    """
    store: dict = {}
    run_model = run_model.to(device).eval()
    handles = _hook_points(path_model, spec, store, keep_grad=True)
    sums_t = {pt: 0.0 for pt in store}
    sums_a = {pt: 0.0 for pt in store}
    rows_n = {pt: 0 for pt in store}
    try:
        with torch.enable_grad():
            for s in range(0, len(x), batch_size):
                for pt in store:
                    store[pt].clear()
                xb = x[s:s + batch_size].to(device)
                logp = F.log_softmax(run_model(xb), -1)
                tb = target[s:s + batch_size].to(device)
                loss = F.kl_div(logp, tb, reduction="sum")
                tensors = [t for pt in store for t in store[pt] if t.requires_grad]
                grads = torch.autograd.grad(loss, tensors, allow_unused=True) if tensors else []
                gmap = {id(t): g for t, g in zip(tensors, grads)}
                for pt, ts in store.items():
                    for t in ts:
                        g = gmap.get(id(t))
                        a = t.detach()
                        g = torch.zeros_like(a) if g is None else g.detach()
                        rt = _rows((a * g).abs(), pt[2]).double()
                        ra = _rows(a.abs(), pt[2]).double()
                        sums_t[pt] = sums_t[pt] + rt.sum(0)
                        sums_a[pt] = sums_a[pt] + ra.sum(0)
                        rows_n[pt] += rt.shape[0]
    finally:
        for h in handles:
            h.remove()
    tay, act = {}, {}
    for name, g in spec.groups.items():
        pts = [pt for pt in g.acts if rows_n[pt]]
        if not pts:
            tay[name] = act[name] = torch.ones(g.size, dtype=torch.float64)
            continue
        tay[name] = sum(sums_t[pt] / rows_n[pt] for pt in pts).cpu() / len(pts)
        act[name] = sum(sums_a[pt] / rows_n[pt] for pt in pts).cpu() / len(pts)
    return tay, act


# ------------------------------------------------------------------------------------ depth matching
def _block_outputs(model: nn.Module, paths: list[str], x: torch.Tensor, device, max_rows: int, seed: int) -> list:
    mods = _modules_by_path(model)
    store: dict[str, list] = {p: [] for p in paths}
    hs = [mods[p].register_forward_hook(lambda _m, _i, o, p=p: store[p].append(o.detach().float())) for p in paths]
    try:
        with torch.no_grad():
            model.to(device).eval()
            for s in range(0, len(x), 256):
                model(x[s:s + 256].to(device))
    finally:
        for h in hs:
            h.remove()
    out = []
    for p in paths:
        h = torch.cat(store[p])
        h = h.reshape(-1, h.shape[-1])
        if len(h) > max_rows:
            h = h[_subsample(len(h), max_rows, seed).to(h.device)]
        out.append(h.double())
    return out


def linear_cka(a: torch.Tensor, b: torch.Tensor) -> float:
    """Linear CKA (Kornblith et al., ICML 2019) of features ``a [S, p]`` and ``b [S, q]``."""
    a = a - a.mean(0, keepdim=True)
    b = b - b.mean(0, keepdim=True)
    num = (a.t() @ b).pow(2).sum()
    den = (a.t() @ a).pow(2).sum().sqrt() * (b.t() @ b).pow(2).sum().sqrt()
    return float(num / den.clamp_min(1e-300))


def monotone_match(sim: np.ndarray) -> list[tuple[int, int]]:
    """Order-preserving matching of ``min(L_A, L_B)`` pairs ``(i, j)`` maximising ``Σ sim[i, j]``
    (``sim [L_A, L_B]``; both indices strictly increasing)."""
    la, lb = sim.shape
    neg = -1e18
    # dp[i][j][n] is too big in general; with k = min(la, lb) one side is matched completely, so a
    # 2-D DP over (i, j) with "every row of the shorter side used" is enough
    if la <= lb:  # every A block matched
        dp = np.full((la + 1, lb + 1), neg)
        dp[0, :] = 0.0
        for i in range(1, la + 1):
            for j in range(i, lb + 1):
                dp[i, j] = max(dp[i, j - 1], dp[i - 1, j - 1] + sim[i - 1, j - 1])
        pairs, i, j = [], la, lb
        while i > 0:
            if j > i and dp[i, j] == dp[i, j - 1]:
                j -= 1
            else:
                pairs.append((i - 1, j - 1))
                i, j = i - 1, j - 1
        return pairs[::-1]
    return [(i, j) for j, i in monotone_match(sim.T)]


def match_depth(model_a: nn.Module, model_b: nn.Module, x: torch.Tensor, *, device, max_rows: int,
                seed: int) -> tuple[list[int | None], np.ndarray]:
    """For each block of B, the matched block of A (``None`` = unmatched) and the CKA matrix ``[L_A, L_B]``."""
    pa, pb = block_paths(model_a), block_paths(model_b)
    if len(pa) == len(pb):
        return list(range(len(pb))), np.eye(len(pb))
    if not pa or not pb:
        raise IncompatibleModelsError("ot: models of different depths can only be block-matched in families with "
                                      "interchangeable blocks (ViTs)")
    if x is None:
        raise IncompatibleModelsError("ot: models of different depths are block-matched on the fusion set; "
                                      "give fusion_inputs")
    ha = _block_outputs(model_a, pa, x, device, max_rows, seed)
    hb = _block_outputs(model_b, pb, x, device, max_rows, seed)
    sim = np.array([[linear_cka(u, v) for v in hb] for u in ha])
    match: list[int | None] = [None] * len(pb)
    for i, j in monotone_match(sim):
        match[j] = i
    return match, sim


def depth_view(model_a: nn.Module, match: list[int | None]) -> tuple[nn.Module, list[int]]:
    """A's view with B's depth (blocks ``match``; an unmatched B block borrows A's nearest matched block as a
    placeholder that fusion gives weight 0) and the list of unmatched B block positions."""
    if all(m == i for i, m in enumerate(match)) and len(match) == len(block_paths(model_a)):
        return model_a, []
    matched = [i for i, m in enumerate(match) if m is not None]
    idx, missing = [], []
    for j, m in enumerate(match):
        if m is None:
            near = min(matched, key=lambda k: (abs(k - j), k))
            idx.append(match[near])
            missing.append(j)
        else:
            idx.append(m)
    return adapter_for(model_a).with_blocks(model_a, idx), missing


# ------------------------------------------------------------------------------------ transport
def _uniform(v: torch.Tensor | None) -> bool:
    return v is None or bool(torch.allclose(v, v.mean().expand_as(v), rtol=1e-9, atol=1e-12))


def conditional_marginal(imp: torch.Tensor, min_importance: float) -> torch.Tensor:
    """Mass ∝ importance; units below ``min_importance`` × mean get none. Sums to 1 (uniform when every
    importance vanishes)."""
    v = imp.detach().double().cpu().clamp_min(0)
    if float(v.sum()) <= 0 or not torch.isfinite(v).all():
        v = torch.ones_like(v)
    v = torch.where(v < min_importance * v.mean(), torch.zeros_like(v), v)
    if float(v.sum()) <= 0:
        v = torch.ones_like(v)
    return v / v.sum()


def transport(cost: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, transport: str, solver: str, reg: float,
              mass: float, reg_m: float) -> torch.Tensor:
    """Plan ``[m_A, m_B]`` between marginals ``a``, ``b`` (each summing to 1, zeros allowed) on the
    max-normalised ``cost``."""
    import ot as pot

    c = cost.detach().double().cpu().numpy()
    if not np.isfinite(c).all():
        raise NumericalFusionError("selective ot: ground cost has NaN/inf entries")
    if c.max() > 0:
        c = c / c.max()
    ia, ib = np.flatnonzero(a.numpy() > 0), np.flatnonzero(b.numpy() > 0)
    sa, sb = a.numpy()[ia], b.numpy()[ib]
    sa, sb = sa / sa.sum(), sb / sb.sum()
    sub = np.ascontiguousarray(c[np.ix_(ia, ib)])
    if transport == "partial" and mass >= 1.0:
        transport = "balanced"
    if transport == "balanced":
        if solver == "sinkhorn":
            p = ot_plan(torch.from_numpy(sub), torch.from_numpy(sa), torch.from_numpy(sb), solver="sinkhorn", reg=reg,
                        normalize=False).numpy()
        else:
            p = pot.emd(sa, sb, sub, numItermax=1_000_000)
    elif transport == "partial":
        m = float(mass) * min(sa.sum(), sb.sum())
        if solver == "sinkhorn":
            p = pot.partial.entropic_partial_wasserstein(sa, sb, sub, reg=reg, m=m)
        else:
            p = pot.partial.partial_wasserstein(sa, sb, sub, m=m)
    elif transport == "unbalanced":
        if solver == "sinkhorn":
            p = pot.unbalanced.sinkhorn_unbalanced(sa, sb, sub, reg=reg, reg_m=reg_m)
        else:
            p = pot.unbalanced.mm_unbalanced(sa, sb, sub, reg_m=reg_m)
    else:
        raise FusionOptionError(f"ot: unknown transport {transport!r}")
    p = np.nan_to_num(np.asarray(p, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0).clip(min=0)
    plan = np.zeros(c.shape)
    plan[np.ix_(ia, ib)] = p * (a.numpy()[ia].sum())  # back to the full marginal scale (sums ≤ 1)
    return torch.as_tensor(plan, dtype=torch.float64)


def selective_plan(cost: torch.Tensor, ga: Group, gb: Group, imp_a: torch.Tensor, imp_b: torch.Tensor, *,
                   opts) -> tuple[Map, torch.Tensor]:
    """The map of one group and, per B unit, the matched fraction ``r`` of its mass (0…1)."""
    ma, mb = cost.shape
    a = conditional_marginal(imp_a, opts.min_importance)
    b = conditional_marginal(imp_b, opts.min_importance)
    balanced = opts.transport == "balanced" or (opts.transport == "partial" and opts.mass >= 1.0)
    heads = ga.blocks > 1 or gb.blocks > 1
    if balanced and _uniform(a) and _uniform(b) and ga.blocks == gb.blocks:
        # every unit equally important and all mass moved: ordinary OT (``ot``'s own solve, same plans)
        m = solve_group(cost, ga, gb, solver=opts.solver, reg=opts.reg, head_preserving=opts.head_preserving)
        return m, torch.ones(mb, dtype=torch.float64)
    if heads and opts.head_preserving:
        ha, hb = ga.blocks, gb.blocks
        if ma % ha or mb % hb:
            raise IncompatibleModelsError(f"{ga.name}: {ma} units in {ha} heads / {mb} units in {hb} heads")
        da, db = ma // ha, mb // hb
        head_a, head_b = a.reshape(ha, da).sum(1), b.reshape(hb, db).sum(1)
        hc = exact_block_costs(cost, ha, hb)
        if balanced and _uniform(head_a) and _uniform(head_b) and ha == hb:
            perm = assignment(hc, maximize=False)
            hp = torch.zeros(ha, hb, dtype=torch.float64)
            hp[perm, torch.arange(hb)] = 1.0 / hb
        else:
            hp = transport(hc, head_a, head_b, transport=opts.transport, solver=opts.solver, reg=opts.reg,
                           mass=opts.mass, reg_m=opts.reg_m)
        plan = torch.zeros(ma, mb, dtype=torch.float64)
        thr = 1e-9 * float(hp.max().clamp_min(1e-300))
        for i, j in zip(*torch.nonzero(hp > thr, as_tuple=True)):
            i, j = int(i), int(j)
            blk = cost[i * da:(i + 1) * da, j * db:(j + 1) * db]
            if opts.solver != "sinkhorn" and da == db:
                p = Map.from_perm(assignment(blk, maximize=False)).plan
            else:
                p = ot_plan(blk, solver=opts.solver, reg=opts.reg)
            plan[i * da:(i + 1) * da, j * db:(j + 1) * db] = p / p.sum().clamp_min(1e-300) * hp[i, j]
        col = plan.sum(0)
        bh = b.reshape(hb, db).sum(1).repeat_interleave(db) / db  # head mass spread evenly over its units
        r = torch.where(bh > 0, col / bh.clamp_min(1e-300), torch.zeros_like(col)).clamp(0, 1)
        return Map.from_plan(plan) if plan.sum() > 0 else Map(plan, None), r
    if heads and ga.blocks != gb.blocks:
        raise IncompatibleModelsError(f"{ga.name}: {ga.blocks} vs {gb.blocks} heads need head_preserving=true")
    plan = transport(cost, a, b, transport=opts.transport, solver=opts.solver, reg=opts.reg, mass=opts.mass,
                     reg_m=opts.reg_m)
    col = plan.sum(0)
    r = torch.where(b > 0, col / b.clamp_min(1e-300), torch.zeros_like(col)).clamp(0, 1)
    return Map(plan, None) if plan.sum() <= 0 else Map.from_plan(plan), r


# ------------------------------------------------------------------------------------------ fusion
def selective_average(anchor: dict[str, torch.Tensor], aligned: list[dict[str, torch.Tensor]], w_anchor: float,
                      weights: list[float], ratios: list[dict[str, torch.Tensor]], spec: PermSpec,
                      frozen: list[list[str]] | None = None) -> dict[str, torch.Tensor]:
    """Per element ``(w_B·B + Σ w_k·R_k·Ã_k) / (w_B + Σ w_k·R_k)``, ``R_k`` the product of the matched
    fractions ``ratios[k][group]`` over the tensor's grouped axes (entries in the anchor's ``spec``);
    tensors whose name starts with a prefix in ``frozen[k]`` get ``R_k = 0`` (blocks A has no match for)."""
    out = {}
    frozen = frozen or [[] for _ in aligned]
    for key, ref in anchor.items():
        if not ref.is_floating_point():
            out[key] = ref.clone()
            continue
        e = spec.entries.get(key)
        shape = list(ref.shape)
        if e is not None and e.view is not None:
            shape = list(e.view)
            for ax in e.axes:
                shape[ax.axis] = spec.groups[ax.group].size
            if e.qkv and len(shape) == 3:
                shape[-1] = -1
        num = w_anchor * ref.double().reshape(shape)
        den = torch.full_like(num, w_anchor)
        for st, w, rt, fz in zip(aligned, weights, ratios, frozen):
            R = torch.ones_like(num)
            if any(key.startswith(p) for p in fz):
                R = torch.zeros_like(num)
            elif e is not None:
                for ax in e.axes:
                    bshape = [1] * R.dim()
                    bshape[ax.axis] = -1
                    R = R * rt[ax.group].to(R.dtype).reshape(bshape)
            num = num + w * R * st[key].double().reshape(shape)
            den = den + w * R
        out[key] = (num / den).reshape(ref.shape).to(ref.dtype)
    return out


def group_importance(name: str, g: Group, scores: dict | None, tay: dict, act: dict, mode: str) -> torch.Tensor:
    """Unit importance of group ``name``: client ``scores`` where they cover it (``mode="auto"``), else
    the Taylor score (or the activation magnitude where the Taylor score vanishes)."""
    if mode == "uniform":
        return torch.ones(g.size, dtype=torch.float64)
    if mode == "auto" and scores is not None:
        m = marginal_from_scores(scores, g, floor=0.0)
        if m is not None:
            return m
    if mode in ("auto", "taylor"):
        t = tay[name]
        if float(t.sum()) > 1e-12 * max(1.0, float(act[name].sum())) and torch.isfinite(t).all():
            return t
    return act[name]


def fuse_selective(models: list[nn.Module], *, fusion_inputs, scores, weights, device, seed, opts,
                   info: dict) -> tuple[nn.Module, bool]:
    """Fuse ``models`` into ``models[opts.anchor]``'s architecture (see the module docstring). With
    ``opts.selective`` False: vanilla OT (uniform marginals, everything matched) with depth matching.
    Returns ``(fused model, whether any aligned state differs from the anchor's)``."""
    o = opts if opts.selective else dataclasses.replace(opts, transport="balanced", min_importance=0.0)
    k0 = o.anchor
    if not 0 <= k0 < len(models):
        raise FusionOptionError(f"ot: option 'anchor' must index one of the {len(models)} models, got {k0}")
    if o.residual != "tied":
        raise FusionOptionError("ot: selective=true and models of different depths need residual='tied'")
    if o.cost == "weights":
        raise FusionOptionError("ot: selective=true and models of different depths need cost='activations'")
    if fusion_inputs is None:
        raise IncompatibleModelsError("ot: selective=true (and fusing different depths) needs fusion_inputs")
    x = fusion_inputs
    ref = models[k0]
    spec_b = build_spec(ref, "tied")
    acts_b = activations(ref, ref, spec_b, x, max_rows=o.max_rows, seed=seed, device=device)
    acts_b = {g: standardize(v) for g, v in acts_b.items()}
    need_imp = o.selective and o.importance != "uniform"
    target = None
    if need_imp:
        with torch.no_grad():
            probs = [torch.cat([m.to(device).eval()(x[s:s + 256].to(device)).softmax(-1).double()
                                for s in range(0, len(x), 256)]) for m in models]
        target = sum(w * p for w, p in zip(weights, probs)).float()
        tay_b, act_b = taylor_importance(ref, ref, spec_b, x, target, device=device)
    state_b = state_on(ref, device)
    aligned, ws, ratios, frozen = [], [], [], []
    info.update(selective=o.selective, anchor=k0, transport=o.transport if o.selective else "balanced",
                block_match=[], matched_fraction=[], trace_ratio=[])
    for k, model in enumerate(models):
        if k == k0:
            continue
        match, sim = match_depth(model, ref, x, device=device, max_rows=o.max_rows, seed=seed)
        try:
            view, missing = depth_view(model, match)
        except UnsupportedModelError as exc:
            raise IncompatibleModelsError(f"ot: model {k}: {exc}") from None
        spec_a = build_spec(view, "tied")
        state_a = state_on(view, device)
        if list(spec_a.groups) != list(spec_b.groups) or list(state_a) != list(state_b):
            raise IncompatibleModelsError(f"ot: model {k} and the anchor (model {k0}) have different layer "
                                          "structure (permutation groups or parameter names differ)")
        acts_a = activations(model, view, spec_a, x, max_rows=o.max_rows, seed=seed, device=device)
        acts_a = {g: standardize(v) for g, v in acts_a.items()}
        if need_imp:
            tay_a, act_a = taylor_importance(model, view, spec_a, x, target, device=device)
        pa, pb = block_paths(model), block_paths(ref)
        renamed = match != list(range(len(pa)))
        sc_a = scores[k] if scores is not None else None
        if sc_a is not None and renamed:  # A's block levels under the names of the B blocks they match
            to_b = {pa[i]: pb[j] for j, i in enumerate(match) if i is not None}
            sc_a = {to_b.get(n, n): v for n, v in sc_a.items() if n in to_b or n not in pa}
        sc_b = scores[k0] if scores is not None else None
        maps: dict[str, Map] = {}
        rk: dict[str, torch.Tensor] = {}
        for g, ga in spec_a.groups.items():
            gb = spec_b.groups[g]
            c = activation_cost(acts_a[g], acts_b[g], std=False)
            if o.selective:
                ia = group_importance(g, ga, sc_a, tay_a if need_imp else {}, act_a if need_imp else {}, o.importance)
                ib = group_importance(g, gb, sc_b, tay_b if need_imp else {}, act_b if need_imp else {}, o.importance)
            else:
                ia = torch.ones(ga.size, dtype=torch.float64)
                ib = torch.ones(gb.size, dtype=torch.float64)
            m, r = selective_plan(c, ga, gb, ia, ib, opts=o)
            maps[g], rk[g] = m, r
        st = apply_maps(state_a, spec_a, spec_b, maps, state_b)
        aligned.append(st)
        ws.append(weights[k])
        ratios.append(rk)
        frozen.append([f"{pb[j]}." for j in missing])
        info["block_match"].append(match)
        info["matched_fraction"].append({g: float(v.mean()) for g, v in rk.items()})
        info["trace_ratio"].append({g: m.trace_ratio() for g, m in maps.items()})
    fused = copy.deepcopy(ref).cpu()
    new_state = selective_average(state_b, aligned, weights[k0], ws, ratios, spec_b, frozen)
    load_state(fused, new_state)
    differs = any(v.is_floating_point() and not torch.allclose(v, state_b[n].to(v.device), rtol=1e-6, atol=1e-7)
                  for n, v in new_state.items())
    return fused, differs
