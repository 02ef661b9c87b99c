"""Warm start: round 1 fuses the clients' own models, multi-round FL continues from the fused model.

The cross-silo case fusion is made for: institutions that already have models of one architecture, trained
independently (different initialisations, their own data). ``mode='warm-start'`` runs it on any strategy:

- round 1 is a one-shot round: the train config says ``mode='one-shot'`` (the ClientApp ignores the weights sent
  and trains its own independently initialised model, ``fedfuse.task.client_init_seed``) with
  ``local-epochs=warm-start-epochs`` (and ``lr=warm-start-lr`` when set); the server validates the replies as in
  any round and combines the models with ``warm-start-fusion`` (a ``fedfuse.fusion`` method, or ``best-client``);
  no divergence guard (the clients' average is no fallback for independently initialised models), no server
  step, no refinement: the fused model is the round's global model;
- then the strategy's server state is reset (server momentum, Flower's optimiser state), so that round 2's step
  starts from the fused model and not from a "step" initial model → fused model;
- rounds >= 2 are the strategy's own multi-round rounds (``average``, ``fedavg``, Flower's baselines, fusion
  strategies alike).

The round's record (``history``, ``rounds.csv``) names the aggregation ``warm-start:<fusion>`` and its
``fusion-info`` holds the method's diagnostics (``auto-choice`` for ``auto``, ``best-client`` for best-client).
With ``save_dir`` the clients' round-1 models are written there (``client-<partition-id>.pt``), so that other
starts (the best client's model, their average) can be compared on the same models (``initial-model-path``).

Nothing fails silently: a round 1 with too few valid replies, or whose fusion failed under ``fusion-fallback=
'previous'`` (the global model would stay the fresh initialisation), stops the run with ``WarmStartFailed`` (in
``results.json`` as the run's error); under ``fusion-fallback='average'`` a failed fusion takes the clients' plain
average (WARNING, recorded as the round's fallback).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.logger import log
from torch import nn

from fedfuse.choices import BEST_CLIENT
from fedfuse.fusion import fuse_result, get_spec
from fedfuse.flower.round.replies import ClientUpdate, state_to_record
from fedfuse.models import levels
from fedfuse.strategy_specs import DEPTH_WARM_START


@dataclass(frozen=True)
class WarmStart:
    """Round 1 of a warm-start run (see the module docstring).

    Attributes:
        fusion: a ``fedfuse.fusion`` method that returns one model of the clients' architecture, or ``best-client``
            (the client model with the highest accuracy on the server's labelled fusion set).
        options: the fusion method's options (validated now against its options schema).
        epochs: the clients' local epochs in round 1.
        lr: the clients' learning rate in round 1 (``None``: the run's).
        save_dir: where the clients' round-1 models are written (``None``: not written).
        depth_tiers: the run has depth tiers: ``fusion`` is the depth-tier strategy's own one-shot aggregation
            (``DEPTH_WARM_START``), which takes the clients' models of several depths and widths.
    """

    fusion: str = "kf-linear"
    options: dict[str, Any] = field(default_factory=dict)
    epochs: int = 20
    lr: float | None = None
    save_dir: Path | None = None
    depth_tiers: bool = False

    def __post_init__(self) -> None:
        if int(self.epochs) < 1:
            raise ValueError(f"warm start: epochs must be >= 1, got {self.epochs}")
        if self.lr is not None and not float(self.lr) > 0:
            raise ValueError(f"warm start: lr must be > 0 or None, got {self.lr}")
        if self.depth_tiers:   # the depth-tier strategy's own one-shot aggregations (fedfuse.flower.tiers.depth_tiers)
            if self.fusion not in DEPTH_WARM_START or self.options:
                raise ValueError(f"warm start: with depth tiers the clients' own models are combined by one of "
                                 f"{list(DEPTH_WARM_START)} without options, got {self.fusion!r} {self.options or ''}")
            return
        if self.fusion == BEST_CLIENT:
            if self.options:
                raise ValueError(f"warm start: best-client takes no options, got {sorted(self.options)}")
            return
        spec = get_spec(self.fusion)
        if not spec.same_architecture:
            raise ValueError(f"warm start: fusion method {self.fusion!r} does not return one model of the clients' "
                             "architecture")
        spec.parse_options(self.options)

    def check_server(self, fusion_inputs: torch.Tensor | None, fusion_labels: torch.Tensor | None) -> None:
        """What the server must hold for this fusion: labels for ``best-client``; ``ValueError`` naming the key."""
        if self.fusion == BEST_CLIENT and (fusion_inputs is None or fusion_labels is None):
            raise ValueError("run-config key 'warm-start-options.fusion': 'best-client' picks the client model with the best "
                             "accuracy on the server's labelled fusion set, but the fusion set has no labels 'y' "
                             "(fusion-set-path with x and y, or fusion-set-source='public'); choose a fusion method")

    @staticmethod
    def applies(server_round: int) -> bool:
        return server_round == 1

    @property
    def label(self) -> str:
        return f"warm-start:{self.fusion}"

    @property
    def needs_scores(self) -> bool:
        """Whether the clients must send importance scores (the method reads them under ``options``)."""
        return (not self.depth_tiers and self.fusion != BEST_CLIENT
                and get_spec(self.fusion).reads_client_scores(self.options))

    def round_config(self) -> dict[str, Any]:
        """Round 1's train-config keys: the one-shot signal, the warm-start epochs (and lr)."""
        out: dict[str, Any] = {"mode": "one-shot", "local-epochs": int(self.epochs), "fusion-method": self.label,
                               "need-importance": self.needs_scores, "need-class-counts": False}
        if self.lr is not None:
            out["lr"] = float(self.lr)
        return out

    def level_widths(self, model_fn) -> dict[str, int] | None:
        """The importance vectors' lengths a reply must have (``None`` when no scores are read)."""
        return {lv.name: lv.width for lv in levels(model_fn())} if self.needs_scores else None

    def combine(self, protocol: Any, server_round: int, updates: list[ClientUpdate]
                ) -> tuple[dict[str, torch.Tensor], dict[str, Any], float]:
        """``(fused state, info, seconds)`` from the round's valid replies; ``FusionError`` when the method fails."""
        t0 = time.perf_counter()
        if self.save_dir is not None:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            for u in updates:
                torch.save(u.state, self.save_dir / f"client-{u.partition_id}.pt")
        if self.depth_tiers:   # models of several depths (and widths): the strategy's own aggregation across them
            result = protocol.fuse_own_models(server_round, updates, self.fusion)
            model, info = result.model, dict(result.info or {})
        elif self.fusion == BEST_CLIENT:
            models = [protocol.build_model(u.state) for u in updates]
            model, info = best_client(models, updates, protocol.fusion_inputs, protocol.fusion_labels)
        else:
            models = [protocol.build_model(u.state) for u in updates]
            result = fuse_result(self.fusion, models, fusion_inputs=protocol.fusion_inputs,
                                 scores=[u.scores for u in updates] if self.needs_scores else None,
                                 weights=[u.num_examples for u in updates], device=protocol.device,
                                 seed=protocol.seed + server_round, **self.options)
            model, info = result.model, dict(result.info or {})
        info["warm-start"] = self.fusion
        return model.state_dict(), info, time.perf_counter() - t0


