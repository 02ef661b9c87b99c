"""The CUDA paths: every fusion method, client training, neuron importance and pruning with ``device="cuda"``.

The brief: "every training/fusion path takes a ``device`` and uses CUDA when present; nothing requires it". These
tests skip cleanly without a GPU (CI has none) and run on a machine that has one (``tests/test_fusion_contract.py``
checks the same contract on CPU). On CUDA, ``fuse`` must return a CPU model in eval mode that agrees with the CPU
fusion where the method is deterministic, leave the caller's models on the device they were on, and not leak GPU
memory across calls.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from fedfuse.fusion import METHOD_SPECS, fuse, fuse_result
from fedfuse.importance import neuron_importance
from fedfuse.models import build_model
from fedfuse.training import evaluate, train

from tests.test_fusion_contract import CLASSES, SHAPE, _fast, _inputs, _models, _supported_setups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
METHODS = sorted(METHOD_SPECS)
# methods whose fusion has no random draw that CUDA makes differently (no init from the CUDA generator, no
# minibatch order): their CUDA fusion must give the CPU fusion's function up to float rounding
DETERMINISTIC = ("average", "ensemble", "ot", "hf-linear")


def _cases():
    """Every supported (method, arch) with the models on the GPU, and the weight-matching methods (which compute on
    the models' state dicts) also with the models left on the CPU (``device="cuda"`` moves what it computes on)."""
    setups = _supported_setups(METHODS)
    return ([(m, a, "cuda") for m, a in setups]
            + [(m, a, "cpu") for m, a in setups if m in ("ot", "rebasin", "transfusion", "auto")])


@pytest.mark.parametrize("method,arch,models_on", _cases())
def test_every_method_fuses_on_cuda(method, arch, models_on):
    models = [m.to(models_on) for m in _models(arch, n=max(2, METHOD_SPECS[method].min_models))]
    x = _inputs()
    res = fuse_result(method, models, fusion_inputs=x, device="cuda", seed=3, **_fast(method))
    fused = res.model
    assert all(t.device.type == "cpu" for t in fused.state_dict().values()), "fuse must return a CPU model"
    assert not fused.training
    assert all(t.device.type == models_on for m in models for t in m.state_dict().values()), "inputs were moved"
    with torch.no_grad():
        out = fused(x)
    assert out.shape == (len(x), CLASSES) and torch.isfinite(out).all()
    if method in DETERMINISTIC:
        cpu = fuse(method, [copy.deepcopy(m).cpu() for m in models], fusion_inputs=x, seed=3, **_fast(method))
        with torch.no_grad():
            torch.testing.assert_close(out, cpu(x), rtol=1e-3, atol=1e-3)


def test_fusion_frees_gpu_memory():
    """Repeated fusions (one per round) do not accumulate tensors on the GPU."""
    models = [m.cuda() for m in _models("cnn", n=3)]
    x = _inputs(64)
    fuse("ot", models, fusion_inputs=x, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        fuse("ot", models, fusion_inputs=x, device="cuda")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + 1024


def test_training_and_evaluation_on_cuda():
    torch.manual_seed(0)
    x = torch.randn(256, *SHAPE)
    y = (x.flatten(1) @ torch.randn(x[0].numel(), CLASSES)).argmax(1)   # a learnable labelling
    model = build_model("cnn", num_classes=CLASSES, input_shape=SHAPE, width=8, seed=0)
    before = evaluate(model, x, y, device="cuda")["accuracy"]
    train(model, x, y, epochs=10, lr=1e-2, device="cuda", seed=0)
    assert next(model.parameters()).device.type == "cuda"
    after = evaluate(model, x, y, device="cuda")["accuracy"]
    assert after > before + 0.15, (before, after)   # 0.18 -> 0.43 on CPU


@pytest.mark.parametrize("method", ["deeplift", "conductance"])
def test_importance_on_cuda_matches_cpu(method):
    model = build_model("mlp", num_classes=CLASSES, input_shape=SHAPE, width=16, seed=0).eval()
    x, y = _inputs(48), torch.randint(0, CLASSES, (48,), generator=torch.Generator().manual_seed(0))
    cpu = neuron_importance(model, x, y, method=method)
    gpu = neuron_importance(copy.deepcopy(model).cuda(), x, y, method=method, device="cuda")
    assert list(cpu) == list(gpu)
    for name in cpu:
        assert gpu[name].device.type == "cpu"
        torch.testing.assert_close(gpu[name], cpu[name], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", ["quickstart-net", "skip-cnn", "concat-cnn", "tv:mobilenet_v2-0.25",
                                  "timm:convnext_atto-small", "timm:vit_tiny"])
def test_models_users_bring_align_on_cuda(name):
    """The graph reader's alignment on CUDA (issue "Fuse the models users bring"): a user's model fused with a
    permuted copy of itself on ``device="cuda"`` gives the model back (float64, as ``tests/test_any_model.py`` checks on
    the CPU), as a CPU model, for every weight-matching method."""
    from fedfuse.fusion.permute import build_spec, reset_bn_stats
    from fedfuse.fusion.permute.maps import permute_model, random_perms
    from tests.test_any_model import FAST, MATCHING, X, _f64, _model, _rel

    m = _model(FAST[name]).double()
    reset_bn_stats(m, X.double())
    p = permute_model(m, random_perms(build_spec(m), seed=3))
    y = _f64(m)
    for method in MATCHING:
        fused = fuse(method, [m, p], fusion_inputs=X.double(), device="cuda")
        assert all(t.device.type == "cpu" for t in fused.state_dict().values()), method
        assert _rel(_f64(fused), y) <= 1e-5, method
