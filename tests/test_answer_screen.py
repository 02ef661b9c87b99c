"""Issue 45: the clients' answers to the server's queries (the head round's statistics, the candidate scores of
``auto``'s vote and of the head round's check) bounded always and screened by the robust setting
(``fedfuse.flower.trust.screen``), against lying clients (``tests/support/liars.py``)."""

from __future__ import annotations

import json
from unittest.mock import Mock

import pytest
import torch
from flwr.app import Message, MetricRecord, RecordDict

from fedfuse.flower.trust.screen import (CLASS_MEAN_THRESHOLD, cap_statistics, check_statistics,
                                          class_mean_outliers, class_mean_scores, count_limit, paired_median)
from fedfuse.flower.aggregators.candidates import score_candidates
from fedfuse.flower.client_app import make_client_app
from fedfuse.progressive import HeadStatistics, head_statistics
from fedfuse.models import build_model
from tests.support.liars import Liar
from tests.support.trust_cases import C, federation_stats as _federation


def test_honest_statistics_obey_the_identities_and_made_up_ones_are_rejected():
    model = build_model("mlp", num_classes=C, input_shape=(1, 8, 8), width=32, depth=1, seed=0).eval()
    x, y = torch.randn(50, 1, 8, 8), torch.randint(0, C, (50,))
    honest = head_statistics(model, x, y, C)
    check_statistics(honest)
    neg = honest.cross.clone()
    neg[-1, 0], neg[-1, 1] = -1.0, neg[-1, 1] + 1 + neg[-1, 0]   # counts still sum to n, one negative
    with pytest.raises(ValueError, match="class counts"):
        check_statistics(HeadStatistics(honest.gram, neg, 50))
    moved = honest.cross.clone()
    moved[0, 0] += 5.0   # a feature sum that is not the Gram matrix's
    with pytest.raises(ValueError, match="sum to the Gram matrix's last column"):
        check_statistics(HeadStatistics(honest.gram, moved, 50))
    g = torch.randn(33, 33, dtype=torch.float64)
    g = g @ g.T
    g[-1, -1] = 50.0
    with pytest.raises(ValueError, match="head statistics"):
        check_statistics(HeadStatistics(g, torch.rand(33, C, dtype=torch.float64), 50))


def test_a_claimed_count_weighs_at_most_the_cap_and_the_sums_scale_with_it():
    stats = [{"": s} for s in _federation(0, clients=5)]
    big = stats[0][""]
    stats[0] = {"": HeadStatistics(big.gram * 100, big.cross * 100, big.num_examples * 100)}
    record: dict = {}
    out = cap_statistics(stats, [11, 12, 13, 14, 15], 10.0, record)
    limit = count_limit([s[""].num_examples for s in stats], 10.0)
    assert record["capped"] == [{"node": 11, "claimed": big.num_examples * 100, "used": int(limit)}]
    s = out[0][""]
    assert s.num_examples == int(limit) and float(s.gram[-1, -1]) == pytest.approx(int(limit))
    check_statistics(s)
    assert torch.allclose(s.cross[:-1] / s.cross[-1].clamp_min(1), big.cross[:-1] / big.cross[-1].clamp_min(1))
    assert out[1:] == stats[1:]
    assert cap_statistics(stats[:2], [1, 2], 10.0, {}) == stats[:2]   # two replies: no median to trust


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_class_means_single_out_reversed_labels_among_non_iid_clients(seed):
    assert class_mean_outliers(_federation(0, seed)) == {}
    far = class_mean_outliers(_federation(3, seed))
    assert set(far) == {7, 8, 9} and min(far.values()) > CLASS_MEAN_THRESHOLD
    assert class_mean_scores(_federation(3, seed)[:2]) == [None, None]


def test_paired_median_keeps_the_honest_choice_whatever_three_liars_report():
    honest = [[0.5 + 0.05 * i, 0.52 + 0.05 * i, 0.60 + 0.05 * i] for i in range(7)]   # candidate 2 best everywhere
    liars = [[1.0, 1.0, 0.0]] * 3
    pooled = paired_median(honest + liars)
    assert max(range(3), key=pooled.__getitem__) == 2
    assert pooled[2] - pooled[0] == pytest.approx(0.10)


