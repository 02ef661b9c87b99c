"""``RoundProtocol``: the round of every fedfuse strategy, whatever aggregates it — the way a reply travels, in this
one file.

Flower's ``FedAvg`` with its node sampling (made reproducible per round) and message construction; the rest of a
train round is fedfuse's, once for every strategy. A reply travels:

    configure_train: round config (``round_config``), sampling (``sample``), per-node messages
    aggregate_train(replies):
      1. triage (``_split_replies``): error replies and silent nodes become logged failure records; the divergence
         screen's rule 1 sizes up every reply's norm (``_size_up``)
      2. a warm start's round 1 goes to ``fedfuse.flower.aggregators.warm_start`` (the clients' own models)
      3. a streamed round (``streaming_round``: a plain weighted average) is one pass over the replies
         (``aggregate_streamed`` → ``stream_average``: validate, cap, accumulate, drop) → ``_finish_stream`` (the
         aggregator's steps on the average) under the fallback policy
      4. otherwise each reply is validated (``check_reply``: the reply contract of ``fedfuse.flower.round.replies``
         against ``reply_reference``, then the divergence screen: outsized weights, non-finite outputs; a rejected
         reply is logged with its reason and the round goes on with the others) and sorted (``update_key``:
         partition id, deterministic float sums); sample counts capped (``cap_weights``)
      5. stop when every reply diverged or broke the contract, skip below ``min_valid_replies`` (``_stop_or_skip``)
      6. the robust screen (``screen_updates``), the update observer (``observe``)
      7. ``aggregate(updates)`` — what the strategy aggregates with and its steps — under the fallback policy
         (``with_fallback``)
      8. the round's history record and train metrics (``_close_round``) → new global ArrayRecord

What aggregates is either held or supplied. A strategy that fuses holds a ``FusionAggregator``
(``fedfuse.flower.aggregators.fusion_strategy``: the fusion method and its steps, guard → momentum → refine →
static BN) as ``aggregator``; the hooks below then defer to it (``aggregate``, the round's label and its score and
class-count and statistics requests, the score check, the streamed round's steps, the fallback's reset) and the
strategy answers for the aggregator's settings (``strategy.momentum_step`` is ``strategy.aggregator.momentum_step``).
Otherwise a subclass supplies ``aggregate`` (FedAvg, Flower's baselines). Either way a subclass may refine the hooks
``round_config`` (keys added to the train config), ``sample`` (node sampling and messages), ``reply_reference`` (the
shapes a reply must have), ``statistics_reference`` (the statistics it must carry), ``update_key`` (fusion order),
``average`` (what the ``"average"`` fallback uses), ``streaming_round`` / ``_finish_stream`` (a streamed round and its
steps) and ``on_fallback`` (server state a fallback invalidates).

Only the fusion error family (``fedfuse.fusion.FusionError``) falls back: ``fallback="previous"`` keeps
the last global model, ``"average"`` uses the weighted average of the valid replies, ``"raise"`` fails
the run; each says so in a WARNING line with the round and the reason. Any other exception is a bug and
fails the run.
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

from fedfuse.fusion import FusionError
from fedfuse.fusion.average import average_state_dicts
from fedfuse.fusion.stack import model_for_state
from fedfuse.flower.trust.screen import count_limit
from fedfuse.flower.round.replies import WEIGHT_KEY
from fedfuse.flower.round.divergence import PROBE, non_finite_outputs
from fedfuse.flower.round.divergence import OUTSIZED, outsized_replies, record_norm, reply_norm
from fedfuse.flower.round.replies import ClientsDivergedError, ReplyContractError, aggregate_metrics, info_line
from fedfuse.flower.round.replies import (IMPORTANCE_KEY, MAX_NUM_EXAMPLES, METRICS_KEY, ClientUpdate,
                                          ContractMismatch, NonFiniteWeights, ReplyRejected, _metric_record, _npy_view,
                                          partition_in_reason, record_rejection, state_to_record, validate_reply)
from fedfuse.flower.head.head_step import HeadPlan
from fedfuse.flower.round.options import WEIGHT_CAP, ProtocolOptions, refuse_unknown, take_options
from fedfuse.training import resolve_device
from fedfuse.flower.aggregators.warm_start import WarmStart, warm_start_round


MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]
Reference = dict[str, tuple[tuple[int, ...], np.dtype]]


class RoundProtocol(FedAvg):
    """Sampling, per-node messages and the train round (see the module docstring): reply triage and validation, the
    streamed round, the fallback policy and the round's record, all here.

    Args:
        model_fn: ``() -> nn.Module`` building the global architecture (optional for strategies that
            aggregate arrays: replies are then checked against the global ArrayRecord sent).
        fusion_inputs: the server fusion set ``[B, *input_shape]`` (unlabeled; every round sees it).
        fusion_labels: optional labels ``[B]`` of the fusion set (server-side importance only).
        fallback: ``"previous"`` | ``"average"`` | ``"raise"`` when aggregation raises a ``FusionError``.
        min_valid_replies: rounds with fewer valid replies are skipped (global model unchanged).
        device: where the server computes (``"auto"``: CUDA when present).
        seed: base seed; round ``r`` samples nodes and fuses with seeds derived from ``seed`` and ``r``.
        weight_cap: a reply's sample count is clipped to ``weight_cap`` × the median count of the round's valid
            replies (with at least 3 of them), so that one client claiming ``num-examples`` × 100 (a free rider)
            cannot take over the average or the fusion; 0 = no cap. The default 10 leaves every honest split measured
            untouched (docs/trust.md, "What the server bounds"); clipped replies are recorded in the round's
            ``capped``.
        screen: the robust setting (``fedfuse.flower.trust.screen.ClientScreen``): free riders and models that disagree
            with the clients' majority on the fusion set are dropped, updates bounded in norm, before aggregation;
            recorded in the round's ``screened``. ``None`` (default): every valid reply is aggregated.
        Flower ``FedAvg``'s options keep their meaning (``fraction_evaluate`` defaults to 0: fedfuse evaluates
            centrally; without ``train_metrics_aggr_fn`` scalar metrics are sample-weighted means and
            ``class-counts`` lists are summed).
    """

    outsized_limit: float = OUTSIZED   # the divergence screen's rule 1 (0 = off); ``fedfuse.flower.round.divergence``
    reply_probe: torch.Tensor | None = None   # its rule 2's inputs (the broadcast guard's; default: the fusion inputs)
    _outsized: dict[int, dict[str, Any]] = {}
    aggregator: Any = None   # the held ``FusionAggregator`` (see the module docstring), else ``None``

    def __init__(self, *, model_fn: Callable[[], nn.Module] | None = None,
                 fusion_inputs: torch.Tensor | None = None, fusion_labels: torch.Tensor | None = None,
                 device: str = "cpu", seed: int = 0, protocol: ProtocolOptions | None = None, **options: Any) -> None:
        protocol = take_options(ProtocolOptions, protocol, options)   # flat keywords (``fraction_train=...``)
        refuse_unknown(type(self), options)
        super().__init__(**protocol.flower())
        self.fallback = protocol.fallback
        self.min_valid_replies = protocol.min_valid_replies
        self.weight_cap = protocol.weight_cap
        self.screen = protocol.screen
        # the robust setting reaches the clients' answers to queries too (auto's vote, the head round)
        self.robust_answers = bool(protocol.robust_answers) or protocol.screen is not None
        self._user_train_metrics_aggr_fn = protocol.train_metrics_aggr_fn
        self.model_fn = model_fn
        self.fusion_inputs = fusion_inputs
        self.fusion_labels = fusion_labels
        self.device = device
        self.seed = seed
        self._global: ArrayRecord | None = None
        self._template: nn.Module | None = None   # model_fn() once: build_model copies it (no re-initialisation)
        self._reference_cache: Reference | None = None
        self.history: list[dict[str, Any]] = []
        self.last_updates: list[ClientUpdate] = []
        # keep_updates: keep every round's validated replies in ``last_updates``; update_observer: called with
        # every validated reply of a round (e.g. the ServerApp's per-client test reference)
        self.keep_updates = False
        self.update_observer: Callable[[ClientUpdate], None] | None = None
        # rounds already done before this ``start`` (resume): clients, seeds and ``history`` see the true round
        self.round_offset = 0
        self._probe: nn.Module | None = None   # the streamed ensemble's forward passes
        self._sent_msgs: list[Message] = []
        self._node_partitions: dict[int, int] = {}     # node id -> partition id, learnt from replies
        # mode='warm-start' (``fedfuse.flower.aggregators.warm_start.WarmStart``): round 1 combines the clients' own models
        self.warm_start: WarmStart | None = None

    def __getattr__(self, name: str) -> Any:
        """A name this strategy does not define is its held aggregator's (``momentum_step``, ``refinement``,
        ``fusion_options``, ``post_steps``, ...): one object owns each setting."""
        aggregator = self.__dict__.get("aggregator")
        if aggregator is None or name.startswith("__") or not hasattr(aggregator, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(aggregator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting one of the held aggregator's settings (``strategy.guard = False``, ``strategy.fuse_fn = f``) sets
        it there, where the aggregation reads it; every other name is the strategy's own."""
        aggregator = self.__dict__.get("aggregator")
        if (aggregator is not None and name not in self.__dict__ and not hasattr(type(self), name)
                and hasattr(aggregator, name)):
            setattr(aggregator, name, value)
        else:
            super().__setattr__(name, value)

    # ---------------------------------------------------------------- what the held aggregator asks of the clients
    @property
    def refine_steps(self) -> tuple[str, ...]:
        """The refine steps after the aggregation (``()``: none)."""
        return () if self.aggregator is None else self.aggregator.refine_steps

    @property
    def wants_class_counts(self) -> bool:
        """Whether the clients must send their per-class counts (the held aggregator's steps read them)."""
        return self.aggregator is not None and self.aggregator.wants_class_counts

    @property
    def wants_client_scores(self) -> bool:
        """Whether the clients must send importance scores (the held aggregator's method reads them)."""
        return self.aggregator is not None and self.aggregator.reads_client_scores

    def round_needs_scores(self, server_round: int) -> bool:
        """Whether round ``server_round``'s replies carry importance scores."""
        return self.aggregator is not None and self.aggregator.round_needs_scores(server_round)

    # ---------------------------------------------------------------- hooks
    def round_config(self, server_round: int) -> dict[str, Any]:
        """Keys added to round ``server_round``'s train config (the ClientApps read them): the round's aggregation
        and whether the clients must send importance scores and class counts."""
        config = {"fusion-method": self.round_label(server_round),
                  "need-importance": self.round_needs_scores(server_round),
                  "need-class-counts": self.wants_class_counts}
        if self.aggregator is not None:   # the method's own requests (the clients' statistics)
            config.update(self.aggregator.round_config(server_round))
        return config

    def round_label(self, server_round: int) -> str:
        """The round's aggregation, as recorded in ``history`` and logged."""
        if self.aggregator is not None:
            return self.aggregator.round_method(server_round)
        return getattr(self, "method", type(self).__name__)

    def sample(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        """Flower ``FedAvg``'s node sampling and train messages (one per sampled node)."""
        return list(super().configure_train(server_round, arrays, config, grid))

    def reply_reference(self, server_round: int, node_id: int) -> tuple[Reference, dict[str, int] | None]:
        """``(array names -> (shape, dtype), level widths or None)`` that node ``node_id``'s reply must match."""
        return self._reference(), (self.aggregator.level_widths if self.round_needs_scores(server_round) else None)

    def statistics_reference(self, server_round: int) -> dict[str, tuple[int, ...]] | None:
        """``{name: shape}`` of the statistics round ``server_round``'s replies must carry (``None``: none; a fusion
        method that reads the clients' statistics says which)."""
        return None if self.aggregator is None else self.aggregator.statistics_reference(server_round)

    def update_key(self, update: ClientUpdate) -> tuple:
        """The fusion order of the valid replies (partition id: deterministic float sums)."""
        return update.partition_id, update.node_id

    def aggregate(self, server_round: int, updates: list[ClientUpdate]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any], float]:
        """``(new global state dict, info, seconds)``; raises ``FusionError`` for a failure the round may fall back
        from. The held aggregator's, else the subclass's."""
        if self.aggregator is None:
            raise NotImplementedError
        return self.aggregator.aggregate(server_round, updates)

    def average(self, updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
        """Sample-count-weighted average of the updates' weights (FedAvg; the ``"average"`` fallback)."""
        w = np.array([u.num_examples for u in updates], dtype=float)
        return average_state_dicts([u.state for u in updates], list(w / w.sum()))

    weighted_average = average   # the name strategies and tests use

    def head_plan(self, model: nn.Module, final_round: int, one_shot: bool) -> HeadPlan:
        """What the head round after the last round solves (``fedfuse.flower.head.head_step``): the global model's
        classifier(s), one check. A strategy with other models to solve (width tiers, depth tiers' exits) says so."""
        return HeadPlan({1.0: model})

    def narrower_tier_models(self, server_round: int) -> dict[float, nn.Module]:
        """Every narrower width tier's model as round ``server_round`` would send it (``{}``: one architecture)."""
        return {}

    def evaluate_tiers(self, server_round: int, x: torch.Tensor, y: torch.Tensor, device) -> dict[str, Any]:
        """The results row's per-tier entries (``tier-accuracy``, ...); ``{}``: one architecture."""
        return {}

    def adopt_head(self, models: dict[float, nn.Module]) -> None:
        """After the head round: the models it kept (``{tier: model}``, the global one at tier 1). The run evaluates
        the global one; a strategy whose evaluation reads its own state takes them here."""

    def on_fallback(self) -> None:
        """Forget server state the fallen-back round did not produce (e.g. momentum)."""
        if self.aggregator is not None:
            self.aggregator.on_fallback()

    def summary(self) -> None:
        super().summary()
        if self.aggregator is not None:
            self.aggregator.summary()

    def reset_server_state(self) -> None:
        self.on_fallback()

    def restart_server_state(self) -> None:
        """Forget the server step's state because the global model restarts from a model it did not produce (a warm
        start's fused model), silently (``on_fallback`` by default; Flower's baselines reset without the fallback's
        WARNING)."""
        self.on_fallback()

    # ---------------------------------------------------------------- models
    def _model_template(self) -> nn.Module:
        if self._template is None:
            self._template = self.model_fn()
        return self._template

    def build_model(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """A model of the global architecture holding ``state`` (a copy of one ``model_fn()`` instance; a ``Stacked``
        of copies when ``state`` is a one-shot ``stack`` global model's: ``model_for_state``)."""
        return model_for_state(lambda: copy.deepcopy(self._model_template()), state).eval()

    def _reference(self) -> Reference:
        if self.model_fn is not None:
            if self._reference_cache is None:  # the global architecture does not change between rounds
                self._reference_cache = {k: (tuple(v.shape), v.detach().cpu().numpy().dtype)
                                         for k, v in self._model_template().state_dict().items()}
            return self._reference_cache
        if self._global is None:
            raise RuntimeError("strategy: no global model to validate replies against (set model_fn)")
        return {k: (tuple(a.shape), a.numpy().dtype) for k, a in self._global.items()}

    # ---------------------------------------------------------------- configure
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        server_round += self.round_offset
        self._global = arrays
        for key, value in self.round_config(server_round).items():
            config[key] = value
        config[WEIGHT_KEY] = self.weighted_by_key   # what the replies must name their sample count by
        if self.warm_round(server_round):   # the one-shot signal, the warm-start epochs: in a copy (Flower passes
            # the same train config every round, and rounds >= 2 are the run's own)
            config = ConfigRecord({**dict(config), **self.warm_start.round_config()})
        rng_state = random.getstate()  # FedAvg samples nodes with `random`: reproducible per round
        random.seed(self.seed * 1_000_003 + server_round)
        try:
            messages = self.sample(server_round, arrays, config, grid)
        finally:
            random.setstate(rng_state)
        self._sent_msgs = [m for m in messages if isinstance(m, Message)]  # the grid sets their message ids
        return messages

    # ---------------------------------------------------------------- replies
    def warm_round(self, server_round: int) -> bool:
        """Whether round ``server_round`` is a warm start's round 1 (``fedfuse.flower.aggregators.warm_start``)."""
        return self.warm_start is not None and self.warm_start.applies(server_round)

    # ---------------------------------------------------------------- aggregation
    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.round_offset
        replies = list(replies)
        ok, failures = self._split_replies(server_round, replies)
        record: dict[str, Any] = {"round": server_round, "method": self.round_label(server_round),
                                  "replies": len(replies), "failures": failures, "rejected": [],
                                  "fallback": None, "skipped": None, "fusion-info": None}
        if self.warm_round(server_round):
            return warm_start_round(self, server_round, ok, failures, record)
        streamed = self.aggregate_streamed(server_round, ok, failures, record)
        if streamed is not None:
            return streamed
        validated = self.validate_replies(server_round, ok, record)
        updates = cap_weights(validated, self.weight_cap, record)
        record["valid"] = len(updates)
        self.last_updates = updates
        if self._stop_or_skip(server_round, len(updates), record):
            self.observe(validated, updates)
            return None, None
        # after the skip rule: a liar the screen drops was a valid reply, and dropping it must not skip the round
        updates = self.screen_updates(updates, record)
        self.last_updates = updates
        self.observe(validated, updates)   # the clients' ensemble and per-client columns: the replies kept
        t0 = time.perf_counter()
        average = (lambda: self.average(updates)) if self.round_label(server_round) != "average" else None
        state, fallback, info = self.with_fallback(server_round, len(updates),
                                                   lambda: self.aggregate(server_round, updates), average)
        metrics = self._close_round(record, time.perf_counter() - t0, fallback, info, updates, ok, failures)
        return (None if state is None else state_to_record(state)), metrics

    def screen_updates(self, updates: list[ClientUpdate], record: dict[str, Any]) -> list[ClientUpdate]:
        """The robust setting's screen (``screen``) of the round's valid replies against the global model sent."""
        if self.screen is None or self._global is None or not updates:
            return updates
        ref = updates[0].state
        global_state = {k: torch.from_numpy(array_copy(self._global[k], ref[k])) for k in ref}
        return self.screen(updates, global_state, self.build_model,
                           self.fusion_inputs if self.model_fn is not None else None, record,
                           device=resolve_device(self.device))

    # ---------------------------------------------------------------- triage: split, size up, validate, order
    def _failure(self, node_id: int, reason: str, code: int | None = None) -> dict[str, Any]:
        partition = self._node_partitions.get(node_id)
        if partition is None:   # a node that failed before any valid reply: its error names its partition
            partition = partition_in_reason(reason)
            if partition is not None:
                self._node_partitions[node_id] = partition
        return failure_record(node_id, reason, code, partition)

    def _reply_node(self, msg: Message) -> int:
        return reply_node(msg, self._sent_msgs)

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
            log(WARNING, "aggregate_train: round %d: no reply from node %d (timed out or disconnected)",
                server_round, node_id)
            failures.append(self._failure(node_id, "no reply within the round timeout "
                                                   "(timed out, disconnected or died)"))
        self._sent_msgs = []
        self._outsized = self._size_up(server_round, ok)
        return ok, failures

    def _reply_reference(self, server_round: int, node: int):
        """``(reference, level widths)`` that node ``node``'s reply must match in round ``server_round``."""
        if self.warm_round(server_round) and not self.warm_start.depth_tiers:   # depth tiers: per node, as always
            return self._reference(), self.warm_start.level_widths(self._model_template)
        return self.reply_reference(server_round, node)

    def _size_up(self, server_round: int, ok: list[Message]) -> dict[int, dict[str, Any]]:
        """The divergence screen's rule 1 over the round's replies, before any is validated: ``{node: rejection}``
        of the replies whose weights' norm is outsized (``fedfuse.flower.round.divergence.outsized_replies``)."""
        if not self.outsized_limit or len(ok) < 2:
            return {}
        norms = {}
        for m in ok:
            node = int(m.metadata.src_node_id)
            try:
                reference, _ = self._reply_reference(server_round, node)
            except (RuntimeError, KeyError, ValueError):   # validation says why
                continue
            norm = reply_norm(m, self.arrayrecord_key, reference)
            if norm is not None:
                norms[node] = norm
        sent = self._global
        global_norm = None if sent is None else record_norm(
            sent, {k: (tuple(a.shape), np.dtype(a.dtype)) for k, a in sent.items()})
        return outsized_replies(norms, global_norm, self.outsized_limit)

    def _probe_inputs(self) -> torch.Tensor | None:
        """The divergence screen's rule 2 inputs: ``reply_probe`` (the ServerApp sets the broadcast guard's), else the
        first ``PROBE`` fusion inputs of a strategy that builds models, else none (rule 2 off)."""
        if self.reply_probe is not None:
            return self.reply_probe
        if self.fusion_inputs is not None and self.model_fn is not None:
            return self.fusion_inputs[:PROBE]
        return None

    def diverging(self, server_round: int, update: ClientUpdate) -> dict[str, Any] | None:
        """The divergence screen (``fedfuse.flower.round.divergence``) on a reply that passed the reply contract: its
        rejection fields (``reason``, a flag) when it must be dropped, else ``None``."""
        outsized = self._outsized.get(update.node_id)
        if outsized is not None:
            return {**outsized, "outsized-weights": True}
        probe = self._probe_inputs()
        if probe is None or len(probe) == 0:
            return None
        try:
            model = self.build_model(update.state)
        except (RuntimeError, ValueError, KeyError, TypeError):   # not the global architecture (a narrower tier)
            return None
        why = non_finite_outputs(model, probe, resolve_device(self.device))
        if why is None:
            return None
        return {"reason": f"its model has {why}: the global model would too", "non-finite-outputs": True}

    def check_reply(self, server_round: int, msg: Message, record: dict[str, Any], *, level_widths: bool = True,
                    copy: bool = True) -> ClientUpdate | None:
        """One reply validated against ``reply_reference``, or ``None`` (rejected: logged and recorded)."""
        node = int(msg.metadata.src_node_id)
        reference, widths = self._reply_reference(server_round, node)
        try:
            update = validate_reply(msg, reference, widths if level_widths else None, arrays_key=self.arrayrecord_key,
                                    metrics_key=METRICS_KEY, importance_key=IMPORTANCE_KEY,
                                    weight_key=self.weighted_by_key, copy=copy,
                                    statistics=self.statistics_reference(server_round))
        except ReplyRejected as exc:
            flags = {"non-finite-weights": True} if isinstance(exc, NonFiniteWeights) else {}
            if isinstance(exc, ContractMismatch):
                flags["contract"] = True
            record_rejection(record, server_round, node, str(exc), **self._where(msg, node), **flags)
            return None
        diverging = self.diverging(server_round, update)
        if diverging is None:
            return update
        reason = diverging.pop("reason")
        record_rejection(record, server_round, node, reason, **self._where(msg, node), **diverging)
        return None

    def _where(self, msg: Message, node: int) -> dict[str, Any]:
        """A rejected reply's record fields besides its reason: its partition id (from its metrics, else learnt in an
        earlier round) and ``rejected_extra``."""
        metrics = _metric_record(msg.content, METRICS_KEY)
        pid = metrics.get("partition-id") if metrics is not None else None
        if isinstance(pid, bool) or not isinstance(pid, (int, float)) or not float(pid).is_integer():
            pid = self._node_partitions.get(node)
        return {**({"partition-id": int(pid)} if pid is not None else {}), **self.rejected_extra(node)}

    def rejected_extra(self, node_id: int) -> dict[str, Any]:
        """Extra fields of a rejected-reply record (capacity tiers add the node's tier)."""
        return {}

    def validate_replies(self, server_round: int, ok: list[Message], record: dict[str, Any]) -> list[ClientUpdate]:
        """The valid replies in fusion order (``update_key``); ``observe`` hands those the round keeps to
        ``update_observer``."""
        updates = [u for u in (self.check_reply(server_round, m, record) for m in ok) if u is not None]
        updates.sort(key=self.update_key)
        self._node_partitions.update({u.node_id: u.partition_id for u in updates})
        if self.aggregator is not None:   # less the replies whose scores disagree with their weights
            updates = self.aggregator.check_scores(server_round, updates, record)
        return updates

    def observe(self, validated: list[ClientUpdate], kept: list[ClientUpdate]) -> None:
        """Hand each ``validated`` reply the round kept (its node among ``kept``'s, after the later screens: the score
        check, the robust screen) to ``update_observer``, as the client sent it (not as a screen shrank it), in
        fusion order: the clients' ensemble and per-client columns leave the dropped replies out."""
        if self.update_observer is None:
            return
        nodes = {u.node_id for u in kept}
        for u in validated:
            if u.node_id in nodes:
                self.update_observer(u)

    # ---------------------------------------------------------------- a streamed round (one pass over the replies)
    def streaming_round(self, server_round: int) -> bool:
        """Whether round ``server_round`` is a plain weighted average run as a stream over the replies (the held
        aggregator says when; ``FedAvgStrategy`` too; none otherwise)."""
        return self.aggregator is not None and self.aggregator.streams(server_round)

    def aggregate_streamed(self, server_round: int, ok: list[Message], failures: list[dict],
                           record: dict[str, Any]) -> tuple[ArrayRecord | None, MetricRecord | None] | None:
        if not self.streaming_round(server_round):
            return None
        t_start = time.perf_counter()
        ensemble = self.stream_checks_calibration()
        streamed = stream_average(self, server_round, ok, record, keep_members=ensemble)
        record["valid"] = len(streamed.metrics_only)
        self.last_updates = []
        if self._stop_or_skip(server_round, len(streamed.metrics_only), record):
            return None, None
        t0 = time.perf_counter()
        reference = self._reference()

        def probs() -> torch.Tensor:
            return self._stream_ensemble(streamed.members, reference)

        state, fallback, info = self.with_fallback(
            server_round, len(streamed.metrics_only),
            lambda: self._finish_stream(server_round, streamed.average, probs if ensemble else None, streamed.metrics_only),
            lambda: streamed.average, streamed=True)
        seconds = time.perf_counter() - t0 + (t0 - t_start - streamed.observer_seconds)
        metrics = self._close_round(record, seconds, fallback, info, streamed.metrics_only, ok, failures)
        return (None if state is None else state_to_record(state)), metrics

    def stream_checks_calibration(self) -> bool:
        """Whether the streamed round keeps its members to check a ``calibrate`` step against their ensemble."""
        return self.aggregator is not None and self.aggregator.stream_checks_calibration()

    def _stream_ensemble(self, members: list[tuple[Message, float]], reference) -> torch.Tensor:
        """The clients' ensemble on the fusion set, re-read from the round's valid replies (``stream_ensemble``)."""
        if self._probe is None:
            self._probe = self.model_fn().eval()
        return stream_ensemble(self._probe, members, reference, self.arrayrecord_key, self.fusion_inputs)

    def _finish_stream(self, server_round: int, average: dict[str, torch.Tensor],
                       probs: Callable[[], torch.Tensor] | None, updates: list[ClientUpdate]):
        """``(state, info, seconds)`` of a streamed round from its average: the held aggregator's server step and
        refinement on it, else the average itself (no model built, no step)."""
        if self.aggregator is not None:
            return self.aggregator.finish_stream(server_round, average, probs, updates)
        return average, {}, 0.0

    # ---------------------------------------------------------------- outcome: fallback, stop/skip, the round's record
    def with_fallback(self, server_round: int, num_models: int,
                      run: Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any], float]],
                      average: Callable[[], dict[str, torch.Tensor]] | None, streamed: bool = False,
                      label: str | None = None
                      ) -> tuple[dict[str, torch.Tensor] | None, str | None, dict[str, Any] | None]:
        """``(new global state or None, fallback text or None, info)``: ``run()``, and on a ``FusionError`` the
        fallback policy (``average`` is the weighted average of the round, ``None`` where the round's aggregation
        is that average already). The one place a round falls back. ``label``: the aggregation as logged (default
        ``round_summary``)."""
        summary = label or self.round_summary(server_round)
        label = label or self.round_label(server_round)
        try:
            state, info, seconds = run()
        except FusionError as exc:
            if self.fallback == "raise":
                raise
            self.reset_server_state()  # the next global model does not come from the server step
            reason = f"{type(exc).__name__}: {exc}"
            if self.fallback == "average" and average is not None:
                log(WARNING, "aggregate_train: round %d: fusion %r failed (%s); fell back to weighted averaging",
                    server_round, label, reason)
                return average(), f"average: {reason}", None
            log(WARNING, "aggregate_train: round %d: fusion %r failed (%s); keeping the previous global model",
                server_round, label, reason)
            return None, f"previous: {reason}", None
        log(INFO, "aggregate_train: round %d: %s aggregated %d models in %.2fs%s%s", server_round,
            summary, num_models, seconds, " (streamed)" if streamed else "",
            f" ({info_line(info)})" if info else "")
        if info and info.get("collapse-warning"):   # finite, but one class for (almost) every input: on the log too
            log(WARNING, "aggregate_train: round %d: %s", server_round, info["collapse-warning"])
        return state, None, info

    def round_summary(self, server_round: int) -> str:
        """The aggregation as the round's log line names it."""
        if self.aggregator is not None:
            return self.aggregator.round_summary(server_round)
        return self.round_label(server_round)

    def _stop_or_skip(self, server_round: int, valid: int, record: dict[str, Any]) -> bool:
        """Every reply non-finite → ``ClientsDivergedError``; every reply missing a record or key the strategy reads →
        ``ReplyContractError``; fewer than ``min_valid_replies`` → the round is skipped (logged, recorded; returns
        True)."""
        # a round whose every reply was rejected for one run-stopping reason: no later round can differ
        for flags, what, error in ((("non-finite-weights", "non-finite-outputs"),
                                    "every client returned non-finite weights or a model with non-finite outputs",
                                    self._diverged),
                                   (("contract",), "every reply broke the reply contract", self._contract_broken)):
            hits = [r for r in record["rejected"] if any(r.get(flag) for flag in flags)]
            if not valid and hits and len(hits) == len(record["rejected"]):
                self.history.append({**record, "skipped": what})
                raise error(server_round, hits)
        if valid < self.min_valid_replies:
            reason = (f"round {server_round} skipped: {valid} valid replies, fewer than the minimum "
                      f"{self.min_valid_replies}; the global model is unchanged")
            log(WARNING, "aggregate_train: %s", reason)
            record["skipped"] = reason
            self.history.append(record)
            return True
        return False

    def _diverged(self, server_round: int, hits: list[dict[str, Any]]) -> ClientsDivergedError:
        what = ("non-finite weights" if all(h.get("non-finite-weights") for h in hits)
                else "non-finite weights or a model with non-finite outputs")
        return ClientsDivergedError(
            f"round {server_round}: every client that replied ({len(hits)}) returned {what} (e.g. node "
            f"{hits[0]['node-id']}: {hits[0]['reason']}); local training diverged, so the run stops here with the "
            "last global model. Lower the clients' 'lr' or use another 'optimizer'.")

    def _contract_broken(self, server_round: int, hits: list[dict[str, Any]]) -> ReplyContractError:
        return ReplyContractError(
            f"round {server_round}: every reply ({len(hits)}) was rejected for a missing record or key (e.g. node "
            f"{hits[0]['node-id']}: {hits[0]['reason']}); the strategy reads arrays from {self.arrayrecord_key!r} "
            f"and the sample count from metrics {self.weighted_by_key!r}: make the ClientApp reply with these keys "
            f"(the train message's config names them) or build the strategy with the ClientApp's keys")

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

    def _train_metrics(self, updates: list[ClientUpdate], ok: list[Message]) -> MetricRecord:
        if self._user_train_metrics_aggr_fn is not None:
            valid_nodes = {u.node_id for u in updates}
            contents = [m.content for m in ok if int(m.metadata.src_node_id) in valid_nodes]
            return self._user_train_metrics_aggr_fn(contents, self.weighted_by_key)
        return aggregate_metrics(updates)

