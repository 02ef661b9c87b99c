"""Capacity tiers of a federation: parse ``client-tiers`` and assign a tier to every client.

A tier is a width multiplier ``r`` in (0, 1] of the global model (HeteroFL, arXiv 2010.01264, names
r = 1, 1/2, 1/4, 1/8, 1/16 tiers a–e). ``"1,0.5,0.25"`` assigns the tiers round-robin by partition id
(client ``p`` gets tier ``p mod 3``); with one value per client that is one tier per client.
"""

from __future__ import annotations

import math

from fedfuse.strategy_specs import SUBMODEL_METHODS, TIER_STRATEGIES, strategy_spec
# how a fusion strategy derives each tier's model: the global model's slice; the round's clients fused into the
# tier's width; the slice distilled from the ensemble of all the round's clients on the fusion set; the fused global
# model structurally pruned to the tier's architecture (its units reordered so that the pruned model is the slice:
# fedfuse.hetero.prune), with '-recover' then distilled from the round's clients
TIER_MODELS = ("auto", "slice", "fuse", "distill", "prune", "prune-recover")


def resolve_tier_models(strategy: str | None, tier_models: str, family: str | None = None) -> str:
    """``tier-models='auto'`` → the best measured setting for ``strategy`` and the model ``family``: the strategy's
    registry entry (``tiers.models_auto``: ``slice`` for HeteroFL / FedRolex, their papers' sub-models, and FedDF,
    its per-tier distillation), else ``prune`` (units chosen by importance), except ViTs: ``slice`` (pruning heads
    lost to slicing there). The figures are in docs/tiers.md. Any other value is returned as given."""
    if tier_models != "auto":
        return tier_models
    auto = _spec_value(strategy, "models_auto")
    if auto is not None:
        return auto
    return "slice" if family == "vit" else "prune"


def _spec_value(strategy: str | None, attr: str):
    """The ``WidthTiers`` field ``attr`` of ``strategy``'s registry entry (``None`` for no or an unknown strategy)."""
    try:
        return getattr(strategy_spec(strategy).tiers, attr) if strategy is not None else None
    except ValueError:
        return None


ORDERED_DROPOUT = ("auto", "all", "narrow", "off")
ORDERED_DROPOUT_DRAWS = ("uniform", "width", "sandwich")   # ordered-dropout-draw words (besides auto, a probability)


def resolve_ordered_dropout(strategy: str | None, ordered_dropout: str, mode: str = "multi-round") -> str:
    """``ordered-dropout='auto'`` → the best measured setting for ``strategy`` (its registry entry's
    ``tiers.ordered_dropout_auto``): ``off`` for HeteroFL / FedRolex / FedDF (their papers' local training) and in
    one-shot mode, ``all`` for ``average`` and the fusion methods in multi-round mode. ``"all"``: every client also
    trains its narrower tiers' sub-models (FjORD's ordered dropout, "FjORD: Fair and Accurate Federated Learning
    under heterogeneous targets with Ordered Dropout", arXiv 2102.13451); ``"narrow"``: every client but those of
    the widest tier; ``"off"``. Ordered dropout raises the small tiers' models and can cost the global model
    (docs/tiers.md)."""
    if ordered_dropout not in ORDERED_DROPOUT:
        raise ValueError(f"ordered-dropout: {ordered_dropout!r} is not one of {ORDERED_DROPOUT}")
    if ordered_dropout != "auto":
        return ordered_dropout
    if mode == "one-shot":
        return "off"
    return _spec_value(strategy, "ordered_dropout_auto") or "all"


def resolve_ordered_dropout_draw(strategy: str | None, draw: str | float, family: str | None = None) -> str | float:
    """``ordered-dropout-draw='auto'`` → the best measured draw (``results/tiers-od-draw/table.md``): ``width`` (each
    width in proportion to itself, ``fedfuse.hetero.ordered_dropout.draw_weights``) for ``average`` and the fusion
    methods, where it puts the default above HeteroFL, FedRolex and FedDF in more capacity-tier cells than FjORD's
    uniform draw (docs/tiers.md, "Since the width draw"); ``uniform`` for ViTs (the width draw cost their smallest
    tier) and for the strategies whose ordered dropout is off by default (HeteroFL, FedRolex, FedDF: with
    ``ordered-dropout='all'`` they are the FjORD-style baselines, FjORD's own draw). Any other value is returned as
    given."""
    if draw != "auto":
        return draw
    if family == "vit" or _spec_value(strategy, "ordered_dropout_auto") == "off":
        return "uniform"
    return "width"


