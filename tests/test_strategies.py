"""Strategies without Ray: validated aggregation, rejection of each kind of bad reply, fallbacks,
named classes on FedAvg's public API, and the Flower-free fedfuse core."""

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedfuse.flower import (STRATEGIES, Preset, FusionStrategy, KfLinearStrategy, ReplyContractError, RoundProtocol,
                            build_strategy)
from fedfuse.fusion import METHOD_SPECS, METHODS, FusionError, IncompatibleModelsError, NoOptions, register
from fedfuse.fusion.average import fuse_average
from fedfuse.importance import uniform_importance
from fedfuse.models import build_model

ROOT = Path(__file__).resolve().parents[1]

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


def _register_once(name, options=NoOptions, **capabilities):
    """Register a test fusion method (new-style signature) once per session; returns its function."""
    def deco(fn):
        if name not in METHOD_SPECS:
            register(name, options=options, **capabilities)(fn)
        return METHOD_SPECS[name].fn
    return deco


def _average(models, weights):
    return fuse_average(models, fusion_inputs=None, scores=None, weights=weights, device="cpu", seed=0,
                        options=NoOptions(), info={})


def test_registry_and_errors():
    assert {"fedavg", "average"} <= set(STRATEGIES)
    assert "ensemble" not in STRATEGIES  # a reference, not a global model
    with pytest.raises(ValueError, match="unknown strategy"):
        build_strategy("fedmagic")
    with pytest.raises(ValueError, match="did you mean 'kf-linear'"):
        build_strategy("kf-linaer")
    with pytest.raises(ValueError, match="model_fn"):
        build_strategy("average")


def test_strategies_cover_every_same_architecture_method_with_a_named_class():
    methods = {n for n, spec in METHOD_SPECS.items() if spec.same_architecture and not n.startswith("test-")}
    from fedfuse.strategy_specs import NON_FUSION_STRATEGIES  # fedavg + Flower's baselines (fedfuse.flower.aggregators.baselines)
    from fedfuse.strategy_specs import TIER_STRATEGIES  # heterofl / fedrolex (fedfuse.flower.tiers.tiered)

    from fedfuse.strategy_specs import DEPTH_TIER_STRATEGIES  # depthfl / depthfl-fedavg / inclusivefl (depth_tiers)

    from fedfuse.strategy_specs import ONE_SHOT_ONLY_STRATEGIES  # stack (its global model: every client's, one-shot)

    assert set(STRATEGIES) - set(TIER_STRATEGIES) - set(DEPTH_TIER_STRATEGIES) == \
        methods | set(NON_FUSION_STRATEGIES) | set(ONE_SHOT_ONLY_STRATEGIES)
    for name, preset in STRATEGIES.items():
        # a preset (registry entry + the round protocol that runs it), not a generated class
        assert isinstance(preset, Preset) and preset.method == name and preset.doc
        cls = preset.protocol
        assert issubclass(cls, RoundProtocol) and issubclass(cls, FedAvg)
        assert cls.method in (name, None) and cls.__name__.endswith("Strategy") and cls.__doc__
        assert cls.__module__ in ("fedfuse.flower.strategies", "fedfuse.flower.aggregators.baselines", "fedfuse.flower.tiers.tiered",
                                  "fedfuse.flower.aggregators.selection", "fedfuse.flower.tiers.depth_tiers",
                                  "fedfuse.flower.aggregators.fusion_strategy")
        # importable by its name from its module (the named classes users import)
        assert getattr(sys.modules[cls.__module__], cls.__name__) is cls
    from server.strategies import STRATEGIES as legacy, build_strategy as legacy_build  # public API contract
    assert legacy is STRATEGIES and legacy_build is build_strategy


