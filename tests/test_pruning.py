"""fedfuse.pruning: structured pruning with Torch-Pruning (issue 14, seed 000's pruning half).

Tiny models, seconds. Checks function preservation, exact head/block surgery against masked / skipped
references, the requested size, tier targets, the pruned model's usability, argument errors and recovery.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.models import adapter_for, build_model, levels
from fedfuse.pruning import (PruneOptions, _apply, _graph, block_similarity, count_macs, count_params, prune,
                             prune_result)

SHAPE = (1, 8, 8)
FAMILIES = {
    "mlp": dict(width=48, depth=2),
    "mlp-bn": dict(width=48, depth=2, batchnorm=True),
    "cnn": dict(width=16, depth=2),
    "resnet": dict(width=16, depth=2, blocks_per_stage=2),
    "vit": dict(width=64, depth=3, num_heads=4),
}


def make(kind: str, seed: int = 0, **over) -> nn.Module:
    name = kind.split("-")[0]
    m = build_model(name, num_classes=10, input_shape=SHAPE, seed=seed, **{**FAMILIES[kind], **over})
    if kind == "mlp-bn":  # non-trivial BatchNorm statistics
        m.train()
        with torch.no_grad():
            m(torch.randn(256, *SHAPE) * 2 + 0.5)
    return m.eval()


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def X() -> torch.Tensor:
    return torch.randn(48, *SHAPE, generator=torch.Generator().manual_seed(1))


def state_copy(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


# ------------------------------------------------------------------------------------------- function
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_nothing_removed_preserves_function_and_input_untouched(kind, X):
    m = make(kind)
    before = state_copy(m)
    res = prune_result(m, params_ratio=1.0, fusion_inputs=X)
    assert res.model is not m
    assert res.info["params_ratio"] == 1.0 and res.info["macs_ratio"] == 1.0
    with torch.no_grad():
        torch.testing.assert_close(res.model(X), m(X), rtol=0, atol=1e-6)
    for k, v in m.state_dict().items():  # the input model is not modified
        assert torch.equal(v, before[k]), k


def _mask_head(attn, head: int):
    """Reference: zero head ``head``'s attention output before the projection (the head masked out)."""
    hd = attn.head_dim

    def pre(_mod, args):
        x = args[0].clone()
        x[..., head * hd:(head + 1) * hd] = 0
        return (x,)
    return attn.proj.register_forward_pre_hook(pre)


def test_vit_head_removal_cuts_exactly_its_qkv_rows_and_proj_columns(X):
    m = make("vit")
    blk = 1
    head = 2
    attn = m.blocks[blk].attn
    H, hd, D = attn.num_heads, attn.head_dim, m.embed_dim
    pruned = copy.deepcopy(m)
    spec = adapter_for(pruned).pruning_spec(pruned)
    _, units = _graph(pruned, spec, X[:1])
    key = f"blocks.{blk}.attn.proj:heads"
    assert key in {u.key for u in units}
    imp = torch.ones(H * hd)
    imp[head * hd:(head + 1) * hd] = 0  # the head to drop ranks lowest
    _apply(pruned, {key: (H - 1, hd)}, {key: imp}, X[:1])
    pa = pruned.blocks[blk].attn
    assert (pa.num_heads, pa.head_dim) == (H - 1, hd)
    keep_cols = [i for i in range(H * hd) if not head * hd <= i < (head + 1) * hd]
    keep_rows = [s * D + i for s in range(3) for i in keep_cols]
    torch.testing.assert_close(pa.qkv.weight, attn.qkv.weight[keep_rows], rtol=0, atol=0)
    torch.testing.assert_close(pa.qkv.bias, attn.qkv.bias[keep_rows], rtol=0, atol=0)
    torch.testing.assert_close(pa.proj.weight, attn.proj.weight[:, keep_cols], rtol=0, atol=0)
    assert pa.qkv.in_features == D and pa.proj.out_features == D  # the residual stream is untouched
    for i, b in enumerate(pruned.blocks):  # other blocks keep every head
        if i != blk:
            assert b.attn.num_heads == H
    h = _mask_head(attn, head)
    try:
        with torch.no_grad():
            torch.testing.assert_close(pruned(X), m(X), rtol=1e-5, atol=1e-5)
    finally:
        h.remove()
    with torch.no_grad():  # and the masked head did matter: the unmasked model differs
        assert (pruned(X) - m(X)).abs().max() > 1e-4


