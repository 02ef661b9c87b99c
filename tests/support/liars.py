"""TEST-ONLY lying clients for the robust setting's tests: one Flower ClientApp mod per threat.

Nothing in the product imports this. ``Liar(threat, clients).mod`` is a Flower mod (``mod(msg, context,
call_next)``) for ``fedfuse.flower.client_app.make_client_app(mods=[...])``; the clients named (partition ids) lie,
the others run fedfuse's ClientApp untouched, and every liar runs it too before it changes its honest reply.
The threats the product's robust tests answer (the trust benchmark has its own, with more of them):

=================== ======================================================================================
``scale``           the update ×``factor`` (10): ``g + 10 (w − g)``
``sign-flip``       the update negated: ``g − (w − g)``
``random``          every weight tensor replaced by Gaussian noise of the trained tensor's standard deviation
``free-ride``       sends the global model back untrained and claims ``num-examples`` × 100
``lie-head``        the head round: sends the statistics of reversed labels (``cross``'s columns reversed) claiming
                    100 × its samples (every sum × 100), and scores the solved heads 1 and the model before 0
=================== ======================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord

UPDATE_THREATS = ("scale", "sign-flip", "random", "free-ride")
THREATS = (*UPDATE_THREATS, "lie-head")


@dataclass
class Liar:
    """Partition ids ``clients`` carry out ``threat`` in every round (``mod``); ``nodes``: their node ids seen."""

    threat: str
    clients: frozenset[int]
    factor: float = 10.0
    seed: int = 0
    nodes: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.threat not in THREATS:
            raise ValueError(f"unknown threat {self.threat!r}; choose one of {THREATS}")
        self.clients = frozenset(int(c) for c in self.clients)

    def mod(self, msg: Message, context: Context, call_next) -> Message:
        pid = int(context.node_config.get("partition-id", -1))
        if pid not in self.clients:
            return call_next(msg, context)
        self.nodes.add(int(context.node_id))
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        if self.threat == "lie-head":
            lie_in_answer(self.threat, msg.metadata.message_type, reply)
        elif msg.metadata.message_type.split(".")[0] == MessageType.TRAIN:
            self._corrupt(msg, reply, pid)
        return reply

    def _corrupt(self, msg: Message, reply: Message, pid: int) -> None:
        corrupt_update(self.threat, msg, reply, pid, factor=self.factor, seed=self.seed)


def corrupt_update(threat: str, msg: Message, reply: Message, pid: int, *, factor: float = 10.0, seed: int = 0) -> None:
    """Change an honest train reply's weights (in place) the way an update threat says (``scale``, ``sign-flip``,
    ``random``, ``free-ride``, and the trust benchmark's ``free-ride-noise``: the global model plus Gaussian noise of
    1 % of each tensor's std); the free riders claim ``num-examples`` × 100. Shared with
    ``simulations/attacks.py``."""
    content = reply.content
    config = msg.content["config"] if "config" in msg.content else ConfigRecord()
    weight_key = str(config.get("weight-key", "num-examples"))
    arrays_key = next(k for k in content.array_records if k != "importance")
    # each liar draws its own noise (identical random replies would be a colluding attack)
    rng = np.random.default_rng([seed, int(config.get("server-round", 0)), pid])
    sent = msg.content[arrays_key] if arrays_key in msg.content else None
    new = {}
    for k, a in content[arrays_key].items():
        w = a.numpy()
        g = sent[k].numpy() if sent is not None and k in sent else w
        if w.dtype.kind != "f":
            new[k] = w
        elif threat == "scale":
            new[k] = g + factor * (w - g)
        elif threat == "sign-flip":
            new[k] = g - (w - g)
        elif threat == "random":
            new[k] = rng.normal(0.0, float(w.std()) + 1e-3, size=w.shape)
        elif threat == "free-ride":
            new[k] = g
        else:   # free-ride-noise
            new[k] = g + rng.normal(0.0, 0.01 * (float(g.std()) + 1e-3), size=g.shape)
    content[arrays_key] = ArrayRecord({k: Array(np.ascontiguousarray(v, dtype=content[arrays_key][k].numpy().dtype))
                                       for k, v in new.items()})
    if threat in ("free-ride", "free-ride-noise"):
        metrics = dict(content["metrics"])
        metrics[weight_key] = int(metrics[weight_key]) * 100
        content["metrics"] = MetricRecord(metrics)


def lie_in_answer(threat: str, message_type: str, reply: Message) -> None:
    """Change an honest answer to a scoring or head-statistics query (in place): ``lie-head`` scores the solved heads
    1 and the model before 0 and sends the statistics of reversed labels; ``lie-votes`` (the trust benchmark's) scores
    the candidate it scored worst 1 and the others 0; every count × 100. Shared with ``simulations/attacks.py``."""
    content = reply.content
    if message_type == "query.score_candidates":
        metrics = dict(content["metrics"])
        k = sum(1 for key in metrics if key.startswith("accuracy-"))
        accs = [float(metrics[f"accuracy-{i}"]) for i in range(k)]
        worst = min(range(k), key=accs.__getitem__)
        for i in range(k):
            win = (i == worst) if threat == "lie-votes" else (i > 0)   # lie-head: the solved heads over the model
            metrics[f"accuracy-{i}"], metrics[f"loss-{i}"] = (1.0, 0.0) if win else (0.0, 10.0)
        metrics["num-examples"] = int(metrics["num-examples"]) * 100
        content["metrics"] = MetricRecord(metrics)
    elif message_type == "query.head_statistics" and threat == "lie-head":
        stats = {}
        for key, a in content["head-statistics"].items():
            v = a.numpy().astype(np.float64) * 100.0
            stats[key] = v[:, ::-1] if key.startswith("cross") else v   # the labels reversed
        content["head-statistics"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in stats.items()})
        metrics = dict(content["metrics"])
        metrics["num-examples"] = int(metrics["num-examples"]) * 100
        content["metrics"] = MetricRecord(metrics)
