"""Strategy registry: ``"fedavg"`` plus one ``FusionStrategy`` per fusion method of ``fedfuse.fusion``.

    from server.strategies import build_strategy, STRATEGIES
    strategy = build_strategy("kf-gradient", model_fn=lambda: build_model("mlp"), fusion_inputs=X)

Every method registered in ``fedfuse.fusion.METHODS`` whose result keeps the global architecture
becomes a strategy automatically (``ensemble`` does not: it is reported as a per-round reference).
"""

from __future__ import annotations

from typing import Any

from fedfuse.fusion import METHODS
from server.strategies.base import FlowerFedAvg, FusionStrategy, state_to_record
from server.strategies.validation import ClientUpdate, ReplyRejected, validate_reply


def _class_name(method: str) -> str:
    return "".join(part.capitalize() for part in method.replace("_", "-").split("-")) + "Strategy"


STRATEGIES: dict[str, type[FusionStrategy]] = {"fedavg": FlowerFedAvg}
for _name, _fn in sorted(METHODS.items()):
    if getattr(_fn, "same_architecture", True):
        STRATEGIES[_name] = type(_class_name(_name), (FusionStrategy,), {"default_method": _name,
                                 "__module__": __name__, "__doc__": f"FusionStrategy aggregating with fedfuse.fusion method {_name!r}."})


def build_strategy(name: str, **options: Any) -> FusionStrategy:
    """Build the strategy registered as ``name`` (a ``flwr.serverapp.strategy.Strategy``).

    ``options`` go to ``FusionStrategy`` (``model_fn``, ``fusion_inputs``, ``fusion_options``,
    ``importance``, ``fallback``, ``device``, ``seed``) and to Flower's ``FedAvg``
    (``fraction_train``, ``min_train_nodes``, ``min_available_nodes``, …).
    """
    if name not in STRATEGIES:
        raise ValueError(f"strategy: unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](**options)


__all__ = ["STRATEGIES", "build_strategy", "FusionStrategy", "FlowerFedAvg", "ClientUpdate", "ReplyRejected",
           "validate_reply", "state_to_record"]