weight_limit = count_limit   # the train replies' name of the same bound (fedfuse.flower.trust.screen)


def cap_update(u: ClientUpdate, limit: float, cap: float, record: dict[str, Any]) -> ClientUpdate:
    """``u``, weighted as at most ``limit`` samples; a clipped reply is listed in ``record["capped"]`` (node,
    claimed, used) and logged."""
    if u.num_examples <= limit:
        return u
    used = max(1, int(limit))
    record.setdefault("capped", []).append({"node-id": u.node_id, "claimed": u.num_examples, "used": used})
    log(WARNING, "aggregate_train: node %d claims %d samples, more than %g × the round's median: weighted as %d",
        u.node_id, u.num_examples, cap, used)
    return dataclasses.replace(u, num_examples=used)


def cap_weights(updates: list[ClientUpdate], cap: float, record: dict[str, Any]) -> list[ClientUpdate]:
    """``updates`` with each sample count clipped to ``weight_limit`` of theirs (``cap_update``)."""
    limit = weight_limit([u.num_examples for u in updates], cap)
    return updates if limit is None else [cap_update(u, limit, cap, record) for u in updates]


def array_copy(array, like: torch.Tensor) -> np.ndarray:
    """A writable numpy copy of a Flower ``Array`` (the fast ``.npy`` view when its header is the expected one)."""
    view = _npy_view(array, tuple(like.shape), like.detach().cpu().numpy().dtype)
    return np.array(view if view is not None else array.numpy(), copy=True)


