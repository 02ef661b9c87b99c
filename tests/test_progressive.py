"""Progressive few-round fusion (``fedfuse.progressive``, issue 27 item 2): the closed-form head equals centralised
ridge regression on the pooled data whatever the split; malformed statistics are refused; level-wise rounds keep the
frozen levels bit-identical; ``head-round=true`` runs the head round through fedfuse's ClientApp (one-shot: K = 2),
rejecting a malformed reply and keeping the others."""

import json
from unittest.mock import Mock

import pytest
import torch
from flwr.app import ArrayRecord, Message

from fedfuse.config import ConfigError, preflight
from fedfuse.flower.head.head_messages import head_reply_content, read_head_reply
from fedfuse.flower.head.head_round import HeadRound
from fedfuse.models import build_model
from fedfuse.progressive import (HeadStatistics, cut_points, features, fit_temperature, freeze, fuse_suffixes, head_statistics,
                                 lift_suffix, model_equivalents, solve_head, split, with_head)
from fedfuse.training import train


def _data(n=300, d=8, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(c, d, generator=g) * 2
    y = torch.randint(0, c, (n,), generator=g)
    return centers[y] + torch.randn(n, d, generator=g), y


def _ridge_direct(f, y, c, ridge):
    f1 = torch.cat([f, torch.ones(len(f), 1, dtype=f.dtype)], 1)
    reg = torch.eye(f1.shape[1], dtype=f.dtype) * ridge * len(f)
    reg[-1, -1] = 0
    return torch.linalg.solve(f1.T @ f1 + reg, f1.T @ torch.nn.functional.one_hot(y, c).double())


@pytest.mark.parametrize("ridge", [1e-3, 0.1])
def test_head_from_split_statistics_equals_centralised_ridge_on_the_pooled_data(ridge):
    x, y = _data()
    model = build_model("mlp", 4, (8,), width=16, depth=2, seed=1)
    # label-skewed split into 3 clients: each client's own statistics, summed by solve_head
    parts = [y % 3 == i for i in range(3)]
    head = solve_head([head_statistics(model, x[p], y[p], 4) for p in parts], ridge)
    wb = _ridge_direct(features(model, x), y, 4, ridge)
    assert torch.allclose(head.weight.double(), wb[:-1].T, atol=1e-5)
    assert torch.allclose(head.bias.double(), wb[-1], atol=1e-5)
    # another split of the same data gives the same head
    other = solve_head([head_statistics(model, x[:50], y[:50], 4), head_statistics(model, x[50:], y[50:], 4)], ridge)
    assert torch.allclose(other.weight, head.weight, atol=1e-5) and torch.allclose(other.bias, head.bias, atol=1e-5)
    fitted = with_head(model, head)
    assert fitted[-1] is head


@pytest.mark.parametrize("family", ["mlp", "cnn", "resnet", "vit"])
def test_the_head_round_takes_every_model_family(family):
    """Registry-driven: K = 2 needs only the adapter's pre-logit features and classifier."""
    from fedfuse.models import MODELS

    assert family in MODELS
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, 8, 8, generator=g), torch.randint(0, 4, (40,), generator=g)
    model = build_model(family, 4, (3, 8, 8), seed=0)
    fitted = with_head(model, solve_head([head_statistics(model, x[:20], y[:20], 4),
                                          head_statistics(model, x[20:], y[20:], 4)]))
    with torch.no_grad():
        assert fitted.eval()(x).shape == (40, 4) and torch.isfinite(fitted(x)).all()


def test_temperature_keeps_the_predictions_and_matches_the_reference_confidence():
    x, y = _data()
    model = build_model("mlp", 4, (8,), width=16, depth=1, seed=1)
    train(model, x, y, epochs=3, lr=1e-2)
    with_head(model, solve_head([head_statistics(model, x, y, 4)]))
    with torch.no_grad():
        before = model(x)
        target = (before * 8).softmax(-1)   # a reference eight times as confident
    tau = fit_temperature(model, x, target)
    with torch.no_grad():
        after = model(x)
    assert tau == pytest.approx(8, rel=0.3) and torch.equal(after.argmax(-1), before.argmax(-1))
    assert torch.allclose(after, before * tau, atol=1e-4)


def test_statistics_pack_round_trip_and_size():
    x, y = _data(50)
    s = head_statistics(build_model("mlp", 4, (8,), width=16, depth=1), x, y, 4)
    back = HeadStatistics.unpack(s.pack(), s.cross, s.num_examples)
    assert torch.equal(back.gram, s.gram) and torch.equal(back.cross, s.cross)
    assert s.numbers_sent == 17 * 18 // 2 + 17 * 4 == s.pack().numel() + s.cross.numel()
    assert model_equivalents(s.numbers_sent, build_model("mlp", 4, (8,), width=16, depth=1)) == pytest.approx(
        s.numbers_sent / (8 * 16 + 16 + 16 * 4 + 4))


