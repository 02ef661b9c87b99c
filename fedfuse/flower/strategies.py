"""Named fedfuse strategies: ``"fedavg"`` plus one ``FusionStrategy`` subclass per fusion method.

    from fedfuse.flower import build_strategy, STRATEGIES, KfLinearStrategy
    strategy = KfLinearStrategy(model_fn=lambda: build_model("mlp"), fusion_inputs=X, min_train_nodes=4)
    strategy = build_strategy("kf-linear", model_fn=..., fusion_inputs=X)      # the same, by name

Each class only fixes ``method``; every option is ``FusionStrategy``'s (its own plus Flower ``FedAvg``'s).
Methods whose result is not the global architecture (``ensemble``) have no strategy: they are
references, not aggregations.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedfuse.flower.replies import ClientUpdate
from fedfuse.flower.strategy import FusionStrategy
from fedfuse.fusion import MethodSpec


class FedAvgStrategy(FusionStrategy):
    """Federated averaging (McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", arXiv 1602.05629) over validated replies: the sample-weighted mean of every
    floating-point array; integer buffers (BatchNorm counters) are taken from the first reply.

    Works on the arrays alone (``model_fn`` optional: without it replies are checked against the
    global ArrayRecord sent in ``configure_train``); importance records are ignored; takes no
    ``fusion_options``.
    """

    method = "fedavg"
    default_refine = "none"
    can_refine = False
    default_server_momentum = 0.0  # FedAvg: no server optimizer (fedavgm is Flower's FedAvgM)
    streams = True  # the same running weighted sum as 'average' (aggregate_streaming)

    def __init__(self, method: str | None = None, **options: Any) -> None:
        if options.get("server_momentum") or options.get("server_learning_rate", 1.0) != 1.0:
            raise ValueError("strategy 'fedavg' is plain FedAvg: server_momentum / server_learning_rate do not apply; "
                             "use 'fedavgm' (Flower's FedAvgM) or a fusion strategy such as 'average'")
        super().__init__(method, **options)

    def _method_spec(self, method: str) -> MethodSpec | None:
        return None  # not a fedfuse.fusion method: plain averaging of the arrays

    def _check_options(self, options: dict[str, Any]) -> None:
        if options:
            raise ValueError(f"strategy 'fedavg' takes no fusion_options, got {sorted(options)}")

    def _needs_modules(self) -> bool:
        return False

    def aggregate_state(self, server_round: int, updates: list[ClientUpdate]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any], float]:
        w = np.array([u.num_examples for u in updates], dtype=float)
        w = w / w.sum()
        ref = updates[0].state
        state = {k: (sum(float(wi) * u.state[k].double() for wi, u in zip(w, updates)).to(ref[k].dtype)
                     if ref[k].is_floating_point() else ref[k].clone()) for k in ref}
        return state, {}, 0.0


FlowerFedAvg = FedAvgStrategy  # name used before issue 11


class AverageStrategy(FusionStrategy):
    """Weighted averaging of the client models (``fedfuse.fusion`` method ``average``), by default with FedAvgM's
    server step (momentum 0.5) and the calibration refinement: fedfuse's default multi-round aggregation."""

    method = "average"
    default_server_momentum = 0.5  # measured: MNIST-1D Dirichlet α=0.1 0.597 ± 0.015 vs 0.532 ± 0.049 without
    streams = True  # a running weighted sum over the replies: server memory bounded in the number of clients


class KdStrategy(FusionStrategy):
    """Multi-teacher knowledge distillation into the global architecture on the server fusion set
    (Hinton et al., "Distilling the Knowledge in a Neural Network", arXiv 1503.02531; method ``kd``)."""

    method = "kd"


class LpStrategy(FusionStrategy):
    """Linear probing: model 0's classifier level refit on the fusion set against the ensemble's averaged
    softmax (method ``lp``)."""

    method = "lp"


class HfLinearStrategy(FusionStrategy):
    """Neuron interpolation, HF grouping with closed-form linear level fits ("Model Fusion via Neuron
    Interpolation", arXiv 2507.00037; method ``hf-linear``)."""

    method = "hf-linear"


class KfLinearStrategy(FusionStrategy):
    """Neuron interpolation, KF (k-means) grouping with closed-form linear level fits ("Model Fusion via
    Neuron Interpolation", arXiv 2507.00037; method ``kf-linear``)."""

    method = "kf-linear"


class HfGradientStrategy(FusionStrategy):
    """Neuron interpolation, HF grouping with gradient-based level fits (blocks allowed; ``hf-gradient``)."""

    method = "hf-gradient"


class KfGradientStrategy(FusionStrategy):
    """Neuron interpolation, KF (k-means) grouping with gradient-based level fits (blocks allowed; ``kf-gradient``)."""

    method = "kf-gradient"


class OtStrategy(FusionStrategy):
    """Optimal-transport fusion (Singh & Jaggi, "Model Fusion via Optimal Transport", arXiv 1910.05653;
    method ``ot``): layer-wise OT alignment to the first model, then averaging."""

    method = "ot"


class RebasinStrategy(FusionStrategy):
    """Git Re-Basin permutation alignment then averaging (Ainsworth et al., "Git Re-Basin: Merging Models
    modulo Permutation Symmetries", arXiv 2209.04836; method ``rebasin``)."""

    method = "rebasin"


class TransfusionStrategy(FusionStrategy):
    """Data-free TransFusion alignment of every model to model 0 (head-aware weight matching), then
    weighted averaging (method ``transfusion``)."""

    method = "transfusion"


class FsMergeStrategy(FusionStrategy):
    """FS-Merge (Kinderman et al., "Foldable SuperNets: Scalable Merging of Transformers with Different
    Initializations and Tasks", arXiv 2410.01483; method ``fs-merge``): a SuperNet trained by feature
    reconstruction on the fusion set, folded back to one model."""

    method = "fs-merge"


class FedDfStrategy(FusionStrategy):
    """FedDF (Lin et al., "Ensemble Distillation for Robust Model Fusion in Federated Learning", arXiv
    2006.07242; method ``feddf``): weighted average, then the round's client ensemble distilled into it on
    the server fusion set (Adam 1e-3, early stopping on a held-out part). The baseline for "a server with
    unlabeled data"; its own refinement is the distillation, so ``refine`` defaults to none."""

    method = "feddf"
    default_refine = "none"
    default_server_momentum = 0.0  # the paper's server step: the distilled average is the new global model


class FsMergeSeqStrategy(FusionStrategy):
    """Sequential FS-Merge: merge models 0 and 1, then the result with model 2, ... (method ``fs-merge-seq``)."""

    method = "fs-merge-seq"


STRATEGIES: dict[str, type[FusionStrategy]] = {cls.method: cls for cls in (
    FedAvgStrategy, AverageStrategy, KdStrategy, LpStrategy, HfLinearStrategy, KfLinearStrategy,
    HfGradientStrategy, KfGradientStrategy, OtStrategy, RebasinStrategy, TransfusionStrategy, FsMergeStrategy,
    FsMergeSeqStrategy, FedDfStrategy)}


from fedfuse.flower.baselines import FLOWER_BASELINES  # noqa: E402  (Flower's FedAvgM/FedAdam/FedYogi/FedProx)

STRATEGIES.update(FLOWER_BASELINES)

from fedfuse.flower.tiers import TIER_STRATEGY_CLASSES  # noqa: E402  (HeteroFL / FedRolex: capacity tiers)

STRATEGIES.update(TIER_STRATEGY_CLASSES)


def build_strategy(name: str, **options: Any) -> FusionStrategy:
    """Build the strategy registered as ``name`` (a ``flwr.serverapp.strategy.Strategy``).

    ``options`` are ``FusionStrategy``'s keyword options (``model_fn``, ``fusion_inputs``,
    ``fusion_options``, ``fallback``, …, and FedAvg's ``fraction_train``, ``min_train_nodes``, …).
    """
    if name not in STRATEGIES:
        import difflib

        close = difflib.get_close_matches(name, list(STRATEGIES), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"strategy: unknown strategy {name!r}{hint}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](**options)


__all__ = ["STRATEGIES", "build_strategy", "FedAvgStrategy", "FlowerFedAvg", "AverageStrategy", "KdStrategy",
           "LpStrategy", "HfLinearStrategy", "KfLinearStrategy", "HfGradientStrategy", "KfGradientStrategy",
           "OtStrategy", "RebasinStrategy", "TransfusionStrategy", "FsMergeStrategy", "FsMergeSeqStrategy",
           "FedDfStrategy"]