def parse_tiers(text: str, key: str = "client-tiers") -> tuple[float, ...]:
    """``"1,0.5,0.25"`` → ``(1.0, 0.5, 0.25)``; ``""`` → ``()`` (no tiers). ``ValueError`` naming ``key``
    for a value that is not a number in (0, 1]."""
    text = str(text).strip()
    if not text:
        return ()
    out = []
    for part in text.split(","):
        part = part.strip()
        if "x" in part:   # '<width>x1': a width tier at full depth
            r, d = parse_tier_pair(part, key=key)
            if d < 1:
                raise ValueError(f"{key}: {part!r} is a depth tier; width tiers and depth tiers are not combined "
                                 "(give every tier as <width>x<depth> with width 1, or widths alone)")
            out.append(r)
            continue
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"{key}: {part!r} is not a number; give comma-separated width multipliers in (0, 1], "
                             f"e.g. '1,0.5,0.25', or <width>x<depth> tiers (depth tiers: fedfuse.hetero.depth)") from None
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


def parse_tier_pairs(text: str, key: str = "client-tiers") -> tuple[tuple[float, float], ...]:
    """``"1x1,1x0.5,0.5"`` → ``((1.0, 1.0), (1.0, 0.5), (0.5, 1.0))``: ``<width>x<depth>`` multipliers in (0, 1]; a
    bare number is a width tier at full depth (today's syntax). ``ValueError`` naming ``key``; one tier must be the
    full model (``1x1``)."""
    text = str(text).strip()
    if not text:
        return ()
    out = [parse_tier_pair(part, key=key) for part in text.split(",")]
    if (1.0, 1.0) not in out:
        raise ValueError(f"{key}: no tier is the full model ('1' or '1x1'), so no client would train the global "
                         f"model; got {text!r}")
    return tuple(out)


def parse_tier_pair(value, key: str = "tier") -> tuple[float, float]:
    """One tier ``"<width>x<depth>"`` (or a bare width) → ``(width, depth)`` multipliers in (0, 1]."""
    text = str(value).strip()
    width, sep, depth = text.partition("x")
    try:
        float(width)
    except ValueError:
        raise ValueError(f"{key}: {text!r} is not a number; give a width multiplier in (0, 1] or a "
                         "<width>x<depth> tier, e.g. '1x0.5'") from None
    w = parse_tier_value(width, key=key)
    if not sep:
        return w, 1.0
    try:
        d = float(depth)
    except ValueError:
        raise ValueError(f"{key}: depth {depth!r} of tier {text!r} is not a number; write <width>x<depth>, e.g. "
                         "'1x0.5'") from None
    if not (math.isfinite(d) and 0 < d <= 1):
        raise ValueError(f"{key}: depth multiplier {depth} of tier {text!r} must be in (0, 1] (1 = the global "
                         "model's depth)")
    return w, d


def has_depth_tiers(text: str, key: str = "client-tiers") -> bool:
    """Whether ``client-tiers`` names a tier shallower than the global model."""
    return any(d < 1 for _, d in parse_tier_pairs(text, key=key)) if "x" in str(text) else False


def tier_sort_key(name: str) -> tuple[float, float]:
    """``(width, depth)`` of a results tier label (``"0.5"``, ``"1x0.25"``), to sort tiers and find the full one."""
    return parse_tier_pair(name, key="tier label")


def tier_name(width_mult: float) -> str:
    """A stable label for results tables: ``1``, ``0.5``, ``0.25``."""
    return f"{width_mult:g}"


__all__ = ["TIER_STRATEGIES", "TIER_MODELS", "SUBMODEL_METHODS", "resolve_tier_models", "parse_tiers", "tier_of", "parse_tier_value", "tier_name",
           "parse_tier_pairs", "parse_tier_pair", "has_depth_tiers", "tier_sort_key"]
