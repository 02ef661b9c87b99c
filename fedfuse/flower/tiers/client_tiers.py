"""The ClientApp's side of capacity tiers: say which tier this node is, build the tier's model.

- ``query`` handler: a tier-aware strategy asks a node it has not seen yet for its partition id and tier
  (Flower ``MessageType.QUERY``); the reply's ``"metrics"`` record holds ``partition-id`` and ``tier``.
  The tier is the node config's ``tier`` when set (a SuperNode's own capacity in a deployment:
  ``flower-supernode --node-config "... tier=0.25"``), else the run's tiers that the query carries
  (``client-tiers``, already parsed by the server) round-robin by partition id.
- ``tier_model``: the model a ``train`` message asks for: the run's architecture at the width multiplier
  the strategy sends as ``tier-width-mult`` (with HeteroFL's width scaler when ``width-scaler`` is set).
- ``tier_forward``: with ``ordered-dropout-widths`` in the train config, local training draws per batch one of
  the node's nested widths (FjORD's ordered dropout, ``fedfuse.hetero.ordered_dropout``).
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from torch import nn

from fedfuse.config import config_notes, parse_once
from fedfuse.hetero import attach_width_scaler, parse_tier_value, tier_of
from fedfuse.hetero.tiers import parse_tier_pair
from fedfuse.hetero.depth import ExitsView, MultiExit, exit_submodel, held_keys, mutual_distillation_loss
from fedfuse.hetero.ordered_dropout import OrderedDropout, draw_weights, ordered_dropout
from fedfuse.models import adapter_for

QUERY_KIND = "fedfuse-tier"        # config["query"] of a tier query
TIERS_KEY = "client-tiers"         # query config: the run's width multipliers (a list of floats)
TIER_KEY = "tier-width-mult"       # train config: the width multiplier of the model the node receives
SCALER_KEY = "width-scaler"        # train config: apply HeteroFL's width scaler during local training
OD_DRAW_KEY = "ordered-dropout-draw"  # train config: how the node draws its widths ('width' | own probability; absent: uniform)
OD_KEY = "ordered-dropout-widths"  # train config: the narrower tiers this node also trains (FjORD ordered dropout)
DEPTHS_KEY = "client-depths"       # query config: the run's depth multipliers (depth tiers)
DEPTH_KEY = "tier-depth-units"     # train config: the depth units (blocks) of the model the node receives
SELF_DISTILL_KEY = "depth-self-distill"   # train config: DepthFL's mutual distillation between the node's exits
OWN_EXIT_KEY = "depth-own-exit"   # train config: the node holds and trains only the exit after its depth (InclusiveFL)


def node_tier(context: Context, tiers: list[float] | tuple[float, ...] | None = None) -> tuple[int, float]:
    """``(partition id, width multiplier)`` of this node: node-config ``tier``, else ``tiers`` (the run's tiers as
    the strategy sends them) round-robin; without ``tiers`` the run config's ``client-tiers``. ``ValueError``
    naming the key for a bad value."""
    try:
        pid = int(context.node_config["partition-id"])
    except KeyError as exc:
        raise ValueError("node-config needs 'partition-id' (flower-supernode --node-config "
                         "\"partition-id=0 num-partitions=2\")") from exc
    if context.node_config.get("tier") not in (None, ""):
        width, depth = parse_tier_pair(context.node_config["tier"], key="node-config key 'tier'")
        if depth < 1:
            raise ValueError(f"node-config key 'tier': {context.node_config['tier']!r} is a depth tier but the run "
                             "has none (run-config client-tiers with <width>x<depth> entries)")
        return pid, width
    if tiers is not None:
        return pid, tier_of(pid, tuple(parse_tier_value(t, key=f"query config {TIERS_KEY!r}") for t in tiers))
    with config_notes():   # the ServerApp says what the check resolved, once
        cfg = parse_once(context.run_config)
    return pid, tier_of(pid, cfg.tiers)


def node_depth(context: Context, depths: list[float]) -> tuple[int, float]:
    """``(partition id, depth multiplier)`` of this node in a depth-tier run (``node_width_depth`` without the
    width)."""
    pid, _, depth = node_width_depth(context, depths)
    return pid, depth


def node_width_depth(context: Context, depths: list[float],
                     widths: list[float] | None = None) -> tuple[int, float, float]:
    """``(partition id, width multiplier, depth multiplier)`` of this node in a depth-tier run: node-config ``tier``
    (``<width>x<depth>``) when set, else the run's tiers as the strategy sends them (``depths`` and, for width ×
    depth tiers, the aligned ``widths``; all 1 when absent) round-robin. The depth must be one of the run's (the
    global model has an exit classifier at those depths only); the width any multiplier in (0, 1]."""
    pid = int(context.node_config.get("partition-id", -1))
    if pid < 0:
        raise ValueError("node-config needs 'partition-id'")
    run = [float(d) for d in depths]
    ws = [1.0] * len(run) if not widths else [parse_tier_value(w, key=f"query config {TIERS_KEY!r}") for w in widths]
    if len(ws) != len(run):
        raise ValueError(f"query config {TIERS_KEY!r}: {len(ws)} widths for {len(run)} depth tiers")
    if context.node_config.get("tier") in (None, ""):
        return pid, ws[pid % len(run)], run[pid % len(run)]
    width, depth = parse_tier_pair(context.node_config["tier"], key="node-config key 'tier'")
    if depth not in run:
        raise ValueError(f"node-config key 'tier': {context.node_config['tier']!r} must be a depth tier of the run "
                         f"(<width>x<depth> with depth one of {sorted(set(run))})")
    return pid, width, depth


def query(msg: Message, context: Context) -> Message:
    """Reply to a tier query with ``{"partition-id", "tier"}`` (and ``"tier-depth"`` when the query carries the run's
    depth tiers); other queries: ``ValueError``."""
    config = msg.content.config_records.get("config")
    if config is None or config.get("query") != QUERY_KIND:
        raise ValueError(f"fedfuse ClientApp answers only tier queries (config query={QUERY_KIND!r})")
    depths = config.get(DEPTHS_KEY)
    if depths:
        widths = config.get(TIERS_KEY)
        pid, width, depth = node_width_depth(context, list(depths),
                                             list(widths) if widths and len(widths) == len(depths) else None)
        metrics = {"partition-id": pid, "tier": width, "tier-depth": depth}
    else:
        tiers = config.get(TIERS_KEY)
        pid, tier = node_tier(context, list(tiers) if tiers is not None else None)
        metrics = {"partition-id": pid, "tier": tier}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


def depth_tier(model: nn.Module, config, received: dict | None, *, base: nn.Module | None = None, seed: int = 0,
               input_shape: tuple[int, ...] | None = None):
    """A depth-tier node's model and loss: ``model`` (the run's ``MultiExit``, at the node's width) set to the
    ``config[DEPTH_KEY]`` units the strategy sends, ``received`` (its held arrays; ``None`` when the node trains its
    own initialisation) loaded, and DepthFL's loss over its exits (``config[SELF_DISTILL_KEY]``: with mutual
    distillation); with ``config[OWN_EXIT_KEY]`` the node holds only the exit after its depth and its loss is that
    exit's cross-entropy (InclusiveFL, arXiv 2202.08036: one classifier per sub-model). Width × depth tiers with
    ``config[OD_KEY]`` (the run's narrower widths): each batch runs the exits of one nested width of the node's model
    (FjORD's ordered dropout; ``base`` the global ``MultiExit`` the widths are relative to, ``seed`` the draws').
    Returns ``(model, loss_fn, held keys)``, or ``(model, None, None)`` without depth tiers."""
    if DEPTH_KEY not in config:
        return model, None, None
    if not isinstance(model, MultiExit):
        raise ValueError(f"train config {DEPTH_KEY!r}: the run's model has no exit classifiers (run-config "
                         "client-tiers has no depth tier)")
    k = int(config[DEPTH_KEY])
    model.set_active(k)
    own_exit = bool(config.get(OWN_EXIT_KEY, False))
    keys = held_keys(model, k, own_exit=own_exit)
    if received is not None:
        if set(received) != set(keys):
            missing, extra = sorted(set(keys) - set(received)), sorted(set(received) - set(keys))
            raise ValueError(f"train message: a depth-{k} model holds other arrays (missing {missing[:3]}, "
                             f"extra {extra[:3]})")
        model.load_state_dict(received, strict=False)
    self_distill = bool(config.get(SELF_DISTILL_KEY, True))
    exits = _depth_ordered_dropout(model, config, base, seed, input_shape) or model.forward_exits

    def loss_fn(xb, yb):
        if own_exit:   # the cross-entropy of the node's own classifier alone
            return mutual_distillation_loss([model(xb)], yb, self_distill=False)
        return mutual_distillation_loss(exits(xb), yb, self_distill=self_distill)

    return model, loss_fn, keys


def _od_widths(config, widths) -> tuple[float, list[float]]:
    """The node's tier and the narrower widths the strategy asks it to train (``config[OD_KEY]``), checked."""
    r = parse_tier_value(config.get(TIER_KEY, 1.0), key=f"train config {TIER_KEY!r}")
    ps = [parse_tier_value(p, key=f"train config {OD_KEY!r}") for p in widths]
    if any(p >= r for p in ps):
        raise ValueError(f"train config {OD_KEY!r}: {list(ps)} must be narrower than the node's tier {r}")
    return r, ps


def _depth_ordered_dropout(model, config, base, seed: int, input_shape):
    """The ordered-dropout forward over the exits of a width × depth node (``depth_tier``), or ``None``."""
    widths = config.get(OD_KEY)
    if not widths:
        return None
    if base is None:
        raise ValueError(f"train config {OD_KEY!r}: ordered dropout over a depth tier's widths needs the global model")
    r, ps = _od_widths(config, widths)
    ps = sorted(set(ps), reverse=True)
    subs = [base.at_width_mult(p, seed=seed, input_shape=input_shape).set_active(model.active) for p in ps]
    positions = [{f"model.{k}": v for k, v in exit_submodel(model, sub).positions.items()} for sub in subs]
    try:
        weights = draw_weights(config.get(OD_DRAW_KEY, "uniform"), r, ps)
    except ValueError as exc:
        raise ValueError(f"train config {OD_DRAW_KEY!r}: {exc}") from None
    return OrderedDropout(ExitsView(model), [ExitsView(sub) for sub in subs], seed=seed, weights=weights,
                          positions=positions)


def tier_model(model: nn.Module, config, *, seed: int, input_shape: tuple[int, ...]) -> nn.Module:
    """``model`` at the width multiplier of ``config[TIER_KEY]`` (unchanged when the strategy sends none),
    with the width scaler hooks when ``config[SCALER_KEY]``."""
    if TIER_KEY not in config:
        return model
    r = parse_tier_value(config[TIER_KEY], key=f"train config {TIER_KEY!r}")
    if isinstance(model, MultiExit):   # a width x depth tier: the narrow model with the same exits
        return model if r == 1 else model.at_width_mult(r, seed=seed, input_shape=tuple(input_shape))
    out = model if r == 1 else adapter_for(model).at_width_mult(model, r, seed=seed, input_shape=tuple(input_shape))
    if bool(config.get(SCALER_KEY, False)):
        attach_width_scaler(out, r)
    return out


def tier_forward(base: nn.Module, model: nn.Module, config, *, seed: int, input_shape: tuple[int, ...]):
    """The ordered-dropout training forward (``fedfuse.hetero.OrderedDropout``) when the strategy sends
    ``config[OD_KEY]`` (width multipliers of the narrower tiers, relative to the global model ``base``; with
    ``config[OD_DRAW_KEY]`` how widths are drawn: ``fedfuse.hetero.ordered_dropout.draw_weights``); ``None`` otherwise
    (plain ``model(x)``)."""
    widths = config.get(OD_KEY)
    if TIER_KEY not in config or not widths or isinstance(model, MultiExit):   # depth tiers: depth_tier's loss
        return None
    r, ps = _od_widths(config, widths)
    scaler = bool(config.get(SCALER_KEY, False))

    def model_at(p: float) -> nn.Module:
        sub = adapter_for(base).at_width_mult(base, p, seed=seed, input_shape=tuple(input_shape))
        if scaler:
            attach_width_scaler(sub, p)
        return sub

    draw = config.get(OD_DRAW_KEY, "uniform")
    try:
        return ordered_dropout(model, ps, model_at, seed=seed, own=r, draw=draw)
    except ValueError as exc:
        raise ValueError(f"train config {OD_DRAW_KEY!r}: {exc}") from None


__all__ = ["query", "node_tier", "node_depth", "node_width_depth", "depth_tier", "DEPTHS_KEY", "DEPTH_KEY", "SELF_DISTILL_KEY",
           "OWN_EXIT_KEY", "tier_model", "tier_forward", "QUERY_KIND", "TIERS_KEY", "TIER_KEY", "SCALER_KEY", "OD_KEY",
           "OD_DRAW_KEY"]
