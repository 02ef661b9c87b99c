"""FedFisher (arXiv 2403.12329): the server optimisation, the diagonal and K-FAC Fishers against known answers, the
alignment and misuse (the registry-wide contract is ``tests/test_fusion_contract.py``)."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from torch import nn

from fedfuse.fusion import FusionOptionError, IncompatibleModelsError, MissingInputError, client_statistics, fuse
from fedfuse.fusion import fuse_result
from fedfuse.fusion.permute import build_spec, permute_model, random_perms
from fedfuse.models import build_model

torch.set_num_threads(1)
SHAPE = (1, 8, 8)


def _x(n=64, shape=SHAPE, seed=0):
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


def _mlp(seed=1):
    return build_model("mlp", num_classes=5, input_shape=SHAPE, width=12, depth=2, seed=seed).eval()


def _gap(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


def test_equal_fishers_keep_the_weighted_average():
    """Equal Fishers: the minimiser is the weighted average, where the optimisation starts (gradient 0)."""
    a, b = _mlp(1), _mlp(2)
    st = client_statistics("fedfisher", a, _x())
    fused = fuse("fedfisher", [a, b], statistics=[st, st], weights=[0.25, 0.75])
    avg = fuse("average", [a, b], weights=[0.25, 0.75])
    assert _gap(fused, avg) < 1e-6


def test_diagonal_optimisation_approaches_fisher_merging_and_lowers_the_objective():
    """With the diagonal Fisher the objective's minimiser is Fisher merging's closed form: the authors' optimisation
    from the average gets most of the way there in their 2,000 steps."""
    a, b = _mlp(1), _mlp(2)
    sa, sb = client_statistics("fedfisher", a, _x(seed=1)), client_statistics("fedfisher", b, _x(seed=2))
    avg = fuse("average", [a, b], weights=[0.4, 0.6])
    closed = fuse("fisher", [a, b], statistics=[sa, sb], weights=[0.4, 0.6], epsilon=1e-12)

    def objective(m):
        th = {k: v.detach() for k, v in m.named_parameters()}
        return sum(0.5 * p * float((st[k] * (th[k] - dict(c.named_parameters())[k]) ** 2).sum())
                   for p, st, c in ((0.4, sa, a), (0.6, sb, b)) for k in th)
    res = fuse_result("fedfisher", [a, b], statistics=[sa, sb], weights=[0.4, 0.6])
    start, end = res.info["objective"]
    best = objective(closed)
    assert abs(start - objective(avg)) < 1e-6 * start and abs(end - objective(res.model)) < 1e-4 * start
    assert best <= end < start and end - best < 0.05 * (start - best)
    assert _gap(res.model, closed) < 0.7 * _gap(avg, closed)


def test_kfac_factors_of_a_linear_model_are_the_known_ones():
    """A linear softmax model: A = E[ā āᵀ] (ā = [x, 1]) and G = E[diag(p) − p pᵀ], exactly."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 5)).eval()
    x = _x(50)
    st = client_statistics("fedfisher", model, x, kind="kfac", batch_size=16)
    xa = torch.cat([x.flatten(1), torch.ones(50, 1)], 1).double()
    p = model(x).softmax(-1).double()
    torch.testing.assert_close(st["1:A"].double(), xa.T @ xa / 50, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st["1:G"].double(), (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).mean(0),
                               atol=1e-6, rtol=1e-5)


def test_kfac_of_permuted_copies_comes_back_after_alignment():
    a = build_model("lenet", 10, (1, 28, 28), seed=1).eval()
    b = permute_model(a, random_perms(build_spec(a), seed=2))
    x = _x(24, (1, 28, 28))
    sa, sb = (client_statistics("fedfisher", m, x, kind="kfac") for m in (a, b))
    fused = fuse("fedfisher", [a, b], statistics=[sa, sb], kind="kfac", align="weights", steps=50)
    assert _gap(fused, a) < 1e-5
    unaligned = fuse("fedfisher", [a, b], statistics=[sa, sb], kind="kfac", steps=50)
    assert _gap(unaligned, a) > 1e-2


def test_misuse_is_named():
    a, b = _mlp(1), _mlp(2)
    diag = client_statistics("fedfisher", a, _x())
    with pytest.raises(MissingInputError, match="kfac"):
        fuse("fedfisher", [a, b], statistics=[diag, diag], kind="kfac")
    vit = [build_model("vit", num_classes=5, input_shape=SHAPE, width=16, depth=1, num_heads=2, seed=s) for s in (1, 2)]
    with pytest.raises(IncompatibleModelsError, match="kind='diagonal'"):
        fuse("fedfisher", vit, fusion_inputs=_x(), kind="kfac")
    with pytest.raises(FusionOptionError, match="lr"):
        fuse("fedfisher", [a, b], statistics=[diag, diag], lr=0.0)
    with pytest.raises(IncompatibleModelsError):
        fuse("fedfisher", [a, copy.deepcopy(vit[0])], statistics=[diag, diag])
