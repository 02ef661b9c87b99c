"""One registry entry per server strategy name: what aggregates, its default round steps, its defaults.

The Flower integration (``fedfuse.flower``) builds a strategy from its entry; the run-config checks
(``fedfuse.config``) read the same entry, so a strategy's identity lives in one place. This module
imports no Flower and nothing of fedfuse at import time (``choices`` and ``config`` import it).

Aggregations:

- ``"fusion"``: ``fedfuse.fusion.fuse_result(method, client models)``; ``"average"`` is the fusion
  method that is the sample-weighted mean, run as a stream over the replies.
- ``"arrays"``: FedAvg on the arrays alone (no model is built).
- ``"flower"``: a Flower strategy's own ``aggregate_train`` (``flower_class`` in
  ``flwr.serverapp.strategy``) on the validated replies.
- ``"submodel"``: HeteroFL's count-weighted average of nested sub-models (capacity tiers only).
- ``"depth"``: DepthFL's layer-wise average over the clients that hold each layer (depth tiers only).

Round steps after the aggregation (``fedfuse.flower.round.steps``): the divergence guard (fusion methods
other than ``average``), the server step (FedAvgM's momentum on the pseudo-gradient, Hsu et al.,
arXiv 1909.06335), the ``refine`` steps (calibrate / distill, kept only when they move the model
towards the clients' ensemble) and, for HeteroFL, static batch normalisation.

Every fusion method of ``fedfuse.fusion.METHOD_SPECS`` whose result keeps the global architecture is a
strategy of its own (``strategy_spec`` builds its entry on first use).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

AGGREGATIONS = ("fusion", "arrays", "flower", "submodel", "depth")
#: the server momentum of fedfuse's measured momentum step: ``average``'s default, ``auto``'s step for plain-SGD
#: clients, fedfuse's FedAvgM default; chosen on MNIST-1D cells with plain-SGD clients, where Hsu et al.'s 0.9
#: (arXiv 1909.06335; Flower's fedavgm baseline) also broke runs (docs/multi-round.md, "Server momentum for plain-SGD
#: clients")
SERVER_MOMENTUM = 0.5
#: strategy ``auto``: fusion candidates are built only when the clients train at least this many local epochs a round
#: (``strategy-options.auto-fusion-epochs``; measured: docs/multi-round.md)
AUTO_FUSION_EPOCHS = 10
FUSION_RUN_KEYS = ("server-lr", "server-momentum")   # what fedfuse's server step reads
SERVER_STEPS = ("fedfuse", "paper", "flower")


@dataclass(frozen=True)
class WidthTiers:
    """How an entry aggregates clients of different widths (capacity tiers, ``client-tiers='1,0.5'``).

    Attributes:
        required: a capacity-tier baseline (the strategy exists only with tiers).
        submodel: averages HeteroFL's nested sub-models (units keep their index) instead of fusing into the global
            width.
        refine: the entry's ``default_refine`` when tiered (``None``: the same).
        distill: every narrower tier's slice is distilled from all the round's clients (FedDF with architecture
            groups).
        window_rolls: FedRolex's rolling sub-model window.
        static_bn: HeteroFL's static batch normalisation after aggregation.
        models_auto: what ``tier-models='auto'`` means (``None``: ``prune``, or ``slice`` for ViTs).
        ordered_dropout_auto: what ``ordered-dropout='auto'`` means in multi-round runs.
    """

    required: bool = False
    submodel: bool = False
    refine: str | None = None
    distill: bool = False
    window_rolls: bool = False
    static_bn: bool = False
    models_auto: str | None = None
    ordered_dropout_auto: str = "all"


@dataclass(frozen=True)
class DepthTiers:
    """How an entry aggregates clients of different depths (``client-tiers='1x1,1x0.5'``,
    ``fedfuse.flower.tiers.depth_tiers``).

    Attributes:
        aggregates: the strategy takes depth tiers at all.
        required: a depth-tier baseline (the strategy exists only with depth tiers).
        width_tiers: also takes tiers narrower than the global model (width x depth tiers).
        distils_exits: the clients' ensemble is then distilled into every exit (FedDF's step); the divergence
            guard stays on.
        aligns: the clients are aligned (OT) before the layer-wise average (one width only).
        self_distills: the clients distil their exits into each other (DepthFL's self-distillation; ``False``: the
            paper's DepthFL (FedAvg) ablation).
        own_exit: each node holds and trains only the exit after its own depth (InclusiveFL) instead of every exit
            up to it (DepthFL).
        momentum_distills: the server's step is InclusiveFL's momentum distillation into each shallower tier's top
            layer (``fedfuse.flower.tiers.depth_tiers.MomentumDistillation``; run-config ``mom-beta``).
    """

    aggregates: bool = False
    required: bool = False
    width_tiers: bool = False
    distils_exits: bool = False
    aligns: bool = False
    self_distills: bool = True
    own_exit: bool = False
    momentum_distills: bool = False


@dataclass(frozen=True)
class StrategySpec:
    """What a strategy name means.

    Attributes:
        name: the strategy name (run-config ``strategy``).
        aggregation: one of ``AGGREGATIONS``.
        method: the ``fedfuse.fusion`` method of a ``"fusion"`` aggregation (else ``None``).
        flower_class: the ``flwr.serverapp.strategy`` class name of a ``"flower"`` aggregation.
        default_refine: the refine steps ``refine=None`` means (``"none"`` for array aggregations).
        can_refine: whether the strategy takes refine steps at all.
        server_step: ``"fedfuse"`` (FedAvgM's step on the aggregate, configurable), ``"paper"`` (none: the
            aggregate is the new global model, as in the strategy's paper) or ``"flower"`` (Flower's own).
        default_server_momentum: the momentum of the ``"fedfuse"`` server step when not set.
        streams: rounds that are a plain weighted average run as a stream over the replies.
        run_keys: the strategy-specific run-config keys it reads (``server-lr``, ``server-momentum``,
            ``proximal-mu``); setting one of those keys for another strategy is a config error.
        selects: the round chooses between candidate aggregations by the clients' scores
            (``fedfuse.flower.aggregators.selection``).
        flower_options: ``(run-config key, Flower keyword)`` pairs: the run-config keys a ``"flower"`` aggregation
            reads (its ``run_keys``) and the keyword option of Flower's class each one sets.
        min_replies: ``(a, b)``: a round needs ``a * f + b`` replies with ``num-malicious-nodes`` f (Krum: f + 3,
            Bulyan: 4f + 3; ``(0, 1)``: one reply).
        dp_average: its aggregate is an average of the (clipped) updates, so differential privacy's Gaussian noise
            is calibrated to it (FedAvg, FedProx; FedAvgM / FedAdam / FedYogi post-process that average).
        tiers: how it takes capacity (width) tiers (``WidthTiers``).
        depth: how it takes depth tiers (``DepthTiers``).
        one_shot_only: its global model is not one model of the clients' architecture (``stack``: every client's
            model kept side by side), so a run is one training round (``mode='one-shot'``) and the head round; the
            server and the clients rebuild that model from its arrays (``fedfuse.fusion.stack.model_for_state``).
        paper: what the strategy is and the paper (title and arXiv id) it follows: the docs and the docstring of its
            strategy class (a plain fusion method's entry takes its ``MethodSpec.paper``).
    """

    name: str
    aggregation: str
    method: str | None = None
    flower_class: str | None = None
    default_refine: str = "calibrate"
    can_refine: bool = True
    server_step: str = "fedfuse"
    default_server_momentum: float = 0.0
    streams: bool = False
    run_keys: tuple[str, ...] = FUSION_RUN_KEYS
    selects: bool = False
    flower_options: tuple[tuple[str, str], ...] = ()
    min_replies: tuple[int, int] = (0, 1)
    dp_average: bool = False
    tiers: WidthTiers = WidthTiers()
    depth: DepthTiers = DepthTiers()
    one_shot_only: bool = False
    paper: str = ""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"strategy spec {self.name!r}: aggregation {self.aggregation!r} not in {AGGREGATIONS}")
        if self.server_step not in SERVER_STEPS:
            raise ValueError(f"strategy spec {self.name!r}: server_step {self.server_step!r} not in {SERVER_STEPS}")

    @property
    def is_fusion(self) -> bool:
        """A fusion strategy (fedfuse's own server step and refine steps apply)."""
        return self.aggregation == "fusion" and self.server_step == "fedfuse"

    @property
    def keyword_options(self) -> tuple[tuple[str, str], ...]:
        """``(run-config key, keyword option)`` pairs the strategy's class takes from the run config: Flower's own
        (``flower_options``), or fedfuse's server step (FedAvgM's) for a strategy that reads ``server-momentum``."""
        if self.aggregation == "flower":
            return self.flower_options
        return _SERVER_STEP_OPTIONS if "server-momentum" in self.run_keys else ()


_SERVER_STEP_OPTIONS = (("server-momentum", "server_momentum"), ("server-lr", "server_learning_rate"))
_ARRAYS = dict(default_refine="none", can_refine=False, run_keys=())
_FLOWER = dict(aggregation="flower", server_step="flower", **_ARRAYS)


def _flower(flower_class: str, *options: tuple[str, str], **extra) -> dict:
    """The fields of a Flower strategy's entry: ``options`` are its ``(run-config key, Flower keyword)`` pairs."""
    return {**_FLOWER, "flower_class": flower_class, "run_keys": tuple(k for k, _ in options),
            "flower_options": options, **extra}


_KRUM = ("num-malicious-nodes", "num_malicious_nodes")
_DEPTH = dict(aggregation="depth", server_step="paper", tiers=WidthTiers(ordered_dropout_auto="off"), **_ARRAYS)
_TIER_BASELINE = dict(aggregation="submodel", server_step="paper", **_ARRAYS)
_SUBMODELS = dict(required=True, submodel=True, static_bn=True, models_auto="slice", ordered_dropout_auto="off")

#: the strategies that are not a plain ``fedfuse.fusion`` method with fedfuse's defaults
SPECIAL_SPECS: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec("fedavg", "arrays", server_step="paper", streams=True, dp_average=True, **_ARRAYS,
                 paper="Communication-Efficient Learning of Deep Networks from Decentralized Data, arXiv 1602.05629"),
    StrategySpec("fedavgm", **_flower("FedAvgM", ("server-lr", "server_learning_rate"),
                                      ("server-momentum", "server_momentum"), dp_average=True),
                 paper="Measuring the Effects of Non-Identical Data Distribution, arXiv 1909.06335"),
    StrategySpec("fedadam", **_flower("FedAdam", ("server-lr", "eta"), dp_average=True),
                 paper="Adaptive Federated Optimization, arXiv 2003.00295"),
    StrategySpec("fedyogi", **_flower("FedYogi", ("server-lr", "eta"), dp_average=True),
                 paper="Adaptive Federated Optimization, arXiv 2003.00295"),
    StrategySpec("fedprox", **_flower("FedProx", ("proximal-mu", "proximal_mu"), dp_average=True),
                 paper="Federated Optimization in Heterogeneous Networks, arXiv 1812.06127"),
    # Byzantine-robust aggregation (Flower's own implementations, behind fedfuse's reply validation; their defaults:
    # FedTrimmedAvg beta 0.2, Krum / MultiKrum / Bulyan num_malicious_nodes 0)
    StrategySpec("fedmedian", **_flower("FedMedian"),
                 paper="Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates, arXiv 1803.01498"),
    StrategySpec("fedtrimmedavg", **_flower("FedTrimmedAvg", ("trim-beta", "beta")),
                 paper="Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates, arXiv 1803.01498"),
    StrategySpec("krum", **_flower("Krum", _KRUM, min_replies=(1, 3)),
                 paper="Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent, NeurIPS 2017"),
    StrategySpec("multikrum", **_flower("MultiKrum", _KRUM, ("num-nodes-to-select", "num_nodes_to_select"),
                                        min_replies=(1, 3)),
                 paper="Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent, NeurIPS 2017"),
    StrategySpec("bulyan", **_flower("Bulyan", _KRUM, min_replies=(4, 3)),
                 paper="The Hidden Vulnerability of Distributed Learning in Byzantium, arXiv 1802.07927"),
    StrategySpec("average", "fusion", method="average", default_server_momentum=SERVER_MOMENTUM, streams=True,
                 tiers=WidthTiers(submodel=True, refine="none"), depth=DepthTiers(aggregates=True, width_tiers=True),
                 paper="Weighted averaging of the client models with FedAvgM's server step and the calibration "
                       "refinement: fedfuse's default multi-round aggregation."),
    # method None: the clients' vote between candidate aggregations, not the label-free fusion method "auto"
    # (fedfuse.fusion.auto): no fusion options, and no fusion set when every round takes an array candidate
    StrategySpec("auto", "fusion", method=None, default_server_momentum=SERVER_MOMENTUM, default_refine="none",
                 can_refine=False, selects=True, run_keys=("server-momentum",),
                 paper="fedfuse: FedAvg's average while the clients train few local epochs; from auto-fusion-epochs, "
                       "per round the candidate (plain average, average with server momentum, FedDF) with the best "
                       "accuracy on the clients' own data"),
    StrategySpec("feddf", "fusion", method="feddf", default_refine="none", server_step="paper", run_keys=(),
                 tiers=WidthTiers(submodel=True, distill=True, models_auto="slice", ordered_dropout_auto="off"),
                 depth=DepthTiers(aggregates=True, width_tiers=True, distils_exits=True),
                 paper='FedDF (Lin et al., "Ensemble Distillation for Robust Model Fusion in Federated Learning", '
                       'arXiv 2006.07242): the weighted average, then the clients\' ensemble distilled into it on '
                       'the fusion set.'),
    StrategySpec("stack", "fusion", method="stack", default_refine="none", can_refine=False, server_step="paper",
                 run_keys=(), one_shot_only=True,
                 paper="Stacking (fedfuse.fusion.stack; Wolpert 1992, the kind of model FuseFL arXiv 2410.20380 and "
                       "FENS arXiv 2411.07182 end with): every client's model kept side by side, one classifier over "
                       "their concatenated features, solved by the head round; one-shot only, the result is "
                       "num-clients times the clients' architecture."),
    StrategySpec("heterofl", **_TIER_BASELINE, tiers=WidthTiers(**_SUBMODELS),
                 paper="HeteroFL: Computation and Communication Efficient Federated Learning for Heterogeneous "
                       "Clients, arXiv 2010.01264"),
    StrategySpec("fedrolex", **_TIER_BASELINE, tiers=WidthTiers(**_SUBMODELS, window_rolls=True),
                 paper="FedRolex: Model-Heterogeneous Federated Learning with Rolling Sub-Model Extraction, "
                       "arXiv 2212.01548"),
    StrategySpec("depthfl", **_DEPTH, depth=DepthTiers(aggregates=True, required=True, width_tiers=True),
                 paper="DepthFL: Depthwise Federated Learning for Heterogeneous Clients, ICLR 2023 (openreview "
                       "pf8RIZTMU58)"),
    StrategySpec("depthfl-fedavg", **_DEPTH,
                 depth=DepthTiers(aggregates=True, required=True, width_tiers=True, self_distills=False),
                 paper="DepthFL without self-distillation (the paper's DepthFL (FedAvg) ablation), ICLR 2023"),
    StrategySpec("inclusivefl", **{**_DEPTH, "run_keys": ("mom-beta",)},
                 depth=DepthTiers(aggregates=True, required=True, self_distills=False, own_exit=True,
                                  momentum_distills=True),
                 paper="No One Left Behind: Inclusive Federated Learning over Heterogeneous Devices, KDD 2022, "
                       "arXiv 2202.08036"),
)}

