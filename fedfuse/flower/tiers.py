"""Capacity tiers on Flower: every node trains its tier's model; the server fuses all tiers into the global
(widest) model and derives each tier's model for the next round (issue 13, spec ``heterogeneous-fl.md``).

- ``TieredFusionStrategy(method=...)``: a ``FusionStrategy`` whose ``configure_train`` sends every sampled
  node *its own* message: the tier model's arrays and ``tier-width-mult`` (Flower's Message API; no
  framework change). A node's tier is learnt once, by a ``query`` message the ClientApp answers
  (``fedfuse.flower.tier_client``: node-config ``tier`` or ``client-tiers`` round-robin). Replies are
  validated against their tier's shapes; all replies are fused into the global architecture
  (``fuse(..., target=global)``, so any method with ``mixed_widths`` works: kf-linear, kf-gradient, kd,
  ot, ...). Each tier's next model is ``tier_models="slice"`` (the global model's top-left slice) or
  ``"fuse"`` (the round's clients fused directly into the tier's width; needs ``any_target``) or ``"prune"`` /
  ``"prune-recover"`` (structured pruning of the fused global model to the tier's architecture; the global
  model's units are reordered, function-preserving, so that the pruned tier model *is* its top-left slice:
  ``fedfuse.hetero.prune``; ``-recover`` then distils the round's clients into it).
  The weighted average that the divergence guard, the ``average`` fallback and ``fusion_rounds`` use is
  HeteroFL's count-weighted sub-model average here.
- ``HeteroFLStrategy``: HeteroFL (Diao et al., arXiv 2010.01264): top-left slices, every global entry the
  (sample-weighted) mean of the clients holding it, static BN (running statistics re-estimated on the
  fusion set where the model has BatchNorm), the width scaler in local training.
- ``FedRolexStrategy``: FedRolex (Alam et al., arXiv 2212.01548): the same with the window rolled by one
  unit per round.

Per round, ``history`` gets ``tier-bytes-sent`` / ``tier-clients`` / ``tier-val-accuracy`` / ``tier-train-seconds``
(``{tier: value}``), and ``evaluate_tiers`` scores every tier model on the test split for the results
(``tier-accuracy``).
"""

from __future__ import annotations

import copy
import time
from logging import INFO, WARNING
from typing import Any, Callable, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import nn

from fedfuse.flower.replies import IMPORTANCE_KEY, METRICS_KEY, ClientUpdate, NonFiniteWeights, ReplyRejected, validate_reply
from fedfuse.flower.strategy import FusionStrategy, state_to_record
from fedfuse.flower.tier_client import OD_KEY, QUERY_KIND, SCALER_KEY, TIER_KEY
from fedfuse.fusion import FusionResult, MethodSpec, check_finite, fuse_result
from fedfuse.hetero import (SubModel, aggregate_states, parse_tier_value, reestimate_batchnorm, slice_state, submodel,
                            tier_name)
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.fusion.refine import DistillRefineOptions, distill_ensemble, kl_to
from fedfuse.hetero.anchor import align_to_anchor
from fedfuse.hetero.prune import permutation_layout
from fedfuse.hetero.tiers import SUBMODEL_METHODS, TIER_MODELS, resolve_ordered_dropout, resolve_tier_models
from fedfuse.models.adapters import BATCHNORMS
from fedfuse.models import adapter_for, levels
from fedfuse.training import metrics_from_logits, predict_logits, resolve_device

QUERY_TIMEOUT = 600.0   # seconds a tier query waits for a node


def _shapes(state: dict[str, torch.Tensor]) -> tuple:
    return tuple((k, tuple(v.shape)) for k, v in state.items())


def _named_strategy(method: str | None) -> type[FusionStrategy] | None:
    """The flat strategy class of fusion method ``method`` (its default refine / server momentum), if any."""
    from fedfuse.flower.strategies import STRATEGIES   # here: strategies imports this module

    cls = STRATEGIES.get(method) if method is not None else None
    return cls if cls is not None and cls.method == method and cls.__module__ == "fedfuse.flower.strategies" else None


