"""fedfuse on Flower: strategies, the reply contract, the ServerApp and the ClientApp.

This is the only part of fedfuse that imports Flower (``flwr``); the core (models, fusion, data,
training, importance, config) does not.

    from fedfuse.flower import build_strategy, STRATEGIES, KfLinearStrategy, FusionStrategy
    from fedfuse.flower.server_app import app as server_app, make_server_app   # pyproject components
    from fedfuse.flower.client_app import app as client_app, make_client_app

Modules: ``strategy`` (``FusionStrategy``: FedAvg with fusion as the aggregation), ``strategies`` (one
named class per fusion method + ``STRATEGIES`` / ``build_strategy``), ``replies`` (the reply contract a
ClientApp must follow, and its validation), ``client`` (``make_train_reply`` / ``reply_to_train``: a valid
reply from your own ClientApp), ``server_app`` / ``client_app`` (fedfuse's own apps).
"""

from fedfuse.flower.baselines import (FLOWER_BASELINES, FedAdamStrategy, FedAvgMStrategy, FedProxStrategy,
                                      FedYogiStrategy, FlowerBaselineStrategy)
from fedfuse.flower.replies import ClientUpdate, NonFiniteWeights, ReplyRejected, validate_reply
from fedfuse.flower.client import TrainRequest, make_train_reply, read_train_message, reply_to_train
from fedfuse.flower.strategies import (STRATEGIES, AverageStrategy, FedAvgStrategy, FedDfStrategy, FlowerFedAvg,
                                       FsMergeSeqStrategy, FsMergeStrategy, HfGradientStrategy, HfLinearStrategy,
                                       KdStrategy, KfGradientStrategy, KfLinearStrategy, LpStrategy, OtStrategy,
                                       RebasinStrategy, TransfusionStrategy, build_strategy)
from fedfuse.flower.strategy import FALLBACKS, ClientsDivergedError, FusionStrategy, state_to_record

__all__ = ["STRATEGIES", "build_strategy", "FusionStrategy", "FALLBACKS", "FedAvgStrategy", "FlowerFedAvg",
           "AverageStrategy", "KdStrategy", "LpStrategy", "HfLinearStrategy", "KfLinearStrategy",
           "HfGradientStrategy", "KfGradientStrategy", "OtStrategy", "RebasinStrategy", "TransfusionStrategy",
           "FsMergeStrategy", "FsMergeSeqStrategy", "FedDfStrategy", "FLOWER_BASELINES", "FlowerBaselineStrategy",
           "FedAvgMStrategy", "FedAdamStrategy", "FedYogiStrategy", "FedProxStrategy", "ClientsDivergedError",
           "ClientUpdate", "ReplyRejected", "NonFiniteWeights", "validate_reply", "state_to_record",
           "TrainRequest", "read_train_message", "make_train_reply", "reply_to_train"]
