"""Time and memory measurement shared by the benchmarks.

Timings are *interleaved*: repeat 1 of every case, then repeat 2 of every case, … and summarised by the
median, so load drifts on a shared machine hit every case alike. Every reported time is a ratio to a
baseline measured in the same run.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any, Callable, Hashable

import torch

from fedfuse.fusion import FusionResult, fuse_result


def sync(device: torch.device | str | None) -> None:
    """Wait for queued CUDA work so a timer measures it (no-op on CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_timings(cases: dict[Hashable, Callable[[], Any]], repeats: int, warmup: int = 1,
                        before: Callable[[Hashable], None] | None = None,
                        device: torch.device | str | None = None) -> dict[Hashable, dict[str, list[float]]]:
    """``{case: {"wall": [s, ...], "cpu": [s, ...]}}`` over ``repeats`` interleaved calls of each case.

    ``before(case)`` runs untimed before every call (e.g. switching a model's mode); ``warmup`` untimed
    calls per case run first. ``cpu`` is this process's CPU time (what the wall time would be on an idle
    core with one thread).
    """
    for case, fn in cases.items():
        for _ in range(warmup):
            if before is not None:
                before(case)
            fn()
    out = {case: {"wall": [], "cpu": []} for case in cases}
    for _ in range(repeats):
        for case, fn in cases.items():
            if before is not None:
                before(case)
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            out[case]["cpu"].append(time.process_time() - c0)
            out[case]["wall"].append(time.perf_counter() - t0)
    return out


def medians(times: dict[Hashable, dict[str, list[float]]]) -> dict[Hashable, dict[str, float]]:
    return {case: {k: statistics.median(v) for k, v in t.items()} for case, t in times.items()}


class PeakRSS:
    """Context manager: peak process-RSS delta in bytes, sampled every ``interval`` s → ``self.peak``.
    Blind to allocations shorter than the interval or served from freed memory."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self.start)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.start = self._rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss() - self.start)


def profiled_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak live bytes of PyTorch CPU tensor allocations while ``fn()`` runs: the cumulative sum of the
    ``torch.profiler`` memory events (every allocation and free), maximised."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    ev = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nb in ev:
        live += nb
        peak = max(peak, live)
    return peak


MEMORY_MEASURES = ("profile", "rss", "none")


def timed_fuse(method: str, models, fusion_inputs, device: torch.device, seed: int, options: dict,
               memory: str = "none", short_options: dict | None = None) -> tuple[FusionResult, float, int]:
    """``fuse_result`` with wall seconds and peak memory in bytes (-1 when not measured).

    On CUDA the peak is ``torch.cuda.max_memory_allocated`` during the timed call. On CPU ``memory``:
    ``profile`` = ``profiled_peak_bytes`` of a *separate* call with ``short_options`` merged in (a shortened
    pass, so profiling does not distort the timing; valid for methods whose peak does not depend on the
    number of steps); ``rss`` = ``PeakRSS`` during the timed call; ``none``.
    """
    if memory not in MEMORY_MEASURES:
        raise ValueError(f"timed_fuse: memory must be one of {MEMORY_MEASURES}, got {memory!r}")
    call = lambda opts: fuse_result(method, models, fusion_inputs=fusion_inputs, device=device, seed=seed,  # noqa: E731
                                    **opts)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        res = call(options)
        torch.cuda.synchronize()
        return res, time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base
    if memory == "rss":
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            res = call(options)
            sec = time.perf_counter() - t0
        return res, sec, mem.peak
    t0 = time.perf_counter()
    res = call(options)
    sec = time.perf_counter() - t0
    peak = -1
    if memory == "profile":
        peak = profiled_peak_bytes(lambda: call({**options, **(short_options or {})}))
    return res, sec, peak
