"""Neuron importance: one non-negative score per neuron per level, and scores mean something."""

import pytest
import torch

from fedfuse.importance import neuron_importance
from fedfuse.models import build_model, levels


@pytest.mark.parametrize("name,shape", [("mlp", (1, 8, 8)), ("cnn", (1, 8, 8)), ("resnet", (1, 40)),
                                        ("vit", (1, 8, 8))])
@pytest.mark.parametrize("method", ["uniform", "conductance", "deeplift"])
def test_shapes_and_non_negative(name, shape, method):
    model = build_model(name, num_classes=5, input_shape=shape, width=16, seed=0)
    x, y = torch.randn(12, *shape), torch.randint(0, 5, (12,))
    scores = neuron_importance(model, x, y, method=method, batch_size=5)
    assert list(scores) == [lv.name for lv in levels(model)]
    for lv in levels(model):
        s = scores[lv.name]
        assert s.shape == (lv.width,) and s.dtype == torch.float32
        assert (s > 0).all() and torch.isfinite(s).all()
    if method == "uniform":
        assert all(torch.equal(s, torch.ones_like(s)) for s in scores.values())
    else:
        assert any(s.std() > 0 for s in scores.values())


@pytest.mark.parametrize("method", ["conductance", "deeplift"])
def test_dead_neuron_scores_zero_and_strong_neuron_scores_high(method):
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=3, input_shape=(6,), width=8, depth=1, seed=0)
    with torch.no_grad():
        model[3].weight[:, 2] = 0.0          # hidden neuron 2 never reaches the output
        model[3].weight[:, 5] *= 25.0        # hidden neuron 5 dominates the logits
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    s = neuron_importance(model, x, y, method=method)["1"]
    assert s[2] < 1e-6
    assert s.argmax() == 5


def test_scores_do_not_change_model_and_errors():
    model = build_model("mlp", num_classes=3, input_shape=(6,), seed=0).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    neuron_importance(model, torch.randn(8, 6), torch.randint(0, 3, (8,)), method="deeplift")
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="unknown method"):
        neuron_importance(model, torch.randn(2, 6), torch.zeros(2, dtype=torch.long), method="shap")
    with pytest.raises(ValueError, match="needs targets"):
        neuron_importance(model, torch.randn(2, 6), None, method="deeplift")
