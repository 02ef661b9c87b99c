"""Depth tiers on Flower: every node trains the first blocks of the global model with an exit classifier after
each of them; the server aggregates every layer over the nodes that hold it.

The global model is the run's ``MultiExit`` (``fedfuse.hetero.depth``: the deepest model plus an exit classifier at
every tier's depth). ``DepthTieredStrategy`` is the round protocol holding a ``FusionAggregator`` (its method's
options and steps: the server momentum of ``average``) with:

- a ``TierLayout`` asked for depths: each node's depth multiplier, learnt once by a ``query`` message;
  ``configure_train`` sends every sampled node *its own* message: the arrays its depth holds
  (``held_keys``), the depth in units (``tier-depth-units``) and whether to distil between its exits;
- replies validated against their depth's arrays;
- the aggregation: DepthFL's layer-wise average (``aggregate_held``) — for ``feddf``, followed by the ensemble of
  the round's client models (each at its own deepest exit) distilled into every exit of the global model on the
  fusion set (``distill_exits``): the shallow clients' knowledge reaches the deep classifiers; for ``ot``, the same
  after aligning every client's units to the deepest client's by their activations on the fusion set first
  (``align_depths``): clients trained from their own initialisations (one-shot) then average unit by unit.

Strategies: ``depthfl`` (DepthFL, Kim et al., ICLR 2023: layer-wise average, the clients' mutual self-distillation
between their exits, no server step), ``depthfl-fedavg`` (the paper's ablation without self-distillation),
``inclusivefl`` (InclusiveFL, Liu et al., KDD 2022, arXiv 2202.08036: one classifier per client depth, the layer-wise
average after momentum distillation into each shallower tier's top layer), ``average`` (the layer-wise average with
fedfuse's server momentum), ``feddf`` and ``ot`` (above).
Per round, ``history`` gets ``tier-bytes-sent`` / ``tier-clients`` / ``tier-val-accuracy`` / ``tier-train-seconds``
(``{tier label: value}``, labels ``1x<depth>``); ``evaluate_tiers`` scores every exit on a test split and their
ensemble (``exit-ensemble-accuracy``).

**The depth-tier baselines**: DepthFL, its ablation without self-distillation, and InclusiveFL, each
``DepthTieredStrategy`` (above) with its registry entry (``DepthTiers``: self-distillation,
the node's own exit, InclusiveFL's momentum distillation step, ``MomentumDistillation``); the named classes fix
``method``. ``build_depth_strategy`` picks the class for a strategy name (fedfuse's own aggregations across depths are
``DepthTieredStrategy`` itself).
"""

from __future__ import annotations

import copy
import time
from logging import INFO, WARNING
from typing import Any, Callable, Iterable
import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import nn
from fedfuse.fusion import FusionResult
from fedfuse.hetero import reestimate_batchnorm, slice_state
from fedfuse.hetero.depth import (MultiExit, aggregate_held, align_depths, classifier_readers, distill_exits,
                                  layer_momentum, momentum_distill, narrow_copy, unit_arrays, units_at)
from fedfuse.hetero.depth_layout import DepthLayout
from fedfuse.hetero.tiers import resolve_ordered_dropout
from fedfuse.strategy_specs import (DEPTH_METHODS, DEPTH_WARM_START, WIDTH_DEPTH_TIER_METHODS, strategy_spec,
                                    with_tiers)
from fedfuse.progressive import head_sites
from fedfuse.training import metrics_from_logits, predict_logits, resolve_device
from fedfuse.flower.tiers.client_tiers import DEPTH_KEY, OWN_EXIT_KEY, SELF_DISTILL_KEY, TIER_KEY
from fedfuse.flower.aggregators.fusion_strategy import FusionAggregator, FusionConcerns
from fedfuse.flower.head.head_step import HeadPlan
from fedfuse.flower.round.protocol import RoundProtocol, state_to_record
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.flower.tiers.tier_models import (TierLayout, checked_draw, client_tier_means, count_sent,
                                        request_ordered_dropout, round_tier_records)
