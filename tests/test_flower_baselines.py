"""Flower's FedAvgM / FedAdam / FedYogi / FedProx as fedfuse strategies (``fedfuse.flower.aggregators.baselines``).

The aggregation must be exactly Flower's (compared with Flower's strategy run alone on the same messages),
only validated replies may reach it, FedProx's proximal term must change local training (and ``mu=0`` must
not), and the run-config keys fail naming the key.
"""

import json
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import (Bulyan, FedAdam, FedAvgM, FedMedian, FedProx, FedTrimmedAvg, FedYogi, Krum,
                                     MultiKrum)

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.config_layout import path_of
from fedfuse.flower import STRATEGIES, build_strategy
from fedfuse.flower.aggregators.baselines import (FLOWER_BASELINES, FedAdamStrategy, FlowerBaselineStrategy, baseline_options)
from fedfuse.models import build_model
from fedfuse.training import train

SHAPE = (1, 8, 8)
FLOWER = {"fedavgm": FedAvgM, "fedadam": FedAdam, "fedyogi": FedYogi, "fedprox": FedProx, "fedmedian": FedMedian,
          "fedtrimmedavg": FedTrimmedAvg, "krum": Krum, "multikrum": MultiKrum, "bulyan": Bulyan}
# non-default options so that the server optimiser visibly acts (FedAvgM with Flower's defaults is FedAvg)
OPTIONS = {"fedavgm": {"server_learning_rate": 0.7, "server_momentum": 0.9}, "fedadam": {"eta": 0.05},
           "fedyogi": {"eta": 0.02}, "fedprox": {"proximal_mu": 0.1}, "fedmedian": {}, "fedtrimmedavg": {"beta": 0.34},
           "krum": {"num_malicious_nodes": 0}, "multikrum": {"num_malicious_nodes": 0, "num_nodes_to_select": 2},
           "bulyan": {"num_malicious_nodes": 0}}


def model_fn():
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=1, seed=0)


def reply(node_id, seed, n=50, nan=False):
    """A client reply (Mock Message: a real one needs a live run) with the weights of seed ``seed``."""
    msg = Mock(spec=Message)
    msg.metadata = Mock(src_node_id=node_id)
    msg.has_error.return_value = False
    state = build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=1, seed=seed).state_dict()
    arrays = {k: v.numpy().copy() for k, v in state.items()}
    if nan:
        arrays["1.weight"][0, 0] = np.nan
    metrics = {"num-examples": n, "partition-id": node_id, "train-accuracy": 0.5, "class-counts": [n] + [0] * 9}
    msg.content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                              "metrics": MetricRecord(metrics)})
    return msg


def grid():
    g = Mock()
    g.get_node_ids.return_value = [1, 2, 3]
    return g


def state_of(record):
    return {k: torch.from_numpy(np.array(v.numpy())) for k, v in record.items()}


def configure(strategy, server_round, arrays, config=None):
    """``configure_train`` with the message construction captured (``Message()`` needs a live run)."""
    inner = strategy.flower if isinstance(strategy, FlowerBaselineStrategy) else strategy
    inner._construct_messages = lambda record, node_ids, message_type: [(record, n) for n in node_ids]
    return list(strategy.configure_train(server_round, arrays, config or ConfigRecord({}), grid()))


def test_registered_as_strategies_and_config_names():
    from fedfuse.config import strategy_names

    for name, cls in FLOWER_BASELINES.items():
        assert STRATEGIES[name].protocol is cls and name in strategy_names()
        built = build_strategy(name, model_fn=model_fn, min_train_nodes=3, min_available_nodes=3)
        assert isinstance(built.flower, FLOWER[name])


@pytest.mark.parametrize("name", sorted(FLOWER))
def test_aggregates_exactly_like_flowers_strategy_alone(name):
    ours = build_strategy(name, model_fn=model_fn, min_train_nodes=3, min_available_nodes=3, **OPTIONS[name])
    alone = FLOWER[name](min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0.0, **OPTIONS[name])
    ours_arrays = alone_arrays = ArrayRecord(model_fn().state_dict())
    for rnd in (1, 2, 3):  # several rounds: momentum / moments carry over
        replies = [reply(1, 10 * rnd + 1, n=20), reply(2, 10 * rnd + 2, n=80), reply(3, 10 * rnd + 3, n=40)]
        sent = configure(ours, rnd, ours_arrays)
        configure(alone, rnd, alone_arrays)
        assert sent[0][0]["config"]["server-round"] == rnd
        if name == "fedprox":
            assert sent[0][0]["config"]["proximal-mu"] == 0.1  # FedProx's own configure_train ran
        ours_arrays, metrics = ours.aggregate_train(rnd, replies)
        # fresh copies: some of Flower's robust strategies consume the replies' arrays
        alone_arrays, _ = alone.aggregate_train(rnd, [reply(i, 10 * rnd + i, n=m) for i, m in ((1, 20), (2, 80), (3, 40))])
        got, want = state_of(ours_arrays), state_of(alone_arrays)
        assert set(got) == set(want)
        for k in got:
            assert got[k].dtype == torch.float32  # the global model keeps its dtypes
            torch.testing.assert_close(got[k], want[k].to(got[k].dtype), rtol=1e-5, atol=1e-6)
        assert metrics["num-valid"] == 3 and metrics["class-counts"][0] == 140
        assert ours.history[-1]["fusion-info"]["flower-strategy"] == FLOWER[name].__name__
    if name not in ("fedprox", "multikrum"):  # not the plain weighted average (MultiKrum averages 2 of the 3)
        avg = sum(w * v for w, v in zip((20 / 140, 80 / 140, 40 / 140),
                                        (state_of(reply(i, 30 + i, n=m).content["arrays"])["3.bias"]
                                         for i, m in ((1, 20), (2, 80), (3, 40)))))
        assert not torch.allclose(got["3.bias"], avg, atol=1e-4)


