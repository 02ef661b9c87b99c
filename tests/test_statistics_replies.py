"""The clients' statistics through Flower (issue 59 item 2): a strategy whose fusion method reads per-client statistics
(RegMean's Gram matrices, Fisher merging's Fisher) asks the clients for them in the train config
(``need-statistics``), each reply carries them (``"statistics"`` record, checked against the names and shapes the method
computes for the global architecture) and the fusion reads the clients' own, not the public-data variant."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfuse.flower import build_strategy, reply_to_train
from fedfuse.flower.round.replies import NEED_STATISTICS, STATISTICS_KEY
from fedfuse.fusion import client_statistics
from fedfuse.models import build_model
from tests.support.mock_reply import mock_reply

SHAPE = (1, 8, 8)


def model_fn(seed=0):
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=1, seed=seed)


def _reply(node_id, method, *, statistics="own", seed=None):
    """A Message-like reply of node ``node_id``: a trained-looking model, its statistics on its own random data
    (``statistics``: ``"own"``, ``None`` = no record, or a callable that edits them)."""
    model = model_fn(seed=node_id if seed is None else seed)
    content = RecordDict({"arrays": ArrayRecord({k: Array(v.numpy().copy()) for k, v in model.state_dict().items()}),
                          "metrics": MetricRecord({"num-examples": 40, "partition-id": node_id})})
    if statistics is not None:
        g = torch.Generator().manual_seed(node_id)
        stats = client_statistics(method, model, torch.randn(40, *SHAPE, generator=g),
                                  torch.randint(0, 10, (40,), generator=g))
        if callable(statistics):
            stats = statistics(stats)
        content[STATISTICS_KEY] = ArrayRecord({k: Array(v.numpy().copy()) for k, v in stats.items()})
    return mock_reply(content, node_id)


def _strategy(method):
    strategy = build_strategy(method, model_fn=model_fn, fusion_inputs=torch.randn(32, *SHAPE), guard=False,
                              refine="none")
    strategy._global = ArrayRecord(model_fn().state_dict())
    return strategy


@pytest.mark.parametrize("method", ["regmean", "fisher"])
def test_the_round_asks_for_the_clients_statistics_and_fuses_with_them(method):
    strategy = _strategy(method)
    assert strategy.round_config(1)[NEED_STATISTICS] is True
    assert build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=torch.randn(8, *SHAPE)).round_config(1)[
        NEED_STATISTICS] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no public-data-variant warning: the clients' statistics are used
        arrays, _ = strategy.aggregate_train(1, [_reply(n, method) for n in (1, 2, 3)])
    assert arrays is not None
    record = strategy.history[-1]
    assert record["valid"] == 3 and record["rejected"] == [] and record["fallback"] is None
    assert record["fusion-info"]["statistics"] == "clients"


@pytest.mark.parametrize("edit, reason", [
    (None, "no ArrayRecord 'statistics'"),
    (lambda st: {k: v for i, (k, v) in enumerate(st.items()) if i}, "statistics names differ"),
    (lambda st: {k: (v[:-1] if i == 0 else v) for i, (k, v) in enumerate(st.items())}, "has shape"),
    (lambda st: {k: (v * float("nan") if i == 0 else v) for i, (k, v) in enumerate(st.items())}, "NaN or Inf"),
])
def test_a_reply_without_valid_statistics_is_rejected_and_the_round_goes_on(edit, reason):
    strategy = _strategy("regmean")
    bad = _reply(2, "regmean", statistics=edit) if edit is not None else _reply(2, "regmean", statistics=None)
    arrays, _ = strategy.aggregate_train(1, [_reply(1, "regmean"), bad, _reply(3, "regmean")])
    record = strategy.history[-1]
    assert arrays is not None and record["valid"] == 2 and record["fusion-info"]["statistics"] == "clients"
    assert [r["node-id"] for r in record["rejected"]] == [2] and reason in record["rejected"][0]["reason"]


def _train_message(config):
    from fedfuse.flower.runner.inprocess import SERVER_TASK_ID, SUPERLINK_NODE_ID, task_identity

    with task_identity(1, SUPERLINK_NODE_ID, SERVER_TASK_ID):   # Message() reads the run id
        msg = Message(RecordDict({"arrays": ArrayRecord(model_fn().state_dict()), "config": ConfigRecord(config)}),
                      11, "train")
    msg.metadata.__dict__["_message_id"] = "m1"
    return msg


def test_reply_to_train_sends_statistics_only_when_asked_and_needs_the_training_data():
    from fedfuse.flower.runner.inprocess import task_identity

    model = model_fn(seed=3)
    x, y = torch.randn(20, *SHAPE), torch.randint(0, 10, (20,))
    asked = _train_message({"fusion-method": "regmean", NEED_STATISTICS: True})
    not_asked = _train_message({"fusion-method": "kf-linear"})
    with task_identity(1, 11, 2):
        with pytest.raises(ValueError, match="train_data="):
            reply_to_train(asked, model, num_examples=20)
        content = reply_to_train(asked, model, num_examples=20, train_data=(x, y)).content
        bare = reply_to_train(not_asked, model, num_examples=20, train_data=(x, y)).content
    expected = client_statistics("regmean", model, x, y)
    assert set(content[STATISTICS_KEY]) == set(expected)
    for k, v in expected.items():
        assert np.allclose(content[STATISTICS_KEY][k].numpy(), v.numpy())
    assert STATISTICS_KEY not in bare


def test_a_regmean_run_fuses_with_the_statistics_each_client_computed_on_its_own_data(tmp_path):
    from fedfuse.flower.runner.inprocess import run_inprocess

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = run_inprocess({"strategy": "regmean", "num-server-rounds": 1, "num-clients": 3,
                             "head-round": False, "output-dir": str(tmp_path), "run-name": "r"}, echo=False)
    rounds = json.loads((Path(run) / "results.json").read_text())["rounds"]
    assert rounds[1]["valid-replies"] == 3 and rounds[1]["rejected"] == []
    assert rounds[1]["fusion-info"]["statistics"] == "clients"
    assert not [w for w in caught if "PUBLIC-DATA VARIANT" in str(w.message)]
