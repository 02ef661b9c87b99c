"""RegMean (arXiv 2212.09849) and Fisher merging (arXiv 2111.09832): exactness, the client statistics, alignment,
errors and the device argument (the registry-wide contract is ``tests/test_fusion_contract.py``)."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from torch import nn

from fedfuse.fusion import (FusionOptionError, IncompatibleModelsError, MissingInputError, client_statistics, fuse,
                            fuse_result)
from fedfuse.fusion.fisher import fisher_statistics
from fedfuse.fusion.permute import build_spec, permute_model, random_perms
from fedfuse.fusion.regmean import layer_rows, move_grams, regmean_statistics, weight_matrix
from fedfuse.models import build_model

torch.set_num_threads(1)
SHAPE = (1, 8, 8)


def _lenets(n=2, shape=(1, 28, 28)):
    return [build_model("lenet", 10, shape, seed=s).eval() for s in range(1, n + 1)]


def _cnns(n=2):
    return [build_model("cnn", num_classes=5, input_shape=SHAPE, width=4, depth=2, batchnorm=True, seed=s).eval()
            for s in range(1, n + 1)]


def _x(n=64, shape=SHAPE, seed=0):
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


def _gap(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


# ------------------------------------------------------------------------------------------------- RegMean
@pytest.mark.parametrize("method", ["regmean", "fisher"])
def test_copies_and_a_single_model_come_back(method):
    a = _cnns(1)[0]
    x = _x()
    st = client_statistics(method, a, x)
    assert _gap(fuse(method, [a, copy.deepcopy(a), copy.deepcopy(a)], statistics=[st] * 3, weights=[1, 5, 2]), a) < 1e-5
    assert _gap(fuse(method, [a], statistics=[st]), a) < 1e-5
    assert _gap(fuse(method, [a, copy.deepcopy(a)], fusion_inputs=x), a) < 1e-5   # the public-data variant too


def test_regmean_of_least_squares_fits_is_the_pooled_least_squares_fit():
    """A linear model ``y = W x`` fitted by least squares on each client's data: RegMean with the clients' Gram
    matrices (α = 1, no ridge, sample-count weights) is the least-squares fit on the pooled data, exactly."""
    gen = torch.Generator().manual_seed(0)
    true = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    xs, ys, models = [], [], []
    for i, n in enumerate((40, 90, 25)):
        x = torch.randn(n, 6, generator=gen, dtype=torch.float64) * (1 + i) + i   # different input distributions
        y = x @ true.T + 0.3 * torch.randn(n, 3, generator=gen, dtype=torch.float64)
        m = nn.Sequential(nn.Linear(6, 3, bias=False)).double()
        with torch.no_grad():
            m[0].weight.copy_(torch.linalg.lstsq(x, y).solution.T)
        xs.append(x), ys.append(y), models.append(m)
    stats = [client_statistics("regmean", m, x) for m, x in zip(models, xs)]
    fused = fuse("regmean", models, statistics=stats, weights=[len(x) for x in xs], alpha=1.0, ridge=0.0)
    pooled = torch.linalg.lstsq(torch.cat(xs), torch.cat(ys)).solution.T
    torch.testing.assert_close(fused[0].weight.detach(), pooled, rtol=1e-9, atol=1e-9)
    plain = sum(m[0].weight.detach() * len(x) for m, x in zip(models, xs)) / sum(len(x) for x in xs)
    assert float((plain - pooled).abs().max()) > 1e-2   # not the average


def test_regmean_alpha_zero_is_a_diagonal_weighted_average():
    gen = torch.Generator().manual_seed(1)
    models = [nn.Sequential(nn.Linear(4, 2, bias=False)) for _ in range(2)]
    xs = [torch.randn(30, 4, generator=gen) * s for s in (1.0, 3.0)]
    stats = [client_statistics("regmean", m, x) for m, x in zip(models, xs)]
    fused = fuse("regmean", models, statistics=stats, alpha=0.0, ridge=0.0)
    d = [torch.diagonal(s["0"]).double() for s in stats]
    want = sum(di * m[0].weight.detach().double() for di, m in zip(d, models)) / (d[0] + d[1])
    torch.testing.assert_close(fused[0].weight.detach().double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("conv", [
    nn.Conv2d(3, 4, 3, stride=2, padding=1),
    nn.Conv2d(4, 6, (3, 2), dilation=(2, 1), padding="same", padding_mode="reflect"),
    nn.Conv2d(4, 6, 3, groups=2, padding=1, bias=False),
    nn.Conv1d(4, 5, 3, stride=2, padding=2, padding_mode="circular"),
])
def test_unfolded_rows_times_the_weight_are_the_convolution(conv):
    """The Gram matrix is of the rows the layer multiplies by its weight: im2col patches, padded as the layer pads,
    per group. ``rows @ Wᵀ`` reproduces the convolution's output."""
    torch.manual_seed(0)
    x = torch.randn(2, conv.in_channels, 9, 8) if isinstance(conv, nn.Conv2d) else torch.randn(2, conv.in_channels, 11)
    with torch.no_grad():
        want = conv(x) - (conv.bias.view(1, -1, *[1] * (x.dim() - 2)) if conv.bias is not None else 0)
        rows, w = layer_rows(conv, x), weight_matrix(conv).float()   # [g, N·L, d], [g, out/g, d]
        got = rows @ w.transpose(1, 2)                               # [g, N·L, out/g]
    n, length = x.shape[0], want[0, 0].numel()
    got = got.reshape(conv.groups, n, length, -1).permute(1, 0, 3, 2).reshape(n, conv.out_channels, *want.shape[2:])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    st = regmean_statistics(nn.Sequential(conv), x)["0"]
    assert st.shape == ((w.shape[-1],) * 2 if conv.groups == 1 else (conv.groups, w.shape[-1], w.shape[-1]))


