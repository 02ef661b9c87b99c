"""Lying clients for the trust benchmark and its tests: one Flower ClientApp mod per threat (issue 25).

Nothing in the product imports this. ``Attack(threat, clients).mod`` is a Flower mod
(``mod(msg, context, call_next)``) for ``fedfuse.flower.client_app.make_client_app(mods=[...])``; the clients named
(partition ids) lie, the others run fedfuse's ClientApp untouched. The ClientApp itself is always the real one: a
poisoned-data client trains on its poisoned file through the node-config ``data-path`` that a deployed SuperNode
uses for its private data; a poisoned-model client changes its honest reply after training.

Threats (``THREATS``):

=================== ======================================================================================
``scale``           the update ×``factor`` (10): ``g + 10 (w − g)`` (model replacement, Bagdasaryan et al.,
                    "How To Backdoor Federated Learning", arXiv 1807.00459)
``sign-flip``       the update negated: ``g − (w − g)``
``random``          every weight tensor replaced by Gaussian noise of the trained tensor's standard deviation
``label-flip``      trains on labels ``C − 1 − y`` (data poisoning)
``backdoor``        trains on its data plus 10 % of it with ``TRIGGER`` stamped on and relabelled
                    ``BACKDOOR_CLASS`` (a targeted backdoor; ``stamp`` puts the trigger on test inputs)
``free-ride``       sends the global model back untrained and claims ``num-examples`` × 100
``free-ride-noise`` the global model plus Gaussian noise (1 % of each tensor's std), ``num-examples`` × 100
``inflate-scores``  its importance scores × 1000
``concentrate``     all of its importance mass on one unit per level (× 1000)
``lie-counts``      class counts claiming 100 × its samples, all of one class (``head_weights``/calibration)
``lie-votes``       answers every scoring query (``auto``'s vote, the head round's check) with accuracy 1 for the
                    candidate it scored worst and 0 for the others (losses alike), claiming ``num-examples`` × 100
``lie-head``        the head round: sends the statistics of reversed labels (``cross``'s columns reversed) claiming
                    100 × its samples (every sum × 100), and scores the solved heads 1 and the model before 0
``absent``          not an attack: the client answers every message with an error, so the run is the honest
                    clients' alone (the oracle screen that drops exactly the liars, and nothing else)
=================== ======================================================================================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Error, Message, MessageType, MetricRecord

from tests.support.liars import corrupt_update, lie_in_answer  # the shared reply corruptions (one implementation)

UPDATE_THREATS = ("scale", "sign-flip", "random", "free-ride", "free-ride-noise")   # tests.support.liars.corrupt_update
THREATS = ("scale", "sign-flip", "random", "label-flip", "backdoor", "free-ride", "free-ride-noise",
           "inflate-scores", "concentrate", "lie-counts", "lie-votes", "lie-head", "absent")
QUERY_THREATS = ("lie-votes", "lie-head")   # threats on the answers to the server's queries, not on train replies
DATA_THREATS = ("label-flip", "backdoor")
TRIGGER = {0: 4.0, 1: -4.0, 2: 4.0, 3: -4.0}   # feature index -> value (MNIST-1D's features lie in about ±4.5)
BACKDOOR_CLASS = 0
BACKDOOR_SHARE = 0.1


def stamp(x: np.ndarray) -> np.ndarray:
    """``x`` ``[N, *shape]`` with the backdoor trigger written into its first flattened features (a copy)."""
    out = np.array(x, dtype=np.float32, copy=True).reshape(len(x), -1)
    for i, v in TRIGGER.items():
        out[:, i] = v
    return out.reshape(np.shape(x))


def poisoned_data(threat: str, x: np.ndarray, y: np.ndarray, num_classes: int, seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The training data a ``label-flip`` or ``backdoor`` client trains on instead of ``(x, y)``."""
    if threat == "label-flip":
        return x, (num_classes - 1 - np.asarray(y)).astype(np.int64)
    if threat == "backdoor":
        rng = np.random.default_rng(seed)
        pick = rng.choice(len(x), size=max(1, int(round(BACKDOOR_SHARE * len(x)))), replace=False)
        return (np.concatenate([x, stamp(x[pick])]).astype(np.float32),
                np.concatenate([y, np.full(len(pick), BACKDOOR_CLASS)]).astype(np.int64))
    raise ValueError(f"poisoned_data: {threat!r} is not a data threat ({DATA_THREATS})")


