"""Former home of the capacity-tier strategies (now ``fedfuse.flower.tiered``); kept so that existing imports work."""

from fedfuse.flower.strategies import strategy_builder  # noqa: F401
from fedfuse.flower.tiered import (TIER_STRATEGY_CLASSES, FedRolexStrategy, HeteroFLStrategy,  # noqa: F401
                                   TieredFusionStrategy, build_tier_strategy)

__all__ = ["TieredFusionStrategy", "HeteroFLStrategy", "FedRolexStrategy", "TIER_STRATEGY_CLASSES",
           "build_tier_strategy", "strategy_builder"]