def test_vit_head_dim_pruning_keeps_the_attention_scale(X):
    """Dropping head dimensions whose Q/K/V rows are zero leaves the function unchanged only if the logits keep
    the original 1/sqrt(head_dim) scale (fused attention rescales by the new head dim; the adapter compensates)."""
    m = make("vit")
    attn = m.blocks[0].attn
    H, hd, D = attn.num_heads, attn.head_dim, m.embed_dim
    dead = [0, 5]  # dims of every head with zero q/k/v rows and zero projection columns
    with torch.no_grad():
        for h in range(H):
            for d in dead:
                for s in range(3):
                    attn.qkv.weight[s * D + h * hd + d] = 0
                    attn.qkv.bias[s * D + h * hd + d] = 0
                attn.proj.weight[:, h * hd + d] = 0
    pruned = copy.deepcopy(m)
    key = "blocks.0.attn.proj:heads"
    imp = torch.ones(H * hd)
    for h in range(H):
        for d in dead:
            imp[h * hd + d] = 0
    _apply(pruned, {key: (H, hd - len(dead))}, {key: imp}, X[:1])
    pa = pruned.blocks[0].attn
    assert (pa.num_heads, pa.head_dim, pa.qkv.out_features) == (H, hd - 2, 3 * H * (hd - 2))
    with torch.no_grad():
        torch.testing.assert_close(pruned(X), m(X), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["vit", "resnet"])
def test_block_removal_equals_skipping_the_block(kind, X):
    m = make(kind)
    res = prune_result(m, params_ratio=1.0, fusion_inputs=X, prune_blocks=1)
    (dropped,) = res.info["blocks_removed"]
    assert len(res.model.blocks) == len(m.blocks) - 1
    h = m.blocks[dropped].register_forward_hook(lambda _mod, args, out: args[0])  # skip it
    try:
        with torch.no_grad():
            torch.testing.assert_close(res.model(X), m(X), rtol=1e-5, atol=1e-6)
    finally:
        h.remove()
    assert [lv.name for lv in levels(res.model)][-1] in ("head", "fc")


def test_block_removal_picks_the_block_with_a_negligible_residual_update(X):
    m = make("vit", depth=4)
    with torch.no_grad():  # block 2's residual branches add (almost) nothing
        for lin in (m.blocks[2].attn.proj, m.blocks[2].mlp.fc2):
            lin.weight.mul_(1e-4)
            lin.bias.zero_()
    sim = block_similarity(m, X)
    assert max(sim, key=sim.get) == 2 and sim[2] > 0.999
    res = prune_result(m, params_ratio=1.0, fusion_inputs=X, prune_blocks=1)
    assert res.info["blocks_removed"] == [2]
    with torch.no_grad():
        assert (res.model(X) - m(X)).abs().max() < 1e-2
    # prune_blocks=True drops only blocks above the similarity threshold, and never below the requested size
    second = sorted(sim.values())[-2]
    res = prune_result(m, params_ratio=0.7, fusion_inputs=X, prune_blocks=True, block_similarity=(sim[2] + second) / 2)
    assert res.info["blocks_removed"] == [2]
    assert abs(res.info["params_ratio"] - 0.7) <= 0.05 * 0.7
    res = prune_result(m, params_ratio=0.9, fusion_inputs=X, prune_blocks=True, block_similarity=-1.0)
    assert res.info["blocks_removed"] == []  # one block is 1/4 of the model: dropping it would undershoot 0.9


