"""KD and LP baselines (spec §2.5): they move the student toward the ensemble; LP touches only the head."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
import torch.nn.functional as F

from fedfuse.fusion import METHODS, FusionOptionError, MissingInputError, fuse, fuse_result
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.models import build_model

torch.set_num_threads(1)


def _kl_to_ensemble(model, models, x) -> float:
    with torch.no_grad():
        p = teacher_probs(models, x, [0.5, 0.5])
        return F.kl_div(F.log_softmax(model(x), -1), p, reduction="batchmean").item()


@pytest.fixture(scope="module")
def pair():
    a = build_model("mlp", input_shape=(12,), width=16, seed=0).eval()
    b = build_model("mlp", input_shape=(12,), width=16, seed=1).eval()
    return a, b, torch.randn(128, 12)


def test_registered():
    assert "kd" in METHODS and "lp" in METHODS
    assert not METHODS["kd"].uses_scores and METHODS["kd"].needs_data


def test_kd_moves_toward_ensemble_and_leaves_inputs(pair):
    a, b, x = pair
    before = copy.deepcopy(a.state_dict())
    result = fuse_result("kd", [a, b], fusion_inputs=x, epochs=30, lr=3e-3)
    st = result.model
    losses = result.info["epoch_losses"]  # diagnostics: mean distillation loss per epoch
    assert result.info["epochs"] == 30 and len(losses) == 30 and losses[-1] < losses[0]
    assert _kl_to_ensemble(st, [a, b], x) < 0.3 * _kl_to_ensemble(a, [a, b], x)
    assert all(torch.equal(v, a.state_dict()[k]) for k, v in before.items())  # parents untouched
    for aug in ("noise", "mixup"):
        assert fuse("kd", [a, b], fusion_inputs=x, epochs=2, augmentation=aug)(x).shape == (128, 10)
    fresh = fuse("kd", [a, b], fusion_inputs=x, epochs=1, student="fresh")
    assert not torch.allclose(fresh[1].weight, a[1].weight)
    with pytest.raises(FusionOptionError, match="'student'"):
        fuse("kd", [a, b], fusion_inputs=x, epochs=1, student="nope")
    with pytest.raises(FusionOptionError, match="'lr' must be > 0"):
        fuse("kd", [a, b], fusion_inputs=x, lr=0.0)
    with pytest.raises(MissingInputError, match="fusion set"):
        fuse("kd", [a, b], fusion_inputs=None)


def test_lp_refits_only_the_head(pair):
    a, b, x = pair
    st = fuse("lp", [a, b], fusion_inputs=x, epochs=60, lr=3e-3)
    sa, ss = a.state_dict(), st.state_dict()
    head = {"5.weight", "5.bias"}
    for k in sa:
        if k in head:
            assert not torch.allclose(sa[k], ss[k]), k
        else:
            assert torch.equal(sa[k], ss[k]), k
    assert _kl_to_ensemble(st, [a, b], x) < 0.8 * _kl_to_ensemble(a, [a, b], x)
    with pytest.raises(MissingInputError, match="fusion set"):
        fuse("lp", [a, b], fusion_inputs=None)


def test_lp_on_vit():
    vs = [build_model("vit", input_shape=(1, 8, 8), width=8, depth=1, num_heads=2, seed=i).eval() for i in range(2)]
    x = torch.randn(20, 1, 8, 8)
    st = fuse("lp", vs, fusion_inputs=x, epochs=2)
    assert torch.equal(st.blocks[0].attn.qkv.weight, vs[0].blocks[0].attn.qkv.weight)
    assert st(x).shape == (20, 10)
