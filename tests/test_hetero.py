"""HeteroFL / FedRolex sub-models on constructed tensors, the width scaler, static BN, tier parsing (issue 13)."""

import copy

import pytest
import torch
from torch import nn

from fedfuse.hetero import (aggregate_states, attach_width_scaler, parse_tier_value, parse_tiers,
                            reestimate_batchnorm, slice_state, submodel, tier_of, window_indices)
from fedfuse.models import build_model


def _const(model: nn.Module, value: float) -> dict:
    return {k: (torch.full_like(v, value) if v.is_floating_point() else v.clone()) for k, v in model.state_dict().items()}


def test_window_positions_heterofl_and_fedrolex():
    assert window_indices(8, 4).tolist() == [0, 1, 2, 3]                         # HeteroFL: top-left
    # FedRolex: the window rolls by one unit per round and wraps around
    assert [window_indices(4, 2, offset=t).tolist() for t in range(5)] == [[0, 1], [1, 2], [2, 3], [3, 0], [0, 1]]
    assert window_indices(4, 4, offset=3).tolist() == [0, 1, 2, 3]              # the whole group is not rolled
    # attention heads (blocks of 2 dims) move whole: 3 heads of 2 dims, keep 2 heads
    assert window_indices(6, 4, offset=1, block=2).tolist() == [2, 3, 4, 5]
    assert window_indices(6, 4, offset=2, block=2).tolist() == [4, 5, 0, 1]
    with pytest.raises(ValueError, match="cannot hold"):
        window_indices(4, 5)


def test_heterofl_count_weighted_average_on_constructed_tensors():
    g = build_model("mlp", 3, (5,), width=4, depth=1)         # 0.weight? no: Flatten, Linear(5,4), ReLU, Linear(4,3)
    half = build_model("mlp", 3, (5,), width=4, depth=1, width_mult=0.5)
    full_sub, half_sub = submodel(g, g), submodel(g, half)
    glob = _const(g, -9.0)
    full_state, half_state = _const(g, 1.0), _const(half, 3.0)
    out = aggregate_states(glob, [full_state, half_state], [full_sub, half_sub])
    w1, b1, w2, b2 = out["1.weight"], out["1.bias"], out["3.weight"], out["3.bias"]
    assert torch.all(w1[:2] == 2.0) and torch.all(w1[2:] == 1.0)   # rows 0-1 held by both: (1+3)/2
    assert torch.all(b1[:2] == 2.0) and torch.all(b1[2:] == 1.0)
    assert torch.all(w2[:, :2] == 2.0) and torch.all(w2[:, 2:] == 1.0)  # classifier: inputs sliced, classes not
    assert torch.all(b2 == 2.0)
    # weights (e.g. sample counts): rows 0-1 = (1·1 + 3·3) / 4
    out = aggregate_states(glob, [full_state, half_state], [full_sub, half_sub], weights=[1.0, 3.0])
    assert torch.allclose(out["1.weight"][:2], torch.full((2, 5), 2.5, dtype=torch.float32))
    # entries held by no client keep the global value
    out = aggregate_states(glob, [half_state], [half_sub])
    assert torch.all(out["1.weight"][2:] == -9.0) and torch.all(out["1.weight"][:2] == 3.0)


def test_fedrolex_round_windows_on_constructed_tensors():
    g = build_model("mlp", 2, (3,), width=4, depth=1)
    half = build_model("mlp", 2, (3,), width=4, depth=1, width_mult=0.5)
    glob = {k: v.clone() for k, v in g.state_dict().items()}
    glob["1.bias"] = torch.arange(4.0)
    for t, rows in [(0, [0, 1]), (1, [1, 2]), (3, [3, 0])]:
        sub = submodel(g, half, offset=t)
        assert slice_state(glob, sub)["1.bias"].tolist() == [float(r) for r in rows]
        assert sub.positions["3.weight"][0].tolist() == rows                   # classifier columns follow
        out = aggregate_states(glob, [_const(half, 7.0)], [sub])
        assert [i for i in range(4) if out["1.bias"][i] == 7.0] == sorted(rows)


@pytest.mark.parametrize("name,shape,kw", [
    ("mlp", (6,), {}), ("cnn", (1, 8, 8), {"batchnorm": True}), ("resnet", (1, 8, 8), {}),
    ("resnet", (1, 12), {"norm": "group"}), ("vit", (1, 8, 8), {"num_heads": 4}),
])
@pytest.mark.parametrize("offset", [0, 3])
def test_slices_load_into_tier_models_and_aggregate_back_exactly(name, shape, kw, offset):
    g = build_model(name, 5, shape, seed=1, **kw)
    gs = g.state_dict()
    tiers = [build_model(name, 5, shape, width_mult=r, **kw) for r in (1.0, 0.5, 0.25)]
    subs = [submodel(g, t, offset=offset) for t in tiers]
    states = []
    for t, s in zip(tiers, subs):
        st = slice_state(gs, s)
        t.load_state_dict(st)                                      # shapes fit the tier model
        with torch.no_grad():
            assert t.eval()(torch.randn(2, *shape)).shape == (2, 5)
        states.append(st)
    assert 0.0 < subs[2].held_fraction() < subs[1].held_fraction() < subs[0].held_fraction() == 1.0
    back = aggregate_states(gs, states, subs, weights=[1.0, 2.0, 5.0])      # unchanged slices: the global model
    assert all(torch.allclose(back[k].float(), v.float(), atol=1e-6) for k, v in gs.items())


