"""Client side of the fedfuse reply contract: reply correctly from your own ClientApp in two lines.

The fedfuse strategies (``fedfuse.flower.strategies``) validate every ``train`` reply against the contract
of ``fedfuse.flower.round.replies``. These helpers build such a reply from a trained ``torch`` model, so a
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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from torch import nn

from fedfuse.flower.round.replies import (ARRAYS_KEY, IMPORTANCE_KEY, MAX_NUM_EXAMPLES, METRICS_KEY, NUM_EXAMPLES_KEY)
from fedfuse.importance import IMPORTANCE_METHODS, neuron_importance, uniform_importance

NEED_IMPORTANCE = "need-importance"
NEED_CLASS_COUNTS = "need-class-counts"
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
        server_round / fusion_method / need_importance / need_class_counts: read from ``config``.
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
                        weight_key=str(cfg.get(WEIGHT_KEY) or NUM_EXAMPLES_KEY))


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
                     weight_key: str = NUM_EXAMPLES_KEY, device: str | torch.device = "cpu") -> RecordDict:
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
    Returns:
        ``RecordDict({arrays_key: ArrayRecord, "metrics": MetricRecord[, "importance": ArrayRecord]})``.
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
                   device: str | torch.device = "cpu") -> Message:
    """The reply ``Message`` to a fedfuse ``train`` message ``msg``, doing what its config asks.

    Scores only when ``need-importance`` is true; ``class_counts`` only when ``need-class-counts`` is true (a
    ``ValueError`` when asked for and not given); the weights under the received record's name and the sample
    count under the key the message names (``weight-key``: the strategy's ``weighted_by_key``) unless
    ``weight_key`` is given. Other arguments as ``make_train_reply``.
    """
    request = read_train_message(msg)
    if request.need_class_counts and class_counts is None:
        raise ValueError(f"the strategy asks for the class counts (train config '{NEED_CLASS_COUNTS}' = true; it "
                         "calibrates or weights heads with them): pass class_counts=[samples of class 0, 1, ...]")
    content = make_train_reply(model, num_examples=num_examples, train_metrics=train_metrics, val_data=val_data,
                               need_importance=request.need_importance, importance=importance,
                               importance_samples=importance_samples, scores=scores,
                               class_counts=class_counts if request.need_class_counts else None,
                               partition_id=partition_id, arrays_key=request.arrays_key,
                               weight_key=weight_key or request.weight_key,
                               device=device)
    return Message(content=content, reply_to=msg)


__all__ = ["TrainRequest", "read_train_message", "make_train_reply", "reply_to_train", "NEED_IMPORTANCE",
           "NEED_CLASS_COUNTS", "WEIGHT_KEY"]
