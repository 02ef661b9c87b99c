"""Flower's own server strategies as fedfuse baselines: FedAvgM, FedAdam, FedYogi, FedProx.

What a Flower user would pick instead of fusion, run on the same splits with fedfuse's reply contract:

    replies → fedfuse's round protocol: split off errors, validate each reply (``fedfuse.flower.round.replies``),
    sort by partition id → Flower's strategy: ``aggregate_train(valid replies)`` → cast to the global model's
    dtypes, finite check → new global ArrayRecord

The aggregation is Flower's code (``flwr.serverapp.strategy.FedAvgM`` / ``FedAdam`` / ``FedYogi`` /
``FedProx``, an inner instance, ``self.flower``), never a rewrite; rejected replies never reach it. A failure
inside Flower's aggregation (``AggregationError``, ``InconsistentMessageReplies``) or a non-finite result is a
``FusionError``, so the round takes the configured ``fallback``; the inner strategy's server-optimizer state
then restarts from the actual global model, so one bad step cannot poison later rounds.

- FedAvgM: Hsu et al., "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
  Classification", arXiv 1909.06335.
- FedAdam / FedYogi: Reddi et al., "Adaptive Federated Optimization", arXiv 2003.00295.
- FedProx: Li et al., "Federated Optimization in Heterogeneous Networks", arXiv 1812.06127. Flower's FedProx
  only sends ``mu``; fedfuse's ClientApp adds ``mu/2 · ||w - w_global||²`` to its local loss.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from typing import Any, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError, InconsistentMessageReplies
from flwr.serverapp.strategy import (Bulyan, FedAdam, FedAvg, FedAvgM, FedMedian, FedProx, FedTrimmedAvg, FedYogi, Krum,
                                     MultiKrum)

from fedfuse.fusion import FusionError, NumericalFusionError
from fedfuse.strategy_specs import SERVER_MOMENTUM, strategy_spec
from fedfuse.flower.round.options import arrays_only
from fedfuse.flower.round.protocol import RoundProtocol
from fedfuse.flower.round.replies import ClientUpdate

# Flower state that a fallback or a resume invalidates (FedAvgM: anchor + momentum; FedOpt: moments)
_SERVER_OPT_STATE = ("current_arrays", "momentum_vector", "m_t", "v_t")


class FlowerAggregationError(FusionError):
    """Flower's strategy could not aggregate the validated replies (the round falls back)."""


