"""``fuse(..., reference=)``: align every model onto a separate reference model (the previous global model in a
federation) that is not itself averaged in; methods with the ``any_reference`` capability only."""

import pytest
import torch

from fedfuse.fusion import METHOD_SPECS, IncompatibleModelsError, fuse
from fedfuse.fusion.permute import build_spec, permute_model, random_perms
from fedfuse.models import build_model
from helpers import model_with_bn_stats as _model

ALIGNERS = sorted(n for n, s in METHOD_SPECS.items() if s.any_reference)
CASES = [("mlp", (1, 8, 8), dict(width=24)), ("cnn", (1, 8, 8), dict(width=8, batchnorm=True)),
         ("resnet", (1, 8, 8), dict(width=8))]


def test_the_aligners_are_rebasin_and_ot():
    assert ALIGNERS == ["ot", "rebasin"]


@pytest.mark.parametrize("method", ALIGNERS)
@pytest.mark.parametrize("name,shape,kw", CASES)
def test_permuted_copies_land_in_the_reference_units(method, name, shape, kw):
    """Models that are permuted copies of one function, aligned onto a differently permuted reference, fuse to that
    function in the reference's units; the reference's own weights carry no weight."""
    m = _model(name, shape, kw)
    x = torch.randn(96, *shape, generator=torch.Generator().manual_seed(5))
    spec = build_spec(m)
    p1, p2 = (permute_model(m, random_perms(spec, seed=s)) for s in (3, 4))
    ref = permute_model(m, random_perms(spec, seed=9))
    with torch.no_grad():
        ref_other = permute_model(m, random_perms(spec, seed=9))
        for prm in ref_other.parameters():   # the same units, other values: must not leak into the result
            prm.add_(0.01 * torch.randn_like(prm))
        fused = fuse(method, [p1, p2], fusion_inputs=x, reference=ref_other, reset_bn=False, weights=[1, 3])
        assert (fused(x) - m(x)).abs().max() < 1e-4
        # the same units as the reference: every weight close to the reference's permutation of m
        for (k, a), b in zip(fused.state_dict().items(), ref.state_dict().values()):
            if a.is_floating_point():
                assert (a - b).abs().max() < 1e-4, k


@pytest.mark.parametrize("method", ALIGNERS)
def test_a_single_model_onto_the_reference_keeps_its_function(method):
    m = build_model("mlp", 4, (1, 8, 8), width=16, seed=1)
    ref = build_model("mlp", 4, (1, 8, 8), width=16, seed=2)
    x = torch.randn(64, 1, 8, 8)
    with torch.no_grad():
        fused = fuse(method, [m], fusion_inputs=x, reference=ref)
        assert (fused(x) - m(x)).abs().max() < 1e-4


def test_methods_without_the_capability_say_so():
    models = [build_model("mlp", 4, (1, 8, 8), width=16, seed=s) for s in (1, 2)]
    with pytest.raises(IncompatibleModelsError, match="does not align to a separate reference.*'ot', 'rebasin'"):
        fuse("average", models, reference=models[0])


@pytest.mark.parametrize("method", ALIGNERS)
def test_a_reference_of_another_architecture_is_an_error(method):
    models = [build_model("mlp", 4, (1, 8, 8), width=16, seed=s) for s in (1, 2)]
    wide = build_model("mlp", 4, (1, 8, 8), width=32, seed=3)
    with pytest.raises(IncompatibleModelsError, match="reference must be a model of model 0's architecture"):
        fuse(method, models, fusion_inputs=torch.randn(8, 1, 8, 8), reference=wide)
    with pytest.raises(IncompatibleModelsError, match="got OrderedDict"):
        fuse(method, models, fusion_inputs=torch.randn(8, 1, 8, 8), reference=models[0].state_dict())


def test_ot_reference_does_not_combine_with_selective_transport():
    models = [build_model("mlp", 4, (1, 8, 8), width=16, seed=s) for s in (1, 2)]
    with pytest.raises(IncompatibleModelsError, match="does not combine with selective"):
        fuse("ot", models, fusion_inputs=torch.randn(8, 1, 8, 8), reference=models[0], selective=True)


# ---------------------------------------------------------------- the strategy option and its run-config key
def _updates(models):
    from fedfuse.flower.round.replies import ClientUpdate

    return [ClientUpdate(i + 1, i, m.state_dict(), None, 10 * (i + 1), {}) for i, m in enumerate(models)]


@pytest.mark.parametrize("align_to", ["model-0", "global"])
def test_strategy_aligns_onto_the_round_global_model(align_to):
    from flwr.app import ArrayRecord

    from fedfuse.flower import build_strategy
    from fedfuse.fusion import fuse_result

    seen = {}

    def spy(method, models, **kw):
        seen.update(kw)
        return fuse_result(method, models, **kw)

    def model_fn():
        return build_model("mlp", 4, (1, 8, 8), width=16, seed=0)

    glob = model_fn()
    s = build_strategy("rebasin", model_fn=model_fn, fusion_inputs=torch.randn(32, 1, 8, 8), fuse_fn=spy,
                       align_to=align_to, refine="none", guard=False, server_momentum=0.0)
    s._global = ArrayRecord(glob.state_dict())   # what configure_train keeps: the round's global model
    clients = [build_model("mlp", 4, (1, 8, 8), width=16, seed=k) for k in (1, 2)]
    s.aggregate(1, _updates(clients))
    if align_to == "global":
        ref = seen["reference"]
        assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), glob.state_dict().values()))
    else:
        assert "reference" not in seen


def test_strategy_align_to_needs_an_aligning_method():
    from fedfuse.flower import build_strategy

    def model_fn():
        return build_model("mlp", 4, (1, 8, 8), width=16, seed=0)

    with pytest.raises(ValueError, match="align_to='global' needs a method that aligns.*'ot', 'rebasin'.*'kf-linear'"):
        build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=torch.randn(8, 1, 8, 8), align_to="global")
    with pytest.raises(ValueError, match="align_to must be"):
        build_strategy("ot", model_fn=model_fn, fusion_inputs=torch.randn(8, 1, 8, 8), align_to="previous")


def test_run_config_key_fails_before_any_client_trains():
    from fedfuse.config import ConfigError, parse_run_config

    assert parse_run_config({"strategy": "ot", "align-to": "global"}).align_to == "global"
    with pytest.raises(ConfigError, match="'strategy-options.align-to'.*not 'feddf'"):
        parse_run_config({"strategy": "feddf", "align-to": "global"})
    with pytest.raises(ConfigError, match="'strategy-options.align-to'.*one-shot"):
        parse_run_config({"strategy": "rebasin", "align-to": "global", "mode": "one-shot", "num-server-rounds": 1})
    with pytest.raises(ConfigError, match="align-to"):
        parse_run_config({"strategy": "ot", "align-to": "globl"})
