"""Models and their fusion levels: decomposition is exact, names/widths stable, outside models work."""

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from fedfuse.models import build_model, level_outputs, levels, neurons_last, neurons_restore

CASES = [("mlp", (1, 8, 8)), ("mlp", (64,)), ("cnn", (1, 8, 8)), ("cnn", (1, 40)), ("resnet", (1, 8, 8)),
         ("resnet", (1, 40)), ("vit", (1, 8, 8)), ("vit", (1, 40)), ("vit", (3, 16, 16))]


@pytest.mark.parametrize("name,shape", CASES)
def test_levels_compose_to_model(name, shape):
    model = build_model(name, num_classes=7, input_shape=shape, seed=1).eval()
    x = torch.randn(4, *shape)
    lv = levels(model)
    outs = level_outputs(model, x)
    assert len(outs) == len(lv) >= 2
    torch.testing.assert_close(outs[-1], model(x), rtol=0, atol=1e-6)
    assert lv[-1].kind == "classifier" and lv[-1].width == 7
    for level, out in zip(lv, outs):
        z = neurons_last(out, level.layout)
        assert z.shape[-1] == level.width, (level.name, out.shape)
        torch.testing.assert_close(neurons_restore(z, level.layout, out), out)
        params = dict(model.named_parameters())
        assert all(p in params for p in level.param_names)
    # every parameter belongs to exactly one level
    owned = [p for level in lv for p in level.param_names]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())


def test_level_names_stable_across_seeds_and_instances():
    a = [(lv.name, lv.width) for lv in levels(build_model("cnn", 10, (1, 8, 8), seed=0))]
    b = [(lv.name, lv.width) for lv in levels(build_model("cnn", 10, (1, 8, 8), seed=5))]
    assert a == b


def test_plain_sequential_from_outside_with_batchnorm_and_trailing_op():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 9), nn.BatchNorm1d(9), nn.Tanh(), nn.Linear(9, 3),
                          nn.LogSoftmax(dim=1)).eval()
    lv = levels(model)
    assert [(l.name, l.width, l.kind) for l in lv] == [("2", 9, "affine"), ("4", 3, "classifier")]
    assert lv[0].norm is model[2] and lv[0].layer is model[1]
    x = torch.randn(5, 12)
    torch.testing.assert_close(level_outputs(model, x)[-1], model(x))


def test_plain_timm_vit_with_registers():
    model = VisionTransformer(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=24, depth=3,
                              num_heads=3, reg_tokens=2).eval()
    lv = levels(model)
    assert [l.name for l in lv] == ["blocks.0", "blocks.1", "blocks.2", "head"]
    x = torch.randn(2, 3, 16, 16)
    outs = level_outputs(model, x)
    assert outs[0].shape == (2, 16 + 1 + 2, 24)
    torch.testing.assert_close(outs[-1], model(x), rtol=0, atol=1e-6)


def test_build_model_deterministic_and_leaves_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    m1 = build_model("mlp", seed=3)
    after = torch.rand(1)
    assert torch.equal(before, after)
    m2 = build_model("mlp", seed=3)
    m3 = build_model("mlp", seed=4)
    for (k, a), b, c in zip(m1.state_dict().items(), m2.state_dict().values(), m3.state_dict().values()):
        assert torch.equal(a, b)
    assert not torch.equal(m1[1].weight, m3[1].weight)


def test_width_and_depth_knobs():
    m = build_model("mlp", input_shape=(10,), width=33, depth=3)
    assert [l.width for l in levels(m)] == [33, 33, 33, 10]
    v = build_model("vit", input_shape=(1, 8, 8), width=48, depth=4, num_heads=4)
    assert [l.width for l in levels(v)] == [48] * 4 + [10]


def test_errors():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("transformer-xl")
    with pytest.raises(ValueError, match="graph reader: LSTM has no Linear/Conv layer"):
        levels(nn.LSTM(3, 3))
    with pytest.raises(ValueError, match="unsupported parameterised module"):
        levels(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 2)))
