"""Warm start (``mode='warm-start'``, ``fedfuse.flower.aggregators.warm_start``) and ``initial-model-path``.

Config errors name the key; round 1 of a warm-start run trains independently initialised client models for
``warm-start-epochs`` and its global model is the fused model (not their average); rounds >= 2 are the strategy's own
rounds from it, with the server state reset; end to end on the in-process engine (the same ServerApp and ClientApp as
``flwr run``).
"""

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from fedfuse.config import ConfigError, parse_run_config, preflight
from fedfuse.flower import build_strategy
from fedfuse.flower.aggregators.warm_start import WarmStart, best_client
from tests.test_flower_baselines import configure, model_fn, reply

WARM = {"mode": "warm-start", "num-server-rounds": 3}
TINY = {"dataset": "digits", "model": "mlp", "model-width": 32, "model-depth": 1, "num-clients": 3,
        "partitioning": "dirichlet", "num-server-rounds": 2, "local-epochs": 1, "lr": 0.01,
        "fusion-set-size": 120, "min-train-nodes": 3, "importance-samples": 64, "head-round": False}


@pytest.mark.parametrize("overrides, key", [
    ({**WARM, "num-server-rounds": 1}, "'num-server-rounds'"),
    ({"warm-start-epochs": 5}, "'warm-start-options.epochs'"),                       # set without mode='warm-start'
    ({"warm-start-fusion": "ot"}, "'warm-start-options.fusion'"),
    ({**WARM, "warm-start-fusion": "kf-lin"}, "'warm-start-options.fusion'"),       # unknown (close match named)
    ({**WARM, "warm-start-fusion": "ensemble"}, "'warm-start-options.fusion'"),     # not one model of the architecture
    ({**WARM, "warm-start-fusion": "rebasin"}, "'warm-start-options.fusion-options'"),  # the default options are kf-linear's
    ({**WARM, "warm-start-fusion-options": "{ridge=1"}, "'warm-start-options.fusion-options'"),
    ({**WARM, "warm-start-fusion": "best-client"}, "'warm-start-options.fusion-options'"),
    ({**WARM, "initial-model-path": "/x.pt"}, "'initial-model-path'"),
    ({"mode": "one-shot", "num-server-rounds": 1, "initial-model-path": "/x.pt"}, "'initial-model-path'"),
    ({**WARM, "client-tiers": "1,0.5"}, "'client-tiers'"),
    ({**WARM, "fusion-set-source": "public", "public-fraction": 0.0, "warm-start-fusion": "kd",
      "warm-start-fusion-options": ""}, "'warm-start-options.fusion'"),               # kd needs a fusion set
])
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        parse_run_config(overrides)


def test_config_accepts_warm_start():
    cfg = parse_run_config({**WARM, "warm-start-fusion": "ot", "warm-start-fusion-options": "",
                            "strategy": "fedavg"})
    assert (cfg.mode, cfg.warm_start_fusion, cfg.warm_start_fusion_options_table) == ("warm-start", "ot", {})
    assert parse_run_config(WARM).warm_start_fusion_options_table == {"importance": "uniform"}


def test_initial_model_path_is_checked_before_the_run(tmp_path):
    base = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1}
    with pytest.raises(ConfigError, match="'initial-model-path'.*cannot read"):
        preflight({**base, "initial-model-path": str(tmp_path / "missing.pt")})
    from fedfuse.models import build_model

    wrong = build_model("mlp", num_classes=10, input_shape=(1, 8, 8), width=8, depth=1, seed=0).state_dict()
    torch.save(wrong, tmp_path / "wrong.pt")
    with pytest.raises(ConfigError, match="'initial-model-path'.*does not fit"):
        preflight({**base, "initial-model-path": str(tmp_path / "wrong.pt")})


def test_baseline_of_a_warm_start_is_fedavg_from_scratch():
    from fedfuse.flower.runner.compare import baseline_config

    cfg = baseline_config({**WARM, "warm-start-epochs": 5, "warm-start-fusion": "ot", "strategy": "average"})
    assert cfg == {"mode": "multi-round", "num-server-rounds": 3, "strategy": "fedavg", "head-round": True}
    parse_run_config(cfg)