#: names whose aggregation is not a fusion method (FedAvg and Flower's own strategies)
NON_FUSION_STRATEGIES = tuple(n for n, s in SPECIAL_SPECS.items() if s.aggregation in ("arrays", "flower"))
FLOWER_BASELINE_STRATEGIES = tuple(n for n, s in SPECIAL_SPECS.items() if s.aggregation == "flower")
TIER_STRATEGIES = tuple(n for n, s in SPECIAL_SPECS.items() if s.tiers.required)
DEPTH_TIER_STRATEGIES = tuple(n for n, s in SPECIAL_SPECS.items() if s.depth.required)
#: the strategies whose global model is not one model of the clients' architecture (``mode='one-shot'`` only)
ONE_SHOT_ONLY_STRATEGIES = tuple(n for n, s in SPECIAL_SPECS.items() if s.one_shot_only)
#: what a plain fusion method's entry adds to ``fusion_spec``'s defaults (ot: aligned, then distilled, across depths)
FUSION_TRAITS: dict[str, dict] = {"ot": dict(depth=DepthTiers(aggregates=True, distils_exits=True, aligns=True))}


def _depth_order(flag: str) -> tuple[str, ...]:
    """The names whose entry sets ``DepthTiers`` ``flag``: the depth-tier baselines, then the other entries, then
    ``FUSION_TRAITS``."""
    special = sorted((s for s in SPECIAL_SPECS.values() if getattr(s.depth, flag)), key=lambda s: not s.depth.required)
    traits = tuple(n for n, t in FUSION_TRAITS.items() if getattr(t.get("depth", DepthTiers()), flag))
    return tuple(s.name for s in special) + traits


