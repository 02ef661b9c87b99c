"""Strategies without Ray: validated aggregation, rejection of each kind of bad reply, fallbacks."""

from unittest.mock import Mock

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfuse.fusion import METHODS, register
from fedfuse.importance import uniform_importance
from fedfuse.models import build_model
from server.strategies import STRATEGIES, build_strategy

SHAPE = (1, 8, 8)


def model_fn():
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=1, seed=0)


def reply(node_id, seed, n=50, pid=None, scores=True, mutate=None, error=None):
    msg = Mock(spec=Message)
    msg.metadata = Mock(src_node_id=node_id)
    if error is not None:
        msg.has_error.return_value = True
        msg.error = Mock(code=2, reason=error)
        return msg
    msg.has_error.return_value = False
    model = build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=1, seed=seed)
    arrays = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    imp = {k: v.numpy().copy() for k, v in uniform_importance(model).items()} if scores else None
    metrics = {"num-examples": n, "partition-id": node_id if pid is None else pid, "train-accuracy": 0.5}
    if mutate:
        mutate(arrays, imp, metrics)
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "metrics": MetricRecord(metrics)})
    if imp is not None:
        content["importance"] = ArrayRecord({k: Array(v) for k, v in imp.items()})
    msg.content = content
    return msg


def state_of(record):
    return {k: torch.from_numpy(np.array(v.numpy())) for k, v in record.items()}


def test_registry_and_errors():
    assert {"fedavg", "average"} <= set(STRATEGIES)
    assert "ensemble" not in STRATEGIES  # a reference, not a global model
    with pytest.raises(ValueError, match="unknown strategy"):
        build_strategy("fedmagic")
    with pytest.raises(ValueError, match="model_fn"):
        build_strategy("average")


def test_average_strategy_matches_weighted_mean_and_is_order_independent():
    s = build_strategy("average", model_fn=model_fn)
    replies = [reply(3, 1, n=10), reply(1, 2, n=30), reply(2, 3, n=60)]
    arrays, metrics = s.aggregate_train(1, replies)
    s2 = build_strategy("average", model_fn=model_fn)
    arrays2, _ = s2.aggregate_train(1, list(reversed(replies)))
    a, b = state_of(arrays), state_of(arrays2)
    for k in a:
        assert torch.equal(a[k], b[k])  # sorted by partition id: bitwise identical
    states = {pid: build_model("mlp", 10, SHAPE, width=16, depth=1, seed=seed).state_dict()
              for pid, seed in [(3, 1), (1, 2), (2, 3)]}
    expected = (10 * states[3]["1.weight"] + 30 * states[1]["1.weight"] + 60 * states[2]["1.weight"]) / 100
    torch.testing.assert_close(a["1.weight"], expected, rtol=1e-5, atol=1e-6)
    assert metrics["num-examples"] == 100 and metrics["num-valid"] == 3


def test_fedavg_strategy_equals_flower_weighted_average():
    s = build_strategy("fedavg")
    s._global = ArrayRecord(model_fn().state_dict())
    replies = [reply(1, 1, n=20), reply(2, 2, n=80)]
    arrays, _ = s.aggregate_train(1, replies)
    m1 = build_model("mlp", 10, SHAPE, width=16, depth=1, seed=1).state_dict()
    m2 = build_model("mlp", 10, SHAPE, width=16, depth=1, seed=2).state_dict()
    torch.testing.assert_close(state_of(arrays)["3.bias"], 0.2 * m1["3.bias"] + 0.8 * m2["3.bias"])


def _set(key, value):
    def mutate(arrays, imp, metrics):
        value(arrays, imp, metrics)
    return mutate


