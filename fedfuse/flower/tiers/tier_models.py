"""The tiers' models in a federation with capacity tiers: the layout (which node holds which width, each tier's
architecture, where a tier's entries sit inside the global (widest) model) and how each narrower tier's model is
derived after a round (below).

A tier is a width multiplier ``r`` in (0, 1] of the global model (HeteroFL, arXiv 2010.01264). Tier ``r``'s
model is a nested sub-model of the global one: the top-left slice of every level (``fedfuse.hetero.submodel``),
or, for FedRolex (arXiv 2212.01548), a window that rolls by one unit per round. A node's tier is learnt once by a
``query`` message its ClientApp answers (``fedfuse.flower.tiers.client_tiers``).

**How each narrower tier's model is derived** after a round, and guarded.

``TierModels`` is the round step of capacity tiers (composed into ``TieredFusionStrategy``): after the new
global model is set it derives every narrower tier's model by the strategy's ``tier_models`` rule:

- ``"slice"``: the global model's top-left slice (nothing to derive);
- ``"fuse"``: the round's client models fused directly into the tier's width (``fuse(..., target=tier)``);
- ``"distill"`` (and FedDF with architecture groups): the slice, then the ensemble of all the round's clients
  distilled into it on the fusion set;
- ``"prune"`` / ``"prune-recover"``: the fused global model structurally pruned to the tier's architecture, its
  units reordered (function-preserving) so that each pruned tier model *is* its top-left slice
  (``fedfuse.hetero.prune``); ``-recover`` then distils the round's clients into it.

then guards each derived tier model against the tier's slice of the sub-model average (``guard_tiers``).
"""

from __future__ import annotations

import copy
from logging import WARNING
from typing import Callable
import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import nn
from fedfuse.hetero import SubModel, parse_tier_value, slice_state, submodel
from fedfuse.hetero.ordered_dropout import draw_weights
from fedfuse.hetero.tiers import resolve_ordered_dropout_draw
from fedfuse.models import adapter_for, levels
from fedfuse.flower.tiers.client_tiers import DEPTHS_KEY, OD_DRAW_KEY, OD_KEY, QUERY_KIND, TIERS_KEY
from typing import Any
from fedfuse.fusion import check_finite, fuse_result
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.fusion.refine import DistillRefineOptions, distill_ensemble, kl_to
from fedfuse.hetero import slice_state, tier_name
from fedfuse.hetero.anchor import align_to_anchor
from fedfuse.hetero.prune import prune_order
from fedfuse.models import levels
from fedfuse.training import resolve_device
from fedfuse.flower.round.protocol import RoundProtocol
from fedfuse.flower.round.replies import ClientUpdate

QUERY_TIMEOUT = 600.0   # seconds a tier query waits for a node


def checked_draw(method: str, draw: str | float, model: nn.Module) -> str | float:
    """The ordered-dropout draw of ``method`` on ``model``'s family (``auto`` resolved), validated: a bad one is a
    ``ValueError`` naming the option, before any node trains."""
    draw = resolve_ordered_dropout_draw(method, draw, adapter_for(model).family)
    try:
        draw_weights(draw, 1.0, [0.5])
    except ValueError as exc:
        raise ValueError(f"strategy: ordered_dropout_draw: {exc}") from None
    return draw


def request_ordered_dropout(cfg: ConfigRecord, narrower: list[float], dropout: str, draw: str | float, *,
                            narrow_node: bool) -> None:
    """Ask a node (its train ``cfg``) to train the ``narrower`` nested widths of its model too, one drawn per batch
    (FjORD's ordered dropout, arXiv 2102.13451): with ``dropout`` ``'all'``, or ``'narrow'`` on a ``narrow_node``;
    ``draw`` other than uniform goes with it (``fedfuse.hetero.ordered_dropout.draw_weights``)."""
    if narrower and (dropout == "all" or dropout == "narrow" and narrow_node):
        cfg[OD_KEY] = [float(t) for t in narrower]
        if draw != "uniform":
            cfg[OD_DRAW_KEY] = draw