@dataclasses.dataclass
class StreamedRound:
    """The outcome of one streamed pass: the average (``None`` without valid replies), the valid replies' metrics
    (``metrics_only``: no arrays), the members of the clients' ensemble and the seconds spent in the update observer."""

    average: dict[str, torch.Tensor] | None
    metrics_only: list[ClientUpdate]
    members: list[tuple[Message, float]]
    observer_seconds: float


def fusion_order(ok: list[Message], weight_key: str) -> tuple[list[Message], list[float]]:
    """The replies sorted by (partition id, node id) from their metrics alone, and their plausible sample counts
    (the weights' denominator and the weight cap's median)."""
    keyed = []
    for msg in ok:
        metrics = _metric_record(msg.content, METRICS_KEY)
        pid = metrics.get("partition-id", -1) if metrics is not None else -1
        n = metrics.get(weight_key) if metrics is not None else None
        keyed.append(((int(pid) if isinstance(pid, (int, float)) and not isinstance(pid, bool) else -1,
                       int(msg.metadata.src_node_id)), n, msg))
    keyed.sort(key=lambda t: t[0])
    plausible = [float(n) for _, n, _ in keyed
                 if isinstance(n, (int, float)) and not isinstance(n, bool) and 0 < n <= MAX_NUM_EXAMPLES]
    return [m for _, _, m in keyed], plausible


