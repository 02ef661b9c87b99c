"""A weighted-average round as a stream over the replies: each reply is validated, added to a running float64
weighted sum of the weights and dropped, so the server holds one model's worth of sums whatever the number of
clients. The result equals averaging the kept replies (same order, same weights: sorted by partition id, sample
counts read from the metrics before any array is deserialised)."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from torch import nn

from fedfuse.fusion import fuse_result
from fedfuse.flower.round.steps import Refinement, RoundData, ServerMomentum
from fedfuse.flower.round.protocol import Reference, RoundProtocol, cap_update, weight_limit
from fedfuse.flower.round.replies import (MAX_NUM_EXAMPLES, METRICS_KEY, ClientUpdate, _metric_record, _npy_view,
                                   state_to_record)


@dataclasses.dataclass
class StreamedRound:
    """The outcome of one streamed pass: the average (``None`` without valid replies), the valid replies' metrics
    (``metrics_only``: no arrays), the members of the clients' ensemble and the seconds spent in the update observer."""

    average: dict[str, torch.Tensor] | None
    metrics_only: list[ClientUpdate]
    members: list[tuple[Message, float]]
    observer_seconds: float


def fusion_order(ok: list[Message], weight_key: str) -> tuple[list[Message], list[float]]:
    """The replies sorted by (partition id, node id) from their metrics alone, and their plausible sample counts
    (the weights' denominator and the weight cap's median)."""
    keyed = []
    for msg in ok:
        metrics = _metric_record(msg.content, METRICS_KEY)
        pid = metrics.get("partition-id", -1) if metrics is not None else -1
        n = metrics.get(weight_key) if metrics is not None else None
        keyed.append(((int(pid) if isinstance(pid, (int, float)) and not isinstance(pid, bool) else -1,
                       int(msg.metadata.src_node_id)), n, msg))
    keyed.sort(key=lambda t: t[0])
    plausible = [float(n) for _, n, _ in keyed
                 if isinstance(n, (int, float)) and not isinstance(n, bool) and 0 < n <= MAX_NUM_EXAMPLES]
    return [m for _, _, m in keyed], plausible


def stream_average(strategy: RoundProtocol, server_round: int, ok: list[Message], record: dict[str, Any],
                   keep_members: bool) -> StreamedRound:
    """One pass over the replies: validate (``strategy.check_reply``), accumulate, observe, drop."""
    ordered, counts = fusion_order(ok, strategy.weighted_by_key)
    limit = weight_limit(counts, strategy.weight_cap)   # the weight cap, from the metrics before any array
    total = float(np.minimum(np.array(counts, dtype=float), limit if limit is not None else np.inf).sum()) \
        if counts else 1.0
    members: list[tuple[Message, float]] = []
    acc: dict[str, torch.Tensor] | None = None
    dtypes: dict[str, torch.dtype] = {}
    metrics_only: list[ClientUpdate] = []
    valid_total, observer_seconds = 0, 0.0
    for msg in ordered:
        u = strategy.check_reply(server_round, msg, record, level_widths=False, copy=False)
        if u is None:
            continue
        if limit is not None:
            u = cap_update(u, limit, strategy.weight_cap, record)
        w = u.num_examples / total
        valid_total += u.num_examples
        if acc is None:  # integer buffers (BatchNorm counters) from the first reply, as average_state_dicts
            dtypes = {k: v.dtype for k, v in u.state.items()}
            acc = {k: (v.double().mul_(w) if v.is_floating_point() else v.clone()) for k, v in u.state.items()}
        else:
            for k, v in u.state.items():
                if v.is_floating_point():
                    acc[k].add_(v, alpha=w)   # the same float64 steps as average_state_dicts: bit-identical
        if keep_members:
            members.append((msg, w))
        strategy._node_partitions[u.node_id] = u.partition_id
        if strategy.update_observer is not None:
            t_obs = time.perf_counter()
            strategy.update_observer(u)
            observer_seconds += time.perf_counter() - t_obs
        metrics_only.append(dataclasses.replace(u, state={}, scores=None))
        del u
    if acc is None:
        return StreamedRound(None, metrics_only, members, observer_seconds)
    if valid_total != total:  # a rejected reply: renormalise over the valid ones
        scale = total / valid_total
        for v in acc.values():
            if v.is_floating_point():
                v.mul_(scale)
        members = [(m, w * scale) for m, w in members]
    return StreamedRound({k: v.to(dtypes[k]) for k, v in acc.items()}, metrics_only, members, observer_seconds)


