"""fedfuse on Flower: strategies, the reply contract, the ServerApp and the ClientApp.

This is the only part of fedfuse that imports Flower (``flwr``); the core (models, fusion, data,
training, importance, config) does not.

    from fedfuse.flower import build_strategy, STRATEGIES, KfLinearStrategy, FusionStrategy
    from fedfuse.flower.server_app import app as server_app, make_server_app   # pyproject components
    from fedfuse.flower.client_app import app as client_app, make_client_app

Layout, one package per concern (each package's docstring says what it holds):

- ``strategies``: ``STRATEGIES`` / ``build_strategy`` from the registry (``fedfuse.strategy_specs``) and the named
  classes; ``server_app`` / ``client_app``: fedfuse's own apps (the pyproject's components);
- ``round``: what every strategy does with a round's messages: the reply contract, both sides (``replies``: validation,
  and the helpers your own ClientApp replies with), ``RoundProtocol`` (triage, validation, the streamed average, the fallback and the round's
  record, in one file), the typed options, the steps after an aggregation (divergence guard, server momentum,
  refinement), divergence checked on every reply and on the model broadcast;
- ``aggregators``: what a round aggregates with: ``FusionAggregator`` (a ``fedfuse.fusion`` method and its steps,
  held by a protocol; ``FusionStrategy`` is the protocol holding one), Flower's own
  strategies, strategy ``auto``'s vote between candidates (``selection``, ``candidates``), a warm start's round 1;
- ``tiers``: clients of different capacities (width tiers: fusion into the global width, HeteroFL, FedRolex; depth
  tiers: DepthFL, InclusiveFL) and the ClientApp's side of them;
- ``head``: the head round (the classifier solved in closed form from the clients' statistics);
- ``trust``: the robust reply screen, the screen of the clients' answers, differential privacy, secure sums;
- ``runner``: ``fedfuse run`` / ``compare`` / ``sweep``: the runners around ``flwr run`` and the in-process engine.
"""

from fedfuse.flower.aggregators.baselines import (FLOWER_BASELINES, BulyanStrategy, FedAdamStrategy, FedAvgMStrategy,
                                      FedMedianStrategy, FedProxStrategy, FedTrimmedAvgStrategy, FedYogiStrategy,
                                      FlowerBaselineStrategy, KrumStrategy, MultiKrumStrategy)
from fedfuse.flower.round.replies import ClientUpdate, NonFiniteWeights, ReplyRejected, validate_reply
from fedfuse.flower.round.replies import TrainRequest, make_train_reply, read_train_message, reply_to_train
from fedfuse.flower.strategies import (STRATEGIES, AverageStrategy, Preset, FedAvgStrategy, FedDfStrategy,
                                       FsMergeSeqStrategy, FsMergeStrategy, HfGradientStrategy, HfLinearStrategy,
                                       KdStrategy, KfGradientStrategy, KfLinearStrategy, LpStrategy, OtStrategy,
                                       RebasinStrategy, TransfusionStrategy, build_strategy)
from fedfuse.choices import FALLBACKS
from fedfuse.flower.aggregators.fusion_strategy import FusionStrategy
from fedfuse.flower.round.options import (FusionOptions, GuardOptions, MomentumOptions, ProtocolOptions, RefineOptions,
                                    TierOptions)
from fedfuse.flower.round.protocol import ClientsDivergedError, ReplyContractError, RoundProtocol, state_to_record
from fedfuse.flower.trust.screen import ClientScreen
from fedfuse.flower.aggregators.selection import SelectionStrategy
from fedfuse.flower.tiers.tiered import FedRolexStrategy, HeteroFLStrategy, TieredFusionStrategy

__all__ = ["STRATEGIES", "Preset", "build_strategy", "FusionStrategy", "SelectionStrategy", "RoundProtocol", "TieredFusionStrategy",
           "HeteroFLStrategy", "FedRolexStrategy", "FALLBACKS", "FedAvgStrategy",
           "AverageStrategy", "KdStrategy", "LpStrategy", "HfLinearStrategy", "KfLinearStrategy",
           "HfGradientStrategy", "KfGradientStrategy", "OtStrategy", "RebasinStrategy", "TransfusionStrategy",
           "FsMergeStrategy", "FsMergeSeqStrategy", "FedDfStrategy", "FLOWER_BASELINES", "FlowerBaselineStrategy",
           "FedAvgMStrategy", "FedAdamStrategy", "FedYogiStrategy", "FedProxStrategy", "FedMedianStrategy",
           "FedTrimmedAvgStrategy", "KrumStrategy", "MultiKrumStrategy", "BulyanStrategy", "ClientsDivergedError", "ReplyContractError",
           "ClientScreen", "ClientUpdate", "ReplyRejected", "NonFiniteWeights", "validate_reply", "state_to_record",
           "TrainRequest", "read_train_message", "make_train_reply", "reply_to_train", "FusionOptions", "GuardOptions",
           "MomentumOptions", "RefineOptions", "ProtocolOptions", "TierOptions"]