def count_sent(sent: dict[str, int], counts: dict[str, int], name: str, record) -> None:
    """Add one message of tier ``name`` carrying ``record`` (an ``ArrayRecord``) to the round's byte and node counts."""
    sent[name] = sent.get(name, 0) + sum(int(a.numpy().nbytes) for a in record.values())
    counts[name] = counts.get(name, 0) + 1


def _shapes(state: dict[str, torch.Tensor]) -> tuple:
    return tuple((k, tuple(v.shape)) for k, v in state.items())


class TierLayout:
    """Tiers, their architectures and their sub-model layouts.

    Args:
        model_fn: ``() -> nn.Module``: the global (widest) architecture.
        tiers: the run's width multipliers (a node's own tier comes from its query reply, so node-config overrides
            may add tiers).
        input_shape: the inputs of the architecture (CNN tiers rebuild their pooling from it).
        window_rolls: FedRolex's rolling window (the offset of round ``t`` is ``t - 1``).
        depths: the run's depth multipliers (depth tiers): the query asks every node for its depth too
            (``node_depth``).
    """

    def __init__(self, model_fn: Callable[[], nn.Module], tiers: tuple[float, ...],
                 input_shape: tuple[int, ...] | None = None, window_rolls: bool = False,
                 depths: tuple[float, ...] = ()) -> None:
        self.model_fn = model_fn
        self.tiers = tuple(parse_tier_value(t, key="strategy tiers") for t in tiers) or (1.0,)
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.window_rolls = window_rolls
        self.depths = tuple(float(d) for d in depths)
        self.node_tier: dict[int, float] = {}
        self.node_depth: dict[int, float] = {}
        self._skeletons: dict[float, nn.Module] = {}
        self._layouts: dict[tuple[float, int], SubModel] = {}

    def all_tiers(self) -> list[float]:
        """Every tier of the run and of the nodes seen, widest first."""
        return sorted({1.0, *self.tiers, *self.node_tier.values()}, reverse=True)

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

    def level_widths(self, r: float) -> dict[str, int]:
        return {lv.name: lv.width for lv in levels(self.skeleton(r))}

    def reference(self, r: float) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{name: (shape, dtype)}`` a reply of tier ``r`` must have."""
        return {k: (tuple(v.shape), v.detach().cpu().numpy().dtype) for k, v in self.skeleton(r).state_dict().items()}

    def slice(self, global_state: dict[str, torch.Tensor], r: float, server_round: int) -> dict[str, torch.Tensor]:
        """Tier ``r``'s entries of ``global_state`` in ``server_round`` (the state itself for tier 1)."""
        return global_state if r == 1 else slice_state(global_state, self.layout(r, self.window(server_round)))

    def build_model(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """A model for ``state`` of any tier (the tier is recognised by the arrays' shapes)."""
        sig = _shapes(state)
        for r in self.all_tiers():
            sk = self.skeleton(r)
            if _shapes(sk.state_dict()) == sig:
                m = copy.deepcopy(sk)
                m.load_state_dict(state)
                return m.eval()
        raise ValueError("strategy: arrays of no known tier's shapes")

    def learn(self, node_ids: list[int], grid: Grid, partitions: dict[int, int]) -> None:
        """Ask nodes not seen yet for their partition id and tier (one QUERY message each); ``partitions`` learns
        their partition ids."""
        unknown = [n for n in node_ids if n not in self.node_tier]
        if not unknown:
            return
        query = ConfigRecord({"query": QUERY_KIND, TIERS_KEY: [float(t) for t in self.tiers],
                              **({DEPTHS_KEY: list(self.depths)} if self.depths else {})})
        msgs = [Message(content=RecordDict({"config": ConfigRecord(dict(query))}), dst_node_id=n,
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
            if self.depths:
                if "tier-depth" not in metrics or float(metrics["tier-depth"]) not in self.depths:
                    raise RuntimeError(f"strategy: node {node}'s tier reply has no depth of the run's "
                                       f"{sorted(set(self.depths))} (is its ClientApp fedfuse's?)")
                self.node_depth[node] = float(metrics["tier-depth"])
            self.node_tier[node] = parse_tier_value(metrics["tier"], key=f"node {node} tier")
            if "partition-id" in metrics:
                partitions[node] = int(metrics["partition-id"])
        missing = [n for n in unknown if n not in self.node_tier]
        if missing:
            log(WARNING, "configure_train: nodes %s did not answer the tier query; they are left out this round",
                missing)


ROUND_TIER_KEYS = ("tier-bytes-sent", "tier-clients", "tier-val-accuracy", "tier-train-seconds")


def client_tier_means(updates, label_of: Callable[[object], str]) -> dict[str, dict[str, float]]:
    """``{"tier-val-accuracy": {tier: mean}, "tier-train-seconds": {tier: mean}}`` over the round's updates,
    grouped by ``label_of(update)``."""
    out = {}
    for src, key in (("val-accuracy", "tier-val-accuracy"), ("train-seconds", "tier-train-seconds")):
        vals: dict[str, list[float]] = {}
        for u in updates:
            v = u.metrics.get(src)
            if isinstance(v, (int, float)):
                vals.setdefault(label_of(u), []).append(float(v))
        out[key] = {k: sum(v) / len(v) for k, v in vals.items()}
    return out


def round_tier_records(history: list[dict], server_round: int) -> dict:
    """The tier records (``ROUND_TIER_KEYS``) of round ``server_round`` in a strategy's ``history``."""
    hist = next((h for h in reversed(history) if h.get("round") == server_round), None)
    return {key: hist[key] for key in ROUND_TIER_KEYS if hist is not None and key in hist}


# ---------------------------------------------------------------- how each narrower tier's model is derived
class TierModels:
    """The derived tier models of a tiered strategy and the state of the round's tier guard.

    Args:
        strategy: the tiered strategy (its layout, fusion set, method and options).
        tier_models: the resolved rule (``"slice"`` | ``"fuse"`` | ``"distill"`` | ``"prune"`` | ``"prune-recover"``).
        prune_options: ``criterion`` (``fedfuse.pruning``'s; default ``auto``), ``recover`` (``True`` or a
            ``DistillRefineOptions`` table) and ``PruneOptions`` keys.
    """

    def __init__(self, strategy: RoundProtocol, tier_models: str, prune_options: dict[str, Any]) -> None:
        self.strategy = strategy
        self.tier_models = tier_models
        self.prune_options = prune_options
        self.derived: dict[float, dict[str, torch.Tensor]] = {}   # tier -> derived state (the step's product)
        self.guarded: dict[str, str] = {}   # tier -> why its derived model was replaced, this round
        self._tier_fallback: dict[str, torch.Tensor] | None = None   # the round's sub-model average when guarded
        self._pruned: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None   # (state, perms)

    def take_round(self) -> tuple[dict[str, torch.Tensor] | None, tuple | None]:
        """``(the sub-model average the whole round falls back to when a tier was guarded, or None; (the reordered
        global state, its unit permutations) when the tiers were pruned, or None)``, once per round."""
        out = (self._tier_fallback, self._pruned)
        self._tier_fallback = self._pruned = None
        return out

    def forget(self) -> None:
        """Every tier gets the global model's slice next round (a fallback kept the previous global model)."""
        self.derived.clear()

    def derive_tier_models(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """``tier_models="fuse"``: fuse the round's client models into every narrower tier's width. ``feddf``:
        every narrower tier's slice of the new global model is a student of the ensemble of all clients."""
        s = self.strategy
        self.derived.clear()   # a tier without a derivation this round gets the new global model's slice
        self.guarded = {}
        self._pruned = None
        if not updates or s.spec is None:
            return
        if self.tier_models.startswith("prune"):   # (with feddf: instead of its per-tier distillation)
            self._prune_tiers(server_round, updates)
        elif self.tier_models == "distill" or (s.entry.tiers.distill and s.round_method(server_round) == s.method):
            self._distill_tiers(server_round, updates)
        elif self.tier_models == "fuse" and not s.entry.tiers.submodel:
            self._fuse_tiers(server_round, updates)
        self.guard_tiers(server_round, updates)

    def guard_tiers(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """The divergence guard for every narrower tier's model (fusion methods; sub-model averaging needs none):
        a tier model (fused into the tier's width, or the slice of a fused global model, whose units the
        level fits mixed) whose KL to the round's clients' ensemble on the fusion set exceeds ``guard_ratio`` ×
        that of the tier's slice of HeteroFL's sub-model average + 0.05 (or is not finite) is replaced by that
        slice (WARNING, ``history[round]["tier-guard"]``): the global guard alone passes fused models whose narrow
        slices are at chance. Guarding a tier alone is not enough: the next round averages the narrow clients'
        entries into the global model's top-left block, which must hold the same units, so a guarded tier makes ``aggregate_train`` use the sub-model average for the global model and every tier
        (``self._tier_fallback``)."""
        s = self.strategy
        if (not s.guard or s.fusion_inputs is None or s.submodel_round(server_round)
                or len(updates) == 0):
            return
        tiers = sorted(set(s.tier_layout.node_tier.values()) - {1.0})
        if not tiers:
            return
        x = torch.as_tensor(s.fusion_inputs).float()
        teachers = [s.build_model(u.state) for u in updates]
        target = teacher_probs(teachers, x, s._norm_weights(updates))
        average = s.weighted_average(updates)   # HeteroFL's sub-model average (into the new global's entries)
        nxt = s.window(server_round + 1)
        for r in tiers:
            layout = s.layout(r, nxt)
            candidate = self.derived.get(r)
            if candidate is None:
                candidate = slice_state(s.global_state(), layout)
            safe = slice_state(average, layout)
            with torch.no_grad():
                logits = s.build_model(candidate)(x)
                kl_c = kl_to(target, logits) if bool(torch.isfinite(logits).all()) else float("inf")
                kl_s = kl_to(target, s.build_model(safe)(x))
            if not kl_c <= s.guard_step.limit(kl_s):   # the divergence guard's rule (DivergenceGuard.limit)
                reason = (f"tier {tier_name(r)}: its model's KL to the clients' ensemble on the fusion set is "
                          f"{kl_c:.4g}, above {s.guard_step.ratio:g} x the sub-model average's slice's {kl_s:.4g} + 0.05")
                log(WARNING, "aggregate_train: round %d: tier guard: %s; the tier gets that slice", server_round,
                    reason)
                self.guarded[tier_name(r)] = reason
                self.derived[r] = {k: v.detach().clone() for k, v in safe.items()}
        if self.guarded:
            self._tier_fallback = average

    def _fuse_tiers(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """``tier_models="fuse"``: the round's client models fused into every narrower tier's width."""
        s = self.strategy
        models = [s.build_model(u.state) for u in updates]
        scores = [u.scores for u in updates] if s.wants_client_scores and all(u.scores for u in updates) else None
        for r in sorted({s.tier_layout.node_tier[n] for n in s.tier_layout.node_tier} - {1.0}):
            try:
                res = fuse_result(s.method, models, fusion_inputs=s.fusion_inputs, scores=scores,
                                  weights=[u.num_examples for u in updates], device=s.device,
                                  seed=s.seed + server_round, target=s.skeleton(r),
                                  refine="+".join(s.refine_steps) or None,
                                  prior=s.class_prior(updates)[0] if "calibrate" in s.refine_steps else None,
                                  **s.fusion_options)
                check_finite(s.method, res.model)
                model = res.model
                if s.anchor:   # its units onto the new global model's slice (the next round averages them there)
                    slice_model = s.build_model(slice_state(s.global_state(),
                                                               s.layout(r, s.window(server_round + 1))))
                    model, _ = align_to_anchor(model, slice_model, seed=s.seed + server_round)
                self.derived[r] = model.state_dict()
            except ValueError as exc:   # FusionError: this tier keeps the slice of the global model
                self.derived.pop(r, None)
                log(WARNING, "aggregate_train: round %d: fusing tier %s failed (%s); it gets the global model's slice",
                    server_round, tier_name(r), exc)

    def aggregated_scores(self, updates: list[ClientUpdate]) -> dict[str, torch.Tensor] | None:
        """The round's client importance scores at the global width (level name -> ``[width]``), or ``None`` when
        not every client sent scores: each client's level scores divided by their mean, then the sample-weighted mean
        over the clients holding each unit (a tier of width ``c`` holds units ``0..c-1``: the top-left slice)."""
        s = self.strategy
        if not updates or not all(u.scores for u in updates):
            return None
        widths = {lv.name: lv.width for lv in levels(s.skeleton(1.0))}
        w = s._weights(updates)
        out = {}
        for name, width in widths.items():
            acc, cnt = torch.zeros(width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
            for u, wi in zip(updates, w):
                sc = u.scores.get(name)
                if sc is None:
                    continue
                sc = torch.as_tensor(sc).double().flatten()[:width]
                sc = sc / sc.mean().clamp_min(1e-12)
                acc[:len(sc)] += wi * sc
                cnt[:len(sc)] += wi
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
        s = self.strategy
        tiers = sorted(set(s.tier_layout.node_tier.values()) - {1.0})
        if not tiers:
            return
        opts = dict(self.prune_options)
        recover = opts.pop("recover", False)
        criterion = opts.pop("criterion", "auto")
        if s.tier_layout.input_shape is not None and "input_shape" not in opts:
            opts["input_shape"] = s.tier_layout.input_shape
        glob = s.build_model(s.global_state())
        x = torch.as_tensor(s.fusion_inputs).float() if s.fusion_inputs is not None else None
        scores = self.aggregated_scores(updates)
        state, perms, info = prune_order(glob, {tier_name(r): s.skeleton(r) for r in tiers}, scores=scores,
                                         fusion_inputs=x, criterion=criterion, seed=s.seed + server_round, **opts)
        teachers = [s.build_model(u.state) for u in updates] if recover else None
        dev = resolve_device(s.device)
        for r in tiers:
            sliced = slice_state(state, s.layout(r, 0))
            if not recover:   # the pruned tier model is its slice
                self.derived[r] = {k: v.detach().cpu() for k, v in sliced.items()}
                continue
            student = s.build_model(sliced)
            ropts = DistillRefineOptions(**recover) if isinstance(recover, dict) else DistillRefineOptions()
            info[tier_name(r)]["recover"] = distill_ensemble(student, teachers, s._norm_weights(updates), x,
                                                             ropts, seed=s.seed + server_round, device=dev)
            student = student.cpu()
            check_finite(f"prune (tier {tier_name(r)})", student)
            self.derived[r] = {k: v.detach().cpu() for k, v in student.state_dict().items()}
        if s.history and s.history[-1].get("round") == server_round:
            s.history[-1]["tier-prune"] = {k: {kk: vv for kk, vv in v.items() if kk != "recover"}
                                              for k, v in info.items()}
        self._pruned = (state, perms)

    def _distill_tiers(self, server_round: int, updates: list[ClientUpdate]) -> None:
        """``tier_models="distill"`` and FedDF with architecture groups: each narrower tier's model (the slice of the new global model) learns
        the weighted softmax of all the round's clients on the fusion set (early stopping on a held-out part)."""
        s = self.strategy
        teachers = [s.build_model(u.state) for u in updates]
        # feddf's own distillation options; other methods: the refine step's defaults (Adam 1e-3, early stopping)
        options = s.method_options if s.entry.tiers.distill else DistillRefineOptions()
        dev = resolve_device(s.device)
        for r in sorted(set(s.tier_layout.node_tier.values()) - {1.0}):
            student = s.build_model(slice_state(s.global_state(), s.layout(r, s.window(server_round + 1))))
            distill_ensemble(student, teachers, s._norm_weights(updates), s.fusion_inputs, options,
                             seed=s.seed + server_round, device=dev)
            check_finite(f"feddf (tier {tier_name(r)})", student.cpu())
            self.derived[r] = {k: v.detach().cpu() for k, v in student.state_dict().items()}


__all__ = ["TierLayout", "QUERY_TIMEOUT", "ROUND_TIER_KEYS", "client_tier_means", "round_tier_records"]
