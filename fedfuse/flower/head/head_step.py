"""The head round as the last step of the round protocol: any strategy can end a run with it.

After the training rounds, ``HeadRoundStep`` asks the strategy what to solve (``RoundProtocol.head_plan``: the
global model's classifier by default; every width tier's model for ``TieredFusionStrategy``; every exit, checked on
its own, for depth tiers; every width's exits, each width on its own features, for width × depth tiers), runs the head round (``fedfuse.flower.head.head_round.HeadRound``: every node's ridge
statistics, the closed-form heads, the clients' check) and hands the kept models back
(``RoundProtocol.adopt_head``). A plug-in strategy gets the same by inheriting the protocol's two hooks, or
overrides them to solve something else; the ServerApp only records and evaluates the result.

The head round reads every node's labels once, as Fed3R's closed-form classifier does (Fanì et al., "Accelerating
Heterogeneous Federated Learning with Closed-form Classifiers", arXiv 2406.01116).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedfuse.flower.head.head_round import HeadRound
from fedfuse.flower.round.options import WEIGHT_CAP
from fedfuse.flower.trust.privacy import HeadPrivacy
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.choices import HEAD_SOLVERS


@dataclass(frozen=True)
class HeadRoundOptions:
    """The head round's options (run-config keys ``head-ridge``, ``head-solver``, ``round-timeout``,
    ``secure-aggregation``): ``solver`` is a name of ``fedfuse.choices.HEAD_SOLVERS`` or ``"best"`` (every one,
    the clients keep the best)."""

    ridge: float = 1e-3
    solver: str = "best"
    timeout: float | None = None
    secure: bool = False

    @property
    def solvers(self) -> tuple[str, ...]:
        return HEAD_SOLVERS if self.solver == "best" else (self.solver,)


@dataclass
class HeadPlan:
    """What a strategy's head round solves.

    Attributes:
        models: ``{width tier: model}``, the global model at tier 1 (width tiers: every tier's model).
        per_tier: solve and check every tier's classifier on its own (``HeadRound.run_tiers``).
        check_each: with several classifiers (a depth tier's exits), check each one on its own.
        sites: with ``per_tier``, the classifiers of each tier's model to solve (``fedfuse.progressive.head_sites``
            names; a tier not named: its own classifier); width × depth tiers: every width's exits its nodes use.
    """

    models: dict[float, nn.Module]
    per_tier: bool = False
    check_each: bool = False
    sites: dict[float, tuple[str, ...]] = field(default_factory=dict)


def ensemble_reference(strategy, model: nn.Module, inputs: torch.Tensor | None,
                       private: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The probabilities the solved head's temperature is fitted to: the last round's clients' ensemble on the fusion
    set, or (DP: no client model may be read) the released model's own on ``inputs``; ``None``: temperature 1."""
    if private:
        with torch.no_grad():
            return inputs.float(), torch.softmax(model.eval()(inputs.float()), -1)
    updates = strategy.last_updates
    if strategy.fusion_inputs is None or not updates:
        return None
    members = [strategy.build_model(u.state).eval() for u in updates]
    total = sum(u.num_examples for u in updates)
    x = strategy.fusion_inputs.float()
    with torch.no_grad():
        return x, teacher_probs(members, x, [u.num_examples / total for u in updates])


class HeadRoundStep:
    """The head round after the last training round of any ``RoundProtocol`` (see the module docstring)."""

    def __init__(self, options: HeadRoundOptions, privacy: HeadPrivacy | None = None) -> None:
        self.options = options
        self.privacy = privacy

    def __call__(self, grid, strategy, model: nn.Module, num_classes: int, final_round: int,
                 reference: tuple[torch.Tensor, torch.Tensor] | None, one_shot: bool = False
                 ) -> tuple[nn.Module, dict[str, Any]]:
        """``(the global model after the head round, the round's record)``; the strategy adopts every kept model."""
        o = self.options
        # the strategy's bounds reach the head round's answers too: its weight cap, and the robust setting
        # (fedfuse.flower.trust.screen); Flower's own strategies have neither attribute: the defaults
        head = HeadRound(o.ridge, timeout=o.timeout, solvers=o.solvers, privacy=self.privacy, secure=o.secure,
                         weight_cap=getattr(strategy, "weight_cap", WEIGHT_CAP),
                         robust=bool(getattr(strategy, "robust_answers", False)))
        plan = strategy.head_plan(model, final_round, one_shot)
        if plan.per_tier:
            models, record = head.run_tiers(grid, plan.models, num_classes, reference, sites=plan.sites or None)
        else:
            solved, record = head.run(grid, plan.models[1.0], num_classes, reference, check_each=plan.check_each)
            models = {1.0: solved}
        strategy.adopt_head(models)
        return models[1.0], record


__all__ = ["HeadRoundOptions", "HeadPlan", "HeadRoundStep", "ensemble_reference"]
