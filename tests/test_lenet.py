"""LeNet-5 (NIID-Bench's CNN, ``model='lenet'``): the published layout, its run-config size, and every fusion method
that takes a sequential CNN fuses it (registry-driven: a new method is covered automatically)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse.config import ConfigError, check_model, parse_run_config
from fedfuse.fusion import METHODS, IncompatibleModelsError, fuse_result, get_spec
from fedfuse.fusion.permute import build_spec, permute_model, random_perms
from fedfuse.importance import neuron_importance
from fedfuse.models import build_model, levels, model_family
from fedfuse.models.lenet import lenet_widths

torch.set_num_threads(1)
SHAPE = (1, 28, 28)
# methods that cannot take a CNN, with the reason they give (FS-Merge's SuperNet has MLP and ViT layouts only)
NOT_CNN: dict[str, str] = {}   # every method takes LeNet (FS-Merge: the layout read off its permutation spec)
TWO_ONLY = {"hf-linear", "hf-gradient"}
FAST = {"kd": dict(epochs=1), "lp": dict(epochs=1), "feddf": dict(epochs=1), "hf-gradient": dict(epochs=1, head_epochs=1),
        "kf-gradient": dict(epochs=1, head_epochs=1), "rebasin": dict(max_iter=3), "transfusion": dict(max_iter=3),
        "fs-merge": dict(steps=3), "fs-merge-seq": dict(steps=3, stage_steps=2)}


def test_lenet_is_niid_benchs_cnn():
    m = build_model("lenet", 10, SHAPE)
    kinds = [type(x).__name__ for x in m]
    assert kinds == ["Conv2d", "ReLU", "MaxPool2d", "Conv2d", "ReLU", "MaxPool2d", "Flatten", "Linear", "ReLU",
                     "Linear", "ReLU", "Linear"]
    assert (m[0].out_channels, m[0].kernel_size, m[3].out_channels, m[3].kernel_size) == (6, (5, 5), 16, (5, 5))
    assert (m[7].in_features, m[7].out_features, m[9].out_features, m[11].out_features) == (256, 120, 84, 10)
    assert sum(p.numel() for p in m.parameters()) == 44426
    assert model_family(m) == "sequential"
    assert [(lv.name, lv.width, lv.layout) for lv in levels(m)] == [
        ("0", 6, "channels"), ("3", 16, "channels"), ("7", 120, "flat"), ("9", 84, "flat"), ("11", 10, "flat")]
    with torch.no_grad():
        assert m(torch.rand(3, *SHAPE)).shape == (3, 10)
    assert build_model("lenet", 10, (3, 32, 32))[7].in_features == 400   # CIFAR-10's LeNet: 16 × 5 × 5
    assert lenet_widths(3) == (3, 8, 60, 42) and lenet_widths(12) == (12, 32, 240, 168)


@pytest.mark.parametrize("shape,match", [((1, 8, 8), "at least 16"), ((40,), "image inputs")])
def test_lenet_rejects_inputs_it_cannot_take(shape, match):
    with pytest.raises(ValueError, match=match):
        build_model("lenet", 10, shape)
    with pytest.raises(ValueError, match="2 convolution stages"):
        build_model("lenet", 10, SHAPE, depth=3)


def test_run_config_builds_the_published_size_unless_told():
    cfg = parse_run_config({"model": "lenet", "dataset": "fashion-mnist", "strategy": "fedavg", "data-root": "/"})
    assert (cfg.model_width, cfg.model_depth) == (6, 2)
    assert parse_run_config({"model": "lenet", "model-width": 12}).model_width == 12
    # model-width = 0 (the default) is each model's own size: unchanged for the others
    assert (parse_run_config({}).model_width, parse_run_config({"model": "cnn"}).model_depth) == (64, 2)
    with pytest.raises(ConfigError, match="'model'.*lenet"):
        check_model(parse_run_config({"model": "lenet", "dataset": "digits", "strategy": "fedavg"}))


def test_permutation_spec_is_a_symmetry_through_the_flatten():
    m = build_model("lenet", 10, SHAPE, seed=1).eval()
    spec = build_spec(m)
    p = permute_model(m, random_perms(spec, seed=2))
    x = torch.rand(4, *SHAPE)
    with torch.no_grad():
        assert torch.allclose(m(x), p(x), atol=1e-5)
    assert not torch.equal(m[7].weight, p[7].weight)


def test_importance_scores_cover_every_level():
    m = build_model("lenet", 10, SHAPE)
    s = neuron_importance(m, torch.rand(8, *SHAPE), torch.randint(0, 10, (8,)), method="deeplift")
    assert {k: tuple(v.shape) for k, v in s.items()} == {"0": (6,), "3": (16,), "7": (120,), "9": (84,), "11": (10,)}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_fuses_lenet_or_says_why(method):
    models = [build_model("lenet", 10, SHAPE, width=3, seed=s).eval() for s in (1, 2, 3)]
    models = models[:2] if method in TWO_ONLY else models
    x = torch.rand(24, *SHAPE, generator=torch.Generator().manual_seed(0))
    opts = {k: v for k, v in FAST.get(method, {}).items()}
    if method in NOT_CNN:
        with pytest.raises(IncompatibleModelsError, match=NOT_CNN[method]):
            fuse_result(method, models, fusion_inputs=x, **opts)
        return
    fused = fuse_result(method, models, fusion_inputs=x, seed=0, **opts).model
    with torch.no_grad():
        out = fused(x)
    assert out.shape == (24, 10) and torch.isfinite(out).all()
    if isinstance(fused, nn.Sequential) and get_spec(method).same_architecture:   # pfnm may open new units
        assert {k: v.shape for k, v in fused.state_dict().items()} == \
            {k: v.shape for k, v in models[0].state_dict().items()}
