"""TransFusion (fedfuse.fusion.transfusion) and task-vector transport (fedfuse.rebase)."""

import pytest
import torch

from fedfuse.fusion import fuse
from fedfuse.fusion.permute import build_spec, permute_model, random_perms
from fedfuse.fusion.transfusion import spectral_head_cost
from fedfuse.models import build_model
from fedfuse.rebase import match_bases, permute_task_vector, task_vector, transport

SHAPE = (1, 8, 8)


def _vit(seed=0, width=16, heads=4, depth=2):
    return build_model("vit", input_shape=SHAPE, width=width, depth=depth, num_heads=heads, seed=seed).eval()


def _perturbed(model, seed, scale=0.05):
    """A "fine-tuned" copy: every float tensor moved by a random delta."""
    ft = build_model("vit", input_shape=SHAPE, width=model.embed_dim, depth=len(model.blocks),
                     num_heads=model.blocks[0].attn.num_heads, seed=0).eval()
    g = torch.Generator().manual_seed(seed)
    ft.load_state_dict({k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                        for k, v in model.state_dict().items()})
    return ft


def test_heads_permuted_copy_recovered_by_transfusion():
    m = _vit()
    spec = build_spec(m)
    perms = random_perms(spec, seed=3)
    p = permute_model(m, perms)
    x = torch.randn(48, *SHAPE)
    with torch.no_grad():
        assert (p(x) - m(x)).abs().max() < 1e-5
        fused = fuse("transfusion", [m, p, permute_model(m, random_perms(spec, seed=4))])
        assert (fused(x) - m(x)).abs().max() < 1e-5
    # the head order was really scrambled
    assert not torch.equal(perms["blocks.0.attn"][::4] // 4, torch.arange(4))


def test_spectral_distance_zero_for_permuted_head():
    m = _vit()
    spec = build_spec(m)
    p = permute_model(m, random_perms(spec, seed=3))
    perm = random_perms(spec, seed=3)["blocks.1.attn"]
    d = spectral_head_cost(p.state_dict(), m.state_dict(), spec, spec, "blocks.1.attn")
    head_of = perm.view(4, 4)[:, 0] // 4  # p's head j is m's head head_of[j]
    for j in range(4):
        assert d[j, head_of[j]] < 1e-8
        assert d[j].min() == d[j, head_of[j]]
    assert (d.sum() > 1e-3)


def test_transfusion_other_families_and_bad_inputs():
    mlp = build_model("mlp", input_shape=SHAPE, width=16, seed=0).eval()
    x = torch.randn(16, *SHAPE)
    p = permute_model(mlp, random_perms(build_spec(mlp), seed=1))
    with torch.no_grad():
        assert (fuse("transfusion", [mlp, p])(x) - mlp(x)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="equal widths"):
        fuse("transfusion", [_vit(width=16), _vit(width=32)])
    with pytest.raises(ValueError, match="heads"):
        fuse("transfusion", [_vit(heads=4), _vit(heads=2)])


def test_transport_alpha_zero_returns_to_base():
    a, b = _vit(0), _vit(1)
    tau = task_vector(_perturbed(a, 5), a)
    out = transport(tau, a, b, alpha=0.0)
    for k, v in b.state_dict().items():
        assert torch.equal(out.state_dict()[k], v), k
    assert out is not b


@pytest.mark.parametrize("residual", ["untied", "tied"])
def test_transport_between_base_and_permuted_copy_is_exact(residual):
    a = _vit(0)
    perms = random_perms(build_spec(a), seed=7)
    b = permute_model(a, perms)              # the "new release" is a permuted copy of the old one
    ft = _perturbed(a, 11)
    tau = task_vector(ft, a)
    moved = transport(tau, a, b, alpha=1.0, residual=residual)
    expected = permute_model(ft, perms)      # θ_B + π(τ) must equal π(θ_A + τ)
    for k, v in expected.state_dict().items():
        assert torch.allclose(moved.state_dict()[k], v, atol=1e-6), k
    x = torch.randn(32, *SHAPE)
    with torch.no_grad():
        assert (moved(x) - ft(x)).abs().max() < 1e-4
        naive = b.state_dict()
        naive = {k: v + tau.get(k, 0) for k, v in naive.items()}
        nb = _vit(0)
        nb.load_state_dict(naive)
        assert (nb(x) - ft(x)).abs().max() > 1e-2   # adding τ unpermuted is wrong (the test can fail)


def test_transport_is_linear_and_reuses_maps():
    a, b = _vit(0), _vit(1)
    t1, t2 = task_vector(_perturbed(a, 1), a), task_vector(_perturbed(a, 2), a)
    maps, sa, sb = match_bases(a, b)
    like = b.state_dict()
    p1 = permute_task_vector(t1, maps, sa, sb, like)
    p2 = permute_task_vector(t2, maps, sa, sb, like)
    p12 = permute_task_vector({k: t1[k] + t2[k] for k in t1}, maps, sa, sb, like)
    for k in p12:
        assert torch.allclose(p12[k], p1[k] + p2[k], atol=1e-6)
    m1 = transport(t1, a, b, alpha=0.5, maps=maps)
    m2 = transport(t1, a, b, alpha=0.5)
    for k, v in m1.state_dict().items():
        assert torch.allclose(v, m2.state_dict()[k])


def test_transport_head_absolute_and_bad_inputs():
    a = _vit(0)
    perms = random_perms(build_spec(a), seed=7)
    b = permute_model(a, perms)
    ft = _perturbed(a, 3)
    moved = transport(task_vector(ft, a), a, b, head="absolute", alpha=0.0)
    x = torch.randn(8, *SHAPE)
    assert torch.allclose(moved.head.bias, ft.head.bias)
    with pytest.raises(ValueError, match="dict"):
        transport(ft, a, b)
    with pytest.raises(ValueError, match="finite"):
        transport(task_vector(ft, a), a, b, alpha=float("nan"))
    with pytest.raises(ValueError, match="not a parameter"):
        transport({"nope": torch.zeros(1)}, a, b)
    with pytest.raises(ValueError, match="shape"):
        transport({"head.bias": torch.zeros(3)}, a, b)
    with pytest.raises(ValueError, match="incompatible"):
        transport(task_vector(ft, a), a, _vit(0, width=32))
    with pytest.raises(ValueError, match="head"):
        transport(task_vector(ft, a), a, b, head="sideways")
    del x
