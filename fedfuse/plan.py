"""The run plan: every measured default, ``"auto"`` value and sentinel of a run config, resolved in one place.

A run config leaves some choices to fedfuse (``strategy='auto'``, ``tier-options.models='auto'``,
``strategy-options.server-momentum=-1``, one-shot's candidates, ...). Each rule that resolves one lives here, once,
with the measurement it comes from; ``make_plan(cfg)`` applies them all before Flower starts and returns a ``Plan``:
what the run will do and, per choice, the value, why, and the doc section that holds the measurement. The runner
prints it, ``results.json`` records it (``"plan"``), and the ServerApp builds its strategy from it
(``fedfuse.flower.server_app``): the server, the privacy wrapper and the config checks read the same answer.

This module imports nothing of fedfuse at import time but the strategy registry (``fedfuse.config`` imports it);
``cfg`` is a ``fedfuse.config.RunConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fedfuse.strategy_specs import (ARRAY_CANDIDATES, MEAN_METHODS, NON_FUSION_STRATEGIES, SELECTING_STRATEGIES,
                                    SERVER_MOMENTUM, strategy_spec)

#: the server momentum of ``auto``'s momentum step when ``auto-momentum`` takes it and ``server-momentum`` is not set
#: (the ``average`` candidate's own default, ``fedfuse.strategy_specs.SERVER_MOMENTUM``)
AUTO_SERVER_MOMENTUM = SERVER_MOMENTUM
#: one-shot ``auto``'s candidates without the head round. Not the weighted average: one-shot clients train from their
#: own initialisations, so their average is at chance (Fashion-MNIST O1: 10.0 % in every cell, docs/fashion-mnist.md)
#: and as a candidate it only gives lying voters a target (docs/trust.md, "One-shot, the vote": 0.113 with it)
ONE_SHOT_AUTO_CANDIDATES = ("feddf", "kf-linear")
#: the model families whose one-shot ``auto`` with the head round is kf-linear (the rest: FedDF). ResNets since
#: kf-linear reads them (the graph reader): + head round 5–6 points above FedDF + head round on torchvision ResNet-18
#: clients (results/fmnist-resnet18, where the rule was chosen), then +3.0 / +1.9 / +1.8 on fedfuse's ResNet on
#: MNIST-1D, above on all nine cell-seeds (results/resnet-mnist1d-oneshot, the check)
KF_LINEAR_HEAD_FAMILIES = ("mlp", "cnn", "lenet", "resnet")
#: the server step of that kf-linear candidate before the head round (``auto_candidate_refine``): the clients' ensemble
#: distilled into every layer of the fused model on the fusion set (``DistillRefineOptions``), softened (τ 4), on
#: mixed pairs of fusion images (mixup) so that 2,000 images teach more than 2,000 points, for up to 200 epochs,
#: stopped after 20 without a better held-out KL. Chosen among 21 settings on one strong-client cell of
#: docs/fashion-mnist.md (α 0.3, seed 0), +0.8 / +0.7 / +0.7 over kf-linear + head round on its nine cells
#: (results/fmnist-o1-strong/refine; FedDF's own setting, τ 1, ≤ 50 epochs, patience 5, lost 0.7–0.9 there); through
#: the app (results/app-one-shot-default) +2.5 / +2.3 / +2.4 over kf-linear + head round on nine runs.
ONE_SHOT_DISTILL = {"temperature": 4.0, "epochs": 200, "patience": 20, "augmentation": "mixup"}
#: the families that step is measured on and taken for: LeNet-5 only. On torchvision ResNet-18 clients the same step
#: lowered kf-linear + head round by 1.2–2.6 points on each of four cells (results/fmnist-resnet18), and the MLP and
#: CNN families are not measured, so they keep kf-linear + head round
ONE_SHOT_DISTILL_FAMILIES = ("lenet",)
#: the model families whose one-shot ``auto`` with the head round stacks the clients' models (``stack``: every client's
#: model kept, one classifier over their features solved by the head round) where the run allows it
#: (``one_shot_stack_refusal``). Measured above that single-model candidate on every cell-seed of each family: LeNet-5
#: on Fashion-MNIST through the app, +3.6 / +3.7 / +4.1 over the distilled kf-linear + head round and above the
#: clients' ensemble on 9 / 9 runs (results/app-one-shot-default/stack); on MNIST-1D over kf-linear + head round,
#: fedfuse's ResNet +0.6 to +1.1 through the app (results/resnet-mnist1d-oneshot) and +9.2 to +9.6 on the bench's
#: clients, the CNN +12.2 to +13.2, the MLP +4.6 to +6.0 (results/stack-mnist1d-*). Not the ViTs (not measured)
ONE_SHOT_STACK_FAMILIES = ("lenet", "resnet", "cnn", "mlp")
#: the most clients one-shot ``auto`` stacks: the stacked model is num-clients times the clients' model, and the head
#: round's statistics grow with (num-clients x width)^2; measured up to this many (results/stack-mnist1d-clients)
ONE_SHOT_STACK_MAX_CLIENTS = 10


def _default(cfg: Any, field: str) -> Any:
    """The schema default of ``cfg``'s field (``RunConfig`` declares it)."""
    return next(f.default for f in dataclasses.fields(cfg) if f.name == field)


