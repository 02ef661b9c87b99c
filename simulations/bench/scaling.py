"""Cost as clients grow: one round's server aggregation time and memory for 10, 50 and 200 sampled clients.

    python -m simulations.bench.scaling --repeats 9                      # the default aggregation, ~2 min
    python -m simulations.bench.scaling --strategies average,feddf,kf-linear --no-memory \\
        --width 64 --depth 2 --shard-size 320 --fusion-size 300 --repeats 3 --out results/scaling/fusion-methods

What is measured, all in ONE process (only ratios inside one run are claims; the machine is shared):

- **Aggregation**: the real strategy objects (``fedfuse.flower.build_strategy(name, model_fn=...,
  fusion_inputs=X)``, the options the ServerApp passes by default: refine ``auto``, guard on, fallback
  ``previous``) driven through ``aggregate_train(server_round, replies)`` with real ``flwr.app.Message``
  replies that follow the reply contract (``fedfuse.flower.round.replies``): ``"arrays"`` ArrayRecord,
  ``"metrics"`` MetricRecord (num-examples, partition-id, class-counts, train-loss) and, for methods that
  use scores, an ``"importance"`` ArrayRecord (the client's DeepLIFT scores on its validation split, as the
  fedfuse ClientApp sends them). The timed call therefore includes reply validation (deserialising every
  array), the fusion, the divergence guard and the refinement.
- **Client models**: one global model (the MLP trained ``--warmup-epochs`` on a class-balanced part of
  MNIST-1D, i.e. a mid-training round) copied to every client, each trained one local epoch (SGD momentum
  0.9, ``--lr``, batch 32) on its own label-skewed shard: ``--shard-size`` samples whose class proportions
  are drawn from Dirichlet(``--alpha``). The client sets are nested (the 10 clients are the first 10 of the
  50, ...), as when a server samples more nodes of one federation.
- **One client's local epoch**: ``fedfuse.training.train`` for 1 epoch of a client's shard (the first
  client's; SGD, batch 32), timed interleaved with the aggregations.
- **Timing**: every case ``--repeats`` times, interleaved (repeat 1 of every case, then repeat 2, ...,
  after one untimed warm-up call each), median; wall time and this process's CPU time (one torch thread).
- **Memory** (untimed calls, a fresh strategy object each, ascending client counts): ``tracemalloc`` peak
  (Python objects and numpy buffers, i.e. the deserialised reply arrays; torch's CPU allocator is invisible
  to it), the ``torch.profiler`` peak of live torch CPU tensor bytes (``timing.profiled_peak_bytes``), the
  peak process-RSS delta sampled every 2 ms from ``/proc/self/statm`` after ``malloc_trim(0)``
  (``timing.PeakRSS``; a lower bound: freed memory is reused), and what the strategy still holds after the
  round (``tracemalloc`` current minus start with the round's result dropped: ``last_updates``, history).
- **Growth**: a least-squares line through (clients, median seconds) per strategy (seconds per added
  client, also in local epochs per added client), the log-log exponent, and the client count at which the
  round's aggregation costs one local epoch.

Writes ``<out>/table.md``, ``<out>/scaling.json`` and ``<out>/time_vs_clients.png``.
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import ctypes
import gc
import logging
import os
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, Metadata, MetricRecord, RecordDict

from fedfuse.flower import FusionStrategy, build_strategy
from fedfuse.flower.round.replies import ARRAYS_KEY, IMPORTANCE_KEY, METRICS_KEY
from fedfuse.importance import neuron_importance
from fedfuse.models import build_model
from fedfuse.training import train

from simulations.bench.specs import split_list
from simulations.bench.tables import markdown_table, write_json
from simulations.bench.timing import PeakRSS, interleaved_timings, medians, profiled_peak_bytes

# the default 'average' as configured, and in a round whose calibration fires (calibrate_min_gap=0.0: the worst case,
# the clients' ensemble is re-read from the replies) or does not (0.99: the common case in the issue-12 runs, where
# the prior gap stays below the default 0.2). feddf / kf-linear: --strategies average,feddf,kf-linear --no-memory
# (torch.profiler's memory events of feddf at 200 clients take > 10 GB of RSS)
DEFAULT_STRATEGIES = ("fedavg", "average", "average[calibrate_min_gap=0.0]", "average[calibrate_min_gap=0.99]")
DEFAULT_CLIENTS = (10, 50, 200)
LOCAL_EPOCH = "local-epoch"
SERVER_ROUND = 2  # any round > 1: a multi-round round, fusion seed = seed + round


@dataclass(frozen=True)
class ScalingSetup:
    """The benchmark's fixed settings (model, client shards, local recipe, scores, timing)."""

    width: int = 64
    depth: int = 2
    shard_size: int = 320          # samples a client trains on (one local epoch = shard_size / batch_size steps)
    val_size: int = 64             # samples a client scores neurons on (its validation split)
    alpha: float = 0.1             # Dirichlet label skew of the shards
    lr: float = 0.2                # the recipe: SGD momentum 0.9, lr 0.2, batch 32
    batch_size: int = 32
    warmup_epochs: int = 2         # central epochs of the shared global model before the measured round
    warmup_size: int = 1000
    importance: str = "deeplift"   # the scores kf-linear's clients send (fedfuse's default)
    repeats: int = 3
    seed: int = 0