#: the strategies that aggregate clients of different depths (``fedfuse.flower.tiers.depth_tiers``)
DEPTH_METHODS = _depth_order("aggregates")
#: the depth-tier strategies that also take tiers narrower than the global model (width x depth tiers)
WIDTH_DEPTH_TIER_METHODS = _depth_order("width_tiers")
#: how a warm start combines the clients' own models with depth tiers (``DepthTieredStrategy.fuse_own_models``):
#: the strategies that distil into every exit, the aligning one first
DEPTH_WARM_START = tuple(sorted(_depth_order("distils_exits"), key=lambda n: n not in _depth_order("aligns")))
#: the strategies whose round chooses between candidates by the clients' scores (``auto``)
SELECTING_STRATEGIES = tuple(n for n, s in SPECIAL_SPECS.items() if s.selects)
#: the fusion strategies that are the plain sample-weighted mean (run as a stream over the replies)
MEAN_METHODS = tuple(n for n, s in SPECIAL_SPECS.items() if s.aggregation == "fusion" and s.streams)
PAPER_SERVER_STEP = tuple(n for n, s in SPECIAL_SPECS.items() if s.server_step == "paper" and s.aggregation != "arrays")
SUBMODEL_METHODS = tuple(n for n, s in SPECIAL_SPECS.items() if s.tiers.submodel and not s.tiers.required)
#: every strategy-specific run-config key (the entries' run_keys)
STRATEGY_KEYS_ALL = tuple(dict.fromkeys(k for s in SPECIAL_SPECS.values() for k in s.run_keys))
#: differential privacy's strategies: their aggregate is an average of the clipped updates (``dp_average``)
DP_STRATEGIES = tuple(n for n, s in SPECIAL_SPECS.items() if s.dp_average)