def test_malformed_statistics_and_inputs_raise_value_errors():
    x, y = _data(40)
    s = head_statistics(build_model("mlp", 4, (8,), width=16, depth=1), x, y, 4)
    with pytest.raises(ValueError, match="non-finite"):
        HeadStatistics(s.gram, torch.full_like(s.cross, float("nan")), s.num_examples)
    with pytest.raises(ValueError, match="must equal num_examples"):
        HeadStatistics(s.gram, s.cross, s.num_examples + 5)
    with pytest.raises(ValueError, match="does not fit"):
        HeadStatistics.unpack(s.pack()[:-1], s.cross, s.num_examples)
    with pytest.raises(ValueError, match="different shapes"):
        solve_head([s, head_statistics(build_model("mlp", 4, (8,), width=8, depth=1), x, y, 4)])
    with pytest.raises(ValueError, match="labels must be in"):
        head_statistics(build_model("mlp", 4, (8,), width=16, depth=1), x, y + 4, 4)
    with pytest.raises(ValueError, match="no client statistics"):
        solve_head([])
    with pytest.raises(ValueError, match="takes 8 features"):
        with_head(build_model("mlp", 4, (8,), width=16, depth=1), torch.nn.Linear(8, 4))


def test_level_wise_cut_lift_and_frozen_prefix_stay_bit_identical():
    x, y = _data()
    a = build_model("mlp", 4, (8,), width=16, depth=2, seed=1)
    b = build_model("mlp", 4, (8,), width=16, depth=2, seed=2)
    for m in (a, b):
        train(m, x, y, epochs=2, lr=1e-2)
    cut = cut_points(a)[0]
    prefix = freeze(split(a, cut)[0])
    before = {k: v.clone() for k, v in prefix.state_dict().items()}
    # lifting onto its own lower levels reproduces the client's upper part
    own_prefix, own_suffix = split(a, cut)
    same = lift_suffix(prefix, own_prefix, own_suffix, x, ridge=0.0)
    with torch.no_grad():
        assert torch.allclose(same(prefix(x)), own_suffix(own_prefix(x)), atol=1e-3)
    # client b's upper part moved onto a's fused level, then trained: the frozen level does not move
    bp, bs = split(b, cut)
    upper = lift_suffix(prefix, bp, bs, x)
    train(torch.nn.Sequential(*prefix, *upper), x, y, epochs=2, lr=1e-2)
    assert all(torch.equal(before[k], v) for k, v in prefix.state_dict().items())
    fused = fuse_suffixes("kf-linear", prefix, [same, upper], x[:100], weights=[1, 1])
    assert all(torch.equal(before[k], v) for k, v in split(fused, cut)[0].state_dict().items())
    assert fused(x).shape == (len(x), 4)


def test_level_wise_rounds_take_mlps_only():
    with pytest.raises(ValueError, match="head round"):
        cut_points(build_model("cnn", 4, (1, 8, 8), width=8, depth=2))
    with pytest.raises(ValueError, match="nn.Sequential"):
        cut_points(build_model("resnet", 4, (3, 8, 8), width=8, depth=1))


@pytest.fixture
def identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):   # Message() needs a run identity
        monkeypatch.setattr(TaskIdentity, attr, value)


def _reply(content, node):
    reply = Mock(spec=Message)
    reply.metadata = Mock(src_node_id=node)
    reply.has_error.return_value = False
    reply.content = content
    return reply


def test_head_reply_round_trip_and_rejections():
    x, y = _data(40)
    model = build_model("mlp", 4, (8,), width=16, depth=1)
    s = head_statistics(model, x, y, 4)
    msg = _reply(head_reply_content(s), 1)
    back = read_head_reply(msg, 16, 4)
    assert torch.allclose(back.gram, s.gram)
    with pytest.raises(ValueError, match="expected"):
        read_head_reply(msg, 8, 4)


class _Grid:
    """Answers the head query with the given replies (one per node), as a Grid would."""

    def __init__(self, contents):
        self.contents = contents

    def get_node_ids(self):
        return list(range(1, len(self.contents) + 1))

    def send_and_receive(self, msgs, timeout=None):
        return [_reply(content, m.metadata.dst_node_id) for m, content in zip(msgs, self.contents)]


def test_head_round_rejects_a_malformed_reply_and_solves_from_the_others(identity, caplog):
    x, y = _data()
    model = build_model("mlp", 4, (8,), width=16, depth=1, seed=3)
    good = [head_statistics(model, x[:150], y[:150], 4), head_statistics(model, x[150:], y[150:], 4)]
    bad = head_reply_content(good[0])
    bad.array_records["head-statistics"] = ArrayRecord({"gram-upper": good[0].pack(), "cross": good[0].cross[:3]})
    out, record = HeadRound(1e-3, check=False).run(
        _Grid([head_reply_content(good[0]), bad, head_reply_content(good[1])]), model, 4)
    assert record["valid"] == 2 and len(record["rejected"]) == 1 and "cross has shape" in record["rejected"][0][
        "reason"] and record["fallback"] is None
    assert torch.allclose(out[-1].weight, solve_head(good, 1e-3).weight)
    assert "rejected" in caplog.text
    # nothing valid: the model is kept, loudly
    kept = build_model("mlp", 4, (8,), width=16, depth=1, seed=3)
    w0 = kept[-1].weight.clone()
    out, record = HeadRound(check=False).run(_Grid([bad]), kept, 4)
    assert torch.equal(out[-1].weight, w0) and "no valid head statistics" in record["fallback"]