BAD = {
    "wrong shape": lambda a, i, m: a.__setitem__("1.weight", np.zeros((3, 3), np.float32)),
    "wrong dtype": lambda a, i, m: a.__setitem__("1.weight", a["1.weight"].astype(np.float64)),
    "NaN weights": lambda a, i, m: a["1.weight"].__setitem__((0, 0), np.nan),
    "Inf weights": lambda a, i, m: a["3.bias"].__setitem__(0, np.inf),
    "missing array": lambda a, i, m: a.pop("3.bias"),
    "missing level score": lambda a, i, m: i.pop("1"),
    "negative score": lambda a, i, m: i["1"].__setitem__(0, -1.0),
    "NaN score": lambda a, i, m: i["3"].__setitem__(0, np.nan),
    "wrong score length": lambda a, i, m: i.__setitem__("1", np.ones(5, np.float32)),
    "absurd num-examples": lambda a, i, m: m.__setitem__("num-examples", 10**12),
    "zero num-examples": lambda a, i, m: m.__setitem__("num-examples", 0),
}


@pytest.fixture
def scoring_method():
    """A score-using fusion method (average weighted by mean importance) registered for the test."""
    name = "test-score-average"
    if name not in METHODS:
        @register(name, needs_data=False, uses_scores=True)
        def _fuse(models, *, scores, weights, **_):
            from fedfuse.fusion.average import fuse_average

            assert scores is not None and all("1" in s for s in scores)
            return fuse_average(models, weights=weights)
    yield name


@pytest.mark.parametrize("kind", sorted(BAD))
def test_each_bad_reply_is_rejected_and_round_continues(kind, scoring_method):
    s = build_strategy("average", model_fn=model_fn)
    s.method, s.uses_scores = scoring_method, True  # a score-using method: scores are validated
    s._level_widths = {"1": 16, "3": 10}
    good = [reply(1, 1), reply(2, 2)]
    bad = reply(3, 3, mutate=BAD[kind])
    arrays, metrics = s.aggregate_train(1, good + [bad])
    assert arrays is not None
    assert metrics["num-valid"] == 2 and metrics["num-rejected"] == 1
    rejected = s.history[-1]["rejected"]
    assert rejected[0]["node-id"] == 3 and rejected[0]["reason"]
    for k, v in state_of(arrays).items():
        assert torch.isfinite(v.float()).all()


def test_missing_importance_record_rejected(scoring_method):
    s = build_strategy("average", model_fn=model_fn)
    s.method, s.uses_scores = scoring_method, True
    s._level_widths = {"1": 16, "3": 10}
    arrays, metrics = s.aggregate_train(1, [reply(1, 1), reply(2, 2, scores=False)])
    assert metrics["num-valid"] == 1
    assert "importance" in s.history[-1]["rejected"][0]["reason"]


def test_errors_and_too_few_valid_replies_skip_round():
    s = build_strategy("average", model_fn=model_fn, min_valid_replies=2)
    arrays, metrics = s.aggregate_train(4, [reply(1, 1), reply(2, 0, error="ClientApp raised RuntimeError"),
                                            reply(3, 3, mutate=BAD["NaN weights"])])
    assert arrays is None and metrics is None
    h = s.history[-1]
    assert "skipped" in h["skipped"] and h["failures"][0]["node-id"] == 2 and len(h["rejected"]) == 1


@pytest.mark.parametrize("fallback", ["previous", "average"])
def test_fusion_failure_falls_back(fallback):
    name = "test-always-fails"
    if name not in METHODS:
        @register(name, needs_data=False)
        def _boom(models, **_):
            raise ValueError("cannot handle these models")
    s = build_strategy("average", model_fn=model_fn, fallback=fallback)
    s.method = name
    arrays, metrics = s.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    assert "cannot handle" in s.history[-1]["fallback"]
    if fallback == "previous":
        assert arrays is None
    else:
        assert arrays is not None and s.history[-1]["fallback"].startswith("average")


def test_non_finite_fusion_result_never_becomes_global():
    name = "test-nan-result"
    if name not in METHODS:
        @register(name, needs_data=False)
        def _nan(models, **_):
            m = build_model("mlp", 10, SHAPE, width=16, depth=1)
            with torch.no_grad():
                m[1].weight.fill_(float("nan"))
            return m
    s = build_strategy("average", model_fn=model_fn)
    s.method = name
    arrays, _ = s.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    assert arrays is None and "non-finite" in s.history[-1]["fallback"]