def fusion_spec(method: str, paper: str = "") -> StrategySpec:
    """The entry of a plain fusion method (``fedfuse.fusion`` defaults: calibrate, no server momentum; its
    ``FUSION_TRAITS``)."""
    return StrategySpec(method, "fusion", method=method, paper=paper, **FUSION_TRAITS.get(method, {}))


def strategy_names() -> tuple[str, ...]:
    """Every strategy name: the special entries and every fusion method that keeps the global architecture."""
    from fedfuse.fusion import METHOD_SPECS  # deferred: config imports this registry (fusion: +30% on its import)

    fusion = tuple(sorted(n for n, s in METHOD_SPECS.items() if s.same_architecture and n not in SPECIAL_SPECS))
    return tuple(SPECIAL_SPECS) + fusion


def strategy_spec(name: str) -> StrategySpec:
    """The entry of strategy ``name``; ``ValueError`` (with the closest name) for an unknown one."""
    if name in SPECIAL_SPECS:
        return SPECIAL_SPECS[name]
    from fedfuse.fusion import METHOD_SPECS  # deferred: config imports this registry (fusion: +30% on its import)

    spec = METHOD_SPECS.get(name)
    if spec is None or not spec.same_architecture:
        import difflib

        names = strategy_names()
        close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        why = (f"; method {name!r} does not return the global architecture, so it cannot be a round's aggregation"
               if spec is not None else "")
        raise ValueError(f"strategy: unknown strategy {name!r}{hint}{why}; choose one of {sorted(names)}")
    return fusion_spec(name, spec.paper)