def test_regmean_fuses_a_grouped_and_a_1d_convolution_model():
    models = [nn.Sequential(nn.Conv1d(4, 6, 3, groups=2), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 8, 3)) for _ in range(2)]
    xs = [torch.randn(20, 4, 10), torch.randn(30, 4, 10) + 1]
    stats = [client_statistics("regmean", m, x) for m, x in zip(models, xs)]
    assert stats[0]["0"].shape == (2, 6, 6)
    fused = fuse("regmean", models, statistics=stats)
    assert fused(xs[0]).shape == (20, 3)


def test_regmean_takes_an_input_feature_no_model_sees_as_the_average():
    """A dead input (zero Gram row and column in every model) makes the plain solve singular; the ridge towards the
    weighted average gives its weight column the average, the others the regression."""
    models = [nn.Sequential(nn.Linear(3, 2, bias=False)) for _ in range(2)]
    xs = [torch.randn(20, 3), torch.randn(20, 3)]
    for x in xs:
        x[:, 1] = 0
    stats = [client_statistics("regmean", m, x) for m, x in zip(models, xs)]
    fused = fuse("regmean", models, statistics=stats)
    avg = (models[0][0].weight + models[1][0].weight).detach() / 2
    torch.testing.assert_close(fused[0].weight.detach()[:, 1], avg[:, 1], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="linear algebra failed|singular"):
        fuse("regmean", models, statistics=stats, ridge=0.0)


# -------------------------------------------------------------------------------------------------- Fisher
def test_fisher_with_equal_fishers_is_the_weighted_average():
    a, b = _lenets()
    st = client_statistics("fisher", a, _x(16, (1, 28, 28)), max_samples=8)
    fused = fuse("fisher", [a, b], statistics=[st, st], weights=[0.25, 0.75])
    avg = fuse("average", [a, b], weights=[0.25, 0.75])
    assert _gap(fused, avg) < 1e-6


def test_fisher_weights_each_coordinate_by_its_fisher():
    a, b = (nn.Sequential(nn.Linear(2, 2)) for _ in range(2))
    fa = {k: torch.full_like(v, 3.0) for k, v in a.named_parameters()}
    fb = {k: torch.full_like(v, 1.0) for k, v in b.named_parameters()}
    fb["0.bias"] = torch.tensor([0.0, 9.0])
    fused = fuse("fisher", [a, b], statistics=[fa, fb], epsilon=1e-12)
    want_w = (3 * a[0].weight + b[0].weight) / 4
    want_b = torch.stack([a[0].bias[0], (3 * a[0].bias[1] + 9 * b[0].bias[1]) / 12])
    torch.testing.assert_close(fused[0].weight.detach(), want_w.detach())
    torch.testing.assert_close(fused[0].bias.detach(), want_b.detach())


