"""The plug-in contract from the client's side (issue 15): the reply helper, what a client sends (scores and
class counts only on request), ``importance='server'``, node-local data, the fusion-set file and the
``num-partitions`` check. Flower messages go through ``LocalGrid`` (Flower's wire format, no Ray)."""

from unittest.mock import Mock

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedfuse.config import ConfigError, read_fusion_set
from fedfuse.data import load_node_data, source_info, write_fusion_set_file, write_node_data, write_partition_files
from fedfuse.data.sources import ArrayDataset
from fedfuse.flower import (ReplyRejected, build_strategy, make_train_reply, read_train_message, reply_to_train,
                            validate_reply)
from fedfuse.flower.client_app import make_client_app
from fedfuse.fusion import fuse_result
from fedfuse.models import build_model, levels
from tests.support.mock_reply import mock_reply
from fedfuse.flower.runner.inprocess import (SERVER_TASK_ID, SUPERLINK_NODE_ID, LocalGrid, fused_run_config,
                                             task_identity)

SHAPE = (1, 8, 8)


def model_fn(seed=0):
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=1, seed=seed)


def _val(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, *SHAPE, generator=g), torch.randint(0, 10, (n,), generator=g)


_as_reply = mock_reply


def _reference(model):
    return {k: (tuple(v.shape), v.numpy().dtype) for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------ the reply helper
def test_make_train_reply_passes_validation_with_default_and_custom_keys():
    model = model_fn(1)
    widths = {lv.name: lv.width for lv in levels(model)}
    content = make_train_reply(model, num_examples=120, train_metrics={"train-loss": 0.5}, val_data=_val(),
                               need_importance=True, class_counts=[12] * 10, partition_id=2)
    assert set(content) == {"arrays", "metrics", "importance"}
    upd = validate_reply(_as_reply(content), _reference(model), widths)
    assert upd.num_examples == 120 and upd.partition_id == 2 and upd.class_counts == [12] * 10
    assert set(upd.scores) == set(widths) and all((s > 0).all() and s.std() > 0 for s in upd.scores.values())
    assert upd.metrics["train-loss"] == 0.5

    custom = make_train_reply(model, num_examples=7, arrays_key="weights", weight_key="samples")
    assert set(custom) == {"weights", "metrics"} and "class-counts" not in custom["metrics"]
    upd = validate_reply(_as_reply(custom), _reference(model), None, arrays_key="weights", weight_key="samples")
    assert upd.num_examples == 7
    with pytest.raises(ReplyRejected, match="no ArrayRecord 'arrays'"):
        validate_reply(_as_reply(custom), _reference(model), None)
    with pytest.raises(ValueError, match="val_data"):
        make_train_reply(model, num_examples=5, need_importance=True)
    with pytest.raises(ValueError, match="num_examples"):
        make_train_reply(model, num_examples=0)


def _train_message(content):
    with task_identity(1, SUPERLINK_NODE_ID, SERVER_TASK_ID):
        msg = Message(content, 11, "train")
    msg.metadata.__dict__["_message_id"] = "m1"
    return msg


def test_reply_to_train_does_what_the_train_config_asks():
    model = model_fn(2)
    state = ArrayRecord(model_fn(0).state_dict())
    ask = lambda imp, counts: _train_message(RecordDict({"weights": state, "config": ConfigRecord(  # noqa: E731
        {"server-round": 3, "need-importance": imp, "need-class-counts": counts})}))
    request = read_train_message(ask(True, False))
    assert request.arrays_key == "weights" and request.server_round == 3 and request.need_importance
    torch.testing.assert_close(request.state_dict()["1.weight"], model_fn(0).state_dict()["1.weight"])
    with task_identity(1, 11, 2):
        bare = reply_to_train(ask(False, False), model, num_examples=9, val_data=_val(), class_counts=[1] * 10)
        full = reply_to_train(ask(True, True), model, num_examples=9, val_data=_val(), class_counts=[1] * 10)
        with pytest.raises(ValueError, match="need-class-counts"):
            reply_to_train(ask(False, True), model, num_examples=9)
    assert set(bare.content) == {"weights", "metrics"} and "class-counts" not in bare.content["metrics"]
    assert set(full.content) == {"weights", "metrics", "importance"} and full.content["metrics"]["class-counts"]
    assert bare.metadata.reply_to_message_id == "m1"


# ------------------------------------------------------------------------------------ what the strategy asks
def _config_of(strategy, server_round=1):
    grid = Mock()
    grid.get_node_ids.return_value = [11, 12]
    with task_identity(1, SUPERLINK_NODE_ID, SERVER_TASK_ID):   # Message() reads the run id
        msgs = list(strategy.configure_train(server_round, ArrayRecord(model_fn().state_dict()), ConfigRecord({}),
                                             grid))
    return msgs[0].content["config"]


def test_clients_send_class_counts_and_scores_only_when_the_strategy_uses_them():
    fx = torch.rand(30, *SHAPE)
    cases = [  # (strategy, options, need-class-counts, need-importance)
        ("average", {}, True, False),                                  # calibrate with prior 'auto'
        ("average", {"prior": "uniform"}, False, False),
        ("average", {"prior": "class-counts"}, True, False),
        ("average", {"refine": "none"}, False, False),
        ("fedavg", {}, False, False),
        ("fedavgm", {}, False, False),
        ("kf-linear", {"refine": "none"}, False, True),
        ("kf-linear", {"refine": "none", "fusion_options": {"head_weights": True}}, True, True),
        ("kf-linear", {"refine": "none", "fusion_options": {"importance": "uniform"}}, False, False),
        ("ot", {"refine": "none"}, False, False),                      # OT ignores scores unless asked
        ("ot", {"refine": "none", "fusion_options": {"marginals": "importance"}}, False, True),
        ("rebasin", {"refine": "none"}, False, True),
        ("rebasin", {"refine": "none", "fusion_options": {"importance_weighted": False}}, False, False),
    ]
    for name, options, counts, scores in cases:
        s = build_strategy(name, model_fn=model_fn, fusion_inputs=fx, **options)
        cfg = _config_of(s)
        assert (cfg["need-class-counts"], cfg["need-importance"]) == (counts, scores), (name, options)
        assert s.wants_class_counts == counts


def test_importance_server_computes_the_named_scores_or_fails_at_construction():
    fx, fy = torch.rand(40, *SHAPE), torch.randint(0, 10, (40,))
    with pytest.raises(ValueError, match="needs fusion_labels"):
        build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=fx, importance="server")
    with pytest.raises(ValueError, match="from the clients only"):
        build_strategy("ot", model_fn=model_fn, fusion_inputs=fx, fusion_labels=fy, importance="server")
    with pytest.raises(ValueError, match="uses no importance scores"):
        build_strategy("average", model_fn=model_fn, fusion_inputs=fx, importance="server")
    with pytest.raises(ValueError, match="conflicts"):
        build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=fx, fusion_labels=fy, importance="server",
                       fusion_options={"importance": "client"})
    # a server-side scoring option alone is importance='server' too: it also needs the labels
    with pytest.raises(ValueError, match="needs fusion_labels"):
        build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=fx, fusion_options={"importance": "conductance"})

    seen = []

    def spy(method, models, **kw):
        seen.append(kw)
        return fuse_result(method, models, **kw)
    s = build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=fx, fusion_labels=fy, importance="server",
                       refine="none", guard=False, fuse_fn=spy)
    assert s.fusion_options["importance"] == "deeplift" and s.importance == "server"
    assert _config_of(build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=fx, fusion_labels=fy,
                                     importance="server"))["need-importance"] is False
    replies = [_as_reply(make_train_reply(model_fn(i), num_examples=20, partition_id=i), node_id=i + 1)
               for i in range(2)]
    arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None and s.history[-1]["fallback"] is None
    assert seen[0]["scores"] is None and seen[0]["importance"] == "deeplift"
    assert seen[0]["fusion_labels"] is fy
    # the scores are real: uniform scores give another fused model
    uniform = build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=fx, fusion_labels=fy, importance="server",
                             refine="none", guard=False, fusion_options={"importance": "uniform"})
    other, _ = uniform.aggregate_train(1, replies)
    assert not torch.allclose(torch.from_numpy(arrays["1.weight"].numpy()), torch.from_numpy(other["1.weight"].numpy()))