class TieredFusionStrategy(FusionStrategy):
    """Fusion across capacity tiers (see the module docstring).

    Args:
        tiers: the run's width multipliers (``client-tiers``; informational: a node's own tier comes from
            its query reply, so node-config overrides may add tiers).
        tier_models: ``"auto"`` (``prune`` for average and fusion methods, ``slice`` for feddf: measured;
            ``fedfuse.hetero.tiers.resolve_tier_models``) | ``"slice"`` | ``"fuse"`` | ``"distill"`` | ``"prune"`` |
            ``"prune-recover"``: how each tier's model is derived after every round (``"distill"``: the global model's slice, then FedDF's distillation
            of all the round's clients into it; ``"prune"``: see ``_prune_tiers``).
        prune_options: ``tier_models="prune"``: ``criterion`` (``fedfuse.pruning``'s; default ``auto``), ``recover``
            (``True`` or a ``DistillRefineOptions`` table; default ``True`` for ``"prune-recover"``, else off) and
            ``PruneOptions`` keys.
        input_shape: the inputs of the architecture (CNN tiers need it to rebuild their pooling).
        weighting: ``"examples"`` (sample counts, as every fedfuse aggregation) | ``"uniform"`` (the
            HeteroFL paper's plain count) for the sub-model average.
        width_scaler: ask clients to apply HeteroFL's width scaler in local training.
        ordered_dropout: ``"all"`` (or ``True``): ask every client to also train the narrower tiers' nested
            sub-models, one width drawn per batch (FjORD's ordered dropout, ``fedfuse.hetero.ordered_dropout``);
            ``"narrow"``: every client but the widest tier's; ``"off"`` (or ``False``); ``"auto"`` (default): the
            measured best, as the run-config key (``resolve_ordered_dropout``; off in one-shot rounds).
        Everything else: ``FusionStrategy``'s options.
    """

    window_rolls = False     # FedRolex: the sub-model window moves with the round
    static_bn = False        # HeteroFL: BN statistics re-estimated on the fusion set after aggregation

    def __init__(self, method: str | None = None, *, tiers: tuple[float, ...] = (1.0,), tier_models: str = "auto",
                 input_shape: tuple[int, ...] | None = None, weighting: str = "examples",
                 width_scaler: bool | None = False, anchor: bool = True, ordered_dropout: str | bool = "auto",
                 prune_options: dict[str, Any] | None = None, **options: Any) -> None:
        named = _named_strategy(method)
        if named is not None:   # the method's own defaults (e.g. average: server momentum 0.5; feddf: no refine)
            self.default_refine, self.default_server_momentum = named.default_refine, named.default_server_momentum
        if method == "average":
            # measured (MNIST-1D α=0.1, tiers 1/0.5/0.25, SGD lr 0.2, seed 0, 15 rounds): calibrate under server
            # momentum 0.5 drifts apart from the clients (bias shifts growing to 44, step norm to 219; 0.078), momentum
            # alone 0.344, calibrate alone 0.328: the tiered average refines nothing by default
            self.default_refine = "none"
        super().__init__(method, **options)
        if tier_models not in TIER_MODELS:
            raise ValueError(f"strategy: tier_models must be one of {TIER_MODELS}, got {tier_models!r}")
        tier_models = resolve_tier_models(self.method, tier_models,
                                          adapter_for(self.model_fn()).family if self.model_fn is not None else None)
        if weighting not in ("examples", "uniform"):
            raise ValueError(f"strategy: weighting must be 'examples' or 'uniform', got {weighting!r}")
        if self.model_fn is None:
            raise ValueError("strategy: a tiered strategy needs model_fn (the global, widest architecture)")
        self.tiers = tuple(parse_tier_value(t, key="strategy tiers") for t in tiers) or (1.0,)
        if (self.spec is not None and len(set(self.tiers)) > 1 and not self.spec.mixed_widths
                and self.method not in SUBMODEL_METHODS):
            raise ValueError(f"strategy: method {self.method!r} cannot fuse clients of different widths")
        if tier_models == "fuse" and self.spec is not None and not self.spec.any_target:
            raise ValueError(f"strategy: tier_models='fuse' needs a method that builds into another width; "
                             f"{self.method!r} cannot")
        self.prune_options = dict(prune_options or {})
        if tier_models == "prune-recover":
            self.prune_options.setdefault("recover", True)
        if tier_models.startswith("prune") and self.prune_options.get("recover") and self.fusion_inputs is None:
            raise ValueError(f"strategy: tier_models={tier_models!r} with recovery needs fusion_inputs (the server "
                             "fusion set)")
        if tier_models == "distill" and self.fusion_inputs is None:
            raise ValueError("strategy: tier_models='distill' needs fusion_inputs (the server fusion set)")
        if tier_models == "fuse" and self.method in SUBMODEL_METHODS:
            raise ValueError(f"strategy: {self.method!r} averages sub-models and derives tier models by slicing; "
                             "tier_models='fuse' does not apply")
        self.tier_models = tier_models
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.weighting = weighting
        if width_scaler is None:
            # HeteroFL's scaler (× 1/r in training) keeps the pre-normalisation scale equal across tiers; the paper
            # always pairs it with static BN. Without normalisation layers it multiplies an L-layer MLP's logits by
            # r^-L in training only (×16 for r = 1/4, L = 2) and a narrow client diverges (SGD lr 0.2: NaN)
            width_scaler = any(isinstance(m, BATCHNORMS) for m in self.model_fn().modules())
        self.width_scaler = bool(width_scaler)
        if ordered_dropout is True or ordered_dropout is False:
            ordered_dropout = "all" if ordered_dropout else "off"
        try:   # validated here; 'auto' is resolved per round (configure_train: the round's mode)
            resolve_ordered_dropout(self.method, ordered_dropout)
        except ValueError as exc:
            raise ValueError(f"strategy: {exc}") from None
        self.ordered_dropout = ordered_dropout
        self.anchor = bool(anchor)
        self._skeletons: dict[float, nn.Module] = {}
        self._layouts: dict[tuple[float, int], SubModel] = {}
        self._node_tier: dict[int, float] = {}
        self._derived: dict[float, dict[str, torch.Tensor]] = {}   # tier -> model from 'fuse' derivation
        self._round_tiers: dict[str, Any] = {}
        self._tier_guarded: dict[str, str] = {}   # tier -> why its derived model was replaced (the round's tier guard)
        self._tier_fallback: dict[str, torch.Tensor] | None = None   # the round's sub-model average when a tier is guarded
        self._offset = 0   # the window offset of the round being aggregated
        self._pruned: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None   # (state, perms)
        self._level_widths = None  # per tier (tier_level_widths)
        base_fn = self.fuse_fn

        def fuse_into_global(method: str, models: list[nn.Module], **kw: Any) -> FusionResult:
            kw.setdefault("target", self.model_fn())   # the widest architecture, whichever model comes first
            return base_fn(method, models, **kw)

        self.fuse_fn = fuse_into_global

    # ---------------------------------------------------------------- tiers and their layouts
    def skeleton(self, r: float) -> nn.Module:
        """A model of tier ``r``'s architecture (weights meaningless)."""
        if r not in self._skeletons:
            g = self.model_fn()
            self._skeletons[r] = g if r == 1 else adapter_for(g).at_width_mult(g, r, input_shape=self.input_shape)
        return self._skeletons[r]

    def window(self, server_round: int) -> int:
        """The sub-model window offset of ``server_round`` (0 unless the window rolls)."""
        return max(0, server_round - 1) if self.window_rolls else 0

    def layout(self, r: float, offset: int) -> SubModel:
        key = (r, offset)
        if key not in self._layouts:
            self._layouts[key] = submodel(self.skeleton(1.0), self.skeleton(r), offset=offset)
        return self._layouts[key]

    def global_state(self) -> dict[str, torch.Tensor]:
        if self._global is None:
            raise RuntimeError("strategy: no global model yet")
        return {k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in self._global.items()}

    def tier_state(self, r: float, server_round: int) -> dict[str, torch.Tensor]:
        """The state dict tier ``r`` receives in ``server_round`` (the global model itself for tier 1)."""
        if r == 1:
            return self.global_state()
        if r in self._derived:   # tier_models='fuse', or feddf's per-tier distillation
            return self._derived[r]
        return slice_state(self.global_state(), self.layout(r, self.window(server_round)))

    def build_model(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """A model for ``state`` of any tier (the tier is recognised by the arrays' shapes)."""
        sig = _shapes(state)
        for r in sorted({1.0, *self.tiers, *self._node_tier.values()}, reverse=True):
            sk = self.skeleton(r)
            if _shapes(sk.state_dict()) == sig:
                m = copy.deepcopy(sk)
                m.load_state_dict(state)
                return m.eval()
        raise ValueError("strategy: arrays of no known tier's shapes")

    # ---------------------------------------------------------------- configure: one message per node
    def _learn_tiers(self, node_ids: list[int], grid: Grid) -> None:
        """Ask nodes not seen yet for their partition id and tier (one QUERY message each)."""
        unknown = [n for n in node_ids if n not in self._node_tier]
        if not unknown:
            return
        msgs = [Message(content=RecordDict({"config": ConfigRecord({"query": QUERY_KIND})}), dst_node_id=n,
                        message_type=MessageType.QUERY) for n in unknown]
        replies = list(grid.send_and_receive(msgs, timeout=QUERY_TIMEOUT))
        by_id = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in msgs}
        for rep in replies:
            node = by_id.get(rep.metadata.reply_to_message_id, int(rep.metadata.src_node_id))
            if rep.has_error():
                raise RuntimeError(f"strategy: node {node} could not say its capacity tier: {rep.error.reason}")
            metrics = rep.content.metric_records.get("metrics")
            if metrics is None or "tier" not in metrics:
                raise RuntimeError(f"strategy: node {node}'s tier reply has no 'tier' metric (is its ClientApp "
                                   "fedfuse's, with the query handler?)")
            self._node_tier[node] = parse_tier_value(metrics["tier"], key=f"node {node} tier")
            if "partition-id" in metrics:
                self._node_partitions[node] = int(metrics["partition-id"])
        missing = [n for n in unknown if n not in self._node_tier]
        if missing:
            log(WARNING, "configure_train: nodes %s did not answer the tier query; they are left out this round",
                missing)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        true_round = server_round + self.round_offset
        nodes = [int(m.metadata.dst_node_id) for m in messages]
        self._learn_tiers(nodes, grid)
        states: dict[float, ArrayRecord] = {}
        out: list[Message] = []
        sent_bytes: dict[str, int] = {}
        counts: dict[str, int] = {}
        for msg in messages:
            node = int(msg.metadata.dst_node_id)
            if node not in self._node_tier:
                continue
            r = self._node_tier[node]
            if r not in states:
                states[r] = state_to_record(self.tier_state(r, true_round))
            cfg = ConfigRecord(dict(msg.content.config_records[self.configrecord_key]))
            cfg[TIER_KEY] = float(r)
            cfg[SCALER_KEY] = self.width_scaler
            narrower = sorted({t for t in (*self.tiers, *self._node_tier.values()) if t < r}, reverse=True)
            od = resolve_ordered_dropout(self.method, self.ordered_dropout, str(cfg.get("mode", "multi-round")))
            if narrower and (od == "all" or od == "narrow" and r < max(self.tiers, default=1.0)):
                cfg[OD_KEY] = [float(t) for t in narrower]
            content = RecordDict({self.arrayrecord_key: states[r], self.configrecord_key: cfg})
            out.append(Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN))
            name = tier_name(r)
            sent_bytes[name] = sent_bytes.get(name, 0) + sum(int(a.numpy().nbytes) for a in states[r].values())
            counts[name] = counts.get(name, 0) + 1
        self._round_tiers = {"tier-bytes-sent": sent_bytes, "tier-clients": counts}
        log(INFO, "configure_train: round %d: tiers %s", true_round,
            ", ".join(f"{k}: {counts[k]} nodes, {sent_bytes[k] / 1e6:.3f} MB" for k in sorted(counts, key=float)))
        self._sent_msgs = out
        return out

    # ---------------------------------------------------------------- replies
    def tier_level_widths(self, r: float) -> dict[str, int]:
        return {lv.name: lv.width for lv in levels(self.skeleton(r))}

    def _validate(self, server_round: int, ok: list[Message], record: dict[str, Any]) -> list[ClientUpdate]:
        need_scores = self.round_needs_scores(server_round)
        updates: list[ClientUpdate] = []
        for msg in ok:
            node = int(msg.metadata.src_node_id)
            r = self._node_tier.get(node, 1.0)
            reference = {k: (tuple(v.shape), v.detach().cpu().numpy().dtype)
                         for k, v in self.skeleton(r).state_dict().items()}
            try:
                u = validate_reply(msg, reference, self.tier_level_widths(r) if need_scores else None,
                                   arrays_key=self.arrayrecord_key, metrics_key=METRICS_KEY,
                                   importance_key=IMPORTANCE_KEY, weight_key=self.weighted_by_key)
            except ReplyRejected as exc:
                log(WARNING, "aggregate_train: round %d: rejected reply from node %d (tier %s): %s", server_round,
                    node, tier_name(r), exc)
                rejected = {"node-id": node, "reason": str(exc), "tier": r}
                if isinstance(exc, NonFiniteWeights):
                    rejected["non-finite-weights"] = True
                record["rejected"].append(rejected)
                continue
            u.metrics["tier"] = r
            updates.append(u)
        # the widest model first: it is the fusion reference (model 0), then partition order
        updates.sort(key=lambda u: (-u.metrics["tier"], u.partition_id, u.node_id))
        self._node_partitions.update({u.node_id: u.partition_id for u in updates})
        return updates

    # ---------------------------------------------------------------- aggregation
    def _weights(self, updates: list[ClientUpdate]) -> list[float]:
        return [float(u.num_examples) if self.weighting == "examples" else 1.0 for u in updates]

    def weighted_average(self, updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
        """HeteroFL's sub-model average of the updates into the global model (the average of mixed widths)."""
        subs = [self.layout(u.metrics["tier"], self._offset) for u in updates]
        return aggregate_states(self.global_state(), [u.state for u in updates], subs, self._weights(updates))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        self._offset = self.window(server_round + self.round_offset)
        arrays, metrics = super().aggregate_train(server_round, replies)
        record = self.history[-1] if self.history else {}
        record.update(self._round_tiers)
        for src, key in (("val-accuracy", "tier-val-accuracy"), ("train-seconds", "tier-train-seconds")):
            vals: dict[str, list[float]] = {}
            for u in self.last_updates:
                v = u.metrics.get(src)
                if isinstance(v, (int, float)):
                    vals.setdefault(tier_name(u.metrics["tier"]), []).append(float(v))
            record[key] = {k: sum(v) / len(v) for k, v in vals.items()}
        if arrays is not None:
            self._global = arrays   # the derivations below slice / fuse from the new global model
            t0 = time.perf_counter()
            self.derive_tier_models(server_round + self.round_offset, self.last_updates)
            record["tier-derivation-seconds"] = time.perf_counter() - t0
            if self._tier_guarded:
                record["tier-guard"] = dict(self._tier_guarded)
                if self._tier_fallback is not None:
                    # the tiers must stay nested slices of the global model (the next round averages the narrow
                    # clients' entries into the global's top-left block): the whole round uses the sub-model average
                    arrays = state_to_record(self._tier_fallback)
                    self._global = arrays
                    self._derived.clear()
                    self.reset_server_state()
                    record["guard"] = record.get("guard") or f"average (tier guard: {'; '.join(self._tier_guarded.values())})"
                    log(WARNING, "aggregate_train: round %d: tier guard: the round uses the sub-model average for the "
                        "global model and every tier", server_round + self.round_offset)
            if self._pruned is not None and not self._tier_guarded:
                # tier_models='prune': the new global model with its units reordered (same function), so that every
                # tier's pruned model is its top-left slice; the server momentum follows the units
                state, perms = self._pruned
                arrays = state_to_record(state)
                self._global = arrays
                if self._momentum is not None:
                    layout = permutation_layout(self.skeleton(1.0), perms)
                    self._momentum = slice_state(self._momentum, layout)
            self._pruned = None
            self._tier_fallback = None
        return arrays, metrics

    def fuse_updates(self, server_round: int, updates: list[ClientUpdate],
                     models: list[nn.Module] | None = None) -> FusionResult:
        """Fuse the replies of every tier into the global architecture.

        ``average`` (and every round after ``fusion_rounds``): HeteroFL's sub-model average. ``feddf`` (FedDF with
        architecture groups, Lin et al., arXiv 2006.07242): that average, then the ensemble of *all* clients
        (every tier) distilled into it on the fusion set. Other methods (kf-linear, kf-gradient, ot, kd...): fused
        into the global width, then (``anchor``) their units permuted onto the HeteroFL average's, so that unit
        ``i`` stays the unit the tiers' slices hold (``fedfuse.hetero.anchor``).
        """
        method = self.round_method(server_round)
        if method in SUBMODEL_METHODS:
            t0 = time.perf_counter()
            model = self.build_model(self.weighted_average(updates))
            info: dict[str, Any] = {}
            if method == "feddf":
                teachers = models if models is not None else [self.build_model(u.state) for u in updates]
                dev = resolve_device(self.device)
                info.update(distill_ensemble(model, teachers, self._norm_weights(updates), self.fusion_inputs,
                                             self.spec.parse_options(self.fusion_options),
                                             seed=self.seed + server_round, device=dev))
                model = model.cpu().eval()
            return FusionResult(method=method, model=model, info=info, seconds=time.perf_counter() - t0)
        result = super().fuse_updates(server_round, updates, models)
        if not self.anchor or len({u.metrics["tier"] for u in updates}) < 2 and self.window(server_round) == 0:
            return result   # one width, top-left slices: nothing depends on the unit order
        check_finite(method, result.model)
        anchor = self.build_model(self.weighted_average(updates))
        model, info = align_to_anchor(result.model, anchor, seed=self.seed + server_round)
        return FusionResult(method=result.method, model=model, info={**(result.info or {}), **info},
                            seconds=result.seconds)

    def _norm_weights(self, updates: list[ClientUpdate]) -> list[float]:
        w = self._weights(updates)
        return [v / sum(w) for v in w]

    def aggregate_state(self, server_round: int, updates: list[ClientUpdate]):
        state, info, seconds = super().aggregate_state(server_round, updates)
        if self.static_bn and self.fusion_inputs is not None:
            model = self.build_model(state)
            if reestimate_batchnorm(model, self.fusion_inputs, device=resolve_device(self.device)):
                state = model.state_dict()
                info["static-bn"] = True
        return state, info, seconds

    def derive_tier_models(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """``tier_models="fuse"``: fuse the round's client models into every narrower tier's width. ``feddf``:
        every narrower tier's slice of the new global model is a student of the ensemble of all clients."""
        self._derived.clear()   # a tier without a derivation this round gets the new global model's slice
        self._tier_guarded = {}
        self._pruned = None
        if not updates or self.spec is None:
            return
        if self.tier_models.startswith("prune"):   # (with feddf: instead of its per-tier distillation)
            self._prune_tiers(server_round, updates)
        elif self.tier_models == "distill" or self.round_method(server_round) == "feddf":
            self._distill_tiers(server_round, updates)
        elif self.tier_models == "fuse" and self.method not in SUBMODEL_METHODS:
            self._fuse_tiers(server_round, updates)
        self.guard_tiers(server_round, updates)

    def guard_tiers(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """The divergence guard for every narrower tier's model (fusion methods; sub-model averaging needs none):
        a tier model (fused into the tier's width, or the slice of a fused global model, whose units the
        level fits mixed) whose KL to the round's clients' ensemble on the fusion set exceeds ``guard_ratio`` ×
        that of the tier's slice of HeteroFL's sub-model average + 0.05 (or is not finite) is replaced by that
        slice (WARNING, ``history[round]["tier-guard"]``). Measured without it (MNIST-1D α=0.1, tiers
        1/0.5/0.25, kf-linear, seed 0): the global guard passed a fused model whose 0.25 slice scored 0.105,
        and ``tier_models='fuse'`` sent tier models with KL 17 → 3e4 whose clients returned NaN (final 0.10).
        Guarding a tier alone is not enough: the next round averages the narrow clients' entries into the global
        model's top-left block, which must hold the same units (replacing only the tier models: 0.115), so a
        guarded tier makes ``aggregate_train`` use the sub-model average for the global model and every tier
        (``self._tier_fallback``)."""
        if (not self.guard or self.fusion_inputs is None or self.round_method(server_round) in SUBMODEL_METHODS
                or len(updates) == 0):
            return
        tiers = sorted(set(self._node_tier.values()) - {1.0})
        if not tiers:
            return
        x = torch.as_tensor(self.fusion_inputs).float()
        teachers = [self.build_model(u.state) for u in updates]
        target = teacher_probs(teachers, x, self._norm_weights(updates))
        average = self.weighted_average(updates)   # HeteroFL's sub-model average (into the new global's entries)
        nxt = self.window(server_round + 1)
        for r in tiers:
            layout = self.layout(r, nxt)
            candidate = self._derived.get(r)
            if candidate is None:
                candidate = slice_state(self.global_state(), layout)
            safe = slice_state(average, layout)
            with torch.no_grad():
                logits = self.build_model(candidate)(x)
                kl_c = kl_to(target, logits) if bool(torch.isfinite(logits).all()) else float("inf")
                kl_s = kl_to(target, self.build_model(safe)(x))
            if not kl_c <= self.guard_ratio * kl_s + 0.05:
                reason = (f"tier {tier_name(r)}: its model's KL to the clients' ensemble on the fusion set is "
                          f"{kl_c:.4g}, above {self.guard_ratio:g} x the sub-model average's slice's {kl_s:.4g} + 0.05")
                log(WARNING, "aggregate_train: round %d: tier guard: %s; the tier gets that slice", server_round,
                    reason)
                self._tier_guarded[tier_name(r)] = reason
                self._derived[r] = {k: v.detach().clone() for k, v in safe.items()}
        if self._tier_guarded:
            self._tier_fallback = average

    def _fuse_tiers(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """``tier_models="fuse"``: the round's client models fused into every narrower tier's width."""
        models = [self.build_model(u.state) for u in updates]
        scores = [u.scores for u in updates] if self.wants_client_scores and all(u.scores for u in updates) else None
        for r in sorted({self._node_tier[n] for n in self._node_tier} - {1.0}):
            try:
                res = fuse_result(self.method, models, fusion_inputs=self.fusion_inputs, scores=scores,
                                  weights=[u.num_examples for u in updates], device=self.device,
                                  seed=self.seed + server_round, target=self.skeleton(r),
                                  refine="+".join(self.refine_steps) or None,
                                  prior=self.class_prior(updates)[0] if "calibrate" in self.refine_steps else None,
                                  **self.fusion_options)
                check_finite(self.method, res.model)
                model = res.model
                if self.anchor:   # its units onto the new global model's slice (the next round averages them there)
                    slice_model = self.build_model(slice_state(self.global_state(),
                                                               self.layout(r, self.window(server_round + 1))))
                    model, _ = align_to_anchor(model, slice_model, seed=self.seed + server_round)
                self._derived[r] = model.state_dict()
            except ValueError as exc:   # FusionError: this tier keeps the slice of the global model
                self._derived.pop(r, None)
                log(WARNING, "aggregate_train: round %d: fusing tier %s failed (%s); it gets the global model's slice",
                    server_round, tier_name(r), exc)

    def aggregated_scores(self, updates: list[ClientUpdate]) -> dict[str, torch.Tensor] | None:
        """The round's client importance scores at the global width (level name -> ``[width]``), or ``None`` when
        not every client sent scores: each client's level scores divided by their mean, then the sample-weighted mean
        over the clients holding each unit (a tier of width ``c`` holds units ``0..c-1``: the top-left slice)."""
        if not updates or not all(u.scores for u in updates):
            return None
        widths = {lv.name: lv.width for lv in levels(self.skeleton(1.0))}
        w = self._weights(updates)
        out = {}
        for name, width in widths.items():
            acc, cnt = torch.zeros(width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
            for u, wi in zip(updates, w):
                s = u.scores.get(name)
                if s is None:
                    continue
                s = torch.as_tensor(s).double().flatten()[:width]
                s = s / s.mean().clamp_min(1e-12)
                acc[:len(s)] += wi * s
                cnt[:len(s)] += wi
            if bool((cnt > 0).all()):
                out[name] = (acc / cnt).float()
        return out or None

    def _prune_tiers(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """``tier_models="prune"``: every narrower tier's model is the new global model structurally pruned to the
        tier's architecture (``fedfuse.pruning``, ``target=`` the tier; importance ``criterion`` of
        ``prune_options``, default ``auto``, with the round's aggregated client scores when it has them). Tiers
        are nested top-left slices of the global model (the next round maps the narrow clients' replies back by
        position), so pruning only chooses which units each slice holds: the global model's units are reordered
        (a function-preserving permutation, ``fedfuse.hetero.prune.prune_order``; the narrower tiers pruned from the
        wider tier's model, so they stay nested) and each tier's pruned model is exactly its top-left slice.
        ``aggregate_train`` hands out the reordered global model unless the tier guard fell back. With ``recover``
        the slice is then distilled from the round's client models on the fusion set (``distill_ensemble``,
        held-out early stopping: its units stay those of the slice)."""
        from fedfuse.hetero.prune import prune_order

        tiers = sorted(set(self._node_tier.values()) - {1.0})
        if not tiers:
            return
        opts = dict(self.prune_options)
        recover = opts.pop("recover", False)
        criterion = opts.pop("criterion", "auto")
        if self.input_shape is not None and "input_shape" not in opts:
            opts["input_shape"] = self.input_shape
        glob = self.build_model(self.global_state())
        x = torch.as_tensor(self.fusion_inputs).float() if self.fusion_inputs is not None else None
        scores = self.aggregated_scores(updates)
        state, perms, info = prune_order(glob, {tier_name(r): self.skeleton(r) for r in tiers}, scores=scores,
                                         fusion_inputs=x, criterion=criterion, seed=self.seed + server_round, **opts)
        teachers = [self.build_model(u.state) for u in updates] if recover else None
        dev = resolve_device(self.device)
        for r in tiers:
            student = self.build_model(slice_state(state, self.layout(r, 0)))
            if recover:
                ropts = DistillRefineOptions(**recover) if isinstance(recover, dict) else DistillRefineOptions()
                info[tier_name(r)]["recover"] = distill_ensemble(student, teachers, self._norm_weights(updates), x,
                                                                 ropts, seed=self.seed + server_round, device=dev)
                student = student.cpu()
                check_finite(f"prune (tier {tier_name(r)})", student)
            self._derived[r] = {k: v.detach().cpu() for k, v in student.state_dict().items()}
        if self.history and self.history[-1].get("round") == server_round:
            self.history[-1]["tier-prune"] = {k: {kk: vv for kk, vv in v.items() if kk != "recover"}
                                              for k, v in info.items()}
        self._pruned = (state, perms)

    def _distill_tiers(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """``tier_models="distill"`` and FedDF with architecture groups: each narrower tier's model (the slice of the new global model) learns
        the weighted softmax of all the round's clients on the fusion set (early stopping on a held-out part)."""
        teachers = [self.build_model(u.state) for u in updates]
        # feddf's own distillation options; other methods: the refine step's defaults (Adam 1e-3, early stopping)
        options = self.spec.parse_options(self.fusion_options) if self.method == "feddf" else DistillRefineOptions()
        dev = resolve_device(self.device)
        for r in sorted(set(self._node_tier.values()) - {1.0}):
            student = self.build_model(slice_state(self.global_state(), self.layout(r, self.window(server_round + 1))))
            distill_ensemble(student, teachers, self._norm_weights(updates), self.fusion_inputs, options,
                             seed=self.seed + server_round, device=dev)
            check_finite(f"feddf (tier {tier_name(r)})", student.cpu())
            self._derived[r] = {k: v.detach().cpu() for k, v in student.state_dict().items()}

    # ---------------------------------------------------------------- evaluation (results)
    def tier_model(self, r: float, server_round: int) -> nn.Module:
        """Tier ``r``'s model as it is sent in ``server_round`` (BN re-estimated on the fusion set if any)."""
        model = self.build_model(self.tier_state(r, server_round))
        if self.fusion_inputs is not None and r != 1:
            reestimate_batchnorm(model, self.fusion_inputs)
        return model

    def evaluate_tiers(self, server_round: int, x: torch.Tensor, y: torch.Tensor, device) -> dict[str, Any]:
        """``{"tier-accuracy": {tier: test accuracy}}`` of the tier models the next round sends, plus the round's
        ``tier-bytes-sent``, ``tier-clients``, ``tier-val-accuracy`` and ``tier-train-seconds`` (the tier's clients'
        mean local-training wall seconds; after round 0: empty)."""
        if self._global is None:
            return {}
        tiers = sorted({1.0, *self.tiers, *self._node_tier.values()}, reverse=True)
        acc = {}
        for r in tiers:
            logits = predict_logits(self.tier_model(r, server_round + 1), x, device=device)
            acc[tier_name(r)] = float(metrics_from_logits(logits, y)["accuracy"])
        out: dict[str, Any] = {"tier-accuracy": acc}
        hist = next((h for h in reversed(self.history) if h.get("round") == server_round), None)
        if hist is not None:
            for key in ("tier-bytes-sent", "tier-clients", "tier-val-accuracy", "tier-train-seconds"):
                if key in hist:
                    out[key] = hist[key]
        return out


class HeteroFLStrategy(TieredFusionStrategy):
    """HeteroFL (Diao, Ding & Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning for
    Heterogeneous Clients", arXiv 2010.01264): nested top-left sub-models, count-weighted averaging of the
    entries each client holds, static BN, the width scaler. Aggregates arrays only (no fusion method)."""

    method = "heterofl"
    default_refine = "none"
    default_server_momentum = 0.0   # plain HeteroFL: the aggregate is the new global model
    can_refine = False
    static_bn = True

    def __init__(self, method: str | None = None, *, width_scaler: bool | None = None, guard: bool = False,
                 **options: Any) -> None:
        options.pop("tier_models", None)
        super().__init__(method, width_scaler=width_scaler, guard=False, tier_models="slice", **options)

    def _method_spec(self, method: str) -> MethodSpec | None:
        return None  # not a fedfuse.fusion method

    def _check_options(self, options: dict[str, Any]) -> None:
        if options:
            raise ValueError(f"strategy {self.method!r} takes no fusion_options, got {sorted(options)}")

    def aggregate_state(self, server_round: int, updates: list[ClientUpdate]):
        t0 = time.perf_counter()
        state = self.weighted_average(updates)
        info: dict[str, Any] = {"window-offset": self._offset}
        if self.static_bn and self.fusion_inputs is not None:
            model = self.build_model(state)
            if reestimate_batchnorm(model, self.fusion_inputs, device=resolve_device(self.device)):
                state = model.state_dict()
                info["static-bn"] = True
        return state, info, time.perf_counter() - t0


class FedRolexStrategy(HeteroFLStrategy):
    """FedRolex (Alam, Liu, Yan & Zhang, "FedRolex: Model-Heterogeneous Federated Learning with Rolling
    Sub-Model Extraction", arXiv 2212.01548): HeteroFL's averaging with a sub-model window that rolls by one
    unit (one attention head) per round."""

    method = "fedrolex"
    window_rolls = True


TIER_STRATEGY_CLASSES: dict[str, type[FusionStrategy]] = {"heterofl": HeteroFLStrategy, "fedrolex": FedRolexStrategy}


def build_tier_strategy(name: str, *, tiers: tuple[float, ...], tier_models: str = "auto",
                        input_shape: tuple[int, ...] | None = None, **options: Any) -> FusionStrategy:
    """The tier-aware strategy for ``name``: ``heterofl`` / ``fedrolex``, or ``TieredFusionStrategy`` fusing
    with the fusion method ``name``."""
    if name in TIER_STRATEGY_CLASSES:
        if resolve_tier_models(name, tier_models) != "slice":
            raise ValueError(f"strategy {name!r} derives tier models by slicing only, got tier_models={tier_models!r}")
        return TIER_STRATEGY_CLASSES[name](tiers=tiers, input_shape=input_shape, **options)
    return TieredFusionStrategy(name, tiers=tiers, tier_models=tier_models, input_shape=input_shape, **options)


def strategy_builder(cfg, input_shape: tuple[int, ...]) -> tuple[Callable[..., FusionStrategy], dict[str, Any]]:
    """``(build function, its extra options)`` for a run config: ``build_tier_strategy`` with the tiers when
    ``client-tiers`` is set or the strategy is ``heterofl`` / ``fedrolex``, else the plain ``build_strategy``."""
    from fedfuse.flower.strategies import build_strategy
    from fedfuse.hetero import parse_tiers

    tiers = parse_tiers(cfg.client_tiers, key="run-config key 'client-tiers'")
    if not tiers and cfg.strategy not in TIER_STRATEGY_CLASSES:
        return build_strategy, {}
    return build_tier_strategy, {"tiers": tiers or (1.0,), "tier_models": cfg.tier_models,
                                 "input_shape": tuple(input_shape),
                                 "ordered_dropout": cfg.ordered_dropout}


__all__ = ["TieredFusionStrategy", "HeteroFLStrategy", "FedRolexStrategy", "TIER_STRATEGY_CLASSES",
           "build_tier_strategy", "strategy_builder"]
