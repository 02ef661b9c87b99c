"""Registry-driven contract of every strategy name (``fedfuse.strategy_specs``): it builds, runs one round
(configure + aggregate) on constructed replies under custom record keys, returns a finite global model of the
global architecture, records the round, and rejects an unknown option naming it. Plus each round step alone
(``fedfuse.flower.round.steps``) and the import direction of the layers."""

import ast
from pathlib import Path
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfuse.flower import STRATEGIES, build_strategy, state_to_record
from fedfuse.flower.round.steps import DivergenceGuard, Refinement, RoundData, ServerMomentum, StaticBatchNorm
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.fusion import client_statistics
from fedfuse.importance import uniform_importance
from fedfuse.models import build_model
from fedfuse.strategy_specs import SPECIAL_SPECS, StrategySpec, strategy_names, strategy_spec
from tests.support.layout import EXPERIMENTS

ROOT = Path(__file__).resolve().parents[1]
NAMES = [n for n in strategy_names() if not n.startswith("test-")]   # (other test modules register test methods)
SHAPE = (1, 8, 8)
ARRAYS, WEIGHT = "weights", "samples"


def model_fn(seed=0, depth_tiers=False):
    if depth_tiers:   # a depth-tier strategy's global model: two hidden layers, an exit after the first
        from fedfuse.hetero.depth import multi_exit

        return multi_exit(build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=2, seed=seed),
                          (1.0, 0.5), 10)
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=1, seed=seed)


def _depth(name):
    return strategy_spec(name).depth.required


def _x(n=60):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(1))


def _trained(seed, depth_tiers=False):
    m = model_fn(seed, depth_tiers)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return m