@dataclass
class Client:
    """One trained client: its reply's content (state, scores, metrics)."""

    state: dict[str, torch.Tensor]
    scores: dict[str, torch.Tensor] | None
    metrics: dict[str, Any]


# ------------------------------------------------------------------------------------------ clients
def label_skewed_indices(labels: np.ndarray, num_classes: int, size: int, alpha: float,
                         rng: np.random.Generator) -> np.ndarray:
    """``size`` indices into ``labels`` whose class proportions are drawn from Dirichlet(alpha·1)
    (without replacement within a class unless the class has fewer samples than drawn)."""
    p = rng.dirichlet(np.full(num_classes, alpha))
    counts = rng.multinomial(size, p)
    out = []
    for c, k in enumerate(counts):
        pool = np.flatnonzero(labels == c)
        if k == 0:
            continue
        if len(pool) == 0:
            raise ValueError(f"scaling: class {c} has no samples in the client pool, cannot draw {k}")
        out.append(rng.choice(pool, size=k, replace=len(pool) < k))
    idx = np.concatenate(out)
    rng.shuffle(idx)
    return idx


def warm_global_model(model_fn: Callable[[], torch.nn.Module], x: torch.Tensor, y: torch.Tensor,
                      setup: ScalingSetup) -> torch.nn.Module:
    """The shared global model of the measured round: ``model_fn()`` trained ``warmup_epochs`` on a random
    ``warmup_size`` subset of the pool (a mid-training global model, not an initialisation)."""
    model = model_fn()
    gen = torch.Generator().manual_seed(setup.seed)
    idx = torch.randperm(len(x), generator=gen)[: setup.warmup_size]
    if setup.warmup_epochs:
        train(model, x[idx], y[idx], epochs=setup.warmup_epochs, batch_size=setup.batch_size, optimizer="sgd",
              lr=setup.lr, seed=setup.seed)
    return model.eval()