def one_shot_width_default(cfg: Any) -> str:
    """How one-shot width tiers combine clients trained from their own initialisations: their sub-model average is
    near chance (no shared initialisation to average over), so they are fused: ``kf-linear``, the measured best with
    the head round on the MLP and CNN cells (``results/tiers-head-oneshot``), ``feddf`` for ViTs (kf-linear takes no
    transformer blocks, and FedDF is above kf-gradient there). Measured: docs/tiers.md, "One-shot"."""
    return "feddf" if cfg.model == "vit" else "kf-linear"


def one_shot_depth_default(cfg: Any) -> str:
    """How depth tiers combine clients trained from their own initialisations (one-shot, a warm start's round 1):
    ``ot`` (aligned across depths, then distilled) where measured best, MLPs / plain CNNs and ResNets
    (``results/depth-tiers-oneshot-head``, ``results/depth-tiers-oneshot-resnet``); ``feddf`` for ViTs (measured level
    with ``ot`` at alpha 0.1 and above it at 0.5: ``results/depth-tiers-oneshot-vit``) and for width x depth tiers
    (``ot`` aligns models of one width)."""
    return "ot" if cfg.model in ("mlp", "cnn", "resnet") and min(cfg.depth_tier_widths) == 1 else "feddf"


def auto_round_aggregation(cfg: Any) -> str | None:
    """What ``auto`` takes every round when it builds no fusion candidate (multi-round, ``local-epochs`` below
    ``auto-fusion-epochs``): ``"average"`` (the momentum step) or ``"fedavg"`` (the plain average); ``None`` when
    fusion candidates are built (one-shot, long local training) or the strategy is not ``auto``.

    Why the rule (``auto-momentum='auto'``): server momentum is FedAvgM's step (Hsu et al., arXiv 1909.06335), the
    momentum that plain-SGD clients (Flower's fedavgm baseline) do not take themselves; on top of clients that already
    carry their own momentum or Adam it compounds and breaks runs (measured: docs/multi-round.md)."""
    if cfg.strategy not in SELECTING_STRATEGIES or cfg.mode == "one-shot" or cfg.local_epochs >= cfg.auto_fusion_epochs:
        return None
    arrays = [c for c in cfg.auto_candidate_names if c in ARRAY_CANDIDATES]
    step = next((c for c in arrays if c in MEAN_METHODS), None)       # the mean with fedfuse's server step
    plain = next((c for c in arrays if c not in MEAN_METHODS), None)  # FedAvg's average
    plain_sgd = cfg.optimizer == "sgd" and cfg.momentum == 0   # the clients' own step carries no momentum
    if step and (cfg.auto_momentum == "on" or (cfg.auto_momentum == "auto" and plain_sgd)):
        return step
    if cfg.auto_momentum == "off" and plain:
        return plain
    return arrays[0] if arrays else None


