"""Round steps: what a strategy does to the round's aggregate before it becomes the global model.

Each step is a small object called as ``step(model, round) -> (model, info)``; ``round`` is the
``RoundData`` of the round (client models, weights, fusion set, the global model sent). A strategy runs
its steps in order after its aggregation (``FusionStrategy.post_steps``), so a plug-in adds a step by
overriding that method. The steps:

- ``DivergenceGuard``: replaces a fused model that agrees much less with the clients' ensemble on the
  fusion set than their weighted average does (a safeguard against a fusion that breaks the model).
- ``ServerMomentum``: FedAvgM's server step on the aggregate's pseudo-gradient (Hsu et al., "Measuring the
  Effects of Non-Identical Data Distribution for Federated Visual Classification", arXiv 1909.06335).
- ``Refinement``: ``calibrate`` (classifier bias moved to the federation's class prior) and/or ``distill``
  (FedDF's ensemble distillation, Lin et al., arXiv 2006.07242), kept only when it moves the model towards
  the clients' ensemble (KL on the fusion set).
- ``StaticBatchNorm``: HeteroFL's static batch normalisation (running statistics re-estimated on the
  fusion set).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from logging import WARNING
from typing import Any, Callable

import torch
from flwr.common.logger import log
from torch import nn

from fedfuse.fusion import MissingInputError, check_finite
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.fusion.refine import classifier_bias, kl_to, refine_model
from fedfuse.hetero import reestimate_batchnorm
from fedfuse.training import resolve_device
from fedfuse.flower.round.options import GuardOptions, MomentumOptions, RefineOptions
from fedfuse.flower.round.protocol import array_copy
from fedfuse.flower.round.replies import ClientUpdate, bounded_class_counts


@dataclass
class RoundData:
    """What the steps of one round may read.

    Attributes:
        server_round: the round (resumed runs: the true round).
        updates: the valid replies in fusion order (metrics only in a streamed round).
        weights: their normalised aggregation weights.
        fusion_inputs: the server fusion set ``[B, *input_shape]`` or ``None``.
        build_model: ``state dict -> nn.Module`` of the strategy's architecture(s).
        average: ``() -> state dict``: the round's weighted average (the guard's reference).
        teachers: the client models (built once per round, or ``None`` when no step needs them).
        global_arrays: the global model sent this round (Flower ``ArrayRecord``) or ``None``.
        method: the round's aggregation name (for messages).
        seed, device: the round's seed and the server device.
    """

    server_round: int
    updates: list[ClientUpdate]
    weights: list[float]
    fusion_inputs: torch.Tensor | None
    build_model: Callable[[dict[str, torch.Tensor]], nn.Module]
    average: Callable[[], dict[str, torch.Tensor]]
    teachers: list[nn.Module] | None = None
    global_arrays: Any = None
    method: str = ""
    seed: int = 0
    device: str = "cpu"

    def client_models(self) -> list[nn.Module]:
        if self.teachers is None:
            self.teachers = [self.build_model(u.state) for u in self.updates]
        return self.teachers


class DivergenceGuard:
    """Use the weighted average instead of the fused model when the fused model's KL to the clients' ensemble on
    the fusion set is above ``ratio`` × the average's + 0.05 nats, or not finite. Logged (WARNING) and returned as
    ``info["guard"]`` (the round's record)."""

    def __init__(self, ratio: float = 2.0) -> None:
        self.ratio = GuardOptions(ratio=ratio).ratio   # the check, written once (``fedfuse.flower.round.options``)

    def __call__(self, fused: nn.Module, rd: RoundData) -> tuple[nn.Module, dict[str, Any]]:
        x = torch.as_tensor(rd.fusion_inputs).float()
        target = teacher_probs(rd.client_models(), x, rd.weights)
        average = rd.build_model(rd.average())
        with torch.no_grad():
            fused_logits = fused(x)
            kl_fused = kl_to(target, fused_logits) if bool(torch.isfinite(fused_logits).all()) else float("inf")
            kl_avg = kl_to(target, average(x))
        info: dict[str, Any] = {"guard-kl-fused": kl_fused, "guard-kl-average": kl_avg}
        if not kl_fused <= self.limit(kl_avg):  # also catches NaN
            reason = (f"average: the fused model's KL to the clients' ensemble on the fusion set is {kl_fused:.4g}, "
                      f"above {self.ratio:g} x the weighted average's {kl_avg:.4g} + 0.05")
            log(WARNING, "aggregate_train: round %d: divergence guard: %s; this round uses the weighted average",
                rd.server_round, reason)
            info["guard"] = reason
            return average, info
        return fused, info

    def limit(self, kl_reference: float) -> float:
        """The highest KL to the clients' ensemble a model may have against a reference's (the guard's rule, written
        once: the tier guard of ``fedfuse.flower.tiers.tier_models`` reads it too)."""
        return self.ratio * kl_reference + 0.05


class ServerMomentum:
    """FedAvgM's step on the round's aggregate ``a``: ``v = m·v + (a − x)``, ``x_new = x + lr·v`` with ``x`` the global
    model sent this round. The first step (no momentum yet) with ``lr = 1`` is ``a`` itself. Buffers (BatchNorm's
    running mean / variance and counters) keep the aggregate's values: they are estimates, not trained weights, and
    a momentum step extrapolates them (a running variance stepped below zero turns every output NaN:
    docs/multi-round.md, "How `average` aggregates"). ``info["step-norm"]`` is ``||x_new − x||`` over the parameters."""

    def __init__(self, momentum: float, learning_rate: float = 1.0) -> None:
        options = MomentumOptions(float(momentum), learning_rate)   # the checks, written once
        self.momentum, self.learning_rate = options.momentum, options.learning_rate
        self.velocity: dict[str, torch.Tensor] | None = None   # v, over the floating-point arrays

    @property
    def active(self) -> bool:
        return self.momentum > 0 or self.learning_rate != 1

    def reset(self) -> None:
        self.velocity = None

    def snapshot(self) -> dict[str, torch.Tensor] | None:
        """A copy of the velocity (``None`` before the first step)."""
        return None if self.velocity is None else {k: t.clone() for k, t in self.velocity.items()}

    def swap(self, velocity: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """Set the velocity to ``velocity`` and return the one it had (a candidate step taken and undone)."""
        old, self.velocity = self.velocity, velocity
        return old

    def restart_at(self, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
        """Restart the velocity at the step just taken from ``before`` to ``after``: ``v = after − before`` over the
        floating-point arrays (a round whose model another aggregation chose)."""
        self.velocity = {k: (v.to(torch.float64) - before[k].to(torch.float64))
                         for k, v in after.items() if v.is_floating_point()}

    def remap(self, fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
        """Apply ``fn`` to the velocity (its units reordered with the model's), if there is one."""
        if self.velocity is not None:
            self.velocity = fn(self.velocity)

    def __call__(self, model: nn.Module, rd: RoundData) -> tuple[nn.Module, dict[str, Any]]:
        if rd.global_arrays is None:
            return model, {}
        state = model.state_dict()
        prev = {k: torch.from_numpy(array_copy(rd.global_arrays[k], state[k])) for k in state}
        buffers = {k for k, _ in model.named_buffers()}
        floats = {k for k, v in state.items() if v.is_floating_point() and k not in buffers}
        first = self.velocity is None or not floats <= set(self.velocity)
        if first:
            self.velocity = {k: torch.zeros_like(state[k], dtype=torch.float64) for k in floats}
        else:   # a velocity seeded over every float array (strategy 'auto's choice) steps the parameters only
            self.velocity = {k: self.velocity[k] for k in floats}
        new, sq = {}, 0.0
        for k, a in state.items():
            if k not in floats:
                new[k] = a
                continue
            x = prev[k].to(torch.float64)
            v = self.velocity[k].mul_(self.momentum).add_(a.to(torch.float64) - x)
            step = v if self.learning_rate == 1 else self.learning_rate * v
            sq += float(torch.linalg.vector_norm(step)) ** 2
            new[k] = a if first and self.learning_rate == 1 else (x + step).to(a.dtype)
        model.load_state_dict(new)
        return model, {"step-norm": sq ** 0.5}


def class_prior(prior: str, updates: list[ClientUpdate]) -> tuple[torch.Tensor | None, str]:
    """``(prior [classes] or None = uniform, name)`` of ``calibrate``: ``"class-counts"`` (the sum of the counts the
    clients report; ``MissingInputError`` when one does not), ``"uniform"``, or ``"auto"`` (counts when every reply
    has them)."""
    counts = [u.class_counts for u in updates]
    have = all(c is not None for c in counts) and len({len(c) for c in counts}) == 1
    if prior == "uniform" or (prior == "auto" and not have):
        return None, "uniform"
    if not have:
        missing = [u.node_id for u in updates if u.class_counts is None]
        raise MissingInputError(f"prior='class-counts' needs 'class-counts' in every client's metrics; nodes "
                                f"{missing} sent none (or lists of different lengths)")
    return torch.tensor([bounded_class_counts(u) for u in updates], dtype=torch.float).sum(0), "class-counts"


class Refinement:
    """The ``refine`` steps (``fedfuse.fusion.refine``) on the aggregate, on the fusion set.

    Args:
        steps: parsed refine steps (``("calibrate",)``, ``("distill",)``, both).
        prior: the class prior of ``calibrate`` (``PRIORS``).
        check: keep the refinement only when KL(clients' ensemble ‖ model) on the fusion set is not higher after
            it than before (``info["refine-kept"]``); otherwise the round uses the unrefined aggregate.
        calibrate_min_gap: ``calibrate`` acts only when the aggregate's mean prediction on the fusion set is off the
            prior by at least this much for some class.
        prior_fn: ``updates -> (prior or None, name)`` instead of ``class_prior(prior, updates)``.
    """

    def __init__(self, steps: tuple[str, ...], *, prior: str = "auto", check: bool = True,
                 calibrate_min_gap: float = 0.2,
                 prior_fn: Callable[[list[ClientUpdate]], tuple[torch.Tensor | None, str]] | None = None) -> None:
        options = RefineOptions(None, prior, check, calibrate_min_gap)   # the checks, written once
        self.steps = tuple(steps)
        self.prior, self.check, self.calibrate_min_gap = options.prior, options.check, options.calibrate_min_gap
        self.prior_fn = prior_fn or (lambda updates: class_prior(self.prior, updates))

    def _refine(self, model: nn.Module, rd: RoundData, teachers, weights) -> tuple[nn.Module, dict[str, Any]]:
        prior, prior_name = self.prior_fn(rd.updates)
        info: dict[str, Any] = {"refine": "+".join(self.steps), "prior": prior_name}
        dev = resolve_device(rd.device)
        info.update(refine_model(model.to(dev), self.steps, teachers=teachers, weights=weights,
                                 fusion_inputs=rd.fusion_inputs, prior=prior, seed=rd.seed,
                                 calibrate_min_gap=self.calibrate_min_gap, device=dev))
        return model.cpu().eval(), info

    def __call__(self, model: nn.Module, rd: RoundData) -> tuple[nn.Module, dict[str, Any]]:
        before = copy.deepcopy(model) if self.check else None
        model, info = self._refine(model, rd, rd.teachers, rd.weights)
        if before is not None:
            x = torch.as_tensor(rd.fusion_inputs).float()
            target = teacher_probs(rd.client_models(), x, rd.weights)
            with torch.no_grad():
                kl_before, kl_after = kl_to(target, before(x)), kl_to(target, model(x))
            kept = kl_after <= kl_before
            model = model if kept else before.eval()
            info.update({"refine-kl-before": kl_before, "refine-kl-after": kl_after, "refine-kept": int(kept)})
        check_finite(f"{rd.method} (refined)", model)
        return model, info

    def streamed(self, model: nn.Module, rd: RoundData,
                 ensemble: Callable[[], torch.Tensor] | None) -> tuple[nn.Module, dict[str, Any]]:
        """The same on a streamed average (no client models kept): ``calibrate`` moves only the classifier bias, so
        the check puts the old bias back for one forward pass; ``ensemble()`` re-reads the round's replies for the
        clients' ensemble on the fusion set, only when the calibration fired."""
        checking = self.check and ensemble is not None
        bias_before = classifier_bias(model).detach().clone() if checking else None
        model, info = self._refine(model, rd, None, None)
        if checking and not info.get("calibration-skipped"):
            x = torch.as_tensor(rd.fusion_inputs).float()
            with torch.no_grad():
                bias = classifier_bias(model)
                bias_after = bias.detach().clone()
                logits_after = model(x)
                bias.copy_(bias_before)
                logits_before = model(x)
                target = ensemble()
                kl_before, kl_after = kl_to(target, logits_before), kl_to(target, logits_after)
                kept = kl_after <= kl_before
                if kept:
                    bias.copy_(bias_after)
            info.update({"refine-kl-before": kl_before, "refine-kl-after": kl_after, "refine-kept": int(kept)})
        check_finite(f"{rd.method} (refined)", model)
        return model, info


class StaticBatchNorm:
    """HeteroFL's static batch normalisation: the aggregate's BatchNorm running statistics re-estimated on the
    fusion set (``info["static-bn"]``; a model without BatchNorm is unchanged)."""

    def __call__(self, model: nn.Module, rd: RoundData) -> tuple[nn.Module, dict[str, Any]]:
        if rd.fusion_inputs is None:
            return model, {}
        if reestimate_batchnorm(model, rd.fusion_inputs, device=resolve_device(rd.device)):
            return model, {"static-bn": True}
        return model, {}


__all__ = ["RoundData", "DivergenceGuard", "ServerMomentum", "Refinement", "StaticBatchNorm", "class_prior"]
