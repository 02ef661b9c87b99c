"""The reply contract of a fedfuse ``train`` round, both sides: its validation on the server before anything reaches
fusion, and the helpers a ClientApp replies with.

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

**The client side** (the second half of this module): reply correctly from your own ClientApp in two lines. The
fedfuse strategies (``fedfuse.flower.strategies``) validate every ``train`` reply against the contract above; these
helpers build such a reply from a trained ``torch`` model, so a
user's own ClientApp does not need to know record names, level names or config flags:

    from fedfuse.flower import read_train_message, reply_to_train

    @app.train()
    def train(msg, context):
        request = read_train_message(msg)                       # global weights + what the strategy asks for
        model.load_state_dict(request.state_dict())
        ...  # train locally on (x_train, y_train)
        return reply_to_train(msg, model, num_examples=len(x_train), val_data=(x_val, y_val),
                              class_counts=counts, train_metrics={"train-loss": loss})

``reply_to_train`` follows what the strategy asked in the train config: importance scores (neuron
importance on ``val_data``, DeepLIFT by default) only when ``need-importance`` is true, the class counts only
when ``need-class-counts`` is true (they reveal the client's label distribution), and the weights under the
same record name the global model arrived in (the strategy's ``arrayrecord_key``).

What leaves the client: the trained weights, ``weight_key`` (the sample count), the scalar
``train_metrics`` you pass, ``partition-id`` when you pass one, and, only on request, one importance
score per neuron of each fusion level and the per-class training counts.

``make_train_reply`` is the same without a received message (explicit flags), for tests or custom apps.

**A round's replies taken together** (``RoundProtocol`` in ``protocol.py`` runs the round): the errors that stop a run
(every reply diverged; every reply broke the reply contract), the train metrics of the valid replies and the log
line of an aggregation's info.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, Callable, Mapping, Sequence
import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from torch import nn
from fedfuse.fusion import client_statistics
from fedfuse.fusion.score_check import score_inconsistency
from fedfuse.importance import IMPORTANCE_METHODS, neuron_importance, uniform_importance
from typing import Any
from flwr.app import MetricRecord

MAX_NUM_EXAMPLES = 10**9
ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
IMPORTANCE_KEY = "importance"
STATISTICS_KEY = "statistics"
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
    optional ``scores`` (level name → ``[width]`` tensor), the sample count and the reported metrics, and the
    ``statistics`` its fusion method reads (``fedfuse.fusion.client_statistics``) when the round asked for them."""

    node_id: int
    partition_id: int
    state: dict[str, torch.Tensor]
    scores: dict[str, torch.Tensor] | None
    num_examples: int
    metrics: dict[str, float | int | list]
    class_counts: list[int] | None = field(default=None)
    statistics: dict[str, torch.Tensor] | None = field(default=None)


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
                   weight_key: str = NUM_EXAMPLES_KEY, copy: bool = True,
                   statistics: dict[str, tuple[int, ...]] | None = None,
                   statistics_key: str = STATISTICS_KEY) -> ClientUpdate:
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
        statistics: ``{name: shape}`` of the statistics the round's fusion method reads, when the round asked for
            them (train config ``need-statistics``), else ``None``; read from ``statistics_key``.
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
                        class_counts=[int(c) for c in counts] if isinstance(counts, list) else None,
                        statistics=None if statistics is None else read_statistics(content, statistics, statistics_key))


