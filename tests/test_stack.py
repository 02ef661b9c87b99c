"""``fuse('stack')``: the models side by side with one classifier over their concatenated features, and the head
round solving that classifier from the clients' statistics (``fedfuse.fusion.stack``)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from torch import nn

from fedfuse.fusion import IncompatibleModelsError, MissingInputError, fuse, fuse_result
from fedfuse.fusion.stack import Stacked
from fedfuse.models import build_model
from fedfuse.progressive import _ridge_solve, _with_bias, head_statistics, solve_head, with_head

torch.set_num_threads(1)
SHAPE = (1, 8, 8)


def _models(n=3, classes=4):
    return [build_model("cnn", num_classes=classes, input_shape=SHAPE, seed=s, width=4, depth=2).eval()
            for s in range(1, n + 1)]


def _x(n=64, seed=0):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


def test_the_head_round_on_a_stack_is_the_pooled_ridge_on_the_concatenated_features():
    models, x = _models(), _x(90)
    y = torch.arange(90) % 4
    stacked = fuse("stack", models, fusion_inputs=_x(40, 1))
    assert isinstance(stacked, Stacked)
    feats = stacked.features(x).detach()
    assert feats.shape[1] == stacked.head.in_features == sum(m[-1].in_features for m in models)
    # three clients' statistics of their own parts give the pooled data's ridge classifier
    stats = [head_statistics(stacked, x[k::3], y[k::3], 4) for k in range(3)]
    head = solve_head(stats, ridge=1e-3)
    f = _with_bias(feats.double())
    want = _ridge_solve(f.T @ f, f.T @ nn.functional.one_hot(y, 4).double(), 1e-3 * len(y))
    assert torch.allclose(head.weight.double(), want[:-1].T, atol=1e-4)
    with_head(stacked, head)
    assert torch.allclose(stacked(x).double(), f @ want, atol=1e-4)


def test_logits_features_are_the_members_outputs():
    models, x = _models(), _x()
    stacked = fuse("stack", models, features="logits", head="average", weights=[1, 1, 2])
    assert stacked.head.in_features == 3 * 4
    with torch.no_grad():
        want = sum(w * m(x) for w, m in zip([0.25, 0.25, 0.5], models))
        assert torch.allclose(stacked(x), want, atol=1e-5)


def test_the_fitted_head_imitates_the_ensemble_better_than_the_averaged_one():
    models, x = _models(), _x(200)
    avg = fuse_result("stack", models, head="average").model
    res = fuse_result("stack", models, fusion_inputs=x)
    assert res.info["head"] == "fit"
    start, end = res.info["fit-loss"]
    assert end < start
    with torch.no_grad():
        ens = sum(m(x).softmax(-1) for m in models) / 3
        kl = [float((ens * (ens.log() - m(x).log_softmax(-1))).sum(-1).mean()) for m in (avg, res.model)]
    assert kl[1] < kl[0]


def test_members_of_different_widths_and_families_stack():
    a = build_model("cnn", num_classes=4, input_shape=SHAPE, seed=1, width=4, depth=2).eval()
    b = build_model("mlp", num_classes=4, input_shape=SHAPE, seed=2, width=7, depth=2).eval()
    stacked = fuse("stack", [a, b], fusion_inputs=_x())
    assert stacked(_x()).shape == (64, 4)
    assert stacked.head.in_features == a[-1].in_features + b[-1].in_features


def test_misuse_is_a_clear_error():
    with pytest.raises(MissingInputError, match="head='fit' needs a fusion set"):
        fuse("stack", _models(), head="fit")
    with pytest.raises(ValueError, match="features must be one of"):
        fuse("stack", _models(), features="pixels")
    mixed = _models(2) + _models(1, classes=3)
    with pytest.raises(IncompatibleModelsError, match="different numbers of classes"):
        fuse("stack", mixed, fusion_inputs=_x())


def test_models_the_adapters_cannot_read_are_refused_by_name():
    class Opaque(nn.Module):   # no classifier layer to read features before
        def forward(self, x):
            return x.flatten(1)[:, :4] * 2

    with pytest.raises(IncompatibleModelsError, match="stack"):
        fuse("stack", [Opaque(), Opaque()], fusion_inputs=_x())


def test_the_run_config_says_a_library_method_is_not_a_strategy():
    """``strategy='ensemble'`` fails the config check before any client trains, naming the key and saying why."""
    from fedfuse.config import ConfigError, parse_run_config

    with pytest.raises(ConfigError, match=r"'strategy': 'ensemble' is a fusion method of the library .* not one model"):
        parse_run_config({"strategy": "ensemble", "mode": "one-shot", "num-server-rounds": 1})


@pytest.mark.parametrize("keys, key", [({"mode": "multi-round"}, "'strategy'"),
                                       ({"mode": "warm-start", "num-server-rounds": 2}, "'strategy'"),
                                       ({"mode": "one-shot", "secure-aggregation": True}, "'secure-aggregation'"),
                                       ({"mode": "one-shot", "client-tiers": "1,0.5"}, "'client-tiers'"),
                                       ({"strategy": "auto", "strategy-options.auto-candidates": "stack,fedavg"},
                                        "'strategy-options.auto-candidates'"),
                                       ({"mode": "one-shot", "dp-options.noise-multiplier": 1.0,
                                         "dp-options.clipping-norm": 1.0}, "'strategy'")])
def test_the_stack_strategy_is_one_shot_only(keys, key):
    """A stacked global model cannot be trained by the clients in a next round: ``strategy='stack'`` needs
    ``mode='one-shot'``, said before any client trains, naming the key."""
    from fedfuse.config import ConfigError, parse_run_config

    with pytest.raises(ConfigError, match=key):   # (keys may set the strategy or the rounds)
        parse_run_config({"strategy": "stack", "num-server-rounds": 1, **keys})
    assert parse_run_config({"strategy": "stack", "mode": "one-shot", "num-server-rounds": 1}).strategy == "stack"


def test_a_stacked_state_rebuilds_from_the_clients_architecture_and_refuses_another():
    from fedfuse.fusion.stack import model_for_state, stacked_from_state

    models, x = _models(), _x()
    stacked = fuse("stack", models, fusion_inputs=x, features="logits")
    make = lambda: build_model("cnn", num_classes=4, input_shape=SHAPE, seed=9, width=4, depth=2)   # noqa: E731
    rebuilt = model_for_state(make, stacked.state_dict())
    assert isinstance(rebuilt, Stacked) and rebuilt.feature_kind == "logits" and len(rebuilt.members) == 3
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(x), stacked(x))
    plain = model_for_state(make, models[0].state_dict())
    assert not isinstance(plain, Stacked)
    with pytest.raises(ValueError, match="not this architecture"):
        stacked_from_state(lambda: build_model("mlp", num_classes=4, input_shape=SHAPE, width=7, depth=2),
                           stacked.state_dict())


@pytest.mark.parametrize("strategy", ["stack", None])
def test_a_one_shot_app_run_with_the_stack_strategy(tmp_path, strategy):
    """``mode='one-shot' strategy='stack'``, and the one-shot default that takes it (``auto`` with the head round,
    ``fedfuse.plan.auto_candidates``), through the real ServerApp / ClientApp (in-process engine): the round's global
    model is every client's model side by side, the clients rebuild it for the head round and their evaluation, and
    the head round's classifier over all their features is kept."""
    import json

    from fedfuse.flower.runner.inprocess import run_inprocess
    from fedfuse.fusion.stack import model_for_state

    cfg = {"dataset": "digits", "model": "mlp", "model-width": 32, "model-depth": 1, "num-clients": 4,
           "partitioning": "dirichlet", "dirichlet-alpha": 0.3, "mode": "one-shot", "num-server-rounds": 1,
           "local-epochs": 3, "lr": 0.05, "fusion-set-size": 150, "evaluation": "both",
           "output-dir": str(tmp_path), "run-name": "stack", **({"strategy": strategy} if strategy else {})}
    out = run_inprocess(cfg, echo=False)
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "completed" and not any(h.get("fallback") for h in res["strategy-history"])
    fused, head = res["rounds"][1], res["rounds"][2]
    info = res["strategy-history"][0]["fusion-info"]
    if strategy is None:   # the default: auto's one candidate (nothing to choose: no scoring query), the head round
        assert res["plan"]["candidates"] == ["stack"] and info["select-choice"] == "stack"
        assert info["select-query"] is False and info["select-clients"] == 0 and info["select-accuracy"] is None
    else:
        assert info["head"] == "fit"
    assert head["federated-clients"] == 4 and head["test-accuracy"] > fused["ensemble-accuracy"]
    state = torch.load(out / "global_model.pt", weights_only=True)
    rebuilt = model_for_state(lambda: build_model("mlp", num_classes=10, input_shape=(1, 8, 8), width=32, depth=1),
                              state)
    assert isinstance(rebuilt, Stacked) and len(rebuilt.members) == 4


