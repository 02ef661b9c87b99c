"""Allowed values of the run-config keys, in one place.

``fedfuse.config`` (the run-config schema) and ``fedfuse.data`` (sources, partitioning, fusion set) both
import these lists; they live in this leaf module so that ``config`` can call into ``data`` for its file
checks without an import cycle.
"""

MODES = ("multi-round", "one-shot", "warm-start")
# warm-start-fusion value that keeps the best client model instead of fusing (mode="warm-start")
BEST_CLIENT = "best-client"
DATASETS = ("digits", "digits-flat", "digits-std", "mnist1d", "mnist1d-flat", "synthetic", "cifar10", "cifar100",
            "mnist", "fashion-mnist")
HF_PREFIX = "hf:"  # dataset "hf:<hub name or save_to_disk folder>"
MODELS = ("mlp", "cnn", "lenet", "resnet", "vit")
# model "torchvision:<classification builder>" | "timm:<model name>": a zoo model fitted to the dataset's inputs
# (fedfuse.models.zoo); its own size, so model-width / model-depth stay 0 and it has no capacity tiers
TORCHVISION_PREFIX, TIMM_PREFIX = "torchvision:", "timm:"
ZOO_PREFIXES = (TORCHVISION_PREFIX, TIMM_PREFIX)
# model name -> fusion family of fedfuse.fusion.MethodSpec (sequential levels are affine: Linear/Conv)
MODEL_FAMILIES = {"mlp": "sequential", "cnn": "sequential", "lenet": "sequential", "resnet": "resnet", "vit": "vit"}
# each model's own (width, depth): what model-width / model-depth = 0 (their defaults) build. LeNet-5 as NIID-Bench
# trains it has 6 channels in its first convolution and 2 convolution stages
MODEL_SIZES = {"mlp": (64, 2), "cnn": (64, 2), "lenet": (6, 2), "resnet": (64, 2), "vit": (64, 2)}
PARTITIONINGS = ("iid", "dirichlet", "shards", "full")
OPTIMIZERS = ("adam", "adamw", "sgd")
# the head round's closed-form classifier (fedfuse.progressive.HEAD_SOLVERS); "best": both, the clients choose
HEAD_SOLVERS = ("ridge", "lda")   # the closed-form heads (fedfuse.progressive.solve_classifier)
HEAD_SOLVER_CHOICES = ("best", *HEAD_SOLVERS)
IMPORTANCE = ("uniform", "conductance", "deeplift")
FUSION_SET_SOURCES = ("public", "client0")
FALLBACKS = ("previous", "average", "raise")
# post-aggregation refinement of fusion strategies (fedfuse.fusion.refine); "auto" = the strategy's default
REFINES = ("auto", "none", "calibrate", "distill", "calibrate+distill", "distill+calibrate")
# how the global model is evaluated: by the server on its test set, by the clients on their validation splits, or both
EVALUATIONS = ("central", "federated", "both")
# differential privacy (fedfuse.flower.trust.privacy): where updates are clipped (Flower's server- / client-side fixed
# clipping wrappers); the strategies DP accepts are the registry's (fedfuse.strategy_specs.DP_STRATEGIES)
DP_CLIPPINGS = ("server", "client")
# one-shot mode: the reference rows the server computes from the round's client models (fedfuse.references): all
# (clients, ensemble, average, KD and FedDF), models (no distillation), none
ONE_SHOT_REFERENCES = ("all", "models", "none")
# class prior of the "calibrate" refinement
PRIORS = ("auto", "class-counts", "uniform")


def no_fusion_options(strategy: str, options) -> str:
    """The one sentence for fusion options given to a strategy that is not a fusion method (run config, strategies)."""
    return f"strategy {strategy!r} is not a fusion method and takes no fusion_options, got {sorted(options)}"
