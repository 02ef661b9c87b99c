"""Divergence, checked twice a round: the screen on every reply before anything aggregates it, and the broadcast guard
on the new global model before it is sent.

**The divergence screen**: a reply whose model would make the global model non-finite or diverge is rejected before
anything aggregates it, by every strategy (not only the robust setting's screen), with a logged reason like any
malformed reply, and the round goes on with the others.

A reply can pass the reply contract (names, shapes, dtypes, finite weights) and still wreck the round: finite weights
× 1e20 average into a global model whose outputs overflow, so the broadcast guard (below) throws the
whole round away, every round. Two rules, on every train round, in ``RoundProtocol.check_reply`` (``protocol``):

1. **Outsized weights**: reply ``i`` is rejected when the L2 norm of its floating-point arrays is above
   ``OUTSIZED`` (100) × its reference, the larger of the median norm of the round's *other* readable replies and the
   norm of the global model sent. With no other reply there is no reference and the rule is silent. The median of
   the others (not of all) lets two replies judge each other: the larger of two can be rejected, the smaller never,
   and no round can lose every reply to this rule (the smallest reply is never above its reference).
   Measured on honest runs (the ratio of each reply's norm to its reference, every round): 1.14 by default, 1.15
   with 10 clients at Dirichlet α = 0.1, 1.02 with shards, 1.16 one-shot and warm start, 1.17 with width tiers
   (1, 0.5, 0.25), 1.84 for a CNN under SGD at lr 0.5, 1.36 for a ResNet, 1.16 for an MLP at 10 local epochs,
   1.31 on MNIST-1D at α = 0.05: 100 × leaves a margin of 50 over the largest. A reply 100 × the others' norm puts a
   global model at least 100 / n × theirs (n replies averaged): no training step, and a model whose outputs grow as
   that factor to the power of its depth.
2. **Non-finite outputs**: the reply's own model (the global architecture holding its weights) outputs a non-finite
   value on the probe inputs the broadcast guard uses (the server's fusion inputs, else its test inputs; the first
   ``PROBE``). A reply the global architecture cannot hold (a narrower tier's) is judged by rule 1 only.

Rejected replies are listed in the round's ``rejected`` with their partition id and a flag (``outsized-weights``, with
``norm-ratio``; ``non-finite-outputs``), so ``rounds.csv``'s ``rejected-reasons`` names the partition; they are never
aggregated, fused, voted with, nor counted in the clients' ensemble and per-client columns. A round every reply of
which has non-finite weights or outputs stops the run as diverged clients (``ClientsDivergedError``). The broadcast
guard stays the last line: an aggregate that is non-finite although every reply passed is still not broadcast.

**The broadcast guard**: a global model whose outputs are not finite is never sent to the clients.

The divergence guard and the reply contract look at weights; a model can hold finite weights and still output NaN
(a BatchNorm running variance below zero, an overflow in a deep residual stack). Every round, after the strategy
has aggregated (and derived its tier models), ``guard_broadcast`` runs the new global model on a probe batch
(the server's fusion inputs, else the test inputs; inputs only, no labels). Where any output is non-finite the
round falls back to the last global model: Flower's ``Strategy.start`` keeps the arrays it sent when
``aggregate_train`` returns none. The round's history record gets ``fallback`` ("previous: ...") and
``broadcast-guard`` (the reason, and the replies, with their tiers, whose own models output non-finite values
or whose arrays hold them), the strategy forgets its server state (momentum) as after any fallback, and a WARNING
says so. A run every round of which falls back fails as "fusion never succeeded" (``fedfuse.results``).

The guard is the last line. Before any aggregation the divergence screen (above) drops a
reply whose own model outputs non-finite values on the same probe, or whose weights are outsized against the round's
others, and the round aggregates the rest: one such client no longer costs the round. ``guard_broadcast`` hands the
probe to the strategy for it (``reply_probe``).
"""

from __future__ import annotations

from logging import WARNING
from typing import Any, Iterable, Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from flwr.common.logger import log

from fedfuse.flower.round.replies import _npy_view, _record
from fedfuse.training import predict_logits

OUTSIZED = 100.0   # rule 1: a reply's weight norm above this × the round's other replies' median (module docstring)

Reference = Mapping[str, tuple[tuple[int, ...], np.dtype]]


def squared_norm(arrays: Iterable[np.ndarray]) -> float:
    """The summed squares of the floating-point arrays, in float64 (finite float32 weights × 1e20 do not overflow)."""
    total = 0.0
    for a in arrays:
        if a.dtype.kind == "f" and a.size:
            flat = a.reshape(-1)
            total += float(np.dot(flat.astype(np.float64, copy=False), flat.astype(np.float64, copy=False)))
    return total


def record_norm(arrays: ArrayRecord, reference: Reference | None = None) -> float | None:
    """The L2 norm of an ``ArrayRecord``'s floating-point arrays (read in place where the ``.npy`` header is the
    expected one), or ``None`` when it cannot be read against ``reference`` (a missing name, another shape: the reply
    contract rejects it) or is not finite (the contract rejects NaN or Inf)."""
    try:
        if reference is None:
            views = [a.numpy() for a in arrays.values()]
        else:
            views = []
            for key, (shape, dtype) in reference.items():
                if key not in arrays:
                    return None
                a = _npy_view(arrays[key], shape, dtype)
                a = arrays[key].numpy() if a is None else a
                if tuple(a.shape) != tuple(shape):
                    return None
                views.append(a)
        norm = squared_norm(views) ** 0.5
    except (ValueError, TypeError, KeyError, OverflowError):
        return None
    return norm if np.isfinite(norm) else None