# ------------------------------------------------------------------------------------ fedfuse's ClientApp
RUN = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 2,
       "local-epochs": 1, "importance-samples": 32}


def _round_replies(strategy, run_config, node_configs=None, num_nodes=2):
    grid = LocalGrid(make_client_app(), fused_run_config(run_config), num_nodes)
    for nid, extra in zip(grid.get_node_ids(), node_configs or []):
        grid.contexts[nid].node_config.update(extra)
    with task_identity(grid.run.run_id, SUPERLINK_NODE_ID, SERVER_TASK_ID):
        msgs = list(strategy.configure_train(1, ArrayRecord(model_fn().state_dict()),
                                             ConfigRecord({"local-epochs": 1}), grid))
        return list(grid.send_and_receive(msgs))


def test_fedfuse_client_app_sends_class_counts_only_on_request_and_mirrors_the_arrays_key():
    fx = torch.rand(30, *SHAPE)
    private = build_strategy("average", model_fn=model_fn, fusion_inputs=fx, prior="uniform",
                             arrayrecord_key="weights", min_train_nodes=2, min_available_nodes=2)
    replies = _round_replies(private, RUN)
    assert len(replies) == 2 and not any(r.has_error() for r in replies), [r.error for r in replies if r.has_error()]
    for r in replies:
        assert set(r.content) == {"weights", "metrics"}
        assert "class-counts" not in r.content["metrics"]
        assert {"num-examples", "partition-id", "train-accuracy", "val-accuracy"} <= set(r.content["metrics"])
    arrays, _ = private.aggregate_train(1, replies)
    assert arrays is not None and private.history[-1]["rejected"] == []
    asking = build_strategy("average", model_fn=model_fn, fusion_inputs=fx, min_train_nodes=2)   # prior 'auto'
    assert all(len(r.content["metrics"]["class-counts"]) == 10 for r in _round_replies(asking, RUN))


