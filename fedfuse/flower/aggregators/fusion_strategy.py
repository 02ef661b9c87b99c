"""``FusionStrategy``: the round protocol holding a ``FusionAggregator`` (``fedfuse.fusion.fuse_result(method,
...)`` followed by the round steps of ``fedfuse.flower.round.steps``):

    validated replies → fuse (or the weighted average, streamed) → divergence guard → server momentum
    → refine (calibrate / distill, kept only when it moves the model towards the clients' ensemble)

What each strategy name aggregates and its defaults come from its registry entry
(``fedfuse.strategy_specs``). A subclass or plug-in adds a step by overriding ``post_steps`` (the aggregator's by
default: ``super().post_steps(r)`` is ``self.aggregator.post_steps(r)``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fedfuse.fusion import FusionResult
from fedfuse.strategy_specs import StrategySpec
from fedfuse.flower.aggregators.fusion_aggregator import FusionAggregator, FusionConcerns
from fedfuse.flower.round.options import FusionOptions, GuardOptions, MomentumOptions, RefineOptions
from fedfuse.flower.round.protocol import RoundProtocol
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.flower.round.steps import RoundData


class FusionStrategy(RoundProtocol):
    """A Flower strategy whose aggregation is ``fedfuse.fusion.fuse_result(method, ...)``: the round protocol holding
    a ``FusionAggregator`` (``aggregator``), which owns the method, its options and its steps.

    Use ``build_strategy(name)``, a named class (``KfLinearStrategy``, ...) or ``FusionStrategy(method=...)``.
    The ClientApps must follow the reply contract of ``fedfuse.flower.round.replies``.

    The options come as one typed, frozen object per concern (``fedfuse.flower.round.options``): ``fusion``
    (``FusionOptions``: ``fusion_options``, ``importance``, ``fusion_rounds``, ``fuse_fn``, ``align_to``,
    ``score_check``), ``guard`` (``GuardOptions``: ``guard``, ``guard_ratio``), ``momentum`` (``MomentumOptions``:
    ``server_momentum``, ``server_learning_rate``), ``refine`` (``RefineOptions``: ``refine``, ``prior``,
    ``refine_check``, ``calibrate_min_gap``) and the protocol's (``ProtocolOptions``), or as the flat keywords named
    here, which the constructor moves into those objects once (an unknown keyword is a ``TypeError``).

    Args:
        method: a name in ``fedfuse.fusion.METHOD_SPECS`` whose result keeps the global architecture.
        fusion_options: the method's options, validated now against its options schema.
        importance: ``"client"`` (scores sent by the clients, validated) or ``"server"`` (computed by the method
            on the fusion set; needs ``fusion_labels`` unless uniform).
        fusion_rounds: fuse in rounds ``1..fusion_rounds`` only and average afterwards; 0 = fuse every round.
        fuse_fn: the fusion entry point (default ``fuse_result``): replace it to instrument fusion.
        refine: ``"calibrate"`` | ``"distill"`` | both joined by ``"+"`` | ``"none"``; ``None`` = the registry
            entry's default when ``fusion_inputs`` is given, else none.
        prior, refine_check, calibrate_min_gap: the ``Refinement`` step's options.
        guard, guard_ratio: the ``DivergenceGuard`` step (rounds that fuse with a method other than the average).
        server_momentum, server_learning_rate: the ``ServerMomentum`` step (``None``: the entry's default).
        score_check: reject a reply whose importance scores put most of their mass on units its own model does not
            use on the fusion set (``fedfuse.fusion.score_check``; rounds that read client scores only).
        align_to: the units the clients are aligned onto, for methods that align (``rebasin``, ``ot``: the
            ``any_reference`` capability): ``"model-0"`` (the first reply's, averaged in) or ``"global"`` (the
            round's global model, which every client started from and which is not averaged in:
            ``fuse(..., reference=)``).
        Everything else: ``RoundProtocol``'s options (Flower ``FedAvg``'s included).
    """

    method: str | None = None
    reads_scores = True   # a subclass whose aggregation never reads the method's importance scores says False

    def __init__(self, method: str | None = None, *, model_fn: Callable[[], nn.Module] | None = None,
                 fusion_inputs: torch.Tensor | None = None, fusion_labels: torch.Tensor | None = None,
                 device: str = "cpu", seed: int = 0, fusion: FusionOptions | None = None,
                 guard: GuardOptions | None = None, momentum: MomentumOptions | None = None,
                 refine: RefineOptions | None = None, registry_entry: StrategySpec | None = None,
                 **options: Any) -> None:
        concerns = FusionConcerns.take(options, fusion, guard, momentum, refine)
        super().__init__(model_fn=model_fn, fusion_inputs=fusion_inputs, fusion_labels=fusion_labels, device=device,
                         seed=seed, **options)
        self.aggregator = FusionAggregator(self, method, concerns, registry_entry=registry_entry,
                                           reads_scores=self.reads_scores)
        self.method = self.aggregator.method

    # the aggregation's override points (``super().post_steps(r)`` in a subclass that adds a step)
    def fuse_updates(self, server_round: int, updates: list[ClientUpdate],
                     models: list[nn.Module] | None = None) -> FusionResult:
        """Fuse validated updates (the aggregator's ``fuse_fn``); raises ``FusionError`` when the method cannot."""
        return self.aggregator.fuse_updates(server_round, updates, models)

    def post_steps(self, server_round: int) -> list[Callable[[nn.Module, RoundData], tuple[nn.Module, dict]]]:
        """The steps of round ``server_round`` after the aggregation, in order (override to add one)."""
        return self.aggregator.post_steps(server_round)


__all__ = ["FusionStrategy"]