class _ScoringGrid(_Grid):
    """Answers the head query with statistics and the scoring query with fixed accuracies (before, head)."""

    def __init__(self, contents, accuracies):
        super().__init__(contents)
        self.accuracies = accuracies

    def send_and_receive(self, msgs, timeout=None):
        from flwr.app import MetricRecord, RecordDict

        msgs = list(msgs)
        if msgs[0].metadata.message_type != "query.score_candidates":
            return super().send_and_receive(msgs, timeout)
        return [_reply(RecordDict({"metrics": MetricRecord({"num-examples": 10, "accuracy-0": b, "accuracy-1": h})}),
                       m.metadata.dst_node_id) for m, (b, h) in zip(msgs, self.accuracies)]


@pytest.mark.parametrize("accuracies, kept", [([(0.5, 0.7), (0.6, 0.6)], "head"), ([(0.8, 0.7), (0.8, 0.75)], "before")])
def test_the_clients_score_the_solved_head_against_the_model_before(identity, accuracies, kept):
    x, y = _data()
    model = build_model("mlp", 4, (8,), width=16, depth=1, seed=3)
    w0 = model[-1].weight.clone()
    stats = [head_reply_content(head_statistics(model, x[:150], y[:150], 4)),
             head_reply_content(head_statistics(model, x[150:], y[150:], 4))]
    out, record = HeadRound(1e-3, solvers=("ridge",)).run(_ScoringGrid(stats, accuracies), model, 4)
    assert record["kept"] == kept and set(record["client-accuracy"]) == {"before", "head"}
    assert torch.equal(out[-1].weight, w0) == (kept == "before")


class _LossGrid(_Grid):
    """Head statistics from ``contents``; the first scoring query (before, head) answered with ``first`` (accuracy,
    loss) pairs, the calibration query (the head at every CALIBRATION_FACTORS scale) with ``losses``."""

    def __init__(self, contents, first, losses):
        super().__init__(contents)
        self.first, self.losses, self.queries = first, losses, []

    def send_and_receive(self, msgs, timeout=None):
        from flwr.app import MetricRecord, RecordDict

        from fedfuse.flower.aggregators.candidates import read_score_query

        msgs = list(msgs)
        if msgs[0].metadata.message_type != "query.score_candidates":
            return super().send_and_receive(msgs, timeout)
        self.queries.append(read_score_query(msgs[0]))
        if len(self.queries) == 1:
            metrics = {f"{k}-{i}": v for i, (a, l_) in enumerate(self.first)
                       for k, v in (("accuracy", a), ("loss", l_))}
        else:   # scaling keeps the predictions: the head's accuracy at every scale
            metrics = {f"{k}-{i}": v for i, l_ in enumerate(self.losses)
                       for k, v in (("accuracy", self.first[1][0]), ("loss", l_))}
        return [_reply(RecordDict({"metrics": MetricRecord({"num-examples": 10, **metrics})}), m.metadata.dst_node_id)
                for m in msgs]


@pytest.mark.parametrize("losses, factor, rose", [((2.5, 1.5, 0.8, 1.2, 4.0, 5.0), 0.25, False),
                                                  ((2.5, 2.0, 2.05, 2.2, 4.0, 5.0), 0.125, True),
                                                  ((3.5, 3.4, 3.3, 3.2, 2.95, 2.9), 4.0, True),
                                                  ((3.5, 3.4, 3.3, 3.2, 3.1, 3.05), 1.0, True)])
def test_a_solved_head_that_raises_the_clients_loss_is_calibrated_or_said(identity, caplog, losses, factor, rose):
    """Issue 45: the head round raised the test loss 1.94 -> 5.84 while the accuracy rose 0.47 -> 0.74, silently. When
    the clients' loss with the kept head is above the model before's, one more query scores the head's logits at a few
    scales (same predictions) and the lowest loss is kept; a loss still above is a WARNING, recorded."""
    from fedfuse.flower.head.head_round import CALIBRATION_FACTORS

    x, y = _data()
    model = build_model("mlp", 4, (8,), width=16, depth=1, seed=3)
    parts = [(x[:150], y[:150]), (x[150:], y[150:])]
    contents = [head_reply_content(head_statistics(model, *p, 4)) for p in parts]
    grid = _LossGrid(contents, [(0.47, 1.9), (0.74, 3.0)], losses)
    out, record = HeadRound(1e-3, solvers=("ridge",)).run(grid, model, 4)
    want = solve_head([head_statistics(model, *p, 4) for p in parts], 1e-3)
    assert record["kept"] == "head" and len(grid.queries) == 2 and len(grid.queries[1]) == len(CALIBRATION_FACTORS)
    assert record["calibration"]["factor"] == factor and record["temperature"] == factor   # temperature 1 before
    assert torch.allclose(out[-1].weight, want.weight * factor, atol=1e-6)
    assert record["client-loss"] == {"before": 1.9, "head": min(*losses, 3.0)}
    assert record["federated"]["federated-loss"] == min(*losses, 3.0)
    assert ("loss-rose" in record) == rose and ("raises the clients' loss" in caplog.text) == rose
    # a head that does not raise the loss is not calibrated: one scoring query
    grid = _LossGrid(contents, [(0.47, 1.9), (0.74, 0.9)], losses)
    _, record = HeadRound(1e-3, solvers=("ridge",)).run(grid, model, 4)
    assert len(grid.queries) == 1 and "calibration" not in record and record["client-loss"]["head"] == 0.9