@pytest.mark.parametrize("name", ["fedavgm", "fedadam"])
def test_rejected_replies_never_reach_flower(name):
    ours = build_strategy(name, model_fn=model_fn, min_train_nodes=3, min_available_nodes=3, **OPTIONS[name])
    alone = FLOWER[name](min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0.0, **OPTIONS[name])
    seen = []
    real = ours.flower.aggregate_train
    ours.flower.aggregate_train = lambda rnd, msgs: (seen.append(list(msgs)), real(rnd, msgs))[1]
    arrays = ArrayRecord(model_fn().state_dict())
    configure(ours, 1, arrays)
    configure(alone, 1, arrays)
    good = [reply(3, 3, n=40), reply(1, 1, n=20)]
    arrays_ours, metrics = ours.aggregate_train(1, [good[0], reply(2, 2, nan=True), good[1]])
    assert [int(m.metadata.src_node_id) for m in seen[0]] == [1, 3]  # valid only, partition-id order
    assert metrics["num-rejected"] == 1 and "NaN" in ours.history[-1]["rejected"][0]["reason"]
    arrays_alone, _ = alone.aggregate_train(1, [good[1], good[0]])
    for k, v in state_of(arrays_ours).items():
        torch.testing.assert_close(v, state_of(arrays_alone)[k].to(v.dtype), rtol=1e-5, atol=1e-6)


def test_flower_failure_falls_back_and_resets_the_server_optimizer(caplog):
    ours = build_strategy("fedavgm", model_fn=model_fn, fallback="previous", **OPTIONS["fedavgm"])
    arrays = ArrayRecord(model_fn().state_dict())
    configure(ours, 1, arrays)
    assert ours.flower.current_arrays is arrays
    bad_metrics = reply(2, 2)
    bad_metrics.content["metrics"]["extra"] = 1.0  # Flower needs the same metric keys in every reply
    out, metrics = ours.aggregate_train(1, [reply(1, 1), bad_metrics])
    assert out is None and metrics["fell-back"] == 1
    assert ours.history[-1]["fallback"].startswith("previous: FlowerAggregationError")
    assert ours.flower.current_arrays is None and "state reset after the fallback" in caplog.text


def test_options_and_errors_name_the_key():
    assert build_strategy("fedadam").flower.eta == 0.1 and build_strategy("fedyogi").flower.eta == 0.01
    assert build_strategy("fedprox", proximal_mu=0.3).flower.proximal_mu == 0.3
    assert build_strategy("fedavgm").flower.server_momentum == 0.5  # measured default (docstring), not Flower's 0
    assert parse_run_config({"strategy": "fedavgm"}).server_momentum == -1.0  # = the strategy's default (0.5)
    assert baseline_options("fedavgm", server_momentum=None) == {}
    s = build_strategy("fedavgm", server_learning_rate=0.5, server_momentum=0.9)
    assert (s.flower.server_learning_rate, s.flower.server_momentum) == (0.5, 0.9)
    with pytest.raises(ValueError, match="takes no fusion_options.*ridge"):
        build_strategy("fedadam", fusion_options={"ridge": 1e-3})
    with pytest.raises(ValueError, match="fusion_rounds must be 0"):
        FedAdamStrategy(fusion_rounds=3)
    with pytest.raises(TypeError, match="server_momentum"):
        build_strategy("fedadam", server_momentum=0.9)  # not a FedAdam option
    assert baseline_options("fedadam", server_lr=0.01) == {"eta": 0.01}
    assert baseline_options("fedyogi", server_lr=0.0) == {}
    assert baseline_options("fedavgm", server_lr=0.5, server_momentum=0.9) == {"server_learning_rate": 0.5,
                                                                                "server_momentum": 0.9}
    assert baseline_options("fedprox", proximal_mu=0.01) == {"proximal_mu": 0.01}
    # fusion strategies take FedAvgM's server step on their aggregate (server-lr, server-momentum); not proximal-mu
    assert baseline_options("kf-linear", server_lr=0.5, proximal_mu=0.1) == {"server_learning_rate": 0.5}
    assert baseline_options("fedavg", server_lr=0.5, server_momentum=0.9) == {}