def test_constructor_takes_one_typed_object_per_concern_and_fedavgs_options_by_name():
    from dataclasses import fields

    from fedfuse.flower.round.options import ProtocolOptions
    named = [p for p in inspect.signature(FusionStrategy.__init__).parameters.values()
             if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(named) <= 12   # the options are objects (fusion, guard, momentum, refine, protocol), not 35 keywords
    fedavg = [p for p in inspect.signature(FedAvg.__init__).parameters if p != "self"]
    assert set(fedavg) <= {f.name for f in fields(ProtocolOptions)}   # Flower's FedAvg options keep their names
    with pytest.raises(TypeError, match="fraction_trian"):   # a misspelled flat keyword is refused, named
        KfLinearStrategy(model_fn=model_fn, fusion_inputs=torch.zeros(4, *SHAPE), fraction_trian=0.5)
    s = KfLinearStrategy(model_fn=model_fn, fusion_inputs=torch.zeros(4, *SHAPE), fraction_train=0.5,
                         min_train_nodes=3, min_available_nodes=4, weighted_by_key="n", arrayrecord_key="w")
    assert (s.fraction_train, s.min_train_nodes, s.min_available_nodes, s.weighted_by_key, s.arrayrecord_key) == \
        (0.5, 3, 4, "n", "w")
    assert s.fraction_evaluate == 0.0  # central evaluation by default
    with pytest.raises(ValueError, match="KfLinearStrategy aggregates with 'kf-linear'"):
        KfLinearStrategy(method="ot", model_fn=model_fn, fusion_inputs=torch.zeros(4, *SHAPE))
    with pytest.raises(ValueError, match="takes no fusion_options"):
        build_strategy("fedavg", fusion_options={"ridge": 1.0})


def test_fusion_options_are_validated_at_construction():
    @_register_once("test-typed-options", options=HeadOptions, needs_data=False)
    def _fuse(models, *, weights, options, **_):
        return _average(models, weights)

    FusionStrategy("test-typed-options", model_fn=model_fn, fusion_options={"head_weights": True})
    with pytest.raises(ValueError, match="head_wieghts.*did you mean 'head_weights'"):
        FusionStrategy("test-typed-options", model_fn=model_fn, fusion_options={"head_wieghts": True})
    with pytest.raises(ValueError, match="'head_weights' must be bool"):
        FusionStrategy("test-typed-options", model_fn=model_fn, fusion_options={"head_weights": "yes"})


def test_reply_keys_follow_arrayrecord_key_and_weighted_by_key():
    s = build_strategy("average", model_fn=model_fn, arrayrecord_key="weights", weighted_by_key="samples")

    def renamed(node_id, seed, n):
        msg = reply(node_id, seed, n=n)
        msg.content = RecordDict({"weights": msg.content["arrays"],
                                  "metrics": MetricRecord({"samples": n, "partition-id": node_id})})
        return msg
    arrays, metrics = s.aggregate_train(1, [renamed(1, 1, 20), renamed(2, 2, 80)])
    assert arrays is not None and metrics["num-valid"] == 2
    m1 = build_model("mlp", 10, SHAPE, width=16, depth=1, seed=1).state_dict()
    m2 = build_model("mlp", 10, SHAPE, width=16, depth=1, seed=2).state_dict()
    torch.testing.assert_close(state_of(arrays)["3.bias"], 0.2 * m1["3.bias"] + 0.8 * m2["3.bias"])
    # "arrays"/"num-examples": not this contract; every reply breaking it stops the run with the keys named
    with pytest.raises(ReplyContractError, match="reads arrays from 'weights' and the sample count from metrics 'samples'"):
        s.aggregate_train(2, [reply(1, 1), reply(2, 2)])
    assert s.history[-1]["skipped"] and "no ArrayRecord 'weights'" in s.history[-1]["rejected"][0]["reason"]


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
    assert s.history[-1]["fallback"] is None and s.history[-1]["fusion-info"] == {}


def test_fedavg_strategy_equals_flower_weighted_average():
    s = build_strategy("fedavg")  # no model_fn: replies are checked against the global arrays sent
    grid = Mock()
    grid.get_node_ids.return_value = [1, 2]
    s._construct_messages = lambda record, node_ids, message_type: []  # Message() needs a live run
    s.configure_train(1, ArrayRecord(model_fn().state_dict()), ConfigRecord({}), grid)
    replies = [reply(1, 1, n=20), reply(2, 2, n=80)]
    arrays, _ = s.aggregate_train(1, replies)
    m1 = build_model("mlp", 10, SHAPE, width=16, depth=1, seed=1).state_dict()
    m2 = build_model("mlp", 10, SHAPE, width=16, depth=1, seed=2).state_dict()
    torch.testing.assert_close(state_of(arrays)["3.bias"], 0.2 * m1["3.bias"] + 0.8 * m2["3.bias"])


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


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    head_weights: bool = False
    class_counts: Any = None


@pytest.fixture
def scoring_method():
    """A score-using fusion method (plain average; asserts it got scores) registered for the test."""
    @_register_once("test-score-average", needs_data=False, uses_scores=True)
    def _fuse(models, *, scores, weights, **_):
        assert scores is not None and all("1" in s for s in scores)
        return _average(models, weights)
    return "test-score-average"


@pytest.mark.parametrize("kind", sorted(BAD))
def test_each_bad_reply_is_rejected_and_round_continues(kind, scoring_method):
    s = FusionStrategy(scoring_method, model_fn=model_fn)  # a score-using method: scores are validated
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
    s = FusionStrategy(scoring_method, model_fn=model_fn)
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
    assert h["failures"][0]["code"] == 2 and "RuntimeError" in h["failures"][0]["reason"]


@pytest.fixture
def always_fails():
    """A fusion method that always raises a FusionError, registered for the test only (registering at import
    time would add it to the registry-driven contract test's parameters when collected after this module)."""
    def _always_fails(models, **_):
        raise IncompatibleModelsError("cannot handle these models")

    _register_once("test-always-fails", needs_data=False)(_always_fails)
    yield "test-always-fails"
    METHOD_SPECS.pop("test-always-fails", None)
    METHODS.pop("test-always-fails", None)


@pytest.mark.parametrize("fallback", ["previous", "average"])
def test_fusion_error_falls_back_with_a_warning(fallback, caplog, always_fails):
    s = FusionStrategy("test-always-fails", model_fn=model_fn, fallback=fallback)
    with caplog.at_level("WARNING", logger="flwr"):
        arrays, metrics = s.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    fb = s.history[-1]["fallback"]
    assert fb == f"{fallback}: IncompatibleModelsError: cannot handle these models"
    assert metrics["fell-back"] == 1
    assert "round 1: fusion 'test-always-fails' failed" in caplog.text
    if fallback == "previous":
        assert arrays is None
    else:
        assert arrays is not None


def test_fallback_raise_fails_the_round(always_fails):
    s = FusionStrategy("test-always-fails", model_fn=model_fn, fallback="raise")
    with pytest.raises(FusionError, match="cannot handle"):
        s.aggregate_train(1, [reply(1, 1), reply(2, 2)])


def test_a_bug_in_a_fusion_method_is_not_a_fallback():
    @_register_once("test-buggy", needs_data=False)
    def _bug(models, **_):
        raise KeyError("a bug, not a fusion failure")
    s = FusionStrategy("test-buggy", model_fn=model_fn, fallback="average")
    with pytest.raises(KeyError, match="a bug"):
        s.aggregate_train(1, [reply(1, 1), reply(2, 2)])


def test_non_finite_fusion_result_never_becomes_global():
    @_register_once("test-nan-result", needs_data=False)
    def _nan(models, **_):
        m = build_model("mlp", 10, SHAPE, width=16, depth=1)
        with torch.no_grad():
            m[1].weight.fill_(float("nan"))
        return m
    s = FusionStrategy("test-nan-result", model_fn=model_fn)
    arrays, _ = s.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    assert arrays is None and "non-finite" in s.history[-1]["fallback"]
    assert s.history[-1]["fallback"].startswith("previous: NumericalFusionError")


def test_fusion_info_is_logged_and_kept_per_round(caplog):
    @_register_once("test-info", needs_data=False)
    def _info(models, *, weights, info, **_):
        info.update({"loss": 0.25, "steps": 3})
        return _average(models, weights)
    s = FusionStrategy("test-info", model_fn=model_fn)
    with caplog.at_level("INFO", logger="flwr"):
        s.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    assert s.history[-1]["fusion-info"] == {"loss": 0.25, "steps": 3}
    assert "round 1: test-info aggregated 2 models" in caplog.text and "loss=0.25, steps=3" in caplog.text


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

    @_register_once("test-records-options", options=HeadOptions, needs_data=False)
    def _rec(models, *, weights, options, **_):
        seen["options"] = options
        return _average(models, weights)
    s = FusionStrategy("test-records-options", model_fn=model_fn, fusion_options={"head_weights": True})
    counts = lambda c: (lambda a, i, m: m.__setitem__("class-counts", c))  # noqa: E731
    arrays, _ = s.aggregate_train(1, [reply(2, 1, mutate=counts([0, 5] + [0] * 8)),
                                      reply(1, 2, mutate=counts([7, 0] + [0] * 8))])
    assert arrays is not None
    # sorted by partition id, each scaled to its reply's sample count (50): counts give the split, not the weight
    assert seen["options"].class_counts == [[50, 0] + [0] * 8, [0, 50] + [0] * 8]
    s.aggregate_train(2, [reply(1, 1), reply(2, 2)])  # no class counts reported: a fusion error, not a crash
    assert "class-counts" in s.history[-1]["fallback"] and "MissingInputError" in s.history[-1]["fallback"]


def test_fusion_rounds_fuses_then_averages_and_stops_asking_for_scores():
    fused_rounds = []

    @_register_once("test-records-rounds", needs_data=False, uses_scores=True)
    def _rec(models, *, weights, **_):
        fused_rounds.append(len(models))
        out = _average(models, weights)
        with torch.no_grad():
            for p in out.parameters():
                p.add_(1.0)  # distinguishable from the plain average
        return out
    with pytest.raises(ValueError, match="fusion_rounds"):
        build_strategy("average", model_fn=model_fn, fusion_rounds=-1)
    s = FusionStrategy("test-records-rounds", model_fn=model_fn, fusion_rounds=1)
    assert s.round_method(1) == "test-records-rounds" and s.round_method(2) == "average"
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
    assert [h["method"] for h in s.history] == ["test-records-rounds", "average"]
    grid = Mock()
    grid.get_node_ids.return_value = [11, 12]
    s._construct_messages = lambda record, node_ids, message_type: [(record, n) for n in node_ids]
    cfg1 = list(s.configure_train(1, ArrayRecord(model_fn().state_dict()), ConfigRecord({}), grid))[0][0]["config"]
    cfg2 = list(s.configure_train(2, ArrayRecord(model_fn().state_dict()), ConfigRecord({}), grid))[0][0]["config"]
    assert cfg1["need-importance"] is True and cfg1["fusion-method"] == "test-records-rounds"
    assert cfg2["need-importance"] is False and cfg2["fusion-method"] == "average"


def test_fedfuse_core_imports_no_flower():
    code = ("import sys\n"
            "import fedfuse, fedfuse.fusion, fedfuse.models, fedfuse.config, fedfuse.data, fedfuse.training, "
            "fedfuse.importance, fedfuse.results\n"
            "bad = sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.'))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_only_fedfuse_flower_imports_flower_and_no_product_module_imports_test_support():
    product = [p for d in ("fedfuse", "server", "clients") for p in (ROOT / d).rglob("*.py")]
    assert product
    for path in product:
        mods = _imported_modules(path)
        rel = path.relative_to(ROOT).as_posix()
        assert not any(m == "tests" or m.startswith("tests.") for m in mods), f"{rel} imports test support"
        assert not any("faults" in m for m in mods), f"{rel} imports fault injection"
        if not rel.startswith(("fedfuse/flower/", "server/", "clients/")):
            assert not any(m == "flwr" or m.startswith("flwr.") for m in mods), f"{rel} imports Flower"


@pytest.mark.parametrize("name", ["average", "fedavg", "kf-linear"])
def test_a_free_rider_claiming_100x_its_samples_is_capped(name):
    """One client claims num-examples × 100: weighted as 10 × the round's median instead (default weight_cap), on the
    streamed and the validated path alike; recorded in the round's ``capped``. weight_cap=0 turns the cap off."""
    replies = [reply(1, 1, n=20), reply(2, 2, n=30), reply(3, 3, n=3000)]
    s = build_strategy(name, model_fn=model_fn, fusion_inputs=torch.randn(40, *SHAPE), refine="none", guard=False,
                       importance="server" if name == "kf-linear" else "client",
                       fusion_labels=torch.randint(0, 10, (40,)) if name == "kf-linear" else None)
    arrays, metrics = s.aggregate_train(1, replies)
    assert s.history[-1]["capped"] == [{"node-id": 3, "claimed": 3000, "used": 300}]
    if name != "kf-linear":
        m = {k: build_model("mlp", 10, SHAPE, width=16, depth=1, seed=k).state_dict() for k in (1, 2, 3)}
        expected = (20 * m[1]["3.bias"] + 30 * m[2]["3.bias"] + 300 * m[3]["3.bias"]) / 350
        torch.testing.assert_close(state_of(arrays)["3.bias"], expected, rtol=1e-5, atol=1e-6)
    off = build_strategy("fedavg", model_fn=model_fn, weight_cap=0)
    off.aggregate_train(1, replies)
    assert "capped" not in off.history[-1]
    with pytest.raises(ValueError, match="weight_cap must be >= 0"):
        build_strategy("fedavg", model_fn=model_fn, weight_cap=-1)


def test_typed_options_and_flat_keywords_build_the_same_strategy():
    from fedfuse.flower.round.options import FusionOptions, GuardOptions, MomentumOptions, RefineOptions
    fx = torch.zeros(4, *SHAPE)
    typed = FusionStrategy("kf-linear", model_fn=model_fn, fusion_inputs=fx,
                           fusion=FusionOptions(fusion_rounds=2, align_to="model-0"),
                           guard=GuardOptions(ratio=3.0), momentum=MomentumOptions(0.3, 0.5),
                           refine=RefineOptions("none"))
    flat = build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=fx, fusion_rounds=2, guard_ratio=3.0,
                          server_momentum=0.3, server_learning_rate=0.5, refine="none")
    for s in (typed, flat):
        assert (s.fusion_rounds, s.guard_step.ratio, s.momentum_step.momentum, s.momentum_step.learning_rate,
                s.refine_steps) == (2, 3.0, 0.3, 0.5, ())
    with pytest.raises(ValueError, match="guard_ratio must be > 1"):   # checked once, when the object is made
        GuardOptions(ratio=0.5)
    with pytest.raises(ValueError, match="server_momentum must be in"):
        build_strategy("average", model_fn=model_fn, server_momentum=1.5)
