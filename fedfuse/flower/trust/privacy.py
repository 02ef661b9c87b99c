"""Privacy as run configuration: differential privacy (Flower's own DP wrappers composed around fedfuse's averaging
strategies, one (ε, δ) account for the training rounds and the private head round, and what a DP run sends) and
secure sums of the head round's statistics (below).

``dp-noise-multiplier`` > 0 turns it on (``fedfuse.config``: the keys, and which strategies and options a DP run
refuses before any client trains). ``wrap_private(strategy, cfg)`` then returns::

    PrivateRounds(                                  # fedfuse: the account, uniform weights, nothing but the update
        DifferentialPrivacyServerSideFixedClipping(  # Flower: clip each update, noise the average
            strategy, noise_multiplier, clipping_norm, num_sampled_clients))

(``dp-clipping='client'``: Flower's ``DifferentialPrivacyClientSideFixedClipping``, the nodes clip with
``fixedclipping_mod``, which fedfuse's ClientApp applies when the train message carries the clipping norm:
``dp_clipping_mod``). The Gaussian mechanism's noise, ``noise_multiplier × clipping_norm / n`` on the average of
``n`` clipped updates, is calibrated to one client's influence on a *uniform* average (McMahan et al., "Learning
Differentially Private Recurrent Language Models", arXiv 1710.06963); fedfuse's strategies weigh replies by their
sample counts, so ``PrivateRounds`` sets every reply's weight to 1 before Flower's wrapper sees it, keeps only the
model's arrays (a side record such as importance scores would otherwise be clipped against the model's shapes and
crash the wrapper), drops the replies' other metrics (not covered by the account), and skips a round whose
number of replies differs from the number sampled (the noise would be too small for the average of fewer).

The account (``PrivacyAccount``): Flower's ``RdpAccountant`` (Google's ``dp-accounting``; ``flwr[dp]``), client-level
add-or-remove-one neighbours, no amplification by sampling (Flower's choice for fixed clipping: its nodes are not
Poisson-sampled), every released aggregate one Gaussian event; the private head round (``fedfuse.privacy``) adds its
own events to the same account. ``dp-max-epsilon`` stops the run before a release would exceed it.

**Secure sums**: secure sums of the head round's statistics (``secure-aggregation=true``) with Flower's own SecAgg+.

The head round's statistics are sums over the nodes, so the server needs only the federation's sum. Flower 1.41
carries secure aggregation in one place: ``SecAggPlusWorkflow`` (Bell et al., "Secure Single-Server Aggregation with
(Poly)Logarithmic Complexity", CCS 2020) with the nodes' ``secaggplus_mod``, written for the legacy workflow
(``LegacyContext``, a legacy ``Strategy``, ``FitIns`` / ``FitRes`` records on the ``TRAIN`` route); the Message API
has no secure aggregation of its own. ``secure_sum`` bridges it from fedfuse's Message-API ServerApp: a scratch
``LegacyContext`` over the run's grid, a legacy ``FedAvg`` that asks every node for one task, and the workflow's
masked, quantised sum; no protocol code of fedfuse's own.

What the nodes send (``fedfuse.flower.client_app``): their bounded statistics (``fedfuse.privacy``: clipped features,
per-client means, every number within [-2, 2], inside SecAgg+'s clipping range of 8), weight 1, so the workflow's
weighted mean times the number of nodes that took part is the sum. The query (the global model, the clip bound,
the projection) rides in the ``FitIns``. Quantisation: SecAgg+'s ``quantization_range`` 2²² over [-8, 8], about
4·10⁻⁶ per node and number. What SecAgg+ assumes: an honest-but-curious server and at least 2 nodes; a node that
lies about its statistics is not seen (the server checks only the sum's shape and finiteness).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any
import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable  # type: ignore[attr-defined]
from flwr.common import Context
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (DifferentialPrivacyClientSideFixedClipping,
                                     DifferentialPrivacyServerSideFixedClipping, Strategy)
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
from fedfuse.choices import DP_CLIPPINGS
from flwr.supercore.privacy_accounting import (GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig,
                                               SamplingMethod)
from fedfuse.strategy_specs import DP_STRATEGIES
from fedfuse.config import ConfigError
from fedfuse.plan import auto_server_momentum, dp_strategy
from fedfuse.privacy import feature_clip_bound, public_projection

class PrivacyBudgetError(RuntimeError):
    """The next private release would spend more than ``dp-max-epsilon``."""


class PrivacyAccount:
    """The run's (ε, δ) account: Flower's ``RdpAccountant`` over client-level Gaussian releases.

    Args:
        population: the federation's number of clients (the account's population; no sampling amplification).
        delta: the δ at which ε is reported (``dp-delta``).
        max_epsilon: a release that would take ε above it raises ``PrivacyBudgetError`` (``None``: no limit).
    """

    def __init__(self, population: int, delta: float, max_epsilon: float | None = None) -> None:
        from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

        self.population = int(population)
        self.accountant = RdpAccountant(PrivacyConfig(
            target_delta=float(delta), population_size=self.population,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION, max_epsilon=max_epsilon))
        self.releases: list[dict[str, Any]] = []

    def _event(self, noise_multiplier: float, sample_size: int) -> GaussianPrivacyEvent:
        return GaussianPrivacyEvent(noise_multiplier=float(noise_multiplier),
                                    sample_size=max(1, min(int(sample_size), self.population)),
                                    population_size=self.population)

    def check(self, noise_multiplier: float, sample_size: int, what: str) -> None:
        """``PrivacyBudgetError`` when one more release would take ε above ``max_epsilon``."""
        limit = self.accountant.config.max_epsilon
        if limit is not None and self.accountant.would_exceed(self._event(noise_multiplier, sample_size)):
            raise PrivacyBudgetError(f"the next private release ({what}) would take epsilon above dp-options.max-epsilon "
                                     f"{limit} (spent so far: {self.epsilon:.3f} at delta {self.delta:g})")

    def spend(self, noise_multiplier: float, sample_size: int, what: str, check: bool = True) -> float:
        """Compose one release (``noise_multiplier``: noise std ÷ the release's L2 sensitivity) and return ε
        so far; ``PrivacyBudgetError`` (nothing composed) when it would exceed ``max_epsilon`` (``check``)."""
        if check:
            self.check(noise_multiplier, sample_size, what)
        self.accountant.compose(self._event(noise_multiplier, sample_size))
        eps = self.epsilon
        self.releases.append({"what": what, "noise-multiplier": float(noise_multiplier), "epsilon": eps})
        return eps

    @property
    def epsilon(self) -> float:
        return float(self.accountant.get_privacy_spent().epsilon) if self.accountant.num_releases else 0.0

    @property
    def delta(self) -> float:
        return float(self.accountant.config.target_delta)

    def summary(self) -> dict[str, Any]:
        """What ``results.json`` records: ε, δ, the releases and the accounting model."""
        return {"epsilon": self.epsilon, "delta": self.delta, "releases": len(self.releases),
                "accounting": "RDP (Flower RdpAccountant), client-level add-or-remove-one, no sampling amplification",
                "per-release": list(self.releases)}


@dataclass
class HeadPrivacy:
    """The bounded head round's settings (``fedfuse.flower.head.head_round.HeadRound(privacy=...)``): the feature clip
    bound and projection the nodes apply (``fedfuse.privacy.private_head_statistics``), and in a DP run the Gaussian
    noise multiplier of its releases (the summed statistics, the check's accuracies), the run's account and the
    noise's generator. ``noise_multiplier`` 0 and no account: bounded statistics summed without noise (what
    ``secure-aggregation=true`` alone sends)."""

    noise_multiplier: float
    clip: float
    account: PrivacyAccount | None
    generator: torch.Generator
    projection: torch.Tensor | None = None   # [d, k]: fedfuse.privacy.public_projection (None: every feature)

    @property
    def noised(self) -> bool:
        return self.noise_multiplier > 0 and self.account is not None


def noise_for_epsilon(epsilon: float, delta: float, releases: int = 1, population: int = 10) -> float:
    """The noise multiplier whose ``releases`` Gaussian releases spend ``epsilon`` at ``delta`` on this account
    (bisection on the RDP accountant; for benchmarks and for choosing ``dp-noise-multiplier``)."""
    if not (epsilon > 0 and 0 < delta < 1 and releases >= 1):
        raise ValueError(f"noise_for_epsilon: need epsilon > 0, 0 < delta < 1, releases >= 1; got {epsilon}, "
                         f"{delta}, {releases}")

    def eps(sigma: float) -> float:
        account = PrivacyAccount(population, delta)
        for _ in range(releases):
            account.spend(sigma, population, "calibration")
        return account.epsilon

    lo, hi = 1e-2, 1.0
    while eps(hi) > epsilon:
        hi *= 2.0
        if hi > 1e6:
            raise ValueError(f"noise_for_epsilon: epsilon {epsilon} is out of reach")
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= epsilon else (mid, hi)
    return hi


def planned_epsilon(cfg) -> tuple[float, int] | None:
    """``(ε, releases)`` a DP run's account reaches when every release goes as configured (``cfg``: a ``RunConfig``):
    one Gaussian release per training round at ``dp-options.noise-multiplier``, and with the head round its two (the
    summed statistics and the clients' check) at ``dp-options.head-noise-multiplier`` (else the rounds'); what the
    run header prints before the run. A round released from fewer replies, or a skipped one, makes the final ε (printed
    when the run ends, from the account itself) differ. ``None`` without DP."""
    if cfg.dp_noise_multiplier <= 0:
        return None
    account = PrivacyAccount(cfg.num_clients, cfg.dp_delta)
    for r in range(cfg.num_server_rounds):
        account.spend(cfg.dp_noise_multiplier, cfg.num_clients, f"round {r + 1}", check=False)
    if cfg.head_round:
        for what in ("head statistics", "head check"):
            account.spend(cfg.dp_head_noise_multiplier or cfg.dp_noise_multiplier, cfg.num_clients, what, check=False)
    return account.epsilon, len(account.releases)


class PrivateRounds(Strategy):
    """The DP run's outer strategy: Flower's DP wrapper (``inner``) behind the account, uniform weights and bare
    replies (module docstring). ``fedfuse_strategy``: the fedfuse strategy inside both (its ``arrayrecord_key``,
    ``weighted_by_key`` and ``history``)."""

    def __init__(self, inner: Strategy, fedfuse_strategy: Strategy, account: PrivacyAccount,
                 num_sampled_clients: int) -> None:
        super().__init__()
        self.inner, self.strategy, self.account = inner, fedfuse_strategy, account
        self.num_sampled_clients = int(num_sampled_clients)
        self.noise_multiplier = float(inner.noise_multiplier)
        self.history: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"PrivateRounds({self.inner!r})"

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.current_arrays = arrays   # what the round's updates are measured from (noise_to_update)
        return self.inner.configure_train(server_round, arrays, config, grid)

    def noise_to_update(self, replies: list[Message]) -> dict[str, Any] | None:
        """How the round's noise compares with its signal: the noise's std on every coordinate of the average,
        ``noise_multiplier × clipping_norm / n``, its expected norm (× √d over the model's ``d`` coordinates), the
        norm of the mean of the ``n`` clipped updates (each reply minus the round's global model, clipped to the
        clipping norm as Flower clips it) and their ratio; read only, nothing drawn (``None`` when it cannot be
        measured). A ratio far above 1: the noise, not the update, moves the model (issue 60 item 4)."""
        current = getattr(self, "current_arrays", None)
        key = getattr(self.strategy, "arrayrecord_key", "arrays")
        if current is None:
            return None
        base = [np.asarray(a, dtype=np.float64) for a in current.to_numpy_ndarrays()]
        clip = float(self.inner.clipping_norm)
        total, n = None, 0
        for reply in replies:
            if reply.has_error() or key not in reply.content.array_records:
                continue
            mine = [np.asarray(a, dtype=np.float64) for a in reply.content.array_records[key].to_numpy_ndarrays()]
            if len(mine) != len(base) or any(a.shape != b.shape for a, b in zip(mine, base)):
                return None
            update = np.concatenate([(a - b).ravel() for a, b in zip(mine, base)])
            norm = float(np.linalg.norm(update))
            update *= min(1.0, clip / norm) if norm > 0 else 1.0
            total = update if total is None else total + update
            n += 1
        if total is None:
            return None
        std = self.noise_multiplier * clip / self.num_sampled_clients
        mean_norm = float(np.linalg.norm(total / n))
        noise_norm = std * math.sqrt(total.size)
        return {"noise-std": std, "noise-norm": noise_norm, "update-norm": mean_norm, "coordinates": int(total.size),
                "noise-to-update": noise_norm / mean_norm if mean_norm > 0 else math.inf}

    def _bare(self, reply: Message) -> Message:
        """The reply as the account covers it: the model's arrays and the weight 1, nothing else."""
        if reply.has_error():
            return reply
        content = reply.content
        key = getattr(self.strategy, "arrayrecord_key", "arrays")
        weight_key = getattr(self.strategy, "weighted_by_key", "num-examples")
        for name in [n for n in content.array_records if n != key]:
            del content[name]
        for name in list(content.metric_records):
            del content[name]
        for name in list(content.config_records):
            del content[name]
        content["metrics"] = MetricRecord({weight_key: 1})
        return reply

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = [self._bare(r) for r in replies]
        ok = sum(not r.has_error() for r in replies)
        record = {"round": server_round, "replies": ok, "sampled": self.num_sampled_clients}
        if ok != self.num_sampled_clients:
            record["skipped"] = (f"{ok} valid replies of {self.num_sampled_clients} sampled: the noise is calibrated "
                                 "to the average of all of them, so this round releases nothing")
            log(WARNING, "fedfuse dp: round %d: %s", server_round, record["skipped"])
            self.history.append(record)
            failures = [{"node-id": int(r.metadata.src_node_id), "reason": str(r.error.reason)}
                        for r in replies if r.has_error()]
            if failures:
                log(WARNING, "fedfuse dp: round %d: failed replies: %s", server_round,
                    "; ".join(f"node {f['node-id']}: {f['reason']}" for f in failures[:3]))
            # the fedfuse strategy's record too: a run whose every round is skipped fails (fedfuse.results)
            self.strategy.history.append({
                "round": server_round + int(getattr(self.strategy, "round_offset", 0)), "method": "dp",
                "replies": len(replies), "valid": ok, "failures": failures, "rejected": [], "fallback": None,
                "skipped": f"dp: {record['skipped']}", "fusion-info": None})
            return None, None
        self.account.check(self.noise_multiplier, self.num_sampled_clients, f"round {server_round}")
        ratio = self.noise_to_update(replies)   # before Flower's wrapper clips the replies in place
        if ratio is not None:
            record.update(ratio)
        history = getattr(self.strategy, "history", [])
        before = len(history)
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        # a reply fedfuse rejected after Flower clipped it leaves an average over fewer: the noise, calibrated to
        # all n, is then sigma * valid / n of that average's sensitivity, and that is what the account composes
        valid = next((int(h["valid"]) for h in history[before:] if isinstance(h.get("valid"), int)), ok)
        multiplier = self.noise_multiplier * min(valid, ok) / self.num_sampled_clients
        if multiplier < self.noise_multiplier:
            record["effective-noise-multiplier"] = multiplier
            log(WARNING, "fedfuse dp: round %d averaged %d of %d replies: accounted at noise multiplier %.3g",
                server_round, valid, self.num_sampled_clients, multiplier)
        if arrays is not None or valid > 0:
            self.account.spend(max(multiplier, 1e-6), self.num_sampled_clients, f"round {server_round}",
                               check=False)
        record["epsilon"] = self.account.epsilon
        self.history.append(record)
        log(INFO, "fedfuse dp: round %d released; epsilon %.3f at delta %g", server_round, self.account.epsilon,
            self.account.delta)
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)


def num_sampled(strategy: Strategy, num_clients: int) -> int:
    """How many clients the strategy samples a round (``RoundProtocol``'s rule: Flower FedAvg's)."""
    fraction = float(getattr(strategy, "fraction_train", 1.0))
    minimum = int(getattr(strategy, "min_train_nodes", 2))
    return min(num_clients, max(int(num_clients * fraction), minimum))


def wrap_private(strategy: Strategy, *, noise_multiplier: float, clipping_norm: float, clipping: str,
                 account: PrivacyAccount, num_clients: int) -> PrivateRounds:
    """``strategy`` behind Flower's fixed-clipping DP wrapper (``clipping``: ``"server"`` or ``"client"``) and
    ``PrivateRounds`` (the account, uniform weights, bare replies)."""
    if clipping not in DP_CLIPPINGS:
        raise ValueError(f"dp-clipping must be one of {list(DP_CLIPPINGS)}, got {clipping!r}")
    n = num_sampled(strategy, num_clients)
    cls = (DifferentialPrivacyServerSideFixedClipping if clipping == "server"
           else DifferentialPrivacyClientSideFixedClipping)
    return PrivateRounds(cls(strategy, noise_multiplier, clipping_norm, n), strategy, account, n)


def dp_clipping_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """fedfuse's ClientApp mod: Flower's ``fixedclipping_mod`` on train messages that carry the clipping norm
    (a run with ``dp-clipping='client'``), nothing otherwise."""
    from flwr.clientapp.mod import fixedclipping_mod

    config = msg.content.config_records.get("config")
    if msg.metadata.message_type == "train" and config is not None and KEY_CLIPPING_NORM in config:
        return fixedclipping_mod(msg, context, call_next)
    return call_next(msg, context)



# ------------------------------------------------------------------------------------------------ the run's wiring
def private_config(cfg):
    """``(cfg, account)`` of a run: with ``dp-noise-multiplier`` > 0 the config a DP run executes (``auto`` without a
    fusion candidate is ``fedavg``, ``fedfuse.config.dp_strategy``; no per-client reference columns, which would
    publish each client's model's accuracy) and a fresh ``PrivacyAccount``; else ``(cfg, None)``."""
    import dataclasses

    if cfg.dp_noise_multiplier <= 0:
        return cfg, None
    changes = {}
    if dp_strategy(cfg) != cfg.strategy:
        changes["strategy"] = dp_strategy(cfg)
        if auto_server_momentum(cfg) is not None:   # auto's momentum step (the plan's), as without DP
            changes["server_momentum"] = auto_server_momentum(cfg)
        log(INFO, "fedfuse dp: strategy 'auto' has no fusion candidate at local-epochs %d: it runs as %r",
            cfg.local_epochs, changes["strategy"])
    if cfg.client_references:
        changes["client_references"] = False
        log(INFO, "fedfuse dp: no per-client reference columns (each client's model's accuracy is not covered by the "
            "account)")
    account = PrivacyAccount(cfg.num_clients, cfg.dp_delta, cfg.dp_max_epsilon or None)
    log(INFO, "fedfuse dp: client-level DP, noise multiplier %g, clipping norm %g (%s-side), delta %g%s",
        cfg.dp_noise_multiplier, cfg.dp_clipping_norm, cfg.dp_clipping, cfg.dp_delta,
        f", max epsilon {cfg.dp_max_epsilon:g}" if cfg.dp_max_epsilon else "")
    return dataclasses.replace(cfg, **changes), account


def _flower_dp_wrapper(runner: Strategy, strategy: Strategy) -> Strategy | None:
    """The first of Flower's DP wrappers between ``runner`` and fedfuse's ``strategy`` (``None``: none)."""
    seen, r = set(), runner
    while r is not None and r is not strategy and id(r) not in seen:
        seen.add(id(r))
        if type(r).__module__.startswith("flwr.serverapp.strategy.dp_"):
            return r
        r = getattr(r, "inner", None) or getattr(r, "strategy", None)
    return None


def compose_runner(cfg, strategy: Strategy, account: PrivacyAccount | None, wrap_strategy, context) -> Strategy:
    """The strategy a run starts: fedfuse's, behind ``wrap_private`` in a DP run, then the user's ``wrap_strategy``.
    A Flower DP wrapper the user adds is checked as the config's DP is (``ConfigError`` before any client trains):
    its noise bounds averaging strategies only, and the head round would send its statistics unnoised."""
    runner = strategy
    if account is not None:
        runner = wrap_private(strategy, noise_multiplier=cfg.dp_noise_multiplier, clipping_norm=cfg.dp_clipping_norm,
                              clipping=cfg.dp_clipping, account=account, num_clients=cfg.num_clients)
    if wrap_strategy is None:
        return runner
    runner = wrap_strategy(runner, context)
    if account is None and (found := _flower_dp_wrapper(runner, strategy)) is not None:
        name = type(found).__name__
        if dp_strategy(cfg) not in DP_STRATEGIES:
            raise ConfigError(f"run-config key 'strategy': {cfg.strategy!r} inside Flower's {name}: the wrapper's "
                              f"noise bounds averaging strategies only ({', '.join(DP_STRATEGIES)}); a strategy that "
                              "reads each client's model on its own is not covered (set the dp-* keys instead of "
                              "wrapping to have fedfuse check and account it)")
        if cfg.head_round:
            raise ConfigError(f"run-config key 'head-round': Flower's {name} noises the rounds' average, but the head "
                              "round would send every client's feature statistics and class counts unnoised; set "
                              "head-round=false, or configure DP with the dp-* keys (the head round then runs "
                              "privatised and is accounted)")
        log(WARNING, "fedfuse dp: Flower's %s wraps %r, which weighs replies by their sample counts; the wrapper's "
            "noise is calibrated to a uniform average (the dp-* keys make it uniform and account it)", name,
            cfg.strategy)
    return runner


def head_privacy(cfg, account: PrivacyAccount | None, model, inputs) -> HeadPrivacy:
    """The private head round of a DP run: its noise multiplier (``dp-head-noise-multiplier``, else the rounds'),
    the public projection and the clip bound, both from the server's own inputs (``dp-head-projection``;
    ``fedfuse.privacy.public_projection``, ``feature_clip_bound``), and a seeded generator."""
    if account is None:   # secure-aggregation=true without DP: bounded statistics, every feature, no noise
        return HeadPrivacy(0.0, feature_clip_bound(model, inputs), None, torch.Generator())
    sigma = cfg.dp_head_noise_multiplier or cfg.dp_noise_multiplier
    projection = public_projection(model, inputs, cfg.dp_head_projection)
    return HeadPrivacy(sigma, feature_clip_bound(model, inputs, projection=projection), account,
                       torch.Generator().manual_seed(cfg.seed * 7919 + 17), projection)


# ---------------------------------------------------------------- secure sums
TASK = "fedfuse-task"   # FitIns config: what the node sums
HEAD_TASK = "head-statistics"
CLIP = "dp-clip"
PROJECTION = "dp-projection"   # FitIns config: the projection [d, k], flattened row-major, with PROJECTION_K
PROJECTION_K = "dp-projection-k"
CLIPPING_RANGE = 8.0


class SecureSumError(RuntimeError):
    """Flower's SecAgg+ workflow halted or returned no sum."""


def fitins_task(msg: Message) -> dict[str, Any] | None:
    """The secure-sum task a TRAIN message carries (its ``FitIns`` config), ``None`` for ordinary training."""
    config = msg.content.config_records.get("fitins.config")
    if config is None or config.get(TASK) != HEAD_TASK:
        return None
    return dict(config)


def secagg_if_flagged(msg: Message, context: Context, call_next):
    """The ClientApp's train mod: Flower's ``secaggplus_mod`` on SecAgg+ messages, nothing otherwise."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def task_model_state(msg: Message, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model state a secure-sum task carries (``FitIns`` parameters, in ``template``'s key order)."""
    from flwr.common import parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat

    arrays = parameters_to_ndarrays(compat.recorddict_to_fitins(msg.content, True).parameters)
    if len(arrays) != len(template):
        raise ValueError(f"secure sum: the task carries {len(arrays)} arrays, the model has {len(template)}")
    return {k: torch.as_tensor(np.asarray(a)).reshape(v.shape).to(v.dtype) for (k, v), a in
            zip(template.items(), arrays)}


def task_reply(msg: Message, arrays: list[np.ndarray]) -> Message:
    """A node's answer to a secure-sum task: ``arrays`` as ``FitRes`` parameters, weight 1."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat

    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.asarray(a, dtype=np.float64) for a in arrays]),
                 num_examples=1, metrics={})
    return Message(compat.fitres_to_recorddict(res, False), reply_to=msg)


def secure_sum(grid, state: dict[str, torch.Tensor], config: dict[str, Any], timeout: float | None
               ) -> tuple[list[np.ndarray], int]:
    """``(the nodes' arrays summed, how many nodes took part)``: one SecAgg+ round over every node of ``grid``, the
    ``FitIns`` carrying ``state`` (a model's arrays) and ``config``; ``SecureSumError`` when the workflow halts (fewer
    than 2 nodes, too many dropped) or gives no sum. The server sees the sum only."""
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import LegacyContext, ServerConfig, SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.strategy import FedAvg as LegacyFedAvg
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

    nodes = list(grid.get_node_ids())
    if len(nodes) < 2:
        raise SecureSumError(f"secure aggregation needs at least 2 nodes, the federation has {len(nodes)}")

    class _Sum(LegacyFedAvg):   # asks every node for the task and counts the answers the workflow summed
        taken = 0

        def aggregate_fit(self, server_round, results, failures):
            self.taken = len(results)
            return super().aggregate_fit(server_round, results, failures)

    manager = SimpleClientManager()
    for node in nodes:
        manager.register(GridClientProxy(node_id=node, grid=grid, run_id=grid.run.run_id))
    strategy = _Sum(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=len(nodes),
                    min_available_clients=len(nodes), on_fit_config_fn=lambda _r: dict(config))
    scratch = Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={})
    legacy = LegacyContext(scratch, ServerConfig(num_rounds=1), strategy, manager)
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: 1})
    legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters([v.detach().cpu().numpy() for v in state.values()]), True)
    SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=0.67, max_weight=1.0,
                       clipping_range=CLIPPING_RANGE, timeout=timeout)(grid, legacy)
    if not strategy.taken:
        raise SecureSumError("Flower's SecAgg+ workflow halted before summing (see its log: too few nodes answered "
                             "a stage, or a stage timed out)")
    mean = parameters_to_ndarrays(compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD],
                                                                   True))
    log(INFO, "fedfuse secure sum: %d of %d nodes summed with SecAgg+", strategy.taken, len(nodes))
    if strategy.taken < len(nodes):
        log(WARNING, "fedfuse secure sum: %d nodes dropped out of SecAgg+", len(nodes) - strategy.taken)
    return [np.asarray(m, dtype=np.float64) * strategy.taken for m in mean], strategy.taken


__all__ = ["DP_CLIPPINGS", "HeadPrivacy", "PrivacyAccount", "PrivacyBudgetError", "PrivateRounds",
           "noise_for_epsilon", "planned_epsilon", "num_sampled", "wrap_private", "dp_clipping_mod",
           "private_config", "compose_runner", "head_privacy", "TASK", "HEAD_TASK", "CLIP", "PROJECTION",
           "PROJECTION_K", "SecureSumError", "fitins_task", "secagg_if_flagged", "task_model_state", "task_reply",
           "secure_sum"]