def _no_metrics(contents: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """The inner strategy's metrics are unused (fedfuse aggregates the replies' metrics itself, lists included)."""
    return MetricRecord({})


class FlowerBaselineStrategy(RoundProtocol):
    """The round protocol whose aggregation is a Flower strategy's ``aggregate_train`` (``flower_class``).

    Use a named subclass (``FedAvgMStrategy``, ``FedAdamStrategy``, ``FedYogiStrategy``, ``FedProxStrategy``;
    ``FLOWER_BASELINES``), or this class with ``method=`` a registry entry whose ``flower_class`` names the Flower
    strategy (its options in ``flower_options``). ``RoundProtocol``'s options apply (``model_fn`` is optional: without it replies are
    checked against the global arrays sent); ``fusion_options`` must be empty, ``fusion_rounds`` 0 and ``refine``
    none (not a fusion method); the other fusion-strategy options (``guard``, ``prior``, ...) are accepted and have
    no effect. Flower's sampling options and record keys are passed to the inner strategy, whose own
    ``configure_train`` samples the nodes (inside fedfuse's seeded sampling) so Flower keeps its per-round state
    (FedAvgM's anchor, FedOpt's arrays, FedProx's ``proximal-mu``) exactly as it would alone.

    Args:
        flower_options: keyword options of ``flower_class`` (the subclasses write them out, typed).
    """

    method: str | None = None
    flower_class: type[FedAvg] = FedAvg

    def __init__(self, method: str | None = None, *, flower_options: dict[str, Any] | None = None,
                 fusion_rounds: int = 0, fusion_options: dict[str, Any] | None = None, refine: str | None = None,
                 **options: Any) -> None:
        self.method = method or type(self).method
        self.entry = strategy_spec(self.method)
        if type(self).flower_class is FedAvg and self.entry.flower_class not in (None, "FedAvg"):
            self.flower_class = _flower_class(self.method, self.entry.flower_class)   # the entry's Flower class
        for name in ("server_momentum", "server_learning_rate", "refine_check"):
            if name in options:  # fedfuse's own server step / refine check: Flower's strategy has its own optimizer
                raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword argument {name!r} "
                                f"(Flower's {self.flower_class.__name__} options are its own)")
        # the fusion concerns' flat keywords that every strategy accepts, so that one call builds any of them: neutral
        # here (``guard``, ``prior``, ...), a fusion step refused
        options.update(fusion_options=fusion_options, fusion_rounds=fusion_rounds, refine=refine)
        arrays_only(self.method, f"Flower's {self.flower_class.__name__}", options)   # takes them out of options
        super().__init__(**options)
        self.flower_options = dict(flower_options or {})
        self.flower = self.flower_class(
            fraction_train=self.fraction_train, fraction_evaluate=self.fraction_evaluate,
            min_train_nodes=self.min_train_nodes, min_evaluate_nodes=self.min_evaluate_nodes,
            min_available_nodes=self.min_available_nodes, weighted_by_key=self.weighted_by_key,
            arrayrecord_key=self.arrayrecord_key, configrecord_key=self.configrecord_key,
            train_metrics_aggr_fn=_no_metrics, **self.flower_options)
        self._replies: list[Message] = []
        self._warned_resume = False

    def round_method(self, server_round: int) -> str:
        return self.method

    def summary(self) -> None:
        self.flower.summary()
        log(INFO, "\t└──> fedfuse: Flower %s on validated replies, fallback=%s, options=%s",
            self.flower_class.__name__, self.fallback, self.flower_options or "{}")

    # ---------------------------------------------------------------- rounds
    def sample(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        if self.round_offset and not self._warned_resume:
            self._warned_resume = True
            log(WARNING, "strategy %s: resumed after round %d; Flower's %s server-optimizer state (momentum / "
                "moments) restarts from the checkpointed global model", self.method, self.round_offset,
                self.flower_class.__name__)
        return list(self.flower.configure_train(server_round, arrays, config, grid))

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._replies = list(replies)  # aggregate hands the validated ones to Flower
        try:
            return super().aggregate_train(server_round, self._replies)
        finally:
            self._replies = []

    def aggregate(self, server_round: int, updates: list[ClientUpdate]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any], float]:
        """Flower's ``aggregate_train`` on the validated replies' messages (partition-id order): ``(new global state
        in the global model's dtypes, info, seconds)``; ``FusionError`` when Flower cannot aggregate or the result
        is not finite."""
        t0 = time.perf_counter()
        by_node = {int(m.metadata.src_node_id): m for m in self._replies if not m.has_error()}
        messages = [by_node[u.node_id] for u in updates]
        try:
            arrays, _ = self.flower.aggregate_train(server_round, messages)
        except (AggregationError, InconsistentMessageReplies) as exc:
            raise FlowerAggregationError(f"Flower {self.flower_class.__name__}: {exc}") from exc
        if arrays is None:
            raise FlowerAggregationError(f"Flower {self.flower_class.__name__} returned no arrays for "
                                         f"{len(messages)} valid replies")
        reference = updates[0].state
        state: dict[str, torch.Tensor] = {}
        for key, ref in reference.items():
            a = np.asarray(arrays[key].numpy())
            if not np.isfinite(a).all():
                raise NumericalFusionError(f"Flower {self.flower_class.__name__}: aggregated array {key!r} "
                                           "contains NaN or Inf")
            if not ref.is_floating_point():
                a = np.rint(a)  # integer buffers (BatchNorm counters) are averaged as floats by Flower
            # Flower may promote to float64 (FedAdam's bias-corrected step); the global model keeps its dtypes
            state[key] = torch.from_numpy(np.array(a, copy=True)).to(ref.dtype)
        info: dict[str, Any] = {"flower-strategy": self.flower_class.__name__}
        if self._global is not None:
            step = sum(float(((state[k].double() - torch.from_numpy(np.asarray(self._global[k].numpy())).double())
                              ** 2).sum()) for k in state if state[k].is_floating_point())
            info["step-norm"] = step ** 0.5  # ||new global - previous global||
        return state, info, time.perf_counter() - t0

    def on_fallback(self) -> None:
        """The global model did not come from Flower's step: its anchor / momentum / moments are stale."""
        self.restart_server_state()
        log(WARNING, "aggregate_train: Flower %s state reset after the fallback", self.flower_class.__name__)

    def restart_server_state(self) -> None:
        """Forget Flower's anchor / momentum / moments: the next round's step starts from the model it is sent."""
        for attr in _SERVER_OPT_STATE:
            if getattr(self.flower, attr, None) is not None:
                setattr(self.flower, attr, None)