def stream_average(strategy: RoundProtocol, server_round: int, ok: list[Message], record: dict[str, Any],
                   keep_members: bool) -> StreamedRound:
    """One pass over the replies: validate (``strategy.check_reply``), accumulate, observe, drop."""
    ordered, counts = fusion_order(ok, strategy.weighted_by_key)
    limit = weight_limit(counts, strategy.weight_cap)   # the weight cap, from the metrics before any array
    total = float(np.minimum(np.array(counts, dtype=float), limit if limit is not None else np.inf).sum()) \
        if counts else 1.0
    members: list[tuple[Message, float]] = []
    acc: dict[str, torch.Tensor] | None = None
    dtypes: dict[str, torch.dtype] = {}
    metrics_only: list[ClientUpdate] = []
    valid_total, observer_seconds = 0, 0.0
    for msg in ordered:
        u = strategy.check_reply(server_round, msg, record, level_widths=False, copy=False)
        if u is None:
            continue
        if limit is not None:
            u = cap_update(u, limit, strategy.weight_cap, record)
        w = u.num_examples / total
        valid_total += u.num_examples
        if acc is None:  # integer buffers (BatchNorm counters) from the first reply, as average_state_dicts
            dtypes = {k: v.dtype for k, v in u.state.items()}
            acc = {k: (v.double().mul_(w) if v.is_floating_point() else v.clone()) for k, v in u.state.items()}
        else:
            for k, v in u.state.items():
                if v.is_floating_point():
                    acc[k].add_(v, alpha=w)   # the same float64 steps as average_state_dicts: bit-identical
        if keep_members:
            members.append((msg, w))
        strategy._node_partitions[u.node_id] = u.partition_id
        if strategy.update_observer is not None:
            t_obs = time.perf_counter()
            strategy.update_observer(u)
            observer_seconds += time.perf_counter() - t_obs
        metrics_only.append(dataclasses.replace(u, state={}, scores=None))
        del u
    if acc is None:
        return StreamedRound(None, metrics_only, members, observer_seconds)
    if valid_total != total:  # a rejected reply: renormalise over the valid ones
        scale = total / valid_total
        for v in acc.values():
            if v.is_floating_point():
                v.mul_(scale)
        members = [(m, w * scale) for m, w in members]
    return StreamedRound({k: v.to(dtypes[k]) for k, v in acc.items()}, metrics_only, members, observer_seconds)