def make_clients(n: int, global_state: dict[str, torch.Tensor], model_fn: Callable[[], torch.nn.Module],
                 pool_x: torch.Tensor, pool_y: torch.Tensor, num_classes: int, setup: ScalingSetup
                 ) -> tuple[list[Client], tuple[torch.Tensor, torch.Tensor]]:
    """``n`` clients, each the global model after one local epoch on its own label-skewed shard, with
    the ClientApp's metrics and (``setup.importance``) neuron scores on its validation split.

    Returns ``(clients, (x, y) of client 0's shard)``, the shard the local-epoch reference trains on.
    """
    labels = pool_y.numpy()
    clients, first_shard = [], None
    for k in range(n):
        rng = np.random.default_rng([setup.seed, k])
        idx = label_skewed_indices(labels, num_classes, setup.shard_size + setup.val_size, setup.alpha, rng)
        tr, va = torch.as_tensor(idx[: setup.shard_size]), torch.as_tensor(idx[setup.shard_size:])
        x, y = pool_x[tr], pool_y[tr]
        if first_shard is None:
            first_shard = (x, y)
        model = model_fn()
        model.load_state_dict(global_state)
        out = train(model, x, y, epochs=1, batch_size=setup.batch_size, optimizer="sgd", lr=setup.lr,
                    seed=setup.seed * 7919 + k)
        state = {key: v.detach().clone() for key, v in model.state_dict().items()}
        if not all(bool(torch.isfinite(v).all()) for v in state.values()):
            raise RuntimeError(f"scaling: client {k} diverged in its local epoch (lr {setup.lr}); lower --lr")
        scores = (neuron_importance(model, pool_x[va], pool_y[va], method=setup.importance)
                  if setup.importance != "none" else None)
        metrics = {"num-examples": len(tr), "partition-id": k, "train-loss": float(out["train-loss"]),
                   "class-counts": torch.bincount(y, minlength=num_classes).tolist()}
        clients.append(Client(state=state, scores=scores, metrics=metrics))
    return clients, first_shard


def reply_message(node_id: int, client: Client, with_scores: bool) -> Message:
    """A real ``flwr.app.Message`` reply of node ``node_id`` following the reply contract."""
    content = RecordDict({ARRAYS_KEY: ArrayRecord({k: Array(v.numpy().copy()) for k, v in client.state.items()}),
                          METRICS_KEY: MetricRecord(dict(client.metrics))})
    if with_scores:
        if client.scores is None:
            raise ValueError("scaling: a strategy uses client scores but the clients computed none "
                             "(--importance none); use uniform, deeplift or conductance")
        content[IMPORTANCE_KEY] = ArrayRecord({k: Array(v.float().numpy().copy()) for k, v in client.scores.items()})
    metadata = Metadata(run_id=1, message_id="", src_node_id=node_id, dst_node_id=0,
                        reply_to_message_id=f"train-{node_id}", group_id=str(SERVER_ROUND), created_at=time.time(),
                        ttl=3600.0, message_type="train")
    return Message(content=content, metadata=metadata)