class FedAvgMStrategy(FlowerBaselineStrategy):
    """Flower's ``FedAvgM``: server SGD with momentum on the pseudo-gradient ``w_t - avg(w_i)`` (Hsu et al.,
    arXiv 1909.06335). ``server_momentum=0`` and ``server_learning_rate=1`` is FedAvg.

    Args:
        server_learning_rate: server step size (Flower's default 1.0).
        server_momentum: server momentum. Default 0.5, not Flower's 0.0 (which is plain FedAvg): the best
            measured setting, where 0.9 diverged at server lr 1 (docs/multi-round.md, "Flower's baselines").
    """

    method = "fedavgm"
    flower_class = FedAvgM

    def __init__(self, method: str | None = None, *, server_learning_rate: float = 1.0,
                 server_momentum: float = SERVER_MOMENTUM, **options: Any) -> None:
        super().__init__(method, flower_options={"server_learning_rate": float(server_learning_rate),
                                                 "server_momentum": float(server_momentum)}, **options)


class FedAdamStrategy(FlowerBaselineStrategy):
    """Flower's ``FedAdam``: Adam on the server with the averaged client delta as the gradient (Reddi et al.,
    arXiv 2003.00295). Options are Flower's (defaults as in Flower 1.41).

    Args:
        eta: server learning rate; eta_l: client learning rate (kept by Flower, not sent);
        beta_1, beta_2: first/second moment decay; tau: adaptivity (added to ``sqrt(v)``).
    """

    method = "fedadam"
    flower_class = FedAdam

    def __init__(self, method: str | None = None, *, eta: float = 1e-1, eta_l: float = 1e-1, beta_1: float = 0.9,
                 beta_2: float = 0.99, tau: float = 1e-3, **options: Any) -> None:
        super().__init__(method, flower_options={"eta": float(eta), "eta_l": float(eta_l), "beta_1": float(beta_1),
                                                 "beta_2": float(beta_2), "tau": float(tau)}, **options)


class FedYogiStrategy(FlowerBaselineStrategy):
    """Flower's ``FedYogi``: Yogi on the server (additive second-moment update; Reddi et al., arXiv
    2003.00295). Options are Flower's (defaults as in Flower 1.41)."""

    method = "fedyogi"
    flower_class = FedYogi

    def __init__(self, method: str | None = None, *, eta: float = 1e-2, eta_l: float = 0.0316, beta_1: float = 0.9,
                 beta_2: float = 0.99, tau: float = 1e-3, **options: Any) -> None:
        super().__init__(method, flower_options={"eta": float(eta), "eta_l": float(eta_l), "beta_1": float(beta_1),
                                                 "beta_2": float(beta_2), "tau": float(tau)}, **options)


class FedProxStrategy(FlowerBaselineStrategy):
    """Flower's ``FedProx``: FedAvg on the server; sends ``proximal-mu`` in the train config, and the clients add
    ``mu/2 · ||w - w_global||²`` to their loss (Li et al., arXiv 1812.06127).

    Args:
        proximal_mu: weight of the proximal term (Flower's default 0.0, which is FedAvg and which Flower
            warns about).
    """

    method = "fedprox"
    flower_class = FedProx

    def __init__(self, method: str | None = None, *, proximal_mu: float = 0.0, **options: Any) -> None:
        super().__init__(method, flower_options={"proximal_mu": float(proximal_mu)}, **options)


class FedMedianStrategy(FlowerBaselineStrategy):
    """Flower's ``FedMedian``: the coordinate-wise median of the clients' weights (Yin et al., "Byzantine-Robust
    Distributed Learning: Towards Optimal Statistical Rates", arXiv 1803.01498). No options."""

    method = "fedmedian"
    flower_class = FedMedian

    def __init__(self, method: str | None = None, **options: Any) -> None:
        super().__init__(method, **options)


class FedTrimmedAvgStrategy(FlowerBaselineStrategy):
    """Flower's ``FedTrimmedAvg``: the coordinate-wise mean after cutting the ``beta`` fraction of largest and of
    smallest values (Yin et al., arXiv 1803.01498).

    Args:
        beta: the fraction cut at each end (Flower's default 0.2).
    """

    method = "fedtrimmedavg"
    flower_class = FedTrimmedAvg

    def __init__(self, method: str | None = None, *, beta: float = 0.2, **options: Any) -> None:
        super().__init__(method, flower_options={"beta": float(beta)}, **options)


