"""``FusionStrategy``: the round protocol holding a ``FusionAggregator`` (``fedfuse.fusion.fuse_result(method,
...)`` followed by the round steps of ``fedfuse.flower.round.steps``):

    validated replies → fuse (or the weighted average, streamed) → divergence guard → server momentum
    → refine (calibrate / distill, kept only when it moves the model towards the clients' ensemble)

What each strategy name aggregates and its defaults come from its registry entry
(``fedfuse.strategy_specs``). A subclass or plug-in adds a step by overriding ``post_steps`` (the aggregator's by
default: ``super().post_steps(r)`` is ``self.aggregator.post_steps(r)``).

**The aggregator**, ``FusionAggregator``: a fusion method and the round steps after it, as one object a round protocol
holds.

    validated replies → fuse (``fedfuse.fusion.fuse_result``, or the weighted average, streamed) → divergence guard
    → server momentum → refine (calibrate / distill, kept only when it moves the model towards the clients'
    ensemble) → static BN

The protocol that holds it (``RoundProtocol.aggregator``: ``FusionStrategy``, the capacity and depth tiers, ``auto``'s
selection) keeps what travels with a reply (sampling, validation, the model's architecture, the weighted average);
the aggregator keeps what the method and its steps are: its registry entry, the method's validated options, the
steps' objects and their state (momentum), what the clients must send (scores, class counts) and how a round's
aggregate is made from the validated replies. It calls back into its protocol (``host``) for the model builder,
the weighted average, the fusion set, the global model sent and the hooks a protocol may override
(``fuse_updates``, ``post_steps``, ``class_prior``, ``fuse_target``, ``wants_client_scores``).

**Server-side importance** (``importance="server"``): the fusion method scores the client models itself on the fusion set (captum) instead
of reading scores sent by the clients; what the fusion options must then say, checked before any round.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from logging import INFO
from typing import Any, Callable

import torch
from flwr.common.logger import log
from torch import nn

from fedfuse.choices import no_fusion_options
from fedfuse.fusion import (FusionError, FusionResult, MissingInputError, client_statistics, fuse_result, methods_with,
                            get_spec)
from fedfuse.fusion.refine import parse_refine
from fedfuse.models import levels
from fedfuse.strategy_specs import StrategySpec, strategy_spec
from fedfuse.training import resolve_device
from fedfuse.flower.round.options import FusionOptions, GuardOptions, MomentumOptions, RefineOptions, take_options
from fedfuse.flower.round.protocol import RoundProtocol
from fedfuse.flower.round.replies import (NEED_STATISTICS, ClientUpdate, bounded_class_counts,
                                          reject_inconsistent_scores)
from fedfuse.flower.round.steps import (DivergenceGuard, Refinement, RoundData, ServerMomentum, StaticBatchNorm,
                                        class_prior)


# ---------------------------------------------------------------- server-side importance
def scores_on_server(strategy) -> bool:
    """Whether the strategy's method can score the client models itself: its ``importance`` option takes a captum
    scorer (``ot``'s ``importance`` is selective OT's unit scoring, not a replacement for client scores)."""
    if not strategy._accepts_option("importance"):
        return False
    try:
        strategy.spec.parse_options({"importance": "deeplift"})
    except FusionError:
        return False
    return True


def server_importance_options(strategy, options: dict[str, Any], fusion_labels: Any) -> dict[str, Any]:
    """The fusion options with the method's ``importance`` set to the scoring it runs on the fusion set (DeepLIFT
    unless the options name one); a ``ValueError`` saying what is missing otherwise."""
    method = strategy.method
    if not strategy.uses_scores:
        raise ValueError(f"strategy: importance='server': method {method!r} uses no importance scores; "
                         "leave importance='client' (the default)")
    if not scores_on_server(strategy):
        raise ValueError(f"strategy: importance='server': method {method!r} takes its scores from the "
                         "clients only (no server-side scoring); use importance='client'")
    scoring = options.get("importance", "deeplift")
    if scoring == "client":
        raise ValueError("strategy: importance='server' conflicts with fusion option importance='client'; set "
                         "that option to 'deeplift', 'conductance' or 'uniform' (what the server computes)")
    if scoring != "uniform" and fusion_labels is None:
        raise ValueError(f"strategy: importance='server' computes {scoring} scores of every client model on the "
                         "fusion set and needs fusion_labels (the fusion set's labels, [B]); pass them, or use "
                         "importance='client' (scores from the clients)")
    out = {**options, "importance": scoring}
    strategy._check_options(out)
    return out


# ---------------------------------------------------------------- the aggregator
@dataclasses.dataclass(frozen=True)
class FusionConcerns:
    """The options of a fusion aggregator, one typed object per concern (``fedfuse.flower.round.options``)."""

    fusion: FusionOptions
    guard: GuardOptions
    momentum: MomentumOptions
    refine: RefineOptions

    @classmethod
    def take(cls, options: dict[str, Any], fusion: FusionOptions | None = None, guard: Any = None,
             momentum: MomentumOptions | None = None, refine: Any = None) -> FusionConcerns:
        """The four objects (given, else ``options``' ``fusion=``, ``guard=``, ``momentum=``, ``refine=``), with the
        flat keywords of their concerns (Flower's style: ``server_momentum=0.5``) moved out of ``options`` into them,
        once; ``guard=False`` and ``refine="calibrate"`` are flat keywords too."""
        fusion, guard, momentum, refine = (options.pop(k, None) if v is None else v for k, v in (
            ("fusion", fusion), ("guard", guard), ("momentum", momentum), ("refine", refine)))
        if isinstance(guard, bool):   # the flat keyword of GuardOptions.enabled
            options["guard"], guard = guard, None
        if isinstance(refine, str):   # the flat keyword of RefineOptions.refine
            options["refine"], refine = refine, None
        return cls(take_options(FusionOptions, fusion, options), take_options(GuardOptions, guard, options),
                   take_options(MomentumOptions, momentum, options), take_options(RefineOptions, refine, options))


class FusionAggregator:
    """The aggregation ``fedfuse.fusion.fuse_result(method, ...)`` and its round steps, held by a round protocol.

    Args:
        host: the ``RoundProtocol`` holding it (its model builder, weighted average, fusion set, global model).
        method: a name in ``fedfuse.fusion.METHOD_SPECS`` (or a registry name whose entry aggregates otherwise).
        concerns: the options (``FusionConcerns``; see ``FusionStrategy`` for each one's meaning).
        registry_entry: the entry whose defaults apply (default: ``method``'s).
        reads_scores: ``False`` for a protocol whose aggregation never reads the method's importance scores.
    """

    def __init__(self, host: Any, method: str | None, concerns: FusionConcerns, *,
                 registry_entry: StrategySpec | None = None, reads_scores: bool = True) -> None:
        self.host = host
        fusion, guard, momentum, refine = (concerns.fusion, concerns.guard, concerns.momentum, concerns.refine)
        name, cls_method = type(host).__name__, type(host).method
        if method is not None and cls_method is not None and method != cls_method:
            raise ValueError(f"strategy: {name} aggregates with {cls_method!r}, not {method!r}; "
                             f"use FusionStrategy(method={method!r}) or that method's named strategy")
        method = method or cls_method
        if method is None:
            raise ValueError("strategy: FusionStrategy needs method= (a name in fedfuse.fusion.METHOD_SPECS)")
        self.entry = registry_entry or strategy_spec(method)
        self.method = method
        # the fusion method the rounds run: the entry's (``None`` for strategy ``auto``, a vote between candidates)
        self.spec = self._method_spec(method) if self.entry.method is not None else None
        self.fusion_options = dict(fusion.fusion_options)
        self._check_options(self.fusion_options)
        if fusion.align_to == "global" and not (self.spec is not None and self.spec.any_reference):
            able = methods_with("any_reference")
            raise ValueError(f"strategy: align_to='global' needs a method that aligns onto a reference model "
                             f"({able}), not {method!r}")
        self.align_to = fusion.align_to
        self.score_check = fusion.score_check
        self.importance = fusion.importance
        self.fusion_rounds = fusion.fusion_rounds
        self.fuse_fn = fusion.fuse_fn
        self.uses_scores = bool(reads_scores and self.spec is not None and self.spec.uses_scores)
        self.needs_data = bool(self.spec is not None and self.spec.needs_data)
        if self.importance == "server" or self.fusion_options.get("importance") in ("conductance", "deeplift"):
            self.fusion_options = server_importance_options(self, self.fusion_options, host.fusion_labels)
            self.importance = "server"
        if self.needs_data and host.fusion_inputs is None:
            raise ValueError(f"strategy: method {method!r} needs fusion_inputs (the server fusion set)")
        if host.model_fn is None and self.spec is not None:
            raise ValueError(f"strategy: method {method!r} needs model_fn to rebuild client models")
        # the steps (fedfuse.flower.round.steps), configured from the options and the registry entry's defaults
        self.momentum_step = ServerMomentum(self.entry.default_server_momentum if momentum.momentum is None
                                            else momentum.momentum, momentum.learning_rate)
        self.guard = guard.enabled
        self.guard_step = DivergenceGuard(guard.ratio)
        try:  # the default refinement needs the fusion set; without one (e.g. a plug-in 'average') it is off
            steps = parse_refine(refine.refine if refine.refine is not None else
                                 (self.entry.default_refine if host.fusion_inputs is not None else "none"))
        except ValueError as exc:
            raise ValueError(f"strategy: {exc}") from None
        if steps and not self.entry.can_refine:
            raise ValueError(f"strategy: {name} aggregates the arrays as Flower does and takes no "
                             f"refine step (got refine={refine.refine!r}); use a fusion strategy such as 'average'")
        if steps and host.fusion_inputs is None:
            raise ValueError(f"strategy: refine={'+'.join(steps)!r} needs fusion_inputs (the server fusion set); "
                             "pass refine='none' to aggregate without one")
        self.refinement = Refinement(steps, prior=refine.prior, check=refine.check,
                                     calibrate_min_gap=refine.calibrate_min_gap,
                                     prior_fn=lambda updates: host.class_prior(updates))
        self.static_bn_step = StaticBatchNorm() if self.entry.tiers.static_bn else None
        # the level widths a reply's scores must have (one architecture; a tiered protocol checks its own per tier)
        self.level_widths: dict[str, int] | None = None
        if host.model_fn is not None and self.uses_scores and self.importance == "client":
            self.level_widths = {lv.name: lv.width for lv in levels(host.model_fn())}
        self._work: nn.Module | None = None       # the streamed round's aggregate, reused
        self._statistics_reference: dict[str, tuple[int, ...]] | None = None

    # ---------------------------------------------------------------- options and their views
    def _method_spec(self, method: str):
        if self.entry.aggregation != "fusion":
            return None
        try:
            return get_spec(method)
        except FusionError as exc:
            raise ValueError(f"strategy: {exc}") from None

    def _check_options(self, options: dict[str, Any]) -> None:
        """Validate the fusion options once, at the strategy's door: ``method_options`` is the method's typed options
        object every later step reads (``None`` for a strategy that is not a fusion method)."""
        if self.spec is not None:
            self.method_options = self.spec.parse_options(options)
        elif options:
            raise ValueError(no_fusion_options(self.method, options))
        else:
            self.method_options = None

    def _accepts_option(self, name: str) -> bool:
        return self.spec is not None and name in {f.name for f in dataclasses.fields(self.spec.options)}

    @property
    def refine_steps(self) -> tuple[str, ...]:
        """The refine steps run after the aggregation (``()``: none)."""
        return self.refinement.steps

    @property
    def reads_client_scores(self) -> bool:
        """Whether the clients must send importance scores (the method reads them under these options)."""
        return (self.uses_scores and self.importance == "client" and self.spec is not None
                and self.spec.reads_client_scores(self.method_options))

    @property
    def wants_class_counts(self) -> bool:
        """Whether the clients must send their per-class training counts (they reveal the label distribution):
        fusion option ``head_weights`` and ``calibrate`` with prior ``class-counts``/``auto`` only."""
        head = bool(self.fusion_options.get("head_weights")) and "class_counts" not in self.fusion_options
        return head or ("calibrate" in self.refine_steps and self.refinement.prior in ("class-counts", "auto"))

    @property
    def wants_client_statistics(self) -> bool:
        """Whether the clients must send the statistics the method reads (RegMean's Gram matrices, Fisher merging's
        Fisher: ``fedfuse.fusion.client_statistics`` on their own data, the methods as published); without them the
        method would compute them on the server's fusion set (its public-data variant)."""
        return self.spec is not None and self.spec.client_statistics is not None

    def class_prior(self, updates: list[ClientUpdate]) -> tuple[torch.Tensor | None, str]:
        return class_prior(self.refinement.prior, updates)

    def on_fallback(self) -> None:
        self.momentum_step.reset()

    def summary(self) -> None:
        h = self.host
        log(INFO, "\t└──> fedfuse fusion: method=%s, importance=%s, fallback=%s, refine=%s, guard=%s, device=%s, "
            "options=%s%s", self.method, self.importance if self.uses_scores else "unused", h.fallback,
            "+".join(self.refine_steps) or "none", self.guard, h.device, self.fusion_options or "{}",
            ", aligned to the global model" if self.align_to == "global" else "")

    # ---------------------------------------------------------------- per round
    def round_method(self, server_round: int) -> str:
        """The aggregation of round ``server_round``: ``method``, or ``"average"`` after ``fusion_rounds``."""
        return "average" if self.fusion_rounds and server_round > self.fusion_rounds else self.method

    def round_summary(self, server_round: int) -> str:
        return self.round_method(server_round) + (f" + {'+'.join(self.refine_steps)}" if self.refine_steps else "")

    def round_needs_scores(self, server_round: int) -> bool:
        return self.host.wants_client_scores and self.round_method(server_round) == self.method

    def round_needs_statistics(self, server_round: int) -> bool:
        return self.wants_client_statistics and self.round_method(server_round) == self.method

    def round_config(self, server_round: int) -> dict[str, Any]:
        """The train config keys of the method's own requests (the protocol adds the round's label, scores and class
        counts)."""
        return {NEED_STATISTICS: self.round_needs_statistics(server_round)}

    def statistics_reference(self, server_round: int) -> dict[str, tuple[int, ...]] | None:
        """The statistics' names and shapes for the global architecture, from the method's own statistics function
        on a few fusion inputs (computed once)."""
        if not self.round_needs_statistics(server_round):
            return None
        if self._statistics_reference is None:
            stats = client_statistics(self.method, self.host._model_template(), self.host.fusion_inputs[:4])
            self._statistics_reference = {k: tuple(v.shape) for k, v in stats.items()}
        return self._statistics_reference

    def check_scores(self, server_round: int, updates: list[ClientUpdate], record: dict[str, Any]
                     ) -> list[ClientUpdate]:
        """``updates`` less those whose scores disagree with their weights (``score_check``)."""
        h = self.host
        if not (self.score_check and h.fusion_inputs is not None and self.round_needs_scores(server_round)):
            return updates
        return reject_inconsistent_scores(updates, h.build_model, h.fusion_inputs, record, server_round,
                                          extra=h.rejected_extra, device=resolve_device(h.device))

    # ---------------------------------------------------------------- a streamed round (the protocol's pass)
    def streams(self, server_round: int) -> bool:
        """A plain weighted-average round of a streaming entry (``average``/``fedavg``) with the default ``fuse_fn``,
        no ``distill`` (it reads every client model), no static BN, no robust screen and ``keep_updates`` off."""
        h = self.host
        return (self.entry.streams and not h.keep_updates and self.fuse_fn is fuse_result and h.screen is None
                and self.static_bn_step is None
                and self.round_method(server_round) in ("average", "fedavg") and "distill" not in self.refine_steps)

    def stream_checks_calibration(self) -> bool:
        """Whether the streamed round keeps its members to check a ``calibrate`` step against their ensemble."""
        return self.refinement.check and "calibrate" in self.refine_steps and self.host.fusion_inputs is not None

    def finish_stream(self, server_round: int, average: dict[str, torch.Tensor],
                      probs: Callable[[], torch.Tensor] | None, updates: list[ClientUpdate]):
        """``(state, info, seconds)``: the streamed average, then the server step and ``calibrate`` (checked with
        ``Refinement.streamed`` against the streamed ensemble ``probs``) on one model object reused every round (its
        state is copied out right away). Without either step the average's arrays are the result."""
        t0 = time.perf_counter()
        info: dict[str, Any] = {}
        momentum, refinement = self.momentum_step, self.refinement
        if not momentum.active and not refinement.steps:
            return average, info, time.perf_counter() - t0
        if self._work is None:
            self._work = copy.deepcopy(self.host._model_template())
        model = self._work.cpu()
        model.load_state_dict(average)
        model.eval()
        rd = self.round_data(server_round, updates)
        if momentum.active:
            model, step_info = momentum(model, rd)
            info.update(step_info)
        if refinement.steps:
            model, step_info = refinement.streamed(model, rd, probs)
            info.update(step_info)
        return model.state_dict(), info, time.perf_counter() - t0

    # ---------------------------------------------------------------- aggregation
    def fuse_updates(self, server_round: int, updates: list[ClientUpdate],
                     models: list[nn.Module] | None = None) -> FusionResult:
        """Fuse validated updates (``fuse_fn``); raises ``FusionError`` when the method cannot fuse them."""
        h = self.host
        method = self.round_method(server_round)
        if method != self.method or (self.entry.streams and models is None and self.fuse_fn is fuse_result):
            t0 = time.perf_counter()   # plain weighted averaging on the states, no model per client
            model = h.build_model(h.weighted_average(updates))
            return FusionResult(method=method, model=model, info={}, seconds=time.perf_counter() - t0)
        if models is None:
            models = [h.build_model(u.state) for u in updates]
        scores = [u.scores for u in updates] if h.wants_client_scores else None
        options = dict(self.fusion_options)
        if options.get("head_weights") and "class_counts" not in options:
            missing = [u.node_id for u in updates if u.class_counts is None]
            if missing:
                raise MissingInputError(f"fusion option head_weights needs 'class-counts' in every client's "
                                        f"metrics; nodes {missing} sent none")
            options["class_counts"] = [bounded_class_counts(u) for u in updates]
        if self.round_needs_statistics(server_round):   # each reply's, checked against statistics_reference
            options["statistics"] = [u.statistics for u in updates]
        if self.uses_scores and self.importance == "server" and self._accepts_option("fusion_labels"):
            options.setdefault("fusion_labels", h.fusion_labels)
        target = h.fuse_target()
        if target is not None:
            options.setdefault("target", target)
        if self.align_to == "global" and h._global is not None:
            options.setdefault("reference", h.build_model(h._global.to_torch_state_dict()))
        return self.fuse_fn(method, models, fusion_inputs=h.fusion_inputs, scores=scores,
                            weights=[u.num_examples for u in updates], device=h.device,
                            seed=h.seed + server_round, **options)

    def fuse_target(self) -> nn.Module | None:
        """The architecture the fused model takes (``fuse(..., target=)``); ``None``: model 0's."""
        return None

    def round_data(self, server_round: int, updates: list[ClientUpdate],
                   teachers: list[nn.Module] | None = None) -> RoundData:
        h = self.host
        total = sum(u.num_examples for u in updates)
        return RoundData(server_round, updates, [u.num_examples / total for u in updates], h.fusion_inputs,
                         h.build_model, lambda: h.weighted_average(updates), teachers, h._global,
                         self.round_method(server_round), h.seed + server_round, h.device)

    def post_steps(self, server_round: int) -> list[Callable[[nn.Module, RoundData], tuple[nn.Module, dict]]]:
        """The steps of round ``server_round`` after the aggregation, in order."""
        steps: list = []
        if self.guard and self.host.fusion_inputs is not None and self.round_method(server_round) != "average":
            steps.append(self.guard_step)
        if self.momentum_step.active:
            steps.append(self.momentum_step)
        if self.refine_steps:
            steps.append(self.refinement)
        if self.static_bn_step is not None:
            steps.append(self.static_bn_step)
        return steps

    def aggregate(self, server_round: int, updates: list[ClientUpdate]):
        """``(new global state, info, seconds)``: the protocol's ``fuse_updates`` then its ``post_steps`` (by default
        this object's; a protocol or a plug-in overrides either)."""
        h = self.host
        t0 = time.perf_counter()
        method = self.round_method(server_round)
        steps = h.post_steps(server_round)
        needs_models = ((self.spec is not None and method == self.method and not self.entry.streams)
                        or self.guard_step in steps
                        or "distill" in self.refine_steps)
        teachers = [h.build_model(u.state) for u in updates] if needs_models else None
        result = h.fuse_updates(server_round, updates, models=teachers if method == self.method else None)
        model, info = result.model, dict(result.info or {})
        rd = h.round_data(server_round, updates, teachers)
        for step in steps:
            model, step_info = step(model, rd)
            info.update(step_info)
        return model.state_dict(), info, time.perf_counter() - t0


# ---------------------------------------------------------------- the protocol that holds one
class FusionStrategy(RoundProtocol):
    """A Flower strategy whose aggregation is ``fedfuse.fusion.fuse_result(method, ...)``: the round protocol holding
    a ``FusionAggregator`` (``aggregator``), which owns the method, its options and its steps.

    Use ``build_strategy(name)``, a named class (``KfLinearStrategy``, ...) or ``FusionStrategy(method=...)``.
    The ClientApps must follow the reply contract of ``fedfuse.flower.round.replies``.

    The options come as one typed, frozen object per concern (``fedfuse.flower.round.options``): ``fusion``
    (``FusionOptions``: ``fusion_options``, ``importance``, ``fusion_rounds``, ``fuse_fn``, ``align_to``,
    ``score_check``), ``guard`` (``GuardOptions``: ``guard``, ``guard_ratio``), ``momentum`` (``MomentumOptions``:
    ``server_momentum``, ``server_learning_rate``), ``refine`` (``RefineOptions``: ``refine``, ``prior``,
    ``refine_check``, ``calibrate_min_gap``) and the protocol's (``ProtocolOptions``), or as the flat keywords named
    here, which the constructor moves into those objects once (an unknown keyword is a ``TypeError``).

    Args:
        method: a name in ``fedfuse.fusion.METHOD_SPECS`` whose result keeps the global architecture.
        fusion_options: the method's options, validated now against its options schema.
        importance: ``"client"`` (scores sent by the clients, validated) or ``"server"`` (computed by the method
            on the fusion set; needs ``fusion_labels`` unless uniform).
        fusion_rounds: fuse in rounds ``1..fusion_rounds`` only and average afterwards; 0 = fuse every round.
        fuse_fn: the fusion entry point (default ``fuse_result``): replace it to instrument fusion.
        refine: ``"calibrate"`` | ``"distill"`` | both joined by ``"+"`` | ``"none"``; ``None`` = the registry
            entry's default when ``fusion_inputs`` is given, else none.
        prior, refine_check, calibrate_min_gap: the ``Refinement`` step's options.
        guard, guard_ratio: the ``DivergenceGuard`` step (rounds that fuse with a method other than the average).
        server_momentum, server_learning_rate: the ``ServerMomentum`` step (``None``: the entry's default).
        score_check: reject a reply whose importance scores put most of their mass on units its own model does not
            use on the fusion set (``fedfuse.fusion.score_check``; rounds that read client scores only).
        align_to: the units the clients are aligned onto, for methods that align (``rebasin``, ``ot``: the
            ``any_reference`` capability): ``"model-0"`` (the first reply's, averaged in) or ``"global"`` (the
            round's global model, which every client started from and which is not averaged in:
            ``fuse(..., reference=)``).
        Everything else: ``RoundProtocol``'s options (Flower ``FedAvg``'s included).
    """

    method: str | None = None
    reads_scores = True   # a subclass whose aggregation never reads the method's importance scores says False

    def __init__(self, method: str | None = None, *, model_fn: Callable[[], nn.Module] | None = None,
                 fusion_inputs: torch.Tensor | None = None, fusion_labels: torch.Tensor | None = None,
                 device: str = "cpu", seed: int = 0, fusion: FusionOptions | None = None,
                 guard: GuardOptions | None = None, momentum: MomentumOptions | None = None,
                 refine: RefineOptions | None = None, registry_entry: StrategySpec | None = None,
                 **options: Any) -> None:
        concerns = FusionConcerns.take(options, fusion, guard, momentum, refine)
        super().__init__(model_fn=model_fn, fusion_inputs=fusion_inputs, fusion_labels=fusion_labels, device=device,
                         seed=seed, **options)
        self.aggregator = FusionAggregator(self, method, concerns, registry_entry=registry_entry,
                                           reads_scores=self.reads_scores)
        self.method = self.aggregator.method

    # the aggregation's override points (``super().post_steps(r)`` in a subclass that adds a step)
    def fuse_updates(self, server_round: int, updates: list[ClientUpdate],
                     models: list[nn.Module] | None = None) -> FusionResult:
        """Fuse validated updates (the aggregator's ``fuse_fn``); raises ``FusionError`` when the method cannot."""
        return self.aggregator.fuse_updates(server_round, updates, models)

    def post_steps(self, server_round: int) -> list[Callable[[nn.Module, RoundData], tuple[nn.Module, dict]]]:
        """The steps of round ``server_round`` after the aggregation, in order (override to add one)."""
        return self.aggregator.post_steps(server_round)


__all__ = ["FusionStrategy", "FusionAggregator", "FusionConcerns"]
