"""TEST-ONLY fault injection for fedfuse's Flower apps: a ClientApp mod and a wrapper strategy.

Nothing in the product imports this. ``tests/support/fault_app.py`` installs both into fedfuse's own
ServerApp/ClientApp (``make_server_app``/``run_server``, ``make_client_app(mods=...)``), the way Flower's
``*_mod``s and differential-privacy wrapper strategies are installed.

Fault spec (run-config key ``test-faults`` of the *test* app; ``FAULTS_KEY``): comma-separated
``TARGET:FAULT[@ROUND]`` entries. ``TARGET`` is a partition id, ``*`` (every client) or ``fusion`` (the
server's fusion step); ``@ROUND`` limits the entry to one server round. Example:
``"2:crash,3:nan,4:sleep:40@2,fusion:error@2"``. One SuperNode can also get its own fault through its
node-config ``fault`` (deployment): ``FAULT[@ROUND]``, e.g. ``--node-config "... fault='crash@2'"``.

Client faults (``fault_mod``): ``crash`` (the ClientApp raises), ``exit`` (the ClientApp process dies:
``os._exit``), ``sleep:SECONDS`` (hangs before training; a shorter round-timeout drops it), ``nan`` /
``inf`` (non-finite weights), ``scale:FACTOR`` (every floating-point weight × FACTOR, e.g. ``scale:1e20``: finite
weights whose model overflows), ``shape`` (a weight of the wrong shape), ``dtype`` (float64 weights),
``neg-scores``, ``no-scores``, ``short-scores`` (importance scores negative / missing / too short),
``num-examples`` (an absurd sample count), ``pad:MB`` (an extra weight of MB megabytes: an oversized reply). Server fault (``FusionFaultStrategy``): ``fusion:error``
(fusion raises a ``FusionError`` in that round, so the strategy's configured fallback is taken).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedfuse.fusion import FusionError

FAULTS_KEY = "test-faults"
CLIENT_FAULTS = ("crash", "exit", "sleep", "nan", "inf", "scale", "shape", "dtype", "neg-scores", "no-scores",
                 "short-scores", "num-examples", "pad")
SERVER_FAULTS = ("error",)
ABSURD_NUM_EXAMPLES = 10**12


class InjectedFusionError(FusionError):
    """The fusion failure ``FusionFaultStrategy`` injects."""


@dataclass(frozen=True)
class Fault:
    target: str          # partition id as text, "*", or "fusion"
    kind: str            # one of CLIENT_FAULTS / SERVER_FAULTS
    seconds: float = 0.0  # for sleep
    round: int | None = None
    factor: float = 1.0   # for scale; megabytes for pad

    def applies(self, server_round: int) -> bool:
        return self.round is None or self.round == server_round


# --------------------------------------------------------------------------------------- spec parsing
def _parse_one(target: str, spec: str) -> Fault:
    spec = spec.strip()
    rnd = None
    if "@" in spec:
        spec, r = spec.rsplit("@", 1)
        if not r.strip().isdigit():
            raise ValueError(f"bad round {r!r} in fault {spec!r}@{r}")
        rnd = int(r)
    kind, _, arg = spec.partition(":")
    kind = kind.strip()
    allowed = SERVER_FAULTS if target == "fusion" else CLIENT_FAULTS
    if kind not in allowed:
        raise ValueError(f"unknown fault {kind!r} for target {target!r}; choose one of {list(allowed)}")
    seconds, factor = 0.0, 1.0
    if kind == "sleep":
        try:
            seconds = float(arg)
        except ValueError:
            raise ValueError(f"fault 'sleep' needs seconds, e.g. 'sleep:30', got {spec!r}") from None
    if kind in ("scale", "pad"):
        try:
            factor = float(arg)
        except ValueError:
            raise ValueError(f"fault {kind!r} needs a number, e.g. 'scale:1e20' or 'pad:100', got {spec!r}") from None
    return Fault(target=target, kind=kind, seconds=seconds, round=rnd, factor=factor)


def parse_faults(text: str) -> list[Fault]:
    """``"2:crash,3:sleep:30@2,fusion:error"`` → ``[Fault, ...]`` (``ValueError`` on a bad entry)."""
    faults = []
    for entry in (e.strip() for e in str(text).split(",")):
        if not entry:
            continue
        target, sep, spec = entry.partition(":")
        target = target.strip()
        if not sep or not (target.isdigit() or target in ("*", "fusion")):
            raise ValueError(f"bad entry {entry!r}: expected TARGET:FAULT[@ROUND] with TARGET a partition id, "
                             "'*' or 'fusion'")
        faults.append(_parse_one(target, spec))
    return faults


def client_fault(run_faults: str, node_config: Mapping[str, Any], partition_id: int,
                 server_round: int) -> Fault | None:
    """The fault this client must inject in ``server_round`` (node-config ``fault`` wins), or ``None``."""
    node_fault = str(node_config.get("fault", "") or "")
    candidates = [_parse_one(str(partition_id), node_fault)] if node_fault else []
    candidates += [f for f in parse_faults(run_faults) if f.target in (str(partition_id), "*")]
    return next((f for f in candidates if f.applies(server_round)), None)


def fusion_fault_rounds(run_faults: str) -> set[int] | None:
    """Rounds in which fusion must fail: ``None`` = every round, ``set()`` = never."""
    faults = [f for f in parse_faults(run_faults) if f.target == "fusion"]
    if any(f.round is None for f in faults):
        return None
    return {f.round for f in faults if f.round is not None}


def without_faults_key(context: Context) -> Context:
    """The same context without the test-only ``test-faults`` key (the product config does not know it).

    ``state`` is the same object, so what the app stores there persists across rounds as usual.
    """
    return dataclasses.replace(context, run_config={k: v for k, v in context.run_config.items() if k != FAULTS_KEY})


# ------------------------------------------------------------------------------------ client mod
def fault_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower ClientApp mod: inject this node's fault (if any) into a ``train`` message's handling.

    ``crash``/``exit``/``sleep`` hit before the app runs; the other faults corrupt its reply.
    """
    faults_text = str(context.run_config.get(FAULTS_KEY, "") or "")
    inner_context = without_faults_key(context)
    if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
        return call_next(msg, inner_context)
    pid = int(context.node_config.get("partition-id", -1))
    config = msg.content["config"] if "config" in msg.content else ConfigRecord()
    server_round = int(config.get("server-round", 1))
    fault = client_fault(faults_text, context.node_config, pid, server_round)
    if fault is not None and fault.kind == "crash":
        raise RuntimeError("fedfuse test fault: injected ClientApp crash")
    if fault is not None and fault.kind == "exit":
        os._exit(17)  # the ClientApp process dies without replying
    if fault is not None and fault.kind == "sleep":
        time.sleep(fault.seconds)
    reply = call_next(msg, inner_context)
    if fault is not None and not reply.has_error():
        corrupt_reply(fault, reply)
    return reply