# --------------------------------------------------------------------------------------------- size
@pytest.mark.parametrize("kind", list(FAMILIES))
@pytest.mark.parametrize("what", ["params_ratio", "macs_ratio"])
@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_requested_params_or_macs_within_5_percent(kind, what, ratio, X):
    m = make(kind)
    res = prune_result(m, fusion_inputs=X, criterion="magnitude", **{what: ratio})
    small = res.model
    got = (count_params(small) / count_params(m) if what == "params_ratio"
           else count_macs(small, X[:1]) / count_macs(m, X[:1]))
    assert abs(got - ratio) <= 0.05 * ratio, (got, ratio)
    assert res.info[what] == pytest.approx(got)
    assert res.info["within_tolerance"]
    # physically smaller: fewer parameters, and every weight tensor no larger than the original's
    assert count_params(small) < count_params(m)
    big = dict(m.named_parameters())
    for name, p in small.named_parameters():
        assert all(a <= b for a, b in zip(p.shape, big[name].shape)), name
    with torch.no_grad():
        out = small(X)
    assert out.shape == (len(X), 10) and torch.isfinite(out).all()


def test_vit_heads_are_units_and_head_dim_is_kept(X):
    m = make("vit", width=64, num_heads=8)
    res = prune_result(m, params_ratio=0.5, fusion_inputs=X, criterion="magnitude")
    for blk in res.model.blocks:
        assert blk.attn.head_dim == 8 and blk.attn.num_heads < 8
        assert blk.attn.qkv.out_features == 3 * blk.attn.num_heads * 8
    res = prune_result(m, params_ratio=0.5, fusion_inputs=X, criterion="magnitude", attention="head_dims")
    for blk in res.model.blocks:
        assert blk.attn.num_heads == 8 and blk.attn.head_dim < 8
    assert res.model.embed_dim == res.model.patch_embed.proj.out_channels < 64


def test_timm_vit_small_layout_prunes_to_half_the_macs():
    timm = pytest.importorskip("timm")
    m = timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=96, depth=2,
                                                         num_heads=6, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    res = prune_result(m, macs_ratio=0.5, fusion_inputs=x, criterion="magnitude")
    assert abs(res.info["macs_ratio"] - 0.5) <= 0.025
    with torch.no_grad():
        assert res.model(x).shape == (2, 5)


# ------------------------------------------------------------------------------------------- target
@pytest.mark.parametrize("kind", list(FAMILIES))
@pytest.mark.parametrize("mult", [0.5, 0.25])
def test_target_gives_exactly_the_tier_architecture(kind, mult, X):
    m = make(kind)
    tier = adapter_for(m).at_width_mult(m, mult, input_shape=SHAPE)
    small = prune(m, target=tier, fusion_inputs=X)
    got, want = small.state_dict(), tier.state_dict()
    assert list(got) == list(want)
    assert all(got[k].shape == want[k].shape for k in want)
    ad = adapter_for(small)
    assert ad.config(small, SHAPE) == ad.config(tier, SHAPE)
    assert [(lv.name, lv.width) for lv in levels(small)] == [(lv.name, lv.width) for lv in levels(tier)]
    with torch.no_grad():
        assert small(X).shape == (len(X), 10)


def test_target_shallower_vit_drops_the_most_redundant_blocks(X):
    m = make("vit", depth=4)
    tier = build_model("vit", num_classes=10, input_shape=SHAPE, width=32, depth=2, num_heads=2)
    res = prune_result(m, target=tier, fusion_inputs=X)
    assert len(res.info["blocks_removed"]) == 2
    assert all(res.model.state_dict()[k].shape == v.shape for k, v in tier.state_dict().items())
    assert adapter_for(res.model).config(res.model, SHAPE) == adapter_for(tier).config(tier, SHAPE)


# ----------------------------------------------------------------------------------- pruned is usable
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_pruned_model_runs_trains_and_levels_work(kind, X):
    from fedfuse.importance import neuron_importance
    from fedfuse.training import train

    m = make(kind)
    small = prune(m, params_ratio=0.5, fusion_inputs=X)
    lv = levels(small)
    assert adapter_for(small).family == adapter_for(m).family
    assert [l.name for l in lv] == [l.name for l in levels(m)]
    with torch.no_grad():
        h = X
        for level in lv:
            h = level.run(h)
            width = h.shape[-1] if level.layout in ("flat", "tokens") else h.shape[1]
            assert width == level.width, level.name
        torch.testing.assert_close(h, small(X))
    y = torch.randint(0, 10, (len(X),), generator=torch.Generator().manual_seed(0))
    train(small, X, y, epochs=1)
    small.eval()
    scores = neuron_importance(small, X[:16], y[:16], method="deeplift")
    assert {k: len(v) for k, v in scores.items()} == {l.name: l.width for l in lv}


