"""Validation of client train replies before anything reaches fusion.

A reply is rejected (never fused) when its weights do not match the global model's names, shapes or
dtypes, contain NaN/Inf, its importance scores are missing, negative, non-finite or of the wrong
length, or its ``num-examples`` is not a sane positive count. The reason is returned as text so the
strategy can log it with the node id and record it in the run's results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord

MAX_NUM_EXAMPLES = 10**9


class ReplyRejected(ValueError):
    """A client reply that must not be fused; ``str(exc)`` is the reason."""


@dataclass
class ClientUpdate:
    """One validated client reply."""

    node_id: int
    partition_id: int
    state: dict[str, torch.Tensor]
    scores: dict[str, torch.Tensor] | None
    num_examples: int
    metrics: dict[str, float | int | list]
    class_counts: list[int] | None = field(default=None)


def _record(content, key: str, kind):
    try:
        rec = content[key]
    except KeyError:
        return None
    return rec if isinstance(rec, kind) else None


def validate_reply(msg: Message, reference: dict[str, tuple[tuple[int, ...], np.dtype]],
                   level_widths: dict[str, int] | None, *, arrays_key: str = "arrays",
                   importance_key: str = "importance", metrics_key: str = "metrics") -> ClientUpdate:
    """Check one reply against the global model; return it parsed or raise ``ReplyRejected``.

    Args:
        reference: ``{name: (shape, dtype)}`` of the global model's arrays.
        level_widths: ``{level name: width}`` when importance scores are required, else ``None``.
    """
    content = msg.content
    arrays = _record(content, arrays_key, ArrayRecord)
    if arrays is None:
        raise ReplyRejected(f"no ArrayRecord {arrays_key!r} in reply")
    metrics = _record(content, metrics_key, MetricRecord)
    if metrics is None:
        raise ReplyRejected(f"no MetricRecord {metrics_key!r} in reply")

    n = metrics.get("num-examples")
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not float(n).is_integer():
        raise ReplyRejected(f"num-examples must be an integer, got {n!r}")
    if not 0 < n <= MAX_NUM_EXAMPLES:
        raise ReplyRejected(f"num-examples {n} is not in (0, {MAX_NUM_EXAMPLES}]")

    missing = [k for k in reference if k not in arrays]
    extra = [k for k in arrays if k not in reference]
    if missing or extra:
        raise ReplyRejected(f"array names differ from the global model (missing {missing[:3]}, unexpected {extra[:3]})")
    state: dict[str, torch.Tensor] = {}
    for key, (shape, dtype) in reference.items():
        a = arrays[key].numpy()
        if tuple(a.shape) != tuple(shape):
            raise ReplyRejected(f"array {key!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        if a.dtype != dtype:
            raise ReplyRejected(f"array {key!r} has dtype {a.dtype}, expected {dtype}")
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise ReplyRejected(f"array {key!r} contains NaN or Inf")
        state[key] = torch.from_numpy(np.array(a, copy=True))

    scores = None
    if level_widths is not None:
        imp = _record(content, importance_key, ArrayRecord)
        if imp is None:
            raise ReplyRejected(f"importance scores required but no ArrayRecord {importance_key!r} in reply")
        scores = {}
        for name, width in level_widths.items():
            if name not in imp:
                raise ReplyRejected(f"importance scores missing level {name!r}")
            s = np.asarray(imp[name].numpy(), dtype=np.float64).reshape(-1)
            if s.shape[0] != width:
                raise ReplyRejected(f"importance of level {name!r} has {s.shape[0]} scores, expected {width}")
            if not np.isfinite(s).all():
                raise ReplyRejected(f"importance of level {name!r} contains NaN or Inf")
            if (s < 0).any():
                raise ReplyRejected(f"importance of level {name!r} has negative scores")
            scores[name] = torch.from_numpy(s).float()

    pid = metrics.get("partition-id", -1)
    counts = metrics.get("class-counts")
    return ClientUpdate(node_id=int(msg.metadata.src_node_id), partition_id=int(pid) if isinstance(pid, (int, float)) else -1,
                        state=state, scores=scores, num_examples=int(n), metrics=dict(metrics),
                        class_counts=[int(c) for c in counts] if isinstance(counts, list) else None)
