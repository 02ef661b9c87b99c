"""Neuron Interpolation fusion (hf/kf × linear/gradient): exactness, options, failure mode #1."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from torch import nn

from fedfuse.fusion import fuse_result, METHODS, FusionOptionError, IncompatibleModelsError, MissingInputError, fuse
from fedfuse.models import build_model, levels
from fedfuse.training import train

torch.set_num_threads(1)
NI = ["hf-linear", "kf-linear", "hf-gradient", "kf-gradient"]
FAST = dict(epochs=3, head_epochs=3)  # gradient variants: tiny budgets for speed


def _randomise_bn(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g))
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=g))
            m.bias.data.copy_(torch.randn(m.num_features, generator=g))


def _permuted_mlp(model: nn.Sequential, seed: int = 0) -> nn.Sequential:
    """Same function, hidden neurons permuted (levels: Linear → ReLU → Linear → ReLU → Linear)."""
    out = copy.deepcopy(model)
    lins = [m for m in out if isinstance(m, nn.Linear)]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a, b in zip(lins[:-1], lins[1:]):
            p = torch.randperm(a.out_features, generator=g)
            a.weight.copy_(a.weight[p])
            a.bias.copy_(a.bias[p])
            b.weight.copy_(b.weight[:, p])
    return out


def test_registered_with_scores():
    for m in NI:
        assert m in METHODS and METHODS[m].uses_scores


@pytest.mark.parametrize("method", NI)
def test_identical_mlps_fuse_to_the_same_function(method):
    torch.manual_seed(0)
    m = build_model("mlp", input_shape=(1, 8, 8), width=24, seed=1).eval()
    x = torch.randn(200, 1, 8, 8)       # 200 > 65 columns: full-rank design, the fit is unique
    fused = fuse(method, [m, copy.deepcopy(m)], fusion_inputs=x, **(FAST if "gradient" in method else {}))
    xt = torch.randn(64, 1, 8, 8)       # unseen inputs: the weights themselves must be recovered
    assert torch.allclose(fused(xt), m(xt), atol=1e-4)


@pytest.mark.parametrize("method", ["hf-linear", "kf-linear"])
def test_model_and_permuted_copy(method):
    m = build_model("mlp", input_shape=(20,), width=16, seed=3).eval()
    pm = _permuted_mlp(m)
    x, xt = torch.randn(150, 20), torch.randn(50, 20)
    assert torch.allclose(pm(xt), m(xt), atol=1e-5)
    fused = fuse(method, [m, pm], fusion_inputs=x)
    assert torch.allclose(fused(xt), m(xt), atol=1e-4)


@pytest.mark.parametrize("method", ["hf-linear", "kf-linear"])
def test_batchnorm_cnn_exact(method):
    m = build_model("cnn", input_shape=(2, 8, 8), width=4, batchnorm=True, seed=5).eval()
    _randomise_bn(m)
    x, xt = torch.randn(120, 2, 8, 8), torch.randn(20, 2, 8, 8)
    fused = fuse(method, [m, copy.deepcopy(m)], fusion_inputs=x)
    assert torch.allclose(fused(xt), m(xt), atol=1e-4)
    bn = [b for b in fused.modules() if isinstance(b, nn.BatchNorm2d)]
    assert bn and all(torch.allclose(b.running_mean, torch.zeros_like(b.running_mean)) for b in bn)


def test_conv1d_and_bias_free_outside_sequential():
    seq = nn.Sequential(nn.Conv1d(1, 6, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(),
                        nn.Linear(6 * 12, 5, bias=False))
    x, xt = torch.randn(100, 1, 12), torch.randn(10, 1, 12)
    fused = fuse("kf-linear", [seq, copy.deepcopy(seq), copy.deepcopy(seq)], fusion_inputs=x)
    assert torch.allclose(fused(xt), seq(xt), atol=1e-4)


def test_importance_weights_the_targets():
    """Models sharing hidden layers, different heads: the fused head is the weighted mean (Theorem 1 with the models'
    weights; each model's scores are normalised per level, so scaling one model's scores changes nothing)."""
    a = build_model("mlp", input_shape=(10,), width=12, seed=0).eval()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[-1].weight.normal_()
        b[-1].bias.normal_()
    x, xt = torch.randn(80, 10), torch.randn(30, 10)
    names = [lv.name for lv in levels(a)]
    sa = {n: torch.ones(lv.width) for n, lv in zip(names, levels(a))}
    sb = {n: torch.ones(lv.width) for n, lv in zip(names, levels(b))}
    sa[names[-1]] = torch.full((levels(a)[-1].width,), 3.0)
    for method in ("hf-linear", "kf-linear"):
        fused = fuse(method, [a, b], fusion_inputs=x, scores=[sa, sb], weights=[3, 1])
        assert torch.allclose(fused(xt), 0.75 * a(xt) + 0.25 * b(xt), atol=1e-4)
        scaled = fuse(method, [a, b], fusion_inputs=x, scores=[sa, sb])   # a's head scores 3 ×: no more say
        assert torch.allclose(scaled(xt), 0.5 * a(xt) + 0.5 * b(xt), atol=1e-4)
        uni = fuse(method, [a, b], fusion_inputs=x)
        assert torch.allclose(uni(xt), 0.5 * a(xt) + 0.5 * b(xt), atol=1e-4)


def test_fused_width_and_mixed_widths():
    a = build_model("mlp", input_shape=(10,), width=16, seed=0).eval()
    b = build_model("mlp", input_shape=(10,), width=24, seed=1).eval()
    x = torch.randn(120, 10)
    for method in ("kf-linear", "kf-gradient"):
        fused = fuse(method, [a, b], fusion_inputs=x, fused_width=20, **(FAST if "gradient" in method else {}))
        assert [lv.width for lv in levels(fused)] == [20, 20, 10]
        assert fused(x).shape == (120, 10)
    # fused width = sum of parents' widths: nothing is merged, the hidden levels are reproduced exactly
    wide = fuse("kf-linear", [a, b], fusion_inputs=x, fused_width=[40, 40])
    assert torch.allclose(wide(x), 0.5 * (a(x) + b(x)), atol=1e-3)
    with pytest.raises(IncompatibleModelsError, match="Hungarian|equal width"):
        fuse("hf-linear", [a, b], fusion_inputs=x)
    with pytest.raises(IncompatibleModelsError, match="at most 2 models, got 3"):
        fuse("hf-linear", [a, a, a], fusion_inputs=x)
    with pytest.raises(FusionOptionError, match="'fused_width' asks for 50 neurons"):
        fuse("kf-linear", [a, b], fusion_inputs=x, fused_width=50)
    with pytest.raises(FusionOptionError, match="fused_width"):
        fuse("kf-linear", [a, b], fusion_inputs=x, fused_width=0)
    with pytest.raises(FusionOptionError, match="unknown option 'epochs'"):  # linear fits train nothing
        fuse("kf-linear", [a, b], fusion_inputs=x, epochs=3)


def test_linear_variants_fit_blocks_per_layer_and_gradient_handles_vit():
    v1 = build_model("vit", input_shape=(1, 8, 8), width=16, depth=2, num_heads=2, seed=0).eval()
    v2 = build_model("vit", input_shape=(1, 8, 8), width=16, depth=2, num_heads=2, seed=1).eval()
    x = torch.randn(40, 1, 8, 8)
    res = fuse_result("kf-linear", [v1, v2], fusion_inputs=x)   # block levels: the graph variant, layer by layer
    assert res.model(x).shape == (40, 10) and res.info["graph"]["refit"]
    for method in ("kf-gradient", "hf-gradient"):
        fused = fuse(method, [v1, v2], fusion_inputs=x, align_residual=True, **FAST)
        assert fused(x).shape == (40, 10)


def test_plain_timm_vit_and_resnet_gradient():
    from timm.models.vision_transformer import VisionTransformer

    kw = dict(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=8, depth=1, num_heads=2)
    vs = [VisionTransformer(**kw).eval() for _ in range(3)]
    x = torch.randn(30, 1, 8, 8)
    assert fuse("kf-gradient", vs, fusion_inputs=x, setting=2, **FAST)(x).shape == (30, 3)
    rs = [build_model("resnet", input_shape=(1, 8, 8), width=4, depth=2, seed=i).eval() for i in range(2)]
    assert fuse("kf-gradient", rs, fusion_inputs=x, **FAST)(x).shape == (30, 10)


def test_server_side_importance_option():
    a = build_model("mlp", input_shape=(10,), width=8, seed=0).eval()
    b = build_model("mlp", input_shape=(10,), width=8, seed=1).eval()
    x, y = torch.randn(50, 10), torch.randint(0, 10, (50,))
    with pytest.raises(MissingInputError, match="fusion_labels"):
        fuse("kf-linear", [a, b], fusion_inputs=x, importance="deeplift")
    f1 = fuse("kf-linear", [a, b], fusion_inputs=x, importance="deeplift", fusion_labels=y)
    f2 = fuse("kf-linear", [a, b], fusion_inputs=x)
    assert not torch.allclose(f1(x), f2(x))
    with pytest.raises(FusionOptionError, match="unknown option"):
        fuse("kf-linear", [a, b], fusion_inputs=x, no_such_option=1)


def test_gradient_fit_reduces_level_error_from_model0_init():
    """init='model0' (paper) trains each level from model 0; the fit must move toward the targets."""
    a = build_model("mlp", input_shape=(10,), width=16, seed=0).eval()
    b = build_model("mlp", input_shape=(10,), width=16, seed=1).eval()
    x = torch.randn(200, 10)
    target = 0.5 * (a(x) + b(x))
    f0 = fuse("kf-gradient", [a, b], fusion_inputs=x, init="model0", setting=1, epochs=0, head_epochs=0, eps=0.0)
    f1 = fuse("kf-gradient", [a, b], fusion_inputs=x, init="model0", setting=1, epochs=30, head_epochs=60)
    assert torch.allclose(f0(x), a(x))  # no training, no perturbation: model 0
    assert ((f1(x) - target) ** 2).mean() < 0.5 * ((f0(x) - target) ** 2).mean()


def test_blocks_start_near_model0_by_default():
    """A level without a closed form (a ResNet block) starts from model 0 perturbed by eps = 0.1 (the default),
    not re-initialised (setting 1's eps = 1, still available): with no fit epochs the fused blocks stay close to
    model 0's and move further with eps = 1."""
    from fedfuse.fusion.interpolation import GradientInterpolationOptions, _fresh_values

    assert GradientInterpolationOptions().eps == 0.1
    assert GradientInterpolationOptions(eps=None).eps == 1.0 and GradientInterpolationOptions(setting=2, eps=None).eps == 0.1
    assert GradientInterpolationOptions().head_eps == 0.1 and GradientInterpolationOptions(eps=0.3).head_eps == 0.3
    assert GradientInterpolationOptions(head_eps=1.0).head_eps == 1.0
    with pytest.raises(ValueError, match="'head_eps'"):
        GradientInterpolationOptions(head_eps=2.0)
    rs = [build_model("resnet", input_shape=(1, 8, 8), width=4, depth=2, seed=i).eval() for i in range(2)]
    x = torch.randn(30, 1, 8, 8)
    with pytest.raises(FusionOptionError, match="kf-gradient.*'head_eps'"):
        fuse("kf-gradient", rs, fusion_inputs=x, head_eps=-1.0)
    block = [n for n, _ in rs[0].named_parameters() if ".conv" in n or "blocks" in n]
    assert block, "the test needs a block's parameters"

    def dist(eps):
        f = fuse("kf-gradient", rs, fusion_inputs=x, epochs=0, head_epochs=0, eps=eps)
        fp, mp = dict(f.named_parameters()), dict(rs[0].named_parameters())
        return sum(float((fp[n] - mp[n]).norm()) for n in block)

    near, far = dist(0.1), dist(1.0)
    assert 0 < near < 0.2 * far
    # fresh values: every named parameter, its own shape, the model untouched
    before = {n: p.detach().clone() for n, p in rs[0].named_parameters()}
    fresh = _fresh_values(rs[0], block, gen_seed=3)
    assert set(fresh) == set(block) and all(fresh[n].shape == before[n].shape for n in block)
    assert all(torch.equal(p, before[n]) for n, p in rs[0].named_parameters())
    assert any(not torch.equal(fresh[n], before[n]) for n in block)
    v = build_model("vit", input_shape=(1, 8, 8), width=16, depth=1, num_heads=2, seed=0)
    bare = [n for n, _ in v.named_parameters() if "pos" in n or "cls" in n]
    assert bare and all(_fresh_values(v, bare, 0)[n].std() < 0.1 for n in bare)


@pytest.fixture(scope="module")
def sharded_digits():
    """Two MLPs on disjoint halves of the digit classes; fusion set from client 0's classes only."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    tr, te = perm[:1400], perm[1400:]
    models = []
    for i, classes in enumerate(([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])):
        idx = tr[torch.isin(y[tr], torch.tensor(classes))]
        m = build_model("mlp", input_shape=(64,), width=48, seed=10 + i)
        train(m, x[idx], y[idx], epochs=10, lr=3e-3, seed=i)
        models.append(m.eval())
    pool = tr[torch.isin(y[tr], torch.tensor([0, 1, 2, 3, 4]))]
    return models, x[pool[:200]], x[te], y[te]


@pytest.mark.parametrize("method", ["kf-gradient", "hf-gradient"])
def test_no_collapse_on_skewed_fusion_set(sharded_digits, method):
    """FINDINGS failure mode #1: a fusion set holding only client 0's classes must not make the fused
    model forget client 1's classes (setting 1: ε = 1, AdamW, the paper's sharded setting)."""
    models, xf, xt, yt = sharded_digits
    fused = fuse(method, models, fusion_inputs=xf, setting=1, epochs=20, head_epochs=30)
    pred = fused(xt).argmax(1)
    other = yt >= 5
    acc_other = (pred[other] == yt[other]).float().mean().item()
    acc_own = (pred[~other] == yt[~other]).float().mean().item()
    base0_other = (models[0](xt).argmax(1)[other] == yt[other]).float().mean().item()
    assert base0_other < 0.05          # client 0 alone knows nothing of client 1's classes
    assert acc_other > 0.5, f"collapsed to client 0: accuracy on client 1's classes {acc_other:.2f}"
    assert acc_own > 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_matches_cpu():
    m = build_model("mlp", input_shape=(10,), width=8, seed=0).eval()
    x = torch.randn(60, 10)
    f = fuse("kf-linear", [m, copy.deepcopy(m)], fusion_inputs=x, device="cuda")
    assert torch.allclose(f(x), m(x), atol=1e-4)


@pytest.mark.parametrize("method", ["hf-linear", "kf-gradient"])
def test_head_weights_take_each_class_from_its_owner(method):
    """Class-count head weighting (spec §2.3b "Head Weights"): a class's target logit comes from the
    clients that trained on it, so with class-disjoint counts the fused head copies the owners' rows."""
    m0 = build_model("mlp", input_shape=(12,), num_classes=4, width=16, seed=2).eval()
    m1 = copy.deepcopy(m0)
    with torch.no_grad():
        head = [m for m in m1 if isinstance(m, nn.Linear)][-1]
        head.weight.mul_(-2.0).add_(0.3)
        head.bias.add_(1.0)
    x, xt = torch.randn(200, 12), torch.randn(40, 12)
    counts = [[30, 20, 0, 0], [0, 0, 25, 35]]
    kw = dict(epochs=0, head_epochs=0) if "gradient" in method else {}
    fused = fuse(method, [m0, m1], fusion_inputs=x, head_weights=True, class_counts=counts, **kw)
    out = fused(xt)
    assert torch.allclose(out[:, :2], m0(xt)[:, :2], atol=1e-4)
    assert torch.allclose(out[:, 2:], m1(xt)[:, 2:], atol=1e-4)
    with pytest.raises(MissingInputError, match="class_counts"):
        fuse(method, [m0, m1], fusion_inputs=x, head_weights=True, **kw)


