"""TEST-ONLY fault injection (off by default): make chosen clients crash, hang, exit or send bad replies.

Used by ``tests/test_faults.py``, ``tests/test_deployment.py`` and ``tests/test_resume.py`` to exercise
fedfuse's fault handling in real Flower runs. Never set it in a real experiment.

Two ways to switch it on:

- run-config ``test-faults`` (simulation and deployment): comma-separated ``TARGET:FAULT[@ROUND]``
  entries. ``TARGET`` is a partition id, ``*`` (every client) or ``fusion`` (the server's fusion step);
  ``@ROUND`` limits the entry to one server round. Example: ``"2:crash,3:nan,4:sleep:40@2,fusion:error@2"``.
- node-config ``fault`` of one SuperNode (deployment): ``FAULT[@ROUND]``, e.g.
  ``flower-supernode ... --node-config "partition-id=2 num-partitions=3 fault='crash@2'"``.

Client faults: ``crash`` (the ClientApp raises), ``exit`` (the ClientApp process dies: ``os._exit``),
``sleep:SECONDS`` (hangs before training; a round-timeout shorter than that drops it), ``nan`` / ``inf``
(non-finite weights), ``shape`` (a weight with the wrong shape), ``dtype`` (float64 weights),
``neg-scores``, ``no-scores``, ``short-scores`` (importance scores negative / missing / wrong length),
``num-examples`` (an absurd sample count). Server fault: ``fusion:error`` (the fusion method raises, so
the configured ``fusion-fallback`` is taken).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

CLIENT_FAULTS = ("crash", "exit", "sleep", "nan", "inf", "shape", "dtype", "neg-scores", "no-scores",
                 "short-scores", "num-examples")
SERVER_FAULTS = ("error",)
ABSURD_NUM_EXAMPLES = 10**12


@dataclass(frozen=True)
class Fault:
    target: str          # partition id as text, "*", or "fusion"
    kind: str            # one of CLIENT_FAULTS / SERVER_FAULTS
    seconds: float = 0.0  # for sleep
    round: int | None = None

    def applies(self, server_round: int) -> bool:
        return self.round is None or self.round == server_round


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
    seconds = 0.0
    if kind == "sleep":
        try:
            seconds = float(arg)
        except ValueError:
            raise ValueError(f"fault 'sleep' needs seconds, e.g. 'sleep:30', got {spec!r}") from None
    return Fault(target=target, kind=kind, seconds=seconds, round=rnd)


def parse_faults(text: str) -> list[Fault]:
    """``"2:crash,3:sleep:30@2,fusion:error"`` → ``[Fault, ...]`` (``ValueError`` on a bad entry)."""
    faults = []
    for entry in (e.strip() for e in text.split(",")):
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


def server_fusion_fault(run_faults: str, server_round: int) -> Fault | None:
    return next((f for f in parse_faults(run_faults) if f.target == "fusion" and f.applies(server_round)), None)


def before_training(fault: Fault | None) -> None:
    """Faults that hit before any work: crash, exit, sleep."""
    if fault is None:
        return
    if fault.kind == "crash":
        raise RuntimeError("fedfuse test fault: injected ClientApp crash")
    if fault.kind == "exit":
        os._exit(17)  # the ClientApp process dies without replying
    if fault.kind == "sleep":
        time.sleep(fault.seconds)


def corrupt_reply(fault: Fault | None, state: dict, scores: dict | None, metrics: dict) -> tuple[dict, dict | None, dict]:
    """Faults that make the reply bad (the server must reject it); returns new (state, scores, metrics)."""
    import torch

    if fault is None or fault.kind in ("crash", "exit", "sleep"):
        return state, scores, metrics
    state = {k: v.clone() for k, v in state.items()}
    first = next(k for k, v in state.items() if v.is_floating_point())
    if fault.kind in ("nan", "inf"):
        state[first].view(-1)[0] = float("nan") if fault.kind == "nan" else float("inf")
    elif fault.kind == "shape":
        state[first] = torch.zeros(*state[first].shape[:-1], state[first].shape[-1] + 1)
    elif fault.kind == "dtype":
        state = {k: (v.double() if v.is_floating_point() else v) for k, v in state.items()}
    elif fault.kind == "num-examples":
        metrics = {**metrics, "num-examples": ABSURD_NUM_EXAMPLES}
    elif scores is not None or fault.kind == "no-scores":
        if fault.kind == "no-scores":
            scores = None
        elif fault.kind == "neg-scores":
            scores = {k: -v.abs() - 1.0 for k, v in scores.items()}
        elif fault.kind == "short-scores":
            scores = {k: v[:-1] for k, v in scores.items()}
    return state, scores, metrics
