"""torchvision's ResNet as users have it (issue 24): the adapter's levels and permutation groups are exact, the
alignment methods recover a permuted copy, and every fusion method either fuses two ResNets or refuses with a
clear error."""

from __future__ import annotations

import copy

import pytest
import torch

tv = pytest.importorskip("torchvision.models")

from fedfuse.fusion import METHOD_SPECS, METHODS, IncompatibleModelsError, fuse  # noqa: E402
from fedfuse.fusion.permute import build_spec, permute_model, random_perms  # noqa: E402
from fedfuse.models import adapter_for, levels, model_family  # noqa: E402
from fedfuse.models.adapters import UnsupportedModelError  # noqa: E402

SHAPE = (3, 16, 16)


def _tv(builder=tv.resnet18, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = builder(num_classes=5)
    with torch.no_grad():   # running statistics away from the init's 0 / 1, so that BatchNorm permutes visibly
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.normal_(0, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    return m.eval()


def _x(n: int = 8) -> torch.Tensor:
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("builder", [tv.resnet18, tv.resnet50])
def test_levels_run_to_the_models_output(builder):
    m = _tv(builder)
    assert model_family(m) == "torchvision-resnet"
    lvs = levels(m)
    assert [lv.name for lv in lvs][:3] == ["stem", "layer1.0", "layer1.1"] and lvs[-1].name == "fc"
    h = _x()
    with torch.no_grad():
        for lv in lvs:
            h = lv.run(h)
            assert h.shape[1] == lv.width
        torch.testing.assert_close(h, m(_x()))
    names = {n for n, _ in m.named_parameters()}
    assert sorted(p for lv in lvs for p in lv.param_names) == sorted(names)


@pytest.mark.parametrize("builder", [tv.resnet18, tv.resnet50])
def test_permutation_groups_preserve_the_function_and_rebasin_recovers_it(builder):
    m = _tv(builder)
    x = _x()
    p = permute_model(m, random_perms(build_spec(m), seed=3))
    with torch.no_grad():
        torch.testing.assert_close(p(x), m(x), rtol=1e-4, atol=1e-4)
        assert any((a - b).abs().max() > 1e-3 for a, b in zip(m.parameters(), p.parameters()))
        fused = fuse("rebasin", [m, p], fusion_inputs=x, reset_bn=False, matching="weights")
        torch.testing.assert_close(fused(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_fuses_two_torchvision_resnets_or_says_why(method):
    """Issue 24's goal 'torchvision's resnet18 fuses as it comes': a model mapping inputs to logits, or an
    ``IncompatibleModelsError`` naming the family."""
    models = [_tv(seed=s) for s in (1, 2)]
    before = [copy.deepcopy(m.state_dict()) for m in models]
    x = _x(16)
    fast = {"epochs": 1} if "epochs" in {f.name for f in __import__("dataclasses").fields(METHOD_SPECS[method].options)} else {}
    if method == "fedfisher":   # the server's Adam steps (2,000 by default): the interface, not the optimum
        fast["steps"] = 10
    spec = METHOD_SPECS[method]
    if "torchvision-resnet" not in spec.families and not spec.any_module:
        with pytest.raises(IncompatibleModelsError, match="torchvision-resnet"):
            fuse(method, models, fusion_inputs=x, **fast)
        return
    try:
        fused = fuse(method, models, fusion_inputs=x, **fast)
    except IncompatibleModelsError as exc:   # the closed-form fits need affine levels: a clear refusal
        assert "block levels" in str(exc)
        return
    assert fused(x).shape == (16, 5)
    for m, b in zip(models, before):   # fuse never changes its inputs
        assert all(torch.equal(v, b[k]) for k, v in m.state_dict().items())


def test_resizing_a_torchvision_resnet_says_what_to_use():
    with pytest.raises(UnsupportedModelError, match="fedfuse.models.resnet"):
        adapter_for(_tv()).config(_tv())


def test_removing_identity_blocks_keeps_a_working_model():
    m = _tv()
    a = adapter_for(m)
    removable = a.removable_blocks(m)
    assert removable == [0, 1, 3, 5, 7]   # layer1 keeps 64 channels at stride 1; then the second block of each stage
    a.remove_blocks(m, [1, 7])
    assert len(m.layer1) == 1 and len(m.layer4) == 1 and m(_x()).shape == (8, 5)
    with pytest.raises(UnsupportedModelError, match="downsample"):
        a.remove_blocks(m, [1])   # now layer2.0, which has a downsample
