"""The round's record helpers (``RoundProtocol`` in ``protocol.py`` runs the round): the errors that stop a run
(every reply diverged; every reply broke the reply contract), the train metrics of the valid replies and the log
line of an aggregation's info."""

from __future__ import annotations

from typing import Any

from flwr.app import MetricRecord

from fedfuse.flower.round.replies import ClientUpdate


class ClientsDivergedError(RuntimeError):
    """Every client of a round returned non-finite weights: local training diverged; the run stops."""


class ReplyContractError(RuntimeError):
    """Every reply of a round lacked a record or key the strategy reads (``ContractMismatch``): the ClientApps and
    the strategy disagree on the reply contract, so no round can aggregate; the run stops (also in a user's own
    ServerApp, which would otherwise end normally with the model unchanged)."""



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


def info_line(info: dict[str, Any], limit: int = 6) -> str:
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


__all__ = ["ClientsDivergedError", "ReplyContractError", "aggregate_metrics", "info_line"]
