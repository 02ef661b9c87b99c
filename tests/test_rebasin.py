"""Git Re-Basin fusion (fedfuse.fusion.rebasin) and the shared permutation machinery (permute.py)."""

import pytest
import torch
from torch import nn

from fedfuse.fusion import FusionOptionError, IncompatibleModelsError, MissingInputError, fuse
from fedfuse.fusion.permute import Map, build_spec, permute_model, random_perms, reset_bn_stats
from helpers import model_with_bn_stats as _model

CASES = [
    ("mlp", (1, 8, 8), dict(width=24)),                      # Linear with bias
    ("mlp", (1, 8, 8), dict(width=24, batchnorm=True)),      # Linear + BatchNorm1d
    ("cnn", (1, 8, 8), dict(width=8, batchnorm=True)),       # Conv2d + BN
    ("cnn", (1, 40), dict(width=8)),                         # Conv1d
    ("resnet", (1, 8, 8), dict(width=8)),                    # residual blocks, BN, shortcut conv
    ("resnet", (1, 8, 8), dict(width=16, norm="group")),     # GroupNorm: group-preserving permutations
    ("vit", (1, 8, 8), dict(width=16, num_heads=4)),         # timm ViT: stream, heads, MLP, LayerNorm
]


@pytest.mark.parametrize("name,shape,kw", CASES)
@pytest.mark.parametrize("matching", ["weights", "activations"])
def test_permuted_copy_recovers_original(name, shape, kw, matching):
    m = _model(name, shape, kw)
    x = torch.randn(96, *shape, generator=torch.Generator().manual_seed(5))
    p = permute_model(m, random_perms(build_spec(m), seed=3))
    with torch.no_grad():
        y, yp = m(x), p(x)
        assert (y - yp).abs().max() < 1e-4                           # permutation preserves the function
        assert any((a - b).abs().max() > 1e-3 for a, b in zip(m.parameters(), p.parameters()))  # but moved weights
        fused = fuse("rebasin", [m, p], fusion_inputs=x, matching=matching, reset_bn=False)
        assert (fused(x) - y).abs().max() < 1e-5
        # more than two models, in any order of copies
        p2 = permute_model(m, random_perms(build_spec(m), seed=4))
        fused3 = fuse("rebasin", [p, m, p2], fusion_inputs=x, matching=matching, reset_bn=False, weights=[1, 2, 3])
        assert (fused3(x) - yp).abs().max() < 1e-5


def test_naive_average_of_permuted_copy_is_not_the_original():
    """The test above can fail: without alignment, averaging a permuted copy changes the function."""
    m = _model("mlp", (1, 8, 8), dict(width=24))
    x = torch.randn(64, 1, 8, 8)
    p = permute_model(m, random_perms(build_spec(m), seed=3))
    with torch.no_grad():
        assert (fuse("average", [m, p])(x) - m(x)).abs().max() > 1e-2


def test_identity_init_weight_matching_also_recovers():
    m = _model("mlp", (1, 8, 8), dict(width=16, depth=3))
    x = torch.randn(32, 1, 8, 8)
    p = permute_model(m, random_perms(build_spec(m), seed=7))
    with torch.no_grad():
        fused = fuse("rebasin", [m, p], matching="weights", init="identity", order="forward")
        assert (fused(x) - m(x)).abs().max() < 1e-5


def test_class_layer_never_permuted():
    for name, shape, kw in CASES:
        m = _model(name, shape, kw)
        spec = build_spec(m)
        assert spec.classifier, name
        for key in spec.classifier:
            e = spec.entries.get(key)
            assert e is None or all(ax.role == "in" for ax in e.axes), (name, key)
    # behaviour: class rows keep their identity, so the fused class bias is the plain average
    a, b = _model("mlp", (1, 8, 8), dict(width=16)), _model("mlp", (1, 8, 8), dict(width=16), seed=1)
    fused = fuse("rebasin", [a, b], matching="weights")
    assert torch.allclose(fused[-1].bias, (a[-1].bias + b[-1].bias) / 2, atol=1e-6)


def test_bn_reestimation_changes_running_stats():
    shape = (1, 8, 8)
    m = _model("resnet", shape, dict(width=8))
    other = _model("resnet", shape, dict(width=8), seed=1)
    x = torch.randn(128, *shape) * 3 + 1
    no_reset = fuse("rebasin", [m, other], fusion_inputs=x, reset_bn=False)
    reset = fuse("rebasin", [m, other], fusion_inputs=x, reset_bn=True)
    a, b = no_reset.state_dict(), reset.state_dict()
    assert not torch.allclose(a["blocks.0.norm1.running_var"], b["blocks.0.norm1.running_var"])
    for k in a:  # weights are the same; only the statistics were re-estimated
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(a[k], b[k]), k
    # the re-estimated statistics are those of the fused model on the fusion set
    with torch.no_grad():
        conv_out = reset.stem[0](x)
        assert torch.allclose(reset.stem[1].running_mean, conv_out.mean((0, 2, 3)), atol=1e-4)


def test_reset_bn_stats_requires_data():
    m = _model("cnn", (1, 8, 8), dict(width=8, batchnorm=True))
    with pytest.raises(ValueError, match="at least 2"):
        reset_bn_stats(m, torch.randn(1, 1, 8, 8))