class KrumStrategy(FlowerBaselineStrategy):
    """Flower's ``Krum``: the client model closest (sum of squared distances to its n − f − 2 nearest) to the others
    (Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017).

    Args:
        num_malicious_nodes: f, the number of Byzantine clients tolerated (Flower's default 0).
    """

    method = "krum"
    flower_class = Krum

    def __init__(self, method: str | None = None, *, num_malicious_nodes: int = 0, **options: Any) -> None:
        super().__init__(method, flower_options={"num_malicious_nodes": int(num_malicious_nodes)}, **options)


class MultiKrumStrategy(FlowerBaselineStrategy):
    """Flower's ``MultiKrum``: the average of the ``num_nodes_to_select`` best-scored client models by Krum's score
    (Blanchard et al., NeurIPS 2017).

    Args:
        num_malicious_nodes: f (Flower's default 0); num_nodes_to_select: m (Flower's default 1).
    """

    method = "multikrum"
    flower_class = MultiKrum

    def __init__(self, method: str | None = None, *, num_malicious_nodes: int = 0, num_nodes_to_select: int = 1,
                 **options: Any) -> None:
        super().__init__(method, flower_options={"num_malicious_nodes": int(num_malicious_nodes),
                                                 "num_nodes_to_select": int(num_nodes_to_select)}, **options)


class BulyanStrategy(FlowerBaselineStrategy):
    """Flower's ``Bulyan``: Krum selection, then a coordinate-wise trimmed mean around the median (El Mhamdi et al.,
    "The Hidden Vulnerability of Distributed Learning in Byzantium", arXiv 1802.07927); needs 4f + 3 replies.

    Args:
        num_malicious_nodes: f (Flower's default 0).
    """

    method = "bulyan"
    flower_class = Bulyan

    def __init__(self, method: str | None = None, *, num_malicious_nodes: int = 0, **options: Any) -> None:
        super().__init__(method, flower_options={"num_malicious_nodes": int(num_malicious_nodes)}, **options)
        # with fewer than 4f + 3 replies Flower's Bulyan returns nothing every round
        f = int(num_malicious_nodes)
        if self.min_train_nodes < 4 * f + 3:
            raise ValueError(f"strategy {self.method!r}: Bulyan needs at least 4f + 3 = {4 * f + 3} replies a round "
                             f"(f = {f} malicious nodes); min_train_nodes is {self.min_train_nodes} "
                             "(run-config key 'strategy-options.min-train-nodes')")


FLOWER_BASELINES: dict[str, type[FlowerBaselineStrategy]] = {cls.method: cls for cls in (
    FedAvgMStrategy, FedAdamStrategy, FedYogiStrategy, FedProxStrategy, FedMedianStrategy, FedTrimmedAvgStrategy,
    KrumStrategy, MultiKrumStrategy, BulyanStrategy)}


def _flower_class(name: str, flower_class: str) -> type[FedAvg]:
    """The ``flwr.serverapp.strategy`` class named ``flower_class`` (registry entry ``name``'s)."""
    import flwr.serverapp.strategy as flower_strategies

    cls = getattr(flower_strategies, flower_class, None)
    if not (isinstance(cls, type) and issubclass(cls, FedAvg)):
        raise ValueError(f"strategy {name!r}: flwr.serverapp.strategy has no FedAvg-based class {flower_class!r}")
    return cls


def baseline_options(strategy: str, *, server_lr: float = 0.0, server_momentum: float | None = None,
                     proximal_mu: float | None = None, trim_beta: float | None = None,
                     num_malicious_nodes: int | None = None, num_nodes_to_select: int | None = None) -> dict[str, Any]:
    """The typed options of Flower baseline ``strategy`` from the run-config keys ``server-lr`` (0 = the
    strategy's default), ``server-momentum``, ``proximal-mu``, ``trim-beta``, ``num-malicious-nodes`` and
    ``num-nodes-to-select``; ``{}`` for any other strategy."""
    values = {"server-lr": server_lr if server_lr > 0 else None, "server-momentum": server_momentum,
              "proximal-mu": proximal_mu, "trim-beta": trim_beta, "num-malicious-nodes": num_malicious_nodes,
              "num-nodes-to-select": num_nodes_to_select}
    try:   # the entry's (run-config key, keyword) pairs: Flower's options, or fedfuse's server step (FedAvgM's)
        pairs = strategy_spec(strategy).keyword_options
    except ValueError:
        return {}
    return {option: values[key] for key, option in pairs if values[key] is not None}


__all__ = ["FlowerBaselineStrategy", "FedAvgMStrategy", "FedAdamStrategy", "FedYogiStrategy", "FedProxStrategy",
           "FLOWER_BASELINES", "FlowerAggregationError", "baseline_options"]