def test_a_head_round_that_raises_the_test_loss_says_so_and_records_both(caplog):
    """The server's view too: loss and accuracy before and after the head round go into its record, and a loss that
    rose is a WARNING even when the accuracy rose (issue 45)."""
    import logging

    from fedfuse.flower.server_app import head_round_loss_check

    rows = [{"round": 1, "test-accuracy": 0.47, "test-loss": 1.94},
            {"round": 2, "test-accuracy": 0.74, "test-loss": 5.84, "federated-accuracy": 0.8, "federated-loss": 0.5}]
    record: dict = {"kept": "head"}
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        head_round_loss_check(rows, 2, record)
    finally:
        flwr_logger.removeHandler(caplog.handler)
    assert record["loss-check"] == {"test": {"loss-before": 1.94, "loss-after": 5.84, "accuracy-before": 0.47,
                                             "accuracy-after": 0.74}}   # no federated loss before: not compared
    assert "the test loss rose from 1.9400 to 5.8400 (accuracy 0.4700 -> 0.7400)" in caplog.text
    caplog.clear()
    rows[1]["test-loss"] = 1.5
    head_round_loss_check(rows, 2, record := {"kept": "head"})
    assert record["loss-check"]["test"]["loss-after"] == 1.5 and "rose" not in caplog.text


def test_lda_head_from_split_statistics_is_linear_discriminant_analysis_of_the_pooled_data():
    """``solve_lda_head``: from the same statistics as the ridge head, whatever the split, the shared-covariance
    Gaussian classifier of the pooled data (class means, pooled within-class covariance, class frequencies); it
    predicts as scikit-learn's LDA does."""
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis

    from fedfuse.progressive import solve_classifier, solve_lda_head

    x, y = _data(600, d=6, c=4)
    f = x.double()
    pooled = solve_lda_head([HeadStatistics(*_raw(f, y, 4), len(y))], shrinkage=0.0)
    parts = [solve_lda_head([HeadStatistics(*_raw(f[i::3], y[i::3], 4), len(y[i::3])) for i in range(3)],
                            shrinkage=0.0)]
    assert torch.allclose(parts[0].weight, pooled.weight, atol=1e-4) and torch.allclose(parts[0].bias, pooled.bias,
                                                                                         atol=1e-4)
    mu = torch.stack([f[y == c].mean(0) for c in range(4)])
    within = sum((f[y == c] - mu[c]).T @ (f[y == c] - mu[c]) for c in range(4)) / len(y)
    w = torch.linalg.solve(within, mu.T).T
    b = -0.5 * (w * mu).sum(1) + torch.log(torch.bincount(y, minlength=4).double() / len(y))
    assert torch.allclose(pooled.weight.double(), w, atol=1e-4) and torch.allclose(pooled.bias.double(), b, atol=1e-4)
    sk = LinearDiscriminantAnalysis(solver="lsqr").fit(x.numpy(), y.numpy())
    agree = (pooled(x).argmax(1).numpy() == sk.predict(x.numpy())).mean()
    assert agree > 0.99
    assert torch.equal(solve_classifier([HeadStatistics(*_raw(f, y, 4), len(y))], "lda").weight,
                       solve_lda_head([HeadStatistics(*_raw(f, y, 4), len(y))]).weight)
    # a class no client holds is never predicted; a feature that never varies (a dead ReLU) does not break it
    keep = y != 3
    dead = torch.cat([f[keep], torch.zeros(int(keep.sum()), 1, dtype=f.dtype)], 1)
    head = solve_lda_head([HeadStatistics(*_raw(dead, y[keep], 4), int(keep.sum()))])
    assert torch.isfinite(head.weight).all() and (head(dead.float()).argmax(1) != 3).all()
    with pytest.raises(ValueError, match="shrinkage"):
        solve_lda_head([HeadStatistics(*_raw(f, y, 4), len(y))], shrinkage=2.0)
    with pytest.raises(ValueError, match="no client"):
        solve_lda_head([])
    with pytest.raises(ValueError, match="head solver"):
        solve_classifier([HeadStatistics(*_raw(f, y, 4), len(y))], "svm")


def _raw(f, y, c):
    """``(gram, cross)`` of features ``f`` with the constant 1 appended and one-hot labels."""
    f1 = torch.cat([f, torch.ones(len(f), 1, dtype=f.dtype)], 1)
    return f1.T @ f1, f1.T @ torch.nn.functional.one_hot(y, c).double()


