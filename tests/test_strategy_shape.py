"""The strategies compose instead of inheriting (issue 58 item 1): registry names are presets (an entry + the round
protocol that runs it), no strategy class is made by ``type()``, the round protocol has no mixin (the way a reply
travels is ``fedfuse/flower/round/protocol.py``), Flower's baselines are not fusion strategies, and no strategy class
is deeper than its fixed bound."""

from __future__ import annotations

import ast
from pathlib import Path

from flwr.serverapp.strategy import FedAvg

from fedfuse.flower import STRATEGIES, FusionStrategy, Preset, RoundProtocol

FLOWER = Path(__file__).resolve().parents[1] / "fedfuse" / "flower"
#: the longest MRO of a registry strategy: its class, TieredFusionStrategy / DepthTieredStrategy, FusionStrategy,
#: RoundProtocol, then Flower's FedAvg, Strategy, ABC, object (12 with the mixins and FedRolex -> HeteroFL)
MAX_MRO = 8


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