def _drifted_copies(base: nn.Module, n: int, scale: float = 0.05) -> list[nn.Module]:
    """Copies of one initialisation with small independent weight changes (multi-round FL clients)."""
    out = []
    for i in range(n):
        m = copy.deepcopy(base)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g))
        out.append(m.eval())
    return out


def test_identity_match_with_infinite_ridge_is_weighted_averaging():
    """match='identity' + uniform scores: the prior is the sample-weighted average of the parents
    (= FedAvg), and an overwhelming ridge leaves the least-squares deviation at zero."""
    base = build_model("mlp", input_shape=(1, 8, 8), width=16, seed=3)
    models = _drifted_copies(base, 3)
    x = torch.randn(120, 1, 8, 8)
    w = [10, 30, 60]
    avg = fuse("average", models, weights=w)
    fused = fuse("kf-linear", models, fusion_inputs=x, weights=w, match="identity", ridge=1e9)
    for k, v in avg.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[k], v, atol=1e-5, rtol=1e-4)
    # a small ridge fits the averaged neuron outputs instead: the first level is linear in the input, so
    # that is still the weight average; after a ReLU the averaged outputs need other weights
    fitted = fuse("kf-linear", models, fusion_inputs=x, weights=w, match="identity", ridge=1e-6)
    torch.testing.assert_close(fitted.state_dict()["1.weight"], avg.state_dict()["1.weight"], atol=1e-5, rtol=1e-4)
    assert (fitted.state_dict()["3.weight"] - avg.state_dict()["3.weight"]).abs().max() > 1e-3
    with pytest.raises(IncompatibleModelsError, match="match='identity'"):
        fuse("kf-linear", models, fusion_inputs=x, match="identity", fused_width=8)
    with pytest.raises(FusionOptionError, match="option 'match' must be"):
        fuse("kf-linear", models, fusion_inputs=x, match="hungarian")


