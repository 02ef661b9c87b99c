"""``fuse('stack')``: the models side by side with one classifier over their concatenated features, and the head
round solving that classifier from the clients' statistics (``fedfuse.fusion.stack``)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from torch import nn

from fedfuse.fusion import IncompatibleModelsError, MissingInputError, fuse, fuse_result
from fedfuse.fusion.stack import Stacked
from fedfuse.models import build_model
from fedfuse.progressive import _ridge_solve, _with_bias, head_statistics, solve_head, with_head

torch.set_num_threads(1)
SHAPE = (1, 8, 8)


def _models(n=3, classes=4):
    return [build_model("cnn", num_classes=classes, input_shape=SHAPE, seed=s, width=4, depth=2).eval()
            for s in range(1, n + 1)]


def _x(n=64, seed=0):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


def test_the_head_round_on_a_stack_is_the_pooled_ridge_on_the_concatenated_features():
    models, x = _models(), _x(90)
    y = torch.arange(90) % 4
    stacked = fuse("stack", models, fusion_inputs=_x(40, 1))
    assert isinstance(stacked, Stacked)
    feats = stacked.features(x).detach()
    assert feats.shape[1] == stacked.head.in_features == sum(m[-1].in_features for m in models)
    # three clients' statistics of their own parts give the pooled data's ridge classifier
    stats = [head_statistics(stacked, x[k::3], y[k::3], 4) for k in range(3)]
    head = solve_head(stats, ridge=1e-3)
    f = _with_bias(feats.double())
    want = _ridge_solve(f.T @ f, f.T @ nn.functional.one_hot(y, 4).double(), 1e-3 * len(y))
    assert torch.allclose(head.weight.double(), want[:-1].T, atol=1e-4)
    with_head(stacked, head)
    assert torch.allclose(stacked(x).double(), f @ want, atol=1e-4)


def test_logits_features_are_the_members_outputs():
    models, x = _models(), _x()
    stacked = fuse("stack", models, features="logits", head="average", weights=[1, 1, 2])
    assert stacked.head.in_features == 3 * 4
    with torch.no_grad():
        want = sum(w * m(x) for w, m in zip([0.25, 0.25, 0.5], models))
        assert torch.allclose(stacked(x), want, atol=1e-5)


def test_the_fitted_head_imitates_the_ensemble_better_than_the_averaged_one():
    models, x = _models(), _x(200)
    avg = fuse_result("stack", models, head="average").model
    res = fuse_result("stack", models, fusion_inputs=x)
    assert res.info["head"] == "fit"
    start, end = res.info["fit-loss"]
    assert end < start
    with torch.no_grad():
        ens = sum(m(x).softmax(-1) for m in models) / 3
        kl = [float((ens * (ens.log() - m(x).log_softmax(-1))).sum(-1).mean()) for m in (avg, res.model)]
    assert kl[1] < kl[0]


def test_members_of_different_widths_and_families_stack():
    a = build_model("cnn", num_classes=4, input_shape=SHAPE, seed=1, width=4, depth=2).eval()
    b = build_model("mlp", num_classes=4, input_shape=SHAPE, seed=2, width=7, depth=2).eval()
    stacked = fuse("stack", [a, b], fusion_inputs=_x())
    assert stacked(_x()).shape == (64, 4)
    assert stacked.head.in_features == a[-1].in_features + b[-1].in_features


def test_misuse_is_a_clear_error():
    with pytest.raises(MissingInputError, match="head='fit' needs a fusion set"):
        fuse("stack", _models(), head="fit")
    with pytest.raises(ValueError, match="features must be one of"):
        fuse("stack", _models(), features="pixels")
    mixed = _models(2) + _models(1, classes=3)
    with pytest.raises(IncompatibleModelsError, match="different numbers of classes"):
        fuse("stack", mixed, fusion_inputs=_x())


def test_models_the_adapters_cannot_read_are_refused_by_name():
    class Opaque(nn.Module):   # no classifier layer to read features before
        def forward(self, x):
            return x.flatten(1)[:, :4] * 2

    with pytest.raises(IncompatibleModelsError, match="stack"):
        fuse("stack", [Opaque(), Opaque()], fusion_inputs=_x())


@pytest.mark.parametrize("name", ["stack", "ensemble"])
def test_the_run_config_says_a_library_method_is_not_a_strategy(name):
    """``strategy='stack'`` fails the config check before any client trains, naming the key and saying why."""
    from fedfuse.config import ConfigError, parse_run_config

    with pytest.raises(ConfigError, match=rf"'strategy': '{name}' is a fusion method of the library .* not one model"):
        parse_run_config({"strategy": name, "mode": "one-shot", "num-server-rounds": 1})