def test_client_scores_rank_the_units():
    m = make("mlp", width=40)
    X = torch.randn(32, *SHAPE)
    first = levels(m)[0].name
    s = torch.full((40,), 1e-3)
    favoured = torch.arange(0, 40, 2)  # even units scored high
    s[favoured] = 1.0
    small = prune(m, params_ratio=0.5, fusion_inputs=X, scores={first: s}, criterion="scores")
    lin_small, lin_big = levels(small)[0].layer, levels(m)[0].layer
    kept = [int(torch.cdist(r[None], lin_big.weight).argmin()) for r in lin_small.weight]
    assert len(set(kept)) == len(kept) < 40
    assert sum(k % 2 == 0 for k in kept) == min(len(kept), 20)  # the favoured units go last


def test_taylor_uses_the_teachers(X):
    m = make("mlp")
    t1, t2 = make("mlp", seed=3), make("mlp", seed=4)
    a = prune_result(m, params_ratio=0.5, fusion_inputs=X, criterion="taylor", teachers=[t1, t2])
    b = prune_result(m, params_ratio=0.5, fusion_inputs=X, criterion="taylor")
    assert a.info["taylor_loss"] == "kl-ensemble" and b.info["taylor_loss"] == "ce-own-predictions"
    c = prune_result(m, params_ratio=0.5, fusion_inputs=X, criterion="taylor", teachers=[m])  # KL gradient 0
    assert c.info["taylor_loss"] == "ce-ensemble-predictions"


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kw,word", [
    (dict(params_ratio=0.0), "params_ratio"), (dict(params_ratio=1.5), "params_ratio"),
    (dict(params_ratio=-0.2), "params_ratio"), (dict(params_ratio=True), "params_ratio"),
    (dict(macs_ratio=0), "macs_ratio"), (dict(macs_ratio=float("nan")), "macs_ratio"),
    (dict(params_ratio=0.5, macs_ratio=0.5), "params_ratio, macs_ratio or target"),
    (dict(), "params_ratio, macs_ratio or target"),
    (dict(params_ratio=0.5, roundto=8), "roundto"),
    (dict(params_ratio=0.5, tolerance=2.0), "tolerance"),
    (dict(params_ratio=0.5, attention="rows"), "attention"),
    (dict(params_ratio=0.5, criterion="l1"), "criterion"),
    (dict(params_ratio=0.5, criterion="scores"), "scores"),
    (dict(params_ratio=0.5, recover={"epoch": 3}), "epoch"),
    (dict(params_ratio=0.5, prune_blocks="yes"), "prune_blocks"),
    (dict(params_ratio=0.5, teachers=[]), "teachers"),
    (dict(params_ratio=0.5, weights=[1.0]), "weights"),
])
def test_bad_arguments_raise_naming_the_key(kw, word, X):
    m = make("mlp")
    with pytest.raises(ValueError, match=word):
        prune(m, fusion_inputs=X, **kw)


def test_bad_targets_and_inputs_raise(X):
    m = make("vit")
    with pytest.raises(ValueError, match="target"):
        prune(m, target=make("mlp"), fusion_inputs=X)
    with pytest.raises(ValueError, match="wider"):
        prune(m, target=adapter_for(m).at_width_mult(m, 2.0), fusion_inputs=X)
    with pytest.raises(ValueError, match="deeper"):
        prune(make("vit", depth=2), target=m, fusion_inputs=X)
    with pytest.raises(ValueError, match="fusion_inputs"):
        prune(m, params_ratio=0.5, criterion="taylor")
    with pytest.raises(ValueError, match="fusion_inputs"):
        prune(m, params_ratio=0.5, recover=True)
    with pytest.raises(ValueError, match="scores"):
        prune(m, params_ratio=0.5, fusion_inputs=X, scores={"blocks.0": torch.ones(3)})
    with pytest.raises(ValueError, match="remove|dropped|blocks"):
        prune(make("mlp"), params_ratio=0.5, fusion_inputs=X, prune_blocks=1)
    assert PruneOptions().attention == "heads"


