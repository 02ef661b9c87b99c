"""The reply contract of a fedfuse ``train`` round, and its validation before anything reaches fusion.

A ClientApp that works with the fedfuse strategies (``fedfuse.flower.strategies``) answers each
``train`` message with a ``Message(content=RecordDict(...), reply_to=msg)`` holding:

- ``"arrays"`` (the strategy's ``arrayrecord_key``): an ``ArrayRecord`` with the trained model's
  state dict: exactly the global model's array names, shapes and dtypes, all finite;
- ``"metrics"``: a ``MetricRecord`` with the sample count under the strategy's ``weighted_by_key``
  (default ``"num-examples"``, an integer in ``(0, 10**9]``); optional ``"partition-id"`` (int; replies
  are fused in partition-id order so float sums are deterministic), ``"class-counts"`` (list of int, one
  per class; needed by the ``head_weights`` fusion option), and any other scalar metrics (averaged,
  weighted by the sample count);
- ``"importance"``: only when the received ``ConfigRecord`` says ``need-importance = true``: an
  ``ArrayRecord`` with one non-negative, finite score vector per fusion level (``fedfuse.models.levels``
  names; length = the level's width), e.g. ``fedfuse.importance.neuron_importance`` output.

The received ``ConfigRecord`` (``"config"``) carries ``server-round``, ``fusion-method`` and
``need-importance`` plus whatever ``train_config`` the ServerApp passes (fedfuse's: ``mode``,
``local-epochs``, ``lr``).

A reply is rejected (never fused) when any of this does not hold; the reason is returned as text so
the strategy can log it with the node id and record it in the run's results.
"""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log

from fedfuse.fusion.score_check import score_inconsistency

MAX_NUM_EXAMPLES = 10**9
ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
IMPORTANCE_KEY = "importance"
NUM_EXAMPLES_KEY = "num-examples"


class ReplyRejected(ValueError):
    """A client reply that must not be fused; ``str(exc)`` is the reason."""


class ContractMismatch(ReplyRejected):
    """A reply that lacks a record or key the strategy was built to read (its ``arrayrecord_key``,
    ``weighted_by_key``, the importance record): the ClientApp and the strategy disagree on the reply contract,
    which no later round fixes."""


class NonFiniteWeights(ReplyRejected):
    """A reply whose weights contain NaN or Inf: the client's local training diverged."""


@dataclass
class ClientUpdate:
    """One validated client reply: weights ``state`` (name → tensor of the global model's shape),
    optional ``scores`` (level name → ``[width]`` tensor), the sample count and the reported metrics."""

    node_id: int
    partition_id: int
    state: dict[str, torch.Tensor]
    scores: dict[str, torch.Tensor] | None
    num_examples: int
    metrics: dict[str, float | int | list]
    class_counts: list[int] | None = field(default=None)


#: how fedfuse's ClientApp names its partition in the error a failing handler raises (``fedfuse.flower.client_app.name_partition_mod``)
PARTITION_PREFIX = "partition {pid}: "


def partition_in_reason(reason: str) -> int | None:
    """The partition id a fedfuse ClientApp's error reason starts with (``PARTITION_PREFIX``), else ``None``."""
    m = re.search(r"partition (\d+): ", reason)
    return int(m.group(1)) if m else None


def bounded_class_counts(update: ClientUpdate) -> list[float] | None:
    """The update's class counts scaled to sum to its (capped) sample count: a client's counts say how its samples
    split over the classes, its ``num_examples`` how many there are, so a client that inflates its counts gains no
    weight in the calibration prior or the head weights beyond its sample count's (docs/trust.md)."""
    c = update.class_counts
    if c is None:
        return None
    total = float(sum(c))
    return [float(v) * update.num_examples / total if total > 0 else 0.0 for v in c]


def record_rejection(record: dict[str, Any], server_round: int, node_id: int, reason: str, **fields: Any) -> None:
    """Log a rejected reply as a WARNING (with its partition id when ``fields`` has ``partition-id``) and add it to the
    round's ``record["rejected"]`` (with ``fields``)."""
    pid = fields.get("partition-id")
    log(WARNING, "aggregate_train: round %d: rejected reply from node %d%s: %s", server_round, node_id,
        f" (partition {pid})" if pid is not None else "", reason)
    record["rejected"].append({"node-id": node_id, "reason": reason, **fields})


def reject_inconsistent_scores(updates: list[ClientUpdate], build_model: Callable[[dict], torch.nn.Module],
                               fusion_inputs: torch.Tensor, record: dict[str, Any], server_round: int, *,
                               extra: Callable[[int], dict] = lambda _node: {}, max_samples: int = 512,
                               device: str | torch.device = "cpu") -> list[ClientUpdate]:
    """The updates whose importance scores agree with their own weights on (at most ``max_samples`` of) the fusion
    set (``fedfuse.fusion.score_check.score_inconsistency``); each other one is rejected (``record_rejection``, with
    ``inconsistent-scores``)."""
    inputs, kept = fusion_inputs[:max_samples], []
    for u in updates:
        problem = None if u.scores is None else score_inconsistency(build_model(u.state), u.scores, inputs,
                                                                     device=device)
        if problem is None:
            kept.append(u)
        else:
            record_rejection(record, server_round, u.node_id, problem, **{"partition-id": u.partition_id,
                                                                        "inconsistent-scores": True},
                             **extra(u.node_id))
    return kept


