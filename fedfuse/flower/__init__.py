"""fedfuse on Flower: strategies, the reply contract, the ServerApp and the ClientApp.

This is the only part of fedfuse that imports Flower (``flwr``); the core (models, fusion, data,
training, importance, config) does not.

    from fedfuse.flower import build_strategy, STRATEGIES, KfLinearStrategy, FusionStrategy
    from fedfuse.flower.server_app import app as server_app, make_server_app   # pyproject components
    from fedfuse.flower.client_app import app as client_app, make_client_app

Modules:

- ``protocol``: ``RoundProtocol``, Flower's ``FedAvg`` with fedfuse's round (sampling, reply triage and
  validation, fallback, history) for every strategy;
- ``fusion_strategy``: ``FusionStrategy``, the protocol aggregating with a ``fedfuse.fusion`` method, then the
  round steps of ``steps`` (divergence guard, server momentum, refinement; ``streaming`` for average rounds);
- ``strategies``: ``STRATEGIES`` / ``build_strategy`` from the registry (``fedfuse.strategy_specs``) and the
  named classes; ``baselines``: Flower's own strategies; ``tiered`` (+ ``tier_layout``, ``tier_derivation``):
  capacity tiers, HeteroFL and FedRolex;
- ``selection`` (+ ``candidates``): ``SelectionStrategy``, strategy ``auto``: below ``auto-fusion-epochs`` local
  epochs one array candidate a round with no query (the plain average, or the momentum step for plain-SGD clients:
  ``auto-momentum``); from there the candidate aggregation the round's clients score best on their
  own data (a ``query.score_candidates`` message);
- ``screen``: ``ClientScreen``, the robust setting's check of a round's replies (free riders, updates pointing
  away from the round's median, update norms bounded; docs/trust.md); ``answer_screen``: the clients' answers to
  the server's queries (head statistics, candidate scores) checked, their claimed counts capped, and with the robust
  setting screened (class means) and pooled one node, one vote;
- ``replies``: the reply contract a ClientApp must follow, and its validation; ``client_replies``:
  ``make_train_reply`` / ``reply_to_train`` for your own ClientApp; ``client_tiers``: the ClientApp's side of
  tiers;
- ``server_app`` / ``client_app``: fedfuse's own apps.
"""

from fedfuse.flower.baselines import (FLOWER_BASELINES, BulyanStrategy, FedAdamStrategy, FedAvgMStrategy,
                                      FedMedianStrategy, FedProxStrategy, FedTrimmedAvgStrategy, FedYogiStrategy,
                                      FlowerBaselineStrategy, KrumStrategy, MultiKrumStrategy)
from fedfuse.flower.replies import ClientUpdate, NonFiniteWeights, ReplyRejected, validate_reply
from fedfuse.flower.client_replies import TrainRequest, make_train_reply, read_train_message, reply_to_train
from fedfuse.flower.strategies import (STRATEGIES, AverageStrategy, FedAvgStrategy, FedDfStrategy,
                                       FsMergeSeqStrategy, FsMergeStrategy, HfGradientStrategy, HfLinearStrategy,
                                       KdStrategy, KfGradientStrategy, KfLinearStrategy, LpStrategy, OtStrategy,
                                       RebasinStrategy, TransfusionStrategy, build_strategy)
from fedfuse.choices import FALLBACKS
from fedfuse.flower.fusion_strategy import FusionStrategy
from fedfuse.flower.options import (FusionOptions, GuardOptions, MomentumOptions, ProtocolOptions, RefineOptions,
                                    TierOptions)
from fedfuse.flower.protocol import ClientsDivergedError, ReplyContractError, RoundProtocol, state_to_record
from fedfuse.flower.screen import ClientScreen
from fedfuse.flower.selection import SelectionStrategy
from fedfuse.flower.tiered import FedRolexStrategy, HeteroFLStrategy, TieredFusionStrategy

__all__ = ["STRATEGIES", "build_strategy", "FusionStrategy", "SelectionStrategy", "RoundProtocol", "TieredFusionStrategy",
           "HeteroFLStrategy", "FedRolexStrategy", "FALLBACKS", "FedAvgStrategy",
           "AverageStrategy", "KdStrategy", "LpStrategy", "HfLinearStrategy", "KfLinearStrategy",
           "HfGradientStrategy", "KfGradientStrategy", "OtStrategy", "RebasinStrategy", "TransfusionStrategy",
           "FsMergeStrategy", "FsMergeSeqStrategy", "FedDfStrategy", "FLOWER_BASELINES", "FlowerBaselineStrategy",
           "FedAvgMStrategy", "FedAdamStrategy", "FedYogiStrategy", "FedProxStrategy", "FedMedianStrategy",
           "FedTrimmedAvgStrategy", "KrumStrategy", "MultiKrumStrategy", "BulyanStrategy", "ClientsDivergedError", "ReplyContractError",
           "ClientScreen", "ClientUpdate", "ReplyRejected", "NonFiniteWeights", "validate_reply", "state_to_record",
           "TrainRequest", "read_train_message", "make_train_reply", "reply_to_train", "FusionOptions", "GuardOptions",
           "MomentumOptions", "RefineOptions", "ProtocolOptions", "TierOptions"]