class _SolverGrid(_Grid):
    """Head statistics from ``contents``; scoring queries answered with ``accuracies`` (one per candidate)."""

    def __init__(self, contents, accuracies):
        super().__init__(contents)
        self.accuracies, self.candidates = accuracies, []

    def send_and_receive(self, msgs, timeout=None):
        from flwr.app import MetricRecord, RecordDict

        from fedfuse.flower.aggregators.candidates import read_score_query

        msgs = list(msgs)
        if msgs[0].metadata.message_type != "query.score_candidates":
            return super().send_and_receive(msgs, timeout)
        self.candidates.append(len(read_score_query(msgs[0])))
        metrics = {"num-examples": 10, **{f"accuracy-{i}": a for i, a in enumerate(self.accuracies)}}
        return [_reply(RecordDict({"metrics": MetricRecord(metrics)}), m.metadata.dst_node_id) for m in msgs]


@pytest.mark.parametrize("accuracies, kept, solver", [((0.5, 0.6, 0.7), "head", "lda"), ((0.5, 0.7, 0.7), "head", "ridge"),
                                                      ((0.8, 0.6, 0.7), "before", "lda")])
def test_the_clients_choose_between_the_ridge_and_the_lda_head(identity, accuracies, kept, solver):
    """``solvers=("ridge", "lda")`` (``head-solver='best'``): one scoring query with the model before and both solved
    heads; the best stays (a tie: the first, ridge) unless the model before scores higher."""
    from fedfuse.progressive import solve_lda_head

    x, y = _data()
    model = build_model("mlp", 4, (8,), width=16, depth=1, seed=3)
    w0 = model[-1].weight.clone()
    parts = [(x[:150], y[:150]), (x[150:], y[150:])]
    grid = _SolverGrid([head_reply_content(head_statistics(model, *p, 4)) for p in parts], accuracies)
    out, record = HeadRound(1e-3, solvers=("ridge", "lda")).run(grid, model, 4)
    assert grid.candidates == [3]
    assert record["kept"] == kept and record["solver"] == solver
    assert record["solver-accuracy"] == {"ridge": accuracies[1], "lda": accuracies[2]}
    assert record["client-accuracy"] == {"before": accuracies[0], "head": max(accuracies[1:])}
    if kept == "before":
        assert torch.equal(out[-1].weight, w0)
    elif solver == "lda":
        want = solve_lda_head([head_statistics(model, *p, 4) for p in parts])
        assert torch.allclose(out[-1].weight, want.weight, atol=1e-5)
    else:
        want = solve_head([head_statistics(model, *p, 4) for p in parts], 1e-3)
        assert torch.allclose(out[-1].weight, want.weight, atol=1e-6)
    assert torch.equal(model[-1].weight, w0)   # the model given is not modified
    with pytest.raises(ValueError, match="solvers"):
        HeadRound(solvers=("ridge", "svm"))
    with pytest.raises(ValueError, match="solvers"):
        HeadRound(solvers=())


def test_run_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="'head-options.ridge'"):
        preflight({"head-round": False, "head-ridge": 0.1})
    from fedfuse.config import parse_run_config
    assert parse_run_config({}).head_round   # on by default
    assert parse_run_config({"client-tiers": "1,0.5", "strategy": "average"}).head_round   # width tiers: every tier
    with pytest.raises(ConfigError, match="'head-round'"):
        preflight({"head-round": "yes"})
    with pytest.raises(ConfigError, match="'head-options.solver'"):
        preflight({"head-round": False, "head-solver": "lda"})
    with pytest.raises(ConfigError, match="'head-options.solver'"):
        preflight({"head-solver": "svm"})
    with pytest.raises(ConfigError, match="'head-options.ridge'"):
        preflight({"head-solver": "lda", "head-ridge": 0.1})


def test_a_progressive_one_shot_run_solves_the_head_from_every_client(tmp_path, capsys):
    from fedfuse.flower.runner.run import main

    cfg = ("mode='one-shot' num-server-rounds=1 num-clients=3 local-epochs=2 model-width=16 model-depth=1 "
           "fusion-set-size=60 importance='uniform' strategy='kf-linear' one-shot-references='models' "
           "head-round=true run-name='r'")
    assert main(["--engine", "inprocess", "--output-dir", str(tmp_path), "--run-config", cfg]) == 0
    out = capsys.readouterr().out
    assert "round 1/1" in out and "head round   acc" in out and "round 2/2" not in out   # the head round: its own step
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    rounds = {r["round"]: r for r in res["rounds"]}
    head = rounds[2]["fusion-info"]["head-round"]
    assert head["valid"] == head["queried"] == 3 and not head["rejected"] and head["fallback"] is None
    assert head["temperature"] > 0 and head["numbers-per-reply"] == 17 * 18 // 2 + 17 * 10
    assert rounds[2]["test-accuracy"] != rounds[1]["test-accuracy"]


def test_a_multi_round_run_ends_with_the_head_round(tmp_path):
    from fedfuse.flower.runner.inprocess import run_inprocess

    out = run_inprocess({"num-clients": 2, "num-server-rounds": 2, "local-epochs": 1, "model-width": 16,
                         "model-depth": 1, "strategy": "fedavg", "head-round": True, "output-dir": str(tmp_path),
                         "run-name": "m"}, echo=False)
    rounds = {r["round"]: r for r in json.loads((out / "results.json").read_text())["rounds"]}
    assert sorted(rounds) == [0, 1, 2, 3] and rounds[3]["fusion-info"]["head-round"]["valid"] == 2