@pytest.mark.parametrize("method", ["kf-linear", "hf-linear"])
def test_probability_head_target_of_identical_models_is_centred_logits(method):
    """head_target='probs' regresses τ·log(mean softmax) (centred); for identical parents and no floor
    that is z − mean_c(z), which an affine head represents exactly, so the argmax is unchanged."""
    m = build_model("mlp", input_shape=(1, 8, 8), width=24, seed=1).eval()
    x = torch.randn(200, 1, 8, 8)
    fused = fuse(method, [m, copy.deepcopy(m)], fusion_inputs=x, head_target="probs", head_floor=1e-30,
                 ridge=0.0)  # no shrinkage of the (mean-logit) deviation from the averaged head
    xt = torch.randn(64, 1, 8, 8)
    z = m(xt)
    torch.testing.assert_close(fused(xt), z - z.mean(1, keepdim=True), atol=1e-4, rtol=1e-4)


def test_head_targets_probability_ensemble_and_floor():
    from fedfuse.fusion.interpolation import head_targets

    z = torch.tensor([[4.0, 0.0, -4.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    z2 = torch.tensor([[-4.0, 0.0, 4.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    a = torch.cat([torch.eye(3) * 0.5, torch.eye(3) * 0.5]).double()          # two models, equal weights
    zz = torch.cat([z, z2], 1)
    torch.testing.assert_close(head_targets(zz, a, 2, "logits"), (z + z2) / 2)
    t = head_targets(zz, a, 2, "probs", floor=1e-30)
    p = (torch.softmax(z, 1) + torch.softmax(z2, 1)) / 2
    torch.testing.assert_close(torch.softmax(t, 1), p)                        # softmax(target) = the ensemble
    assert torch.allclose(t.mean(1), torch.zeros(2, dtype=torch.float64))
    t_floor = head_targets(zz, a, 2, "probs", floor=0.2)                       # confidence bounded by the floor
    assert (t_floor.max(1).values - t_floor.min(1).values).max() <= -torch.log(torch.tensor(0.2)) + 1e-9
    for bad in (dict(head_target="softmax"), dict(head_temperature=0.0), dict(head_floor=1.5)):
        with pytest.raises(FusionOptionError, match=next(iter(bad))):
            fuse("kf-linear", [build_model("mlp", input_shape=(1, 8, 8), width=8, seed=0)] * 2,
                 fusion_inputs=torch.randn(20, 1, 8, 8), **bad)


def test_diagnostics_come_back_in_the_result_info():
    from fedfuse.fusion import fuse_result

    a = build_model("mlp", input_shape=(1, 8, 8), width=12, seed=1).eval()
    b = build_model("mlp", input_shape=(1, 8, 8), width=12, seed=2).eval()
    x = torch.randn(60, 1, 8, 8)
    lin = fuse_result("kf-linear", [a, b], fusion_inputs=x).info["levels"]
    assert set(lin) == {"1", "3"} and lin["1"]["kmeans_cost"] >= 0 and lin["1"]["kmeans_iterations"] >= 1
    grad = fuse_result("kf-gradient", [a, b], fusion_inputs=x, epochs=2, head_epochs=2).info["levels"]
    assert set(grad) == {"1", "3", "5"} and all("val_mse" in grad[k] for k in grad)
    assert grad["5"]["val_mse"] <= grad["5"]["val_mse_start"]  # the best state, including the start, is kept


def test_balanced_match_fuses_permuted_copies_exactly():
    m = build_model("mlp", input_shape=(1, 8, 8), width=24, seed=1).eval()
    copies = [m, _permuted_mlp(m, 1), _permuted_mlp(m, 2)]
    x = torch.randn(200, 1, 8, 8)
    fused = fuse("kf-linear", copies, fusion_inputs=x, match="balanced")
    xt = torch.randn(64, 1, 8, 8)
    assert torch.allclose(fused(xt), m(xt), atol=1e-4)


def test_head_scores_false_weights_the_classifier_by_the_model_weights_only():
    """``head_scores=False``: the classifier's target ignores the output neurons' scores (as if the scores had no
    classifier entry), the hidden levels still use them; with uniform scores it changes nothing."""
    g = torch.Generator().manual_seed(0)
    models = [build_model("mlp", 4, (6,), width=8, depth=1, seed=s) for s in (1, 2)]
    x = torch.randn(64, 6, generator=g)
    scores = [{lv.name: torch.rand(lv.width, generator=g) * (5 if i else 1) for lv in levels(m)}
              for i, m in enumerate(models)]
    head = levels(models[0])[-1].name
    no_head = [{k: v for k, v in s.items() if k != head} for s in scores]
    kw = dict(fusion_inputs=x, weights=[3, 1], seed=0)
    off = fuse("kf-linear", models, scores=scores, head_scores=False, **kw)
    same = fuse("kf-linear", models, scores=no_head, **kw)
    on = fuse("kf-linear", models, scores=scores, **kw)
    with torch.no_grad():
        assert torch.allclose(off(x), same(x), atol=1e-5)
        assert not torch.allclose(off(x), on(x), atol=1e-3)
        assert torch.allclose(fuse("kf-linear", models, head_scores=False, **kw)(x),
                              fuse("kf-linear", models, **kw)(x), atol=1e-5)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_make_optimizer_fused_adam_is_the_same_update(name):
    """Adam and AdamW take torch's fused kernel (the server's level fits and distillation step often); it is the
    same update as the per-tensor loop, to float round-off, and parameters on the meta device keep the loop."""
    from fedfuse.training import make_optimizer

    torch.manual_seed(0)
    a = torch.nn.Linear(7, 3)
    b = copy.deepcopy(a)
    opt = make_optimizer(a.parameters(), name, lr=1e-2, weight_decay=1e-3)
    ref = (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(b.parameters(), lr=1e-2, weight_decay=1e-3)
    assert opt.defaults.get("fused") is True
    x = torch.randn(16, 7)
    for _ in range(5):
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    meta = make_optimizer([torch.nn.Parameter(torch.empty(3, device="meta"))], name)
    assert not meta.defaults.get("fused")