# ------------------------------------------------------------------------------------------ measures
def _malloc_trim() -> None:
    """Give freed heap pages back to the OS (glibc), so an RSS delta sees the next call's allocations."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the RSS delta is only less tight
        pass


def memory_of_round(build: Callable[[], FusionStrategy], replies: list[Message]) -> dict[str, int]:
    """Peak and retained server memory of one ``aggregate_train`` call (bytes); a fresh strategy per measure."""
    out: dict[str, int] = {}
    strategy = build()
    gc.collect()
    _malloc_trim()
    with PeakRSS() as rss:
        result = strategy.aggregate_train(SERVER_ROUND, replies)
    out["rss-peak-delta"] = int(rss.peak)
    del result, strategy

    strategy = build()
    gc.collect()
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    result = strategy.aggregate_train(SERVER_ROUND, replies)
    del result
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out["tracemalloc-peak"] = int(peak - start)
    out["retained-after-round"] = int(current - start)  # what the strategy keeps (last_updates, history)
    del strategy

    strategy = build()
    gc.collect()
    out["torch-peak"] = int(profiled_peak_bytes(lambda: strategy.aggregate_train(SERVER_ROUND, replies)))
    return out


def fit_growth(clients: Sequence[int], seconds: Sequence[float]) -> dict[str, float]:
    """``{"slope": s per added client, "intercept": s, "exponent": d log t / d log n}`` (least squares)."""
    n = np.asarray(clients, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if len(n) < 2:
        return {"slope": float("nan"), "intercept": float("nan"), "exponent": float("nan")}
    slope, intercept = np.polyfit(n, t, 1)
    exponent = np.polyfit(np.log(n), np.log(np.maximum(t, 1e-12)), 1)[0]
    return {"slope": float(slope), "intercept": float(intercept), "exponent": float(exponent)}


def parse_label(label: str) -> tuple[str, dict[str, Any]]:
    """``"average[calibrate_min_gap=0.99 server_momentum=0]"`` → ``("average", {strategy keyword options})``
    (values are Python literals)."""
    import ast

    name, _, rest = label.partition("[")
    options: dict[str, Any] = {}
    for item in rest.rstrip("]").replace(",", " ").split():
        key, _, value = item.partition("=")
        options[key.strip().replace("-", "_")] = ast.literal_eval(value.strip())
    return name.strip(), options


def model_bytes(model: torch.nn.Module) -> int:
    return int(sum(v.numel() * v.element_size() for v in model.state_dict().values()))


# ------------------------------------------------------------------------------------------ the benchmark
def run_scaling(pool_x: torch.Tensor, pool_y: torch.Tensor, fusion_x: torch.Tensor, num_classes: int,
                client_counts: Sequence[int] = DEFAULT_CLIENTS, strategies: Sequence[str] = DEFAULT_STRATEGIES,
                setup: ScalingSetup = ScalingSetup(), memory: bool = True,
                log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Measure one round's aggregation per (strategy, client count) against FedAvg and a local epoch.

    Args:
        pool_x, pool_y: ``[N, *input_shape]`` / ``[N]`` samples the clients' shards are drawn from.
        fusion_x: ``[B, *input_shape]`` the server fusion set.
        num_classes: classes of the task.
        client_counts: sampled clients per round (ascending; clients are nested across counts).
        strategies: ``fedfuse.flower.STRATEGIES`` names; ``fedavg`` is always measured (the baseline).
        memory: also measure memory (three untimed extra calls per case).

    Returns ``{"setup", "model-bytes", "local-epoch": {wall, cpu}, "rows": [one per (strategy, clients)],
    "growth": {strategy: fit}}``; every row has ``wall``/``cpu`` medians (s), ``x-fedavg``,
    ``x-local-epoch`` (wall ratios), ``x-local-epoch-cpu``, ``fusion-seconds`` (the strategy's own
    timing of fusion + guard + refine, the rest being reply validation), the round's history entry
    (``fallback``, ``guard``, ``fusion-info``) and, with ``memory``, the memory measures in bytes.
    """
    client_counts = sorted(int(n) for n in client_counts)
    if not client_counts or client_counts[0] < 1:
        raise ValueError(f"scaling: client counts must be >= 1, got {client_counts}")
    strategies = list(dict.fromkeys(["fedavg", *strategies]))
    input_shape = tuple(pool_x.shape[1:])

    def model_fn() -> torch.nn.Module:
        return build_model("mlp", num_classes=num_classes, input_shape=input_shape, width=setup.width,
                           depth=setup.depth, seed=setup.seed)

    sent: dict[str, ArrayRecord] = {}

    def build(label: str) -> FusionStrategy:
        # the ServerApp's defaults (fedfuse.flower.server_app.setup): refine auto, guard on, fallback previous;
        # Flower's FedAvg warns at every construction that fraction_evaluate is 0 (fedfuse evaluates centrally)
        name, options = parse_label(label)
        flwr_logger = logging.getLogger("flwr")
        level = flwr_logger.level
        flwr_logger.setLevel(logging.ERROR)
        try:
            strategy = build_strategy(name, model_fn=model_fn, fusion_inputs=fusion_x, seed=setup.seed, **options)
        finally:
            flwr_logger.setLevel(level)
        if "global" in sent:  # the global model this round sent (configure_train): the server momentum step runs
            strategy._global = sent["global"]
        return strategy

    uses_scores = {name: build(name).wants_client_scores for name in strategies}
    t0 = time.perf_counter()
    global_model = warm_global_model(model_fn, pool_x, pool_y, setup)
    global_state = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
    sent["global"] = ArrayRecord({k: Array(v.numpy().copy()) for k, v in global_state.items()})
    clients, (shard_x, shard_y) = make_clients(max(client_counts), global_state, model_fn, pool_x, pool_y,
                                               num_classes, setup)
    log(f"{len(clients)} clients trained and scored in {time.perf_counter() - t0:.1f}s")
    replies = {(n, s): [reply_message(k + 1, c, s) for k, c in enumerate(clients[:n])]
               for n in client_counts for s in {False, *(uses_scores.values())}}
    # everything alive now (torch, Flower, the replies) moves to the permanent generation: a gc.collect()
    # between measured calls then scans only what the calls allocate (0.6 s per collect otherwise)
    gc.collect()
    gc.freeze()
    try:
        rows: dict[tuple[str, int], dict[str, Any]] = {}
        for n in client_counts:
            for name in strategies:
                rows[(name, n)] = {"strategy": name, "clients": n, "client-scores": uses_scores[name]}
                if memory:
                    t1 = time.perf_counter()
                    rows[(name, n)]["memory"] = memory_of_round(lambda: build(name), replies[(n, uses_scores[name])])
                    log(f"memory {name} n={n}: {rows[(name, n)]['memory']} ({time.perf_counter() - t1:.1f}s)")

        # timing: one strategy object per case (history grows; the work per call is the same)
        objects = {key: build(key[0]) for key in rows}
        local_model = model_fn()

        def local_epoch() -> None:
            train(local_model, shard_x, shard_y, epochs=1, batch_size=setup.batch_size, optimizer="sgd", lr=setup.lr,
                  seed=setup.seed)

        cases: dict[Any, Callable[[], Any]] = {LOCAL_EPOCH: local_epoch}
        for key in rows:
            cases[key] = (lambda key=key: objects[key].aggregate_train(SERVER_ROUND,
                                                                      replies[(key[1], uses_scores[key[0]])]))

        def before(case: Any) -> None:
            gc.collect()
            if case == LOCAL_EPOCH:
                local_model.load_state_dict(global_state)  # the round's starting point, every repeat

        t1 = time.perf_counter()
        times = interleaved_timings(cases, repeats=setup.repeats, warmup=1, before=before)
        log(f"timing: {setup.repeats} interleaved repeats of {len(cases)} cases in {time.perf_counter() - t1:.1f}s")
        med = medians(times)
        epoch = med[LOCAL_EPOCH]
        for key, row in rows.items():
            strategy = objects[key]
            hist = strategy.history[-1]
            # history = the warm-up call, then the timed calls in order: pair each with its wall time
            fusion_secs = [h.get("fusion-seconds", float("nan")) for h in strategy.history[-setup.repeats:]]
            base = med[("fedavg", key[1])]
            row.update({
                "wall": med[key]["wall"], "cpu": med[key]["cpu"], "wall-all": times[key]["wall"],
                "cpu-all": times[key]["cpu"], "fusion-seconds": float(np.median(fusion_secs)),
                "validation-share": float(np.median([max(0.0, 1 - f / w)
                                                     for f, w in zip(fusion_secs, times[key]["wall"])])),
                "x-fedavg": med[key]["wall"] / base["wall"], "x-fedavg-cpu": med[key]["cpu"] / base["cpu"],
                "x-local-epoch": med[key]["wall"] / epoch["wall"], "x-local-epoch-cpu": med[key]["cpu"] / epoch["cpu"],
                "valid": hist.get("valid"), "fallback": hist.get("fallback"), "guard": hist.get("guard"),
                "streamed": bool(strategy.streaming_round(SERVER_ROUND)),
                "guarded-calls": sum(1 for h in strategy.history if h.get("guard")),
                "fusion-info": hist.get("fusion-info"),
            })
            if hist.get("valid") != key[1]:
                raise RuntimeError(f"scaling: {key[0]} with {key[1]} clients accepted {hist.get('valid')} replies "
                                   f"(rejected: {hist.get('rejected')}); the constructed replies break the contract")
        growth = {}
        for name in strategies:
            ns = list(client_counts)
            fit = fit_growth(ns, [rows[(name, n)]["wall"] for n in ns])
            fit["slope-local-epochs"] = fit["slope"] / epoch["wall"]
            fit["intercept-local-epochs"] = fit["intercept"] / epoch["wall"]
            cpu_fit = fit_growth(ns, [rows[(name, n)]["cpu"] for n in ns])
            fit["cpu-slope-local-epochs"] = cpu_fit["slope"] / epoch["cpu"]
            fit["cpu-exponent"] = cpu_fit["exponent"]
            # the client count at which this round's aggregation costs one local epoch (linear fit)
            fit["clients-at-one-epoch"] = ((epoch["wall"] - fit["intercept"]) / fit["slope"]
                                           if fit["slope"] > 0 else float("inf"))
            if memory:
                for measure, key in (("tracemalloc-peak", "tracemalloc"), ("torch-peak", "torch"),
                                     ("retained-after-round", "retained")):
                    fit[f"{key}-bytes-per-client"] = fit_growth(ns, [rows[(name, n)]["memory"][measure]
                                                                     for n in ns])["slope"]
            growth[name] = fit
        return {"setup": asdict(setup), "strategies": strategies, "clients": client_counts,
                "input-shape": list(input_shape), "num-classes": num_classes, "fusion-size": int(len(fusion_x)),
                "model-bytes": model_bytes(global_model), "local-epoch": epoch, "local-epoch-all": times[LOCAL_EPOCH],
                "rows": list(rows.values()), "growth": growth}
    finally:
        gc.unfreeze()