def test_with_federated_evaluation_the_head_round_row_has_the_clients_scores(tmp_path):
    from fedfuse.flower.runner.inprocess import run_inprocess

    out = run_inprocess({"num-clients": 3, "num-server-rounds": 1, "local-epochs": 1, "model-width": 16,
                         "model-depth": 1, "strategy": "fedavg", "evaluation": "both", "output-dir": str(tmp_path),
                         "run-name": "f"}, echo=False)
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    head = rounds[2]["fusion-info"]["head-round"]
    assert rounds[2]["federated-clients"] == 3
    assert rounds[2]["federated-accuracy"] == pytest.approx(head["client-accuracy"][head["kept"]])
    # the last training round's clients stay the reference columns of the head round's row
    assert rounds[2]["client-test-accuracy"] == rounds[1]["client-test-accuracy"]


def test_head_round_solves_every_exit_of_a_depth_tier_model(identity):
    """A depth-tier ``MultiExit`` has a classifier per depth: each node answers with statistics for every one
    (``gram-upper@<k>`` / ``cross@<k>``), and the server solves each from the pooled statistics."""
    from fedfuse.hetero.depth import multi_exit
    from fedfuse.progressive import head_sites

    x, y = _data()
    model = multi_exit(build_model("mlp", 4, (8,), width=16, depth=4, seed=3), [1, 0.5, 0.25], 4)
    sites = head_sites(model)
    assert set(sites) == {"", "1", "2"}
    parts = [slice(0, 150), slice(150, 300)]
    stats = [{s: head_statistics(model, x[p], y[p], 4, site=s) for s in sites} for p in parts]
    msg = _reply(head_reply_content(stats[0]), 1)
    widths = {s: v.classifier.in_features for s, v in sites.items()}
    back = read_head_reply(msg, widths, 4)
    assert set(back) == set(sites) and all(torch.allclose(back[s].gram, stats[0][s].gram) for s in sites)
    with pytest.raises(ValueError, match="must hold"):
        read_head_reply(msg, 16, 4)   # a reply for several classifiers does not fit a one-classifier model
    out, record = HeadRound(1e-3, check=False).run(_Grid([head_reply_content(s) for s in stats]), model, 4)
    assert record["valid"] == 2
    for s, site in head_sites(out).items():
        want = solve_head([st[s] for st in stats], 1e-3)
        assert torch.allclose(site.classifier.weight, want.weight, atol=1e-6)


def test_head_round_solves_the_classifiers_it_asks_for(identity):
    """``sites``: the query names the classifiers (multi-round depth tiers: the final one only); the exits stay."""
    from fedfuse.flower.head.head_messages import read_head_sites
    from fedfuse.hetero.depth import multi_exit

    x, y = _data()
    model = multi_exit(build_model("mlp", 4, (8,), width=16, depth=4, seed=3), [1, 0.5, 0.25], 4)
    exit_w = model.exits["1"].fc.weight.clone()
    stats = [{"": head_statistics(model, x[p], y[p], 4)} for p in (slice(0, 150), slice(150, 300))]
    grid = _Grid([head_reply_content(s) for s in stats])
    sent = []
    grid.send_and_receive = lambda msgs, timeout=None: (sent.extend(msgs), [
        _reply(head_reply_content(s), m.metadata.dst_node_id) for m, s in zip(msgs, stats)])[1]
    out, record = HeadRound(1e-3, check=False).run(grid, model, 4, sites=("",))
    assert record["valid"] == 2 and all(read_head_sites(m) == [""] for m in sent)
    assert torch.allclose(out.base[-1].weight, solve_head([s[""] for s in stats], 1e-3).weight, atol=1e-6)
    assert torch.equal(out.exits["1"].fc.weight, exit_w)
    with pytest.raises(ValueError, match="no classifier"):
        HeadRound(check=False).run(grid, model, 4, sites=("9",))


class _TierGrid(_Grid):
    """Width tiers: each node answers the head query with statistics of every tier's model it is sent (built as a
    node builds it), and the scoring query with fixed accuracies (before, head) per tier (``None``: the global)."""

    def __init__(self, parts, accuracies):
        super().__init__([None] * len(parts))
        self.parts, self.accuracies, self.sent = parts, accuracies, []

    def send_and_receive(self, msgs, timeout=None):
        from flwr.app import MetricRecord, RecordDict

        from fedfuse.flower.aggregators.candidates import read_score_tier
        from fedfuse.flower.tiers.client_tiers import tier_model
        from fedfuse.flower.head.head_messages import read_head_query, read_head_tiers, tier_site

        msgs = list(msgs)
        self.sent += msgs
        if msgs[0].metadata.message_type == "query.score_candidates":
            b, h = self.accuracies[read_score_tier(msgs[0])]
            return [_reply(RecordDict({"metrics": MetricRecord({"num-examples": 10, "accuracy-0": b,
                                                                "accuracy-1": h})}), m.metadata.dst_node_id)
                    for m in msgs]
        out = []
        for m, (x, y) in zip(msgs, self.parts):
            model = build_model("mlp", 4, (8,), width=16, depth=1)
            model.load_state_dict(read_head_query(m))
            stats = {"": head_statistics(model, x, y, 4)}
            for r, state in read_head_tiers(m).items():
                tier = tier_model(build_model("mlp", 4, (8,), width=16, depth=1), {"tier-width-mult": r}, seed=0,
                                  input_shape=(8,))
                tier.load_state_dict(state)
                stats[tier_site(r)] = head_statistics(tier, x, y, 4)
            out.append(_reply(head_reply_content(stats), m.metadata.dst_node_id))
        return out


