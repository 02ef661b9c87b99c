"""The broadcast guard: a global model whose outputs are not finite is never sent to the clients.

The divergence guard and the reply contract look at weights; a model can hold finite weights and still output NaN
(a BatchNorm running variance below zero, an overflow in a deep residual stack). Every round, after the strategy
has aggregated (and derived its tier models), ``guard_broadcast`` runs the new global model on a probe batch
(the server's fusion inputs, else the test inputs; inputs only, no labels). Where any output is non-finite the
round falls back to the last global model: Flower's ``Strategy.start`` keeps the arrays it sent when
``aggregate_train`` returns none. The round's history record gets ``fallback`` ("previous: ...") and
``broadcast-guard`` (the reason, and the replies, with their tiers, whose own models output non-finite values
or whose arrays hold them), the strategy forgets its server state (momentum) as after any fallback, and a WARNING
says so. A run every round of which falls back fails as "fusion never succeeded" (``fedfuse.results``).

The guard is the last line. Before any aggregation the divergence screen (``fedfuse.flower.round.divergence``) drops a
reply whose own model outputs non-finite values on the same probe, or whose weights are outsized against the round's
others, and the round aggregates the rest: one such client no longer costs the round. ``guard_broadcast`` hands the
probe to the strategy for it (``reply_probe``).
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

import torch
from flwr.common.logger import log

from fedfuse.training import predict_logits

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
