"""Every strategy name, built from its registry entry (``fedfuse.strategy_specs``).

    from fedfuse.flower import build_strategy, STRATEGIES, KfLinearStrategy
    strategy = build_strategy("kf-linear", model_fn=..., fusion_inputs=X)      # by name
    strategy = KfLinearStrategy(model_fn=..., fusion_inputs=X)                  # the same, by class

A name is a preset (``Preset``), not a class of its own: its registry entry (what aggregates, the default round
steps, the defaults) and the round protocol that runs it, picked from the entry's aggregation: ``FusionStrategy``
for fusion methods (``average`` included), ``FedAvgStrategy`` for FedAvg, ``FlowerBaselineStrategy`` holding one
of Flower's own strategies (``fedfuse.flower.aggregators.baselines``), the sub-model averages of the capacity-tier
baselines (``fedfuse.flower.tiers.tiered``), the depth-tier baselines, ``SelectionStrategy`` for ``auto``. The
named classes users import are thin classes that fix ``method``; adding a strategy is one registry entry (or one
fusion method in ``fedfuse.fusion``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedfuse.flower.aggregators.baselines import FLOWER_BASELINES, FlowerBaselineStrategy
from fedfuse.flower.aggregators.fusion_strategy import FusionStrategy
from fedfuse.flower.round.options import arrays_only
from fedfuse.flower.round.protocol import RoundProtocol
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.flower.aggregators.selection import SelectionStrategy
from fedfuse.flower.tiers.depth_tiers import DEPTH_STRATEGY_CLASSES, build_depth_strategy
from fedfuse.flower.tiers.tiered import TIER_STRATEGY_CLASSES, build_tier_strategy
from fedfuse.config import ordered_dropout_draw
from fedfuse.strategy_specs import StrategySpec, key_applies, strategy_names, strategy_spec


class FedAvgStrategy(RoundProtocol):
    """Federated averaging (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
    Data", arXiv 1602.05629) over validated replies: the sample-weighted mean of every floating-point array;
    integer buffers (BatchNorm counters) come from the first reply. The round protocol and nothing else: works on the
    arrays alone (``model_fn`` optional; rounds stream the replies into a running sum), no fusion, no server step,
    no refinement. The fusion strategies' flat options are accepted where they change nothing (``guard``, ``prior``,
    ...); one that would (``fusion_options``, ``refine``, ``server_momentum``, ``fusion_rounds``) is a ``ValueError``."""

    method = "fedavg"

    def __init__(self, method: str | None = None, **options: Any) -> None:
        if method not in (None, type(self).method):
            raise ValueError(f"strategy: {type(self).__name__} aggregates with {type(self).method!r}, not {method!r}")
        arrays_only(type(self).method, "plain FedAvg", options)
        super().__init__(**options)
        self.entry = strategy_spec(type(self).method)

    def aggregate(self, server_round: int, updates: list[ClientUpdate]):
        return self.average(updates), {}, 0.0   # the arrays only: no model built, no step

    def streaming_round(self, server_round: int) -> bool:
        return not self.keep_updates and self.screen is None   # the stream's average is the result: no step


@dataclass(frozen=True)
class Preset:
    """A strategy name, ``STRATEGIES[name]``: what aggregates and the default round steps (its registry entry,
    ``fedfuse.strategy_specs``: ``entry.aggregation``, ``default_refine``, ``default_server_momentum``, the guard,
    static BN), run by one round protocol (``protocol``: a ``RoundProtocol`` class, given ``method=name``). A preset
    is data, not a generated class; calling it builds the strategy:

        STRATEGIES["kf-linear"](model_fn=..., fusion_inputs=X)   # == build_strategy("kf-linear", ...)
    """

    name: str
    protocol: type[RoundProtocol]

    @property
    def method(self) -> str:
        return self.name

    @property
    def entry(self) -> StrategySpec:
        return strategy_spec(self.name)

    @property
    def aggregation(self) -> str:
        """What the round aggregates with: ``"select"`` (strategy ``auto``'s vote) or the entry's aggregation."""
        return "select" if self.entry.selects else self.entry.aggregation

    @property
    def doc(self) -> str:
        """What the name is: the registry entry's paper line, else the protocol's docstring."""
        return self.entry.paper or self.protocol.__doc__ or ""

    def __call__(self, **options: Any) -> RoundProtocol:
        return self.protocol(self.name, **options)

    def __mro_entries__(self, bases: tuple) -> tuple[type]:
        """``class Mine(STRATEGIES["kf-linear"])`` (a subclass that adds one step, as before presets) subclasses the
        protocol class that runs this name (PEP 560); it must fix the name's method to be used without ``method=``."""
        if getattr(self.protocol, "method", None) not in (None, self.name):
            raise TypeError(f"STRATEGIES[{self.name!r}] runs {self.protocol.__name__}, which fixes another method")
        return (self.protocol,)


class AverageStrategy(FusionStrategy):
    method = "average"


class KdStrategy(FusionStrategy):
    method = "kd"


class LpStrategy(FusionStrategy):
    method = "lp"


class HfLinearStrategy(FusionStrategy):
    method = "hf-linear"


class KfLinearStrategy(FusionStrategy):
    method = "kf-linear"


class HfGradientStrategy(FusionStrategy):
    method = "hf-gradient"


class KfGradientStrategy(FusionStrategy):
    method = "kf-gradient"


class OtStrategy(FusionStrategy):
    method = "ot"


class RebasinStrategy(FusionStrategy):
    method = "rebasin"


class TransfusionStrategy(FusionStrategy):
    method = "transfusion"


class FsMergeStrategy(FusionStrategy):
    method = "fs-merge"


class FsMergeSeqStrategy(FusionStrategy):
    method = "fs-merge-seq"


class FedDfStrategy(FusionStrategy):
    method = "feddf"


#: the classes users import by name (``from fedfuse.flower import KfLinearStrategy``): ``FusionStrategy`` with the
#: method fixed, each documented by its registry entry; any other fusion method's preset runs ``FusionStrategy``
_NAMED: dict[str, type[RoundProtocol]] = {cls.method: cls for cls in (
    AverageStrategy, KdStrategy, LpStrategy, HfLinearStrategy, KfLinearStrategy, HfGradientStrategy,
    KfGradientStrategy, OtStrategy, RebasinStrategy, TransfusionStrategy, FsMergeStrategy, FsMergeSeqStrategy,
    FedDfStrategy)}
for _cls in _NAMED.values():
    _cls.__doc__ = strategy_spec(_cls.method).paper or f"``FusionStrategy`` with fusion method ``{_cls.method}``."


def _protocol(name: str) -> type[RoundProtocol]:
    """The round protocol class that runs strategy ``name`` (from its registry entry's aggregation)."""
    spec = strategy_spec(name)
    if spec.aggregation == "arrays":
        return FedAvgStrategy
    if spec.aggregation == "flower":   # a typed class of Flower's options, else the entry's flower_class
        return FLOWER_BASELINES.get(name, FlowerBaselineStrategy)
    if spec.aggregation == "submodel":
        return TIER_STRATEGY_CLASSES[name]
    if spec.aggregation == "depth":
        return DEPTH_STRATEGY_CLASSES[name]
    if spec.selects:
        return SelectionStrategy
    return _NAMED.get(name, FusionStrategy)


def _registry() -> dict[str, Preset]:
    return {name: Preset(name, _protocol(name)) for name in strategy_names()}


STRATEGIES: dict[str, Preset] = _registry()


def build_strategy(name: str, **options: Any) -> RoundProtocol:
    """Build the strategy registered as ``name`` (a ``flwr.serverapp.strategy.Strategy``): its preset's round
    protocol with ``method=name``.

    ``options`` are the implementation's keyword options (``FusionStrategy``'s: ``model_fn``, ``fusion_inputs``,
    ``fusion_options``, ``fallback``, …, and Flower ``FedAvg``'s ``fraction_train``, ``min_train_nodes``, …).
    ``ValueError`` naming the closest name for an unknown strategy.
    """
    if name not in STRATEGIES:
        STRATEGIES[name] = Preset(name, _protocol(name))   # a fusion method registered after import (or the
        # ValueError with the closest name)
    return STRATEGIES[name](**options)


def strategy_builder(cfg, input_shape: tuple[int, ...]):
    """``(build function, its extra options)`` for a run config: ``build_tier_strategy`` with ``cfg.tiers`` when
    tiers are set or the strategy needs them, else ``build_strategy``."""
    if cfg.depth_tiers:   # depth tiers: fedfuse.flower.tiers.depth_tiers (inclusivefl: its beta)
        return build_depth_strategy, {"depths": cfg.depth_tiers, "widths": cfg.depth_tier_widths,
                                      "input_shape": tuple(input_shape), "ordered_dropout": cfg.ordered_dropout,
                                      "ordered_dropout_draw": ordered_dropout_draw(cfg),
                                      **({"mom_beta": cfg.mom_beta} if key_applies("mom-beta", cfg.strategy) else {})}
    if not cfg.tiers and not strategy_spec(cfg.strategy).tiers.required:
        return build_strategy, {}
    return build_tier_strategy, {"tiers": cfg.tiers or (1.0,), "tier_models": cfg.tier_models,
                                 "input_shape": tuple(input_shape), "ordered_dropout": cfg.ordered_dropout,
                                 "ordered_dropout_draw": ordered_dropout_draw(cfg)}


__all__ = ["STRATEGIES", "Preset", "build_strategy", "strategy_builder", "FedAvgStrategy", "AverageStrategy", "KdStrategy",
           "LpStrategy", "HfLinearStrategy", "KfLinearStrategy", "HfGradientStrategy", "KfGradientStrategy",
           "OtStrategy", "RebasinStrategy", "TransfusionStrategy", "FsMergeStrategy", "FsMergeSeqStrategy",
           "FedDfStrategy", "SelectionStrategy"]