def one_shot_stack_refusal(cfg: Any) -> str | None:
    """Why one-shot ``auto`` with the head round does not take ``stack`` for this run (``None``: it does). The stacked
    model is every client's model side by side, so it needs the clients' statistics of all of them in the clear
    (no secure aggregation, no DP), one architecture per client (no capacity tiers), a measured family and at most
    ``ONE_SHOT_STACK_MAX_CLIENTS`` clients, and no ``robust`` setting (not measured against lying clients); with the
    default candidates only."""
    if cfg.strategy not in SELECTING_STRATEGIES or cfg.mode != "one-shot":
        return "not one-shot auto"
    reasons = [why for bad, why in (
        (not cfg.head_round, "head-round is off (the stack's classifier is solved by the head round)"),
        (cfg.auto_candidates != _default(cfg, "auto_candidates"), "strategy-options.auto-candidates is set"),
        (cfg.refine != _default(cfg, "refine"), "strategy-options.refine is set (it refines one model)"),
        (cfg.model not in ONE_SHOT_STACK_FAMILIES, f"model {cfg.model!r} is not measured stacked"),
        (cfg.num_clients > ONE_SHOT_STACK_MAX_CLIENTS,
         f"num-clients {cfg.num_clients} > {ONE_SHOT_STACK_MAX_CLIENTS} (the stack is num-clients models)"),
        (cfg.secure_aggregation, "secure-aggregation is on"),
        (cfg.robust, "robust is on (a lying client's model would be a member; not measured)"),
        (bool(cfg.client_tiers), "client-tiers are set"),
        (cfg.dp_noise_multiplier > 0 or cfg.dp_head_noise_multiplier > 0, "differential privacy is on"),
    ) if bad]
    return "; ".join(reasons) or None


def auto_candidates(cfg: Any) -> tuple[str, ...]:
    """Strategy ``auto``'s candidate aggregations, in order of preference (``()`` for another strategy).

    One-shot with the default list: a single round, so no later round suffers from its choice; the momentum step is
    the average there, so the list is FedDF and kf-linear (``ONE_SHOT_AUTO_CANDIDATES``), and with the head round one
    candidate only: the clients score the candidates before their head is solved, which ranks them wrongly for after
    it; ``stack`` where the run allows it (``one_shot_stack_refusal``: measured above every single-model candidate and
    the clients' ensemble, ``ONE_SHOT_STACK_FAMILIES``), else kf-linear where it is measured best
    (MLP/CNN/LeNet/ResNet: its features beat FedDF's under the head round), FedDF for the ViTs (kf-linear takes no
    transformer blocks; FedDF above kf-gradient there) and the zoo models (not measured through the app). Measured:
    docs/one-shot.md, its opening sections; LeNet: docs/fashion-mnist.md, O1 (+2.9 to +3.1). Multi-round below ``auto-fusion-epochs``: the array
    candidate every round takes first (``auto_round_aggregation``)."""
    if cfg.strategy not in SELECTING_STRATEGIES:
        return ()
    candidates = tuple(cfg.auto_candidate_names)
    if cfg.mode == "one-shot" and cfg.auto_candidates == _default(cfg, "auto_candidates"):
        candidates = ONE_SHOT_AUTO_CANDIDATES if not cfg.head_round else (
            ("stack",) if one_shot_stack_refusal(cfg) is None else
            ("kf-linear",) if cfg.model in KF_LINEAR_HEAD_FAMILIES else ("feddf",))
    take = auto_round_aggregation(cfg)
    if take in MEAN_METHODS:   # below auto-fusion-epochs the first array candidate is taken: the momentum step
        candidates = (take,) + tuple(c for c in candidates if c != take)
    return candidates


