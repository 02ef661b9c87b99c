"""Tests for ``fedfuse.tofu`` (Token Fusion, paper seed 004; spec ot-transfusion-tofu.md §3.7)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse import tofu
from fedfuse.models import build_model, level_outputs
from timm.models.vision_transformer import VisionTransformer

torch.set_num_threads(1)


def _vit2d(reg_tokens: int = 0, depth: int = 4, seed: int = 0) -> nn.Module:
    # 16×16 images, patch 2 → 64 patches (+ CLS + registers)
    return build_model("vit", 10, (1, 16, 16), width=32, depth=depth, seed=seed, patch_size=2,
                       reg_tokens=reg_tokens).eval()


def _vit1d(depth: int = 6, seed: int = 0) -> nn.Module:
    # MNIST-1D-sized signals [N, 1, 40], patch 1 → 40 tokens + CLS
    return build_model("vit", 10, (1, 40), width=32, depth=depth, seed=seed, patch_size=1).eval()


def _timm_regs(global_pool: str = "token", class_token: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=4, in_chans=3, num_classes=7, embed_dim=48, depth=4,
                             num_heads=3, reg_tokens=4, class_token=class_token, global_pool=global_pool,
                             init_values=1e-2, qk_norm=True).eval()


MODELS = {
    "vit2d": (_vit2d, (3, 1, 16, 16)),
    "vit2d_regs": (lambda: _vit2d(reg_tokens=2), (3, 1, 16, 16)),
    "vit1d": (_vit1d, (3, 1, 40)),
    "timm_regs": (_timm_regs, (3, 3, 32, 32)),
    "timm_regs_avg_nocls": (lambda: _timm_regs("avg", class_token=False), (3, 3, 32, 32)),
}


def _input(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------- identity

@pytest.mark.parametrize("name", list(MODELS))
def test_r0_outputs_identical(name: str) -> None:
    make, shape = MODELS[name]
    model, x = make(), _input(shape)
    with torch.no_grad():
        ref = model(x)
        tofu.apply(model, r=0)
        assert tofu.is_applied(model)
        out = model(x)
    assert torch.equal(ref, out)


@pytest.mark.parametrize("name", list(MODELS))
def test_remove_restores_exact_model(name: str) -> None:
    make, shape = MODELS[name]
    model, x = make(), _input(shape)
    cls, block_cls = type(model), type(model.blocks[0])
    keys = list(model.state_dict())
    with torch.no_grad():
        ref = model(x)
        tofu.apply(model, r=6)
        changed = model(x)
        tofu.remove(model)
        back = model(x)
    assert not torch.equal(ref, changed)  # ToFu really changed the computation
    assert torch.equal(ref, back)
    assert type(model) is cls and all(type(b) is block_cls for b in model.blocks)
    assert not tofu.is_applied(model) and not hasattr(model, "_tofu_state")
    assert list(model.state_dict()) == keys


def test_context_managers_restore() -> None:
    model, x = _vit1d(), _input((2, 1, 40))
    ref = tofu.token_counts(model, x)
    with tofu.tofu(model, r=4) as m:
        assert m is model and tofu.token_counts(model, x)[-1] < ref[-1]
        with tofu.suspended(model):
            with tofu.suspended(model):  # re-entrant
                assert tofu.token_counts(model, x) == ref
            assert tofu.token_counts(model, x) == ref
        assert tofu.token_counts(model, x)[-1] < ref[-1]
    assert not tofu.is_applied(model) and tofu.token_counts(model, x) == ref
    with tofu.suspended(model):  # no-op on unpatched models
        assert tofu.token_counts(model, x) == ref


# ---------------------------------------------------------------------------------------- token counts

@pytest.mark.parametrize("merge", ["mlerp", "average", "prune"])
def test_token_count_shrinks_by_r_per_block(merge: str) -> None:
    model, x = _vit1d(depth=6), _input((2, 1, 40))
    tofu.apply(model, r=5, merge=merge)
    counts = tofu.token_counts(model, x)
    assert counts[0] == 41
    assert counts == [41, 36, 31, 26, 21, 16, 11]


def test_token_count_clipped_never_below_protected_plus_one() -> None:
    model, x = _vit2d(reg_tokens=2, depth=8), _input((2, 1, 16, 16))
    p = model.num_prefix_tokens
    tofu.apply(model, r=40)  # far more than available
    counts = tofu.token_counts(model, x)
    expect = [64 + p]
    for _ in range(8):
        n = expect[-1]
        expect.append(n - (n - p) // 2)  # r capped at ⌊(N − protected)/2⌋
    assert counts == expect
    assert min(counts) >= p + 1 and counts[-1] == p + 1


def test_per_block_r_schedule() -> None:
    model, x = _vit1d(depth=6), _input((2, 1, 40))
    tofu.apply(model, r=[0, 3, 0, 7, 1, 2])
    assert tofu.token_counts(model, x) == [41, 41, 38, 38, 31, 30, 28]
    with pytest.raises(ValueError):
        tofu.apply(model, r=[1, 2])


# ------------------------------------------------------------------------------------- protected tokens

@pytest.mark.parametrize("name", ["vit2d_regs", "timm_regs", "vit1d"])
def test_protected_tokens_survive_in_front(name: str) -> None:
    make, shape = MODELS[name]
    model, x = make(), _input(shape)
    p = model.num_prefix_tokens
    with torch.no_grad():
        ref_tokens = model.blocks[0](_embed(model, x))
    tofu.apply(model, r=100)  # maximal reduction: halve the non-protected tokens in every block
    source, size, _ = tofu.token_trace(model, x)
    counts = tofu.token_counts(model, x)
    assert source.shape[1] == counts[-1] <= p + (counts[0] - p) // 2 ** len(model.blocks) + 1
    assert torch.equal(source[:, :p], torch.arange(p).expand(len(x), p))  # CLS/registers kept, in order
    assert torch.all(size[:, :p] == 1)  # nothing merged into them
    # every patch is accounted for by the surviving patch tokens
    assert torch.all(size[:, p:].sum(dim=(1, 2)) == source.new_tensor(x.shape[0] * [0]) + _n_patches(model))
    # block 0 reduces after attention: protected token values equal the unpatched block's
    with torch.no_grad():
        out0 = model.blocks[0](_embed(model, x))
    torch.testing.assert_close(out0[:, :p], ref_tokens[:, :p], rtol=1e-5, atol=1e-6)


def _n_patches(model: nn.Module) -> int:
    return model.patch_embed.num_patches


def _embed(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from fedfuse.models.vit import vit_embed
    return vit_embed(model, x)


def test_sizes_sum_to_patch_count() -> None:
    model, x = _vit2d(reg_tokens=2), _input((3, 1, 16, 16))
    for merge in ("mlerp", "average", "prune"):
        tofu.apply(model, r=7, merge=merge)
        _, size, _ = tofu.token_trace(model, x)
        assert torch.allclose(size.sum(dim=(1, 2)), torch.full((3,), 64.0 + model.num_prefix_tokens))


def test_bsm_never_selects_protected_tokens() -> None:
    # prefix tokens are exact duplicates of B tokens: unprotected, they would be chosen first
    g = torch.Generator().manual_seed(0)
    b, p, n, c = 2, 2, 10, 8
    metric = torch.randn(b, n, c, generator=g)
    metric[:, 0] = metric[:, 3]
    metric[:, 2] = metric[:, 5]  # offset 0 (A) duplicates offset 3 (B) when protect=0
    unm, src, dst = tofu.bipartite_soft_matching(metric, r=1, protect=0)
    assert torch.all(src[:, 0] == 0)  # without protection token 0 (the "CLS") is the first source
    unm, src, dst = tofu.bipartite_soft_matching(metric, r=4, protect=p)
    # indices are into the non-protected tokens: A = p + 2*i; the duplicate pair (2, 5) is A0→B1
    assert torch.all(src[:, 0] == 0) and torch.all(dst[:, 0] == 1)
    assert src.shape == (b, 4) and unm.shape == (b, 0)


# ------------------------------------------------------------------------------------------ merge maths

def _merge_case(mode: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    b, n, c, p = 2, 13, 6, 1
    x = torch.randn(b, n, c, generator=g) * torch.rand(b, n, 1, generator=g) * 3
    size = torch.ones(b, n, 1)
    na, nb = len(range(p, n, 2)), len(range(p + 1, n, 2))
    # four sources, two of them share destination 1 → sets of size 3 and 2
    src = torch.tensor([[0, 2, 3, 5]]).expand(b, -1)
    dst = torch.tensor([[1, 1, 4, 0]]).expand(b, -1)
    unm = torch.tensor([[1, 4]]).expand(b, -1)
    assert na == 6 and nb == 6
    out, out_size, _ = tofu.merge_tokens(x, size, unm, src, dst, p, mode)
    return x, out, out_size, src, dst, p


def test_mlerp_keeps_max_norm_and_mean_direction() -> None:
    x, out, out_size, src, dst, p = _merge_case("mlerp")
    xa, xb = x[:, p::2], x[:, p + 1::2]
    dst_out = out[:, p + 2:]  # after protected + 2 unchanged A tokens
    assert out.shape[1] == x.shape[1] - 4
    for bi in range(x.shape[0]):
        for d in range(xb.shape[1]):
            members = [xb[bi, d]] + [xa[bi, s] for s, t in zip(src[bi].tolist(), dst[bi].tolist()) if t == d]
            members_t = torch.stack(members)
            got = dst_out[bi, d]
            torch.testing.assert_close(got.norm(), members_t.norm(dim=-1).max(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, tofu.mlerp(members_t), rtol=1e-5, atol=1e-6)
            assert torch.nn.functional.cosine_similarity(got, members_t.mean(0), dim=0) > 1 - 1e-5
            assert out_size[bi, p + 2 + d, 0] == len(members)


def test_average_is_mean_and_shrinks_norm() -> None:
    x, out, _, src, dst, p = _merge_case("average")
    xa, xb = x[:, p::2], x[:, p + 1::2]
    merged = out[:, p + 2 + 1]  # destination 1 received two sources
    members = torch.stack([xb[:, 1], xa[:, 0], xa[:, 2]], dim=1)
    torch.testing.assert_close(merged, members.mean(1), rtol=1e-5, atol=1e-6)
    assert torch.all(merged.norm(dim=-1) < members.norm(dim=-1).max(dim=1).values)


def test_prune_drops_sources_keeps_others_exact() -> None:
    x, out, out_size, src, dst, p = _merge_case("prune")
    xa, xb = x[:, p::2], x[:, p + 1::2]
    assert torch.equal(out[:, :p], x[:, :p])
    assert torch.equal(out[:, p:p + 2], xa[:, [1, 4]])
    assert torch.equal(out[:, p + 2:], xb)
    assert out_size[0, p + 2 + 1, 0] == 3  # sizes passed on (prune_passes_size)


@pytest.mark.parametrize("mode", ["average", "mlerp"])
def test_merging_duplicates_is_lossless(mode: str) -> None:
    g = torch.Generator().manual_seed(5)
    b, c = 2, 8
    base = torch.randn(b, 6, c, generator=g)
    x = torch.cat([torch.randn(b, 1, c, generator=g), base.repeat_interleave(2, dim=1)], dim=1)  # A_i == B_i
    unm, src, dst = tofu.bipartite_soft_matching(x, r=6, protect=1)
    assert torch.equal(src.sort(-1).values, dst.sort(-1).values)  # every A found its twin
    out, size, _ = tofu.merge_tokens(x, torch.ones(b, 13, 1), unm, src, dst, 1, mode)
    torch.testing.assert_close(out[:, 1:], base, rtol=1e-5, atol=1e-6)
    assert torch.all(size[:, 1:] == 2)


# ------------------------------------------------------------------------------------------- attention

@pytest.mark.parametrize("fused", [True, False])
def test_attention_with_keys_matches_timm(fused: bool) -> None:
    model = _timm_regs()
    attn = model.blocks[1].attn
    attn.fused_attn = fused
    x = _input((2, 68, 48))
    with torch.no_grad():
        ref = attn(x)
        out, k_mean = tofu.attention_with_keys(attn, x)
        k = attn.k_norm(attn.qkv(x).reshape(2, 68, 3, 3, 16)[:, :, 1].transpose(1, 2))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k_mean, k.mean(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_proportional_attention_equals_duplicated_keys(fused: bool) -> None:
    # a token of size s must be attended to like s identical copies of it
    model = _vit1d()
    attn = model.blocks[0].attn
    attn.fused_attn = fused
    x = _input((1, 5, 32))
    sizes = torch.tensor([1, 3, 1, 2, 1])
    expanded = x.repeat_interleave(sizes, dim=1)
    with torch.no_grad():
        out, _ = tofu.attention_with_keys(attn, x, sizes.float().view(1, 5, 1))
        ref = attn(expanded)
    first = torch.cumsum(sizes, 0) - sizes
    torch.testing.assert_close(out, ref[:, first], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- activation collection

def _raw_level_outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    from fedfuse.models import levels

    outs, h = [], x
    for lv in levels(model):
        h = lv.run(h)
        outs.append(h)
    return outs


def test_level_outputs_match_under_suspended() -> None:
    model, x = _vit2d(reg_tokens=1), _input((4, 1, 16, 16))
    with torch.no_grad():
        ref = level_outputs(model, x)
        tofu.apply(model, r=8)
        reduced = _raw_level_outputs(model, x)  # level by level, with nothing suspending ToFu
        with tofu.suspended(model):
            safe = level_outputs(model, x)
    # without suspension the token sets differ (why the server must suspend ToFu) ...
    assert [h.shape for h in reduced[:-1]] != [h.shape for h in ref[:-1]]
    # ... with it, every level output is token-for-token the unpatched model's
    assert [h.shape for h in safe] == [h.shape for h in ref]
    for a, b in zip(safe, ref):
        assert torch.equal(a, b)


def test_neuron_importance_matches_under_suspended() -> None:
    pytest.importorskip("captum")
    from fedfuse.importance import neuron_importance

    model, x = _vit1d(depth=2), _input((6, 1, 40))
    y = torch.arange(6) % 10
    ref = neuron_importance(model, x, y, method="deeplift")
    tofu.apply(model, r=8)
    with tofu.suspended(model):
        got = neuron_importance(model, x, y, method="deeplift")
    assert tofu.is_applied(model) and tofu.state(model).enabled  # suspension ended cleanly
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k])


def test_level_outputs_and_importance_suspend_tofu_themselves() -> None:
    # the call sites in fedfuse.models.levels.level_outputs and fedfuse.importance.neuron_importance
    # wrap tofu.suspended(model): no caller-side suspension needed, and ToFu is back on afterwards
    pytest.importorskip("captum")
    from fedfuse.importance import neuron_importance

    model, x = _vit2d(), _input((2, 1, 16, 16))
    y = torch.tensor([3, 7])
    with torch.no_grad():
        ref = level_outputs(model, x)
    ref_imp = neuron_importance(model, x, y, method="deeplift")
    tofu.apply(model, r=8)
    with torch.no_grad():
        got = level_outputs(model, x)
    assert [h.shape for h in got] == [h.shape for h in ref]
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    imp = neuron_importance(model, x, y, method="deeplift")
    for k in ref_imp:
        torch.testing.assert_close(imp[k], ref_imp[k])
    assert tofu.state(model).enabled and tofu.token_counts(model, x)[-1] < ref[0].shape[1]


# ----------------------------------------------------------------------------------------- training

@pytest.mark.parametrize("name", ["vit2d_regs", "vit1d", "timm_regs_avg_nocls"])
def test_training_step_with_tofu(name: str) -> None:
    make, shape = MODELS[name]
    model, x = make(), _input(shape)
    y = torch.tensor([0, 1, 2])
    tofu.apply(model, r=6, proportional_attention=False)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    grads = [p.grad for p in model.blocks.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.blocks[-1].mlp.fc1.weight.grad.abs().sum() > 0  # gradient flows through merged tokens
    assert losses[-1] < losses[0]


def test_rejects_non_vit() -> None:
    with pytest.raises(ValueError):
        tofu.apply(nn.Sequential(nn.Linear(2, 2)), r=2)
    with pytest.raises(ValueError):
        tofu.apply(_vit1d(), r=2, merge="max")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    model, x = _timm_regs(), _input((3, 3, 32, 32))
    tofu.apply(model, r=6)
    with torch.no_grad():
        cpu = model(x)
        gpu = model.cuda()(x.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-3)
