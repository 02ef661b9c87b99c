"""Capacity tiers of a federation: parse ``client-tiers`` and assign a tier to every client.

A tier is a width multiplier ``r`` in (0, 1] of the global model (HeteroFL, arXiv 2010.01264, names
r = 1, 1/2, 1/4, 1/8, 1/16 tiers a–e). ``"1,0.5,0.25"`` assigns the tiers round-robin by partition id
(client ``p`` gets tier ``p mod 3``); with one value per client that is one tier per client.
"""

from __future__ import annotations

import math

from fedfuse.choices import TIER_STRATEGIES  # sub-model averaging baselines (fedfuse.flower.tiers)
# how a fusion strategy derives each tier's model: the global model's slice; the round's clients fused into the
# tier's width; the slice distilled from the ensemble of all the round's clients on the fusion set; the fused global
# model structurally pruned to the tier's architecture (its units reordered so that the pruned model is the slice:
# fedfuse.hetero.prune), with '-recover' then distilled from the round's clients
TIER_MODELS = ("auto", "slice", "fuse", "distill", "prune", "prune-recover")
# fusion strategies whose tiered form averages HeteroFL's sub-models (units keep their index, so any tier mix
# works): 'average' (+ fedfuse's server step and refinement) and 'feddf' (FedDF with architecture groups)
SUBMODEL_METHODS = ("average", "feddf")


def resolve_tier_models(strategy: str | None, tier_models: str, family: str | None = None) -> str:
    """``tier-models='auto'`` → the measured best for ``strategy`` and the model ``family``: ``slice`` for HeteroFL /
    FedRolex (their papers' sub-models) and FedDF (its per-tier distillation); for ``average`` and the fusion methods
    ``prune``, except ViTs: ``slice``. Measured (10 clients, 30 rounds, 3 seeds, ``results/tiers``):

    - MLP, MNIST-1D, tiers 1/0.5/0.25 at α=0.1 and 0.5: the global and every tier's model above ``slice`` by 1.6–7.4
      points; tiers 1/0.125 at α=0.1: global +1.3, tier 0.125 −1.4, within the seed spread
      (``results/hetero/prune-vs-slice``, ``results/hetero/prune-default-check``); with ordered dropout, MNIST-1D
      α=0.1: 0.441 / 0.529 / 0.516 vs ``slice`` 0.376 / 0.518 / 0.514 (``results/tiers/explore-od-mnist1d-a0.1``).
    - CNN (with ordered dropout), α=0.1: MNIST-1D 0.708 / 0.748 / 0.775 vs ``slice`` 0.604 / 0.722 / 0.742; digits
      0.603 / 0.626 / 0.632 vs 0.632 / 0.624 / 0.630 (``results/tiers/explore-cnn-slice-*``).
    - ViT, digits α=0.1 (with ordered dropout): ``slice`` 0.469 / 0.756 / 0.712 vs ``prune`` 0.487 / 0.446 / 0.450
      (``results/tiers/explore-vit-slice``).

    Any other value is returned as given."""
    if tier_models != "auto":
        return tier_models
    if strategy in TIER_STRATEGIES + ("feddf",) or family == "vit":
        return "slice"
    return "prune"


ORDERED_DROPOUT = ("auto", "all", "narrow", "off")


def resolve_ordered_dropout(strategy: str | None, ordered_dropout: str, mode: str = "multi-round") -> str:
    """``ordered-dropout='auto'`` → the measured best for ``strategy``: ``off`` for HeteroFL / FedRolex / FedDF
    (their papers' local training) and in one-shot mode, ``all`` for ``average`` and the fusion methods in
    multi-round mode. ``"all"``: every client also trains its narrower tiers' sub-models; ``"narrow"``: every client
    but those of the widest tier; ``"off"``.

    Measured (``results/tiers/summary.md``: 13 multi-round cells, 10 clients, 30 rounds, ``average``): ``all``
    raises the smallest tier's model in 11 of 13 cells (MNIST-1D MLP α=0.1 tiers 1/0.5/0.25, 5 seeds: 0.511 vs
    0.402 ``off``; it beats FedAvg trained at the smallest width in 12 of 13 cells, ``off`` in 5) and costs the
    global model in 7 (digits CNN 0.603 vs 0.773; tiers 1/0.125, where the full-width clients train their own width
    on half the batches: MNIST-1D α=0.5 0.465 vs 0.535), every curve still rising at round 30. ``narrow`` was below
    ``all`` on 4 of 5 cells (``results/tiers/explore-od-narrow-*``). One-shot (clients trained from scratch, fused
    once): kf-linear's global model 55.2 vs 82.1 % (digits CNN, with distillation): off there.
    """
    if ordered_dropout not in ORDERED_DROPOUT:
        raise ValueError(f"ordered-dropout: {ordered_dropout!r} is not one of {ORDERED_DROPOUT}")
    if ordered_dropout != "auto":
        return ordered_dropout
    return "off" if strategy in TIER_STRATEGIES + ("feddf",) or mode == "one-shot" else "all"


def parse_tiers(text: str, key: str = "client-tiers") -> tuple[float, ...]:
    """``"1,0.5,0.25"`` → ``(1.0, 0.5, 0.25)``; ``""`` → ``()`` (no tiers). ``ValueError`` naming ``key``
    for a value that is not a number in (0, 1]."""
    text = str(text).strip()
    if not text:
        return ()
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"{key}: {part!r} is not a number; give comma-separated width multipliers in (0, 1], "
                             f"e.g. '1,0.5,0.25'") from None
        if not (math.isfinite(r) and 0 < r <= 1):
            raise ValueError(f"{key}: width multiplier {part} must be in (0, 1] (1 = the global model's width)")
        out.append(r)
    if max(out) != 1:
        raise ValueError(f"{key}: no tier has width multiplier 1, so no client would train the global (widest) "
                         f"model; got {text!r}")
    return tuple(out)


def tier_of(partition_id: int, tiers: tuple[float, ...]) -> float:
    """The width multiplier of client ``partition_id``: ``tiers[partition_id mod len(tiers)]``."""
    if not tiers:
        return 1.0
    return tiers[int(partition_id) % len(tiers)]


def parse_tier_value(value, key: str = "tier") -> float:
    """One tier (a node-config ``tier`` override): a number in (0, 1]; ``ValueError`` naming ``key``."""
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: {value!r} is not a width multiplier in (0, 1]") from None
    if isinstance(value, bool) or not (math.isfinite(r) and 0 < r <= 1):
        raise ValueError(f"{key}: width multiplier {value!r} must be in (0, 1]")
    return r


def tier_name(width_mult: float) -> str:
    """A stable label for results tables: ``1``, ``0.5``, ``0.25``."""
    return f"{width_mult:g}"


__all__ = ["TIER_STRATEGIES", "TIER_MODELS", "SUBMODEL_METHODS", "resolve_tier_models", "parse_tiers", "tier_of", "parse_tier_value", "tier_name"]