def test_head_round_with_width_tiers_solves_and_checks_every_tier(identity):
    """Width tiers: one query carries every tier's model; each node answers for every tier (its statistics on that
    tier's features); each tier's head is the pooled ridge solution, kept unless the clients score that tier lower."""
    from fedfuse.flower.tiers.client_tiers import tier_model

    x, y = _data()
    parts = [(x[:150], y[:150]), (x[150:], y[150:])]
    big = build_model("mlp", 4, (8,), width=16, depth=1, seed=3)
    small = tier_model(big, {"tier-width-mult": 0.5}, seed=0, input_shape=(8,))
    w_small = small[-1].weight.clone()
    grid = _TierGrid(parts, {None: (0.5, 0.7), 0.5: (0.8, 0.6)})   # the global gains, tier 0.5 would lose
    out, record = HeadRound(1e-3, solvers=("ridge",)).run_tiers(grid, {1.0: big, 0.5: small}, 4)
    assert record["valid"] == 2 and record["fallback"] is None and record["rejected"] == []
    assert record["tiers"]["1"]["kept"] == record["kept"] == "head" and record["tiers"]["0.5"]["kept"] == "before"
    want = solve_head([head_statistics(big, *p, 4) for p in parts], 1e-3)
    assert torch.allclose(out[1.0][-1].weight, want.weight, atol=1e-6)
    assert out[0.5] is small and torch.equal(small[-1].weight, w_small)   # the narrow tier's trained head stays
    # the narrow tier's solved head is the pooled ridge solution on its own features
    grid = _TierGrid(parts, {None: (0.5, 0.7), 0.5: (0.5, 0.6)})
    out, record = HeadRound(1e-3, solvers=("ridge",)).run_tiers(grid, {1.0: big, 0.5: small}, 4)
    want = solve_head([head_statistics(small, *p, 4) for p in parts], 1e-3)
    assert record["tiers"]["0.5"]["kept"] == "head" and torch.allclose(out[0.5][-1].weight, want.weight, atol=1e-6)
    assert {m.metadata.message_type for m in grid.sent} == {"query.head_statistics", "query.score_candidates"}
    with pytest.raises(ValueError, match="global one"):
        HeadRound().run_tiers(grid, {0.5: small}, 4)


def test_check_each_keeps_every_solved_exit_the_clients_do_not_score_lower(identity):
    """``check_each``: each solved classifier of a depth tier's model is scored on its own, through it (the scoring
    query names the site); one the clients score lower goes back to its trained weights, the others stay solved."""
    from flwr.app import MetricRecord, RecordDict

    from fedfuse.flower.aggregators.candidates import read_score_site
    from fedfuse.hetero.depth import multi_exit
    from fedfuse.progressive import SiteView, head_sites

    x, y = _data()
    model = multi_exit(build_model("mlp", 4, (8,), width=16, depth=4, seed=3), [1, 0.5, 0.25], 4)
    trained = {s: v.classifier.weight.clone() for s, v in head_sites(model).items()}
    parts = (slice(0, 150), slice(150, 300))
    stats = [{s: head_statistics(model, x[p], y[p], 4, site=s) for s in head_sites(model)} for p in parts]
    scores = {None: (0.5, 0.6), "1": (0.7, 0.6), "2": (0.5, 0.5)}   # the final one and exit 2 kept, exit 1 not
    grid, seen = _Grid([head_reply_content(s) for s in stats]), []

    def send(msgs, timeout=None):
        msgs = list(msgs)
        if msgs[0].metadata.message_type != "query.score_candidates":
            return [_reply(head_reply_content(s), m.metadata.dst_node_id) for m, s in zip(msgs, stats)]
        site = read_score_site(msgs[0])
        seen.append(site)
        b, h = scores[site]
        return [_reply(RecordDict({"metrics": MetricRecord({"num-examples": 10, "accuracy-0": b, "accuracy-1": h})}),
                       m.metadata.dst_node_id) for m in msgs]

    grid.send_and_receive = send
    out, record = HeadRound(1e-3, solvers=("ridge",)).run(grid, model, 4, check_each=True)
    assert sorted(seen, key=str) == sorted([None, "1", "2"], key=str)   # one scoring query per classifier
    assert {k: v["kept"] for k, v in record["sites"].items()} == {"final": "head", "1": "before", "2": "head"}
    assert record["kept"] == "head" and record["client-accuracy"] == {"before": 0.5, "head": 0.6}
    sites = head_sites(out)
    assert torch.equal(sites["1"].classifier.weight, trained["1"])
    for s in ("", "2"):
        want = solve_head([st[s] for st in stats], 1e-3)
        assert not torch.equal(sites[s].classifier.weight, trained[s])
        # solved, then scaled by its temperature (1 without a reference)
        assert torch.allclose(sites[s].classifier.weight, want.weight, atol=1e-6)
    # a site's view is the model of that depth: its logits are the exit's
    assert torch.allclose(SiteView(out, "2")(x[:5]), sites["2"].logits(x[:5]))


