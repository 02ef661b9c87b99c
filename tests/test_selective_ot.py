"""Selective (importance-conditioned) OT fusion: ``fuse("ot", ..., selective=True)`` (issue 14, seed 000 §1.9).

Fast checks: all-equal importance reduces to ordinary OT (same plans, same weights); ViTs of different
embedding widths, head counts and depths fuse into either parent's architecture and run; copies of a model
fuse back to it; low-importance units stay unmatched (the anchor's values); heads are transported as units.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from fedfuse.fusion import FusionOptionError, IncompatibleModelsError, fuse, fuse_result
from fedfuse.fusion.permute import Group, build_spec
from fedfuse.fusion.selective import conditional_marginal, monotone_match, selective_plan, transport
from fedfuse.fusion.ot import OTOptions
from fedfuse.models import build_model, levels

torch.set_num_threads(1)
SHAPE = (1, 8, 8)


def _vit(width, heads, depth, seed):
    return build_model("vit", num_classes=5, input_shape=SHAPE, width=width, depth=depth, num_heads=heads,
                       seed=seed).eval()


def _x(n=64, seed=0):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


def _gap(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(sa[k].shape == sb[k].shape for k in sa)
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


@pytest.mark.parametrize("arch", ["vit", "mlp"])
def test_all_equal_importance_is_ordinary_ot(arch):
    if arch == "vit":
        a, b = _vit(16, 2, 2, 1), _vit(16, 2, 2, 2)
    else:
        a, b = (build_model("mlp", num_classes=5, input_shape=SHAPE, width=12, depth=2, seed=s).eval() for s in (1, 2))
    x = _x()
    plain = fuse_result("ot", [a, b], fusion_inputs=x)
    sel = fuse_result("ot", [a, b], fusion_inputs=x, selective=True, importance="uniform", transport="balanced")
    assert _gap(plain.model, sel.model) < 1e-6
    assert sel.info["trace_ratio"][0] == pytest.approx(plain.info["trace_ratio"][0], nan_ok=True)
    assert all(v == 1.0 for v in sel.info["matched_fraction"][0].values())
    # equal client scores on every level (MLP: every group is covered by a level) give the same
    if arch == "mlp":
        scores = [{lv.name: torch.ones(lv.width) for lv in levels(m)} for m in (a, b)]
        same = fuse("ot", [a, b], fusion_inputs=x, scores=scores, selective=True, transport="balanced")
        assert _gap(plain.model, same) < 1e-6
        # partial transport with all the mass (mass=1) is balanced transport
        full = fuse("ot", [a, b], fusion_inputs=x, scores=scores, selective=True, transport="partial", mass=1.0)
        assert _gap(plain.model, full) < 1e-6


def test_vits_of_different_widths_heads_and_depths_fuse_into_either_architecture():
    big, small = _vit(32, 4, 3, 1), _vit(16, 2, 2, 2)
    x = _x(48)
    for selective in (False, True):
        for models, anchor, like in (([big, small], 0, big), ([big, small], 1, small), ([small, big], 0, small)):
            res = fuse_result("ot", models, fusion_inputs=x, selective=selective, anchor=anchor)
            assert {k: v.shape for k, v in res.model.state_dict().items()} == \
                {k: v.shape for k, v in like.state_dict().items()}
            with torch.no_grad():
                out = res.model(x)
            assert out.shape == (48, 5) and torch.isfinite(out).all()
            depth_other = len(models[1 - anchor].blocks)
            match = res.info["block_match"][0]
            assert len(match) == len(like.blocks)
            got = [m for m in match if m is not None]
            assert len(got) == min(depth_other, len(like.blocks)) and got == sorted(got)  # order kept


def test_different_depths_keep_the_anchor_blocks_without_a_partner():
    big, small = _vit(16, 2, 3, 1), _vit(16, 2, 2, 2)
    res = fuse_result("ot", [big, small], fusion_inputs=_x(), selective=True)
    missing = [j for j, m in enumerate(res.info["block_match"][0]) if m is None]
    assert len(missing) == 1
    sf, sb = res.model.state_dict(), big.state_dict()
    j = missing[0]
    # the unmatched block's own tensors are exactly the anchor's
    for k in sb:
        if k.startswith(f"blocks.{j}.") and "mlp.fc1" in k:
            assert torch.equal(sf[k], sb[k]), k


def test_monotone_block_matching():
    sim = torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.1, 0.2, 0.8, 0.3], [0.0, 0.1, 0.3, 0.95]]).numpy()
    assert monotone_match(sim) == [(0, 0), (1, 2), (2, 3)]
    assert monotone_match(sim.T) == [(0, 0), (2, 1), (3, 2)]


@pytest.mark.parametrize("arch", ["vit", "mlp", "cnn"])
def test_copies_fuse_back_to_the_model(arch):
    if arch == "vit":
        a = _vit(16, 2, 2, 1)
    elif arch == "mlp":
        a = build_model("mlp", num_classes=5, input_shape=SHAPE, width=12, depth=2, seed=1).eval()
    else:
        a = build_model("cnn", num_classes=5, input_shape=SHAPE, width=4, depth=2, batchnorm=True, seed=1).eval()
    x, xt = _x(96, 1), _x(40, 5)
    for weights in ([0.5, 0.5], [0.2, 0.5, 0.3]):
        for opts in ({}, {"transport": "unbalanced"}, {"transport": "balanced"}, {"importance": "activation"}):
            copies = [a] + [copy.deepcopy(a) for _ in weights[1:]]
            fused = fuse("ot", copies, fusion_inputs=x, weights=weights, selective=True, **opts)
            assert _gap(fused, a) < 1e-5, (weights, opts)
            with torch.no_grad():
                assert float((fused(xt) - a(xt)).abs().max()) < 1e-4


def test_low_importance_units_stay_unmatched():
    # constructed case: B unit 3 and A unit 0 carry no importance; the rest match one to one
    g = Group("h", 4)
    cost = torch.tensor([[0.0, 1, 1, 1], [1, 0.0, 1, 1], [1, 1, 0.0, 1], [1, 1, 1, 0.0]])
    opts = OTOptions(selective=True, transport="balanced", min_importance=0.1)
    m, r = selective_plan(cost, g, g, torch.tensor([0.0, 1, 1, 1]), torch.tensor([1.0, 1, 1, 0]), opts=opts)
    assert float(m.plan[0].sum()) == 0 and float(m.plan[:, 3].sum()) == 0  # no mass in or out
    assert r[3] == 0 and r[1] == pytest.approx(1) and r[2] == pytest.approx(1)
    # partial transport moves only the cheapest `mass`: the expensive pair stays unmatched
    cost2 = torch.tensor([[0.0, 1, 1], [1, 0.0, 1], [1, 1, 0.9]])
    m2, r2 = selective_plan(cost2, Group("h", 3), Group("h", 3), torch.ones(3), torch.ones(3),
                            opts=OTOptions(selective=True, transport="partial", mass=2 / 3, min_importance=0.0))
    assert r2.tolist() == pytest.approx([1, 1, 0])
    # end to end (MLP): a unit the anchor's client scores call unimportant keeps the anchor's weights
    a, b = (build_model("mlp", num_classes=5, input_shape=SHAPE, width=12, depth=2, seed=s).eval() for s in (1, 2))
    scores = [{lv.name: torch.ones(lv.width) for lv in levels(m)} for m in (a, b)]
    first = levels(a)[0].name
    scores[0][first][5] = 0.0
    fused = fuse("ot", [a, b], fusion_inputs=_x(), scores=scores, selective=True, transport="balanced")
    spec = build_spec(a)
    rows = [e.name for e, ax in spec.entries_of(spec.groups[next(iter(spec.groups))].name) if ax.role == "out"]
    for k in rows:
        assert torch.equal(fused.state_dict()[k][5], a.state_dict()[k][5]), k
    assert not torch.equal(fused.state_dict()[rows[0]][4], a.state_dict()[rows[0]][4])  # others are fused


def test_heads_are_transported_as_units():
    a, b = _vit(32, 4, 1, 1), _vit(16, 2, 1, 2)
    res = fuse_result("ot", [b, a], fusion_inputs=_x(), selective=True, transport="balanced", min_importance=0.0)
    assert res.model(_x(8)).shape == (8, 5)
    # a head plan between 4 heads of 8 dims (A) and 2 heads of 8 dims (B): blocks are whole heads, and each
    # matched head pair is a within-head permutation (scaled)
    ga, gb = Group("attn", 32, "attn", blocks=4), Group("attn", 16, "attn", blocks=2)
    cost = torch.rand(32, 16, generator=torch.Generator().manual_seed(0))
    m, r = selective_plan(cost, ga, gb, torch.rand(32) + 0.5, torch.rand(16) + 0.5,
                          opts=OTOptions(selective=True, transport="balanced", min_importance=0.0))
    for i in range(4):
        for j in range(2):
            blk = m.plan[i * 8:(i + 1) * 8, j * 8:(j + 1) * 8]
            if blk.sum() > 0:
                nz = blk > 0
                assert bool((nz.sum(0) == 1).all() and (nz.sum(1) == 1).all())
    assert r.min() > 0.99  # balanced: every B head fully matched


def test_transport_primitives():
    c = torch.rand(5, 4, generator=torch.Generator().manual_seed(1))
    a, b = conditional_marginal(torch.ones(5), 0.0), conditional_marginal(torch.ones(4), 0.0)
    for kind in ("balanced", "partial", "unbalanced"):
        p = transport(c, a, b, transport=kind, solver="emd", reg=0.05, mass=0.5, reg_m=1.0)
        assert p.shape == (5, 4) and (p >= 0).all() and float(p.sum()) <= 1 + 1e-6
    p = transport(c, a, b, transport="partial", solver="emd", reg=0.05, mass=0.5, reg_m=1.0)
    assert float(p.sum()) == pytest.approx(0.5, abs=1e-6)
    assert conditional_marginal(torch.tensor([1.0, 1.0, 0.01, 2.0]), 0.1).tolist()[2] == 0.0


def test_options_are_typed_and_validated():
    a, b = _vit(16, 2, 1, 1), _vit(16, 2, 1, 2)
    x = _x()
    with pytest.raises(FusionOptionError, match="mass"):
        fuse("ot", [a, b], fusion_inputs=x, selective=True, mass=0.0)
    with pytest.raises(FusionOptionError, match="transport"):
        fuse("ot", [a, b], fusion_inputs=x, selective=True, transport="sideways")
    with pytest.raises(FusionOptionError, match="did you mean 'selective'"):
        fuse("ot", [a, b], fusion_inputs=x, selectve=True)
    with pytest.raises(FusionOptionError, match="anchor"):
        fuse("ot", [a, b], fusion_inputs=x, anchor=2)
    with pytest.raises(FusionOptionError, match="residual"):
        fuse("ot", [a, b], fusion_inputs=x, selective=True, residual="mean")
    with pytest.raises(ValueError, match="activation"):
        fuse("ot", [a, b], selective=True)  # no fusion set
    mlp = build_model("mlp", num_classes=5, input_shape=SHAPE, width=12, depth=2, seed=1)
    mlp3 = build_model("mlp", num_classes=5, input_shape=SHAPE, width=12, depth=3, seed=1)
    with pytest.raises(IncompatibleModelsError):
        fuse("ot", [mlp, mlp3], fusion_inputs=x, selective=True)