def test_num_partitions_must_match_num_clients():
    s = build_strategy("fedavg", model_fn=model_fn, min_train_nodes=2)
    replies = _round_replies(s, {**RUN, "num-clients": 3})
    assert all(r.has_error() for r in replies)
    assert "num-partitions=2 but run-config num-clients=3" in replies[0].error.reason


# ------------------------------------------------------------------------------------ node-local data
def test_node_local_data_round_trip_checks_and_client_app(tmp_path):
    paths = write_partition_files(tmp_path / "nodes", dataset="digits", num_partitions=2, seed=0)
    info = source_info("digits")
    train, val = load_node_data(paths[0], num_classes=10, info=info, dataset="digits")
    assert train.x.shape[1:] == SHAPE and len(val) > 0 and train.x.dtype == torch.float32
    # without x_val/y_val the node holds out val-fraction itself
    p = write_node_data(tmp_path / "no-val.pt", train)
    tr2, va2 = load_node_data(p, num_classes=10, info=info, dataset="digits", val_fraction=0.25)
    assert len(tr2) + len(va2) == len(train) and abs(len(va2) - 0.25 * len(train)) <= 10
    raw = ArrayDataset(train.x * 16, train.y, 10)   # raw digits scale 0..16
    bad = {"raw.npz": (lambda f: write_node_data(f, raw), "values span"),
           "flat.npz": (lambda f: np.savez(f, x_train=train.x.reshape(len(train), -1).numpy(),
                                           y_train=train.y.numpy()), "shape"),
           "nolabels.npz": (lambda f: np.savez(f, x_train=train.x.numpy()), "missing \\['y_train'\\]"),
           "labels.npz": (lambda f: np.savez(f, x_train=train.x.numpy(), y_train=train.y.numpy() + 10),
                          "classes 0..9")}
    for name, (write, why) in bad.items():
        write(tmp_path / name)
        with pytest.raises(ValueError, match=why):
            load_node_data(tmp_path / name, num_classes=10, info=info, dataset="digits")

    # the ClientApp trains on its own file only (class counts of the file, not of a public partition)
    s = build_strategy("average", model_fn=model_fn, fusion_inputs=torch.rand(30, *SHAPE), min_train_nodes=2)
    replies = _round_replies(s, RUN, node_configs=[{"data-path": str(paths[0])}, {"data-path": str(paths[1])}])
    assert not any(r.has_error() for r in replies), [r.error.reason for r in replies if r.has_error()]
    for r, path in zip(replies, paths):
        own, _ = load_node_data(path, num_classes=10, info=info, dataset="digits")
        assert r.content["metrics"]["class-counts"] == own.class_counts()
        assert r.content["metrics"]["num-examples"] == len(own)
    replies = _round_replies(s, RUN, node_configs=[{"data-path": str(tmp_path / "raw.npz")}])
    assert replies[0].has_error() and "node-config 'data-path'" in replies[0].error.reason
    assert "values span" in replies[0].error.reason


