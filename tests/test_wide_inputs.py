"""Linear neuron interpolation on levels with more inputs than fusion rows (a VGG's 25,088-feature classifier Linear
on a few hundred samples): the least-squares fit in its dual (kernel) form, an ``N × N`` system instead of the
``D × D`` normal equations, and the same ridge solution as the primal form."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from torch import nn

import fedfuse.fusion.interpolation as interpolation
from fedfuse.fusion import fuse
from fedfuse.fusion.grouping import kernel_least_squares, projected_coordinates

torch.set_num_threads(1)


def _wide_mlp(d: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 10)).double().eval()


def _wide_cnn(seed: int) -> nn.Sequential:
    """A conv level of 64 × 3 × 3 + 1 = 577 design columns on 8 samples × 4 positions = 32 rows, BatchNorm folded."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(64, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                      nn.Linear(16 * 2 * 2, 10)).double().eval()
    bn = m[1]
    bn.running_mean.normal_()
    bn.running_var.uniform_(0.5, 1.5)
    return m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture
def eigh_sizes(monkeypatch):
    """The side of every matrix the fits eigendecompose."""
    sizes: list[int] = []
    eigh = torch.linalg.eigh

    def spy(a, *args, **kwargs):
        sizes.append(a.shape[-1])
        return eigh(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", spy)
    return sizes


def test_kernel_least_squares_is_the_primal_fit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 300, generator=g, dtype=torch.float64)
    z = torch.randn(20, 7, generator=g, dtype=torch.float64)
    for ridge in (0.0, 1e-3 * float((x * x).sum()) / x.shape[1]):
        primal = projected_coordinates(x.T @ x, x.T @ z, ridge=ridge)
        dual = kernel_least_squares(x @ x.T, ridge=ridge)
        assert _rel(x.T @ dual.dual(z), primal.coef) < 1e-9
        # coordinates: the same distances between the projected outputs
        c = dual.coords(z)
        assert _rel(torch.cdist(c, c), torch.cdist(primal.coords, primal.coords)) < 1e-9
        assert _rel(torch.cdist(c, c), torch.cdist((x @ primal.coef).T, (x @ primal.coef).T)) < 1e-9


@pytest.mark.parametrize("method", ["kf-linear", "hf-linear"])
def test_self_fusion_with_more_inputs_than_samples_is_exact(method, eigh_sizes):
    """N = 64 fusion samples, D = 3000 inputs: m's function, with no D × D system anywhere."""
    m = _wide_mlp(3000, 0)
    x = torch.randn(64, 3000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        fused = fuse(method, [m, m], fusion_inputs=x)
        assert _rel(fused(x), m(x)) <= 1e-5
    assert eigh_sizes and max(eigh_sizes) <= 64   # the 64 × 64 kernels, never the 3001 × 3001 normal matrix


@pytest.mark.parametrize("case", [
    ("kf-linear", "mlp", {}),
    ("hf-linear", "mlp", {}),
    ("kf-linear", "mlp", {"prior": "zero", "head_target": "probs", "head_ridge": 1e-2}),
    ("kf-linear", "cnn", {}),
    ("hf-linear", "cnn", {"prior": "zero"}),
], ids=lambda c: f"{c[0]}-{c[1]}-{'-'.join(c[2]) or 'defaults'}")
def test_dual_fit_gives_the_primal_weights(case, monkeypatch):
    method, arch, options = case
    if arch == "mlp":
        a, b = _wide_mlp(1000, 0), _wide_mlp(1000, 1)
        x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    else:
        a, b = _wide_cnn(0), _wide_cnn(1)
        x = torch.randn(8, 64, 2, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    dual = fuse(method, [a, b], fusion_inputs=x, **options)
    monkeypatch.setattr(interpolation, "DUAL_ROW_RATIO", 0.0)   # every fit in the primal form
    primal = fuse(method, [a, b], fusion_inputs=x, **options)
    want = primal.state_dict()
    for k, v in dual.state_dict().items():
        if v.is_floating_point():
            assert _rel(v, want[k]) < 1e-8, k


def test_primal_form_is_kept_where_samples_outnumber_inputs(eigh_sizes):
    """D = 41 inputs, N = 64 samples: the normal equations, as before."""
    m = _wide_mlp(40, 0)
    x = torch.randn(64, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fused = fuse("kf-linear", [m, m], fusion_inputs=x)
    with torch.no_grad():
        assert _rel(fused(x), m(x)) <= 1e-5
    assert 41 in eigh_sizes