def _reference_fisher(m: nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The definition, one sample and one class at a time with plain autograd."""
    out = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in m.named_parameters()}
    for i in range(len(x)):
        lp = m(x[i:i + 1]).log_softmax(-1)[0]
        p = lp.exp().detach()
        for c in (range(len(lp)) if y is None else [int(y[i])]):
            gs = torch.autograd.grad(lp[c], list(m.parameters()), retain_graph=True)
            for (k, _), g in zip(m.named_parameters(), gs):
                out[k] += (p[c] if y is None else 1.0) * g.double() ** 2
    return {k: v / len(x) for k, v in out.items()}


@pytest.mark.parametrize("arch", ["lenet", "cnn", "vit"])
@pytest.mark.parametrize("kind", ["exact", "empirical"])
def test_fisher_statistics_are_the_definition(arch, kind):
    """The batched per-sample gradients (Linear / Conv layers from one backward per class, norms and embeddings one
    sample at a time) give the definition: E_x Σ_y p(y|x) (∂ log p(y|x))² (exact) or the true label's (empirical)."""
    shape = (1, 28, 28) if arch == "lenet" else SHAPE
    kw = {"cnn": dict(width=4, depth=2, batchnorm=True), "vit": dict(width=16, depth=1, num_heads=2)}.get(arch, {})
    m = build_model(arch, 5, shape, seed=1, **kw).eval()
    x, y = _x(12, shape), torch.arange(12) % 5
    got = fisher_statistics(m, x, y if kind == "empirical" else None, kind=kind, batch_size=5)
    want = _reference_fisher(m, x, y if kind == "empirical" else None)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k], rtol=1e-4, atol=1e-10 + 1e-4 * float(want[k].abs().max()))


# ----------------------------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("method", ["regmean", "fisher"])
@pytest.mark.parametrize("how", ["weights", "activations"])
def test_aligning_a_permuted_copy_gives_the_model_back(method, how):
    """Client 1 holds a unit-permuted copy of client 0 (independent-initialisation symmetry at its simplest) and its
    statistics computed on its own data in its own units: aligning first recovers the model exactly; without it the
    merge mixes unrelated units."""
    a = _cnns(1)[0]
    b = permute_model(a, random_perms(build_spec(a), seed=4)).eval()
    x = _x(128)
    stats = [client_statistics(method, a, x[:64]), client_statistics(method, b, x[64:])]
    aligned = fuse(method, [a, b], fusion_inputs=x, statistics=stats, align=how)
    with torch.no_grad():
        torch.testing.assert_close(aligned(x), a(x), rtol=1e-4, atol=1e-4)
        assert float((fuse(method, [a, b], statistics=stats)(x) - a(x)).abs().max()) > 1e-2


def test_moved_gram_matrices_are_those_of_the_aligned_model():
    """``P G Pᵀ``: the Gram matrices a client computed in its own units, moved with the permutation, equal those the
    permuted model computes on the same data."""
    from fedfuse.fusion.permute import Map

    a = _lenets(1)[0]
    spec = build_spec(a)
    perms = random_perms(spec, seed=2)
    b = permute_model(a, perms).eval()
    x = _x(32, (1, 28, 28))
    # the maps that move a onto b's units: b's unit j is a's unit perm[j]
    maps = {g: Map.from_perm(perms[g]) if g in perms else Map.identity(grp.size) for g, grp in spec.groups.items()}
    moved = move_grams(regmean_statistics(a, x), a, spec, build_spec(b), maps)
    direct = regmean_statistics(b, x)
    for k in direct:
        torch.testing.assert_close(moved[k], direct[k], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("method", ["regmean", "fisher"])
def test_what_the_methods_cannot_take_is_a_value_error_saying_why(method):
    a, b = _lenets()
    x = _x(8, (1, 28, 28))
    st = client_statistics(method, a, x)
    other = build_model("lenet", 7, (1, 28, 28), seed=3).eval()
    with pytest.raises(IncompatibleModelsError, match="another architecture|shape"):
        fuse(method, [a, other], statistics=[st, client_statistics(method, other, x)])
    with pytest.raises(MissingInputError, match="fusion"):
        fuse(method, [a, b])                              # neither the clients' statistics nor a fusion set
    with pytest.raises(FusionOptionError, match="2 statistics dicts for 3 models"):
        fuse(method, [a, b, b], statistics=[st, st])
    bad = dict(st)
    bad.pop(next(iter(bad)))
    with pytest.raises(MissingInputError, match=r"statistics\[1\] has no"):
        fuse(method, [a, b], statistics=[st, bad])
    wrong = {k: v[..., :1] for k, v in st.items()}
    with pytest.raises(IncompatibleModelsError, match=r"statistics\[0\]\[.*has shape"):
        fuse(method, [a, b], statistics=[wrong, st])
    nan = {k: v.clone() for k, v in st.items()}
    next(iter(nan.values())).view(-1)[0] = float("nan")
    with pytest.raises(FusionOptionError, match="not a finite"):
        fuse(method, [a, b], statistics=[nan, st])
    with pytest.warns(UserWarning, match="PUBLIC-DATA VARIANT"):
        res = fuse_result(method, [a, b], fusion_inputs=x)
    assert res.info["statistics"] == "fusion set (public-data variant)"
    assert fuse_result(method, [a, b], statistics=[st, st]).info["statistics"] == "clients"


def test_regmean_refuses_layers_it_cannot_unfold():
    models = [nn.Sequential(nn.ConvTranspose2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 10 * 10, 3)) for _ in range(2)]
    with pytest.raises(IncompatibleModelsError, match="ConvTranspose2d"):
        fuse("regmean", models, fusion_inputs=torch.randn(4, 1, 8, 8))


