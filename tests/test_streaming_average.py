"""Issue 12, cost as clients grow: the default ``average`` (and ``fedavg``) aggregate a round as a stream over the
replies (running weighted sum; the calibration check's ensemble re-read from the replies only when a calibration
fired). The result must equal averaging the kept replies bit for bit, and the strategy's memory must not grow with
the number of clients."""

from __future__ import annotations

import gc
import os
import tracemalloc

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedfuse.flower import build_strategy
from fedfuse.flower.round.replies import _npy_view
from tests.test_strategies import BAD, SHAPE, model_fn, reply, state_of

torch.set_num_threads(1)


def _x(n=64, seed=0):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


def _global():
    return ArrayRecord({k: Array(v.numpy().copy()) for k, v in model_fn().state_dict().items()})


def _run(name, keep, replies, rounds=3, **options):
    s = build_strategy(name, model_fn=model_fn, fusion_inputs=_x(), seed=0, **options)
    s.keep_updates = keep
    s._global = _global()
    seen = []
    s.update_observer = lambda u: seen.append((u.partition_id, {k: v.clone() for k, v in u.state.items()}))
    out = []
    for r in range(1, rounds + 1):
        arrays, metrics = s.aggregate_train(r, replies)
        out.append((state_of(arrays), {k: v for k, v in dict(metrics).items() if k != "fusion-seconds"},
                    s.history[-1]))
    return s, out, seen


@pytest.mark.parametrize("name,options", [("average", {}), ("average", {"calibrate_min_gap": 0.0}),
                                          ("average", {"refine": "none", "server_momentum": 0.0}),
                                          ("fedavg", {})])
def test_streamed_round_equals_the_kept_replies_average_bit_for_bit(name, options):
    # arrival order differs from partition order, sample counts differ, one reply is rejected (NaN weights)
    replies = [reply(5, 5, n=70, scores=False), reply(2, 2, n=30, scores=False), reply(9, 9, n=55, scores=False),
               reply(4, 4, n=41, scores=False, mutate=BAD["NaN weights"]), reply(1, 1, n=12, scores=False)]
    streamed, a, seen_a = _run(name, False, replies, **options)
    kept, b, seen_b = _run(name, True, replies, **options)
    assert streamed.streaming_round(1) and not kept.streaming_round(1)
    for (sa, ma, ha), (sb, mb, hb) in zip(a, b):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
        assert ma == mb
        assert ha["valid"] == hb["valid"] == 4 and len(ha["rejected"]) == len(hb["rejected"]) == 1
        for key in ("refine-kept", "calibration-skipped", "step-norm"):
            if key in (hb["fusion-info"] or {}) and not (hb["fusion-info"] or {}).get("calibration-skipped"):
                assert ha["fusion-info"][key] == hb["fusion-info"][key], key
    # both modes hand every valid reply to the observer, in partition order
    assert [p for p, _ in seen_a] == [p for p, _ in seen_b] == [1, 2, 5, 9] * 3
    assert streamed.last_updates == [] and len(kept.last_updates) == 4


def test_calibration_check_reads_the_ensemble_only_when_a_calibration_fired(monkeypatch):
    replies = [reply(i, i, scores=False) for i in range(1, 4)]
    calls = []
    s = build_strategy("average", model_fn=model_fn, fusion_inputs=_x(), seed=0)  # min gap 0.2: skipped here
    original = s._stream_ensemble
    monkeypatch.setattr(s, "_stream_ensemble", lambda *a: calls.append(1) or original(*a))
    s.aggregate_train(1, replies)
    assert s.history[-1]["fusion-info"].get("calibration-skipped") == 1 and not calls
    s.refinement.calibrate_min_gap = 0.0
    s.aggregate_train(2, replies)
    assert "refine-kept" in s.history[-1]["fusion-info"] and calls == [1]


def _peak_bytes(strategy, replies):
    gc.collect()
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    strategy.aggregate_train(1, replies)
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak - start, current - start


def test_streaming_memory_does_not_grow_with_the_number_of_clients():
    def wide():  # ~0.4 MB of weights per model: per-client copies would dominate the peak
        from fedfuse.models import build_model
        return build_model("mlp", num_classes=10, input_shape=SHAPE, width=1024, depth=1, seed=0)

    def replies(n):
        out = []
        for k in range(n):
            msg = reply(k + 1, 0, scores=False)
            state = {key: v.numpy() + 0.01 * (k + 1) for key, v in wide().state_dict().items()}
            msg.content["arrays"] = ArrayRecord({key: Array(np.ascontiguousarray(v, np.float32))
                                                 for key, v in state.items()})
            out.append(msg)
        return out

    model_bytes = sum(v.numel() * 4 for v in wide().state_dict().values())
    small, large = replies(4), replies(16)
    peaks = {}
    for keep in (False, True):
        for n, rs in ((4, small), (16, large)):
            s = build_strategy("average", model_fn=wide, fusion_inputs=_x(), seed=0)
            s.keep_updates = keep
            s.aggregate_train(1, rs)  # warm caches (template, reference) outside the measure
            peaks[(keep, n)] = _peak_bytes(s, rs)
    # streamed: the 12 extra clients add well under one model's bytes (float64 sums are fixed-size)
    assert peaks[(False, 16)][0] - peaks[(False, 4)][0] < 0.5 * model_bytes
    assert peaks[(False, 16)][1] < 0.5 * model_bytes          # nothing per client kept after the round
    # kept replies: every extra client adds at least its model copy
    assert peaks[(True, 16)][0] - peaks[(True, 4)][0] > 10 * model_bytes


def test_npy_view_reads_exactly_what_numpy_reads_and_declines_anything_else():
    for a in (np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((), np.int64), np.ones(5, np.float64)):
        arr = Array(a)
        view = _npy_view(arr, a.shape, a.dtype)
        assert view is not None and np.array_equal(view, arr.numpy()) and view.dtype == a.dtype
    arr = Array(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert _npy_view(arr, (4, 3), np.float32) is None            # other shape: np.load path, then rejected
    assert _npy_view(arr, (3, 4), np.float64) is None            # other dtype
    fortran = Array(np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)))
    assert _npy_view(fortran, (3, 4), np.float32) is None or np.array_equal(
        _npy_view(fortran, (3, 4), np.float32), fortran.numpy())