def test_warm_start_options_and_best_client():
    with pytest.raises(ValueError, match="best-client takes no options"):
        WarmStart(fusion="best-client", options={"ridge": 1.0})
    with pytest.raises(ValueError, match="does not return one model"):
        WarmStart(fusion="ensemble")
    with pytest.raises(ValueError, match="'warm-start-options.fusion'"):
        WarmStart(fusion="best-client").check_server(torch.zeros(4, 64), None)
    warm = WarmStart(fusion="kf-linear", epochs=7, lr=0.03)
    assert warm.round_config()["mode"] == "one-shot" and warm.round_config()["local-epochs"] == 7
    assert warm.round_config()["lr"] == 0.03 and warm.needs_scores          # kf-linear reads client scores
    assert not WarmStart(options={"importance": "uniform"}).needs_scores
    models = [model_fn() for _ in range(2)]
    models[1].load_state_dict(build_strategy("fedavg", model_fn=model_fn).build_model(
        {k: torch.zeros_like(v) for k, v in models[1].state_dict().items()}).state_dict())
    x = torch.randn(20, 1, 8, 8)
    with torch.no_grad():
        y = models[0](x).argmax(-1)
    updates = [type("U", (), {"partition_id": p})() for p in (4, 5)]
    chosen, info = best_client(models, updates, x, y)
    assert chosen is models[0] and info["best-client"] == 4 and info["best-client-fusion-accuracy"] == 1.0


@pytest.mark.parametrize("name", ["average", "fedavg", "fedavgm"])
def test_round_1_fuses_and_restarts_the_server_state(name, tmp_path):
    """Round 1: the one-shot signal with the warm-start epochs (in a copy of the train config), the fused model
    (kf-linear here, not the average), the record names it, the client models are saved, and the server step's state
    is reset; round 2 is the strategy's own round."""
    strategy = build_strategy(name, model_fn=model_fn, fusion_inputs=torch.randn(64, 1, 8, 8))
    strategy.warm_start = WarmStart(fusion="kf-linear", options={"importance": "uniform"}, epochs=4,
                                    save_dir=tmp_path / "warm")
    arrays = ArrayRecord(model_fn().state_dict())
    config = ConfigRecord({"mode": "warm-start", "local-epochs": 1})
    msgs = configure(strategy, 1, arrays, config)
    sent = msgs[0][0]["config"]
    assert (sent["mode"], sent["local-epochs"], sent["fusion-method"]) == ("one-shot", 4, "warm-start:kf-linear")
    assert (config["mode"], config["local-epochs"]) == ("warm-start", 1)    # rounds >= 2 keep the run's config
    replies = [reply(n, seed=10 + n) for n in (1, 2, 3)]
    new, _ = strategy.aggregate_train(1, replies)
    fused = {k: torch.from_numpy(v.numpy()) for k, v in new.items()}
    from fedfuse.fusion import fuse

    models = [strategy.build_model({k: torch.from_numpy(a.numpy().copy()) for k, a in r.content["arrays"].items()})
              for r in replies]
    expected = fuse("kf-linear", models, fusion_inputs=strategy.fusion_inputs, weights=[50, 50, 50], seed=1,
                    importance="uniform").state_dict()
    average = fuse("average", models).state_dict()
    assert all(torch.equal(fused[k], expected[k]) for k in expected)
    assert not all(torch.allclose(fused[k], average[k]) for k in average)
    assert strategy.history[0]["method"] == "warm-start:kf-linear"
    assert strategy.history[0]["fusion-info"]["warm-start"] == "kf-linear"
    assert sorted(p.name for p in (tmp_path / "warm").iterdir()) == ["client-1.pt", "client-2.pt", "client-3.pt"]
    if name == "fedavgm":
        assert strategy.flower.current_arrays is None and strategy.flower.momentum_vector is None
    elif name == "average":
        assert strategy.momentum_step.velocity is None
    else:   # plain FedAvg keeps no server state to restart
        assert not hasattr(strategy, "momentum_step")
    msgs = configure(strategy, 2, new, config)
    assert msgs[0][0]["config"]["mode"] == "warm-start" and msgs[0][0]["config"]["local-epochs"] == 1
    assert strategy.round_label(2) == name