def read_statistics(content, reference: dict[str, tuple[int, ...]], key: str = STATISTICS_KEY
                    ) -> dict[str, torch.Tensor]:
    """A reply's statistics record checked against ``reference`` (``{name: shape}``: what
    ``fedfuse.fusion.client_statistics`` computes for the global architecture): the same names and shapes,
    floating-point and finite; ``ContractMismatch`` without the record, ``ReplyRejected`` saying what differs."""
    record = _record(content, key, ArrayRecord)
    if record is None:
        raise ContractMismatch(f"the round's fusion method reads the clients' statistics but the reply has no "
                               f"ArrayRecord {key!r} (train config '{NEED_STATISTICS}' = true)")
    missing = [k for k in reference if k not in record]
    extra = [k for k in record if k not in reference]
    if missing or extra:
        raise ReplyRejected(f"statistics names differ from the method's (missing {missing[:3]}, unexpected {extra[:3]})")
    out = {}
    for name, shape in reference.items():
        a = record[name].numpy()
        if tuple(a.shape) != tuple(shape):
            raise ReplyRejected(f"statistics {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        if a.dtype.kind != "f":
            raise ReplyRejected(f"statistics {name!r} has dtype {a.dtype}, expected floating point")
        if not np.isfinite(a).all():
            raise ReplyRejected(f"statistics {name!r} contains NaN or Inf")
        out[name] = torch.from_numpy(np.array(a, copy=True))
    return out


def state_to_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A torch state dict → ``ArrayRecord`` (CPU, contiguous)."""
    return ArrayRecord({k: v.detach().cpu().contiguous() for k, v in state.items()})


# ---------------------------------------------------------------- the client side: replying from a ClientApp
NEED_IMPORTANCE = "need-importance"
NEED_CLASS_COUNTS = "need-class-counts"
NEED_STATISTICS = "need-statistics"   # train config: send the statistics the round's fusion method reads
WEIGHT_KEY = "weight-key"   # train config: the metric the strategy reads the sample count from (weighted_by_key)
CONFIG_KEY = "config"


@dataclass
class TrainRequest:
    """What a fedfuse ``train`` message carries.

    Attributes:
        arrays_key: the name of the received weights record (the strategy's ``arrayrecord_key``); replies use it.
        arrays: the global model's weights (``None`` when the message carries none).
        config: the train ``ConfigRecord`` as a dict (``server-round``, ``fusion-method``, ``need-importance``,
            ``need-class-counts`` and the ServerApp's own keys, e.g. fedfuse's ``mode``/``local-epochs``/``lr``).
        server_round / fusion_method / need_importance / need_class_counts / need_statistics: read from ``config``.
        weight_key: the metric the strategy reads the sample count from (train config ``weight-key``, the
            strategy's ``weighted_by_key``; ``num-examples`` when the message does not say).
    """

    arrays_key: str
    arrays: ArrayRecord | None
    config: dict[str, Any] = field(default_factory=dict)
    server_round: int = 1
    fusion_method: str = ""
    need_importance: bool = False
    need_class_counts: bool = False
    weight_key: str = NUM_EXAMPLES_KEY
    need_statistics: bool = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The received global weights as a torch state dict (``model.load_state_dict(...)``)."""
        if self.arrays is None:
            raise ValueError("the train message carries no ArrayRecord with the global weights")
        return self.arrays.to_torch_state_dict()


def read_train_message(msg: Message, *, config_key: str = CONFIG_KEY) -> TrainRequest:
    """Parse a ``train`` message: the weights record (its only ``ArrayRecord``, whatever its name) and config."""
    content = msg.content
    arrays = [(k, v) for k, v in content.items() if isinstance(v, ArrayRecord)]
    if len(arrays) > 1:
        raise ValueError(f"the train message holds {len(arrays)} ArrayRecords {[k for k, _ in arrays]}; expected one "
                         "(the global weights)")
    key, record = arrays[0] if arrays else (ARRAYS_KEY, None)
    cfg_record = content[config_key] if config_key in content else None
    cfg = dict(cfg_record) if isinstance(cfg_record, ConfigRecord) else {}
    return TrainRequest(arrays_key=key, arrays=record, config=cfg, server_round=int(cfg.get("server-round", 1)),
                        fusion_method=str(cfg.get("fusion-method", "")),
                        need_importance=bool(cfg.get(NEED_IMPORTANCE, False)),
                        need_class_counts=bool(cfg.get(NEED_CLASS_COUNTS, False)),
                        weight_key=str(cfg.get(WEIGHT_KEY) or NUM_EXAMPLES_KEY),
                        need_statistics=bool(cfg.get(NEED_STATISTICS, False)))


def _scores(model: nn.Module, val_data, importance: str, importance_samples: int,
            device: str | torch.device) -> dict[str, torch.Tensor]:
    if importance not in IMPORTANCE_METHODS:
        raise ValueError(f"importance: unknown method {importance!r}; choose one of {list(IMPORTANCE_METHODS)}")
    if importance == "uniform":
        return uniform_importance(model)
    if val_data is None:
        raise ValueError(f"the strategy asks for importance scores (train config '{NEED_IMPORTANCE}' = true): pass "
                         f"val_data=(x [N, *input_shape], y [N]) to score neurons with {importance!r}, or scores=")
    x, y = val_data
    n = min(int(importance_samples), len(x))
    if n == 0:
        raise ValueError("importance: val_data holds no samples to score neurons on")
    was_training = model.training
    try:
        return neuron_importance(model, torch.as_tensor(x[:n]).float(), torch.as_tensor(y[:n]).long(),
                                 method=importance, device=device)
    finally:
        model.train(was_training)


def make_train_reply(model: nn.Module | Mapping[str, torch.Tensor], *, num_examples: int,
                     train_metrics: Mapping[str, Any] | None = None, val_data: Sequence | None = None,
                     need_importance: bool = False, importance: str = "deeplift", importance_samples: int = 256,
                     scores: Mapping[str, torch.Tensor] | None = None, class_counts: Sequence[int] | None = None,
                     partition_id: int | None = None, arrays_key: str = ARRAYS_KEY,
                     weight_key: str = NUM_EXAMPLES_KEY, device: str | torch.device = "cpu",
                     statistics: Mapping[str, torch.Tensor] | None = None) -> RecordDict:
    """The content of a valid ``train`` reply (``fedfuse.flower.round.replies`` contract).

    Args:
        model: the trained model (or its state dict; then ``need_importance`` needs ``scores``).
        num_examples: local training samples; sent under ``weight_key`` (the strategy's ``weighted_by_key``).
        train_metrics: extra scalar metrics (``{"train-loss": 0.3}``); averaged by the strategy, weighted by
            ``num_examples``.
        val_data: ``(x [N, *input_shape], y [N])`` local validation data for the importance scores.
        need_importance: add the ``"importance"`` record (one non-negative ``[width]`` vector per fusion level
            of ``fedfuse.models.levels(model)``): ``scores`` when given, else ``importance`` computed on the
            first ``importance_samples`` of ``val_data`` (``fedfuse.importance.neuron_importance``).
        class_counts: per-class training counts, sent as ``class-counts`` when given (pass them only when the
            strategy asks: train config ``need-class-counts``).
        partition_id: sent as ``partition-id`` (replies are fused in partition order: deterministic sums).
        arrays_key: name of the weights record (the strategy's ``arrayrecord_key``).
        statistics: the statistics the round's fusion method reads (``fedfuse.fusion.client_statistics`` on the
            local training data), sent as the ``"statistics"`` record when given (pass them only when the strategy
            asks: train config ``need-statistics``).
    Returns:
        ``RecordDict({arrays_key: ArrayRecord, "metrics": MetricRecord[, "importance": ArrayRecord]
        [, "statistics": ArrayRecord]})``.
    """
    if isinstance(num_examples, bool) or not float(num_examples).is_integer() or \
            not 0 < int(num_examples) <= MAX_NUM_EXAMPLES:
        raise ValueError(f"num_examples must be an integer in (0, {MAX_NUM_EXAMPLES}], got {num_examples!r}")
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    content = RecordDict({arrays_key: ArrayRecord({k: v.detach().cpu().contiguous() for k, v in state.items()})})
    if need_importance:
        if scores is None:
            if not isinstance(model, nn.Module):
                raise ValueError("need_importance with a state dict needs scores= (or pass the model)")
            scores = _scores(model, val_data, importance, importance_samples, device)
        content[IMPORTANCE_KEY] = ArrayRecord({k: torch.as_tensor(v).detach().cpu().float().reshape(-1).contiguous()
                                               for k, v in scores.items()})
    if statistics is not None:
        content[STATISTICS_KEY] = ArrayRecord({k: torch.as_tensor(v).detach().cpu().float().contiguous()
                                               for k, v in statistics.items()})
    metrics: dict[str, Any] = {}
    for k, v in (train_metrics or {}).items():
        if k in (weight_key, "class-counts", "partition-id"):
            raise ValueError(f"train_metrics: {k!r} is set by make_train_reply (num_examples / class_counts / "
                             "partition_id)")
        metrics[k] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    metrics[weight_key] = int(num_examples)
    if partition_id is not None:
        metrics["partition-id"] = int(partition_id)
    if class_counts is not None:
        metrics["class-counts"] = [int(c) for c in class_counts]
    content[METRICS_KEY] = MetricRecord(metrics)
    return content


def reply_to_train(msg: Message, model: nn.Module, *, num_examples: int,
                   train_metrics: Mapping[str, Any] | None = None, val_data: Sequence | None = None,
                   importance: str = "deeplift", importance_samples: int = 256,
                   scores: Mapping[str, torch.Tensor] | None = None, class_counts: Sequence[int] | None = None,
                   partition_id: int | None = None, weight_key: str | None = None,
                   device: str | torch.device = "cpu", train_data: Sequence | None = None) -> Message:
    """The reply ``Message`` to a fedfuse ``train`` message ``msg``, doing what its config asks.

    Scores only when ``need-importance`` is true; ``class_counts`` only when ``need-class-counts`` is true (a
    ``ValueError`` when asked for and not given); the weights under the received record's name and the sample
    count under the key the message names (``weight-key``: the strategy's ``weighted_by_key``) unless
    ``weight_key`` is given. The statistics of the round's fusion method (RegMean's Gram matrices, Fisher merging's
    Fisher) only when ``need-statistics`` is true, computed on ``train_data`` (``(x [N, *input_shape], y [N])``, the
    local training data; a ``ValueError`` when asked for and not given). Other arguments as ``make_train_reply``.
    """
    request = read_train_message(msg)
    if request.need_class_counts and class_counts is None:
        raise ValueError(f"the strategy asks for the class counts (train config '{NEED_CLASS_COUNTS}' = true; it "
                         "calibrates or weights heads with them): pass class_counts=[samples of class 0, 1, ...]")
    statistics = None
    if request.need_statistics:
        if train_data is None:
            raise ValueError(f"the strategy's fusion method {request.fusion_method!r} reads the clients' statistics "
                             f"(train config '{NEED_STATISTICS}' = true): pass train_data=(x [N, *input_shape], y [N])")
        statistics = client_statistics(request.fusion_method, model, torch.as_tensor(train_data[0]).float(),
                                       torch.as_tensor(train_data[1]).long(), device=device)
    content = make_train_reply(model, num_examples=num_examples, train_metrics=train_metrics, val_data=val_data,
                               need_importance=request.need_importance, importance=importance,
                               importance_samples=importance_samples, scores=scores,
                               class_counts=class_counts if request.need_class_counts else None,
                               partition_id=partition_id, arrays_key=request.arrays_key,
                               weight_key=weight_key or request.weight_key,
                               device=device, statistics=statistics)
    return Message(content=content, reply_to=msg)


# ---------------------------------------------------------------- a round's replies taken together
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


__all__ = ["ClientUpdate", "ReplyRejected", "ContractMismatch", "NonFiniteWeights", "validate_reply", "read_statistics", "record_rejection", "state_to_record", "ARRAYS_KEY", "METRICS_KEY", "IMPORTANCE_KEY", "STATISTICS_KEY", "TrainRequest", "read_train_message", "make_train_reply", "reply_to_train", "NEED_IMPORTANCE", "NEED_CLASS_COUNTS", "NEED_STATISTICS", "WEIGHT_KEY", "ClientsDivergedError", "ReplyContractError", "aggregate_metrics", "info_line"]
