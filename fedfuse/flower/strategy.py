"""``FusionStrategy``: Flower's ``FedAvg`` with the aggregation replaced by ``fedfuse.fusion``.

It keeps FedAvg's node sampling and configuration and overrides ``aggregate_train`` fully (stock
FedAvg rejects replies carrying a second ArrayRecord, see ``specs/flower.md`` §2):

    replies → drop errors (logged) → validate each (shapes, dtypes, finite, scores) → sort by
    partition id (deterministic float sums) → fedfuse.fusion.fuse(method, ...) → finite check →
    new global ArrayRecord

Rejected replies, failures, fallbacks and timings are kept in ``self.history`` (one dict per round)
so the ServerApp can write them to the run's results.
"""

from __future__ import annotations

import random
import time
from logging import INFO, WARNING
from typing import Any, Callable, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedfuse.fusion import METHODS, fuse
from fedfuse.models import levels
from server.strategies.validation import ClientUpdate, ReplyRejected, validate_reply

FALLBACKS = ("previous", "average", "raise")


class FusionStrategy(FedAvg):
    """A Flower strategy whose aggregation is ``fedfuse.fusion.fuse(method, ...)``.

    Args:
        method: a name in ``fedfuse.fusion.METHODS`` whose result keeps the global architecture.
        model_fn: ``() -> nn.Module`` building the global architecture (needed to turn arrays into
            models and to know the fusion levels). Required except for weights-only methods.
        fusion_inputs: the server fusion set ``[B, *input_shape]`` (every round sees the same set).
        fusion_labels: optional labels ``[B]`` of the fusion set, only for server-side importance.
        fusion_options: extra keyword options for the fusion method.
        importance: ``"client"`` (scores sent by clients, validated) or ``"server"`` (computed by
            the method on the fusion set) for methods that use scores.
        fallback: when fusion raises or yields non-finite weights: ``"previous"`` keeps the last
            global model, ``"average"`` uses the weighted average of the valid replies, ``"raise"``.
        min_valid_replies: rounds with fewer valid replies are skipped (global model unchanged).
        fusion_rounds: fuse with ``method`` in rounds ``1..fusion_rounds`` only and average the replies'
            weights (FedAvg) afterwards; 0 = fuse every round. Fusion gives multi-round FL its fast
            start; once the clients share one initialisation, plain averaging keeps improving where a
            refit on the small fusion set plateaus (``simulations/README.md``, multi-round results).
        device: where fusion runs (``"auto"``: CUDA when present).
        seed: base seed; round ``r`` fuses with ``seed + r``.
        **fedavg_kwargs: FedAvg's own options (``fraction_train``, ``min_train_nodes``, …).
    """

    default_method = "average"

    def __init__(self, method: str | None = None, *, model_fn: Callable[[], nn.Module] | None = None,
                 fusion_inputs: torch.Tensor | None = None, fusion_labels: torch.Tensor | None = None,
                 fusion_options: dict[str, Any] | None = None, importance: str = "client",
                 fallback: str = "previous", min_valid_replies: int = 1, device: str = "cpu", seed: int = 0,
                 fusion_rounds: int = 0, **fedavg_kwargs):
        fedavg_kwargs.setdefault("fraction_evaluate", 0.0)  # central evaluation by default
        super().__init__(**fedavg_kwargs)
        method = method or self.default_method
        if method not in METHODS:
            raise ValueError(f"strategy: unknown fusion method {method!r}; choose one of {sorted(METHODS)}")
        fn = METHODS[method]
        if not getattr(fn, "same_architecture", True):
            raise ValueError(f"strategy: method {method!r} does not return the global architecture, so it "
                             "cannot be a round's aggregation (it is evaluated as a reference instead)")
        if fallback not in FALLBACKS:
            raise ValueError(f"strategy: fallback must be one of {FALLBACKS}, got {fallback!r}")
        if importance not in ("client", "server"):
            raise ValueError(f"strategy: importance must be 'client' or 'server', got {importance!r}")
        self.method = method
        self.model_fn = model_fn
        self.fusion_inputs = fusion_inputs
        self.fusion_labels = fusion_labels
        self.fusion_options = dict(fusion_options or {})
        self.importance = importance
        self.fallback = fallback
        self.min_valid_replies = max(1, int(min_valid_replies))
        if int(fusion_rounds) < 0:
            raise ValueError(f"strategy: fusion_rounds must be >= 0, got {fusion_rounds}")
        self.fusion_rounds = int(fusion_rounds)
        self.device = device
        self.seed = seed
        self.needs_data = bool(getattr(fn, "needs_data", True))
        self.uses_scores = bool(getattr(fn, "uses_scores", False))
        if self.needs_data and fusion_inputs is None:
            raise ValueError(f"strategy: method {method!r} needs fusion_inputs (the server fusion set)")
        if model_fn is None and self._needs_modules():
            raise ValueError(f"strategy: method {method!r} needs model_fn to rebuild client models")
        self._level_widths: dict[str, int] | None = None
        if model_fn is not None and self.uses_scores and importance == "client":
            self._level_widths = {lv.name: lv.width for lv in levels(model_fn())}
        self._global: ArrayRecord | None = None
        self.last_updates: list[ClientUpdate] = []
        self.history: list[dict[str, Any]] = []
        # rounds already done before this ``start`` (resume from a checkpoint): ``start`` counts 1..k,
        # clients, fusion seeds and ``history`` see the true round ``round_offset + 1 ..``
        self.round_offset = 0
        self._sent: set[int] = set()                   # node ids sent a train message this round
        self._sent_msgs: list[Message] = []
        self._node_partitions: dict[int, int] = {}     # node id -> partition id, learnt from replies

    # ---------------------------------------------------------------- helpers
    def _failure(self, node_id: int, reason: str, code: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"node-id": node_id, "reason": reason}
        if code is not None:
            out["code"] = code
        if node_id in self._node_partitions:
            out["partition-id"] = self._node_partitions[node_id]
        return out

    def _needs_modules(self) -> bool:
        return True

    @property
    def wants_client_scores(self) -> bool:
        return self.uses_scores and self.importance == "client"

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> fedfuse fusion: method=%s, importance=%s, fallback=%s, device=%s",
            self.method, self.importance if self.uses_scores else "unused", self.fallback, self.device)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        server_round += self.round_offset
        self._global = arrays
        config["fusion-method"] = self.round_method(server_round)
        config["need-importance"] = self.round_needs_scores(server_round)
        rng_state = random.getstate()  # FedAvg samples nodes with `random`: make it reproducible per round
        random.seed(self.seed * 1_000_003 + server_round)
        try:
            messages = list(super().configure_train(server_round, arrays, config, grid))
        finally:
            random.setstate(rng_state)
        self._sent_msgs = [m for m in messages if isinstance(m, Message)]  # the grid sets their message ids
        self._sent = {int(m.metadata.dst_node_id) for m in self._sent_msgs}
        return messages

    def _reply_node(self, msg: Message) -> int:
        """The node a reply is about: errors made by the SuperLink (e.g. node unavailable) carry the
        SuperLink's id as source, so map them back through the message they reply to."""
        by_id = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in self._sent_msgs if m.metadata.message_id}
        return by_id.get(msg.metadata.reply_to_message_id, int(msg.metadata.src_node_id))

    def _reference(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        if self.model_fn is not None:
            return {k: (tuple(v.shape), v.detach().cpu().numpy().dtype) for k, v in self.model_fn().state_dict().items()}
        if self._global is None:
            raise RuntimeError("strategy: no global model to validate replies against")
        return {k: (tuple(a.shape), a.numpy().dtype) for k, a in self._global.items()}

    def build_model(self, state: dict[str, torch.Tensor]) -> nn.Module:
        model = self.model_fn()
        model.load_state_dict(state)
        return model.eval()

    # ---------------------------------------------------------------- aggregation
    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.round_offset
        replies = list(replies)
        ok, errors = self._check_and_log_replies(replies, is_train=True, validate=False)
        record: dict[str, Any] = {"round": server_round, "method": self.round_method(server_round),
                                  "replies": len(replies),
                                  "failures": [self._failure(self._reply_node(m), _short(str(m.error.reason)),
                                                             int(m.error.code)) for m in errors],
                                  "rejected": [], "fallback": None, "skipped": None}
        for node_id in sorted(self._sent - {self._reply_node(m) for m in replies}):
            # no reply at all: the node timed out (round-timeout), disconnected or its process died
            log(WARNING, "aggregate_train: round %d: no reply from node %d (timed out or disconnected)",
                server_round, node_id)
            record["failures"].append(self._failure(node_id, "no reply within the round timeout "
                                                             "(timed out, disconnected or died)"))
        for failure in record["failures"]:
            if failure.get("code") is not None:
                log(WARNING, "aggregate_train: round %d: node %d (partition %s) failed: %s", server_round,
                    failure["node-id"], failure.get("partition-id", "?"), failure["reason"][:200])
        self._sent, self._sent_msgs = set(), []
        reference = self._reference()
        level_widths = self._level_widths if self.round_needs_scores(server_round) else None
        updates: list[ClientUpdate] = []
        for msg in ok:
            try:
                updates.append(validate_reply(msg, reference, level_widths))
            except ReplyRejected as exc:
                log(WARNING, "aggregate_train: rejected reply from node %d: %s", msg.metadata.src_node_id, exc)
                record["rejected"].append({"node-id": int(msg.metadata.src_node_id), "reason": str(exc)})
        updates.sort(key=lambda u: (u.partition_id, u.node_id))
        self._node_partitions.update({u.node_id: u.partition_id for u in updates})
        record["valid"] = len(updates)
        self.last_updates = updates
        if len(updates) < self.min_valid_replies:
            msg = (f"round {server_round} skipped: {len(updates)} valid replies, fewer than the minimum "
                   f"{self.min_valid_replies}; the global model is unchanged")
            log(WARNING, "aggregate_train: %s", msg)
            record["skipped"] = msg
            self.history.append(record)
            return None, None

        t0 = time.perf_counter()
        state, fallback = self._fuse_with_fallback(server_round, updates)
        record["fusion-seconds"] = time.perf_counter() - t0
        record["fallback"] = fallback
        self.history.append(record)
        metrics = self._aggregate_metrics(updates)
        metrics["fusion-seconds"] = record["fusion-seconds"]
        metrics["num-valid"] = len(updates)
        metrics["num-rejected"] = len(record["rejected"])
        metrics["num-failures"] = len(errors)
        if state is None:
            return None, metrics
        return state_to_record(state), metrics

    def round_method(self, server_round: int) -> str:
        """The aggregation of round ``server_round``: ``method``, or ``"average"`` after ``fusion_rounds``."""
        if self.fusion_rounds and server_round > self.fusion_rounds:
            return "average"
        return self.method

    def round_needs_scores(self, server_round: int) -> bool:
        """Whether round ``server_round``'s clients must send importance scores."""
        return self.wants_client_scores and self.round_method(server_round) == self.method

    @staticmethod
    def weighted_average(updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
        """Sample-count-weighted average of the updates' weights (FedAvg)."""
        from fedfuse.fusion.average import average_state_dicts

        w = np.array([u.num_examples for u in updates], dtype=float)
        return average_state_dicts([u.state for u in updates], list(w / w.sum()))

    def fuse_updates(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
        """Run the fusion method on validated updates; returns the new global state dict."""
        if self.round_method(server_round) != self.method:
            return self.weighted_average(updates)
        models = [self.build_model(u.state) for u in updates]
        scores = [u.scores for u in updates] if self.wants_client_scores else None
        options = dict(self.fusion_options)
        if options.get("head_weights") and "class_counts" not in options:
            # class-count head weighting (NI spec §2.3b) uses the class counts the clients report
            if any(u.class_counts is None for u in updates):
                raise ValueError("head_weights needs 'class-counts' in every client's metrics")
            options["class_counts"] = [u.class_counts for u in updates]
        if self.uses_scores and self.importance == "server":
            options.setdefault("fusion_labels", self.fusion_labels)
        fused = fuse(self.method, models, fusion_inputs=self.fusion_inputs, scores=scores,
                     weights=[u.num_examples for u in updates], device=self.device, seed=self.seed + server_round,
                     **options)
        return fused.state_dict()

    def _fuse_with_fallback(self, server_round: int,
                            updates: list[ClientUpdate]) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        try:
            state = self.fuse_updates(server_round, updates)
            bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
            if bad:
                raise FloatingPointError(f"fused model has non-finite values in {bad[:3]}")
            return state, None
        except Exception as exc:  # noqa: BLE001 - any fusion failure takes the configured fallback
            if self.fallback == "raise":
                raise
            reason = f"{type(exc).__name__}: {exc}"
            if self.fallback == "average" and self.method != "average":
                state = self.weighted_average(updates)
                log(WARNING, "aggregate_train: fusion %r failed (%s); fell back to weighted averaging",
                    self.method, reason)
                return state, f"average ({reason})"
            log(WARNING, "aggregate_train: fusion %r failed (%s); keeping the previous global model",
                self.method, reason)
            return None, f"previous ({reason})"

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


def _short(reason: str, head: int = 150, tail: int = 350) -> str:
    """A long error reason (e.g. a Ray traceback) cut to its start and its end (where the exception is)."""
    return reason if len(reason) <= head + tail else f"{reason[:head]} ... {reason[-tail:]}"


def state_to_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A torch state dict → ``ArrayRecord`` (CPU, contiguous)."""
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in state.items()})


class FlowerFedAvg(FusionStrategy):
    """Stock FedAvg aggregation (Flower's own ``aggregate_arrayrecords``) over validated replies.

    Importance records that fedfuse clients may send are ignored; bad replies are still rejected.
    """

    def __init__(self, **kwargs):
        kwargs.pop("method", None)
        super().__init__(method="average", **kwargs)
        self.method = "fedavg"
        self.needs_data = False
        self.uses_scores = False

    def _needs_modules(self) -> bool:
        return False

    def fuse_updates(self, server_round: int, updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
        from flwr.app import RecordDict
        from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

        contents = [RecordDict({"arrays": state_to_record(u.state),
                                "metrics": MetricRecord({"num-examples": u.num_examples})}) for u in updates]
        agg = aggregate_arrayrecords(contents, "num-examples")
        reference = updates[0].state
        # Flower averages every array, integer BN counters included; keep those exact like FedAvg users expect
        return {k: (torch.from_numpy(np.array(agg[k].numpy())).to(reference[k].dtype)) for k in reference}
