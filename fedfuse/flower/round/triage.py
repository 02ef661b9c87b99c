"""Reply triage of a train round (a mixin of ``RoundProtocol``): error replies and silent nodes become logged
failure records, each reply is validated against the reply contract (``fedfuse.flower.round.replies``) and the
divergence screen (``fedfuse.flower.round.divergence``: outsized weights, non-finite outputs; a rejected reply is
logged with its reason and partition id and the round goes on), and the valid ones are put in fusion order.

The mixin reads ``RoundProtocol``'s state: ``_sent_msgs``, ``_node_partitions``, ``_global``, ``update_observer``,
``reply_probe``, the record keys, and the hooks ``reply_reference``, ``update_key`` and ``warm_round``.
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Message
from flwr.common.logger import log

from fedfuse.flower.round.broadcast_guard import PROBE, non_finite_outputs
from fedfuse.flower.round.divergence import OUTSIZED, outsized_replies, record_norm, reply_norm
from fedfuse.flower.round.replies import (IMPORTANCE_KEY, METRICS_KEY, ClientUpdate, ContractMismatch, NonFiniteWeights, ReplyRejected,
                                    _metric_record, partition_in_reason, record_rejection, validate_reply)
from fedfuse.training import resolve_device


class ReplyTriage:
    """Split, validate and order a round's replies (see the module docstring)."""

    outsized_limit: float = OUTSIZED   # the divergence screen's rule 1 (0 = off); ``fedfuse.flower.round.divergence``
    reply_probe: torch.Tensor | None = None   # its rule 2's inputs (the broadcast guard's; default: the fusion inputs)
    _outsized: dict[int, dict[str, Any]] = {}

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
                                    weight_key=self.weighted_by_key, copy=copy)
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


__all__ = ["ReplyTriage", "failure_record", "reply_node"]