def test_statistics_for_a_method_that_reads_none_and_a_client_function_for_it_are_errors():
    a, b = _lenets()
    st = client_statistics("regmean", a, _x(4, (1, 28, 28)))
    with pytest.raises(FusionOptionError, match="reads no per-model statistics.*fisher.*regmean"):
        fuse("average", [a, b], statistics=[st, st])
    with pytest.raises(FusionOptionError, match="reads no client statistics"):
        client_statistics("kf-linear", a, _x(4, (1, 28, 28)))
    with pytest.raises(MissingInputError, match="labels"):
        client_statistics("fisher", a, _x(4, (1, 28, 28)), kind="empirical")


def test_alignment_needs_a_model_fedfuse_can_permute_and_activation_matching_a_fusion_set():
    a, b = _lenets()
    st = [client_statistics("regmean", m, _x(8, (1, 28, 28))) for m in (a, b)]
    with pytest.raises(MissingInputError, match="align='activations' needs fusion_inputs"):
        fuse("regmean", [a, b], statistics=st, align="activations")
    assert fuse("regmean", [a, b], statistics=st, align="weights")(_x(2, (1, 28, 28))).shape == (2, 10)


# ------------------------------------------------------------------------------------------------- device
@pytest.mark.parametrize("method", ["regmean", "fisher"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_statistics_and_fusion_run_on_the_device_given(method, device):
    a, b = _cnns()
    x = _x(32)
    st = [client_statistics(method, m, x, device=device) for m in (a, b)]
    assert all(v.device.type == "cpu" for s in st for v in s.values())
    fused = fuse(method, [a, b], statistics=st, device=device)
    assert all(t.device.type == "cpu" for t in fused.state_dict().values())
    assert all(t.device.type == "cpu" for m in (a, b) for t in m.state_dict().values())
    if device == "cuda":   # the CPU result, up to float rounding
        cpu_st = [client_statistics(method, m, x) for m in (a, b)]
        torch.testing.assert_close(fused(x), fuse(method, [a, b], statistics=cpu_st)(x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("method", ["average", "regmean", "fisher"])
def test_float64_models_are_left_as_they_were(method):
    """The weighted average's float64 accumulator was model 0's own tensor for a float64 model (``.double()`` of a
    float64 tensor is that tensor) and ``mul_`` scaled the caller's weights in place."""
    a, b = (nn.Sequential(nn.Linear(3, 2)).double() for _ in range(2))
    x = torch.randn(8, 3, dtype=torch.float64)
    before = [copy.deepcopy(m.state_dict()) for m in (a, b)]
    st = [client_statistics(method, m, x) for m in (a, b)] if method != "average" else None
    fuse(method, [a, b], statistics=st)
    assert all(torch.equal(s[k], m.state_dict()[k]) for s, m in zip(before, (a, b)) for k in s)