def _record(content, key: str, kind):
    try:
        rec = content[key]
    except KeyError:
        return None
    return rec if isinstance(rec, kind) else None


def _metric_record(content, key: str) -> MetricRecord | None:
    """The reply's ``key`` MetricRecord, or its only MetricRecord (Flower's FedAvg contract)."""
    rec = _record(content, key, MetricRecord)
    if rec is not None:
        return rec
    found = [r for r in content.values() if isinstance(r, MetricRecord)]
    return found[0] if len(found) == 1 else None


def _npy_view(array, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """A read-only view of a Flower ``Array``'s ``.npy`` bytes when its header is exactly the one ``np.save`` writes
    for ``(dtype, C order, shape)``, else ``None`` (the caller then uses ``Array.numpy()``, which parses any
    header). Skips ``np.load``'s header evaluation: most of a small reply's validation time."""
    data = array.data
    if not isinstance(data, (bytes, bytearray, memoryview)) or bytes(data[:6]) != b"\x93NUMPY":
        return None
    major = data[6]
    if major == 1:
        start, hlen = 10, int.from_bytes(data[8:10], "little")
    elif major in (2, 3):
        start, hlen = 12, int.from_bytes(data[8:12], "little")
    else:
        return None
    dtype = np.dtype(dtype)
    expected = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (dtype.str, tuple(shape))
    if bytes(data[start:start + hlen]).decode("latin1").rstrip() != expected:
        return None
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) - start - hlen != count * dtype.itemsize:
        return None
    return np.frombuffer(data, dtype=dtype, count=count, offset=start + hlen).reshape(shape)


def validate_reply(msg: Message, reference: dict[str, tuple[tuple[int, ...], np.dtype]],
                   level_widths: dict[str, int] | None, *, arrays_key: str = ARRAYS_KEY,
                   importance_key: str = IMPORTANCE_KEY, metrics_key: str = METRICS_KEY,
                   weight_key: str = NUM_EXAMPLES_KEY, copy: bool = True) -> ClientUpdate:
    """Check one reply against the global model; return it parsed or raise ``ReplyRejected``.

    Args:
        msg: a reply without error (``msg.has_error()`` is false).
        reference: ``{name: (shape, dtype)}`` of the global model's arrays.
        level_widths: ``{level name: width}`` when importance scores are required, else ``None``.
        arrays_key / metrics_key / importance_key: record names in the reply's content.
        weight_key: the metric holding the sample count (the strategy's ``weighted_by_key``).
        copy: copy every array out of the reply (``False``: the state's tensors share memory with the arrays
            deserialised from the reply, which ``Array.numpy()`` creates afresh on every call; for a caller that
            reads them once and drops them, as the streaming average does).
    """
    content = msg.content
    arrays = _record(content, arrays_key, ArrayRecord)
    if arrays is None:
        raise ContractMismatch(f"no ArrayRecord {arrays_key!r} in reply (records: {list(content.keys())})")
    metrics = _metric_record(content, metrics_key)
    if metrics is None:
        raise ContractMismatch(f"no MetricRecord {metrics_key!r} in reply")

    n = metrics.get(weight_key)
    if n is None:
        raise ContractMismatch(f"no {weight_key!r} in the reply's metrics (the strategy's weighted_by_key; the reply "
                               f"has {sorted(metrics)})")
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not float(n).is_integer():
        raise ReplyRejected(f"{weight_key} must be an integer, got {n!r}")
    if not 0 < n <= MAX_NUM_EXAMPLES:
        raise ReplyRejected(f"{weight_key} {n} is not in (0, {MAX_NUM_EXAMPLES}]")

    missing = [k for k in reference if k not in arrays]
    extra = [k for k in arrays if k not in reference]
    if missing or extra:
        raise ReplyRejected(f"array names differ from the global model (missing {missing[:3]}, unexpected {extra[:3]})")
    state: dict[str, torch.Tensor] = {}
    for key, (shape, dtype) in reference.items():
        a = _npy_view(arrays[key], shape, dtype)
        if a is None:
            a = arrays[key].numpy()
        if tuple(a.shape) != tuple(shape):
            raise ReplyRejected(f"array {key!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        if a.dtype != dtype:
            raise ReplyRejected(f"array {key!r} has dtype {a.dtype}, expected {dtype}")
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise NonFiniteWeights(f"array {key!r} contains NaN or Inf")
        state[key] = torch.from_numpy(np.array(a, copy=True) if copy or not a.flags.writeable else a)

    scores = None
    if level_widths is not None:
        imp = _record(content, importance_key, ArrayRecord)
        if imp is None:
            raise ContractMismatch(f"importance scores required but no ArrayRecord {importance_key!r} in reply")
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
    return ClientUpdate(node_id=int(msg.metadata.src_node_id),
                        partition_id=int(pid) if isinstance(pid, (int, float)) else -1,
                        state=state, scores=scores, num_examples=int(n), metrics=dict(metrics),
                        class_counts=[int(c) for c in counts] if isinstance(counts, list) else None)


def state_to_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A torch state dict → ``ArrayRecord`` (CPU, contiguous)."""
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in state.items()})