class _Grid:
    """Answers a scoring query with fixed ``(count, accuracies)`` per node."""

    def __init__(self, answers: dict[int, tuple[int, list[float]]]):
        self.answers = answers

    def send_and_receive(self, msgs, timeout=None):
        out = []
        for m in msgs:
            n, accs = self.answers[m.metadata.dst_node_id]
            reply = Mock(spec=Message)
            reply.metadata = Mock(src_node_id=m.metadata.dst_node_id)
            reply.has_error.return_value = False
            reply.content = RecordDict({"metrics": MetricRecord({"num-examples": n, **{
                f"accuracy-{i}": a for i, a in enumerate(accs)}, **{f"loss-{i}": 1 - a for i, a in enumerate(accs)}})})
            out.append(reply)
        return out


@pytest.fixture
def identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):   # Message() needs a run identity
        monkeypatch.setattr(TaskIdentity, attr, value)


def test_the_vote_caps_claimed_counts_and_the_robust_vote_is_one_node_one_vote(identity):
    states = [{"w": torch.zeros(2)}, {"w": torch.ones(2)}]
    answers = {n: (100, [0.6, 0.7]) for n in range(1, 8)}
    answers.update({n: (100 * 100, [1.0, 0.0]) for n in (8, 9, 10)})   # three liars claiming 100x their samples
    grid = _Grid(answers)
    plain = score_candidates(grid, list(answers), states)
    assert sorted(n for n, _, _ in plain.capped) == [8, 9, 10] and {u for _, _, u in plain.capped} == {1000}
    assert plain.examples == 7 * 100 + 3 * 1000
    assert plain.accuracy[0] > plain.accuracy[1]   # capped, three liars at 10x the median still carry the mean
    robust = score_candidates(grid, list(answers), states, robust=True)
    assert robust.accuracy[1] - robust.accuracy[0] == pytest.approx(0.1)
    uncapped = score_candidates(grid, list(answers), states, weight_cap=0)
    assert not uncapped.capped and uncapped.examples == 7 * 100 + 3 * 10000


@pytest.mark.slow
def test_lying_head_answers_poison_the_default_head_round_and_not_the_robust_one(tmp_path):
    """Three of ten clients send reversed-label statistics claiming 100x their samples and vote for the solved head:
    the plain head round keeps a poisoned head; the robust one drops their statistics, votes one node one vote."""
    from fedfuse.flower.runner.inprocess import run_inprocess

    cfg = {"dataset": "digits", "model": "mlp", "model-width": 64, "model-depth": 1, "num-clients": 10,
           "partitioning": "dirichlet", "dirichlet-alpha": 1.0, "num-server-rounds": 4, "local-epochs": 2,
           "lr": 0.05, "fusion-set-size": 150, "min-train-nodes": 10, "strategy": "fedavg", "head-round": True}
    finals, heads = {}, {}
    for robust in (False, True):
        attack = Liar("lie-head", frozenset({2, 5, 7}))
        out = run_inprocess({**cfg, "robust": robust, "output-dir": str(tmp_path), "run-name": f"r{robust}"},
                            echo=False, client_app=make_client_app(mods=[attack.mod]))
        res = json.loads((out / "results.json").read_text())
        finals[robust] = [r["test-accuracy"] for r in res["rounds"]]
        heads[robust] = next(h["fusion-info"]["head-round"] for h in res["strategy-history"]
                             if h.get("post-step") == "head-round")
        heads[robust]["liars"] = attack.nodes
    assert len(heads[False]["capped"]) == 3 and heads[False]["kept"] == "head"
    assert finals[False][-1] < finals[False][-2] - 0.2   # the poisoned head, kept by the liars' votes
    dropped = {r["node"] for r in heads[True]["rejected"] if "class means" in r["reason"]}
    assert dropped == heads[True]["liars"]
    assert finals[True][-1] >= finals[True][-2] - 0.02
