"""Matching finds a permuted copy's permutation back on timm's ResNet as timm builds it (zoo table, check iii).

timm zero-initialises the last BatchNorm of every residual branch (``zero_init_last``): on a fresh model each block's
``bn2`` outputs exactly 0. The generic reader used to read a residual stream's activations at one of those norms
only, so ``rebasin`` and ``ot`` saw a constant cost for the stream groups, kept the identity, and
``fuse(method, [m, P(m)])`` was off by a relative error of about 1. The reader now reads a group at every norm that
writes its units (``graph._activation_sites``). ``tests/test_any_model.py`` perturbs the norms before its checks, which
hid the zero-initialised case; this test keeps the model as timm makes it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fedfuse.fusion import fuse
from fedfuse.fusion.permute import build_spec, reset_bn_stats
from fedfuse.fusion.permute.maps import permute_model, random_perms
from fedfuse.models import set_example_input

timm = pytest.importorskip("timm")

X = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _f64(model: nn.Module) -> torch.Tensor:
    """Outputs on ``X`` in float64, so float32 round-off is not mistaken for a wrong permutation."""
    with torch.no_grad():
        return copy.deepcopy(model).double().eval()(X.double())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    m = timm.create_model("resnet18", num_classes=10).eval()
    set_example_input(m, X)
    reset_bn_stats(m, X)
    m.eval()
    p = permute_model(m, random_perms(build_spec(m), seed=1)).eval()
    set_example_input(p, X)
    return m, p


def test_the_case_is_timms_zero_initialised_residual_branch(pair):
    m, _ = pair
    assert all(not blk.bn2.weight.detach().any() for layer in (m.layer1, m.layer2, m.layer3, m.layer4)
               for blk in layer)


def test_every_stream_group_is_read_where_its_units_are_not_all_zero(pair):
    m, _ = pair
    spec = build_spec(m)
    stream = spec.groups["conv1"]   # the stem's stream: written by bn1 and by layer1's blocks' bn2
    assert [path for path, _, _ in stream.acts] == ["bn1", "layer1.0.bn2", "layer1.1.bn2"]


@pytest.mark.parametrize("method", ["rebasin", "ot"])
def test_matching_undoes_a_permutation_of_timm_resnet18(pair, method):
    m, p = pair
    y = _f64(m)
    assert _rel(_f64(p), y) <= 1e-5, "P(m) must compute m's function"
    assert _rel(_f64(fuse(method, [m, p], fusion_inputs=X)), y) <= 1e-5