# ------------------------------------------------------------------------------------------ report
def _mb(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _info_text(row: dict[str, Any]) -> str:
    """The round's notable diagnostics: fallback, guard, FedDF/refine epochs."""
    parts = []
    if row.get("fallback"):
        parts.append(f"fallback: {row['fallback'][:60]}")
    if row.get("guarded-calls"):
        parts.append(f"guard used the average ({row['guarded-calls']} calls)")
    info = row.get("fusion-info") or {}
    for key in ("refine", "distill-epochs", "distill-best-epoch"):
        if key in info:
            parts.append(f"{key}={info[key]}")
    if "calibration-gap-before" in info:
        parts.append(f"calibration {'skipped' if info.get('calibration-skipped') else 'fired'} "
                     f"(gap {info['calibration-gap-before']:.2f})")
    if row.get("streamed"):
        parts.append("streamed")
    return "; ".join(parts) or "–"


def _crossing(fit: dict[str, float]) -> str:
    """The client count at which the linear fit reaches one local epoch, in words."""
    n = fit["clients-at-one-epoch"]
    if not np.isfinite(n):
        return "never (no growth)" if fit["intercept-local-epochs"] < 1 else "every count"
    if n < 1:
        return "every count (the fixed part alone exceeds one epoch)"
    return f"≈ {n:.0f}"


def render_table(res: dict[str, Any], command: str) -> str:
    s = res["setup"]
    epoch = res["local-epoch"]
    lines = [
        "# Cost as clients grow: one round's server aggregation vs clients",
        "",
        f"Command: `{command}`",
        "",
        f"Tiny MLP {s['width']}×{s['depth']} on MNIST-1D (input {res['input-shape']}, {res['num-classes']} classes, "
        f"{res['model-bytes']} bytes of weights); fusion set {res['fusion-size']} samples. Clients: one global model "
        f"({s['warmup_epochs']} central epochs) after one local epoch each (SGD momentum 0.9, lr {s['lr']}, batch "
        f"{s['batch_size']}) on its own {s['shard_size']}-sample shard with Dirichlet(α = {s['alpha']}) label skew; "
        f"`kf-linear`'s clients send {s['importance']} scores. Real `flwr.app.Message` replies through each "
        "strategy's `aggregate_train` (validation + fusion + guard + refine), the ServerApp's default options. "
        f"Median of {s['repeats']} interleaved repeats in one process; the machine was shared, so the ratios are "
        "the result, the seconds are only this run's.",
        "",
        f"One client's local epoch (this run): {epoch['wall'] * 1e3:.1f} ms wall, {epoch['cpu'] * 1e3:.1f} ms CPU "
        f"({s['shard_size']} samples, {-(-s['shard_size'] // s['batch_size'])} SGD steps).",
        "",
        "## Aggregation time per round",
        "",
    ]
    rows = sorted(res["rows"], key=lambda r: (res["strategies"].index(r["strategy"]), r["clients"]))
    lines.append(markdown_table(
        ["strategy", "clients", "× FedAvg", "× FedAvg (CPU time)", "× local epoch", "× local epoch (CPU time)",
         "validation share", "ms (this run)", "round notes"],
        [[r["strategy"], r["clients"], f"{r['x-fedavg']:.2f}", f"{r['x-fedavg-cpu']:.2f}", f"{r['x-local-epoch']:.3f}",
          f"{r['x-local-epoch-cpu']:.3f}",
          f"{r['validation-share']:.0%}",
          f"{r['wall'] * 1e3:.1f}", _info_text(r)] for r in rows]))
    lines += ["", "*validation share*: the part of the call outside the strategy's own fusion timer (reply "
              "validation: deserialising and checking every array, building `ClientUpdate`s), median over the "
              "timed calls. Wall-time ratios are inflated unevenly when other jobs load the machine; the CPU-time "
              "ratios (this process, one torch thread) are the steadier of the two. *streamed*: the round ran as a "
              "stream over the replies (`FusionStrategy.aggregate_streaming`, `average` and `fedavg`): each reply "
              "validated, added to a running float64 weighted sum and dropped; the calibration check's client "
              "ensemble is re-read from the replies one at a time only when the calibration fired. "
              "`average[calibrate_min_gap=0.99]` is the default in a round whose calibration does not fire (in the "
              "issue-12 runs the prior gap stays below the default 0.2 in most rounds).", "",
              "## Growth with the number of clients", ""]
    lines.append(markdown_table(
        ["strategy", "local epochs per added client", "(CPU time)", "fixed part (local epochs)",
         "ms per added client (this run)", "log-log exponent", "(CPU time)",
         "clients at which a round costs one local epoch"],
        [[name, f"{g['slope-local-epochs']:.4f}", f"{g['cpu-slope-local-epochs']:.4f}",
          f"{g['intercept-local-epochs']:.2f}", f"{g['slope'] * 1e3:.3f}", f"{g['exponent']:.2f}",
          f"{g['cpu-exponent']:.2f}", _crossing(g)] for name, g in res["growth"].items()]))
    lines += ["", "Least-squares line through the medians at "
              f"{', '.join(str(n) for n in res['clients'])} clients; the exponent is the slope of log time vs "
              "log clients (1 = linear)."]
    mem_rows = [r for r in rows if "memory" in r]
    if mem_rows:
        lines += ["", "## Server memory per round (MiB)", ""]
        lines.append(markdown_table(
            ["strategy", "clients", "tracemalloc peak", "torch CPU tensors peak", "RSS peak delta",
             "kept after the round"],
            [[r["strategy"], r["clients"], _mb(r["memory"]["tracemalloc-peak"]), _mb(r["memory"]["torch-peak"]),
              _mb(r["memory"]["rss-peak-delta"]), _mb(r["memory"]["retained-after-round"])] for r in mem_rows]))
        lines += ["", markdown_table(
            ["strategy", "tracemalloc KiB per added client", "torch KiB per added client",
             "kept KiB per added client"],
            [[name, f"{g['tracemalloc-bytes-per-client'] / 1024:.1f}", f"{g['torch-bytes-per-client'] / 1024:.1f}",
              f"{g['retained-bytes-per-client'] / 1024:.1f}"] for name, g in res["growth"].items()]),
            "Methods: *tracemalloc peak* = Python objects and numpy buffers (the deserialised reply arrays and "
            "their `ClientUpdate` copies; torch's CPU allocator is invisible to it); *torch CPU tensors peak* = "
            "peak live bytes of torch CPU allocations from the `torch.profiler` memory events (rebuilt client "
            "modules, activations, fits); *RSS peak delta* = process RSS sampled every 2 ms from "
            "`/proc/self/statm` after `malloc_trim(0)`, a lower bound (freed memory is reused); *kept after the "
            "round* = tracemalloc bytes still held by the strategy once the round's result is dropped "
            "(`last_updates` of the strategies that keep every reply, history; a streamed round keeps none). The reply messages themselves (what Flower's grid hands to "
            "`aggregate_train`) are allocated before the call and not counted. Each measure is one untimed call "
            "on a fresh strategy object."]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epoch = res["local-epoch"]["wall"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for name in res["strategies"]:
        rs = sorted((r for r in res["rows"] if r["strategy"] == name), key=lambda r: r["clients"])
        ax.plot([r["clients"] for r in rs], [r["wall"] / epoch for r in rs], "o-", label=name)
    ax.axhline(1.0, color="k", ls="--", lw=1, label="one client's local epoch")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sampled clients per round")
    ax.set_ylabel("aggregation time / one local epoch")
    ax.set_title("Aggregation time (median, same process)")
    ax.legend(fontsize=8)
    ax = axes[1]
    if any("memory" in r for r in res["rows"]):
        for name in res["strategies"]:
            rs = sorted((r for r in res["rows"] if r["strategy"] == name and "memory" in r), key=lambda r: r["clients"])
            ax.plot([r["clients"] for r in rs],
                    [(r["memory"]["tracemalloc-peak"] + r["memory"]["torch-peak"]) / 2**20 for r in rs], "o-",
                    label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sampled clients per round")
        ax.set_ylabel("MiB (tracemalloc peak + torch peak)")
        ax.set_title("Server memory per round")
        ax.legend(fontsize=8)
    else:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_mnist1d(fusion_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(pool x, pool y, fusion x, classes)``: MNIST-1D's training split minus a class-balanced fusion set."""
    from fedfuse.data import load_source
    from fedfuse.data.fusion_set import fusion_set

    train_set, _ = load_source("mnist1d", seed=seed)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(train_set))
    reserved, rest = perm[: 3 * fusion_size], perm[3 * fusion_size:]
    fx, fy = fusion_set(train_set, size=fusion_size, source="public", partitions=None, reserved=reserved, seed=seed,
                        return_labels=True)
    pool = torch.as_tensor(rest)
    return train_set.x[pool], train_set.y[pool], fx, train_set.num_classes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ScalingSetup()
    ap.add_argument("--clients", default=",".join(str(n) for n in DEFAULT_CLIENTS))
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    ap.add_argument("--width", type=int, default=d.width)
    ap.add_argument("--depth", type=int, default=d.depth)
    ap.add_argument("--shard-size", type=int, default=d.shard_size)
    ap.add_argument("--val-size", type=int, default=d.val_size)
    ap.add_argument("--alpha", type=float, default=d.alpha)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup-epochs", type=int, default=d.warmup_epochs)
    ap.add_argument("--importance", default=d.importance, help="uniform | deeplift | conductance")
    ap.add_argument("--fusion-size", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--no-memory", action="store_true", help="skip the memory measures")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", default="results/scaling")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # one INFO line per aggregate_train call otherwise
    setup = ScalingSetup(width=args.width, depth=args.depth, shard_size=args.shard_size, val_size=args.val_size,
                         alpha=args.alpha, lr=args.lr, warmup_epochs=args.warmup_epochs, importance=args.importance,
                         repeats=args.repeats, seed=args.seed)
    clients = [int(n) for n in split_list(args.clients)]
    strategies = split_list(args.strategies)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    pool_x, pool_y, fusion_x, classes = load_mnist1d(args.fusion_size, args.seed)
    res = run_scaling(pool_x, pool_y, fusion_x, classes, clients, strategies, setup, memory=not args.no_memory,
                      log=lambda s: print(f"[scaling {time.perf_counter() - t0:6.1f}s] {s}", flush=True))
    res["load-average"] = {"start": load0, "end": os.getloadavg(), "cpus": os.cpu_count()}
    res["seconds"] = time.perf_counter() - t0
    command = "python -m simulations.bench.scaling " + " ".join(sys.argv[1:] if argv is None else argv)
    res["command"] = command.strip()
    out = Path(args.out)
    write_json(res, out / "scaling.json")
    (out / "table.md").write_text(render_table(res, res["command"]))
    plot(res, out / "time_vs_clients.png")
    print((out / "table.md").read_text())
    print(f"wrote {out}/table.md, scaling.json, time_vs_clients.png in {res['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
