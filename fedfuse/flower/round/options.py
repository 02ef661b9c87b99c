"""A strategy's options, one typed, frozen object per concern, checked once when it is made.

``FusionStrategy`` and the other fedfuse strategies take these objects (``fusion=FusionOptions(...)``,
``guard=GuardOptions(...)``, ...) or, as Flower's strategies do, flat keyword options
(``build_strategy("kf-linear", server_momentum=0.5, fraction_train=0.5)``): ``take_options`` moves each flat
keyword into the object of its concern, once, at the constructor's door, and an unknown keyword is a ``TypeError``
naming it. Inside, the strategy and its steps read the objects' fields and nothing else.

The concerns: ``FusionOptions`` (the aggregation), ``GuardOptions`` (the divergence guard), ``MomentumOptions`` (the
server step), ``RefineOptions`` (calibrate / distill), ``ProtocolOptions`` (the round protocol and Flower ``FedAvg``'s
own options) and ``TierOptions`` (capacity tiers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, TypeVar

from fedfuse.choices import FALLBACKS, PRIORS, no_fusion_options
from fedfuse.fusion import FusionResult, fuse_result
from fedfuse.fusion.refine import parse_refine
from fedfuse.hetero.tiers import TIER_MODELS

T = TypeVar("T")

WEIGHT_CAP = 10.0   # × the round's median sample count (``ProtocolOptions.weight_cap``)


def _checked(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"strategy: {message}")


@dataclass(frozen=True)
class FusionOptions:
    """The aggregation of a ``FusionStrategy`` (see its docstring for each option's meaning)."""

    fusion_options: dict[str, Any] = field(default_factory=dict)
    importance: str = "client"
    fusion_rounds: int = 0
    fuse_fn: Callable[..., FusionResult] = fuse_result
    align_to: str = "model-0"
    score_check: bool = True

    FLAT: ClassVar[dict[str, str]] = {"fusion_options": "fusion_options", "importance": "importance",
                                      "fusion_rounds": "fusion_rounds", "fuse_fn": "fuse_fn",
                                      "align_to": "align_to", "score_check": "score_check"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "fusion_options", dict(self.fusion_options or {}))
        _checked(self.importance in ("client", "server"),
                 f"importance must be 'client' or 'server', got {self.importance!r}")
        _checked(int(self.fusion_rounds) >= 0, f"fusion_rounds must be >= 0, got {self.fusion_rounds}")
        object.__setattr__(self, "fusion_rounds", int(self.fusion_rounds))
        _checked(self.align_to in ("model-0", "global"),
                 f"align_to must be 'model-0' or 'global', got {self.align_to!r}")
        object.__setattr__(self, "score_check", bool(self.score_check))


@dataclass(frozen=True)
class GuardOptions:
    """The divergence guard (``fedfuse.flower.round.steps.DivergenceGuard``): on or off, and its KL ratio."""

    enabled: bool = True
    ratio: float = 2.0

    FLAT: ClassVar[dict[str, str]] = {"guard": "enabled", "guard_ratio": "ratio"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "enabled", bool(self.enabled))
        _checked(float(self.ratio) > 1, f"guard_ratio must be > 1, got {self.ratio}")
        object.__setattr__(self, "ratio", float(self.ratio))


@dataclass(frozen=True)
class MomentumOptions:
    """The server step (``fedfuse.flower.round.steps.ServerMomentum``); ``momentum=None``: the registry entry's default."""

    momentum: float | None = None
    learning_rate: float = 1.0

    FLAT: ClassVar[dict[str, str]] = {"server_momentum": "momentum", "server_learning_rate": "learning_rate"}

    def __post_init__(self) -> None:
        if self.momentum is not None:
            _checked(0 <= float(self.momentum) < 1, f"server_momentum must be in [0, 1), got {self.momentum}")
            object.__setattr__(self, "momentum", float(self.momentum))
        _checked(float(self.learning_rate) > 0, f"server_learning_rate must be > 0, got {self.learning_rate}")
        object.__setattr__(self, "learning_rate", float(self.learning_rate))

    @property
    def is_default(self) -> bool:
        """No server step asked for (plain FedAvg takes no other)."""
        return not self.momentum and self.learning_rate == 1.0


@dataclass(frozen=True)
class RefineOptions:
    """The refinement step (``fedfuse.flower.round.steps.Refinement``); ``refine=None``: the registry entry's default
    when there is a fusion set."""

    refine: str | None = None
    prior: str = "auto"
    check: bool = True
    calibrate_min_gap: float = 0.2

    FLAT: ClassVar[dict[str, str]] = {"refine": "refine", "prior": "prior", "refine_check": "check",
                                      "calibrate_min_gap": "calibrate_min_gap"}

    def __post_init__(self) -> None:
        _checked(self.prior in PRIORS, f"prior must be one of {PRIORS}, got {self.prior!r}")
        _checked(0 <= float(self.calibrate_min_gap) < 1,
                 f"calibrate_min_gap must be in [0, 1), got {self.calibrate_min_gap}")
        object.__setattr__(self, "calibrate_min_gap", float(self.calibrate_min_gap))
        object.__setattr__(self, "check", bool(self.check))


@dataclass(frozen=True)
class ProtocolOptions:
    """The round protocol's options (``fedfuse.flower.round.protocol.RoundProtocol``) and Flower ``FedAvg``'s own, which
    keep Flower's names and meanings. ``robust_answers``: screen the clients' answers to the server's queries
    (``fedfuse.flower.trust.screen``) without a ``screen`` of their updates (one-shot runs); a ``screen`` implies
    it."""

    fallback: str = "previous"
    min_valid_replies: int = 1
    weight_cap: float = WEIGHT_CAP
    screen: Any = None
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.0
    min_train_nodes: int = 2
    min_evaluate_nodes: int = 2
    min_available_nodes: int = 2
    weighted_by_key: str = "num-examples"
    arrayrecord_key: str = "arrays"
    configrecord_key: str = "config"
    train_metrics_aggr_fn: Callable | None = None
    evaluate_metrics_aggr_fn: Callable | None = None
    robust_answers: bool = False   # last: the fields before it keep their positions

    FLAT: ClassVar[dict[str, str]] = {}   # every field by its own name (filled below)

    def __post_init__(self) -> None:
        _checked(self.fallback in FALLBACKS, f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        object.__setattr__(self, "min_valid_replies", max(1, int(self.min_valid_replies)))
        _checked(self.weight_cap >= 0, f"weight_cap must be >= 0 (0 = no cap), got {self.weight_cap}")
        object.__setattr__(self, "weight_cap", float(self.weight_cap))

    def flower(self) -> dict[str, Any]:
        """Flower ``FedAvg``'s constructor options."""
        names = ("fraction_train", "fraction_evaluate", "min_train_nodes", "min_evaluate_nodes", "min_available_nodes",
                 "weighted_by_key", "arrayrecord_key", "configrecord_key", "train_metrics_aggr_fn",
                 "evaluate_metrics_aggr_fn")
        return {n: getattr(self, n) for n in names}


ProtocolOptions.FLAT = {f.name: f.name for f in dataclasses.fields(ProtocolOptions)}


@dataclass(frozen=True)
class TierOptions:
    """Capacity tiers (``fedfuse.flower.tiers.tiered.TieredFusionStrategy``; each option's meaning is in its docstring)."""

    tiers: tuple[float, ...] = (1.0,)
    tier_models: str = "auto"
    input_shape: tuple[int, ...] | None = None
    weighting: str = "examples"
    width_scaler: bool | None = False
    anchor: bool = True
    ordered_dropout: str | bool = "auto"
    ordered_dropout_draw: str | float = "auto"
    prune_options: dict[str, Any] = field(default_factory=dict)

    FLAT: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        _checked(self.tier_models in TIER_MODELS,
                 f"tier_models must be one of {TIER_MODELS}, got {self.tier_models!r}")
        _checked(self.weighting in ("examples", "uniform"),
                 f"weighting must be 'examples' or 'uniform', got {self.weighting!r}")
        if self.ordered_dropout is True or self.ordered_dropout is False:
            object.__setattr__(self, "ordered_dropout", "all" if self.ordered_dropout else "off")
        object.__setattr__(self, "prune_options", dict(self.prune_options or {}))
        object.__setattr__(self, "anchor", bool(self.anchor))


TierOptions.FLAT = {f.name: f.name for f in dataclasses.fields(TierOptions)}


def take_options(cls: type[T], given: T | None, flat: dict[str, Any]) -> T:
    """``given`` (or the defaults) with the flat keywords of ``cls``'s concern moved out of ``flat`` into it."""
    mine = {cls.FLAT[k]: flat.pop(k) for k in list(flat) if k in cls.FLAT}
    if given is None:
        return cls(**mine)
    return dataclasses.replace(given, **mine) if mine else given


def arrays_only(name: str, what: str, options: dict[str, Any]) -> None:
    """Take the fusion concerns' flat keywords out of ``options`` for a strategy that only averages arrays: those
    that change nothing there pass (``guard``, ``prior``, ``importance``, ...), one that would change the aggregation
    is a ``ValueError`` naming it."""
    fusion = take_options(FusionOptions, None, options)
    take_options(GuardOptions, None, options)
    momentum = take_options(MomentumOptions, None, options)
    refine = take_options(RefineOptions, None, options)
    refuse_fusion_steps(name, what, fusion.fusion_options, fusion.fusion_rounds, refine.refine)
    if not momentum.is_default:
        raise ValueError(f"strategy {name!r} is {what}: server_momentum / server_learning_rate do not apply; use "
                         "'fedavgm' (Flower's FedAvgM) or a fusion strategy such as 'average'")


def refuse_fusion_steps(name: str, what: str, fusion_options: dict[str, Any] | None, fusion_rounds: int,
                        refine: str | None) -> None:
    """A ``ValueError`` when a strategy that aggregates arrays (``what``: plain FedAvg, one of Flower's) is given
    a fusion method's step: fusion options, fusion rounds, a refine step."""
    if fusion_options:
        raise ValueError(no_fusion_options(name, fusion_options))
    if int(fusion_rounds):
        raise ValueError(f"strategy {name!r} is {what}, not a fusion method: fusion_rounds must be 0, "
                         f"got {fusion_rounds}")
    if refine is not None and parse_refine(refine):
        raise ValueError(f"strategy: {name!r} aggregates the arrays as {what} does and takes no refine step (got "
                         f"refine={refine!r}); use a fusion strategy such as 'average'")


def refuse_unknown(owner: type, flat: dict[str, Any]) -> None:
    """A ``TypeError`` naming the keywords no concern took (as Python's own for an unexpected keyword)."""
    if flat:
        raise TypeError(f"{owner.__name__}() got unexpected keyword argument(s) {sorted(flat)}")


__all__ = ["WEIGHT_CAP", "FusionOptions", "GuardOptions", "MomentumOptions", "RefineOptions", "ProtocolOptions", "TierOptions",
           "take_options", "arrays_only", "refuse_fusion_steps", "refuse_unknown"]
