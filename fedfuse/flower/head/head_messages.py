"""The head round's messages (``fedfuse.flower.head.head_round``): the server's query and the nodes' replies.

Query ``message_type``: ``"query.head_statistics"``; content: ``ArrayRecord`` ``"model"`` (the global model's state
dict; width tiers: one ``"model@<tier>"`` more per narrower tier, their widths in the config's ``"tiers"``, and where a
tier's model has other classifiers to solve than its own (width × depth tiers: the exits its nodes use) their names in
the config's ``"sites@<tier>"``; DP: the config's ``"dp-clip"`` and the ``ArrayRecord`` ``"dp-projection"``). Reply: ``ArrayRecord`` ``"head-statistics"``
with ``gram-upper`` / ``cross`` per classifier site and ``MetricRecord`` ``"metrics"`` with ``num-examples``.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfuse.hetero import tier_name
from fedfuse.progressive import HeadStatistics

ACTION = "head_statistics"
MESSAGE_TYPE = f"query.{ACTION}"


TIERS = "tiers"   # query config: the narrower tiers' width multipliers (one "model@<tier>" record each)


def tier_site(r: float, site: str = "") -> str:
    """The reply's site name of width tier ``r``'s classifier (``gram-upper@tier-<tier>``), or of its classifier
    ``site`` of ``fedfuse.progressive.head_sites`` (a width × depth tier's exit: ``gram-upper@tier-<tier>/<site>``)."""
    return f"tier-{tier_name(r)}" + (f"/{site}" if site else "")


def _tier_sites_key(r: float) -> str:
    return f"sites@{tier_name(r)}"


DP_CLIP = "dp-clip"   # query config: the private head round's feature clip bound (fedfuse.privacy)
DP_PROJECTION = "dp-projection"   # query array record: the private head round's public projection [d, k]


def head_query_content(state: dict[str, torch.Tensor], sites: tuple[str, ...] | None = None,
                       tier_states: dict[float, dict[str, torch.Tensor]] | None = None,
                       dp_clip: float | None = None, dp_projection: torch.Tensor | None = None,
                       tier_sites: dict[float, tuple[str, ...]] | None = None) -> RecordDict:
    """The query: the fused model whose features the nodes summarise, which of its classifiers (``sites`` of
    ``head_sites``; ``None``: every one), with width tiers every narrower tier's model (``tier_states``) and which of
    its classifiers (``tier_sites``; a tier not named there: its own, ``""``), and in a DP run the feature clip bound
    of the private statistics (``dp_clip``)."""
    content = RecordDict({"model": ArrayRecord(state)})
    config: dict[str, Any] = {}
    if dp_clip is not None:
        config[DP_CLIP] = float(dp_clip)
    if dp_projection is not None:
        content[DP_PROJECTION] = ArrayRecord({"projection": dp_projection.float().contiguous()})
    if sites is not None:
        config["sites"] = list(sites)
    for r, s in (tier_states or {}).items():
        content[f"model@{tier_name(r)}"] = ArrayRecord(s)
    if tier_states:
        config[TIERS] = [float(r) for r in tier_states]
    for r, names in (tier_sites or {}).items():
        if r not in (tier_states or {}):
            raise ValueError(f"head-statistics query: classifiers named for tier {r}, which the query does not carry")
        config[_tier_sites_key(r)] = [str(n) for n in names]
    if config:
        content["config"] = ConfigRecord(config)
    return content


def read_head_query(msg: Message) -> dict[str, torch.Tensor]:
    if "model" not in msg.content.array_records:
        raise ValueError("head-statistics query: no 'model' array record")
    return msg.content.array_records["model"].to_torch_state_dict()


def read_head_tiers(msg: Message) -> dict[float, dict[str, torch.Tensor]]:
    """The narrower tiers' models of a width-tier query (``{}`` without tiers); ``ValueError`` when one is missing."""
    config = msg.content.config_records.get("config")
    if config is None or TIERS not in config:
        return {}
    out = {}
    for r in config[TIERS]:
        key = f"model@{tier_name(float(r))}"
        if key not in msg.content.array_records:
            raise ValueError(f"head-statistics query: tier {r} announced, no {key!r} array record")
        out[float(r)] = msg.content.array_records[key].to_torch_state_dict()
    return out


def read_head_tier_sites(msg: Message) -> dict[float, list[str]]:
    """The classifiers asked of each narrower tier's model (``{tier: names}``; ``[""]``, its own, where the query
    names none)."""
    config = msg.content.config_records.get("config")
    tiers = [] if config is None or TIERS not in config else [float(r) for r in config[TIERS]]
    return {r: [str(n) for n in config[_tier_sites_key(r)]] if _tier_sites_key(r) in config else [""] for r in tiers}


def read_head_dp_clip(msg: Message) -> tuple[float | None, torch.Tensor | None]:
    """The private head round's ``(clip bound, projection)`` (``(None, None)``: the statistics are not
    privatised)."""
    config = msg.content.config_records.get("config")
    clip = None if config is None or DP_CLIP not in config else float(config[DP_CLIP])
    record = msg.content.array_records.get(DP_PROJECTION)
    projection = None if record is None else record.to_torch_state_dict()["projection"].double()
    return clip, projection


def read_head_sites(msg: Message) -> list[str] | None:
    """The classifiers the query asks statistics for (``None``: every one the model has)."""
    config = msg.content.config_records.get("config")
    return None if config is None or "sites" not in config else [str(s) for s in config["sites"]]


def _keys(site: str) -> tuple[str, str]:
    """The reply's array names of classifier ``site``: ``gram-upper`` / ``cross`` for the model's own (``""``),
    ``gram-upper@<site>`` / ``cross@<site>`` for the others (a depth tier's exits)."""
    return ("gram-upper", "cross") if site == "" else (f"gram-upper@{site}", f"cross@{site}")


def head_reply_content(stats: HeadStatistics | dict[str, HeadStatistics]) -> RecordDict:
    """A node's answer (the packed statistics, half the Gram matrix), one pair of arrays per classifier."""
    per_site = stats if isinstance(stats, dict) else {"": stats}
    arrays = {}
    for site, s in per_site.items():
        g, c = _keys(site)
        arrays.update({g: s.pack(), c: s.cross})
    n = int(next(iter(per_site.values())).num_examples)   # every classifier summarises the same samples
    return RecordDict({"head-statistics": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": n})})


def read_head_reply(msg: Message, features: int | dict[str, int],
                    num_classes: int) -> HeadStatistics | dict[str, HeadStatistics]:
    """The statistics of one node's answer; ``ValueError`` saying why when it is malformed or does not fit a model
    with ``features`` pre-logit features (a dict: the feature width of each classifier of ``head_sites``, then a
    dict of statistics back) and ``num_classes`` classes."""
    if msg.has_error():
        raise ValueError(f"error reply: {msg.error.reason}")
    arrays = msg.content.array_records.get("head-statistics")
    metrics = msg.content.metric_records.get("metrics")
    if arrays is None or metrics is None or "num-examples" not in metrics:
        raise ValueError("no 'head-statistics' arrays or no 'metrics' record with 'num-examples'")
    state = arrays.to_torch_state_dict()
    widths = features if isinstance(features, dict) else {"": features}
    want = {k for site in widths for k in _keys(site)}
    if set(state) != want:
        raise ValueError(f"'head-statistics' must hold {sorted(want)}, holds {sorted(state)}")
    out = {}
    for site, d in widths.items():
        g, c = _keys(site)
        if tuple(state[c].shape) != (d + 1, num_classes):
            raise ValueError(f"{c} has shape {tuple(state[c].shape)}, expected {(d + 1, num_classes)}")
        out[site] = HeadStatistics.unpack(state[g], state[c], int(metrics["num-examples"]))
    return out if isinstance(features, dict) else out[""]


__all__ = ["ACTION", "MESSAGE_TYPE", "TIERS", "DP_CLIP", "DP_PROJECTION", "tier_site", "head_query_content",
           "read_head_query", "read_head_tiers", "read_head_tier_sites", "read_head_dp_clip", "read_head_sites", "head_reply_content",
           "read_head_reply"]
