"""OT fusion (fedfuse.fusion.ot): exactness under permutations, n > 2, widths, policies, bad inputs."""

import pytest
import torch

from fedfuse.fusion import FusionOptionError, IncompatibleModelsError, MissingInputError, fuse, fuse_result
from fedfuse.fusion.permute import build_spec, ot_plan, permute_model, random_perms
from helpers import model_with_bn_stats as _model

CASES = [
    ("mlp", (1, 8, 8), dict(width=24)),
    ("cnn", (1, 8, 8), dict(width=8, batchnorm=True)),
    ("resnet", (1, 8, 8), dict(width=8)),
    ("vit", (1, 8, 8), dict(width=16, num_heads=4)),
    ("vit", (1, 40), dict(width=16, num_heads=2)),
]


@pytest.mark.parametrize("name,shape,kw", CASES)
@pytest.mark.parametrize("cost", ["activations", "weights"])
def test_exact_ot_recovers_permuted_copy(name, shape, kw, cost):
    m = _model(name, shape, kw)
    x = torch.randn(96, *shape, generator=torch.Generator().manual_seed(1))
    p = permute_model(m, random_perms(build_spec(m), seed=2))
    p2 = permute_model(m, random_perms(build_spec(m), seed=9))
    with torch.no_grad():
        y = m(x)
        result = fuse_result("ot", [m, p, p2], fusion_inputs=x, cost=cost, solver="emd", reset_bn=False)
        assert (result.model(x) - y).abs().max() < 1e-5
        trace = result.info["trace_ratio"]
        assert len(trace) == 2  # one entry per aligned (non-anchor) model


@pytest.mark.parametrize("residual", ["mean", "no_resid", "only_resid"])
def test_vit_residual_policies_exact_under_permutation(residual):
    m = _model("vit", (1, 8, 8), dict(width=16, num_heads=4))
    x = torch.randn(64, 1, 8, 8)
    p = permute_model(m, random_perms(build_spec(m), seed=2))
    with torch.no_grad():
        fused = fuse("ot", [m, p], fusion_inputs=x, solver="emd", residual=residual)
        assert (fused(x) - m(x)).abs().max() < 1e-5


def test_sinkhorn_is_close_and_soft():
    m = _model("mlp", (1, 8, 8), dict(width=16))
    x = torch.randn(128, 1, 8, 8)
    p = permute_model(m, random_perms(build_spec(m), seed=2))
    with torch.no_grad():
        fused = fuse("ot", [m, p], fusion_inputs=x, solver="sinkhorn", reg=0.05)
        err = (fused(x) - m(x)).abs().max()
    assert err < 0.05 * m(x).abs().max()
    plan = ot_plan(torch.rand(6, 6), solver="sinkhorn", reg=0.5)
    assert (plan > 1e-4).sum() > 6  # entropic plans are dense
    assert torch.allclose(plan.sum(1), torch.full((6,), 1 / 6, dtype=torch.float64), atol=1e-5)


def test_head_preserving_vs_cross_head():
    """Cross-head (flat) exact OT can mix heads and then loses the function; head-preserving cannot."""
    m = _model("vit", (1, 8, 8), dict(width=16, num_heads=4))
    x = torch.randn(64, 1, 8, 8)
    p = permute_model(m, random_perms(build_spec(m), seed=2))
    with torch.no_grad():
        hp = fuse("ot", [m, p], fusion_inputs=x, solver="emd", head_preserving=True)
        assert (hp(x) - m(x)).abs().max() < 1e-5
        flat = fuse("ot", [m, p], fusion_inputs=x, solver="emd", head_preserving=False)
        assert torch.isfinite(flat(x)).all()