def stream_ensemble(probe: torch.nn.Module, members: list[tuple[Message, float]], reference: Reference,
                    arrays_key: str, fusion_inputs: torch.Tensor) -> torch.Tensor:
    """The clients' ensemble on the fusion set, ``sum_i w_i softmax(f_i(x))`` (the same order and sums as
    ``teacher_probs``), re-reading the round's valid replies one at a time."""
    x = torch.as_tensor(fusion_inputs).float()
    probs = None
    with torch.no_grad():
        for msg, w in members:
            arrays = msg.content[arrays_key]
            state = {}
            for key, (shape, dtype) in reference.items():
                a = _npy_view(arrays[key], shape, dtype)
                state[key] = torch.from_numpy(np.array(a if a is not None else arrays[key].numpy(), copy=True))
            p = torch.cat([w * torch.func.functional_call(probe, state, (x[i:i + 512],)).softmax(-1)
                           for i in range(0, x.shape[0], 512)])
            probs = p if probs is None else probs + p
    return probs


def finish_stream(work: Callable[[], torch.nn.Module], average: dict[str, torch.Tensor], rd: RoundData, momentum: ServerMomentum,
                  refinement: Refinement, ensemble) -> tuple[dict[str, torch.Tensor], dict[str, Any], float]:
    """``(state, info, seconds)``: the streamed average, then the server step and the refinement (checked with
    ``Refinement.streamed``) on ``work()``, a model object the strategy reuses every round. Without either step the
    average's arrays are the result (FedAvg: no model built, so no ``model_fn`` needed)."""
    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    if not momentum.active and not refinement.steps:
        return average, info, time.perf_counter() - t0
    model = work().cpu()
    model.load_state_dict(average)
    model.eval()
    if momentum.active:
        model, step_info = momentum(model, rd)
        info.update(step_info)
    if refinement.steps:
        model, step_info = refinement.streamed(model, rd, ensemble)
        info.update(step_info)
    return model.state_dict(), info, time.perf_counter() - t0


class StreamedRounds:
    """The streamed plain-average rounds of a ``FusionStrategy`` (a mixin: it reads the strategy's steps, record
    keys and ``model_fn``): which rounds stream, and the round as one pass over the replies."""

    def streaming_round(self, server_round: int) -> bool:
        """A plain weighted-average round of a streaming entry (``average``/``fedavg``) with the default ``fuse_fn``,
        no ``distill`` (it reads every client model), no static BN, no robust screen and ``keep_updates`` off."""
        return (self.entry.streams and not self.keep_updates and self.fuse_fn is fuse_result and self.screen is None
                and self.static_bn_step is None
                and self.round_method(server_round) in ("average", "fedavg") and "distill" not in self.refine_steps)

    def aggregate_streamed(self, server_round: int, ok: list[Message], failures: list[dict],
                           record: dict[str, Any]) -> tuple[ArrayRecord | None, MetricRecord | None] | None:
        if not self.streaming_round(server_round):
            return None
        t_start = time.perf_counter()
        ensemble = self.stream_checks_calibration()
        streamed = stream_average(self, server_round, ok, record, keep_members=ensemble)
        record["valid"] = len(streamed.metrics_only)
        self.last_updates = []
        if self._stop_or_skip(server_round, len(streamed.metrics_only), record):
            return None, None
        t0 = time.perf_counter()
        reference = self._reference()

        def probs() -> torch.Tensor:
            return self._stream_ensemble(streamed.members, reference)

        state, fallback, info = self.with_fallback(
            server_round, len(streamed.metrics_only),
            lambda: self._finish_stream(server_round, streamed.average, probs if ensemble else None, streamed.metrics_only),
            lambda: streamed.average, streamed=True)
        seconds = time.perf_counter() - t0 + (t0 - t_start - streamed.observer_seconds)
        metrics = self._close_round(record, seconds, fallback, info, streamed.metrics_only, ok, failures)
        return (None if state is None else state_to_record(state)), metrics

    def stream_checks_calibration(self) -> bool:
        """Whether the streamed round keeps its members to check a ``calibrate`` step against their ensemble."""
        return self.refinement.check and "calibrate" in self.refine_steps and self.fusion_inputs is not None

    def _stream_ensemble(self, members: list[tuple[Message, float]], reference) -> torch.Tensor:
        """The clients' ensemble on the fusion set, re-read from the round's valid replies (``stream_ensemble``)."""
        if self._probe is None:
            self._probe = self.model_fn().eval()
        return stream_ensemble(self._probe, members, reference, self.arrayrecord_key, self.fusion_inputs)

    def _finish_stream(self, server_round: int, average: dict[str, torch.Tensor],
                       probs: Callable[[], torch.Tensor] | None, updates: list[ClientUpdate]):
        """The streamed average → server step → ``calibrate`` checked against the streamed ensemble."""
        def work() -> nn.Module:   # one model object reused every round (its state is copied out right away)
            if self._work is None:
                self._work = copy.deepcopy(self._model_template())
            return self._work

        return finish_stream(work, average, self.round_data(server_round, updates), self.momentum_step,
                             self.refinement, probs)


__all__ = ["StreamedRounds", "StreamedRound", "fusion_order", "stream_average", "stream_ensemble", "finish_stream"]
