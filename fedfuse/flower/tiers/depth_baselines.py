"""The depth-tier baselines: DepthFL, its ablation without self-distillation, and InclusiveFL, each a
``DepthTieredStrategy`` (``fedfuse.flower.tiers.depth_tiers``) that adds its own step; ``build_depth_strategy`` picks the
class for a strategy name (fedfuse's own aggregations across depths are ``DepthTieredStrategy`` itself).
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any, Iterable

import torch
from flwr.app import Message
from flwr.common.logger import log

from fedfuse.hetero.depth import aggregate_held, layer_momentum, momentum_distill, unit_arrays
from fedfuse.flower.tiers.depth_tiers import DepthTieredStrategy
from fedfuse.flower.round.replies import ClientUpdate


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
    that hold it, and its one step is momentum distillation (``fedfuse.hetero.depth``):

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
    own_exit = True

    def __init__(self, method: str | None = None, *, mom_beta: float = 0.2, **options: Any) -> None:
        if isinstance(mom_beta, bool) or not isinstance(mom_beta, (int, float)) or not 0 <= mom_beta <= 1:
            raise ValueError(f"strategy 'inclusivefl': strategy-options.mom-beta must be a number in [0, 1], got {mom_beta!r}")
        super().__init__(method, self_distill=False, **options)
        self.mom_beta = float(mom_beta)
        skeleton = self._skeleton
        tiers = sorted(set(self._units.values()))
        if len(tiers) < 2:
            raise ValueError(f"strategy 'inclusivefl': momentum distillation needs a depth tier shallower than the "
                             f"deepest; depths {list(self.tier_layout.depths)} give one")
        self._deeper = dict(zip(tiers, tiers[1:]))   # tier (units) -> the next deeper tier
        self._layers: dict[int, list[dict[str, str]]] = {}
        for k, deeper in self._deeper.items():
            arrays = [unit_arrays(skeleton, j) for j in range(k, deeper + 1)]
            self._layers[k] = [named for named, _ in arrays]
            if arrays[0][1]:
                log(INFO, "inclusivefl: %s of tier %d's top layer lie outside its block: no momentum distillation",
                    arrays[0][1], k)
        self._momentum: dict[int, dict[str, torch.Tensor]] = {}
        self._logged: set[str] = set()

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> inclusivefl: momentum distillation beta=%g into the top layer of tiers (units) %s, "
            "each from the next deeper tier", self.mom_beta, sorted(self._deeper))

    def average(self, updates: list[ClientUpdate]) -> dict[str, torch.Tensor]:
        """The layer-wise average, each client's top layer first mixed with its tier's momentum."""
        g = self.global_state()
        states = [momentum_distill(g, u.state, self._momentum[k], self.mom_beta)
                  if (k := self.node_units(u.node_id)) in self._momentum else u.state for u in updates]
        return aggregate_held(g, states, [float(u.num_examples) for u in updates])

    weighted_average = average

    def update_momentum(self, global_state: dict[str, torch.Tensor], updates: list[ClientUpdate]) -> list[int]:
        """Each tier whose next deeper tier is among ``updates`` (trained from ``global_state``) gets that tier's
        ``layer_momentum``; the others keep theirs. Returns the tiers (units) that got one."""
        by_tier: dict[int, list[ClientUpdate]] = {}
        for u in updates:
            by_tier.setdefault(self.node_units(u.node_id), []).append(u)
        fresh = []
        for k, deeper in self._deeper.items():
            ups = by_tier.get(deeper)
            if not ups:
                continue
            keys = {key for layer in self._layers[k] for key in layer.values()}
            sent = {key: global_state[key] for key in keys}
            avg = aggregate_held(sent, [{key: u.state[key] for key in keys} for u in ups],
                                 [float(u.num_examples) for u in ups])
            self._momentum[k], skipped = layer_momentum({key: avg[key] - sent[key] for key in keys},
                                                        self._layers[k])
            for line in sorted(set(skipped) - self._logged):
                log(INFO, "inclusivefl: tier %d's momentum leaves out %s", k, line)
            self._logged.update(skipped)
            fresh.append(k)
        return fresh

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        if self.round_offset and not self._momentum and server_round == 1:
            log(WARNING, "strategy inclusivefl: resumed after round %d; the momentum of the deeper tiers restarts "
                "empty (no momentum distillation until a deeper tier replies)", self.round_offset)
        sent = self.global_state()   # the model this round's clients trained from
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            fresh = self.update_momentum(sent, self.last_updates)
            log(INFO, "aggregate_train: round %d: inclusivefl momentum (beta %g) from the next deeper tier for "
                "tiers %s (units)", server_round + self.round_offset, self.mom_beta, fresh)
        return arrays, metrics


DEPTH_STRATEGY_CLASSES: dict[str, type[DepthTieredStrategy]] = {"depthfl": DepthFLStrategy,
                                                                "depthfl-fedavg": DepthFLFedAvgStrategy,
                                                                "inclusivefl": InclusiveFLStrategy}


def build_depth_strategy(name: str, *, depths: tuple[float, ...], **options: Any) -> DepthTieredStrategy:
    """The depth-tier strategy for ``name`` (one of ``DEPTH_METHODS``)."""
    cls = DEPTH_STRATEGY_CLASSES.get(name, DepthTieredStrategy)
    return cls(None if name in DEPTH_STRATEGY_CLASSES else name, depths=depths, **options)


__all__ = ["DepthFLStrategy", "DepthFLFedAvgStrategy", "InclusiveFLStrategy", "DEPTH_STRATEGY_CLASSES",
           "build_depth_strategy"]