def test_bad_inputs_raise_value_error():
    a = _model("mlp", (1, 8, 8), dict(width=16))
    wide = _model("mlp", (1, 8, 8), dict(width=24))
    deep = _model("mlp", (1, 8, 8), dict(width=16, depth=3))
    x = torch.randn(16, 1, 8, 8)
    with pytest.raises(IncompatibleModelsError, match="equal widths"):
        fuse("rebasin", [a, wide], fusion_inputs=x)
    with pytest.raises(IncompatibleModelsError, match="parameter names"):
        fuse("rebasin", [a, deep], fusion_inputs=x)
    with pytest.raises(FusionOptionError, match="matching"):
        fuse("rebasin", [a, a], fusion_inputs=x, matching="magic")
    with pytest.raises(MissingInputError, match="needs fusion_inputs"):
        fuse("rebasin", [a, a], matching="activations")
    with pytest.raises(IncompatibleModelsError, match="graph reader: Linear's output is not a Linear classifier"):
        fuse("rebasin", [nn.Linear(4, 2), nn.Linear(4, 2)], matching="weights")
    with pytest.raises(IncompatibleModelsError, match="families"):
        fuse("rebasin", [_model("resnet", (1, 8, 8), dict(width=8)), _model("cnn", (1, 8, 8), dict(width=8))],
             matching="weights")


def test_importance_weighted_average_follows_scores():
    """Model 0 puts (almost) all its importance on one unit of a group, model 1 spreads it evenly: the group's other
    fused rows are model 1's (aligned). Scores are relative within a model (``fuse`` normalises each model's scores
    per level), so a model's say on a unit is its score there against its own mean."""
    a, b = _model("mlp", (1, 8, 8), dict(width=8, depth=1)), _model("mlp", (1, 8, 8), dict(width=8, depth=1), seed=1)
    spec = build_spec(a)
    g = next(iter(spec.groups))
    lv = spec.groups[g].levels[0]
    scores = [{lv: torch.tensor([1e-9] * 7 + [1.0])}, {lv: torch.ones(8)}]
    fused = fuse("rebasin", [a, b], scores=scores, matching="weights")
    rows = {tuple(r.tolist()) for r in torch.round(b[1].weight.detach() * 1e4)}
    got = {tuple(r.tolist()) for r in torch.round(fused[1].weight.detach() * 1e4)}
    assert len(rows & got) >= 7  # (almost) exactly model 1's rows, permuted into model 0's order


def test_map_in_out_rules_for_widths():
    """Column-normalised out map, row-normalised in map (different widths, §1.6)."""
    plan = torch.tensor([[0.25, 0.0], [0.25, 0.0], [0.0, 0.5]])  # A has 3 units, B 2: A0,A1 → B0
    m = Map.from_plan(plan)
    assert m.perm is None
    assert torch.allclose(m.out_map().sum(0), torch.ones(2, dtype=torch.float64))
    assert torch.allclose(m.in_map().sum(1), torch.ones(3, dtype=torch.float64))


def test_weight_scores_in_float32_match_float64():
    """Weight matching sums its scores in float32 (about 1.7x faster on a CPU; the recovery tests above run it);
    they equal the float64 ones to float32 round-off."""
    from fedfuse.fusion.permute.features import weight_score

    a = _model("resnet", (1, 8, 8), dict(width=8))
    spec = build_spec(a)
    b = permute_model(a, random_perms(spec, seed=3))
    sa, sb = a.state_dict(), b.state_dict()
    maps = {g: Map.identity(grp.size) for g, grp in spec.groups.items()}
    for g in spec.groups:
        s64 = weight_score(sa, sb, spec, spec, g, maps)
        s32 = weight_score(sa, sb, spec, spec, g, maps, dtype=torch.float32)
        assert s32.dtype == torch.float32 and s64.dtype == torch.float64
        assert torch.allclose(s32.double(), s64, rtol=1e-5, atol=1e-5 * float(s64.abs().max()))


def test_weight_matching_skips_groups_whose_neighbours_did_not_move(monkeypatch):
    """A group is solved again only when a map its score reads has moved since its last solve: the confirming last
    sweep skips groups, and the permuted copy is still recovered (the recovery tests above run the same path)."""
    import fedfuse.fusion.rebasin as rebasin

    a = _model("resnet", (1, 8, 8), dict(width=8))
    spec = build_spec(a)
    b = permute_model(a, random_perms(spec, seed=3))
    calls = []
    real = rebasin.weight_score
    monkeypatch.setattr(rebasin, "weight_score", lambda *args, **kw: calls.append(args[4]) or real(*args, **kw))
    maps, info = rebasin.weight_matching(b.state_dict(), a.state_dict(), spec, spec, init="identity")
    groups = len(spec.groups)
    assert info["sweeps"] >= 2 and len(calls) < groups * info["sweeps"]   # every sweep, had nothing been skipped
    back = permute_model(b, {g: maps[g].perm for g in maps})
    for k, v in a.state_dict().items():
        assert torch.allclose(back.state_dict()[k].float(), v.float(), atol=1e-5), k