@pytest.mark.parametrize("overrides, key", [
    ({"strategy": "fedavg", "proximal-mu": 0.1}, "proximal-mu"),
    ({"strategy": "fedadam", "server-momentum": 0.9}, "server-momentum"),
    ({"strategy": "fedavg", "server-momentum": 0.0}, "server-momentum"),
    ({"strategy": "fedprox", "server-lr": 0.01}, "server-lr"),
    ({"strategy": "fedavg", "server-lr": 0.5}, "server-lr"),
    ({"strategy": "fedadam", "fusion-options": "{ridge=1e-3}"}, "fusion-options"),
    ({"strategy": "fedprox", "fusion-rounds": 3}, "fusion-rounds"),
    ({"strategy": "fedavgm", "server-momentum": 1.0}, "server-momentum"),
    ({"strategy": "fedprox", "proximal-mu": -0.1}, "proximal-mu"),
    ({"strategy": "average", "server-momentum": -0.5}, "server-momentum"),
])
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"'{path_of(key)}'"):
        parse_run_config(overrides)


def test_config_accepts_each_strategys_own_keys():
    assert parse_run_config({"strategy": "fedadam", "server-lr": 0.01}).server_lr == 0.01
    assert parse_run_config({"strategy": "fedavgm", "server-lr": 0.5, "server-momentum": 0.9}).server_momentum == 0.9
    assert parse_run_config({"strategy": "fedprox", "proximal-mu": 0.01}).proximal_mu == 0.01


def _trained(mu, seed=0):
    model = build_model("mlp", num_classes=3, input_shape=(6,), width=8, depth=1, seed=seed)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, x, y, epochs=3, batch_size=16, optimizer="sgd", lr=0.3, seed=5, proximal_mu=mu)
    dist = sum(float((model.state_dict()[k] - start[k]).pow(2).sum()) for k in start) ** 0.5
    return model.state_dict(), dist


def test_proximal_term_pulls_local_training_to_the_global_model_and_mu_zero_is_plain_training():
    plain, d_plain = _trained(0.0)
    model = build_model("mlp", num_classes=3, input_shape=(6,), width=8, depth=1, seed=0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    train(model, x, y, epochs=3, batch_size=16, optimizer="sgd", lr=0.3, seed=5)  # no proximal_mu argument
    for k, v in model.state_dict().items():
        assert torch.equal(v, plain[k])  # mu=0 is bit-identical to plain training
    prox, d_prox = _trained(1.0)
    assert any(not torch.equal(prox[k], plain[k]) for k in plain)
    assert d_prox < 0.9 * d_plain  # the proximal term keeps the weights closer to where they started
    with pytest.raises(ValueError, match="proximal_mu"):
        _trained(-1.0)


def test_client_round_passes_proximal_mu(monkeypatch):
    import fedfuse.task as task

    seen = {}
    real = task.train

    def spy(*args, **kwargs):
        seen["mu"] = kwargs.get("proximal_mu")
        return real(*args, **kwargs)

    monkeypatch.setattr(task, "train", spy)
    cfg = parse_run_config({"dataset": "synthetic", "num-clients": 2, "partitioning": "iid", "local-epochs": 1})
    data = task.federated_data(cfg)
    tr, va = data.client_data(0, cfg.val_fraction, cfg.seed)
    model = task.global_model(cfg, data.num_classes, data.input_shape)
    task.client_round(cfg, model, tr, va, need_importance=False, device=torch.device("cpu"), seed=0, proximal_mu=0.25)
    assert seen["mu"] == 0.25


def test_fedadam_two_rounds_end_to_end(tmp_path):
    """Flower's FedAdam in fedfuse's ServerApp, on the in-process engine (the same ServerApp and ClientApp as
    ``flwr run``; Flower's own log lines are the run's log)."""
    from fedfuse.flower.runner.inprocess import run_app_inprocess

    cfg = {"dataset": "digits", "model": "mlp", "model-width": 32, "model-depth": 1, "num-clients": 3,
           "partitioning": "iid", "num-server-rounds": 2, "local-epochs": 2, "lr": 0.01, "fusion-set-size": 60,
           "min-train-nodes": 3, "output-dir": str(tmp_path), "run-name": "fedadam", "strategy": "fedadam",
           "server-lr": 0.01}
    outcome = run_app_inprocess(cfg, num_supernodes=3, echo=False)
    assert outcome.ok, f"run {outcome.run_id} ended {outcome.status}: {outcome.details}\n{outcome.log[-4000:]}"
    res = json.loads((outcome.out_dir / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [0, 1, 2, 3] and res["status"] == "completed"   # + the head round
    last = res["rounds"][-2]   # the last training round (the head round follows it)
    assert last["valid-replies"] == 3 and last["rejected"] == [] and last["fallback"] is None
    assert last["fusion-info"]["flower-strategy"] == "FedAdam" and last["fusion-info"]["step-norm"] > 0
    assert last["test-accuracy"] > res["rounds"][0]["test-accuracy"] + 0.05   # Adam steps of size ~eta = 0.01
    assert "FedOpt settings" in outcome.log and "eta (0.01)" in outcome.log  # Flower's own summary, our server-lr
