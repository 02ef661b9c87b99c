"""``RoundProtocol``: the round of every fedfuse strategy, whatever aggregates it.

Flower's ``FedAvg`` with its node sampling (made reproducible per round) and message construction; the
rest of a train round is fedfuse's, once for every strategy:

    replies → split off error replies and silent nodes (logged, recorded) → validate each reply against
    the reply contract (``fedfuse.flower.round.replies``) and the divergence screen (``divergence``: outsized
    weights, non-finite outputs; a rejected reply is logged with its reason and the round goes on with the
    others) → sort (partition id: deterministic float sums) → stop when every
    reply diverged, skip the round below ``min_valid_replies`` → ``aggregate(updates)`` under the
    fallback policy → history record + train metrics → new global ArrayRecord

A subclass supplies ``aggregate`` (what the strategy is) and may refine the hooks ``round_config`` (keys
added to the train config), ``sample`` (node sampling and messages), ``reply_reference`` (the shapes a
reply must have), ``update_key`` (fusion order), ``average`` (what the ``"average"`` fallback uses) and
``on_fallback`` (server state a fallback invalidates).

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
from logging import WARNING
from typing import Any, Callable, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedfuse.fusion.average import average_state_dicts
from fedfuse.flower.trust.answer_screen import count_limit
from fedfuse.flower.round.client_replies import WEIGHT_KEY
from fedfuse.flower.round.outcome import ClientsDivergedError, ReplyContractError, RoundOutcome, aggregate_metrics
from fedfuse.flower.round.replies import ClientUpdate, _npy_view, state_to_record
from fedfuse.flower.head.head_step import HeadPlan
from fedfuse.flower.round.options import WEIGHT_CAP, ProtocolOptions, refuse_unknown, take_options
from fedfuse.training import resolve_device
from fedfuse.flower.round.triage import ReplyTriage, failure_record, reply_node  # noqa: F401 (names of this module)
from fedfuse.flower.aggregators.warm_start import WarmStart, warm_start_round


MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]
Reference = dict[str, tuple[tuple[int, ...], np.dtype]]


class RoundProtocol(ReplyTriage, RoundOutcome, FedAvg):
    """Sampling, per-node messages and the train round (see the module docstring); reply triage and validation
    come from ``ReplyTriage`` (``fedfuse.flower.round.triage``), the fallback policy and the round's record from
    ``RoundOutcome`` (``fedfuse.flower.round.outcome``).

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

    refine_steps: tuple[str, ...] = ()   # the refine steps after the aggregation (``FusionStrategy``'s)
    wants_class_counts = False   # whether the clients must send their per-class counts (``FusionStrategy``'s)
    wants_client_scores = False   # whether the clients must send importance scores (``FusionStrategy``'s)

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
        self._sent_msgs: list[Message] = []
        self._node_partitions: dict[int, int] = {}     # node id -> partition id, learnt from replies
        # mode='warm-start' (``fedfuse.flower.aggregators.warm_start.WarmStart``): round 1 combines the clients' own models
        self.warm_start: WarmStart | None = None

    # ---------------------------------------------------------------- hooks
    def round_config(self, server_round: int) -> dict[str, Any]:
        """Keys added to round ``server_round``'s train config (the ClientApps read them): the round's aggregation
        and whether the clients must send importance scores and class counts (not by default)."""
        return {"fusion-method": self.round_label(server_round), "need-importance": False,
                "need-class-counts": False}

    def round_label(self, server_round: int) -> str:
        """The round's aggregation, as recorded in ``history`` and logged."""
        return getattr(self, "method", type(self).__name__)

    def sample(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        """Flower ``FedAvg``'s node sampling and train messages (one per sampled node)."""
        return list(super().configure_train(server_round, arrays, config, grid))

    def reply_reference(self, server_round: int, node_id: int) -> tuple[Reference, dict[str, int] | None]:
        """``(array names -> (shape, dtype), level widths or None)`` that node ``node_id``'s reply must match."""
        return self._reference(), None

    def update_key(self, update: ClientUpdate) -> tuple:
        """The fusion order of the valid replies (partition id: deterministic float sums)."""
        return update.partition_id, update.node_id

    def aggregate(self, server_round: int, updates: list[ClientUpdate]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any], float]:
        """``(new global state dict, info, seconds)``; raises ``FusionError`` for a failure the round may fall back
        from."""
        raise NotImplementedError

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
        """A model of the global architecture holding ``state`` (a copy of one ``model_fn()`` instance)."""
        model = copy.deepcopy(self._model_template())
        model.load_state_dict(state)
        return model.eval()

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

    def aggregate_streamed(self, server_round: int, ok: list[Message], failures: list[dict],
                           record: dict[str, Any]) -> tuple[ArrayRecord | None, MetricRecord | None] | None:
        """A round aggregated as a stream over the replies (``None``: this round is not; see ``streaming``)."""
        return None

    def screen_updates(self, updates: list[ClientUpdate], record: dict[str, Any]) -> list[ClientUpdate]:
        """The robust setting's screen (``screen``) of the round's valid replies against the global model sent."""
        if self.screen is None or self._global is None or not updates:
            return updates
        ref = updates[0].state
        global_state = {k: torch.from_numpy(array_copy(self._global[k], ref[k])) for k in ref}
        return self.screen(updates, global_state, self.build_model,
                           self.fusion_inputs if self.model_fn is not None else None, record,
                           device=resolve_device(self.device))


weight_limit = count_limit   # the train replies' name of the same bound (fedfuse.flower.trust.answer_screen)


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


__all__ = ["RoundProtocol", "ClientsDivergedError", "ReplyContractError", "WEIGHT_CAP", "weight_limit", "cap_update", "cap_weights", "aggregate_metrics", "state_to_record", "array_copy",
           "failure_record", "reply_node"]