def test_width_x_depth_head_round_solves_every_width_s_exits_on_its_own_features(identity):
    """Width × depth tiers: the query carries every narrower width's ``MultiExit`` and names the exits its nodes use
    (``sites@<tier>``); each node answers them on that width's own features (``tier-<tier>/<k>``), and each width's
    exit is solved from them and checked at that width (scoring queries naming the width and the exit), so a narrow
    tier no longer reads a slice of the full width's solved exit."""
    from flwr.app import MetricRecord, RecordDict

    from fedfuse.flower.aggregators.candidates import read_score_query, read_score_site, read_score_tier
    from fedfuse.flower.head.head_messages import (read_head_query, read_head_sites, read_head_tier_sites,
                                              read_head_tiers, tier_site)
    from fedfuse.hetero.depth import classifier_readers, multi_exit, narrow_copy
    from fedfuse.progressive import head_sites

    x, y = _data()
    model = multi_exit(build_model("mlp", 4, (8,), width=16, depth=4, seed=3), [1, 0.5], 4)
    readers = classifier_readers(model, [(1, 1), (1, 0.5), (0.5, 0.5)])
    assert readers == {"2": [0.5]}   # the narrow tier holds exit 2 only
    narrow = narrow_copy(model, 0.5, (8,))
    trained = head_sites(narrow)["2"].classifier.weight.clone()
    parts = ((x[:150], y[:150]), (x[150:], y[150:]))
    for narrow_scores, want in (((0.7, 0.6), "before"), ((0.6, 0.6), "head")):
        scores = {(None, None): (0.5, 0.6), (None, "2"): (0.5, 0.6), (0.5, "2"): narrow_scores}
        seen, asked = [], []

        def send(msgs, timeout=None, scores=scores, seen=seen, asked=asked):
            msgs = list(msgs)
            if msgs[0].metadata.message_type == "query.score_candidates":
                key = (read_score_tier(msgs[0]), read_score_site(msgs[0]))
                seen.append((key, tuple(read_score_query(msgs[0])[0]["exits.2.fc.weight"].shape)))
                b, h = scores[key]
                return [_reply(RecordDict({"metrics": MetricRecord({"num-examples": 10, "accuracy-0": b,
                                                                    "accuracy-1": h})}), m.metadata.dst_node_id)
                        for m in msgs]
            out = []
            for m, (px, py) in zip(msgs, parts):   # as a node answers: every model asked, at its own width
                asked.append((read_head_sites(m), read_head_tier_sites(m)))
                full = multi_exit(build_model("mlp", 4, (8,), width=16, depth=4, seed=3), [1, 0.5], 4)
                full.load_state_dict(read_head_query(m))
                stats = {s: head_statistics(full, px, py, 4, site=s) for s in read_head_sites(m)}
                for r, state in read_head_tiers(m).items():
                    tier = full.at_width_mult(r, input_shape=(8,))
                    tier.load_state_dict(state)
                    stats.update({tier_site(r, s): head_statistics(tier, px, py, 4, site=s)
                                  for s in read_head_tier_sites(m)[r]})
                out.append(_reply(head_reply_content(stats), m.metadata.dst_node_id))
            return out

        grid = _Grid([None, None])
        grid.send_and_receive = send
        out, record = HeadRound(1e-3, solvers=("ridge",)).run_tiers(
            grid, {1.0: model, 0.5: narrow}, 4, sites={1.0: tuple(head_sites(model)), 0.5: ("2",)})
        assert asked[0][1] == {0.5: ["2"]} and sorted(asked[0][0]) == sorted(head_sites(model))
        # the full width through each classifier, the narrow width through its exit at its own size
        assert sorted(seen, key=str) == sorted([((None, None), (4, 16)), ((None, "2"), (4, 16)),
                                                ((0.5, "2"), (4, 8))], key=str)
        assert record["tiers"]["0.5"]["sites"]["2"]["kept"] == want
        assert record["tiers"]["1"]["sites"]["2"]["kept"] == "head" and record["kept"] == "head"
        full_solved = solve_head([head_statistics(model, px, py, 4, site="2") for px, py in parts], 1e-3).weight
        got = head_sites(out[0.5])["2"].classifier.weight
        if want == "before":
            assert torch.equal(got, trained)
        else:   # solved on the narrow width's features, not sliced from the full width's solution
            solved = solve_head([head_statistics(narrow, px, py, 4, site="2") for px, py in parts], 1e-3).weight
            assert torch.allclose(got, solved, atol=1e-6) and not torch.allclose(got, full_solved[:, :8], atol=1e-3)
        assert torch.allclose(head_sites(out[1.0])["2"].classifier.weight, full_solved, atol=1e-6)
    with pytest.raises(ValueError, match="no classifier"):
        HeadRound(1e-3).run_tiers(grid, {1.0: model, 0.5: narrow}, 4, sites={0.5: ("7",)})
    with pytest.raises(ValueError, match="no model"):
        HeadRound(1e-3).run_tiers(grid, {1.0: model}, 4, sites={0.5: ("2",)})