def stream_ensemble(probe: torch.nn.Module, members: list[tuple[Message, float]], reference: Reference,
                    arrays_key: str, fusion_inputs: torch.Tensor) -> torch.Tensor:
    """The clients' ensemble on the fusion set, ``sum_i w_i softmax(f_i(x))`` (the same order and sums as
    ``teacher_probs``), re-reading the round's valid replies one at a time."""
    x = torch.as_tensor(fusion_inputs).float()
    probs = None
    with torch.no_grad():
        for msg, w in members:
            arrays = msg.content[arrays_key]
            state = {}
            for key, (shape, dtype) in reference.items():
                a = _npy_view(arrays[key], shape, dtype)
                state[key] = torch.from_numpy(np.array(a if a is not None else arrays[key].numpy(), copy=True))
            p = torch.cat([w * torch.func.functional_call(probe, state, (x[i:i + 512],)).softmax(-1)
                           for i in range(0, x.shape[0], 512)])
            probs = p if probs is None else probs + p
    return probs


def failure_record(node_id: int, reason: str, code: int | None, partition_id: int | None) -> dict[str, Any]:
    """The history record of a failed or silent node."""
    out: dict[str, Any] = {"node-id": node_id, "reason": reason}
    if code is not None:
        out["code"] = code
    if partition_id is not None:
        out["partition-id"] = partition_id
    return out


def reply_node(msg: Message, sent: list[Message]) -> int:
    """The node a reply is about: errors made by the SuperLink (e.g. node unavailable) carry the SuperLink's id as
    source, so map them back through the message they reply to."""
    by_id = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in sent if m.metadata.message_id}
    return by_id.get(msg.metadata.reply_to_message_id, int(msg.metadata.src_node_id))


def _short(reason: str, head: int = 150, tail: int = 350) -> str:
    """A long error reason (e.g. a Ray traceback) cut to its start and its end (where the exception is)."""
    return reason if len(reason) <= head + tail else f"{reason[:head]} ... {reason[-tail:]}"


__all__ = ["RoundProtocol", "ClientsDivergedError", "ReplyContractError", "WEIGHT_CAP", "weight_limit", "cap_update", "cap_weights", "aggregate_metrics", "state_to_record", "array_copy",
           "failure_record", "reply_node", "StreamedRound", "fusion_order", "stream_average", "stream_ensemble"]