from typing import Any

def depth_label(depth: float, width: float = 1.0) -> str:
    """The results label of a depth tier: ``1x0.5`` (a width x depth tier: ``0.5x0.5``)."""
    return f"{width:g}x{depth:g}"


class MomentumDistillation:
    """InclusiveFL's server step (``DepthTiers.momentum_distills``; ``fedfuse.flower.tiers.depth_tiers``'s
    ``InclusiveFLStrategy`` says what it is and where it departs from the authors' code): after a round each tier but
    the deepest keeps a momentum, the next deeper tier's update averaged over the layers from the tier's top layer to
    the deeper tier's (``layer_momentum``); the next round each client of the tier has its top layer's update mixed
    with it, ``(1 - beta) Δ + beta m``, before the layer-wise average (``momentum_distill``).

    Args:
        beta: run-config ``mom-beta`` in [0, 1] (0: DepthFL-fedavg's layer-wise average).
        skeleton: the run's ``MultiExit`` (its architecture).
        units: the tiers (number of units) of the run's depths.
        depths: the run's depth multipliers (the error message's).
    """

    def __init__(self, beta: float, skeleton: MultiExit, units: Iterable[int], depths: Iterable[float]) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
            raise ValueError(f"strategy 'inclusivefl': strategy-options.mom-beta must be a number in [0, 1], got {beta!r}")
        self.beta = float(beta)
        tiers = sorted(set(units))
        if len(tiers) < 2:
            raise ValueError(f"strategy 'inclusivefl': momentum distillation needs a depth tier shallower than the "
                             f"deepest; depths {list(depths)} give one")
        self.deeper = dict(zip(tiers, tiers[1:]))   # tier (units) -> the next deeper tier
        self.layers: dict[int, list[dict[str, str]]] = {}
        for k, deeper in self.deeper.items():
            arrays = [unit_arrays(skeleton, j) for j in range(k, deeper + 1)]
            self.layers[k] = [named for named, _ in arrays]
            if arrays[0][1]:
                log(INFO, "inclusivefl: %s of tier %d's top layer lie outside its block: no momentum distillation",
                    arrays[0][1], k)
        self.momentum: dict[int, dict[str, torch.Tensor]] = {}
        self._logged: set[str] = set()

    def summary(self) -> None:
        log(INFO, "\t└──> inclusivefl: momentum distillation beta=%g into the top layer of tiers (units) %s, "
            "each from the next deeper tier", self.beta, sorted(self.deeper))

    def mix(self, global_state: dict[str, torch.Tensor], updates: list[ClientUpdate],
            units_of: Callable[[int], int]) -> list[dict[str, torch.Tensor]]:
        """The updates' states, each client's top layer mixed with its tier's momentum (where it has one)."""
        return [momentum_distill(global_state, u.state, self.momentum[k], self.beta)
                if (k := units_of(u.node_id)) in self.momentum else u.state for u in updates]

    def update(self, global_state: dict[str, torch.Tensor], updates: list[ClientUpdate],
               units_of: Callable[[int], int]) -> list[int]:
        """Each tier whose next deeper tier is among ``updates`` (trained from ``global_state``) gets that tier's
        ``layer_momentum``; the others keep theirs. Returns the tiers (units) that got one."""
        by_tier: dict[int, list[ClientUpdate]] = {}
        for u in updates:
            by_tier.setdefault(units_of(u.node_id), []).append(u)
        fresh = []
        for k, deeper in self.deeper.items():
            ups = by_tier.get(deeper)
            if not ups:
                continue
            keys = {key for layer in self.layers[k] for key in layer.values()}
            sent = {key: global_state[key] for key in keys}
            avg = aggregate_held(sent, [{key: u.state[key] for key in keys} for u in ups],
                                 [float(u.num_examples) for u in ups])
            self.momentum[k], skipped = layer_momentum({key: avg[key] - sent[key] for key in keys}, self.layers[k])
            for line in sorted(set(skipped) - self._logged):
                log(INFO, "inclusivefl: tier %d's momentum leaves out %s", k, line)
            self._logged.update(skipped)
            fresh.append(k)
        return fresh


