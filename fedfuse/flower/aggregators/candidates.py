"""The wire format of a candidate-scoring query: the server sends a round's candidate global models, every node
answers with each candidate's accuracy on its own data.

``strategy='auto'`` (``fedfuse.flower.aggregators.selection``) chooses each round between aggregations (the average with
server momentum, the plain average, a fusion) by how well they do on the clients' data. The server has no labels;
the union of the clients' data is the federation's distribution, so the sample-weighted accuracy of a candidate over
the nodes estimates its accuracy on that distribution (the federated evaluation of Flower's ``evaluate`` round,
run on several models at once). A node scores on its validation split when it has one, else on its training data
(plain Flower's recipe keeps no hold-out); the candidates are aggregates, not trained on any one node's data.

Query ``message_type``: ``"query.score_candidates"``; content: ``ArrayRecord`` ``"candidate-<i>"`` for ``i < k`` and
``ConfigRecord`` ``"config"`` with ``{"candidates": k}`` (and ``"tier-width-mult"`` when the candidates are a width
tier's models, ``"site"`` when they are scored through one of their classifiers, a depth tier's exit: the head
round, ``fedfuse.flower.head.head_round``). Reply: ``MetricRecord`` ``"metrics"`` with
``num-examples``, ``accuracy-<i>`` and ``loss-<i>`` for every candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfuse.flower.trust.screen import count_limit, paired_median
from fedfuse.flower.tiers.client_tiers import TIER_KEY   # query config: the candidates are this width tier's models
from fedfuse.flower.round.options import WEIGHT_CAP
from fedfuse.privacy import gaussian_accuracy_noise

ACTION = "score_candidates"
MESSAGE_TYPE = f"query.{ACTION}"


SITE_KEY = "site"   # query config: score the candidates through this classifier (fedfuse.progressive.head_sites)


def score_query_content(states: list[dict[str, torch.Tensor]], tier: float | None = None,
                        site: str | None = None) -> RecordDict:
    """The content of a scoring query for the candidate ``states`` (state dicts of the global architecture, or of
    width tier ``tier``'s), scored through their classifier ``site`` when given (a depth tier's exit)."""
    if not states:
        raise ValueError("a scoring query needs at least one candidate")
    records = {f"candidate-{i}": ArrayRecord(s) for i, s in enumerate(states)}
    config = {"candidates": len(states), **({} if tier is None else {TIER_KEY: float(tier)}),
              **({} if site is None else {SITE_KEY: str(site)})}
    return RecordDict({**records, "config": ConfigRecord(config)})


def read_score_tier(msg: Message) -> float | None:
    """The width tier whose models a scoring query holds (``None``: the global architecture)."""
    config = msg.content.config_records.get("config")
    return None if config is None or TIER_KEY not in config else float(config[TIER_KEY])


def read_score_site(msg: Message) -> str | None:
    """The classifier a scoring query scores through (``None``: the model's own output)."""
    config = msg.content.config_records.get("config")
    return None if config is None or SITE_KEY not in config else str(config[SITE_KEY])


def read_score_query(msg: Message) -> list[dict[str, torch.Tensor]]:
    """The candidate state dicts of a scoring query (``ValueError`` when it is malformed)."""
    config = msg.content.config_records.get("config")
    if config is None or "candidates" not in config:
        raise ValueError("scoring query: no 'config' record with 'candidates'")
    k = int(config["candidates"])
    missing = [i for i in range(k) if f"candidate-{i}" not in msg.content.array_records]
    if k < 1 or missing:
        raise ValueError(f"scoring query: {k} candidates announced, arrays missing for {missing}")
    return [msg.content.array_records[f"candidate-{i}"].to_torch_state_dict() for i in range(k)]


def score_reply_content(num_examples: int, accuracies: list[float], losses: list[float]) -> RecordDict:
    """A node's answer: its sample count and each candidate's accuracy and loss on its data."""
    metrics = {"num-examples": int(num_examples)}
    for i, (a, l) in enumerate(zip(accuracies, losses)):
        metrics[f"accuracy-{i}"] = float(a)
        metrics[f"loss-{i}"] = float(l)
    return RecordDict({"metrics": MetricRecord(metrics)})


def read_score_reply(msg: Message, k: int) -> tuple[int, list[float]]:
    """``(num_examples, accuracies)`` of one node's answer; ``ValueError`` saying why when it is malformed."""
    if msg.has_error():
        raise ValueError(f"error reply: {msg.error.reason}")
    rec = msg.content.metric_records.get("metrics")
    if rec is None:
        raise ValueError("no 'metrics' record")
    keys = ["num-examples"] + [f"accuracy-{i}" for i in range(k)]
    missing = [key for key in keys if key not in rec]
    if missing:
        raise ValueError(f"missing {missing}")
    n = int(rec["num-examples"])
    accs = [float(rec[f"accuracy-{i}"]) for i in range(k)]
    if n < 1 or not all(math.isfinite(a) and 0 <= a <= 1 for a in accs):
        raise ValueError(f"num-examples {n} < 1 or an accuracy outside [0, 1]: {accs}")
    return n, accs


@dataclass
class Scores:
    """The nodes' answers to one scoring query, pooled.

    Attributes:
        accuracy / loss: sample-weighted mean per candidate, or with ``robust`` the one-node-one-vote pooling
            (``None`` when no node answered validly).
        clients / examples: the nodes and samples that answered validly.
        rejected: ``(node id, reason)`` of every malformed answer.
        capped: ``(node id, claimed, used)`` of every answer whose sample count was capped.
        error: why the query could not be sent (``None`` when it was).
    """

    accuracy: list[float] | None = None
    loss: list[float] | None = None
    clients: int = 0
    examples: int = 0
    rejected: list[tuple[int, str]] = field(default_factory=list)
    capped: list[tuple[int, int, int]] = field(default_factory=list)
    error: str | None = None


def score_candidates(grid, node_ids: list[int], states: list[dict[str, torch.Tensor]],
                     timeout: float | None = None, tier: float | None = None, site: str | None = None,
                     private: tuple[float, torch.Generator] | None = None, weight_cap: float = WEIGHT_CAP,
                     robust: bool = False) -> Scores:
    """Send one scoring query for ``states`` to ``node_ids`` through ``grid`` and pool the valid answers (the
    sample-weighted accuracy and loss of each candidate on the nodes' own data); malformed answers are rejected with
    their reason, a grid that cannot send is reported in ``error``. Never raises for the nodes' sake. ``tier``:
    the states are that width tier's models; ``site``: score them through that classifier (a depth tier's exit).

    A node's claimed sample count weighs at most ``weight_cap`` × the median of the answers' counts
    (``fedfuse.flower.trust.screen.count_limit``; 0: no cap; ``capped`` lists who was). ``robust`` (the robust
    setting): one node, one vote, every candidate after the first pooled as the first's accuracy plus the median of
    the nodes' paired differences (``screen.paired_median``), losses alike.

    ``private = (noise_multiplier, generator)`` (a DP run's head check): each node counts as one, its vector of
    accuracies (L2 norm at most √candidates) is summed with Gaussian noise of std ``noise_multiplier · √candidates``
    (``fedfuse.privacy.gaussian_accuracy_noise``) and divided by the number of nodes; losses are not released
    (``nan``) and ``examples`` is the number of nodes."""
    content = score_query_content(states, tier, site)
    msgs = [Message(content=content, dst_node_id=n, message_type=MESSAGE_TYPE) for n in node_ids]
    try:
        replies = list(grid.send_and_receive(msgs, timeout=timeout))
    except Exception as exc:  # noqa: BLE001 - the caller goes on without scores, loudly
        return Scores(error=f"{type(exc).__name__}: {exc}")
    out = Scores()
    nodes, counts, accs, losses = [], [], [], []
    for reply in replies:
        try:
            n, a = read_score_reply(reply, len(states))
        except ValueError as exc:
            out.rejected.append((int(reply.metadata.src_node_id), str(exc)))
            continue
        metrics = reply.content.metric_records["metrics"]
        if private is not None:   # each node weighs one, its accuracies clamped to [0, 1]
            n, a = 1, [min(max(float(v), 0.0), 1.0) for v in a]
        nodes.append(int(reply.metadata.src_node_id))
        counts.append(n)
        accs.append(a)
        losses.append([float(metrics.get(f"loss-{i}", float("nan"))) for i in range(len(states))])
    if not counts:
        return out
    limit = None if private is not None else count_limit(counts, weight_cap)
    if limit is not None and max(counts) > limit:
        out.capped = [(node, n, max(1, int(limit))) for node, n in zip(nodes, counts) if n > limit]
        counts = [min(n, max(1, int(limit))) for n in counts]
    out.clients, out.examples = len(counts), sum(counts)
    if private is not None:
        std = gaussian_accuracy_noise(private[0], len(states))
        noise = torch.randn(len(states), dtype=torch.float64, generator=private[1]) * std
        out.accuracy = [(sum(a[i] for a in accs) + float(e)) / out.clients for i, e in enumerate(noise)]
        out.loss = [float("nan")] * len(states)
    elif robust:
        out.accuracy, out.loss = paired_median(accs), paired_median(losses)
    else:
        out.accuracy = [sum(n * a[i] for n, a in zip(counts, accs)) / out.examples for i in range(len(states))]
        out.loss = [sum(n * v[i] for n, v in zip(counts, losses)) / out.examples for i in range(len(states))]
    return out


__all__ = ["ACTION", "MESSAGE_TYPE", "score_query_content", "read_score_query", "read_score_tier", "read_score_site",
           "score_reply_content", "read_score_reply", "score_candidates", "Scores"]
