"""The layout of a federation with capacity tiers: which node holds which width, each tier's architecture, and
where a tier's entries sit inside the global (widest) model.

A tier is a width multiplier ``r`` in (0, 1] of the global model (HeteroFL, arXiv 2010.01264). Tier ``r``'s
model is a nested sub-model of the global one: the top-left slice of every level (``fedfuse.hetero.submodel``),
or, for FedRolex (arXiv 2212.01548), a window that rolls by one unit per round. A node's tier is learnt once by a
``query`` message its ClientApp answers (``fedfuse.flower.tiers.client_tiers``).
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


__all__ = ["TierLayout", "QUERY_TIMEOUT", "ROUND_TIER_KEYS", "client_tier_means", "round_tier_records"]