@pytest.mark.parametrize("name,shape,narrow,wide", [
    ("mlp", (1, 8, 8), dict(width=16), dict(width=32)),
    ("cnn", (1, 8, 8), dict(width=8), dict(width=12)),
    ("resnet", (1, 8, 8), dict(width=8), dict(width=12)),
    ("vit", (1, 8, 8), dict(width=16, num_heads=4), dict(width=32, num_heads=4)),
])
def test_different_widths_fuse_into_reference_width(name, shape, narrow, wide):
    ref = _model(name, shape, narrow)
    others = [_model(name, shape, wide, seed=1), _model(name, shape, narrow, seed=2), _model(name, shape, wide, seed=3)]
    x = torch.randn(64, *shape)
    for solver in ("emd", "sinkhorn"):
        fused = fuse("ot", [ref] + others, fusion_inputs=x, solver=solver)
        assert {k: v.shape for k, v in fused.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
        with torch.no_grad():
            assert torch.isfinite(fused(x)).all()
    with pytest.raises(ValueError, match="equal widths"):
        fuse("rebasin", [ref, others[0]], fusion_inputs=x)


def test_wide_model_with_duplicated_units_compresses_exactly():
    """A wide MLP whose hidden units are exact duplicates of a narrow one is mapped back onto it
    (column-normalised out map, row-normalised in map: §1.6)."""
    narrow = _model("mlp", (1, 8, 8), dict(width=8, depth=1))
    wide = _model("mlp", (1, 8, 8), dict(width=16, depth=1), seed=1)
    with torch.no_grad():
        idx = torch.randperm(16, generator=torch.Generator().manual_seed(0)) % 8
        wide[1].weight.copy_(narrow[1].weight[idx])
        wide[1].bias.copy_(narrow[1].bias[idx])
        counts = torch.bincount(idx, minlength=8).float()
        wide[3].weight.copy_(narrow[3].weight[:, idx] / counts[idx])  # each copy carries 1/count of the output
        wide[3].bias.copy_(narrow[3].bias)
        x = torch.randn(64, 1, 8, 8)
        assert (wide(x) - narrow(x)).abs().max() < 1e-5
        fused = fuse("ot", [narrow, wide], fusion_inputs=x, solver="emd", cost="weights")
        assert (fused(x) - narrow(x)).abs().max() < 1e-4


def test_class_layer_identity_aligned():
    a, b = _model("mlp", (1, 8, 8), dict(width=16)), _model("mlp", (1, 8, 8), dict(width=16), seed=1)
    x = torch.randn(32, 1, 8, 8)
    fused = fuse("ot", [a, b], fusion_inputs=x, solver="sinkhorn")
    assert torch.allclose(fused[-1].bias, (a[-1].bias + b[-1].bias) / 2, atol=1e-6)


def test_importance_marginals():
    a, b = _model("mlp", (1, 8, 8), dict(width=16)), _model("mlp", (1, 8, 8), dict(width=16), seed=1)
    x = torch.randn(32, 1, 8, 8)
    spec = build_spec(a)
    scores = [{g.levels[0]: torch.rand(g.size) for g in spec.groups.values()} for _ in range(2)]
    uni = fuse("ot", [a, b], fusion_inputs=x)
    imp = fuse("ot", [a, b], fusion_inputs=x, scores=scores, marginals="importance")
    assert not torch.allclose(uni[1].weight, imp[1].weight)
    with pytest.raises(ValueError, match="needs scores"):
        fuse("ot", [a, b], fusion_inputs=x, marginals="importance")


def test_bn_reset_and_finetune_options():
    shape = (1, 8, 8)
    a, b = _model("cnn", shape, dict(width=8, batchnorm=True)), _model("cnn", shape, dict(width=8, batchnorm=True), seed=1)
    x = torch.randn(64, *shape) * 2
    keep = fuse("ot", [a, b], fusion_inputs=x, reset_bn=False)
    reset = fuse("ot", [a, b], fusion_inputs=x)
    assert not torch.allclose(keep[1].running_mean, reset[1].running_mean)
    result = fuse_result("ot", [a, b], fusion_inputs=x, finetune=dict(epochs=2, lr=1e-3))
    ft = result.model
    assert result.info["finetune"]["finetune-seconds"] > 0
    assert not torch.allclose(ft[0].weight, reset[0].weight)


def test_bad_inputs_raise_value_error():
    a = _model("mlp", (1, 8, 8), dict(width=16))
    x = torch.randn(16, 1, 8, 8)
    with pytest.raises(FusionOptionError, match="solver"):
        fuse("ot", [a, a], fusion_inputs=x, solver="magic")
    with pytest.raises(FusionOptionError, match="> 0 for solver='sinkhorn'"):
        fuse("ot", [a, a], fusion_inputs=x, solver="sinkhorn", reg=0.0)
    with pytest.raises(MissingInputError, match="needs fusion_inputs"):
        fuse("ot", [a, a], cost="activations")
    with pytest.raises(FusionOptionError, match="residual"):
        fuse("ot", [a, a], fusion_inputs=x, residual="sideways")
    with pytest.raises(FusionOptionError, match="'finetune'.*'epoch'.*did you mean 'epochs'"):
        fuse("ot", [a, a], fusion_inputs=x, finetune=dict(epoch=2))
    with pytest.raises(IncompatibleModelsError, match="parameter names"):
        fuse("ot", [a, _model("mlp", (1, 8, 8), dict(width=16, depth=3))], fusion_inputs=x)
    with pytest.raises(IncompatibleModelsError, match="not a neuron axis"):  # different input sizes
        fuse("ot", [a, _model("mlp", (1, 6, 6), dict(width=16))], cost="weights")
    vit_a = _model("vit", (1, 8, 8), dict(width=16, num_heads=4))
    vit_b = _model("vit", (1, 8, 8), dict(width=16, num_heads=2))
    with pytest.raises(IncompatibleModelsError, match="heads"):
        fuse("ot", [vit_a, vit_b], fusion_inputs=torch.randn(8, 1, 8, 8))


@pytest.mark.parametrize("name,shape,kw", CASES)
def test_activation_rows_are_subsampled_as_they_are_produced(name, shape, kw):
    """The row subsample is taken batch by batch as the rows are produced (memory: ``max_rows`` rows per hook point
    plus one batch's); it must pick the rows that subsampling after the whole pass picks (every row kept, then
    ``_subsample`` of each hook point's rows)."""
    from fedfuse.fusion.permute import collect_activations
    from fedfuse.fusion.permute.activations import _subsample

    m = _model(name, shape, kw)
    spec = build_spec(m)
    x = torch.randn(50, *shape, generator=torch.Generator().manual_seed(3))
    for bs in (1, 7, 50):
        every = collect_activations(m, spec, x, max_rows=10 ** 9, batch_size=bs, seed=4)
        kept = collect_activations(m, spec, x, max_rows=37, batch_size=bs, seed=4)
        assert kept.keys() == every.keys()
        for g, rows in every.items():
            points = rows.chunk(len(spec.groups[g].acts))   # every hook point of a group has as many rows
            want = torch.cat([p[_subsample(len(p), 37, 4)] if len(p) > 37 else p for p in points])
            assert torch.equal(kept[g], want), (g, bs)