def test_vit_slice_keeps_whole_heads_of_q_k_and_v():
    g = build_model("vit", 5, (1, 8, 8), width=32, num_heads=4)
    t = build_model("vit", 5, (1, 8, 8), width=32, num_heads=4, width_mult=0.5)    # 2 heads of 8
    qkv = g.state_dict()["blocks.0.attn.qkv.weight"]                                # [96, 32]
    sliced = slice_state(g.state_dict(), submodel(g, t))["blocks.0.attn.qkv.weight"]  # [48, 16]
    for j in range(3):  # q, k, v: the first 16 output dims (2 heads) of each, the first 16 stream inputs
        assert torch.equal(sliced[16 * j:16 * (j + 1)], qkv[32 * j:32 * j + 16, :16])


def test_submodel_rejects_a_wider_tier():
    with pytest.raises(ValueError, match="wider"):
        submodel(build_model("mlp", 3, (4,), width=8), build_model("mlp", 3, (4,), width=16))


def test_width_scaler_scales_hidden_outputs_in_training_only():
    m = build_model("mlp", 3, (4,), width=8, depth=2)
    x = torch.randn(5, 4)
    with torch.no_grad():
        h_ref = m[1](x)
    handles = attach_width_scaler(m, 0.25)
    assert len(handles) == 2                                     # the two hidden Linears, not the classifier
    with torch.no_grad():
        m.train()
        assert torch.allclose(m[1](x), h_ref * 4)
        m.eval()
        assert torch.allclose(m[1](x), h_ref)
    for h in handles:
        h.remove()
    assert attach_width_scaler(m, 1.0) == []


def test_static_bn_reestimates_running_statistics_on_the_fusion_set():
    m = build_model("mlp", 3, (4,), width=6, depth=1, batchnorm=True)
    x = torch.randn(300, 4) * 3 + 2
    assert reestimate_batchnorm(m, x, batch_size=100)          # equal batches: the running mean is exact
    with torch.no_grad():
        h = m[1](x)
    assert torch.allclose(m[2].running_mean, h.mean(0), atol=1e-4)
    assert torch.allclose(m[2].running_var, h.var(0), rtol=0.05)  # mean of per-batch variances
    assert not m.training
    assert not reestimate_batchnorm(build_model("mlp", 3, (4,)), x)   # no BatchNorm: nothing to do


def test_tier_parsing_and_round_robin_assignment():
    assert parse_tiers("1,0.5,0.25") == (1.0, 0.5, 0.25) and parse_tiers("") == ()
    tiers = parse_tiers("1, 0.5, 0.25")
    assert [tier_of(p, tiers) for p in range(5)] == [1.0, 0.5, 0.25, 1.0, 0.5]
    assert tier_of(3, ()) == 1.0
    for bad, msg in [("1,0", "in \\(0, 1\\]"), ("1,2", "in \\(0, 1\\]"), ("1,x", "not a number"),
                     ("0.5,0.25", "no tier has width multiplier 1")]:
        with pytest.raises(ValueError, match="client-tiers") as exc:
            parse_tiers(bad)
        assert exc.match(msg)
    assert parse_tier_value("0.5") == 0.5
    with pytest.raises(ValueError, match="tier"):
        parse_tier_value("1.5")


def test_align_to_anchor_undoes_a_unit_permutation_and_keeps_the_function():
    from fedfuse.hetero.anchor import align_to_anchor

    torch.manual_seed(0)
    anchor = build_model("mlp", 10, (40,), width=32, depth=2)
    # the anchor with its hidden units shuffled (what k-means grouping does to a fused model's unit order)
    shuffled = copy.deepcopy(anchor)
    sd = shuffled.state_dict()
    lin = [k for k in sd if k.endswith("weight")]
    p1, p2 = torch.randperm(32), torch.randperm(32)
    sd[lin[0]] = sd[lin[0]][p1]
    sd[lin[0].replace("weight", "bias")] = sd[lin[0].replace("weight", "bias")][p1]
    sd[lin[1]] = sd[lin[1]][p2][:, p1]
    sd[lin[1].replace("weight", "bias")] = sd[lin[1].replace("weight", "bias")][p2]
    sd[lin[2]] = sd[lin[2]][:, p2]
    shuffled.load_state_dict(sd)
    x = torch.randn(16, 40)
    aligned, info = align_to_anchor(shuffled, anchor)
    with torch.no_grad():
        assert torch.allclose(aligned(x), shuffled(x), atol=1e-5)        # a permutation: same function
    for k, v in anchor.state_dict().items():
        assert torch.allclose(aligned.state_dict()[k], v), k            # unit i is the anchor's unit i again
    assert info["anchor-moved"] > 0.9
