"""Every strategy name, built from its registry entry (``fedfuse.strategy_specs``).

    from fedfuse.flower import build_strategy, STRATEGIES, KfLinearStrategy
    strategy = build_strategy("kf-linear", model_fn=..., fusion_inputs=X)      # by name
    strategy = KfLinearStrategy(model_fn=..., fusion_inputs=X)                  # the same, by class

``build_strategy`` picks the implementation from the entry's aggregation: a ``FusionStrategy`` for fusion
methods (``average`` included), ``FedAvgStrategy`` for FedAvg, Flower's own strategies
(``fedfuse.flower.aggregators.baselines``) and the sub-model averages of the capacity-tier baselines
(``fedfuse.flower.tiers.tiered``). The named classes are thin aliases that fix ``method``; adding a strategy is
one registry entry (or one fusion method in ``fedfuse.fusion``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from fedfuse.flower.aggregators.baselines import FLOWER_BASELINES, flower_baseline_class
from fedfuse.flower.aggregators.fusion_strategy import FusionStrategy
from fedfuse.flower.round.options import arrays_only
from fedfuse.flower.round.protocol import RoundProtocol
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.flower.aggregators.selection import SelectionStrategy
from fedfuse.flower.round.streaming import StreamedRounds
from fedfuse.flower.tiers.depth_baselines import DEPTH_STRATEGY_CLASSES, build_depth_strategy
from fedfuse.flower.tiers.tiered import TIER_STRATEGY_CLASSES, build_tier_strategy
from fedfuse.config import ordered_dropout_draw
from fedfuse.strategy_specs import key_applies, strategy_names, strategy_spec


class FedAvgStrategy(StreamedRounds, RoundProtocol):
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
        return not self.keep_updates and self.screen is None

    def stream_checks_calibration(self) -> bool:
        return False

    def _finish_stream(self, server_round: int, average: dict[str, torch.Tensor], probs, updates):
        return average, {}, 0.0   # no step after the average


def _class_name(method: str) -> str:
    return "".join(p.capitalize() for p in re.split(r"[-_]", method)) + "Strategy"


def _named(method: str, name: str | None = None) -> type[FusionStrategy]:
    """A thin alias class of ``FusionStrategy`` that fixes ``method``."""
    doc = strategy_spec(method).paper or f"``FusionStrategy`` with fusion method ``{method}``."
    return type(name or _class_name(method), (FusionStrategy,), {"method": method, "__doc__": doc,
                                                                  "__module__": __name__})


AverageStrategy = _named("average")
KdStrategy = _named("kd")
LpStrategy = _named("lp")
HfLinearStrategy = _named("hf-linear")
KfLinearStrategy = _named("kf-linear")
HfGradientStrategy = _named("hf-gradient")
KfGradientStrategy = _named("kf-gradient")
OtStrategy = _named("ot")
RebasinStrategy = _named("rebasin")
TransfusionStrategy = _named("transfusion")
FsMergeStrategy = _named("fs-merge")
FsMergeSeqStrategy = _named("fs-merge-seq")
FedDfStrategy = _named("feddf", "FedDfStrategy")
_NAMED = {cls.method: cls for cls in (AverageStrategy, KdStrategy, LpStrategy, HfLinearStrategy, KfLinearStrategy,
                                      HfGradientStrategy, KfGradientStrategy, OtStrategy, RebasinStrategy,
                                      TransfusionStrategy, FsMergeStrategy, FsMergeSeqStrategy, FedDfStrategy)}


def _implementation(name: str) -> type[RoundProtocol]:
    spec = strategy_spec(name)
    if spec.aggregation == "arrays":
        return FedAvgStrategy
    if spec.aggregation == "flower":
        return FLOWER_BASELINES.get(name) or flower_baseline_class(name, spec.flower_class)
    if spec.aggregation == "submodel":
        return TIER_STRATEGY_CLASSES[name]
    if spec.aggregation == "depth":
        return DEPTH_STRATEGY_CLASSES[name]
    if spec.selects:
        return SelectionStrategy
    if name not in _NAMED:   # a fusion method without a written alias: its class is importable by name too
        _NAMED[name] = globals()[_class_name(name)] = _named(name)
    return _NAMED[name]


def _registry() -> dict[str, type[RoundProtocol]]:
    return {name: _implementation(name) for name in strategy_names()}


STRATEGIES: dict[str, type[RoundProtocol]] = _registry()


def build_strategy(name: str, **options: Any) -> RoundProtocol:
    """Build the strategy registered as ``name`` (a ``flwr.serverapp.strategy.Strategy``).

    ``options`` are the implementation's keyword options (``FusionStrategy``'s: ``model_fn``, ``fusion_inputs``,
    ``fusion_options``, ``fallback``, …, and Flower ``FedAvg``'s ``fraction_train``, ``min_train_nodes``, …).
    ``ValueError`` naming the closest name for an unknown strategy.
    """
    if name not in STRATEGIES:
        strategy_spec(name)   # raises the ValueError with the closest name
        STRATEGIES[name] = _implementation(name)   # a fusion method registered after import
    return STRATEGIES[name](**options)


def strategy_builder(cfg, input_shape: tuple[int, ...]):
    """``(build function, its extra options)`` for a run config: ``build_tier_strategy`` with ``cfg.tiers`` when
    tiers are set or the strategy needs them, else ``build_strategy``."""
    if cfg.depth_tiers:   # depth tiers: fedfuse.flower.tiers.depth_tiers, depth_baselines (inclusivefl: its beta)
        return build_depth_strategy, {"depths": cfg.depth_tiers, "widths": cfg.depth_tier_widths,
                                      "input_shape": tuple(input_shape), "ordered_dropout": cfg.ordered_dropout,
                                      "ordered_dropout_draw": ordered_dropout_draw(cfg),
                                      **({"mom_beta": cfg.mom_beta} if key_applies("mom-beta", cfg.strategy) else {})}
    if not cfg.tiers and not strategy_spec(cfg.strategy).tiers.required:
        return build_strategy, {}
    return build_tier_strategy, {"tiers": cfg.tiers or (1.0,), "tier_models": cfg.tier_models,
                                 "input_shape": tuple(input_shape), "ordered_dropout": cfg.ordered_dropout,
                                 "ordered_dropout_draw": ordered_dropout_draw(cfg)}


__all__ = ["STRATEGIES", "build_strategy", "strategy_builder", "FedAvgStrategy", "AverageStrategy", "KdStrategy",
           "LpStrategy", "HfLinearStrategy", "KfLinearStrategy", "HfGradientStrategy", "KfGradientStrategy",
           "OtStrategy", "RebasinStrategy", "TransfusionStrategy", "FsMergeStrategy", "FsMergeSeqStrategy",
           "FedDfStrategy", "SelectionStrategy"]