def test_a_concatenation_too_wide_for_the_head_round_is_warned(monkeypatch):
    import fedfuse.fusion.stack as stack

    monkeypatch.setattr(stack, "WIDE_FEATURES", 8)
    with pytest.warns(RuntimeWarning, match="head round's statistics are about") as record:
        res = fuse_result("stack", _models(), fusion_inputs=_x())
    assert "wide-warning" in res.info and record[0].filename == __file__


def test_a_rebuilt_stack_of_models_the_generic_reader_reads():
    """A user's own model (read by the graph reader, which traces it on an example input): a stack rebuilt from its
    state on a client that never saw the fusion set computes the same features."""
    from fedfuse.fusion.stack import model_for_state

    class Net(nn.Module):   # the Flower quickstart's kind of model, not a family fedfuse wrote
        def __init__(self):
            super().__init__()
            self.conv, self.fc1, self.fc2 = nn.Conv2d(1, 3, 3), nn.Linear(3 * 6 * 6, 12), nn.Linear(12, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))

    torch.manual_seed(0)
    models, x = [Net().eval(), Net().eval()], _x()
    stacked = fuse("stack", models, fusion_inputs=x)
    assert stacked.head.in_features == 24
    from fedfuse.models.adapters import graph

    graph._LAST_SHAPE.clear()   # as in a client's process, which never traced this architecture
    rebuilt = model_for_state(Net, stacked.state_dict()).eval()
    with torch.no_grad():
        assert torch.allclose(rebuilt(x), stacked(x))
