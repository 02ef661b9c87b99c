"""The trust benchmark's threats (``simulations.attacks``, issues 25 and 45): the reply threats change an honest
train reply as documented, the data threats poison labels and stamp the backdoor trigger, the query threats change
honest answers to the server's queries, and the oracle (``absent``) leaves a run of the others. The robust setting
that answers them is the product's (tests/test_trust.py, tests/test_answer_screen.py)."""

from __future__ import annotations

import json
from unittest.mock import Mock

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfuse.flower.client_app import make_client_app
from fedfuse.flower.head.head_messages import head_reply_content
from fedfuse.models import build_model, levels
from simulations.attacks import BACKDOOR_CLASS, Attack, lie_in_answer, poisoned_data, stamp
from tests.support.trust_cases import TINY, federation_stats as _federation, strategy_history as _history

SHAPE = (1, 8, 8)
C = 10


def _mlp(seed: int = 0) -> torch.nn.Module:
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=32, depth=1, seed=seed).eval()


def _moved(model: torch.nn.Module, scale: float, seed: int) -> dict[str, torch.Tensor]:
    """An honest client's model: a shared descent direction (seed 1234) plus its own part (``seed``)."""
    common, own = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(seed)
    return {k: v + scale * (torch.randn(v.shape, generator=common) + torch.randn(v.shape, generator=own))
            for k, v in model.state_dict().items()}


def _train_pair(pid: int = 0):
    g = _mlp()
    trained = _moved(g, 0.05, 1)
    sent = Message(RecordDict({"arrays": ArrayRecord({k: Array(v.numpy()) for k, v in g.state_dict().items()}),
                               "config": ConfigRecord({"server-round": 1, "weight-key": "num-examples"})}),
                   dst_node_id=1, message_type="train")
    scores = {lv.name: np.ones(lv.width, dtype=np.float32) for lv in levels(g)}
    reply_content = RecordDict({"arrays": ArrayRecord({k: Array(v.numpy()) for k, v in trained.items()}),
                                "metrics": MetricRecord({"num-examples": 50, "partition-id": pid}),
                                "importance": ArrayRecord({k: Array(v) for k, v in scores.items()})})
    return g, trained, sent, reply_content


@pytest.mark.parametrize("threat", ["scale", "sign-flip", "free-ride", "inflate-scores", "random"])
def test_reply_threats_change_the_honest_reply_as_documented(threat):
    from fedfuse.flower.runner.inprocess import task_identity

    with task_identity(1, 1, 1):
        g, trained, sent, content = _train_pair()
        reply = Message(content, reply_to=sent)
    Attack(threat, frozenset({0})).corrupt(sent, reply)
    got = {k: torch.from_numpy(a.numpy()) for k, a in reply.content["arrays"].items()}
    gs = g.state_dict()
    k = "1.weight"
    if threat == "scale":
        torch.testing.assert_close(got[k], gs[k] + 10 * (trained[k] - gs[k]))
    elif threat == "sign-flip":
        torch.testing.assert_close(got[k], gs[k] - (trained[k] - gs[k]))
    elif threat == "free-ride":
        torch.testing.assert_close(got[k], gs[k])
        assert reply.content["metrics"]["num-examples"] == 5000
    elif threat == "inflate-scores":
        assert all(float(a.numpy().min()) == 1000.0 for a in reply.content["importance"].values())
    else:
        assert not torch.allclose(got[k], trained[k]) and got[k].shape == trained[k].shape


def test_data_threats_poison_labels_and_stamp_a_trigger():
    x = np.random.default_rng(0).normal(size=(40, 40)).astype(np.float32)
    y = np.arange(40) % 10
    _, flipped = poisoned_data("label-flip", x, y, 10)
    assert (flipped == 9 - y).all()
    bx, by = poisoned_data("backdoor", x, y, 10)
    assert len(bx) == 44 and (by[40:] == BACKDOOR_CLASS).all() and np.allclose(bx[40:], stamp(bx[40:]))
    with pytest.raises(ValueError, match="unknown threat"):
        Attack("bribe", frozenset({0}))


# ------------------------------------------------------------------------------------------- the query threats
@pytest.fixture
def identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):   # Message() needs a run identity
        monkeypatch.setattr(TaskIdentity, attr, value)


def test_the_query_threats_change_honest_answers_as_documented(identity):
    scores = RecordDict({"metrics": MetricRecord({"num-examples": 20, "accuracy-0": 0.7, "accuracy-1": 0.4,
                                                  "accuracy-2": 0.9, "loss-0": 1.0, "loss-1": 2.0, "loss-2": 0.5})})
    reply = Mock(content=scores)
    lie_in_answer("lie-votes", "query.score_candidates", reply)
    m = reply.content["metrics"]
    assert [m[f"accuracy-{i}"] for i in range(3)] == [0.0, 1.0, 0.0] and m["num-examples"] == 2000
    s = _federation(0, clients=1)[0]
    reply = Mock(content=head_reply_content(s))
    lie_in_answer("lie-head", "query.head_statistics", reply)
    state = reply.content["head-statistics"].to_torch_state_dict()
    assert torch.allclose(state["cross"].double(), 100 * s.cross.flip(1))
    assert torch.allclose(state["gram-upper"].double(), 100 * s.pack())
    assert reply.content["metrics"]["num-examples"] == 100 * s.num_examples


# ------------------------------------------------------------------------------------------- the oracle
def test_absent_clients_leave_a_run_of_the_others(tmp_path):
    """The trust bench's oracle (``absent``): the named clients answer every message with an error, so every round
    aggregates exactly the others (the quorum set to them), and the run still trains."""
    from fedfuse.flower.runner.inprocess import run_inprocess

    out = run_inprocess({**TINY, "num-clients": 6, "min-train-nodes": 4, "strategy": "fedavg",
                         "output-dir": str(tmp_path), "run-name": "r"},
                        echo=False, client_app=make_client_app(mods=[Attack("absent", frozenset({1, 4})).mod]))
    history = _history(out)
    assert len(history) == 2
    for h in history:
        assert h["replies"] == 6 and len(h["failures"]) == 2, h
        assert all("absent" in f["reason"] for f in h["failures"])
    assert json.loads((out / "results.json").read_text())["rounds"][-1]["test-accuracy"] > 0.5
