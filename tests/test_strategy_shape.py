"""The strategies compose instead of inheriting (issue 58 item 1): registry names are presets (an entry + the round
protocol that runs it), no strategy class is made by ``type()``, the round protocol has no mixin (the way a reply
travels is ``fedfuse/flower/round/protocol.py``), the fusion method and its steps are an object a protocol holds
(``FusionAggregator``) rather than a class the tiers, depth tiers and ``auto`` inherit, Flower's baselines are not
fusion strategies, and no strategy class is deeper than its fixed bound."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import torch
from flwr.serverapp.strategy import FedAvg

import fedfuse.flower
from fedfuse.flower import STRATEGIES, FusionStrategy, Preset, RoundProtocol, build_strategy
from fedfuse.flower.aggregators.fusion_strategy import FusionAggregator
from fedfuse.flower.aggregators.selection import SelectionStrategy
from fedfuse.flower.tiers.depth_tiers import DepthTieredStrategy
from fedfuse.flower.tiers.tiered import TieredFusionStrategy, build_tier_strategy
from fedfuse.models import build_model

FLOWER = Path(__file__).resolve().parents[1] / "fedfuse" / "flower"
#: the longest MRO of a registry strategy: a named class (KfLinearStrategy, HeteroFLStrategy, DepthFLStrategy), the
#: protocol that holds its aggregator (FusionStrategy, TieredFusionStrategy, DepthTieredStrategy), RoundProtocol, then
#: Flower's FedAvg, Strategy, ABC, object (8 while the tiers inherited FusionStrategy; 12 with the mixins)
MAX_MRO = 7


def test_no_strategy_class_is_made_by_type():
    calls = []
    for path in FLOWER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" \
                    and len(node.args) == 3:
                calls.append(f"{path.relative_to(FLOWER)}:{node.lineno}")
    assert calls == []


def test_registry_names_are_presets_run_by_one_protocol_without_mixins():
    for name, preset in STRATEGIES.items():
        assert isinstance(preset, Preset) and preset.method == name
        mro = preset.protocol.__mro__
        assert len(mro) <= MAX_MRO, (name, [c.__name__ for c in mro])
        assert mro.index(RoundProtocol) < mro.index(FedAvg)
        for cls in mro[:mro.index(RoundProtocol) + 1]:   # single inheritance down to the protocol: no mixin
            assert len(cls.__bases__) == 1, (name, cls.__name__, cls.__bases__)
    assert RoundProtocol.__bases__ == (FedAvg,)


def test_flower_baselines_and_fedavg_are_not_fusion_strategies():
    for name, preset in STRATEGIES.items():
        if preset.entry.aggregation in ("arrays", "flower"):
            assert not issubclass(preset.protocol, FusionStrategy), name


def test_a_preset_can_still_be_subclassed_to_add_a_step():
    """Before presets, ``STRATEGIES[name]`` was a class users subclassed; it still works (PEP 560)."""
    from fedfuse.flower import STRATEGIES

    class Mine(STRATEGIES["kf-linear"]):
        extra = True

    assert issubclass(Mine, STRATEGIES["kf-linear"].protocol) and Mine.method == "kf-linear"


def _strategy_classes() -> list[type]:
    """Every class defined in ``fedfuse.flower`` that is a ``RoundProtocol``."""
    found = set()
    for info in pkgutil.walk_packages(fedfuse.flower.__path__, "fedfuse.flower."):
        module = importlib.import_module(info.name)
        found.update(cls for _, cls in inspect.getmembers(module, inspect.isclass)
                     if issubclass(cls, RoundProtocol) and cls.__module__ == module.__name__)
    return sorted(found, key=lambda c: (c.__module__, c.__name__))


def test_only_the_named_fusion_presets_subclass_fusion_strategy():
    """``FusionStrategy`` is the protocol holding a fusion aggregator; its only subclasses are the named classes that
    fix ``method`` (``KfLinearStrategy``, ...). Tiers, depth tiers and ``auto`` hold an aggregator of their own."""
    classes = _strategy_classes()
    assert {TieredFusionStrategy, DepthTieredStrategy, SelectionStrategy} <= set(classes)
    for cls in classes:
        if cls is FusionStrategy or not issubclass(cls, FusionStrategy):
            continue
        assert cls.__bases__ == (FusionStrategy,) and cls.__module__ == "fedfuse.flower.strategies", cls
        assert {k for k in vars(cls) if not k.startswith("_")} == {"method"}, cls   # fixes the method, nothing else
    for cls in (TieredFusionStrategy, DepthTieredStrategy, SelectionStrategy):
        assert cls.__bases__ == (RoundProtocol,), cls


def test_a_fusion_protocol_holds_its_aggregator_and_answers_for_its_settings():
    shape = (40,)

    def model_fn():
        return build_model("mlp", 10, shape, width=16, depth=2)

    x = torch.randn(16, *shape)
    plain = build_strategy("kf-linear", model_fn=model_fn, fusion_inputs=x)
    tiered = build_tier_strategy("heterofl", tiers=(1.0, 0.5), input_shape=shape, model_fn=model_fn, fusion_inputs=x)
    auto = build_strategy("auto", model_fn=model_fn, fusion_inputs=x)
    for s in (plain, tiered, auto):
        assert isinstance(s.aggregator, FusionAggregator) and s.aggregator.host is s
        assert s.momentum_step is s.aggregator.momentum_step and s.refinement is s.aggregator.refinement
        assert s.method == s.aggregator.method and s.round_label(1) == s.aggregator.round_method(1)
    assert plain.refine_steps == plain.aggregator.refine_steps
    tiered.guard = False   # a setting set through the strategy is set where the aggregation reads it
    assert tiered.aggregator.guard is False and "guard" not in vars(tiered)

    def marker(model, rd):
        return model, {"marker": True}

    class Mine(STRATEGIES["kf-linear"]):   # a plug-in adds a step after the aggregator's own
        def post_steps(self, server_round):
            return super().post_steps(server_round) + [marker]

    mine = Mine(model_fn=model_fn, fusion_inputs=x)
    assert mine.post_steps(1) == mine.aggregator.post_steps(1) + [marker]
    assert build_strategy("fedavg").aggregator is None   # the protocol alone: FedAvg supplies its aggregate