def best_client(models: list[nn.Module], updates: list[ClientUpdate], x: torch.Tensor,
                y: torch.Tensor) -> tuple[nn.Module, dict[str, Any]]:
    """The model with the highest accuracy on the labelled fusion set ``(x, y)`` (ties: the lowest partition id)."""
    with torch.no_grad():
        accs = [float((m(x.float()).argmax(-1) == y).float().mean()) for m in models]
    best = max(range(len(models)), key=lambda i: (accs[i], -i))
    return models[best], {"best-client": updates[best].partition_id, "best-client-fusion-accuracy": accs[best]}


class WarmStartFailed(RuntimeError):
    """Round 1 of a warm start produced no model from the clients' models (too few valid replies, or the fusion failed
    under ``fusion-fallback='previous'``): the run stops instead of continuing from a fresh initialisation."""


def _why(record: dict[str, Any]) -> str:
    """The first failure or rejection of the round, for the error message."""
    first = (record["failures"] or record["rejected"] or [None])[0]
    return f" (e.g. node {first['node-id']}: {first['reason'][-300:]})" if first else ""


def warm_start_round(protocol: Any, server_round: int, ok: list[Message], failures: list[dict],
                     record: dict[str, Any]) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """Round 1 of a warm-start run: validate, combine with ``protocol.warm_start``, reset the server state, record."""
    warm: WarmStart = protocol.warm_start
    record["method"] = warm.label
    updates = protocol.validate_replies(server_round, ok, record)
    protocol.observe(updates, updates)
    record["valid"] = len(updates)
    protocol.last_updates = updates
    if protocol._stop_or_skip(server_round, len(updates), record):
        raise WarmStartFailed(f"{record['skipped']}{_why(record)}; a warm start without the "
                              "clients' models would be FL from a fresh initialisation, so the run stops")
    t0 = time.perf_counter()
    average = (lambda: protocol.average(updates)) if warm.fusion != "average" else None
    state, fallback, info = protocol.with_fallback(server_round, len(updates),
                                                   lambda: warm.combine(protocol, server_round, updates), average,
                                                   label=warm.label)
    if state is None:   # fallback 'previous': the initial model, not the clients' models
        protocol.history.append({**record, "fallback": fallback})
        raise WarmStartFailed(f"round {server_round}: {warm.fusion!r} could not combine the clients' models "
                              f"({fallback}); a warm start from the initial model would be FL from a fresh "
                              "initialisation, so the run stops (strategy-options.fusion-fallback='average' takes their plain average "
                              "instead, or choose another warm-start-options.fusion)")
    # round 2's server step starts from this model: no momentum / optimiser state from "initial → fused"
    protocol.restart_server_state()
    log(INFO, "aggregate_train: round %d: warm start from %d client models (%s); server state reset", server_round,
        len(updates), warm.fusion)
    metrics = protocol._close_round(record, time.perf_counter() - t0, fallback, info, updates, ok, failures)
    return state_to_record(state), metrics


__all__ = ["DEPTH_WARM_START", "WarmStart", "WarmStartFailed", "best_client", "warm_start_round"]
