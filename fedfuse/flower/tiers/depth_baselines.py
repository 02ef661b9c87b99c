"""The depth-tier baselines: DepthFL, its ablation without self-distillation, and InclusiveFL, each
``DepthTieredStrategy`` (``fedfuse.flower.tiers.depth_tiers``) with its registry entry (``DepthTiers``: self-distillation,
the node's own exit, InclusiveFL's momentum distillation step, ``MomentumDistillation``); the named classes fix
``method``. ``build_depth_strategy`` picks the class for a strategy name (fedfuse's own aggregations across depths are
``DepthTieredStrategy`` itself).
"""

from __future__ import annotations

from typing import Any

from fedfuse.flower.tiers.depth_tiers import DepthTieredStrategy


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


__all__ = ["DepthFLStrategy", "DepthFLFedAvgStrategy", "InclusiveFLStrategy", "DEPTH_STRATEGY_CLASSES",
           "build_depth_strategy"]