def test_magnitude_works_without_fusion_inputs():
    m = make("cnn")
    small = prune(m, params_ratio=0.5, criterion="magnitude", input_shape=list(SHAPE))
    assert count_params(small) < count_params(m)
    small = prune(m, params_ratio=0.5)  # auto without data: magnitude, input shape from the adapter
    assert count_params(small) < count_params(m)


# ----------------------------------------------------------------------------------------- recovery
@pytest.mark.parametrize("kind", ["mlp", "vit"])
def test_recovery_does_not_worsen_the_fusion_set_kl_to_the_teachers(kind):
    X = torch.randn(160, *SHAPE, generator=torch.Generator().manual_seed(2))
    m = make(kind)
    with torch.no_grad():  # confident teachers, so pruning moves the predictions
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    teachers = [m, make(kind, seed=5)]

    def kl_to_teachers(s):
        with torch.no_grad():
            t = sum(F.softmax(tm(X), -1) for tm in teachers) / len(teachers)
            return float(F.kl_div(F.log_softmax(s(X), -1), t, reduction="batchmean"))

    plain = prune_result(m, params_ratio=0.3, fusion_inputs=X, criterion="magnitude", teachers=teachers)
    rec = prune_result(m, params_ratio=0.3, fusion_inputs=X, criterion="magnitude", teachers=teachers,
                       recover={"epochs": 20, "patience": 20})
    assert rec.info["recover"]["distill-kl-best"] <= rec.info["recover"]["distill-kl-start"]
    assert kl_to_teachers(rec.model) < kl_to_teachers(plain.model)
    assert count_params(rec.model) == count_params(plain.model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device(X):
    m = make("vit")
    res = prune_result(m, params_ratio=0.5, fusion_inputs=X, device="cuda", recover={"epochs": 2})
    assert next(res.model.parameters()).device.type == "cpu"
    with torch.no_grad():
        assert res.model(X).shape == (len(X), 10)


def test_auto_criterion_is_the_familys_measured_choice(X):
    assert prune_result(make("vit"), params_ratio=0.6, fusion_inputs=X).info["criterion"] == "taylor"
    assert prune_result(make("vit"), params_ratio=0.6).info["criterion"] == "magnitude"  # Taylor needs data
    assert prune_result(make("mlp"), params_ratio=0.6, fusion_inputs=X).info["criterion"] == "magnitude"


@pytest.mark.parametrize("mult", [0.5, 0.25])
def test_groupnorm_resnet_keeps_valid_groups(mult, X):
    m = make("resnet", norm="group", width=32)
    small = prune(m, params_ratio=0.5, fusion_inputs=X, criterion="magnitude")
    for mod in small.modules():
        if isinstance(mod, nn.GroupNorm):
            assert mod.num_channels % mod.num_groups == 0 and mod.weight.numel() == mod.num_channels
    assert count_params(small) < count_params(m)
    tier = adapter_for(m).at_width_mult(m, mult, input_shape=SHAPE)
    small = prune(m, target=tier, fusion_inputs=X)
    assert adapter_for(small).config(small, SHAPE) == adapter_for(tier).config(tier, SHAPE)
    assert [(n, mod.num_groups) for n, mod in small.named_modules() if isinstance(mod, nn.GroupNorm)] == \
        [(n, mod.num_groups) for n, mod in tier.named_modules() if isinstance(mod, nn.GroupNorm)]
    with torch.no_grad():
        assert torch.isfinite(small(X)).all()


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_prune_works_inside_an_inference_context(context):
    """Torch-Pruning traces with autograd; ``prune`` turns it on itself rather than asserting on the caller's
    ``torch.no_grad()`` / ``torch.inference_mode()`` (inputs made inside inference mode are cloned)."""
    m = build_model("mlp", 4, (1, 8, 8), width=16, seed=1)
    with context():
        x = torch.randn(32, 1, 8, 8)
        pruned = prune(m, 0.5, fusion_inputs=x, criterion="taylor")
    assert count_params(pruned) < count_params(m)
    assert torch.isfinite(pruned(torch.randn(4, 1, 8, 8))).all()