def auto_candidate_refine(cfg: Any) -> dict[str, dict]:
    """The refinement of ``auto``'s candidates, ``{candidate: DistillRefineOptions fields}``: one-shot with the head
    round and the default candidates, kf-linear's model is distilled from the clients' ensemble before the head round
    (``ONE_SHOT_DISTILL``) for the families it is measured best on (``ONE_SHOT_DISTILL_FAMILIES``); ``{}`` otherwise, and with ``strategy-options.refine =
    'none'`` (the kf-linear + head round row, kept beside it)."""
    if (cfg.strategy in SELECTING_STRATEGIES and cfg.mode == "one-shot" and cfg.head_round and cfg.refine == "auto"
            and cfg.model in ONE_SHOT_DISTILL_FAMILIES and auto_candidates(cfg) == ("kf-linear",)):
        return {"kf-linear": dict(ONE_SHOT_DISTILL)}
    return {}


def auto_server_momentum(cfg: Any) -> float | None:
    """The momentum of ``auto``'s momentum step when every round takes it and ``server-momentum`` is not set
    (``AUTO_SERVER_MOMENTUM``); ``None``: the strategy's own (registry) default or the user's value."""
    if auto_round_aggregation(cfg) in MEAN_METHODS and cfg.server_momentum < 0:
        return AUTO_SERVER_MOMENTUM
    return None


def dp_strategy(cfg: Any) -> str:
    """The strategy a DP run aggregates with: ``cfg.strategy``, or for ``auto`` without a fusion candidate what it
    takes every round (``auto_round_aggregation``): ``fedavg`` for the plain average, ``fedavgm`` for the momentum
    step (post-processing of the noised average)."""
    take = auto_round_aggregation(cfg)
    if take is None:
        return cfg.strategy
    return "fedavgm" if take in MEAN_METHODS else take


def fuses(cfg: Any) -> bool:
    """Whether any round of the run builds a fused model (else every round averages the arrays: FedAvg, Flower's
    baselines, the tier baselines' sub-model averages, ``average``, or ``auto`` taking an array candidate every
    round), i.e. whether the aggregation itself reads a fusion set."""
    if cfg.strategy in SELECTING_STRATEGIES:
        return auto_round_aggregation(cfg) is None and any(c not in ARRAY_CANDIDATES for c in auto_candidates(cfg))
    if cfg.strategy in NON_FUSION_STRATEGIES or cfg.strategy in MEAN_METHODS:
        return False
    try:
        return strategy_spec(cfg.strategy).aggregation == "fusion"
    except ValueError:
        return True   # a plug-in strategy: assume it fuses


@dataclass(frozen=True)
class Decision:
    """One choice the plan made for the user: the setting (its path), the value taken, why, and where it is
    measured."""

    setting: str
    value: Any
    why: str
    doc: str = ""

    def line(self) -> str:
        return f"{self.setting} = {self.value!r}: {self.why}" + (f" ({self.doc})" if self.doc else "")


@dataclass(frozen=True)
class Plan:
    """What a run will do, resolved before Flower starts (``make_plan``)."""

    strategy: str
    round_aggregation: str | None        # auto's every-round array candidate (None: the clients vote / not auto)
    candidates: tuple[str, ...]          # auto's candidates (() for another strategy)
    server_momentum: float | None        # auto's momentum step when it takes one (None: the strategy's default)
    dp_strategy: str | None              # what a DP run aggregates with (None: no DP)
    fuses: bool                          # a round builds a fused model (the aggregation reads a fusion set)
    decisions: tuple[Decision, ...] = ()
    candidate_refine: dict[str, dict] = dataclasses.field(default_factory=dict)   # auto_candidate_refine

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "round-aggregation": self.round_aggregation,
                "candidates": list(self.candidates), "candidate-refine": self.candidate_refine,
                "server-momentum": self.server_momentum,
                "dp-strategy": self.dp_strategy, "fuses": self.fuses,
                "decisions": [dataclasses.asdict(d) for d in self.decisions]}