@pytest.mark.parametrize("fallback", ["previous", "average"])
def test_a_failed_warm_fusion_never_continues_from_the_initial_model(fallback, monkeypatch):
    from fedfuse.fusion import NumericalFusionError, fuse
    from fedfuse.flower.aggregators import warm_start as module

    def broken(*args, **kwargs):
        raise NumericalFusionError("injected")

    monkeypatch.setattr(module, "fuse_result", broken)
    strategy = build_strategy("fedavg", model_fn=model_fn, fusion_inputs=torch.randn(64, 1, 8, 8), fallback=fallback)
    strategy.warm_start = WarmStart(fusion="kf-linear", options={"importance": "uniform"})
    configure(strategy, 1, ArrayRecord(model_fn().state_dict()))
    replies = [reply(n, seed=10 + n) for n in (1, 2)]
    if fallback == "previous":
        with pytest.raises(module.WarmStartFailed, match="could not combine.*injected"):
            strategy.aggregate_train(1, replies)
        return
    new, _ = strategy.aggregate_train(1, replies)
    models = [strategy.build_model({k: torch.from_numpy(a.numpy().copy()) for k, a in r.content["arrays"].items()})
              for r in replies]
    average = fuse("average", models).state_dict()
    assert all(torch.allclose(torch.from_numpy(new[k].numpy()), average[k]) for k in average)
    assert strategy.history[0]["fallback"].startswith("average: NumericalFusionError")


def _spy(seen):
    def mod(msg, context, call_next):
        if msg.metadata.message_type == "train":
            seen.append((int(context.node_config["partition-id"]), dict(msg.content["config"])))
        return call_next(msg, context)
    return mod


def test_warm_start_run_inprocess(tmp_path):
    """The real ServerApp and ClientApp: round 1's clients train their own independently initialised models for
    warm-start-epochs (recomputed here bit for bit), the round's global model is their kf-linear fusion, round 2
    trains from it with local-epochs."""
    from fedfuse.flower.client_app import make_client_app
    from fedfuse.flower.runner.inprocess import run_inprocess

    seen: list = []
    cfg = {**TINY, "mode": "warm-start", "strategy": "fedavg", "warm-start-epochs": 2, "output-dir": str(tmp_path),
           "run-name": "warm"}
    out = run_inprocess(cfg, num_supernodes=3, echo=False, client_app=make_client_app(mods=[_spy(seen)]))
    res = json.loads((out / "results.json").read_text())
    assert [(c["mode"], c["local-epochs"]) for p, c in seen[:3]] == [("one-shot", 2)] * 3
    assert [(c["mode"], c["local-epochs"]) for p, c in seen[3:]] == [("warm-start", 1)] * 3
    assert [h["method"] for h in res["strategy-history"]] == ["warm-start:kf-linear", "fedavg"]
    assert res["status"] == "completed" and res["fallbacks"] == 0
    _check_round_1(parse_run_config(cfg), out, res["rounds"][1])


def _check_round_1(cfg, out, row):
    """Client 0's saved model is its own init trained warm-start-epochs; the round's test accuracy is the fused
    model's."""
    from fedfuse.flower.server_app import setup
    from fedfuse.fusion import fuse
    from fedfuse.task import client_init_seed, client_round, federated_data, global_model
    from fedfuse.training import evaluate

    data = federated_data(cfg)
    train_sets = [data.client_data(p, cfg.val_fraction, cfg.seed) for p in range(cfg.num_clients)]
    states = [torch.load(out / "warm-start" / f"client-{p}.pt", weights_only=True) for p in range(cfg.num_clients)]
    own = global_model(cfg, data.num_classes, data.input_shape, seed=client_init_seed(cfg, 0))
    redo = client_round(cfg, own, *train_sets[0], need_importance=False, device=torch.device("cpu"),
                        seed=cfg.seed * 7919 + 1, epochs=cfg.warm_start_epochs)
    assert all(torch.equal(redo["state"][k], states[0][k]) for k in states[0])
    _, model_fn, strategy = setup(cfg)
    models = []
    for s in states:
        m = model_fn()
        m.load_state_dict(s)
        models.append(m)
    fused = fuse("kf-linear", models, fusion_inputs=strategy.fusion_inputs, seed=cfg.seed + 1,
                 weights=[len(t) for t, _ in train_sets], importance="uniform")
    m = evaluate(fused, data.test.x, data.test.y, num_classes=data.num_classes, device=torch.device("cpu"))
    assert m["accuracy"] == row["test-accuracy"] and m["per-class-accuracy"] == row["per-class-accuracy"]