#: strategy ``auto``: the candidate aggregations of every round (``fedfuse.flower.aggregators.selection``)
DEFAULT_CANDIDATES = ("fedavg", "average", "feddf")
#: the candidates that are the round's weighted average (no model built per client): the mean, then FedAvg
ARRAY_CANDIDATES = MEAN_METHODS + tuple(n for n, s in SPECIAL_SPECS.items() if s.aggregation == "arrays")


def check_candidates(candidates: Iterable[str], *, one_shot: bool = False) -> tuple[str, ...]:
    """The candidate names, checked: ``average``, ``fedavg`` or a same-architecture fusion method
    (``ValueError`` naming the bad entry); ``one_shot``: a one-shot strategy's, which may also be a one-shot-only
    method (``stack``) when it is the only candidate (scored before the head round, it would rank wrongly against
    one model; ``fedfuse.plan.auto_candidates`` takes it alone)."""
    names = tuple(str(c).strip() for c in candidates)
    if not names or any(not n for n in names):
        raise ValueError(f"strategy 'auto': candidates must be a non-empty list of names, got {list(names)}")
    if len(set(names)) != len(names):
        raise ValueError(f"strategy 'auto': candidates {list(names)} repeat a name")
    for name in names:
        if name in ARRAY_CANDIDATES:
            continue
        spec = strategy_spec(name)   # ValueError with the closest name for an unknown one
        if spec.aggregation != "fusion" or spec.name == "auto":
            raise ValueError(f"strategy 'auto': candidate {name!r} is not 'average', 'fedavg' or a fusion method")
        if spec.one_shot_only and not (one_shot and len(names) == 1):   # a candidate becomes the next round's
            # global model, which the clients train
            raise ValueError(f"strategy 'auto': candidate {name!r} keeps every client's model side by side: the "
                             "clients cannot train it in a next round, and scored before the head round it ranks "
                             f"wrongly against one model; use strategy={name!r} (mode='one-shot') or choose methods "
                             "that return one model")
    return names