@dataclass
class Attack:
    """Partition ids ``clients`` carry out ``threat`` in every train round (``mod``); ``workdir`` holds the poisoned
    data files of the data threats."""

    threat: str
    clients: frozenset[int]
    workdir: Path = Path("/tmp/fedfuse-attacks")
    factor: float = 10.0
    seed: int = 0
    _files: dict[int, Path] = field(default_factory=dict, repr=False)
    nodes: set[int] = field(default_factory=set, repr=False)   # the liars' node ids seen (in-process engine)

    def __post_init__(self) -> None:
        if self.threat not in THREATS:
            raise ValueError(f"unknown threat {self.threat!r}; choose one of {THREATS}")
        self.clients = frozenset(int(c) for c in self.clients)

    # ------------------------------------------------------------------ the mod
    def mod(self, msg: Message, context: Context, call_next) -> Message:
        pid = int(context.node_config.get("partition-id", -1))
        if pid not in self.clients:
            return call_next(msg, context)
        self.nodes.add(int(context.node_id))
        if self.threat == "absent":
            return Message(Error(code=0, reason="absent: this client takes no part"), reply_to=msg)
        if self.threat in DATA_THREATS:   # its own (poisoned) data for every message, as a deployed node has
            context = dataclasses.replace(context, node_config={**context.node_config,
                                                                "data-path": str(self._data_file(pid, context))})
        reply = call_next(msg, context)
        if self.threat in QUERY_THREATS and not reply.has_error():
            lie_in_answer(self.threat, msg.metadata.message_type, reply)
        if msg.metadata.message_type.split(".")[0] == MessageType.TRAIN and not reply.has_error() \
                and self.threat not in DATA_THREATS:
            self.corrupt(msg, reply, pid)
        return reply

    def _data_file(self, pid: int, context: Context) -> Path:
        if pid not in self._files:
            pattern = str(context.run_config.get("data-options.partition-files", ""))
            if "{partition-id}" not in pattern:
                raise ValueError("Attack: the data threats read the client's file from run-config "
                                 "'data-options.partition-files'")
            from fedfuse.config import dataset_info

            d = np.load(pattern.replace("{partition-id}", str(pid)))
            info = dataset_info(str(context.run_config["dataset"]))
            x, y = poisoned_data(self.threat, d["x_train"], d["y_train"], info.num_classes,
                                 seed=self.seed * 1009 + pid)
            self.workdir.mkdir(parents=True, exist_ok=True)
            path = self.workdir / f"{self.threat}-s{self.seed}-node-{pid}.npz"
            np.savez(path, x_train=x, y_train=y)
            self._files[pid] = path
        return self._files[pid]

    # ------------------------------------------------------------------ the reply
    def corrupt(self, msg: Message, reply: Message, pid: int = 0) -> None:
        """Change an honest train reply (in place) the way the threat says."""
        if self.threat in UPDATE_THREATS:
            corrupt_update(self.threat, msg, reply, pid, factor=self.factor, seed=self.seed)
        content = reply.content
        if self.threat in ("inflate-scores", "concentrate") and "importance" in content:
            scores = {}
            for k, a in content["importance"].items():
                s = a.numpy().astype(np.float32)
                if self.threat == "inflate-scores":
                    s = s * 1000.0
                else:
                    top = np.zeros_like(s)
                    top[int(np.argmax(s))] = float(s.sum()) * 1000.0
                    s = top
                scores[k] = s
            content["importance"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in scores.items()})
        if self.threat == "lie-counts" and "class-counts" in dict(content["metrics"]):
            metrics = dict(content["metrics"])
            counts = list(metrics["class-counts"])
            metrics["class-counts"] = [sum(counts) * 100 if c == 0 else 0 for c in range(len(counts))]
            content["metrics"] = MetricRecord(metrics)