def test_warm_start_end_to_end(tmp_path):
    """A warm-start run on fedfuse's own ClientApp: completes, round 1 is the warm start, round 2 FedAvg."""
    from fedfuse.flower.runner.inprocess import run_app_inprocess

    cfg = {**TINY, "mode": "warm-start", "strategy": "average", "warm-start-epochs": 2, "output-dir": str(tmp_path),
           "run-name": "warm-e2e"}
    outcome = run_app_inprocess(cfg, num_supernodes=3, echo=False)
    assert outcome.ok, f"run {outcome.run_id} ended {outcome.status}: {outcome.details}\n{outcome.log[-4000:]}"
    res = json.loads((outcome.out_dir / "results.json").read_text())
    assert [h["method"] for h in res["strategy-history"]] == ["warm-start:kf-linear", "average"]
    rounds = res["rounds"]
    assert rounds[1]["test-accuracy"] > rounds[0]["test-accuracy"] + 0.05 and res["status"] == "completed"
    assert rounds[1]["valid-replies"] == 3 and rounds[2]["valid-replies"] == 3
    assert len(list((outcome.out_dir / "warm-start").glob("client-*.pt"))) == 3


def _given_models(cfg, folder, epochs=2):
    """Each client's own model, trained outside the federation from its own seed on its own data (an institution's
    model); ``[path]`` by partition id."""
    from fedfuse.task import federated_data, global_model
    from fedfuse.training import train

    data = federated_data(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for p in range(cfg.num_clients):
        tr, _ = data.client_data(p, cfg.val_fraction, cfg.seed)
        model = global_model(cfg, data.num_classes, data.input_shape, seed=100 + p)
        train(model, tr.x, tr.y, epochs=epochs, optimizer="adam", lr=0.01, seed=p)
        torch.save(model.state_dict(), folder / f"own-{p}.pt")
        paths.append(folder / f"own-{p}.pt")
    return paths


def test_warm_start_from_given_models_inprocess(tmp_path):
    """Clients that arrive with their own models (node-config model-path): round 1 replies them untrained, the server
    fuses exactly those; a model that does not fit fails naming the node-config key."""
    from fedfuse.flower.client_app import make_client_app
    from fedfuse.flower.runner.inprocess import run_inprocess

    cfg = {**TINY, "mode": "warm-start", "strategy": "fedavg", "warm-start-fusion": "average",
           "warm-start-fusion-options": "", "output-dir": str(tmp_path), "run-name": "given"}
    paths = _given_models(parse_run_config(cfg), tmp_path / "own")

    def given(msg, context, call_next):   # the node-config a SuperNode would be started with
        context.node_config["model-path"] = str(paths[int(context.node_config["partition-id"])])
        return call_next(msg, context)

    out = run_inprocess(cfg, num_supernodes=3, echo=False, client_app=make_client_app(mods=[given]))
    for p, path in enumerate(paths):
        sent = torch.load(out / "warm-start" / f"client-{p}.pt", weights_only=True)
        own = torch.load(path, weights_only=True)
        assert all(torch.equal(sent[k], own[k]) for k in own)       # untrained in round 1
    res = json.loads((out / "results.json").read_text())
    assert res["strategy-history"][0]["method"] == "warm-start:average" and res["status"] == "completed"

    from fedfuse.models import build_model

    torch.save(build_model("mlp", num_classes=10, input_shape=(1, 8, 8), width=8, depth=1, seed=0).state_dict(),
               paths[1])
    with pytest.raises(RuntimeError, match="(?s)WarmStartFailed.*node-config key 'model-path'"):
        run_inprocess({**cfg, "run-name": "misfit"}, num_supernodes=3, echo=False,
                      client_app=make_client_app(mods=[given]))
