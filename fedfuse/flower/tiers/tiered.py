"""Capacity tiers on Flower: every node trains its tier's model; the server aggregates all tiers into the global
(widest) model and derives each tier's model for the next round.

``TieredFusionStrategy`` is the round protocol holding a ``FusionAggregator`` (the method and its steps, as
``FusionStrategy`` holds one) with three parts composed in:

- a ``TierLayout`` (``fedfuse.flower.tiers.tier_models``): each node's tier, learnt once by a ``query`` message, the
  tiers' architectures and where their entries sit in the global model. ``configure_train`` sends every sampled
  node *its own* message: the tier model's arrays and ``tier-width-mult`` (Flower's Message API), and replies are
  validated against their tier's shapes;
- the aggregation: HeteroFL's count-weighted sub-model average for the strategies whose registry entry says
  ``tiers.submodel`` (``average``, ``feddf``, HeteroFL, FedRolex), else the fusion method into the global
  architecture (``fuse(..., target=global)``) with the fused units permuted onto the sub-model average's
  (``fedfuse.hetero.anchor``) so that unit ``i`` stays the unit every tier's slice holds. The sub-model average is
  also what the divergence guard and the ``"average"`` fallback use;
- ``TierModels`` (``fedfuse.flower.tiers.tier_models``): each narrower tier's next model (slice, fuse, distill,
  prune) and its guard.

HeteroFL (Diao et al., arXiv 2010.01264) and FedRolex (Alam et al., arXiv 2212.01548) are this class with their
registry entries (sub-model average, static BN, rolling window for FedRolex, slices, no guard, no refinement); their
named classes only fix ``method``.
Per round, ``history`` gets ``tier-bytes-sent`` / ``tier-clients`` / ``tier-val-accuracy`` /
``tier-train-seconds`` (``{tier: value}``); ``evaluate_tiers`` scores every tier model on a test split.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from typing import Any, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import nn

from fedfuse.fusion import FusionResult, check_finite
from fedfuse.fusion.refine import distill_ensemble
from fedfuse.hetero import aggregate_states, reestimate_batchnorm, slice_state, tier_name
from fedfuse.hetero.anchor import align_to_anchor
from fedfuse.hetero.prune import permutation_layout
from fedfuse.hetero.tiers import resolve_ordered_dropout, resolve_tier_models
from fedfuse.models import adapter_for
from fedfuse.models.adapters import BATCHNORMS
from fedfuse.strategy_specs import strategy_spec, with_tiers
from fedfuse.training import metrics_from_logits, predict_logits, resolve_device
from fedfuse.flower.tiers.client_tiers import SCALER_KEY, TIER_KEY
from fedfuse.flower.aggregators.fusion_strategy import FusionAggregator, FusionConcerns
from fedfuse.flower.head.head_step import HeadPlan
from fedfuse.flower.round.options import TierOptions, take_options
from fedfuse.flower.round.protocol import RoundProtocol, state_to_record
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.flower.tiers.tier_models import TierModels
from fedfuse.flower.tiers.tier_models import QUERY_TIMEOUT  # noqa: F401  (tests patch it here)
from fedfuse.flower.tiers.tier_models import (TierLayout, checked_draw, client_tier_means, count_sent,
                                        request_ordered_dropout, round_tier_records)


class TieredFusionStrategy(RoundProtocol):
    """Fusion across capacity tiers (see the module docstring).

    Args:
        tiers: the run's width multipliers (``RunConfig.tiers``).
        tier_models: ``"auto"`` (the registry entry's rule: ``fedfuse.hetero.tiers.resolve_tier_models``) |
            ``"slice"`` | ``"fuse"`` | ``"distill"`` | ``"prune"`` | ``"prune-recover"`` (``TierModels``).
        prune_options: ``TierModels``'s ``prune_options``.
        input_shape: the inputs of the architecture (CNN tiers need it to rebuild their pooling).
        weighting: ``"examples"`` (sample counts) | ``"uniform"`` (the HeteroFL paper's plain count).
        width_scaler: ask clients to apply HeteroFL's width scaler in local training (``None``: when the model
            has BatchNorm, as the paper pairs it with static BN; without normalisation it scales an L-layer MLP's
            logits by r^-L in training and a narrow client diverges).
        anchor: permute fused units onto the sub-model average's.
        ordered_dropout: ``"all"`` | ``"narrow"`` | ``"off"`` | ``"auto"`` (or a bool): clients also train their
            narrower tiers' nested sub-models (FjORD, arXiv 2102.13451; ``fedfuse.hetero.ordered_dropout``).
        ordered_dropout_draw: with ordered dropout, how a client draws its width per batch: ``"auto"``
            (``fedfuse.hetero.tiers.resolve_ordered_dropout_draw``: the measured best for the method and family),
            ``"uniform"`` (FjORD), ``"width"`` (each width in proportion to itself) or the probability of its own
            width (``fedfuse.hetero.ordered_dropout.draw_weights``).
        The tier options come as one ``TierOptions`` (``tiering=``) or as these flat keywords.
        Everything else: ``FusionStrategy``'s options (the held aggregator's and the protocol's).
    """

    method: str | None = None

    def __init__(self, method: str | None = None, *, tiering: TierOptions | None = None, **options: Any) -> None:
        entry = with_tiers(strategy_spec(method or type(self).method))
        if entry.tiers.required:   # HeteroFL / FedRolex (their entries): the paper's slices, no divergence guard,
            # the width scaler where the model has BatchNorm (None) unless set
            options.pop("tier_models", None)
            options.update(guard=False, tier_models="slice")
            options.setdefault("width_scaler", None)
        tiering = take_options(TierOptions, tiering, options)   # flat keywords (``tiers=...``) into TierOptions
        concerns = FusionConcerns.take(options)
        super().__init__(**options)
        self.aggregator = FusionAggregator(self, method, concerns, registry_entry=entry)
        self.method = self.aggregator.method
        if self.model_fn is None:
            raise ValueError("strategy: a tiered strategy needs model_fn (the global, widest architecture)")
        tier_models = resolve_tier_models(self.method, tiering.tier_models, adapter_for(self.model_fn()).family)
        self.tier_layout = TierLayout(self.model_fn, tiering.tiers, tiering.input_shape,
                                      window_rolls=self.entry.tiers.window_rolls)
        submodel = self.entry.tiers.submodel
        if (self.spec is not None and len(set(self.tier_layout.tiers)) > 1 and not self.spec.mixed_widths
                and not submodel):
            raise ValueError(f"strategy: method {self.method!r} cannot fuse clients of different widths")
        if tier_models == "fuse" and (submodel or self.spec is not None and not self.spec.any_target):
            raise ValueError(f"strategy: tier_models='fuse' needs a fusion method that builds into another width; "
                             f"{self.method!r} averages sub-models or cannot")
        prune_options = dict(tiering.prune_options)
        if tier_models == "prune-recover":
            prune_options.setdefault("recover", True)
        needs_set = tier_models == "distill" or tier_models.startswith("prune") and prune_options.get("recover")
        if needs_set and self.fusion_inputs is None:
            raise ValueError(f"strategy: tier_models={tier_models!r} needs fusion_inputs (the server fusion set)")
        self.tier_models_step = TierModels(self, tier_models, prune_options)
        self.weighting = tiering.weighting
        width_scaler = tiering.width_scaler
        if width_scaler is None:
            width_scaler = any(isinstance(m, BATCHNORMS) for m in self.model_fn().modules())
        self.width_scaler = bool(width_scaler)
        try:   # validated here; 'auto' is resolved per round (the round's mode)
            resolve_ordered_dropout(self.method, tiering.ordered_dropout)
        except ValueError as exc:
            raise ValueError(f"strategy: {exc}") from None
        self.ordered_dropout = tiering.ordered_dropout
        self.ordered_dropout_draw = checked_draw(self.method, tiering.ordered_dropout_draw, self.model_fn())
        self.anchor = tiering.anchor
        self._round_tiers: dict[str, Any] = {}
        self._offset = 0   # the window offset of the round being aggregated
        self.aggregator.level_widths = None   # per tier (TierLayout.level_widths)

    def skeleton(self, r: float) -> nn.Module:
        return self.tier_layout.skeleton(r)

    def window(self, server_round: int) -> int:
        return self.tier_layout.window(server_round)

    def layout(self, r: float, offset: int):
        return self.tier_layout.layout(r, offset)

    def build_model(self, state: dict[str, torch.Tensor]) -> nn.Module:
        return self.tier_layout.build_model(state)

    def global_state(self) -> dict[str, torch.Tensor]:
        if self._global is None:
            raise RuntimeError("strategy: no global model yet")
        return {k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in self._global.items()}

    def tier_state(self, r: float, server_round: int) -> dict[str, torch.Tensor]:
        """The state dict tier ``r`` receives in ``server_round`` (its derived model, else its slice)."""
        derived = self.tier_models_step.derived
        if r != 1 and r in derived:
            return derived[r]
        return self.tier_layout.slice(self.global_state(), r, server_round)

    def submodel_round(self, server_round: int) -> bool:
        """Whether round ``server_round`` aggregates by HeteroFL's sub-model average."""
        return self.entry.tiers.submodel or self.round_method(server_round) == "average"

    def streaming_round(self, server_round: int) -> bool:
        return False   # mixed widths: the sub-model average reads every reply's layout

    # ---------------------------------------------------------------- configure: one message per node
    def on_fallback(self) -> None:
        """Also forget the tier models derived this round: the next round slices the kept global model."""
        super().on_fallback()   # the aggregator's (momentum)
        self.tier_models_step.forget()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        server_round += self.round_offset
        self.tier_layout.learn([int(m.metadata.dst_node_id) for m in messages], grid, self._node_partitions)
        states: dict[float, ArrayRecord] = {}
        out: list[Message] = []
        sent_bytes: dict[str, int] = {}
        counts: dict[str, int] = {}
        for msg in messages:
            node = int(msg.metadata.dst_node_id)
            if node not in self.tier_layout.node_tier:
                continue
            r = self.tier_layout.node_tier[node]
            if r not in states:
                states[r] = state_to_record(self.tier_state(r, server_round))
            cfg = ConfigRecord(dict(msg.content.config_records[self.configrecord_key]))
            cfg[TIER_KEY] = float(r)
            cfg[SCALER_KEY] = self.width_scaler
            narrower = sorted({t for t in (*self.tier_layout.tiers, *self.tier_layout.node_tier.values()) if t < r}, reverse=True)
            dropout = resolve_ordered_dropout(self.method, self.ordered_dropout, str(cfg.get("mode", "multi-round")))
            request_ordered_dropout(cfg, narrower, dropout, self.ordered_dropout_draw,
                                    narrow_node=r < max(self.tier_layout.tiers, default=1.0))
            content = RecordDict({self.arrayrecord_key: states[r], self.configrecord_key: cfg})
            out.append(Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN))
            count_sent(sent_bytes, counts, tier_name(r), states[r])
        self._round_tiers = {"tier-bytes-sent": sent_bytes, "tier-clients": counts}
        log(INFO, "configure_train: round %d: tiers %s", server_round,
            ", ".join(f"{k}: {counts[k]} nodes, {sent_bytes[k] / 1e6:.3f} MB" for k in sorted(counts, key=float)))
        self._sent_msgs = out
        return out

    # ---------------------------------------------------------------- replies
    def reply_reference(self, server_round: int, node_id: int):
        r = self.tier_layout.node_tier.get(node_id, 1.0)
        widths = self.tier_layout.level_widths(r) if self.round_needs_scores(server_round) else None
        return self.tier_layout.reference(r), widths

    def rejected_extra(self, node_id: int) -> dict[str, Any]:
        return {"tier": self.tier_layout.node_tier.get(node_id, 1.0)}

    def check_reply(self, server_round: int, msg: Message, record: dict[str, Any], **kw: Any) -> ClientUpdate | None:
        u = super().check_reply(server_round, msg, record, **kw)
        if u is not None:
            u.metrics["tier"] = self.tier_layout.node_tier.get(u.node_id, 1.0)
        return u

    def update_key(self, update: ClientUpdate) -> tuple:
        return -update.metrics["tier"], update.partition_id, update.node_id   # the widest model is model 0

    # ---------------------------------------------------------------- aggregation
    def _weights(self, updates: list[ClientUpdate]) -> list[float]:
        return [float(u.num_examples) if self.weighting == "examples" else 1.0 for u in updates]

    def _norm_weights(self, updates: list[ClientUpdate]) -> list[float]:
        w = self._weights(updates)
        return [v / sum(w) for v in w]

    def average(self, updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
        """HeteroFL's sub-model average of the updates into the global model."""
        subs = [self.layout(u.metrics["tier"], self._offset) for u in updates]
        return aggregate_states(self.global_state(), [u.state for u in updates], subs, self._weights(updates))

    weighted_average = average

    def fuse_updates(self, server_round: int, updates: list[ClientUpdate],
                     models: list[nn.Module] | None = None) -> FusionResult:
        """The sub-model average (with FedDF's distillation of every tier's clients into it), or the fusion method
        into the global architecture with its units anchored on the sub-model average's."""
        method = self.round_method(server_round)
        if self.submodel_round(server_round):
            t0 = time.perf_counter()
            model = self.build_model(self.weighted_average(updates))
            info: dict[str, Any] = {"window-offset": self._offset} if self.entry.tiers.required else {}
            if self.entry.tiers.distill and method == self.method:
                teachers = models if models is not None else [self.build_model(u.state) for u in updates]
                info.update(distill_ensemble(model, teachers, self._norm_weights(updates), self.fusion_inputs,
                                             self.method_options,
                                             seed=self.seed + server_round, device=resolve_device(self.device)))
                model = model.cpu().eval()
            return FusionResult(method=method, model=model, info=info, seconds=time.perf_counter() - t0)
        result = self.aggregator.fuse_updates(server_round, updates, models)
        if not self.anchor or len({u.metrics["tier"] for u in updates}) < 2 and self.window(server_round) == 0:
            return result   # one width, top-left slices: nothing depends on the unit order
        check_finite(method, result.model)
        anchor = self.build_model(self.weighted_average(updates))
        model, info = align_to_anchor(result.model, anchor, seed=self.seed + server_round)
        return FusionResult(method=result.method, model=model, info={**(result.info or {}), **info},
                            seconds=result.seconds)

    def fuse_target(self) -> nn.Module | None:
        return self.model_fn()   # the widest architecture, whichever model comes first

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        true_round = server_round + self.round_offset
        self._offset = self.window(true_round)
        arrays, metrics = super().aggregate_train(server_round, replies)
        record = self.history[-1] if self.history else {}
        record.update(self._round_tiers)
        record.update(client_tier_means(self.last_updates, lambda u: tier_name(u.metrics["tier"])))
        if arrays is not None:
            arrays = self._derive(true_round, arrays, record)
        return arrays, metrics

    def _derive(self, server_round: int, arrays: ArrayRecord, record: dict[str, Any]) -> ArrayRecord:
        """The tier models of the next round from the new global model (``TierModels``), and what its guard or its
        unit reordering change in the global model."""
        step = self.tier_models_step
        self._global = arrays   # the derivations slice / fuse from the new global model
        t0 = time.perf_counter()
        step.derive_tier_models(server_round, self.last_updates)
        record["tier-derivation-seconds"] = time.perf_counter() - t0
        fallback, pruned = step.take_round()
        if step.guarded:
            record["tier-guard"] = dict(step.guarded)
            if fallback is not None:
                # the tiers must stay nested slices of the global model: the whole round uses the sub-model average
                arrays = state_to_record(fallback)
                self._global = arrays
                step.forget()
                self.reset_server_state()
                record["guard"] = record.get("guard") or f"average (tier guard: {'; '.join(step.guarded.values())})"
                log(WARNING, "aggregate_train: round %d: tier guard: the round uses the sub-model average for the "
                    "global model and every tier", server_round)
        if pruned is not None and not step.guarded:
            # the new global model with its units reordered (same function) so that every tier's pruned model is
            # its top-left slice; the server momentum follows the units (over the parameters only)
            state, perms = pruned
            arrays = state_to_record(state)
            self._global = arrays
            self.momentum_step.remap(lambda v: slice_state(
                v, permutation_layout(self.skeleton(1.0), perms).restricted_to(v)))
        return arrays

    # the derivation step's entry points, under the names plug-ins and tests use
    def derive_tier_models(self, server_round: int, updates: list[ClientUpdate]) -> None:
        self.tier_models_step.derive_tier_models(server_round, updates)

    def guard_tiers(self, server_round: int, updates: list[ClientUpdate]) -> None:
        self.tier_models_step.guard_tiers(server_round, updates)

    def aggregated_scores(self, updates: list[ClientUpdate]) -> dict[str, torch.Tensor] | None:
        return self.tier_models_step.aggregated_scores(updates)

    def narrower_tier_models(self, server_round: int) -> dict[float, nn.Module]:
        """Every narrower tier's model as ``server_round`` would send it (``tier_model``), by width multiplier;
        ``{}`` before the first global model."""
        if self._global is None:
            return {}
        return {r: self.tier_model(r, server_round) for r in self.tier_layout.all_tiers() if r != 1.0}

    def head_plan(self, model: nn.Module, final_round: int, one_shot: bool) -> HeadPlan:
        """Every tier's classifier, each checked on its own (the narrower tiers' models as the next round sends
        them)."""
        return HeadPlan({**self.narrower_tier_models(final_round), 1.0: model}, per_tier=True)

    def adopt_head(self, models: dict[float, nn.Module]) -> None:
        self.adopt_tier_models(models)

    def adopt_tier_models(self, models: dict[float, nn.Module]) -> None:
        """After the last round (the head round of width tiers): the global model and the narrower tiers' models
        are these (``{tier: model}``, the global one at tier 1; each keeps its own classifier, so the narrower
        ones stop being slices of the global model)."""
        for r, model in models.items():
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            if r == 1.0:
                self._global = state_to_record(state)
            else:
                self.tier_models_step.derived[r] = state

    # ---------------------------------------------------------------- evaluation (results)
    def tier_model(self, r: float, server_round: int) -> nn.Module:
        """Tier ``r``'s model as it is sent in ``server_round`` (BN re-estimated on the fusion set if any)."""
        model = self.build_model(self.tier_state(r, server_round))
        if self.fusion_inputs is not None and r != 1:
            reestimate_batchnorm(model, self.fusion_inputs)
        return model

    def evaluate_tiers(self, server_round: int, x: torch.Tensor, y: torch.Tensor, device) -> dict[str, Any]:
        """``{"tier-accuracy": {tier: test accuracy}}`` of the tier models the next round sends, plus the round's
        ``tier-bytes-sent``, ``tier-clients``, ``tier-val-accuracy`` and ``tier-train-seconds``."""
        if self._global is None:
            return {}
        acc = {}
        for r in self.tier_layout.all_tiers():
            logits = predict_logits(self.tier_model(r, server_round + 1), x, device=device)
            acc[tier_name(r)] = float(metrics_from_logits(logits, y)["accuracy"])
        return {"tier-accuracy": acc, **round_tier_records(self.history, server_round)}


class HeteroFLStrategy(TieredFusionStrategy):
    """HeteroFL (Diao, Ding & Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning for
    Heterogeneous Clients", arXiv 2010.01264): nested top-left sub-models, count-weighted averaging of the entries
    each client holds, static BN, the width scaler. Aggregates arrays only (no fusion method, no guard)."""

    method = "heterofl"


class FedRolexStrategy(TieredFusionStrategy):
    """FedRolex (Alam, Liu, Yan & Zhang, "FedRolex: Model-Heterogeneous Federated Learning with Rolling Sub-Model
    Extraction", arXiv 2212.01548): HeteroFL's averaging with a sub-model window that rolls by one unit (one
    attention head) per round."""

    method = "fedrolex"


TIER_STRATEGY_CLASSES: dict[str, type[TieredFusionStrategy]] = {"heterofl": HeteroFLStrategy,
                                                                "fedrolex": FedRolexStrategy}


def build_tier_strategy(name: str, *, tiers: tuple[float, ...], tier_models: str = "auto",
                        input_shape: tuple[int, ...] | None = None, **options: Any) -> TieredFusionStrategy:
    """The tier-aware strategy for ``name``: HeteroFL / FedRolex, or ``TieredFusionStrategy`` with that method."""
    if name in TIER_STRATEGY_CLASSES:
        if resolve_tier_models(name, tier_models) != "slice":
            raise ValueError(f"strategy {name!r} derives tier models by slicing only, got tier_models={tier_models!r}")
        return TIER_STRATEGY_CLASSES[name](tiers=tiers, input_shape=input_shape, **options)
    return TieredFusionStrategy(name, tiers=tiers, tier_models=tier_models, input_shape=input_shape, **options)


__all__ = ["TieredFusionStrategy", "HeteroFLStrategy", "FedRolexStrategy", "TIER_STRATEGY_CLASSES",
           "build_tier_strategy"]