def corrupt_reply(fault: Fault, reply: Message) -> None:
    """Make a train reply bad the way ``fault`` says (in place); the server must reject it."""
    content = reply.content
    if fault.kind in ("nan", "inf", "scale", "shape", "dtype"):
        arrays = {k: a.numpy().copy() for k, a in content["arrays"].items()}
        first = next(k for k, a in arrays.items() if a.dtype.kind == "f")
        if fault.kind == "scale":
            arrays = {k: (a * np.asarray(fault.factor, a.dtype) if a.dtype.kind == "f" else a) for k, a in arrays.items()}
        elif fault.kind in ("nan", "inf"):
            arrays[first].reshape(-1)[0] = np.nan if fault.kind == "nan" else np.inf
        elif fault.kind == "shape":
            a = arrays[first]
            arrays[first] = np.zeros((*a.shape[:-1], a.shape[-1] + 1), dtype=a.dtype)
        else:
            arrays = {k: (a.astype(np.float64) if a.dtype.kind == "f" else a) for k, a in arrays.items()}
        content["arrays"] = ArrayRecord({k: Array(np.ascontiguousarray(a)) for k, a in arrays.items()})
    elif fault.kind == "pad":
        arrays = {k: a.numpy() for k, a in content["arrays"].items()}
        arrays["fedfuse-test-padding"] = np.zeros(int(fault.factor * 2**20) // 4, dtype=np.float32)
        content["arrays"] = ArrayRecord({k: Array(np.ascontiguousarray(a)) for k, a in arrays.items()})
    elif fault.kind == "num-examples":
        content["metrics"] = MetricRecord({**dict(content["metrics"]), "num-examples": ABSURD_NUM_EXAMPLES})
    elif "importance" in content or fault.kind == "no-scores":
        if fault.kind == "no-scores":
            if "importance" in content:
                del content["importance"]
            return
        scores = {k: a.numpy().copy() for k, a in content["importance"].items()}
        if fault.kind == "neg-scores":
            scores = {k: -np.abs(v) - 1.0 for k, v in scores.items()}
        elif fault.kind == "short-scores":
            scores = {k: v[:-1] for k, v in scores.items()}
        content["importance"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in scores.items()})


# ---------------------------------------------------------------------------------- wrapper strategy
class FusionFaultStrategy(Strategy):
    """Wraps any Flower strategy and makes its aggregation raise a ``FusionError`` in chosen rounds.

    For a fedfuse ``FusionStrategy`` the error is raised by its fusion step (its public ``fuse_fn``),
    so the strategy's own fallback handles it as it would a real fusion failure; for any other strategy
    ``aggregate_train`` itself raises.

    Args:
        strategy: the strategy to wrap.
        rounds: server rounds (true round numbers, resumed runs included) in which fusion fails;
            ``None`` = every round.
    """

    def __init__(self, strategy: Strategy, rounds: Iterable[int] | None = None) -> None:
        self.strategy = strategy
        self.rounds = None if rounds is None else set(rounds)
        self._round = 0
        inner_fuse = getattr(strategy, "fuse_fn", None)
        if inner_fuse is not None:
            def faulty_fuse(*args, **kwargs):
                if self._fails(self._round):
                    raise InjectedFusionError(f"fedfuse test fault: injected fusion failure in round {self._round}")
                return inner_fuse(*args, **kwargs)
            strategy.fuse_fn = faulty_fuse
        self._in_fusion = inner_fuse is not None

    def _fails(self, server_round: int) -> bool:
        return self.rounds is None or server_round in self.rounds

    def summary(self) -> None:
        self.strategy.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        self._round = server_round + int(getattr(self.strategy, "round_offset", 0))
        if not self._in_fusion and self._fails(self._round):
            raise InjectedFusionError(f"fedfuse test fault: injected fusion failure in round {self._round}")
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]):
        return self.strategy.aggregate_evaluate(server_round, replies)
