"""Capacity tiers in the library: ``build_model(..., width_mult=)`` and ``fuse(..., target=)`` (issue 13)."""

import pytest
import torch
import torch.nn.functional as F

from fedfuse.fusion import METHOD_SPECS, fuse
from fedfuse.models import adapter_for, build_model, levels

SHAPES = {"mlp": (20,), "cnn": (1, 12), "vit": (1, 8, 8)}


def _toy(shape, n=256, classes=4, seed=0):
    """Gaussian class blobs in ``shape``: a task small models learn in a few steps."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, *shape, generator=g) * 1.5
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + torch.randn(n, *shape, generator=g), y


def _train(model, x, y, steps=60, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


def _acc(model, x, y):
    with torch.no_grad():
        return float((model.eval()(x).argmax(1) == y).float().mean())


@pytest.mark.parametrize("name,expected", [
    ("mlp", {1: [64, 64, 10], 0.5: [32, 32, 10], 0.25: [16, 16, 10]}),
    ("cnn", {1: [16, 32, 10], 0.5: [8, 16, 10], 0.25: [4, 8, 10]}),
    ("resnet", {1: [16, 16, 32, 10], 0.5: [8, 8, 16, 10], 0.25: [4, 4, 8, 10]}),
    ("vit", {1: [32, 32, 10], 0.5: [16, 16, 10], 0.25: [8, 8, 10], 0.125: [8, 8, 10]}),
])
def test_width_mult_scales_every_hidden_width(name, expected):
    shape = (1, 8, 8)
    for mult, widths in expected.items():
        m = build_model(name, 10, shape, width_mult=mult)
        assert [lv.width for lv in levels(m)] == widths
        with torch.no_grad():
            assert m(torch.randn(2, *shape)).shape == (2, 10)
    v = build_model("vit", 10, shape, width_mult=0.5)          # heads scale, head dim and MLP ratio kept
    assert v.blocks[0].attn.num_heads == 2 and v.blocks[0].attn.head_dim == 8
    assert v.blocks[0].mlp.fc1.out_features == 32
    full = build_model("mlp", 10, shape)
    assert adapter_for(full).at_width_mult(full, 0.5).state_dict()["1.weight"].shape == (32, 64)


@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), "0.5", True])
def test_width_mult_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="width_mult"):
        build_model("mlp", 10, (8,), width_mult=bad)


@pytest.mark.parametrize("name", ["mlp", "cnn", "vit"])
@pytest.mark.parametrize("mult", [0.5, 1.5])
def test_fuse_into_narrower_and_wider_target(name, mult):
    shape = SHAPES[name]
    x, y = _toy(shape)
    kw = {"num_heads": 4} if name == "vit" else {}
    # three clients of widths 1, 0.5, 0.5 of the base model, trained on the same task
    models = [_train(build_model(name, 4, shape, width_mult=r, seed=i, **kw), x, y, seed=i)
              for i, r in enumerate([1.0, 0.5, 0.5])]
    target = build_model(name, 4, shape, width_mult=mult, seed=7, **kw)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    methods = (["kf-linear"] if name != "vit" else []) + ["kf-gradient", "kd"]
    for method in methods:
        opts = {"epochs": 30} if method == "kd" else {"epochs": 30, "head_epochs": 30} if method == "kf-gradient" else {}
        fused = fuse(method, models, fusion_inputs=x, target=target, **opts)
        assert [lv.width for lv in levels(fused)] == [lv.width for lv in levels(target)], method
        assert {k: v.shape for k, v in fused.state_dict().items()} == {k: v.shape for k, v in before.items()}
        # the fused model learnt the clients' task (chance = 0.25); clients score ~1.0 on this toy
        assert _acc(fused, x, y) > 0.8, (method, _acc(fused, x, y))
    # the target is not modified (its weights are ignored, not used)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_methods_that_cannot_build_another_architecture_say_so():
    shape = (20,)
    x, _ = _toy(shape)
    models = [build_model("mlp", 4, shape, seed=i) for i in range(2)]
    narrow = build_model("mlp", 4, shape, width_mult=0.5)
    able = sorted(n for n, s in METHOD_SPECS.items() if s.any_target)
    assert {"kf-linear", "kf-gradient", "kd"} <= set(able)
    for method in ("average", "ot", "rebasin", "hf-linear"):
        with pytest.raises(ValueError, match="cannot produce another architecture"):
            fuse(method, models, fusion_inputs=x, target=narrow)
    # a target of model 0's architecture is the default, for every method
    same = build_model("mlp", 4, shape, seed=5)
    a = fuse("average", models, target=same)
    b = fuse("average", models)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    with pytest.raises(ValueError, match="fused_width"):
        fuse("kf-linear", models, fusion_inputs=x, target=narrow, fused_width=8)
    with pytest.raises(ValueError, match="target must be an nn.Module"):
        fuse("kf-linear", models, fusion_inputs=x, target="mlp")


def test_kf_linear_identical_models_into_same_width_target_is_the_model():
    shape = (20,)
    x, y = _toy(shape)
    m = _train(build_model("mlp", 4, shape, seed=1), x, y)
    fused = fuse("kf-linear", [m, m], fusion_inputs=x, target=build_model("mlp", 4, shape, seed=3))
    with torch.no_grad():
        assert torch.allclose(fused(x), m(x), atol=1e-3)
