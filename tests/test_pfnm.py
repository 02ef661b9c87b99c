"""PFNM (arXiv 1905.12022): the matching finds permuted copies, opens new units for unrelated ones, the class layer
follows the class counts, the grown model takes the head round, and misuse is named (the registry-wide contract is
``tests/test_fusion_contract.py``)."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
from torch import nn

from fedfuse.fusion import FusionOptionError, IncompatibleModelsError, MissingInputError, client_statistics, fuse
from fedfuse.fusion.permute import build_spec, permute_model, random_perms
from fedfuse.fusion.pfnm import PFNMOptions, match_units
from fedfuse.models import build_model
from fedfuse.progressive import head_statistics, solve_classifier, with_head

torch.set_num_threads(1)
SHAPE = (1, 8, 8)
# a tight likelihood (σ² 1e-6: a mismatch costs ‖Δw‖²/(4σ²)) and a narrow prior (σ0² 0.01: matching equal units
# gains about ‖w‖²/(2σ0²) over opening a unit each, against the popularity terms' few nats); the posterior mean is
# the matched units' mean up to a relative 1e-4 / J
SHARP = dict(sigma_sq=1e-6, sigma0_sq=1e-2)


def _x(n=64, shape=SHAPE, seed=0):
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


def _mlp(seed=1, classes=5):
    return build_model("mlp", num_classes=classes, input_shape=SHAPE, width=12, depth=2, seed=seed).eval()


def test_permuted_copies_are_matched_back_to_the_model():
    a = _mlp()
    b = permute_model(a, random_perms(build_spec(a), seed=3))
    x = _x()
    fused = fuse("pfnm", [a, b, copy.deepcopy(a)], **SHARP)
    assert [m.out_features for m in fused if isinstance(m, nn.Linear)] == [12, 12, 5]
    torch.testing.assert_close(fused(x), a(x), atol=1e-4, rtol=1e-4)


def test_lenet_with_batchnorm_folded_and_permuted_is_matched_back():
    a = build_model("cnn", num_classes=5, input_shape=SHAPE, width=4, depth=2, batchnorm=True, seed=1).eval()
    with torch.no_grad():   # non-trivial running statistics, so the folding matters
        for m in a.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    b = permute_model(a, random_perms(build_spec(a), seed=4))
    x = _x()
    fused = fuse("pfnm", [a, b], **SHARP)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    torch.testing.assert_close(fused(x), a(x), atol=1e-4, rtol=1e-4)


def test_unrelated_units_open_new_global_units_and_the_model_grows():
    rows = [np.eye(4) * 10.0, -np.eye(4) * 10.0]          # far apart under a tight likelihood: no match pays
    assign, glob = match_units(rows, np.zeros(4), PFNMOptions(**SHARP), np.random.default_rng(0))
    assert glob.shape == (8, 4) and sorted(assign[0] + assign[1]) == list(range(8))
    same = [np.eye(4) * 10.0, np.eye(4)[[2, 0, 3, 1]] * 10.0]   # the same units, permuted: matched, no growth
    assign, glob = match_units(same, np.zeros(4), PFNMOptions(**SHARP), np.random.default_rng(0))
    assert glob.shape == (4, 4) and assign[1] == [assign[0][i] for i in (2, 0, 3, 1)]
    np.testing.assert_allclose(glob[assign[0]], np.eye(4) * 10.0, atol=1e-3)


def test_posterior_mean_is_the_papers_shrinkage():
    """One unit per client, identical: matched, global = (μ0/σ0² + Σ w/σ²) / (1/σ0² + J/σ²). (A unit of norm ~2.3
    is not matched at σ² = σ0² = 1: matching gains ‖w‖²/6 over two units, less than the popularity terms.)"""
    w = np.array([[3.0, -6.0, 1.5]])
    o = PFNMOptions(sigma_sq=1.0, sigma0_sq=1.0, mu0=0.0)
    _, glob = match_units([w, w.copy(), w.copy()], np.array([0.0, 0.0, 0.1]), o, np.random.default_rng(0))
    np.testing.assert_allclose(glob, (np.array([[0.0, 0.0, 0.1]]) + 3 * w) / 4)


def test_class_layer_follows_the_class_counts():
    a = _mlp(classes=3)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[-1].weight.add_(1.0)
        b[-1].bias.add_(2.0)
    counts = [{"class_counts": torch.tensor([10.0, 0.0, 5.0])}, {"class_counts": torch.tensor([0.0, 4.0, 5.0])}]
    fused = fuse("pfnm", [a, b], statistics=counts, **SHARP)
    want_w = torch.stack([a[-1].weight[0], b[-1].weight[1], 0.5 * (a[-1].weight[2] + b[-1].weight[2])])
    want_b = torch.stack([a[-1].bias[0], b[-1].bias[1], 0.5 * (a[-1].bias[2] + b[-1].bias[2])])
    torch.testing.assert_close(fused[-1].weight, want_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused[-1].bias, want_b, atol=1e-5, rtol=1e-5)


def test_client_statistics_are_class_counts_and_need_labels():
    a = _mlp(classes=3)
    st = client_statistics("pfnm", a, _x(6), torch.tensor([0, 2, 2, 1, 2, 0]))
    assert torch.equal(st["class_counts"], torch.tensor([2.0, 1.0, 3.0], dtype=torch.float64))
    with pytest.raises(MissingInputError, match="labels"):
        client_statistics("pfnm", a, _x(6))


def test_grown_lenet_takes_the_head_round():
    a, b = (build_model("lenet", 10, (1, 28, 28), seed=s).eval() for s in (1, 2))
    x, y = _x(40, (1, 28, 28)), torch.arange(40) % 10
    fused = fuse("pfnm", [a, b])
    widths = [m.out_channels if isinstance(m, nn.Conv2d) else m.out_features for m in fused
              if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert widths[:4] != [6, 16, 120, 84] and widths[-1] == 10     # random inits: new global units opened
    headed = with_head(copy.deepcopy(fused), solve_classifier([head_statistics(fused, x, y, 10)], "ridge"))
    assert headed(x).shape == (40, 10)


def test_misuse_is_named():
    a = _mlp()
    with pytest.raises(IncompatibleModelsError, match="class_counts"):
        fuse("pfnm", [a, _mlp(2)], statistics=[{"counts": torch.ones(5)}] * 2)
    with pytest.raises(IncompatibleModelsError, match="classes"):
        fuse("pfnm", [a, _mlp(2, classes=4)])
    with pytest.raises(IncompatibleModelsError):
        fuse("pfnm", [nn.Sequential(nn.Flatten(), nn.Linear(64, 5))] * 2)     # no hidden layer
    vit = [build_model("vit", num_classes=5, input_shape=SHAPE, width=16, depth=1, num_heads=2, seed=s) for s in (1, 2)]
    with pytest.raises(IncompatibleModelsError):
        fuse("pfnm", vit)
    with pytest.raises(FusionOptionError, match="gamma"):
        fuse("pfnm", [a, _mlp(2)], gamma=0.0)