def test_configure_train_asks_for_scores_only_when_used():
    grid = Mock()
    grid.get_node_ids.return_value = [11, 12]
    s = build_strategy("average", model_fn=model_fn)
    # Message() needs a live run context; capture the payload FedAvg would send instead
    s._construct_messages = lambda record, node_ids, message_type: [(record, n) for n in node_ids]
    msgs = list(s.configure_train(1, ArrayRecord(model_fn().state_dict()), ConfigRecord({"mode": "one-shot"}), grid))
    assert sorted(n for _, n in msgs) == [11, 12]
    cfg = msgs[0][0]["config"]
    assert cfg["need-importance"] is False and cfg["fusion-method"] == "average" and cfg["server-round"] == 1


def test_head_weights_option_receives_client_class_counts():
    seen = {}
    name = "test-records-options"
    if name not in METHODS:
        @register(name, needs_data=False)
        def _rec(models, *, weights, **options):
            from fedfuse.fusion.average import fuse_average

            seen.update(options)
            return fuse_average(models, weights=weights)
    s = build_strategy("average", model_fn=model_fn, fusion_options={"head_weights": True})
    s.method = name
    counts = lambda c: (lambda a, i, m: m.__setitem__("class-counts", c))  # noqa: E731
    arrays, _ = s.aggregate_train(1, [reply(2, 1, mutate=counts([0, 5] + [0] * 8)),
                                      reply(1, 2, mutate=counts([7, 0] + [0] * 8))])
    assert arrays is not None
    assert seen["class_counts"] == [[7, 0] + [0] * 8, [0, 5] + [0] * 8]  # sorted by partition id


def test_fusion_rounds_fuses_then_averages_and_stops_asking_for_scores():
    fused_rounds = []
    name = "test-records-rounds"
    if name not in METHODS:
        @register(name, needs_data=False, uses_scores=True)
        def _rec(models, *, weights, **options):
            from fedfuse.fusion.average import fuse_average

            fused_rounds.append(len(models))
            out = fuse_average(models, weights=weights)
            with torch.no_grad():
                for p in out.parameters():
                    p.add_(1.0)  # distinguishable from the plain average
            return out
    with pytest.raises(ValueError, match="fusion_rounds"):
        build_strategy("average", model_fn=model_fn, fusion_rounds=-1)
    s = build_strategy("average", model_fn=model_fn, fusion_rounds=1)
    s.method, s.uses_scores = name, True
    s._level_widths = {lv: w for lv, w in [(k, v.numel()) for k, v in uniform_importance(model_fn()).items()]}
    assert s.round_method(1) == name and s.round_method(2) == "average"
    replies = [reply(1, 1, n=10), reply(2, 2, n=30)]
    r1, _ = s.aggregate_train(1, replies)
    no_scores = [reply(1, 1, n=10, scores=False), reply(2, 2, n=30, scores=False)]
    r2, _ = s.aggregate_train(2, no_scores)  # round 2 averages: scores are not required
    assert fused_rounds == [2]
    avg = build_strategy("average", model_fn=model_fn).aggregate_train(1, replies)[0]
    a, f1, f2 = state_of(avg), state_of(r1), state_of(r2)
    for k in a:
        torch.testing.assert_close(f2[k], a[k])
        torch.testing.assert_close(f1[k], a[k] + 1.0)
    assert [h["method"] for h in s.history] == [name, "average"]
    grid = Mock()
    grid.get_node_ids.return_value = [11, 12]
    s._construct_messages = lambda record, node_ids, message_type: [(record, n) for n in node_ids]
    cfg1 = list(s.configure_train(1, ArrayRecord(model_fn().state_dict()), ConfigRecord({}), grid))[0][0]["config"]
    cfg2 = list(s.configure_train(2, ArrayRecord(model_fn().state_dict()), ConfigRecord({}), grid))[0][0]["config"]
    assert cfg1["need-importance"] is True and cfg1["fusion-method"] == name
    assert cfg2["need-importance"] is False and cfg2["fusion-method"] == "average"
