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
            _lie_head(msg.metadata.message_type, reply)
        elif msg.metadata.message_type.split(".")[0] == MessageType.TRAIN:
            self._corrupt(msg, reply, pid)
        return reply

    def _corrupt(self, msg: Message, reply: Message, pid: int) -> None:
        """Change an honest train reply (in place) the way the threat says."""
        content = reply.content
        config = msg.content["config"] if "config" in msg.content else ConfigRecord()
        weight_key = str(config.get("weight-key", "num-examples"))
        arrays_key = next(k for k in content.array_records if k != "importance")
        # each liar draws its own noise (identical random replies would be a colluding attack)
        rng = np.random.default_rng([self.seed, int(config.get("server-round", 0)), pid])
        sent = msg.content[arrays_key] if arrays_key in msg.content else None
        new = {}
        for k, a in content[arrays_key].items():
            w = a.numpy()
            g = sent[k].numpy() if sent is not None and k in sent else w
            if w.dtype.kind != "f":
                new[k] = w
            elif self.threat == "scale":
                new[k] = g + self.factor * (w - g)
            elif self.threat == "sign-flip":
                new[k] = g - (w - g)
            elif self.threat == "random":
                new[k] = rng.normal(0.0, float(w.std()) + 1e-3, size=w.shape)
            else:   # free-ride
                new[k] = g
        content[arrays_key] = ArrayRecord({k: Array(np.ascontiguousarray(v, dtype=content[arrays_key][k].numpy().dtype))
                                           for k, v in new.items()})
        if self.threat == "free-ride":
            metrics = dict(content["metrics"])
            metrics[weight_key] = int(metrics[weight_key]) * 100
            content["metrics"] = MetricRecord(metrics)


def _lie_head(message_type: str, reply: Message) -> None:
    """Change an honest answer to the head round's queries (in place): the solved heads scored 1 and the model
    before them 0; the statistics of reversed labels; every count × 100."""
    content = reply.content
    if message_type == "query.score_candidates":
        metrics = dict(content["metrics"])
        k = sum(1 for key in metrics if key.startswith("accuracy-"))
        for i in range(k):
            metrics[f"accuracy-{i}"], metrics[f"loss-{i}"] = (1.0, 0.0) if i > 0 else (0.0, 10.0)
        metrics["num-examples"] = int(metrics["num-examples"]) * 100
        content["metrics"] = MetricRecord(metrics)
    elif message_type == "query.head_statistics":
        stats = {}
        for key, a in content["head-statistics"].items():
            v = a.numpy().astype(np.float64) * 100.0
            stats[key] = v[:, ::-1] if key.startswith("cross") else v   # the labels reversed
        content["head-statistics"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in stats.items()})
        metrics = dict(content["metrics"])
        metrics["num-examples"] = int(metrics["num-examples"]) * 100
        content["metrics"] = MetricRecord(metrics)