def make_plan(cfg: Any) -> Plan:
    """The plan of a validated ``RunConfig``: every rule of this module applied, and the choices it made for the
    user said (``Plan.decisions``)."""
    take = auto_round_aggregation(cfg)
    candidates = auto_candidates(cfg)
    momentum = auto_server_momentum(cfg)
    decisions = []
    if cfg.strategy in SELECTING_STRATEGIES:
        if take is not None:
            why = (f"local-epochs {cfg.local_epochs} < strategy-options.auto-fusion-epochs {cfg.auto_fusion_epochs}: "
                   f"the clients drift little, so every round takes {take!r} with no vote and no fusion set")
            if take in MEAN_METHODS:
                why += f" (server momentum {momentum if momentum is not None else cfg.server_momentum} for "\
                       "plain-SGD clients)"
            decisions.append(Decision("strategy", f"auto -> {take}", why, "docs/multi-round.md"))
        elif candidates == ("stack",):
            decisions.append(Decision(
                "strategy-options.auto-candidates", "stack", "one-shot with the head round: every client's model is "
                "kept side by side and one classifier over their features is solved by the head round, so the global "
                f"model is {cfg.num_clients} x the clients' model (strategy-options.auto-candidates='kf-linear' fuses "
                "them into one model of their architecture)", "docs/one-shot.md"))
        else:
            why = ("one-shot: the clients' models are fused once" if cfg.mode == "one-shot" else
                   f"local-epochs {cfg.local_epochs} >= strategy-options.auto-fusion-epochs {cfg.auto_fusion_epochs}")
            refusal = one_shot_stack_refusal(cfg) if cfg.mode == "one-shot" and cfg.head_round else None
            if refusal and cfg.auto_candidates == _default(cfg, "auto_candidates"):
                why += f" (not 'stack': {refusal})"
            decisions.append(Decision("strategy-options.auto-candidates", ",".join(candidates),
                                      why + "; every round the clients vote on their own data",
                                      "docs/one-shot.md" if cfg.mode == "one-shot" else "docs/multi-round.md"))
    refine = auto_candidate_refine(cfg)
    for name, options in refine.items():
        decisions.append(Decision("strategy-options.refine", f"{name} -> distill {options}",
                                  "one-shot with the head round: the clients' ensemble is distilled into the whole "
                                  f"{name} model on the fusion set before its head is solved ('none' skips it)",
                                  "docs/fashion-mnist.md"))
    dp = dp_strategy(cfg) if cfg.dp_noise_multiplier > 0 else None
    if dp is not None and dp != cfg.strategy:
        decisions.append(Decision("strategy", f"{cfg.strategy} -> {dp}", "differential privacy bounds averaging "
                                  "strategies; auto's every-round aggregation is one", "docs/trust.md"))
    return Plan(strategy=cfg.strategy, round_aggregation=take, candidates=candidates, server_momentum=momentum,
                dp_strategy=dp, fuses=fuses(cfg), decisions=tuple(decisions), candidate_refine=refine)


__all__ = ["AUTO_SERVER_MOMENTUM", "ONE_SHOT_AUTO_CANDIDATES", "ONE_SHOT_DISTILL", "ONE_SHOT_DISTILL_FAMILIES", "KF_LINEAR_HEAD_FAMILIES", "Decision", "Plan",
           "ONE_SHOT_STACK_FAMILIES", "ONE_SHOT_STACK_MAX_CLIENTS", "one_shot_stack_refusal",
           "make_plan", "auto_round_aggregation", "auto_candidates", "auto_candidate_refine", "auto_server_momentum", "dp_strategy", "fuses",
           "one_shot_width_default", "one_shot_depth_default"]
