"""``FusionStrategy``: Flower's ``FedAvg`` with the aggregation replaced by ``fedfuse.fusion``.

It keeps FedAvg's node sampling and message construction (public ``configure_train``) and overrides
``aggregate_train`` fully (stock FedAvg rejects replies carrying a second ArrayRecord such as
``"importance"``):

    replies → split off error replies (logged) → validate each against the reply contract
    (``fedfuse.flower.replies``) → sort by partition id (deterministic float sums) →
    ``fedfuse.fusion.fuse_result(method, ...)`` → finite check → new global ArrayRecord

Failures are never silent. Only the fusion error family (``fedfuse.fusion.FusionError``) is caught: the
round then takes the configured fallback (keep the previous global model, or average the valid
replies) and says so in a WARNING line with the round and the reason; any other exception is a bug and
fails the run. Rejected replies, failures, fallbacks, skipped rounds, fusion diagnostics (the method's
``FusionResult.info``) and timings are kept in ``self.history`` (one dict per round) for the results.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time
from logging import INFO, WARNING
from typing import Any, Callable, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedfuse.choices import FALLBACKS, PRIORS
from fedfuse.fusion import (METHOD_SPECS, FusionError, FusionResult, MethodSpec, MissingInputError, check_finite,
                            fuse_result, get_spec)
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.fusion.refine import classifier_bias, kl_to, parse_refine, refine_model
from fedfuse.training import resolve_device
from fedfuse.models import levels
from fedfuse.flower.replies import (IMPORTANCE_KEY, MAX_NUM_EXAMPLES, METRICS_KEY, ClientUpdate, NonFiniteWeights,
                                    ReplyRejected, _metric_record, _npy_view, validate_reply)

MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]


class ClientsDivergedError(RuntimeError):
    """Every client of a round returned non-finite weights: local training diverged; the run stops."""


class FusionStrategy(FedAvg):
    """A Flower strategy whose aggregation is ``fedfuse.fusion.fuse_result(method, ...)``.

    Use a named subclass (``KfLinearStrategy``, ``OtStrategy``, ...; ``fedfuse.flower.STRATEGIES``) or
    ``FusionStrategy(method="...")``. The ClientApps must follow the reply contract of
    ``fedfuse.flower.replies``.

    Args:
        method: a name in ``fedfuse.fusion.METHOD_SPECS`` whose result keeps the global architecture
            (default: the subclass's ``method``).
        model_fn: ``() -> nn.Module`` building the global architecture (turns arrays into models and
            gives the fusion levels).
        fusion_inputs: the server fusion set ``[B, *input_shape]`` (every round sees the same set).
        fusion_labels: optional labels ``[B]`` of the fusion set, only for server-side importance.
        fusion_options: the fusion method's options; validated here against the method's options
            schema (``METHOD_SPECS[method].parse_options``), so a bad key fails before any round.
        importance: ``"client"`` (scores sent by the clients, validated) or ``"server"`` (computed by
            the method on the fusion set) for methods that use scores.
        fallback: when fusion raises a ``FusionError`` or yields non-finite weights: ``"previous"``
            keeps the last global model, ``"average"`` uses the weighted average of the valid replies,
            ``"raise"`` fails the run.
        min_valid_replies: rounds with fewer valid replies are skipped (global model unchanged).
        fusion_rounds: fuse with ``method`` in rounds ``1..fusion_rounds`` only and average the
            replies' weights (FedAvg) afterwards; 0 = fuse every round.
        device: where fusion runs (``"auto"``: CUDA when present).
        seed: base seed; round ``r`` fuses with ``seed + r``.
        fuse_fn: the fusion entry point, ``fedfuse.fusion.fuse_result`` by default; replace it to
            instrument fusion (it must return a ``FusionResult`` and raise ``FusionError`` for a
            failure the round may fall back from).
        refine: post-aggregation refinement on the fusion set, every round (``fedfuse.fusion.refine``):
            ``"calibrate"`` (classifier bias moved to the federation's class prior), ``"distill"`` (FedDF's
            ensemble distillation), both joined by ``"+"``, or ``"none"``. ``None`` = the strategy's
            default (``default_refine``: ``"calibrate"`` for fusion strategies, the best measured setting)
            when ``fusion_inputs`` is given, else ``"none"``.
        prior: the class prior of ``"calibrate"``: ``"class-counts"`` (the sum of the class counts the
            clients report; an error when one does not), ``"uniform"``, or ``"auto"`` (class counts when
            every valid reply has them, else uniform; the info says which).
        guard: the divergence guard. After fusing (before refining) the fused model's KL to the round's
            client ensemble on the fusion set is compared with the weighted average's; if it is higher
            than ``guard_ratio`` × the average's + 0.05 nats, or not finite, the round uses the average
            instead and says so (WARNING, ``history[round]["guard"]``, results ``guarded-rounds``).
        guard_ratio: the guard's tolerance (> 1).
        server_momentum: server momentum on the aggregate's pseudo-gradient (FedAvgM's step, Hsu et al., arXiv
            1909.06335, applied to the fused/guarded aggregate ``a_t``): ``v = m·v + (a_t − x_t)``,
            ``x_{t+1} = x_t + server_learning_rate·v``, where ``x_t`` is the global model sent this round;
            then ``refine``. 0 = off; ``None`` = the strategy's ``default_server_momentum`` (0 here; 0.5 for
            ``AverageStrategy``: on MNIST-1D Dirichlet α=0.1 it lifts ``average`` from 0.532 to 0.59). The
            first round is the aggregate.
        server_learning_rate: the server step on ``v`` (1 = take the aggregate plus momentum).
        refine_check: keep a round's refinement only when it does not move the model away from the clients'
            ensemble on the fusion set (KL(ensemble ‖ model) not higher than before refining); otherwise the
            round uses the unrefined aggregate (``info["refine-kept"]`` = 0). Measured: calibrating every
            round under momentum ends at 0.548, checked 0.592 (MNIST-1D α=0.1, 3 seeds).
        calibrate_min_gap: ``calibrate`` only acts when the aggregate's mean prediction on the fusion set is off the
            prior by at least this much for some class (max |q̄ − π|); smaller gaps are what local training moves
            anyway. Measured (5 seeds, server momentum 0.5, refine check on): MNIST-1D α=0.1 0.597 ± 0.015 with
            0.2 vs 0.568 ± 0.038 with 0; digits Dirichlet α=0.1, 4 clients, 10 rounds 0.801 vs 0.775; on
            class-disjoint digits shards (4 clients, 3 rounds, 3 seeds) 0.2 gives 0.489 vs 0.572 with 0.
        fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes,
        weighted_by_key, arrayrecord_key, configrecord_key, train_metrics_aggr_fn,
        evaluate_metrics_aggr_fn: Flower ``FedAvg``'s options (same meaning). ``arrayrecord_key`` names
            the weights record both ways and ``weighted_by_key`` the reply metric with the sample
            count. ``fraction_evaluate`` defaults to 0 (fedfuse evaluates the global model centrally).
            ``train_metrics_aggr_fn`` (``(contents, weighted_by_key) -> MetricRecord``) gets the valid
            replies' contents; without it scalar metrics are sample-weighted means and
            ``class-counts`` lists are summed.
    """

    method: str | None = None
    default_refine: str = "calibrate"   # refine=None means this (the best measured setting, simulations/README.md)
    can_refine: bool = True             # False for strategies that aggregate arrays only (fedavg, Flower's)
    # server_momentum=None means this; 0 except where measured better (AverageStrategy 0.5): kf-linear fused every
    # round with momentum 0.5 collapsed on digits Dirichlet α=0.1 (0.12, 0.10, one run diverged; README multi-round)
    default_server_momentum: float = 0.0
    # rounds whose aggregation is a plain weighted average (+ server step, + calibrate) run as a stream over the
    # replies (``aggregate_streaming``): a running weighted sum, nothing per client kept. Opt-in per strategy class:
    # AverageStrategy and FedAvgStrategy; other strategies read every client model at once.
    streams: bool = False

    def __init__(self, method: str | None = None, *, model_fn: Callable[[], nn.Module] | None = None,
                 fusion_inputs: torch.Tensor | None = None, fusion_labels: torch.Tensor | None = None,
                 fusion_options: dict[str, Any] | None = None, importance: str = "client",
                 fallback: str = "previous", min_valid_replies: int = 1, fusion_rounds: int = 0,
                 device: str = "cpu", seed: int = 0,
                 fuse_fn: Callable[..., FusionResult] = fuse_result, refine: str | None = None,
                 prior: str = "auto", guard: bool = True, guard_ratio: float = 2.0,
                 server_momentum: float | None = None, server_learning_rate: float = 1.0,
                 refine_check: bool = True, calibrate_min_gap: float = 0.2,
                 fraction_train: float = 1.0, fraction_evaluate: float = 0.0, min_train_nodes: int = 2,
                 min_evaluate_nodes: int = 2, min_available_nodes: int = 2,
                 weighted_by_key: str = "num-examples", arrayrecord_key: str = "arrays",
                 configrecord_key: str = "config", train_metrics_aggr_fn: MetricsAggrFn | None = None,
                 evaluate_metrics_aggr_fn: MetricsAggrFn | None = None) -> None:
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
                         arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key,
                         train_metrics_aggr_fn=train_metrics_aggr_fn,
                         evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn)
        cls_method = type(self).method
        if method is not None and cls_method is not None and method != cls_method:
            raise ValueError(f"strategy: {type(self).__name__} aggregates with {cls_method!r}, not {method!r}; "
                             f"use FusionStrategy(method={method!r}) or that method's named strategy")
        method = method or cls_method
        if method is None:
            raise ValueError("strategy: FusionStrategy needs method= (a name in fedfuse.fusion.METHOD_SPECS)")
        if fallback not in FALLBACKS:
            raise ValueError(f"strategy: fallback must be one of {FALLBACKS}, got {fallback!r}")
        if importance not in ("client", "server"):
            raise ValueError(f"strategy: importance must be 'client' or 'server', got {importance!r}")
        if int(fusion_rounds) < 0:
            raise ValueError(f"strategy: fusion_rounds must be >= 0, got {fusion_rounds}")
        if prior not in PRIORS:
            raise ValueError(f"strategy: prior must be one of {PRIORS}, got {prior!r}")
        if not float(guard_ratio) > 1:
            raise ValueError(f"strategy: guard_ratio must be > 1, got {guard_ratio}")
        if server_momentum is None:
            server_momentum = self.default_server_momentum
        if not 0 <= float(server_momentum) < 1:
            raise ValueError(f"strategy: server_momentum must be in [0, 1), got {server_momentum}")
        if not float(server_learning_rate) > 0:
            raise ValueError(f"strategy: server_learning_rate must be > 0, got {server_learning_rate}")
        try:
            # the default refinement needs the fusion set; without one (e.g. 'average' as a plug-in) it is off
            steps = parse_refine(refine if refine is not None else
                                 (self.default_refine if fusion_inputs is not None else "none"))
        except ValueError as exc:
            raise ValueError(f"strategy: {exc}") from None
        if steps and not self.can_refine:
            raise ValueError(f"strategy: {type(self).__name__} aggregates the arrays as Flower does and takes no "
                             f"refine step (got refine={refine!r}); use a fusion strategy such as 'average'")
        if steps and fusion_inputs is None:
            raise ValueError(f"strategy: refine={'+'.join(steps)!r} needs fusion_inputs (the server fusion set); "
                             "pass refine='none' to aggregate without one")
        self.refine_steps = steps
        self.prior = prior
        self.guard = bool(guard)
        self.guard_ratio = float(guard_ratio)
        self.server_momentum = float(server_momentum)
        self.server_learning_rate = float(server_learning_rate)
        self.refine_check = bool(refine_check)
        if not 0 <= float(calibrate_min_gap) < 1:
            raise ValueError(f"strategy: calibrate_min_gap must be in [0, 1), got {calibrate_min_gap}")
        self.calibrate_min_gap = float(calibrate_min_gap)
        self._momentum: dict[str, torch.Tensor] | None = None   # v, over the floating-point arrays
        self.method = method
        self.spec = self._method_spec(method)
        self.fusion_options = dict(fusion_options or {})
        self._check_options(self.fusion_options)
        self.model_fn = model_fn
        self.fusion_inputs = fusion_inputs
        self.fusion_labels = fusion_labels
        self.importance = importance
        self.fallback = fallback
        self.min_valid_replies = max(1, int(min_valid_replies))
        self.fusion_rounds = int(fusion_rounds)
        self.device = device
        self.seed = seed
        self.fuse_fn = fuse_fn
        self._user_train_metrics_aggr_fn = train_metrics_aggr_fn
        self.needs_data = bool(self.spec.needs_data) if self.spec is not None else False
        self.uses_scores = bool(self.spec.uses_scores) if self.spec is not None else False
        if importance == "server" or self.fusion_options.get("importance") in ("conductance", "deeplift"):
            # scores computed by the method on the fusion set (issue 15: never silently uniform)
            self.fusion_options = self._server_importance_options(self.fusion_options, fusion_labels)
            self.importance = "server"
        if self.needs_data and fusion_inputs is None:
            raise ValueError(f"strategy: method {method!r} needs fusion_inputs (the server fusion set)")
        if model_fn is None and self._needs_modules():
            raise ValueError(f"strategy: method {method!r} needs model_fn to rebuild client models")
        self._level_widths: dict[str, int] | None = None
        if model_fn is not None and self.uses_scores and importance == "client":
            self._level_widths = {lv.name: lv.width for lv in levels(model_fn())}
        self._global: ArrayRecord | None = None
        self.last_updates: list[ClientUpdate] = []
        # keep_updates: keep every round's validated replies in ``last_updates`` (turns streaming off); observer:
        # called with every validated reply of a round (e.g. the ServerApp's per-client test reference) before the
        # strategy drops it, in both modes
        self.keep_updates = False
        self.update_observer: Callable[[ClientUpdate], None] | None = None
        self._reference_cache: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
        self._template: nn.Module | None = None   # model_fn() once: build_model copies it (no re-initialisation)
        self._probe: nn.Module | None = None      # model_fn() once: the streaming ensemble's forward passes
        self._work: nn.Module | None = None       # the streamed round's aggregate, reused
        self.history: list[dict[str, Any]] = []
        # rounds already done before this ``start`` (resume from a checkpoint): ``start`` counts 1..k,
        # clients, fusion seeds and ``history`` see the true round ``round_offset + 1 ..``
        self.round_offset = 0
        self._sent_msgs: list[Message] = []
        self._node_partitions: dict[int, int] = {}     # node id -> partition id, learnt from replies

    # ---------------------------------------------------------------- set-up helpers
    def _method_spec(self, method: str) -> MethodSpec | None:
        """The fusion method's registry entry (checked: it must keep the global architecture)."""
        try:
            spec = get_spec(method)
        except FusionError as exc:
            raise ValueError(f"strategy: {exc}") from None
        if not spec.same_architecture:
            raise ValueError(f"strategy: method {method!r} does not return the global architecture, so it "
                             "cannot be a round's aggregation (it is evaluated as a reference instead)")
        return spec

    def _check_options(self, options: dict[str, Any]) -> None:
        """Validate ``fusion_options`` now, not in round 1 (``FusionOptionError`` names the key)."""
        if self.spec is not None:
            self.spec.parse_options(options)

    def _accepts_option(self, name: str) -> bool:
        return self.spec is not None and name in {f.name for f in dataclasses.fields(self.spec.options)}

    def _needs_modules(self) -> bool:
        return True

    def _scores_on_server(self) -> bool:
        """Whether the method can score the client models itself: its ``importance`` option takes a captum
        scorer (``ot``'s ``importance`` is selective OT's unit scoring, not a client-score replacement)."""
        if not self._accepts_option("importance"):
            return False
        try:
            self.spec.parse_options({"importance": "deeplift"})
        except FusionError:
            return False
        return True

    def _server_importance_options(self, options: dict[str, Any], fusion_labels: Any) -> dict[str, Any]:
        """``importance="server"``: the fusion options with the method's ``importance`` set to the scoring it runs on
        the fusion set (DeepLIFT unless the options name one); a ``ValueError`` saying what is missing otherwise."""
        if not self.uses_scores:
            raise ValueError(f"strategy: importance='server': method {self.method!r} uses no importance scores; "
                             "leave importance='client' (the default)")
        if not self._scores_on_server():
            raise ValueError(f"strategy: importance='server': method {self.method!r} takes its scores from the "
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
        self._check_options(out)
        return out

    @property
    def wants_client_scores(self) -> bool:
        """Whether the clients must send importance scores: the method reads them under these options
        (``MethodSpec.reads_client_scores``: e.g. OT only with ``marginals='importance'``)."""
        return (self.uses_scores and self.importance == "client" and self.spec is not None
                and self.spec.reads_client_scores(self.fusion_options))

    @property
    def wants_class_counts(self) -> bool:
        """Whether the clients must send their per-class training counts (``class-counts``, which reveal their
        label distribution): only for fusion option ``head_weights`` and ``calibrate`` with prior
        ``class-counts``/``auto``. Sent to the clients as train-config ``need-class-counts``."""
        head = bool(self.fusion_options.get("head_weights")) and "class_counts" not in self.fusion_options
        return head or ("calibrate" in self.refine_steps and self.prior in ("class-counts", "auto"))

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> fedfuse fusion: method=%s, importance=%s, fallback=%s, refine=%s, guard=%s, device=%s, "
            "options=%s", self.method, self.importance if self.uses_scores else "unused", self.fallback,
            "+".join(self.refine_steps) or "none", self.guard, self.device, self.fusion_options or "{}")

    # ---------------------------------------------------------------- configure
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        server_round += self.round_offset
        self._global = arrays
        config["fusion-method"] = self.round_method(server_round)
        config["need-importance"] = self.round_needs_scores(server_round)
        config["need-class-counts"] = self.wants_class_counts
        rng_state = random.getstate()  # FedAvg samples nodes with `random`: make it reproducible per round
        random.seed(self.seed * 1_000_003 + server_round)
        try:
            messages = list(super().configure_train(server_round, arrays, config, grid))
        finally:
            random.setstate(rng_state)
        self._sent_msgs = [m for m in messages if isinstance(m, Message)]  # the grid sets their message ids
        return messages

    def round_method(self, server_round: int) -> str:
        """The aggregation of round ``server_round``: ``method``, or ``"average"`` after ``fusion_rounds``."""
        if self.fusion_rounds and server_round > self.fusion_rounds:
            return "average"
        return self.method

    def round_needs_scores(self, server_round: int) -> bool:
        """Whether round ``server_round``'s clients must send importance scores."""
        return self.wants_client_scores and self.round_method(server_round) == self.method

    # ---------------------------------------------------------------- replies
    def _failure(self, node_id: int, reason: str, code: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"node-id": node_id, "reason": reason}
        if code is not None:
            out["code"] = code
        if node_id in self._node_partitions:
            out["partition-id"] = self._node_partitions[node_id]
        return out

    def _reply_node(self, msg: Message) -> int:
        """The node a reply is about: errors made by the SuperLink (e.g. node unavailable) carry the
        SuperLink's id as source, so map them back through the message they reply to."""
        by_id = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in self._sent_msgs if m.metadata.message_id}
        return by_id.get(msg.metadata.reply_to_message_id, int(msg.metadata.src_node_id))

    def _reference(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        if self.model_fn is not None:
            if self._reference_cache is None:  # the global architecture does not change between rounds
                self._reference_cache = {k: (tuple(v.shape), v.detach().cpu().numpy().dtype)
                                         for k, v in self._model_template().state_dict().items()}
            return self._reference_cache
        if self._global is None:
            raise RuntimeError("strategy: no global model to validate replies against (set model_fn)")
        return {k: (tuple(a.shape), a.numpy().dtype) for k, a in self._global.items()}

    def _model_template(self) -> nn.Module:
        if self._template is None:
            self._template = self.model_fn()
        return self._template

    def build_model(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """A model of the global architecture holding ``state`` (a copy of one ``model_fn()`` instance: building
        a model anew re-seeds and re-initialises every layer, the larger part of an average round's time)."""
        model = copy.deepcopy(self._model_template())
        model.load_state_dict(state)
        return model.eval()

    def _split_replies(self, server_round: int, replies: list[Message]) -> tuple[list[Message], list[dict]]:
        """Replies with content, and one failure record per error reply or silent node (all logged)."""
        ok = [m for m in replies if not m.has_error()]
        errors = [m for m in replies if m.has_error()]
        log(INFO, "aggregate_train: round %d: received %d results and %d failures", server_round, len(ok),
            len(errors))
        failures = []
        for m in errors:
            failure = self._failure(self._reply_node(m), _short(str(m.error.reason)), int(m.error.code))
            log(WARNING, "aggregate_train: round %d: node %d (partition %s) failed: %s", server_round,
                failure["node-id"], failure.get("partition-id", "?"), failure["reason"][:200])
            failures.append(failure)
        answered = {self._reply_node(m) for m in replies}
        for node_id in sorted({int(m.metadata.dst_node_id) for m in self._sent_msgs} - answered):
            # no reply at all: the node timed out (round-timeout), disconnected or its process died
            log(WARNING, "aggregate_train: round %d: no reply from node %d (timed out or disconnected)",
                server_round, node_id)
            failures.append(self._failure(node_id, "no reply within the round timeout "
                                                   "(timed out, disconnected or died)"))
        self._sent_msgs = []
        return ok, failures

    def _validate(self, server_round: int, ok: list[Message], record: dict[str, Any]) -> list[ClientUpdate]:
        reference = self._reference()
        level_widths = self._level_widths if self.round_needs_scores(server_round) else None
        updates: list[ClientUpdate] = []
        for msg in ok:
            try:
                updates.append(validate_reply(msg, reference, level_widths, arrays_key=self.arrayrecord_key,
                                              metrics_key=METRICS_KEY, importance_key=IMPORTANCE_KEY,
                                              weight_key=self.weighted_by_key))
            except ReplyRejected as exc:
                log(WARNING, "aggregate_train: round %d: rejected reply from node %d: %s", server_round,
                    msg.metadata.src_node_id, exc)
                rejected = {"node-id": int(msg.metadata.src_node_id), "reason": str(exc)}
                if isinstance(exc, NonFiniteWeights):
                    rejected["non-finite-weights"] = True
                record["rejected"].append(rejected)
        updates.sort(key=lambda u: (u.partition_id, u.node_id))
        self._node_partitions.update({u.node_id: u.partition_id for u in updates})
        if self.update_observer is not None:
            for u in updates:
                self.update_observer(u)
        return updates

    # ---------------------------------------------------------------- aggregation
    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.round_offset
        replies = list(replies)
        ok, failures = self._split_replies(server_round, replies)
        record: dict[str, Any] = {"round": server_round, "method": self.round_method(server_round),
                                  "replies": len(replies), "failures": failures, "rejected": [],
                                  "fallback": None, "skipped": None, "fusion-info": None}
        if self.streaming_round(server_round):
            return self.aggregate_streaming(server_round, ok, failures, record)
        updates = self._validate(server_round, ok, record)
        record["valid"] = len(updates)
        self.last_updates = updates
        if self._stop_or_skip(server_round, len(updates), record):
            return None, None

        t0 = time.perf_counter()
        state, fallback, info = self._fuse_with_fallback(server_round, updates)
        metrics = self._close_round(record, time.perf_counter() - t0, fallback, info, updates, ok, failures)
        if state is None:
            return None, metrics
        return state_to_record(state), metrics

    # ---------------------------------------------------------------- streaming average
    def streaming_round(self, server_round: int) -> bool:
        """Whether round ``server_round`` aggregates as a stream (``aggregate_streaming``): a plain weighted average
        (``average``/``fedavg``, or ``average`` after ``fusion_rounds``) of a ``streams`` strategy, no ``distill``
        (which reads every client model), the default ``fuse_fn`` and ``keep_updates`` off."""
        return (self.streams and not self.keep_updates and self.fuse_fn is fuse_result
                and self.round_method(server_round) in ("average", "fedavg") and "distill" not in self.refine_steps)

    def _wants_stream_ensemble(self) -> bool:
        # the refine check compares the calibrated model with the clients' ensemble on the fusion set
        return self.refine_check and "calibrate" in self.refine_steps and self.fusion_inputs is not None

    def aggregate_streaming(self, server_round: int, ok: list[Message], failures: list[dict],
                            record: dict[str, Any]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``aggregate_train`` of a weighted-average round as a stream over the replies: each reply is validated,
        added to a running float64 weighted sum of the weights (and, when the refine check needs it, its softmax on
        the fusion set to a running ensemble), handed to ``update_observer`` and dropped. The strategy holds one
        model's worth of sums (+ ``[fusion set, classes]`` probabilities) whatever the number of clients; the
        result is the same as averaging the kept replies (same order, same weights: sorted by partition id, sample
        counts read from the metrics first). Then the server step, ``calibrate`` and its check, as
        ``aggregate_state``."""
        t_start = time.perf_counter()
        reference = self._reference()
        observer_seconds = 0.0
        # pass 1, metrics only (no array deserialised): fusion order and the weights' denominator
        keyed = []
        for msg in ok:
            metrics = _metric_record(msg.content, METRICS_KEY)
            pid = metrics.get("partition-id", -1) if metrics is not None else -1
            n = metrics.get(self.weighted_by_key) if metrics is not None else None
            keyed.append(((int(pid) if isinstance(pid, (int, float)) and not isinstance(pid, bool) else -1,
                           int(msg.metadata.src_node_id)), n, msg))
        keyed.sort(key=lambda t: t[0])
        plausible = [float(n) for _, n, _ in keyed
                     if isinstance(n, (int, float)) and not isinstance(n, bool) and 0 < n <= MAX_NUM_EXAMPLES]
        total = float(np.array(plausible, dtype=float).sum()) if plausible else 1.0
        ensemble = self._wants_stream_ensemble()
        members: list[tuple[Message, float]] = []  # the valid replies (Flower's messages, held by the caller anyway)
        acc: dict[str, torch.Tensor] | None = None
        light: list[ClientUpdate] = []   # metrics only (no arrays): the round's metrics aggregation
        valid_total = 0
        for _, _, msg in keyed:
            try:
                u = validate_reply(msg, reference, None, arrays_key=self.arrayrecord_key, metrics_key=METRICS_KEY,
                                   importance_key=IMPORTANCE_KEY, weight_key=self.weighted_by_key, copy=False)
            except ReplyRejected as exc:
                log(WARNING, "aggregate_train: round %d: rejected reply from node %d: %s", server_round,
                    msg.metadata.src_node_id, exc)
                rejected = {"node-id": int(msg.metadata.src_node_id), "reason": str(exc)}
                if isinstance(exc, NonFiniteWeights):
                    rejected["non-finite-weights"] = True
                record["rejected"].append(rejected)
                continue
            w = u.num_examples / total
            valid_total += u.num_examples
            if acc is None:  # integer buffers (BatchNorm counters) from the first reply, as average_state_dicts
                dtypes = {k: v.dtype for k, v in u.state.items()}
                acc = {k: (w * v.double() if v.is_floating_point() else v.clone()) for k, v in u.state.items()}
            else:
                for k, v in u.state.items():
                    if v.is_floating_point():
                        acc[k].add_(w * v.double())
            if ensemble:
                members.append((msg, w))
            self._node_partitions[u.node_id] = u.partition_id
            if self.update_observer is not None:
                t_obs = time.perf_counter()
                self.update_observer(u)
                observer_seconds += time.perf_counter() - t_obs
            light.append(dataclasses.replace(u, state={}, scores=None))
            del u
        record["valid"] = len(light)
        self.last_updates = []
        if self._stop_or_skip(server_round, len(light), record):
            return None, None
        if valid_total != total:  # a rejected reply: renormalise over the valid ones
            scale = total / valid_total
            for k, v in acc.items():
                if v.is_floating_point():
                    v.mul_(scale)
            members = [(m, w * scale) for m, w in members]
        average = {k: v.to(dtypes[k]) for k, v in acc.items()}
        t0 = time.perf_counter()
        probs = (lambda: self._stream_ensemble(members, reference)) if ensemble else None
        state, fallback, info = self._finish_stream(server_round, average, probs, light)
        # the streamed aggregate is the average itself: the divergence guard has nothing to replace (guard stays None)
        metrics = self._close_round(record, time.perf_counter() - t0 + (t0 - t_start - observer_seconds), fallback,
                                    info, light, ok, failures)
        if state is None:
            return None, metrics
        return state_to_record(state), metrics

    def _stream_ensemble(self, members: list[tuple[Message, float]],
                         reference: dict[str, tuple[tuple[int, ...], np.dtype]]) -> torch.Tensor:
        """The clients' ensemble on the fusion set, ``sum_i w_i softmax(f_i(x))`` (``teacher_probs``, same order and
        sums), re-reading the round's valid replies one at a time: only when a calibration needs checking."""
        if self._probe is None:
            self._probe = self.model_fn().eval()
        x = torch.as_tensor(self.fusion_inputs).float()
        probs = None
        with torch.no_grad():
            for msg, w in members:
                arrays = msg.content[self.arrayrecord_key]
                state = {}
                for key, (shape, dtype) in reference.items():
                    a = _npy_view(arrays[key], shape, dtype)
                    state[key] = torch.from_numpy(np.array(a if a is not None else arrays[key].numpy(), copy=True))
                p = torch.cat([w * torch.func.functional_call(self._probe, state, (x[i:i + 512],)).softmax(-1)
                               for i in range(0, x.shape[0], 512)])
                probs = p if probs is None else probs + p
        return probs

    def _stop_or_skip(self, server_round: int, valid: int, record: dict[str, Any]) -> bool:
        """Every reply non-finite → ``ClientsDivergedError``; fewer than ``min_valid_replies`` → the round is
        skipped (logged, recorded; returns True)."""
        non_finite = [r for r in record["rejected"] if r.get("non-finite-weights")]
        if not valid and non_finite and len(non_finite) == len(record["rejected"]):
            self.history.append({**record, "skipped": "every client returned non-finite weights"})
            raise ClientsDivergedError(
                f"round {server_round}: every client that replied ({len(non_finite)}) returned non-finite "
                f"weights (e.g. node {non_finite[0]['node-id']}: {non_finite[0]['reason']}); local training "
                "diverged, so the run stops here with the last global model. Lower the clients' 'lr' or use "
                "another 'optimizer'.")
        if valid < self.min_valid_replies:
            reason = (f"round {server_round} skipped: {valid} valid replies, fewer than the minimum "
                      f"{self.min_valid_replies}; the global model is unchanged")
            log(WARNING, "aggregate_train: %s", reason)
            record["skipped"] = reason
            self.history.append(record)
            return True
        return False

    def _close_round(self, record: dict[str, Any], seconds: float, fallback: str | None,
                     info: dict[str, Any] | None, updates: list[ClientUpdate], ok: list[Message],
                     failures: list[Any]) -> MetricRecord:
        """Record the round's outcome in ``history`` and return the train metrics that report it."""
        record["fusion-seconds"] = seconds
        record["fallback"] = fallback
        record["guard"] = (info or {}).pop("guard", None)
        record["fusion-info"] = info
        self.history.append(record)
        metrics = self._train_metrics(updates, ok)
        metrics["fusion-seconds"] = seconds
        metrics["num-valid"] = len(updates)
        metrics["num-rejected"] = len(record["rejected"])
        metrics["num-failures"] = len(failures)
        metrics["fell-back"] = int(fallback is not None)
        metrics["guarded"] = int(record["guard"] is not None)
        return metrics

    def _finish_stream(self, server_round: int, average: dict[str, torch.Tensor],
                       probs: Callable[[], torch.Tensor] | None, light: list[ClientUpdate]
                       ) -> tuple[dict[str, torch.Tensor] | None, str | None, dict[str, Any] | None]:
        """The streamed average → server step → ``calibrate`` (+ check against the streamed ensemble), with
        ``_fuse_with_fallback``'s failure handling."""
        method = self.round_method(server_round)
        t0 = time.perf_counter()
        try:
            info: dict[str, Any] = {}
            stepping = self.server_momentum > 0 or self.server_learning_rate != 1
            if not stepping and not self.refine_steps:
                state = average  # FedAvg: the arrays themselves, no model built
            else:
                # one model object reused every round (its state is copied into the reply record right away)
                if self._work is None:
                    self._work = copy.deepcopy(self._model_template())
                model = self._work.cpu()
                model.load_state_dict(average)
                model.eval()
                if stepping:
                    info.update(self.server_step(model))
                if self.refine_steps:
                    prior, prior_name = self.class_prior(light)  # the replies' metrics (class counts) are kept
                    info["refine"] = "+".join(self.refine_steps)
                    info["prior"] = prior_name
                    dev = resolve_device(self.device)
                    # calibrate moves only the classifier bias: the check needs that bias (and, when the calibration
                    # fired, the logits with it: computed then by putting it back for one forward pass)
                    checking = self.refine_check and probs is not None
                    if checking:
                        bias_before = classifier_bias(model).detach().clone()
                    info.update(refine_model(model.to(dev), self.refine_steps, teachers=None, weights=None,
                                             fusion_inputs=self.fusion_inputs, prior=prior,
                                             seed=self.seed + server_round, calibrate_min_gap=self.calibrate_min_gap,
                                             device=dev))
                    model = model.cpu().eval()
                    if checking and not info.get("calibration-skipped"):
                        # calibration changed the bias: keep it only if the model moved towards the clients' ensemble
                        x = torch.as_tensor(self.fusion_inputs).float()
                        with torch.no_grad():
                            bias = classifier_bias(model)
                            bias_after = bias.detach().clone()
                            logits_after = model(x)
                            bias.copy_(bias_before)
                            logits_before = model(x)
                            target = probs()
                            kl_before, kl_after = kl_to(target, logits_before), kl_to(target, logits_after)
                            kept = kl_after <= kl_before
                            if kept:
                                bias.copy_(bias_after)
                        info.update({"refine-kl-before": kl_before, "refine-kl-after": kl_after,
                                     "refine-kept": int(kept)})
                    check_finite(f"{method} (refined)", model)
                state = model.state_dict()
        except FusionError as exc:
            if self.fallback == "raise":
                raise
            self.reset_server_state()
            reason = f"{type(exc).__name__}: {exc}"
            if self.fallback == "average":
                log(WARNING, "aggregate_train: round %d: %r failed (%s); fell back to weighted averaging",
                    server_round, method, reason)
                return average, f"average: {reason}", None
            log(WARNING, "aggregate_train: round %d: %r failed (%s); keeping the previous global model",
                server_round, method, reason)
            return None, f"previous: {reason}", None
        log(INFO, "aggregate_train: round %d: %s aggregated %d models in %.2fs (streamed)%s", server_round,
            method + (f" + {'+'.join(self.refine_steps)}" if self.refine_steps else ""), len(light),
            time.perf_counter() - t0, f" ({_info_line(info)})" if info else "")
        return state, None, info

    @staticmethod
    def weighted_average(updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
        """Sample-count-weighted average of the updates' weights (FedAvg)."""
        from fedfuse.fusion.average import average_state_dicts

        w = np.array([u.num_examples for u in updates], dtype=float)
        return average_state_dicts([u.state for u in updates], list(w / w.sum()))

    def fuse_updates(self, server_round: int, updates: list[ClientUpdate],
                     models: list[nn.Module] | None = None) -> FusionResult:
        """Fuse validated updates (``fuse_fn``); the result's model is the new global model.

        Raises ``FusionError`` when the method cannot fuse them (the round then falls back).
        """
        method = self.round_method(server_round)
        if method != self.method or (method == "average" and models is None and self.fuse_fn is fuse_result):
            # plain sample-weighted averaging (after fusion_rounds, or the 'average' method): on the validated
            # states directly, without rebuilding a model per client (the same numbers, a fraction of the time)
            t0 = time.perf_counter()
            model = self.build_model(self.weighted_average(updates))
            return FusionResult(method=method, model=model, info={}, seconds=time.perf_counter() - t0)
        if models is None:  # the updates' models, unless the caller built them already (fusion never modifies them)
            models = [self.build_model(u.state) for u in updates]
        scores = [u.scores for u in updates] if self.wants_client_scores else None
        options = dict(self.fusion_options)
        if options.get("head_weights") and "class_counts" not in options:
            # class-count head weighting (NI spec §2.3b) uses the class counts the clients report
            missing = [u.node_id for u in updates if u.class_counts is None]
            if missing:
                raise MissingInputError(f"fusion option head_weights needs 'class-counts' in every client's "
                                        f"metrics; nodes {missing} sent none")
            options["class_counts"] = [u.class_counts for u in updates]
        if self.uses_scores and self.importance == "server" and self._accepts_option("fusion_labels"):
            options.setdefault("fusion_labels", self.fusion_labels)
        return self.fuse_fn(method, models, fusion_inputs=self.fusion_inputs, scores=scores,
                            weights=[u.num_examples for u in updates], device=self.device,
                            seed=self.seed + server_round, **options)

    def aggregate_state(self, server_round: int, updates: list[ClientUpdate]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any], float]:
        """``(new global state dict, fusion info, seconds)`` of a round: ``fuse_updates``, then the divergence
        guard (the average replaces a fused model that agrees much less with the clients' ensemble), then
        the ``refine`` steps. A guard decision is returned as ``info["guard"]`` (text)."""
        t0 = time.perf_counter()
        method = self.round_method(server_round)
        guarding = self.guard and self.fusion_inputs is not None and method != "average"
        # the client models, built once: fusion, the guard's ensemble and distillation all read them
        teachers = ([self.build_model(u.state) for u in updates]
                    if (method == self.method and method != "average") or guarding or "distill" in self.refine_steps
                    else None)
        result = self.fuse_updates(server_round, updates, models=teachers if method == self.method else None)
        model, info = result.model, dict(result.info or {})
        total = sum(u.num_examples for u in updates)
        weights = [u.num_examples / total for u in updates]
        if guarding:
            model, guard_info = self.divergence_guard(server_round, model, teachers, weights, updates)
            info.update(guard_info)
        if self.server_momentum > 0 or self.server_learning_rate != 1:
            info.update(self.server_step(model))
        if self.refine_steps:
            prior, prior_name = self.class_prior(updates)
            info["refine"] = "+".join(self.refine_steps)
            info["prior"] = prior_name
            dev = resolve_device(self.device)
            before = copy.deepcopy(model) if self.refine_check else None
            info.update(refine_model(model.to(dev), self.refine_steps, teachers=teachers, weights=weights,
                                     fusion_inputs=self.fusion_inputs, prior=prior, seed=self.seed + server_round,
                                     calibrate_min_gap=self.calibrate_min_gap, device=dev))
            model = model.cpu().eval()
            if before is not None:
                model, check = self._check_refinement(before, model, teachers, weights, updates)
                info.update(check)
            check_finite(f"{method} (refined)", model)
        return model.state_dict(), info, time.perf_counter() - t0

    def server_step(self, model: nn.Module) -> dict[str, Any]:
        """FedAvgM's step on the round's aggregate: replace ``model``'s weights ``a`` by ``x + lr·v`` with
        ``v = m·v + (a − x)``, ``x`` the global model sent this round. Returns ``{"step-norm": ||x_new − x||}``.

        The first step (no momentum yet) with ``lr = 1`` returns ``a`` itself. Integer buffers (BatchNorm
        counters) keep the aggregate's values.
        """
        if self._global is None:
            return {}
        state = model.state_dict()
        prev = {k: torch.from_numpy(_array_copy(self._global[k], state[k])) for k in state}
        floats = {k for k, v in state.items() if v.is_floating_point()}
        first = self._momentum is None or set(self._momentum) != floats
        if first:
            self._momentum = {k: torch.zeros_like(state[k], dtype=torch.float64) for k in floats}
        new, sq = {}, 0.0
        for k, a in state.items():
            if k not in floats:
                new[k] = a
                continue
            x = prev[k].to(torch.float64)
            v = self._momentum[k].mul_(self.server_momentum).add_(a.to(torch.float64) - x)
            step = v if self.server_learning_rate == 1 else self.server_learning_rate * v
            sq += float(torch.linalg.vector_norm(step)) ** 2
            new[k] = a if first and self.server_learning_rate == 1 else (x + step).to(a.dtype)
        model.load_state_dict(new)
        return {"step-norm": sq ** 0.5}

    def _check_refinement(self, before: nn.Module, after: nn.Module, teachers: list[nn.Module] | None,
                          weights: list[float], updates: list[ClientUpdate]) -> tuple[nn.Module, dict[str, Any]]:
        """``(model, info)``: the refined model, or the unrefined one when refining moved it away from the clients'
        ensemble on the fusion set (higher KL(ensemble ‖ model)); ``info["refine-kept"]`` says which."""
        if teachers is None:
            teachers = [self.build_model(u.state) for u in updates]
        x = torch.as_tensor(self.fusion_inputs).float()
        target = teacher_probs(teachers, x, weights)
        with torch.no_grad():
            kl_before, kl_after = kl_to(target, before(x)), kl_to(target, after(x))
        kept = kl_after <= kl_before
        return (after if kept else before.eval()), {"refine-kl-before": kl_before, "refine-kl-after": kl_after,
                                                     "refine-kept": int(kept)}

    def reset_server_state(self) -> None:
        """Forget the server momentum (after a fallback or a resume: the global model did not come from it)."""
        self._momentum = None

    def class_prior(self, updates: list[ClientUpdate]) -> tuple[torch.Tensor | None, str]:
        """``(prior [classes] or None = uniform, name)`` for ``calibrate`` (the ``prior`` option)."""
        counts = [u.class_counts for u in updates]
        have = all(c is not None for c in counts) and len({len(c) for c in counts}) == 1
        if self.prior == "uniform" or (self.prior == "auto" and not have):
            return None, "uniform"
        if not have:
            missing = [u.node_id for u in updates if u.class_counts is None]
            raise MissingInputError(f"prior='class-counts' needs 'class-counts' in every client's metrics; nodes "
                                    f"{missing} sent none (or lists of different lengths)")
        total = torch.tensor(counts, dtype=torch.float).sum(0)
        return total, "class-counts"

    def divergence_guard(self, server_round: int, fused: nn.Module, teachers: list[nn.Module],
                         weights: list[float], updates: list[ClientUpdate]) -> tuple[nn.Module, dict[str, Any]]:
        """``(model to use, info)``: the fused model, or the weighted average when the fused model's KL to the
        clients' ensemble on the fusion set exceeds ``guard_ratio`` × the average's + 0.05 (or is not finite)."""
        x = torch.as_tensor(self.fusion_inputs).float()
        target = teacher_probs(teachers, x, weights)
        average = self.build_model(self.weighted_average(updates))
        with torch.no_grad():
            fused_logits = fused(x)
            kl_fused = kl_to(target, fused_logits) if bool(torch.isfinite(fused_logits).all()) else float("inf")
            kl_avg = kl_to(target, average(x))
        info: dict[str, Any] = {"guard-kl-fused": kl_fused, "guard-kl-average": kl_avg}
        limit = self.guard_ratio * kl_avg + 0.05
        if not kl_fused <= limit:  # also catches NaN
            reason = (f"average: the fused model's KL to the clients' ensemble on the fusion set is {kl_fused:.4g}, "
                      f"above {self.guard_ratio:g} x the weighted average's {kl_avg:.4g} + 0.05")
            log(WARNING, "aggregate_train: round %d: divergence guard: %s; this round uses the weighted average",
                server_round, reason)
            info["guard"] = reason
            return average, info
        return fused, info

    def _fuse_with_fallback(self, server_round: int, updates: list[ClientUpdate]
                            ) -> tuple[dict[str, torch.Tensor] | None, str | None, dict[str, Any] | None]:
        """``(new global state or None, fallback text or None, fusion info)``; only ``FusionError`` falls back."""
        method = self.round_method(server_round)
        try:
            # fuse_result raises NumericalFusionError for non-finite weights; averaging validated replies is finite
            state, info, seconds = self.aggregate_state(server_round, updates)
        except FusionError as exc:
            if self.fallback == "raise":
                raise
            self.reset_server_state()  # the next global model does not come from the momentum step
            reason = f"{type(exc).__name__}: {exc}"
            if self.fallback == "average" and method != "average":
                log(WARNING, "aggregate_train: round %d: fusion %r failed (%s); fell back to weighted averaging",
                    server_round, method, reason)
                return self.weighted_average(updates), f"average: {reason}", None
            log(WARNING, "aggregate_train: round %d: fusion %r failed (%s); keeping the previous global model",
                server_round, method, reason)
            return None, f"previous: {reason}", None
        log(INFO, "aggregate_train: round %d: %s aggregated %d models in %.2fs%s", server_round,
            method + (f" + {'+'.join(self.refine_steps)}" if self.refine_steps else ""),
            len(updates), seconds, f" ({_info_line(info)})" if info else "")
        return state, None, info

    def _train_metrics(self, updates: list[ClientUpdate], ok: list[Message]) -> MetricRecord:
        if self._user_train_metrics_aggr_fn is not None:
            valid_nodes = {u.node_id for u in updates}
            contents = [m.content for m in ok if int(m.metadata.src_node_id) in valid_nodes]
            return self._user_train_metrics_aggr_fn(contents, self.weighted_by_key)
        return self._aggregate_metrics(updates)

    @staticmethod
    def _aggregate_metrics(updates: list[ClientUpdate]) -> MetricRecord:
        """Sample-weighted mean of the clients' scalar metrics (lists such as class counts are summed)."""
        total = sum(u.num_examples for u in updates)
        out: dict[str, Any] = {"num-examples": total}
        keys = sorted({k for u in updates for k in u.metrics} - {"num-examples", "partition-id"})
        for k in keys:
            vals = [(u.metrics.get(k), u.num_examples) for u in updates]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v, _ in vals):
                out[k] = float(sum(v * n for v, n in vals) / total)
            elif k == "class-counts" and all(isinstance(v, list) for v, _ in vals):
                lens = {len(v) for v, _ in vals}
                if len(lens) == 1:
                    out[k] = [int(sum(col)) for col in zip(*(v for v, _ in vals))]
        return MetricRecord(out)


def _array_copy(array, like: torch.Tensor) -> np.ndarray:
    """A writable numpy copy of a Flower ``Array`` (the fast ``.npy`` view when its header is the expected one)."""
    view = _npy_view(array, tuple(like.shape), like.detach().cpu().numpy().dtype)
    return np.array(view if view is not None else array.numpy(), copy=True)


def _short(reason: str, head: int = 150, tail: int = 350) -> str:
    """A long error reason (e.g. a Ray traceback) cut to its start and its end (where the exception is)."""
    return reason if len(reason) <= head + tail else f"{reason[:head]} ... {reason[-tail:]}"


def _info_line(info: dict[str, Any], limit: int = 6) -> str:
    """The scalar entries of a fusion info dict as ``k=v`` pairs (the log's one-line summary)."""
    parts = []
    for k, v in info.items():
        if isinstance(v, bool) or isinstance(v, (int, str)):
            parts.append(f"{k}={v}")
        elif isinstance(v, float):
            parts.append(f"{k}={v:.4g}")
        if len(parts) == limit:
            break
    return ", ".join(parts)


def state_to_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A torch state dict → ``ArrayRecord`` (CPU, contiguous)."""
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in state.items()})


__all__ = ["FusionStrategy", "ClientsDivergedError", "FALLBACKS", "state_to_record", "METHOD_SPECS"]