def reply_norm(msg: Message, arrays_key: str, reference: Reference) -> float | None:
    """``record_norm`` of a reply's arrays (``None`` without them)."""
    arrays = _record(msg.content, arrays_key, ArrayRecord)
    return None if arrays is None else record_norm(arrays, reference)


def outsized_replies(norms: Mapping[int, float], global_norm: float | None, limit: float = OUTSIZED
                     ) -> dict[int, dict[str, Any]]:
    """Rule 1 (module docstring): ``{key: {"reason", "norm-ratio"}}`` of the norms above ``limit`` × the larger of
    the median of the other norms and ``global_norm``; ``{}`` when ``limit`` is 0 or there is a single norm."""
    if limit <= 0 or len(norms) < 2:
        return {}
    out = {}
    for key, norm in norms.items():
        others = [v for k, v in norms.items() if k != key]
        median = float(np.median(others))
        reference = max(median, global_norm or 0.0)
        if reference > 0 and norm > limit * reference:
            ratio = norm / reference
            sent = f"; the global model sent: {global_norm:.3g}" if global_norm else ""
            out[key] = {"reason": f"its weights' norm {norm:.3g} is {ratio:.3g} × the round's reference {reference:.3g} "
                                  f"(the median of the other {len(others)} replies: {median:.3g}{sent}); above "
                                  f"{limit:g} × no training step gets there, and the global model would diverge",
                        "norm-ratio": ratio}
    return out


# ---------------------------------------------------------------- the broadcast guard
PROBE = 128   # inputs the guard runs the global model on: a NaN from BatchNorm or an overflow shows on any batch


def non_finite_outputs(model: torch.nn.Module, probe: torch.Tensor, device: Any = "cpu") -> str | None:
    """Why ``model``'s outputs on ``probe`` are not finite (``None`` when they are)."""
    with torch.no_grad():
        logits = predict_logits(model, probe, device=device)
    bad = ~torch.isfinite(logits)
    if bad.any():
        rows = int(bad.any(dim=-1).sum())
        return f"non-finite outputs on {rows} of {len(probe)} probe inputs"
    return None


def _reply_culprits(strategy, probe: torch.Tensor, device: Any) -> list[dict[str, Any]]:
    """The round's valid replies whose arrays hold non-finite values or whose own model outputs them (a reply
    the global architecture cannot hold, a narrower tier's, is judged on its arrays only)."""
    out = []
    for u in getattr(strategy, "last_updates", None) or []:
        why = next((f"non-finite values in {k!r}" for k, v in u.state.items()
                    if v.is_floating_point() and not torch.isfinite(v).all()), None)
        if why is None:
            try:
                model = strategy.build_model(u.state)
            except (RuntimeError, ValueError, KeyError):
                model = None
            why = non_finite_outputs(model, probe, device) if model is not None else None
        if why is not None:
            out.append({"node-id": u.node_id, "partition-id": u.partition_id, "tier": u.metrics.get("tier"),
                        "reason": why})
    return out


def guard_broadcast(strategy, probe: torch.Tensor | None, device: Any = "cpu") -> None:
    """Wrap ``strategy.aggregate_train`` (the instance's, so a wrapper strategy around it is covered too) with the
    broadcast guard on ``probe`` (the first ``PROBE`` of them); no probe, no guard (said once at WARNING)."""
    if probe is None or len(probe) == 0:
        log(WARNING, "fedfuse: broadcast guard off: the server has neither fusion nor test inputs to probe with")
        return
    probe = probe[:PROBE]
    strategy.reply_probe = probe   # the divergence screen's non-finite-outputs rule reads the same inputs
    inner = strategy.aggregate_train

    def aggregate_train(server_round, replies):
        arrays, metrics = inner(server_round, replies)
        if arrays is None:
            return arrays, metrics
        try:
            model = strategy.build_model(arrays.to_torch_state_dict())
        except (RuntimeError, ValueError, KeyError) as exc:   # not the global architecture: nothing to run
            log(WARNING, "fedfuse: broadcast guard: round %d: the global model could not be built to probe (%s)",
                server_round, exc)
            return arrays, metrics
        reason = non_finite_outputs(model, probe, device)
        if reason is None:
            return arrays, metrics
        culprits = _reply_culprits(strategy, probe, device)
        named = "; ".join(f"node {c['node-id']} (partition {c['partition-id']}"
                          + (f", tier {c['tier']}" if c["tier"] is not None else "") + f"): {c['reason']}"
                          for c in culprits) or "no single reply: the aggregate itself"
        record = strategy.history[-1] if getattr(strategy, "history", None) else {}
        record["fallback"] = f"previous: the new global model has {reason}"
        record["broadcast-guard"] = {"reason": reason, "replies": culprits}
        log(WARNING, "fedfuse: round %d: the new global model has %s; it is not broadcast, the round keeps the "
            "previous global model (replies: %s)", server_round + getattr(strategy, "round_offset", 0), reason, named)
        strategy.on_fallback()
        if metrics is not None:
            metrics["fell-back"] = 1
        return None, metrics

    strategy.aggregate_train = aggregate_train


__all__ = ["OUTSIZED", "squared_norm", "record_norm", "reply_norm", "outsized_replies", "PROBE", "non_finite_outputs",
           "guard_broadcast"]