def _reply(node_id, seed, n, scores=True, depth_tiers=False, keys=None, statistics=None):
    msg = Mock(spec=Message)
    msg.metadata = Mock(src_node_id=node_id)
    msg.has_error.return_value = False
    model = _trained(seed, depth_tiers)
    content = RecordDict({ARRAYS: ArrayRecord({k: Array(v.numpy().copy()) for k, v in model.state_dict().items()
                                               if keys is None or k in keys}),
                          "metrics": MetricRecord({WEIGHT: n, "partition-id": node_id,
                                                   "class-counts": [n // 10] * 10})})
    if scores:   # only when the train config asks for them (``need-importance``), as fedfuse's ClientApp does
        content["importance"] = ArrayRecord({k: Array(v.numpy().copy()) for k, v in uniform_importance(model).items()})
    if statistics:   # only when the train config asks for them (``need-statistics``): the method's, on local data
        stats = client_statistics(statistics, model, _x(20), torch.arange(20) % 10)
        content["statistics"] = ArrayRecord({k: Array(v.numpy().copy()) for k, v in stats.items()})
    msg.content = content
    return msg


def _grid(n=2):
    g = Mock()
    g.get_node_ids.return_value = list(range(1, n + 1))
    return g


def _build(name, **extra):
    extra = {"min_train_nodes": 2, "min_available_nodes": 2, **extra}
    depth = {"depths": (1.0, 0.5)} if _depth(name) else {}
    return build_strategy(name, model_fn=lambda: model_fn(depth_tiers=_depth(name)), fusion_inputs=_x(),
                          fusion_labels=torch.arange(60) % 10, arrayrecord_key=ARRAYS, weighted_by_key=WEIGHT,
                          **depth, **extra)


@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_name_builds_and_runs_one_round_under_custom_record_keys(name, monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):   # Message() needs a run identity
        monkeypatch.setattr(TaskIdentity, attr, value)
    n = 3 if name == "bulyan" else 2   # Bulyan needs 4f + 3 replies (f = 0)
    if name == "bulyan":
        with pytest.raises(ValueError, match="min_train_nodes"):
            _build(name)
    s = _build(name, **({"min_train_nodes": 3, "min_available_nodes": 3} if n == 3 else {}))
    assert s.method == name and type(s) is STRATEGIES[name].protocol
    depth = _depth(name)
    if hasattr(s, "tier_layout"):
        s.tier_layout.node_tier = {1: 1.0, 2: 1.0}   # known nodes: no tier query
        s.tier_layout.node_depth = {1: 1.0, 2: 1.0} if depth else {}
    init = model_fn(depth_tiers=depth)
    msgs = list(s.configure_train(1, state_to_record(init.state_dict()), ConfigRecord({}), _grid(n)))
    assert len(msgs) == n and all(ARRAYS in m.content for m in msgs)
    scores = bool(msgs[0].content["config"]["need-importance"])
    held = set(msgs[0].content[ARRAYS]) if depth else None   # a depth tier replies with the arrays it was sent
    stats = msgs[0].content["config"]["fusion-method"] if msgs[0].content["config"].get("need-statistics") else None
    replies = [_reply(1, 1, 30, scores, depth, held, stats), _reply(2, 2, 90, scores, depth, held, stats)] + \
        ([_reply(3, 3, 60, scores, statistics=stats)] if n == 3 else [])
    arrays, metrics = s.aggregate_train(1, replies)
    record = s.history[-1]
    assert record["valid"] == n and not record["rejected"] and record["fallback"] is None, record
    assert arrays is not None and metrics["num-examples"] == (120 if n == 2 else 180)
    out = {k: torch.from_numpy(np.array(v.numpy())) for k, v in arrays.items()}
    ref = init.state_dict()
    if strategy_spec(name).one_shot_only:   # every client's model side by side: rebuilt from the clients' architecture
        from fedfuse.fusion.stack import model_for_state

        rebuilt = model_for_state(model_fn, out)
        assert len(rebuilt.members) == n and rebuilt(_x(4)).shape == (4, 10)
        assert {k: tuple(v.shape) for k, v in rebuilt.members[0].state_dict().items()} == \
            {k: tuple(v.shape) for k, v in ref.items()}
    else:
        assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    assert all(bool(torch.isfinite(v.float()).all()) for v in out.values())


@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_name_rejects_an_unknown_option_naming_it(name):
    with pytest.raises(TypeError, match="no_such_option"):
        _build(name, no_such_option=1)


def test_an_unknown_strategy_name_says_the_closest_one():
    with pytest.raises(ValueError, match="did you mean 'kf-linear'"):
        build_strategy("kf-linaer")
    with pytest.raises(ValueError, match="does not return the global architecture"):
        strategy_spec("ensemble")


def test_registry_entries_are_well_formed_and_fold_the_old_name_lists():
    from fedfuse.strategy_specs import FLOWER_BASELINE_STRATEGIES, NON_FUSION_STRATEGIES, TIER_STRATEGIES
    from fedfuse.hetero.tiers import SUBMODEL_METHODS

    assert FLOWER_BASELINE_STRATEGIES == ("fedavgm", "fedadam", "fedyogi", "fedprox", "fedmedian", "fedtrimmedavg", "krum",
                                          "multikrum", "bulyan")
    assert NON_FUSION_STRATEGIES == ("fedavg",) + FLOWER_BASELINE_STRATEGIES
    assert TIER_STRATEGIES == ("heterofl", "fedrolex") and SUBMODEL_METHODS == ("average", "feddf")
    from fedfuse.strategy_specs import DEPTH_TIER_STRATEGIES

    assert DEPTH_TIER_STRATEGIES == ("depthfl", "depthfl-fedavg", "inclusivefl")
    assert set(STRATEGIES) <= set(strategy_names())   # (+ fusion methods registered later, e.g. by tests)
    for name in strategy_names():
        spec = strategy_spec(name)
        # a fusion strategy runs its own method; auto is the clients' vote, not the fusion method "auto"
        assert spec.name == name and (spec.aggregation != "fusion" or spec.method == (None if spec.selects else name))
    with pytest.raises(ValueError, match="aggregation"):
        StrategySpec("x", "nonsense")
    assert SPECIAL_SPECS["average"].default_server_momentum == 0.5 and SPECIAL_SPECS["feddf"].server_step == "paper"


# ------------------------------------------------------------------------------------------ round steps alone
def _round(models, weights, fusion=True, global_state=None):
    ups = [ClientUpdate(i, i, m.state_dict(), None, 10, {}, [1] * 10) for i, m in enumerate(models)]
    avg = {k: sum(w * m.state_dict()[k] for w, m in zip(weights, models)) for k in models[0].state_dict()}

    def build(state):
        m = model_fn()
        m.load_state_dict(state)
        return m.eval()

    return RoundData(1, ups, weights, _x() if fusion else None, build, lambda: avg, None,
                     state_to_record(global_state) if global_state is not None else None, "test", 1, "cpu")


def test_divergence_guard_alone_keeps_an_agreeing_model_and_replaces_a_broken_one():
    models = [_trained(1), _trained(2)]
    rd = _round(models, [0.5, 0.5])
    kept, info = DivergenceGuard(2.0)(models[0], rd)
    assert kept is models[0] and "guard" not in info
    broken = _trained(3)
    with torch.no_grad():
        for p in broken.parameters():
            p.mul_(50.0)
    out, info = DivergenceGuard(2.0)(broken, rd)
    assert out is not broken and "guard" in info and info["guard-kl-fused"] > info["guard-kl-average"]
    with pytest.raises(ValueError, match="guard_ratio"):
        DivergenceGuard(1.0)


def test_server_momentum_alone_is_fedavgms_step():
    x0, a1, a2 = _trained(1).state_dict(), _trained(2).state_dict(), _trained(3).state_dict()
    step = ServerMomentum(0.5)
    m = model_fn()
    m.load_state_dict(a1)
    out, info = step(m, _round([m], [1.0], global_state=x0))
    assert all(torch.equal(out.state_dict()[k], a1[k]) for k in a1)   # first step: the aggregate itself
    m2 = model_fn()
    m2.load_state_dict(a2)
    out2, _ = step(m2, _round([m2], [1.0], global_state=a1))
    for k in a1:   # v1 = a1 - x0; v2 = 0.5 v1 + (a2 - a1); x2 = a1 + v2
        want = (a1[k].double() + 0.5 * (a1[k].double() - x0[k].double()) + a2[k].double() - a1[k].double()).float()
        torch.testing.assert_close(out2.state_dict()[k], want)
    step.reset()
    assert step.velocity is None
    with pytest.raises(ValueError, match="server_momentum"):
        ServerMomentum(1.0)


def test_refinement_alone_is_kept_only_when_it_moves_towards_the_ensemble():
    models = [_trained(1), _trained(2)]
    rd = _round(models, [0.5, 0.5])
    skewed = torch.tensor([1000.0] + [1.0] * 9)
    away = Refinement(("calibrate",), calibrate_min_gap=0.0, prior_fn=lambda updates: (skewed, "test"))
    before = {k: v.clone() for k, v in models[0].state_dict().items()}
    out, info = away(models[0], rd)
    assert info["refine-kept"] == 0 and all(torch.equal(out.state_dict()[k], before[k]) for k in before)
    with pytest.raises(ValueError, match="prior"):
        Refinement(("calibrate",), prior="nope")


def test_static_batch_norm_alone_reestimates_on_the_fusion_set():
    m = build_model("cnn", num_classes=10, input_shape=SHAPE, width=8, depth=1, seed=0)
    has_bn = any(isinstance(x, torch.nn.modules.batchnorm._BatchNorm) for x in m.modules())
    out, info = StaticBatchNorm()(m, _round([model_fn()], [1.0]))
    assert info.get("static-bn", False) == has_bn
    assert StaticBatchNorm()(m, _round([model_fn()], [1.0], fusion=False))[1] == {}


# ------------------------------------------------------------------------------------------ layering
def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize("layer, forbidden", [
    ("fedfuse/models", ("fedfuse.fusion", "fedfuse.flower", "fedfuse.pruning", *EXPERIMENTS)),
    ("fedfuse/fusion", ("fedfuse.flower", *EXPERIMENTS)),
    ("fedfuse", (*EXPERIMENTS, "tests")),
])
def test_no_module_imports_upward(layer, forbidden):
    assert EXPERIMENTS
    for path in (ROOT / layer).rglob("*.py"):
        bad = {m for m in _imports(path) if any(m == f or m.startswith(f + ".") for f in forbidden)}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


# ------------------------------------------------------------------------------------------ identity in one place
def _ident(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _literals(node: ast.AST) -> list[str]:
    """The str literal, or the str literals of a tuple / set / list of them (else nothing)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if (isinstance(node, (ast.Tuple, ast.Set, ast.List)) and node.elts
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)):
        return [e.value for e in node.elts]
    return []


def strategy_name_comparisons(source: str, rel: str, names) -> list[str]:
    """The comparisons in ``source`` (file ``rel``, relative to the root) of a strategy against a registered
    strategy name: one side a name ending in ``strategy`` (or ``method`` / ``name`` in ``fedfuse/flower/`` and
    ``fedfuse/config.py``), the other a str literal (or a tuple / set / list of them) naming a strategy."""
    narrow = rel.startswith("fedfuse/flower/") or rel == "fedfuse/config.py"
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        idents = [n for n in map(_ident, sides) if n and (n.endswith("strategy") or (narrow and n in ("method", "name")))]
        if idents and any(v in names for side in sides for v in _literals(side)):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_compares_strategy_names_outside_the_registry():
    """Issue 46: a strategy's capabilities are data on its registry entry (``fedfuse.strategy_specs``); no code
    outside the registry (and the fusion methods' own package) compares a strategy against a strategy name."""
    names = set(strategy_names())
    found = []
    for path in sorted((ROOT / "fedfuse").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "fedfuse/strategy_specs.py" or rel.startswith("fedfuse/fusion/"):
            continue
        found += strategy_name_comparisons(path.read_text(), rel, names)
    assert not found, "compare the registry entry's capability instead:\n" + "\n".join(found)
    # the scan sees what it is for
    assert strategy_name_comparisons('if cfg.strategy == "fedavg": pass', "fedfuse/x.py", names)
    assert strategy_name_comparisons('ok = name not in ("feddf", "ot")', "fedfuse/flower/x.py", names)
    assert not strategy_name_comparisons('ok = name == "feddf"', "fedfuse/data/x.py", names)
    assert not strategy_name_comparisons('ok = cfg.refine == "calibrate"', "fedfuse/config.py", names)


def test_capabilities_on_the_entries_give_the_old_name_lists():
    from fedfuse.strategy_specs import DP_STRATEGIES
    from fedfuse.strategy_specs import (ARRAY_CANDIDATES, DEPTH_METHODS, DEPTH_WARM_START, MEAN_METHODS,
                                        SELECTING_STRATEGIES, STRATEGY_KEYS_ALL, WIDTH_DEPTH_TIER_METHODS)
    from fedfuse.flower.aggregators.baselines import baseline_options

    assert DEPTH_METHODS == ("depthfl", "depthfl-fedavg", "inclusivefl", "average", "feddf", "ot")
    assert WIDTH_DEPTH_TIER_METHODS == ("depthfl", "depthfl-fedavg", "average", "feddf")
    assert DEPTH_WARM_START == ("ot", "feddf") and SELECTING_STRATEGIES == ("auto",)
    assert MEAN_METHODS == ("average",) and ARRAY_CANDIDATES == ("average", "fedavg")
    assert set(DP_STRATEGIES) == {"fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi"}
    assert STRATEGY_KEYS_ALL == ("server-lr", "server-momentum", "proximal-mu", "trim-beta", "num-malicious-nodes",
                                 "num-nodes-to-select", "mom-beta")
    assert {n: strategy_spec(n).min_replies for n in ("krum", "multikrum", "bulyan", "fedavg", "ot")} == {
        "krum": (1, 3), "multikrum": (1, 3), "bulyan": (4, 3), "fedavg": (0, 1), "ot": (0, 1)}
    for name, spec in SPECIAL_SPECS.items():   # a Flower entry's run-config keys are its Flower options' keys
        if spec.aggregation == "flower":
            assert spec.run_keys == tuple(k for k, _ in spec.flower_options), name
    assert not strategy_spec("depthfl-fedavg").depth.self_distills and strategy_spec("depthfl").depth.self_distills
    assert strategy_spec("ot").depth.aligns and strategy_spec("ot").depth.distils_exits
    assert strategy_spec("feddf").depth.distils_exits
    kw = dict(server_lr=0.5, server_momentum=0.9, proximal_mu=0.1, trim_beta=0.3, num_malicious_nodes=1,
              num_nodes_to_select=2)
    assert baseline_options("fedavgm", **kw) == {"server_momentum": 0.9, "server_learning_rate": 0.5}
    assert baseline_options("fedadam", **kw) == {"eta": 0.5} and baseline_options("fedyogi", server_lr=0) == {}
    assert baseline_options("fedprox", **kw) == {"proximal_mu": 0.1}
    assert baseline_options("fedtrimmedavg", **kw) == {"beta": 0.3} and baseline_options("fedtrimmedavg") == {}
    assert baseline_options("krum", **kw) == {"num_malicious_nodes": 1} == baseline_options("bulyan", **kw)
    assert baseline_options("multikrum", **kw) == {"num_malicious_nodes": 1, "num_nodes_to_select": 2}
    assert baseline_options("average", **kw) == {"server_momentum": 0.9, "server_learning_rate": 0.5}
    assert baseline_options("feddf", **kw) == {} == baseline_options("fedmedian", **kw) == baseline_options("nope", **kw)
    assert baseline_options("average", server_lr=0.0) == {}


def test_strategy_classes_take_their_docstring_from_the_registry_entry():
    from fedfuse.flower.strategies import FedDfStrategy, KdStrategy, OtStrategy

    assert OtStrategy.__doc__ == strategy_spec("ot").paper and "arXiv 1910.05653" in OtStrategy.__doc__
    assert KdStrategy.__doc__ == strategy_spec("kd").paper and "arXiv 2006.07242" in FedDfStrategy.__doc__
    assert FedDfStrategy.__doc__ == SPECIAL_SPECS["feddf"].paper
