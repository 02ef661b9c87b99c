"""Issue 60 item 1: one client sending finite weights × 1e20 no longer stops the federation. The divergence screen
(``fedfuse.flower.round.divergence``) rejects, before any aggregation and by default, a reply whose weights are
outsized against the round's other replies or whose own model outputs non-finite values on the probe inputs; the
round aggregates the others, the rejection names the partition (console line, ``results.json``, ``rounds.csv``), and
the clients' ensemble and per-client columns leave the rejected reply out.

Before (65c8ee6 .. 35b9bec): the broadcast guard named the reply but threw the whole round away, every round fell
back and the run failed "fusion never succeeded", its ensemble column at chance."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from fedfuse.flower import build_strategy
from fedfuse.flower.round.divergence import OUTSIZED, outsized_replies, record_norm
from fedfuse.flower.round.replies import ClientsDivergedError
from tests.test_strategies import SHAPE, model_fn, reply, state_of

torch.set_num_threads(1)


def _scale(factor):
    def mutate(arrays, imp, metrics):
        for k, a in arrays.items():
            if a.dtype.kind == "f":
                arrays[k] = (a * np.float32(factor)).astype(a.dtype)
    return mutate


def _x(n=64, seed=0):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ the rule
def test_outsized_rule_judges_each_norm_against_the_others_median():
    # one liar among honest replies: only it; the global model's norm is a floor of the reference
    assert set(outsized_replies({1: 10.0, 2: 11.0, 3: 9.0, 4: 1e21}, 8.0)) == {4}
    assert outsized_replies({1: 10.0, 2: 11.0, 3: 9.0, 4: 900.0}, 8.0) == {}       # 90 ×: under the limit
    assert set(outsized_replies({1: 10.0, 2: 11.0, 3: 9.0, 4: 1200.0}, 8.0)) == {4}
    assert outsized_replies({1: 10.0, 2: 11.0, 3: 1200.0}, 20.0) == {}             # the global model's floor
    # two replies judge each other: the larger can go, the smaller never
    assert set(outsized_replies({1: 10.0, 2: 1e21}, None)) == {2}
    # a single reply has no reference; a liar majority is not outsized against itself (rule 2's case)
    assert outsized_replies({1: 1e21}, 1.0) == {}
    assert outsized_replies({1: 10.0, 2: 1e21, 3: 1.1e21}, 10.0) == {}
    # never every reply: the smallest is never above the median of the others
    rng = np.random.default_rng(0)
    for _ in range(200):
        norms = dict(enumerate(10.0 ** rng.uniform(-3, 30, size=int(rng.integers(2, 8)))))
        assert len(outsized_replies(norms, None)) < len(norms)
    assert outsized_replies({1: 1.0, 2: 1e9}, None, limit=0) == {}                 # 0 = off
    hit = outsized_replies({1: 10.0, 2: 10.0, 3: 1e21}, 10.0)[3]
    assert hit["norm-ratio"] == pytest.approx(1e20) and f"above {OUTSIZED:g} ×" in hit["reason"]


def test_record_norm_reads_float32_weights_times_1e20_without_overflow():
    state = {k: v * 1e20 for k, v in model_fn().state_dict().items()}
    norm = record_norm(ArrayRecord(state))
    plain = float(torch.sqrt(sum((v.double() ** 2).sum() for v in model_fn().state_dict().values())))
    assert np.isfinite(norm) and norm == pytest.approx(plain * 1e20, rel=1e-5)
    nan = dict(state)
    nan["1.weight"] = nan["1.weight"].clone()
    nan["1.weight"][0, 0] = float("nan")
    assert record_norm(ArrayRecord(nan)) is None


# ------------------------------------------------------------------------------------------- the strategy
def _round(name, replies, keep, **options):
    s = build_strategy(name, model_fn=model_fn, fusion_inputs=_x(), seed=0, **options)
    s.keep_updates = keep   # False: the streamed average (average, fedavg); True: the kept replies
    s._global = ArrayRecord(model_fn().state_dict())
    seen = []
    s.update_observer = lambda u: seen.append(u.partition_id)
    arrays, metrics = s.aggregate_train(1, replies)
    return s, arrays, metrics, seen


@pytest.mark.parametrize("name", ["average", "fedavg", "kf-linear", "fedmedian"])
@pytest.mark.parametrize("keep", [False, True])
def test_a_reply_times_1e20_is_rejected_and_the_round_aggregates_the_others(name, keep):
    scores = name == "kf-linear"   # importance scores: the fusion method's contract only

    def honest():
        return [reply(i, i, n=40 + i, pid=i - 1, scores=scores) for i in (1, 3, 4)]

    liar = reply(2, 2, n=42, pid=1, scores=scores, mutate=_scale(1e20))
    s, arrays, metrics, seen = _round(name, honest()[:1] + [liar] + honest()[1:], keep)
    _, clean, _, clean_seen = _round(name, honest(), keep)
    record = s.history[-1]
    assert arrays is not None and record["fallback"] is None and record["valid"] == 3
    [rejected] = record["rejected"]
    assert rejected["node-id"] == 2 and rejected["partition-id"] == 1 and rejected["outsized-weights"]
    assert rejected["norm-ratio"] > 1e19 and "norm" in rejected["reason"]
    got, want = state_of(arrays), state_of(clean)
    # the round of the others: exactly, or (streamed) up to the renormalisation of the weights after a rejection
    same = torch.equal if keep else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7))
    assert all(same(got[k], want[k]) for k in want)
    assert seen == clean_seen == [0, 2, 3]                  # the clients' references leave it out
    assert metrics["num-rejected"] == 1 and metrics["fell-back"] == 0


def test_a_liar_majority_is_caught_by_its_models_non_finite_outputs():
    """Two of three replies × 1e20: each is not outsized against the other liar, but its own model overflows on
    the probe inputs (rule 2)."""
    replies = [reply(1, 1, pid=0), reply(2, 2, pid=1, mutate=_scale(1e20)), reply(3, 3, pid=2, mutate=_scale(1e20))]
    s, arrays, _, seen = _round("average", replies, keep=False)
    record = s.history[-1]
    assert arrays is not None and record["valid"] == 1 and seen == [0]
    assert {r["partition-id"] for r in record["rejected"]} == {1, 2}
    assert all(r["non-finite-outputs"] and "non-finite outputs" in r["reason"] for r in record["rejected"])


def test_every_reply_overflowing_stops_the_run_as_diverged_clients():
    replies = [reply(1, 1, pid=0, mutate=_scale(1e20)), reply(2, 2, pid=1, mutate=_scale(1e20))]
    s = build_strategy("average", model_fn=model_fn, fusion_inputs=_x(), seed=0)
    with pytest.raises(ClientsDivergedError, match="non-finite outputs.*lr"):
        s.aggregate_train(1, replies)


def test_the_screen_leaves_honest_rounds_alone_and_can_be_turned_off():
    replies = [reply(i, i, pid=i) for i in range(1, 5)]
    s, _, _, seen = _round("average", replies, keep=False)
    assert s.history[-1]["rejected"] == [] and seen == [1, 2, 3, 4]
    liar = [reply(1, 1, pid=0), reply(2, 2, pid=1, mutate=_scale(1e3)), reply(3, 3, pid=2)]
    s = build_strategy("average", model_fn=model_fn, seed=0)   # no probe inputs: rule 1 alone
    s.outsized_limit = 0
    s.aggregate_train(1, liar)
    assert s.history[-1]["rejected"] == [] and s.history[-1]["valid"] == 3


# ----------------------------------------------------------------------------------------- a federation
def test_one_client_sending_weights_times_1e20_no_longer_stops_the_default_run(tmp_path, caplog):
    """The issue's case: the default strategy, 4 clients in process, partition 1 multiplies its weights by 1e20
    every round (``tests/support/faults.py``'s ``scale``)."""
    from fedfuse.flower.runner.inprocess import run_app_inprocess
    from tests.support.fault_app import client_app, server_app, write_fault_app

    cfg = {"num-clients": 4, "num-server-rounds": 2, "test-faults": "1:scale:1e20", "output-dir": str(tmp_path),
           "run-name": "liar"}
    outcome = run_app_inprocess(cfg, num_supernodes=4, echo=False, app_dir=write_fault_app(tmp_path / "app"),
                                client_app=client_app, server=server_app)
    assert outcome.ok, outcome.details
    res = json.loads((outcome.out_dir / "results.json").read_text())
    assert res["status"] == "completed"
    for row in res["rounds"][1:3]:
        assert row["fallback"] is None and row["valid-replies"] == 3
        [rejected] = row["rejected"]
        assert rejected["partition-id"] == 1 and rejected["outsized-weights"]
        assert sorted(row["client-partition-ids"]) == [0, 2, 3]   # the liar's reply is not a member
        assert row["ensemble-accuracy"] > 0.3   # chance is 0.1: the liar's outputs are not in it
    assert res["rounds"][2]["test-accuracy"] > 0.4
    with open(outcome.out_dir / "rounds.csv") as f:
        rows = {r["round"]: r for r in csv.DictReader(f)}
    assert rows["1"]["rejected"] == "1" and "(partition 1): its weights' norm" in rows["1"]["rejected-reasons"]
    assert "client-1-test-accuracy" not in rows["1"]
    # the console's line names the partition (a WARNING: fedfuse's console shows it)
    assert "rejected reply from node" in outcome.log and "(partition 1): its weights' norm" in outcome.log
