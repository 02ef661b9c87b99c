"""Allowed values of the run-config keys, in one place.

``fedfuse.config`` (the run-config schema) and ``fedfuse.data`` (sources, partitioning, fusion set) both
import these lists; they live in this leaf module so that ``config`` can call into ``data`` for its file
checks without an import cycle.
"""

MODES = ("multi-round", "one-shot")
DATASETS = ("digits", "digits-flat", "mnist1d", "mnist1d-flat", "synthetic", "cifar10", "cifar100", "mnist",
            "fashion-mnist")
HF_PREFIX = "hf:"  # dataset "hf:<hub name or save_to_disk folder>"
MODELS = ("mlp", "cnn", "resnet", "vit")
# model name -> fusion family of fedfuse.fusion.MethodSpec (sequential levels are affine: Linear/Conv)
MODEL_FAMILIES = {"mlp": "sequential", "cnn": "sequential", "resnet": "resnet", "vit": "vit"}
PARTITIONINGS = ("iid", "dirichlet", "shards", "full")
OPTIMIZERS = ("adam", "adamw", "sgd")
IMPORTANCE = ("uniform", "conductance", "deeplift")
FUSION_SET_SOURCES = ("public", "client0")
FALLBACKS = ("previous", "average", "raise")
# post-aggregation refinement of fusion strategies (fedfuse.fusion.refine); "auto" = the strategy's default
REFINES = ("auto", "none", "calibrate", "distill", "calibrate+distill", "distill+calibrate")
# how the global model is evaluated: by the server on its test set, by the clients on their validation splits, or both
EVALUATIONS = ("central", "federated", "both")
# class prior of the "calibrate" refinement
PRIORS = ("auto", "class-counts", "uniform")
# strategies that are not a fedfuse.fusion method (every method that keeps the architecture is one too)
# Flower's own server strategies, run on validated replies (fedfuse.flower.baselines)
FLOWER_BASELINE_STRATEGIES = ("fedavgm", "fedadam", "fedyogi", "fedprox")
NON_FUSION_STRATEGIES = ("fedavg",) + FLOWER_BASELINE_STRATEGIES
# sub-model averaging baselines of capacity tiers (fedfuse.flower.tiers): array aggregation, no server step
TIER_STRATEGIES = ("heterofl", "fedrolex")
# strategies run with their paper's server step (no fedfuse server momentum): FedDF and the tier baselines
PAPER_SERVER_STEP = ("feddf",) + TIER_STRATEGIES
# run-config keys read by some strategies only -> those strategies (set for another one: a ConfigError)
# (FUSION_STRATEGIES stands for every fusion strategy: not in NON_FUSION_STRATEGIES nor PAPER_SERVER_STEP)
FUSION_STRATEGIES = "<fusion strategies>"
STRATEGY_KEYS = {"server-lr": ("fedavgm", "fedadam", "fedyogi", FUSION_STRATEGIES),
                 "server-momentum": ("fedavgm", FUSION_STRATEGIES), "proximal-mu": ("fedprox",)}


def key_applies(key: str, strategy: str) -> bool:
    """Whether the strategy-specific run-config ``key`` (``STRATEGY_KEYS``) is read by ``strategy``."""
    users = STRATEGY_KEYS[key]
    return strategy in users or (FUSION_STRATEGIES in users and strategy not in NON_FUSION_STRATEGIES
                                 and strategy not in PAPER_SERVER_STEP)