# ------------------------------------------------------------------------------------ fusion-set file
def test_write_fusion_set_file_round_trip_and_raw_scale_rejected(tmp_path):
    path = write_fusion_set_file(tmp_path / "fusion.npz", dataset="digits", size=64, seed=1)
    x, y = read_fusion_set(str(path), dataset="digits")
    assert x.shape == (64, *SHAPE) and y.shape == (64,) and 0 <= float(x.min()) and float(x.max()) <= 1
    assert len(set(y.tolist())) == 10                                   # class-balanced draw
    from fedfuse.data import FederatedData

    same = FederatedData.build("digits", 4, "shards", fusion_size=64, public_fraction=0.2, seed=1)
    torch.testing.assert_close(x, same.fusion_x)                         # = the simulation's fusion set
    pt = write_fusion_set_file(tmp_path / "fusion.pt", dataset="mnist1d", size=32, seed=0, with_labels=False)
    x1, y1 = read_fusion_set(str(pt), dataset="mnist1d")
    assert x1.shape == (32, 1, 40) and y1 is None
    np.savez(tmp_path / "raw.npz", x=(x.numpy() * 16), y=y.numpy())     # sklearn's raw digits scale
    with pytest.raises(ConfigError, match=r"'fusion-set-path'.*values span \[0, 16\], expected \[0, 1\]"):
        read_fusion_set(str(tmp_path / "raw.npz"), dataset="digits")


# ------------------------------------------------------------------------------------ the server's own files
def test_server_with_fusion_and_test_files_loads_no_dataset(tmp_path, monkeypatch):
    from fedfuse.config import parse_run_config
    from fedfuse.data import write_test_set_file
    from fedfuse.flower import server_app

    fusion = write_fusion_set_file(tmp_path / "fusion.npz", dataset="digits", size=50, seed=0)
    test = write_test_set_file(tmp_path / "test.pt", dataset="digits", seed=0)

    def no_dataset(*a, **k):
        raise AssertionError("the server loaded the dataset")
    monkeypatch.setattr(server_app, "federated_data", no_dataset)
    cfg = parse_run_config({**RUN, "fusion-set-path": str(fusion), "test-set-path": str(test)})
    data, model_fn, strategy = server_app.setup(cfg)
    assert data.test.x.shape[1:] == SHAPE and len(data.test) > 300 and data.num_classes == 10
    assert strategy.fusion_inputs.shape == (50, *SHAPE)
    np.savez(tmp_path / "nolabels.npz", x=data.test.x.numpy())
    with pytest.raises(ConfigError, match="'data-options.test-set-path'.*labels"):
        server_app.setup(parse_run_config({**RUN, "fusion-set-path": str(fusion),
                                           "test-set-path": str(tmp_path / "nolabels.npz")}))


def test_the_train_config_names_the_weight_key_and_reply_to_train_follows_it():
    """A strategy built with ``weighted_by_key='n-samples'``: its train message says so, and the two-line ClientApp
    (``reply_to_train``) replies with that key without being told; the reply validates."""
    s = build_strategy("average", model_fn=model_fn, weighted_by_key="n-samples", refine="none")
    cfg = _config_of(s)
    assert cfg["weight-key"] == "n-samples"
    msg = _train_message(RecordDict({"arrays": ArrayRecord(model_fn(0).state_dict()), "config": cfg}))
    assert read_train_message(msg).weight_key == "n-samples"
    with task_identity(1, 11, 2):
        reply = reply_to_train(msg, model_fn(1), num_examples=9)
    assert reply.content["metrics"]["n-samples"] == 9 and "num-examples" not in reply.content["metrics"]
    upd = validate_reply(_as_reply(reply.content), _reference(model_fn()), None, weight_key="n-samples")
    assert upd.num_examples == 9


def test_every_reply_breaking_the_contract_stops_the_run(caplog):
    """Replies that all lack the strategy's weight key (a ClientApp that ignores the train config) used to skip every
    round and leave a user's own ServerApp run 'completed' with the model unchanged; now the strategy raises."""
    from fedfuse.flower import ReplyContractError

    s = build_strategy("average", model_fn=model_fn, weighted_by_key="n-samples", refine="none",
                       min_train_nodes=2, min_available_nodes=2)
    _config_of(s)   # the round's global model
    replies = [_as_reply(make_train_reply(model_fn(k), num_examples=9), node_id=n) for k, n in ((1, 11), (2, 12))]
    with pytest.raises(ReplyContractError, match=r"every reply \(2\).*'n-samples'.*train message's config"):
        s.aggregate_train(1, replies)
    assert s.history[-1]["skipped"] == "every reply broke the reply contract"
    # one valid reply among them: the round goes on with it (bad input loses nothing)
    s2 = build_strategy("average", model_fn=model_fn, weighted_by_key="n-samples", refine="none",
                        min_train_nodes=1, min_available_nodes=1, min_valid_replies=1)
    _config_of(s2)
    good = _as_reply(make_train_reply(model_fn(3), num_examples=9, weight_key="n-samples"), node_id=13)
    arrays, _ = s2.aggregate_train(1, replies + [good])
    assert arrays is not None and len(s2.history[-1]["rejected"]) == 2
