"""The outcome of a train round (a mixin of ``RoundProtocol``): the fallback policy, the stop when every client
diverged, the skip below ``min_valid_replies``, and the round's history record and train metrics.

Only the fusion error family (``fedfuse.fusion.FusionError``) falls back: ``fallback="previous"`` keeps the last
global model, ``"average"`` uses the weighted average of the valid replies, ``"raise"`` fails the run; each says so
in a WARNING line. The mixin reads ``RoundProtocol``'s ``fallback``, ``min_valid_replies``, ``history``,
``weighted_by_key`` and the hooks ``round_label``, ``reset_server_state``.
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any, Callable

import torch
from flwr.app import Message, MetricRecord
from flwr.common.logger import log

from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.fusion import FusionError


class ClientsDivergedError(RuntimeError):
    """Every client of a round returned non-finite weights: local training diverged; the run stops."""


class ReplyContractError(RuntimeError):
    """Every reply of a round lacked a record or key the strategy reads (``ContractMismatch``): the ClientApps and
    the strategy disagree on the reply contract, so no round can aggregate; the run stops (also in a user's own
    ServerApp, which would otherwise end normally with the model unchanged)."""


class RoundOutcome:
    """Fallback, stop/skip and the round's record (see the module docstring)."""

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
            f" ({_info_line(info)})" if info else "")
        return state, None, info

    def round_summary(self, server_round: int) -> str:
        """The aggregation as the round's log line names it."""
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


def aggregate_metrics(updates: list[ClientUpdate]) -> MetricRecord:
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


def _info_line(info: dict[str, Any], limit: int = 6) -> str:
    """The scalar entries of an info dict as ``k=v`` pairs (the log's one-line summary)."""
    parts = []
    for k, v in info.items():
        if isinstance(v, bool) or isinstance(v, (int, str)):
            parts.append(f"{k}={v}")
        elif isinstance(v, float):
            parts.append(f"{k}={v:.4g}")
        if len(parts) == limit:
            break
    return ", ".join(parts)


__all__ = ["RoundOutcome", "ClientsDivergedError", "aggregate_metrics"]
