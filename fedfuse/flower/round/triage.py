"""Reply triage of a train round (a mixin of ``RoundProtocol``): error replies and silent nodes become logged
failure records, each reply is validated against the reply contract (``fedfuse.flower.round.replies``; a rejected reply
is logged with its reason and the round goes on), and the valid ones are put in fusion order.

The mixin reads ``RoundProtocol``'s state: ``_sent_msgs``, ``_node_partitions``, ``update_observer``, the record
keys, and the hooks ``reply_reference``, ``update_key`` and ``warm_round``.
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

from flwr.app import Message
from flwr.common.logger import log

from fedfuse.flower.round.replies import (IMPORTANCE_KEY, METRICS_KEY, ClientUpdate, ContractMismatch, NonFiniteWeights, ReplyRejected,
                                    record_rejection, validate_reply)


class ReplyTriage:
    """Split, validate and order a round's replies (see the module docstring)."""

    def _failure(self, node_id: int, reason: str, code: int | None = None) -> dict[str, Any]:
        return failure_record(node_id, reason, code, self._node_partitions.get(node_id))

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
        return ok, failures

    def check_reply(self, server_round: int, msg: Message, record: dict[str, Any], *, level_widths: bool = True,
                    copy: bool = True) -> ClientUpdate | None:
        """One reply validated against ``reply_reference``, or ``None`` (rejected: logged and recorded)."""
        node = int(msg.metadata.src_node_id)
        if self.warm_round(server_round) and not self.warm_start.depth_tiers:   # depth tiers: per node, as always
            reference, widths = self._reference(), self.warm_start.level_widths(self._model_template)
        else:
            reference, widths = self.reply_reference(server_round, node)
        try:
            return validate_reply(msg, reference, widths if level_widths else None, arrays_key=self.arrayrecord_key,
                                  metrics_key=METRICS_KEY, importance_key=IMPORTANCE_KEY,
                                  weight_key=self.weighted_by_key, copy=copy)
        except ReplyRejected as exc:
            flags = {"non-finite-weights": True} if isinstance(exc, NonFiniteWeights) else {}
            if isinstance(exc, ContractMismatch):
                flags["contract"] = True
            record_rejection(record, server_round, node, str(exc), **self.rejected_extra(node), **flags)
            return None

    def rejected_extra(self, node_id: int) -> dict[str, Any]:
        """Extra fields of a rejected-reply record (capacity tiers add the node's tier)."""
        return {}

    def validate_replies(self, server_round: int, ok: list[Message], record: dict[str, Any]) -> list[ClientUpdate]:
        """The valid replies in fusion order (``update_key``), each handed to ``update_observer``."""
        updates = [u for u in (self.check_reply(server_round, m, record) for m in ok) if u is not None]
        updates.sort(key=self.update_key)
        self._node_partitions.update({u.node_id: u.partition_id for u in updates})
        if self.update_observer is not None:
            for u in updates:
                self.update_observer(u)
        return updates


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