def key_applies(key: str, strategy: str) -> bool:
    """Whether the strategy-specific run-config ``key`` (``server-lr``, ``server-momentum``, ``proximal-mu``) is
    read by ``strategy``."""
    try:
        return key in strategy_spec(strategy).run_keys
    except ValueError:
        return False


def key_users(key: str) -> tuple[str, ...]:
    """The strategies that read run-config ``key`` (fusion methods summed up as ``<fusion strategies>``)."""
    special = tuple(n for n, s in SPECIAL_SPECS.items() if key in s.run_keys and s.aggregation != "fusion")
    return special + (("<fusion strategies>",) if key in FUSION_RUN_KEYS else ())


#: run-config key -> the strategies that read it (for the config's "key applies to" checks)
STRATEGY_KEYS = {key: key_users(key) for key in STRATEGY_KEYS_ALL}


def with_tiers(spec: StrategySpec) -> StrategySpec:
    """The entry as a tiered strategy uses it (``tiers.refine`` replaces ``default_refine``)."""
    return replace(spec, default_refine=spec.tiers.refine) if spec.tiers.refine is not None else spec


__all__ = ["SERVER_MOMENTUM", "AUTO_FUSION_EPOCHS", "WidthTiers", "DepthTiers", "STRATEGY_KEYS", "WIDTH_DEPTH_TIER_METHODS", "DEPTH_WARM_START", "DEPTH_METHODS", "FUSION_TRAITS",
           "SELECTING_STRATEGIES", "MEAN_METHODS", "DP_STRATEGIES", "StrategySpec", "SPECIAL_SPECS", "AGGREGATIONS", "SERVER_STEPS", "NON_FUSION_STRATEGIES",
           "FLOWER_BASELINE_STRATEGIES", "TIER_STRATEGIES", "DEPTH_TIER_STRATEGIES", "ONE_SHOT_ONLY_STRATEGIES", "PAPER_SERVER_STEP", "SUBMODEL_METHODS",
           "strategy_spec", "strategy_names", "check_candidates", "DEFAULT_CANDIDATES", "ARRAY_CANDIDATES", "fusion_spec", "key_applies", "key_users", "with_tiers"]