class DepthTieredStrategy(RoundProtocol):
    """Aggregation across depth tiers (see the module docstring).

    Args:
        depths: the run's depth multipliers (``RunConfig.depth_tiers``).
        widths: width × depth tiers: the width multiplier of each entry of ``depths`` (``RunConfig.depth_tier_widths``;
            ``None``: all 1). A node of width ``r < 1`` holds HeteroFL's top-left slice of its depth's arrays
            (``exit_submodel``); every entry is averaged over the nodes that hold it.
        input_shape: the model's input shape (a narrower CNN rebuilds its pooling from it).
        ordered_dropout / ordered_dropout_draw: width × depth tiers: every node also trains the narrower widths of
            its depth, one drawn per batch over all its exits (FjORD's ordered dropout, arXiv 2102.13451), as with
            width tiers (``fedfuse.hetero.tiers.resolve_ordered_dropout``: ``auto``: the registry entry's, ``all`` for
            ``average``, ``off`` for FedDF and the DepthFL baselines, whose papers have none).
        self_distill: the clients distil between their exits (DepthFL); ``None``: the registry entry's
            (off for ``depthfl-fedavg`` and ``inclusivefl``).
        mom_beta: the momentum distillation's beta (``MomentumDistillation``), for an entry whose ``depth`` says
            ``momentum_distills`` (InclusiveFL; default 0.2).
        Everything else: ``FusionStrategy``'s options (the held aggregator's and the protocol's); ``model_fn`` must
            build the run's ``MultiExit``.

    ``own_exit`` (the entry's ``depth.own_exit``): each node holds and trains only the exit after its own depth
    (InclusiveFL) instead of every exit up to it (DepthFL).
    """

    method: str | None = None

    def __init__(self, method: str | None = None, *, depths: tuple[float, ...] = (1.0,),
                 widths: tuple[float, ...] | None = None, input_shape: tuple[int, ...] | None = None,
                 ordered_dropout: str = "auto", ordered_dropout_draw: str | float = "auto",
                 self_distill: bool | None = None, mom_beta: float | None = None, **options: Any) -> None:
        name = method or type(self).method
        if name not in DEPTH_METHODS:
            raise ValueError(f"strategy: {name!r} cannot aggregate clients of different depths; use one of "
                             f"{list(DEPTH_METHODS)}")
        widths = tuple(float(w) for w in widths) if widths else (1.0,) * len(depths)
        if len(widths) != len(depths):
            raise ValueError(f"strategy: {len(widths)} widths for {len(depths)} depth tiers")
        if min(widths) < 1 and name not in WIDTH_DEPTH_TIER_METHODS:
            raise ValueError(f"strategy: {name!r} cannot aggregate width x depth tiers (widths {list(widths)}); use "
                             f"one of {list(WIDTH_DEPTH_TIER_METHODS)}")
        if options.get("refine") not in (None, "none"):
            raise ValueError(f"strategy: depth tiers take no refine step (got refine={options['refine']!r}): the "
                             "refinements act on one classifier, a depth-tier model has one per depth")
        options["refine"] = "none"   # ot's default (calibrate) too: feddf and ot distil into every exit instead
        if mom_beta is not None and not strategy_spec(name).depth.momentum_distills:
            options["mom_beta"] = mom_beta   # refused by name, as any unknown option
        if not strategy_spec(name).depth.distils_exits:
            options["guard"] = False   # the guard checks a fused model against the average; these rounds are it
        concerns = FusionConcerns.take(options)
        super().__init__(**options)
        # no depth-tier aggregation reads importance scores: the clients send none
        self.aggregator = FusionAggregator(self, name, concerns, registry_entry=with_tiers(strategy_spec(name)),
                                           reads_scores=False)
        self.method = self.aggregator.method
        skeleton = self.model_fn() if self.model_fn is not None else None
        if not isinstance(skeleton, MultiExit):
            raise ValueError("strategy: a depth-tier strategy needs model_fn building the run's MultiExit "
                             "(fedfuse.hetero.depth.multi_exit)")
        self.self_distill = self.entry.depth.self_distills if self_distill is None else bool(self_distill)
        self.own_exit = self.entry.depth.own_exit
        self.tier_layout = TierLayout(self.model_fn, widths, input_shape=input_shape, depths=tuple(depths))
        self.ordered_dropout = resolve_ordered_dropout(name, ordered_dropout) if min(widths) < 1 else "off"
        self.ordered_dropout_draw = checked_draw(name, ordered_dropout_draw, skeleton.base)
        self._skeleton = skeleton   # the architecture (weights unused): what the layout and the subclasses read
        self._units = {d: units_at(d, skeleton.num_units) for d in self.tier_layout.depths}
        self.layout = DepthLayout(skeleton, self._units.values(), input_shape, own_exit=self.own_exit)
        self._round_tiers: dict[str, Any] = {}
        self._width_models: dict[float, MultiExit] = {}   # width x depth: the head round's model of each narrower width
        # the entry's server step across depths (InclusiveFL's momentum distillation), else none
        self.momentum_distillation = (MomentumDistillation(0.2 if mom_beta is None else mom_beta, skeleton,
                                                           self._units.values(), self.tier_layout.depths)
                                      if self.entry.depth.momentum_distills else None)

    # ---------------------------------------------------------------- the layout
    def node_units(self, node_id: int) -> int:
        return self._units[self.tier_layout.node_depth[node_id]] if node_id in self.tier_layout.node_depth \
            else self.layout.full

    def node_width(self, node_id: int) -> float:
        return self.tier_layout.node_tier.get(node_id, 1.0)

    def global_state(self) -> dict[str, torch.Tensor]:
        if self._global is None:
            return self.model_fn().state_dict()
        return {k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in self._global.items()}

    def build_model(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """The ``MultiExit`` of a full or a depth tier's state (the depth recognised by its keys; the arrays it
        does not hold are the global model's), its ``active`` depth set."""
        keys = set(state)
        k = self.layout.units_of(keys)
        if k is None:
            raise ValueError("strategy: arrays of no depth tier's keys")
        width = next((w for w in self.tier_layout.all_tiers()
                      if all(tuple(v.shape) == self.layout.shapes(w)[key] for key, v in state.items())), None)
        if width is None:
            raise ValueError("strategy: arrays of no tier's shapes")
        if width == 1:
            model = self.model_fn()
            if keys != self.layout.all:
                model.load_state_dict(self.global_state())
        else:
            skeleton, sub = self.layout.narrow(width)
            model = copy.deepcopy(skeleton)
            model.load_state_dict(slice_state(self.global_state(), sub))
        model.load_state_dict(state, strict=keys == self.layout.all)
        return model.set_active(k).eval()

    def streaming_round(self, server_round: int) -> bool:
        return False   # the layer-wise average reads which arrays each reply holds

    # ---------------------------------------------------------------- configure: one message per node
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.tier_layout.learn([int(m.metadata.dst_node_id) for m in messages], grid, self._node_partitions)
        full = self.global_state()
        records: dict[int, ArrayRecord] = {}
        out: list[Message] = []
        sent: dict[str, int] = {}
        counts: dict[str, int] = {}
        for msg in messages:
            node = int(msg.metadata.dst_node_id)
            if node not in self.tier_layout.node_depth:
                continue
            k, w = self.node_units(node), self.node_width(node)
            if w < 1 and self.method not in WIDTH_DEPTH_TIER_METHODS:
                raise ValueError(f"strategy {self.method!r}: node {node}'s tier (node-config 'tier') has width {w:g}, "
                                 f"narrower than the global model; {self.method!r} cannot aggregate width x depth "
                                 f"tiers, use one of {list(WIDTH_DEPTH_TIER_METHODS)}")
            if (w, k) not in records:
                records[w, k] = state_to_record(self.layout.state(full, w, k))
            cfg = ConfigRecord(dict(msg.content.config_records[self.configrecord_key]))
            cfg[DEPTH_KEY] = int(k)
            if w < 1:
                cfg[TIER_KEY] = float(w)
            narrower = sorted({t for t in self.tier_layout.tiers if t < w}, reverse=True)
            one_shot = str(cfg.get("mode", "multi-round")) == "one-shot"   # own models (a warm start's round 1): none
            request_ordered_dropout(cfg, narrower, "off" if one_shot else self.ordered_dropout,
                                    self.ordered_dropout_draw, narrow_node=w < 1)
            cfg[SELF_DISTILL_KEY] = self.self_distill
            cfg[OWN_EXIT_KEY] = self.own_exit
            out.append(Message(content=RecordDict({self.arrayrecord_key: records[w, k], self.configrecord_key: cfg}),
                               dst_node_id=node, message_type=MessageType.TRAIN))
            count_sent(sent, counts, depth_label(self.tier_layout.node_depth[node], w), records[w, k])
        self._round_tiers = {"tier-bytes-sent": sent, "tier-clients": counts}
        log(INFO, "configure_train: round %d: depth tiers %s", server_round + self.round_offset,
            ", ".join(f"{t}: {counts[t]} nodes, {sent[t] / 1e6:.3f} MB" for t in sorted(counts)))
        self._sent_msgs = out
        return out

    # ---------------------------------------------------------------- replies
    def reply_reference(self, server_round: int, node_id: int):
        return self.layout.reference(self._reference(), self.node_width(node_id), self.node_units(node_id)), None

    def check_reply(self, server_round: int, msg: Message, record: dict[str, Any], **kw: Any) -> ClientUpdate | None:
        u = super().check_reply(server_round, msg, record, **kw)
        if u is not None:
            u.metrics["tier-depth"] = self.tier_layout.node_depth.get(u.node_id, 1.0)
            u.metrics["tier-width"] = self.node_width(u.node_id)
        return u

    def update_key(self, update: ClientUpdate) -> tuple:
        return (-update.metrics.get("tier-depth", 1.0), -update.metrics.get("tier-width", 1.0), update.partition_id,
                update.node_id)

    def rejected_extra(self, node_id: int) -> dict[str, Any]:
        return {"tier-depth": self.tier_layout.node_depth.get(node_id, 1.0), "tier-width": self.node_width(node_id)}

    # ---------------------------------------------------------------- aggregation
    def average(self, updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
        """DepthFL's layer-wise average: every array over the updates that hold it (sample-weighted); with width ×
        depth tiers every entry over the updates that hold it (HeteroFL's count-weighted average)."""
        g = self.global_state()
        states = [u.state for u in updates]
        if self.momentum_distillation is not None:   # InclusiveFL: each client's top layer mixed with its momentum
            states = self.momentum_distillation.mix(g, updates, self.node_units)
        return aggregate_held(g, states, [float(u.num_examples) for u in updates], self.update_positions(updates))

    def update_positions(self, updates: list[ClientUpdate]) -> list[dict[str, torch.Tensor] | None] | None:
        """Per update, the global positions of its arrays (``None`` for all when every node is at full width)."""
        pos = [self.layout.positions(self.node_width(u.node_id), self.node_units(u.node_id)) for u in updates]
        return None if all(p is None for p in pos) else pos

    weighted_average = average

    def aligned_average(self, server_round: int, updates: list[ClientUpdate],
                        models: list[nn.Module]) -> dict[str, torch.Tensor]:
        """``ot``: every client's units permuted onto the deepest client's by their activations on the fusion set
        (``align_depths``), then the layer-wise average of what each holds: clients trained from their own
        initialisations (one-shot) average unit by unit, not into a model at chance."""
        aligned = align_depths(models, [m.active for m in models], self.fusion_inputs, seed=self.seed + server_round,
                               device=resolve_device(self.device))
        return aggregate_held(self.global_state(), [{k: a[k] for k in u.state} for a, u in zip(aligned, updates)],
                              [float(u.num_examples) for u in updates])

    def fuse_updates(self, server_round: int, updates: list[ClientUpdate],
                     models: list[nn.Module] | None = None) -> FusionResult:
        """The layer-wise average (``ot``: of the aligned clients); for ``feddf`` and ``ot`` the clients' ensemble
        then distilled into every exit."""
        return self.fuse_as(self.round_method(server_round), server_round, updates, models)

    def fuse_own_models(self, server_round: int, updates: list[ClientUpdate], method: str) -> FusionResult:
        """A warm start's round 1 (``fedfuse.flower.aggregators.warm_start``): the clients' own models, trained from their own
        initialisations at their tiers, combined by ``method`` (``ot``: aligned across depths; ``feddf``)."""
        if method not in DEPTH_WARM_START:
            raise ValueError(f"strategy: a warm start across depth tiers combines the clients' own models with one of "
                             f"{list(DEPTH_WARM_START)}, not {method!r}")
        if strategy_spec(method).depth.aligns and any(self.node_width(u.node_id) < 1 for u in updates):
            raise ValueError("strategy: 'ot' aligns models of one width; width x depth tiers take 'feddf'")
        return self.fuse_as(method, server_round, updates)

    def fuse_as(self, method: str, server_round: int, updates: list[ClientUpdate],
                models: list[nn.Module] | None = None) -> FusionResult:
        """``fuse_updates`` with the aggregation ``method`` given."""
        t0 = time.perf_counter()
        entry = strategy_spec(method)
        if entry.depth.distils_exits and models is None:
            models = [self.build_model(u.state) for u in updates]
        model = self.build_model(self.aligned_average(server_round, updates, models) if entry.depth.aligns
                                 else self.average(updates))
        info: dict[str, Any] = {}
        if entry.depth.distils_exits:
            total = sum(u.num_examples for u in updates)
            # the feddf strategy: its own options; ot and a warm start's feddf: FedDF's server step at its defaults
            own = method == self.method and not entry.depth.aligns
            info = distill_exits(model, models, [u.num_examples / total for u in updates], self.fusion_inputs,
                                 self.method_options if own else None,
                                 seed=self.seed + server_round, device=resolve_device(self.device))
            model = model.cpu().eval()
        return FusionResult(method=method, model=model, info=info, seconds=time.perf_counter() - t0)

    def summary(self) -> None:
        super().summary()
        if self.momentum_distillation is not None:
            self.momentum_distillation.summary()

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        step = self.momentum_distillation
        if step is not None and self.round_offset and not step.momentum and server_round == 1:
            log(WARNING, "strategy inclusivefl: resumed after round %d; the momentum of the deeper tiers restarts "
                "empty (no momentum distillation until a deeper tier replies)", self.round_offset)
        sent = self.global_state() if step is not None else None   # the model this round's clients trained from
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None and step is not None:
            fresh = step.update(sent, self.last_updates, self.node_units)
            log(INFO, "aggregate_train: round %d: inclusivefl momentum (beta %g) from the next deeper tier for "
                "tiers %s (units)", server_round + self.round_offset, step.beta, fresh)
        if arrays is not None:
            self._global = arrays   # the tiers' evaluation reads the new global model
            self._width_models = {}   # ... and its slices
        record = self.history[-1] if self.history else {}
        record.update(self._round_tiers)
        record.update(client_tier_means(self.last_updates, lambda u: depth_label(u.metrics.get("tier-depth", 1.0),
                                                                                 u.metrics.get("tier-width", 1.0))))
        return arrays, metrics

    def adopt(self, arrays: ArrayRecord) -> None:
        """A model made after the rounds (the head round's) becomes the global model the tiers' evaluation reads."""
        self._global = arrays

    def head_plan(self, model: nn.Module, final_round: int, one_shot: bool) -> HeadPlan:
        """Every exit's classifier; after multi-round training each is checked on its own (a solved exit may beat its
        trained one or not: docs/tiers.md, "Depth tiers"); one-shot: every classifier, one check. With width × depth
        tiers every narrower width also gets its own model, the global model's slice as its nodes receive it, whose
        exits its nodes use are solved on that width's own features and checked at that width: after the head round
        the narrow tiers stop reading slices of the full width's exits, as width tiers' models stop being slices (a
        slice of an exit solved on the full width's features is not fitted to the narrow width's: measured,
        docs/tiers.md, "Width × depth tiers on Fashion-MNIST")."""
        if one_shot:
            return HeadPlan({1.0: model})
        if min(self.tier_layout.tiers) >= 1:
            return HeadPlan({1.0: model}, check_each=True)
        readers = classifier_readers(model, list(zip(self.tier_layout.tiers, self.tier_layout.depths)))
        narrower = sorted({w for w in self.tier_layout.tiers if w < 1}, reverse=True)
        every = tuple(head_sites(model))
        return HeadPlan({1.0: model, **{w: self.static_bn(narrow_copy(model, w, self.layout.input_shape))
                                        for w in narrower}},
                        per_tier=True, sites={1.0: every, **{w: tuple(s for s in every if w in readers.get(s, ()))
                                                              for w in narrower}})

    def static_bn(self, model: MultiExit) -> MultiExit:
        """A narrower width's model with HeteroFL's static batch normalisation (arXiv 2010.01264 §3): its BatchNorm
        running statistics re-estimated on the fusion set, every block's, since the aggregate's are averaged over
        nodes of other widths whose statistics describe other sub-networks; as width tiers' models are
        (``TieredFusionStrategy.tier_model``). Unchanged without a fusion set or BatchNorm (in place; returned)."""
        if self.fusion_inputs is not None:
            active = model.active
            reestimate_batchnorm(model.set_active(model.num_units), self.fusion_inputs,
                                 device=resolve_device(self.device))
            model.set_active(active)
        return model

    def adopt_head(self, models: dict[float, nn.Module]) -> None:
        """The head round's models: the global one, and with width × depth tiers every narrower width's own."""
        self.adopt(ArrayRecord(models[1.0].state_dict()))
        self._width_models = {w: m for w, m in models.items() if w != 1.0}

    # ---------------------------------------------------------------- evaluation (results)
    def evaluate_tiers(self, server_round: int, x: torch.Tensor, y: torch.Tensor, device) -> dict[str, Any]:
        """``{"tier-accuracy": {tier: test accuracy of its exit}, "exit-ensemble-accuracy": the mean softmax of every
        exit}`` of the global model the next round sends, plus the round's tier records."""
        if self._global is None:
            return {}
        model = self.build_model(self.global_state())
        acc, probs = {}, []
        tiers = sorted(set(zip(self.tier_layout.tiers, self.tier_layout.depths)), key=lambda t: (-t[1], -t[0]))
        # one model per width (its depths are views of it): the global one, a narrower width's own after the head
        # round, else its slice of the global model with static BN
        widths = {w: model if w == 1 else self._width_models.get(w) or self.static_bn(
            narrow_copy(model, w, self.layout.input_shape)) for w in {w for w, _ in tiers}}
        for w, d in tiers:
            logits = predict_logits(copy.copy(widths[w]).set_active(self._units[d]), x, device=device)
            acc[depth_label(d, w)] = float(metrics_from_logits(logits, y)["accuracy"])
            probs.append(logits.softmax(-1))
        ens = torch.stack(probs).mean(0)
        return {"tier-accuracy": acc, "exit-ensemble-accuracy": float((ens.argmax(-1) == y).float().mean()),
                **round_tier_records(self.history, server_round)}


# ---------------------------------------------------------------- the depth-tier baselines
class DepthFLStrategy(DepthTieredStrategy):
    """DepthFL (Kim, Yu, Kim & Moon, "DepthFL: Depthwise Federated Learning for Heterogeneous Clients", ICLR 2023):
    layer-wise averaging over the clients that hold each layer, one classifier per depth, the clients' mutual
    self-distillation between their classifiers; no server step."""

    method = "depthfl"


class DepthFLFedAvgStrategy(DepthTieredStrategy):
    """DepthFL without self-distillation (the paper's "DepthFL (FedAvg)" ablation)."""

    method = "depthfl-fedavg"


class InclusiveFLStrategy(DepthTieredStrategy):
    """InclusiveFL (Liu, Wu, Wu, Wang, Lyu, Chen & Xie, "No One Left Behind: Inclusive Federated Learning over
    Heterogeneous Devices", KDD 2022, arXiv 2202.08036): each client trains its first blocks with the one classifier
    after them (plain cross-entropy; it holds no shallower exit), the server averages every layer over the clients
    that hold it, and its one step is momentum distillation (``fedfuse.hetero.depth``; the step is
    ``fedfuse.flower.tiers.depth_tiers.MomentumDistillation``, held by the strategy as its entry says):

    - after a round, each tier but the deepest keeps a momentum ``m``: the next deeper tier's update (its clients'
      sample-weighted mean of state − global) averaged over the layers from the tier's top layer to the deeper
      tier's top layer, both included (``layer_momentum``);
    - the next round, each client of the tier has its top layer's update ``Δ`` replaced by ``(1 − β) Δ + β m``
      before the layer-wise average (``momentum_distill``), β = ``mom_beta`` (run-config ``mom-beta``, the
      paper's ``--mom_beta``, 0.2 in the authors' README command). β = 0: DepthFL-fedavg's layer-wise average.

    Read from the authors' ``InclusiveFL/server.py`` (``HeteAgg_mom``, ``Aggregator_mom``); where fedfuse departs:

    - their command's ``--local_one`` keeps each group's top layer private; here it is one layer of the global
      model, averaged over every client that holds it (DepthFL's layer-wise average), and the rule mixes only the
      shallow tier's clients' share of it;
    - their update loop overwrites the momentum with each layer's ``1/L``-weighted gradient (the last layer's
      wins) and their ``isinstance(..., int)`` test applies it only while it is the initial 0; fedfuse applies the
      rule as weighted: the mean over the layers, whenever a momentum exists;
    - the momentum is one round old, as theirs (computed at aggregation, used at the next update); a tier whose
      deeper tier sent no reply keeps its last one; none exists in a run's first round or after a resume (then no
      rule for that tier);
    - layers pair their arrays by name within the layer (``unit_arrays``): an array of another shape (an MLP's
      first hidden layer ``[W, in]`` against ``[W, W]``, a ResNet stage's first block with its shortcut) is left
      out of that array's mean, and a level's arrays outside its block (a ViT's embedding with block 0) take no
      momentum; both are logged once.

    ``ValueError`` for β outside [0, 1] (naming ``mom-beta``) or without a shallower tier (nothing to distil into).
    """

    method = "inclusivefl"


DEPTH_STRATEGY_CLASSES: dict[str, type[DepthTieredStrategy]] = {"depthfl": DepthFLStrategy,
                                                                "depthfl-fedavg": DepthFLFedAvgStrategy,
                                                                "inclusivefl": InclusiveFLStrategy}


def build_depth_strategy(name: str, *, depths: tuple[float, ...], **options: Any) -> DepthTieredStrategy:
    """The depth-tier strategy for ``name`` (one of ``DEPTH_METHODS``)."""
    cls = DEPTH_STRATEGY_CLASSES.get(name, DepthTieredStrategy)
    return cls(None if name in DEPTH_STRATEGY_CLASSES else name, depths=depths, **options)


__all__ = ["DepthTieredStrategy", "DEPTH_METHODS", "depth_label", "DepthFLStrategy", "DepthFLFedAvgStrategy", "InclusiveFLStrategy", "DEPTH_STRATEGY_CLASSES", "build_depth_strategy"]
