"""Client work (``fedfuse.task.client_round``): training, scoring, and Token Fusion switched off for scoring."""

import copy

import torch

from fedfuse import tofu
from fedfuse.config import parse_run_config
from fedfuse.data import load_source
from fedfuse.importance import neuron_importance
from fedfuse.models import build_model, levels


def _data():
    train, test = load_source("synthetic", seed=0, num_samples=200, num_features=64, num_classes=4,
                              image_shape=(1, 8, 8))
    return train, test


def test_client_round_with_tofu_scores_like_the_plain_model():
    from fedfuse.task import client_round

    cfg = parse_run_config({"model": "vit", "model-width": 16, "model-depth": 2, "tofu-r": 3, "local-epochs": 1,
                            "importance": "deeplift", "importance-samples": 16, "strategy": "average"})
    train_set, val_set = _data()
    model = build_model("vit", num_classes=4, input_shape=(1, 8, 8), width=16, depth=2, seed=0)
    out = client_round(cfg, model, train_set, val_set, need_importance=True, device=torch.device("cpu"), seed=0)
    assert not tofu.is_applied(model)                       # the reply is a plain model
    assert set(out["state"]) == set(build_model("vit", 4, (1, 8, 8), width=16, depth=2).state_dict())
    # the scores equal those of the same weights without ToFu: token counts matched while scoring
    plain = copy.deepcopy(model)
    expected = neuron_importance(plain, val_set.x[:16], val_set.y[:16], method="deeplift")
    assert list(out["scores"]) == [lv.name for lv in levels(model)]
    for k, v in expected.items():
        torch.testing.assert_close(out["scores"][k], v)
    for key in ("train-seconds", "score-seconds", "val-accuracy", "num-examples", "class-counts"):
        assert key in out["metrics"]
    n = len(train_set)
    assert out["metrics"]["num-examples"] == n and sum(out["metrics"]["class-counts"]) == n


def test_tofu_actually_reduces_tokens_during_client_training(monkeypatch):
    from fedfuse import task

    seen = []
    real_train = task.train

    def spy(model, *a, **kw):
        seen.append(tofu.token_counts(model, torch.zeros(1, 1, 8, 8)))
        return real_train(model, *a, **kw)

    monkeypatch.setattr(task, "train", spy)
    cfg = parse_run_config({"model": "vit", "model-width": 16, "model-depth": 2, "tofu-r": 3, "local-epochs": 1,
                            "strategy": "average"})
    train_set, val_set = _data()
    model = build_model("vit", num_classes=4, input_shape=(1, 8, 8), width=16, depth=2, seed=0)
    task.client_round(cfg, model, train_set, val_set, need_importance=False, device=torch.device("cpu"), seed=0)
    counts = seen[0]
    assert counts[0] == 5 and all(b < a for a, b in zip(counts, counts[1:]))  # CLS + 4 patches, shrinking


def test_client_sgd_momentum_reaches_the_optimizer(monkeypatch):
    """``momentum`` (optimizer='sgd') is the client's SGD momentum: 0 is plain SGD (Flower's fedavgm baseline), the
    default 0.9 as before; a bad value is a ValueError naming it."""
    import pytest

    from fedfuse import task, training

    made = []
    real = training.make_optimizer

    def spy(params, name="adam", lr=1e-3, weight_decay=0.0, momentum=0.9):
        opt = real(params, name, lr, weight_decay, momentum)
        made.append(opt)
        return opt

    monkeypatch.setattr(training, "make_optimizer", spy)
    train_set, val_set = _data()
    for extra, expected in (({"momentum": 0.0}, 0.0), ({}, 0.9)):
        cfg = parse_run_config({"model": "mlp", "model-width": 8, "local-epochs": 1, "optimizer": "sgd",
                                "importance": "uniform", **extra})
        model = build_model("mlp", num_classes=4, input_shape=(64,), width=8, depth=1, seed=0)
        task.client_round(cfg, model, train_set, val_set, need_importance=False, device=torch.device("cpu"), seed=0)
        assert isinstance(made[-1], torch.optim.SGD) and made[-1].defaults["momentum"] == expected
    with pytest.raises(ValueError, match="momentum"):
        training.make_optimizer(torch.nn.Linear(2, 2).parameters(), "sgd", momentum=1.5)
