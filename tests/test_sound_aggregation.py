"""Issue 12: round-by-round aggregation that cannot blow up.

Refinement on the fusion set (calibration of the classifier bias, FedDF's ensemble distillation), the
``feddf`` method, the strategies' divergence guard and the stop when every client diverged.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from fedfuse.flower import FusionStrategy, build_strategy
from fedfuse.flower.round.protocol import ClientsDivergedError
from fedfuse.fusion import METHOD_SPECS, METHODS, FusionOptionError, fuse, fuse_result
from fedfuse.fusion.average import average_state_dicts
from fedfuse.fusion.refine import DistillRefineOptions, calibrate_head, distill_ensemble, parse_refine
from fedfuse.models import build_model
from fedfuse.training import evaluate, train

from tests.test_strategies import BAD, SHAPE, _register_once, model_fn, reply, state_of

torch.set_num_threads(1)


def _mlp(seed, width=16):
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=width, depth=1, seed=seed)


def _x(n=64, seed=0):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- calibrate
@pytest.mark.parametrize("prior", [None, torch.tensor([5.0, 1, 1, 1, 1, 1, 1, 1, 1, 0])])
def test_calibrate_moves_the_mean_prediction_to_the_prior_and_changes_only_the_bias(prior):
    m, x = _mlp(0), _x()
    before = copy.deepcopy(m.state_dict())
    info = calibrate_head(m, x, prior)
    target = torch.full((10,), 0.1) if prior is None else (prior / prior.sum() + 1e-4) / (1 + 1e-3)
    with torch.no_grad():
        q = m(x).softmax(-1).mean(0)
    torch.testing.assert_close(q, target, atol=2e-4, rtol=0)
    assert info["calibration-gap-after"] < 2e-4 < info["calibration-gap-before"]
    changed = [k for k in before if not torch.equal(before[k], m.state_dict()[k])]
    assert changed == ["3.bias"]  # the classifier bias of Flatten-Linear-ReLU-Linear


def test_calibrate_is_idempotent_and_rejects_a_bad_prior():
    m, x = _mlp(1), _x()
    calibrate_head(m, x)
    once = copy.deepcopy(m.state_dict())
    info = calibrate_head(m, x)
    assert info["calibration-shift"] < 1e-4
    torch.testing.assert_close(m.state_dict()["3.bias"], once["3.bias"], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="prior"):
        calibrate_head(m, x, torch.tensor([1.0, -1.0] + [0.0] * 8))


def test_parse_refine_names_a_misspelled_step():
    assert parse_refine("calibrate+distill") == ("calibrate", "distill")
    assert parse_refine("none") == () and parse_refine(None) == ()
    with pytest.raises(ValueError, match="did you mean 'calibrate'"):
        parse_refine("calibrat")
    with pytest.raises(FusionOptionError, match="refine"):
        fuse("average", [_mlp(0), _mlp(1)], fusion_inputs=_x(), refine="distil+calibrat")


# --------------------------------------------------------------------------------------------- distill
def test_distill_never_returns_a_student_worse_than_its_start_and_is_a_fixed_point():
    a, x = _mlp(0), _x(80)
    student = copy.deepcopy(a)
    info = distill_ensemble(student, [a, copy.deepcopy(a)], [0.5, 0.5], x, seed=0)
    assert info["distill-best-epoch"] == 0  # the start is already optimal: kept exactly
    for k, v in a.state_dict().items():
        assert torch.equal(v, student.state_dict()[k])
    # a real distillation: the held-out KL can only go down
    teachers = [_mlp(1), _mlp(2)]
    student = _mlp(3)
    info = distill_ensemble(student, teachers, [0.5, 0.5], x, DistillRefineOptions(epochs=5), seed=0)
    assert info["distill-kl-best"] <= info["distill-kl-start"]


def _digits_clients():
    """Two MLPs trained on the two class-halves of sklearn digits (label skew) + a fusion set + a test set."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=gen)
    x, y = x[perm], y[perm]
    test_x, test_y, fus_x = x[:400], y[:400], x[400:700]
    tr_x, tr_y = x[700:], y[700:]
    base = build_model("mlp", num_classes=10, input_shape=SHAPE, width=32, depth=1, seed=0)
    clients = []
    for half in (tr_y < 5, tr_y >= 5):
        m = copy.deepcopy(base)
        train(m, tr_x[half], tr_y[half], epochs=15, lr=5e-3, seed=1)
        clients.append(m.eval())
    return clients, fus_x, test_x, test_y


def test_feddf_improves_over_the_average_where_the_ensemble_beats_it():
    clients, fus_x, test_x, test_y = _digits_clients()
    acc = lambda m: evaluate(m, test_x, test_y, num_classes=10)["accuracy"]  # noqa: E731
    avg = fuse("average", clients)
    ens = fuse("ensemble", clients)
    assert acc(ens) > acc(avg) + 0.05  # the constructed case: label-skewed clients, ensemble far better
    # mean over three distillation seeds: one seed's batch order moves the result by ~±0.01
    results = [fuse_result("feddf", clients, fusion_inputs=fus_x, seed=seed) for seed in (0, 1, 2)]
    feddf_acc = float(np.mean([acc(r.model) for r in results]))
    assert feddf_acc > acc(avg) + 0.05, (acc(avg), feddf_acc, acc(ens))
    assert all(r.info["distill-kl-best"] < r.info["distill-kl-start"] for r in results)
    # fixed point: agreeing clients give their average back
    same = fuse("feddf", [clients[0], copy.deepcopy(clients[0])], fusion_inputs=fus_x)
    for k, v in clients[0].state_dict().items():
        torch.testing.assert_close(same.state_dict()[k], v, atol=1e-6, rtol=0)


def test_calibration_refinement_helps_the_label_skewed_average():
    clients, fus_x, test_x, test_y = _digits_clients()
    acc = lambda m: evaluate(m, test_x, test_y, num_classes=10)["accuracy"]  # noqa: E731
    avg = fuse("average", clients)
    cal = fuse("average", clients, fusion_inputs=fus_x, refine="calibrate")
    assert acc(cal) >= acc(avg)


# ---------------------------------------------------------------------------------------- strategies
def test_default_refine_calibrates_the_average_to_the_clients_class_prior():
    x = _x(100)
    counts = [[10, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 10, 10, 10, 10, 10, 10, 10, 10, 10]]

    def with_counts(c):   # an honest client's counts sum to its sample count (the prior weighs them by it)
        return lambda arrays, imp, metrics: metrics.update({"class-counts": c, "num-examples": sum(c)})
    s = build_strategy("average", model_fn=model_fn, fusion_inputs=x, refine_check=False, calibrate_min_gap=0.0)
    assert s.refine_steps == ("calibrate",)
    arrays, _ = s.aggregate_train(1, [reply(1, 1, mutate=with_counts(counts[0])),
                                      reply(2, 2, mutate=with_counts(counts[1]))])
    m = model_fn()
    m.load_state_dict(state_of(arrays))
    with torch.no_grad():
        q = m(x).softmax(-1).mean(0)
    assert abs(float(q[0]) - 0.1) < 1e-3 and s.history[-1]["fusion-info"]["prior"] == "class-counts"
    # refine='none' is plain weighted averaging
    s2 = build_strategy("average", model_fn=model_fn, fusion_inputs=x, refine="none")
    arrays2, _ = s2.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    avg = average_state_dicts([_mlp(1).state_dict(), _mlp(2).state_dict()], [0.5, 0.5])
    for k, v in state_of(arrays2).items():
        torch.testing.assert_close(v, avg[k])


def test_fedavg_takes_no_refinement_and_prior_class_counts_needs_counts():
    with pytest.raises(ValueError, match="no refine step"):
        build_strategy("fedavg", model_fn=model_fn, fusion_inputs=_x(), refine="calibrate")
    assert build_strategy("fedavg", model_fn=model_fn, fusion_inputs=_x()).refine_steps == ()
    s = build_strategy("average", model_fn=model_fn, fusion_inputs=_x(), prior="class-counts", fallback="raise")
    with pytest.raises(ValueError, match="class-counts"):
        s.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    with pytest.raises(ValueError, match="did you mean"):
        build_strategy("average", model_fn=model_fn, fusion_inputs=_x(), refine="calibrat")


@pytest.fixture
def exploding_method():
    """A 'fusion' that returns the average with every weight scaled ×30 (the measured KF blow-up's shape)."""
    def _explode(models, *, weights, **_):
        m = copy.deepcopy(models[0])
        m.load_state_dict({k: 30 * v for k, v in average_state_dicts([x.state_dict() for x in models],
                                                                      weights).items()})
        return m

    _register_once("test-exploding", needs_data=True)(_explode)
    yield "test-exploding"
    METHOD_SPECS.pop("test-exploding", None)
    METHODS.pop("test-exploding", None)


def test_divergence_guard_replaces_an_exploding_aggregate_by_the_average(exploding_method, caplog):
    x = _x(100)
    s = FusionStrategy(exploding_method, model_fn=model_fn, fusion_inputs=x, refine="none")
    with caplog.at_level("WARNING", logger="flwr"):
        arrays, metrics = s.aggregate_train(3, [reply(1, 1, n=20), reply(2, 2, n=60)])
    h = s.history[-1]
    assert h["guard"] and "KL" in h["guard"] and metrics["guarded"] == 1
    assert "divergence guard" in caplog.text and "round 3" in caplog.text
    avg = average_state_dicts([_mlp(1).state_dict(), _mlp(2).state_dict()], [0.25, 0.75])
    for k, v in state_of(arrays).items():
        torch.testing.assert_close(v, avg[k])
    assert h["fusion-info"]["guard-kl-fused"] > h["fusion-info"]["guard-kl-average"]
    # without the guard the exploding model goes through (the guard is what stops it)
    s2 = FusionStrategy(exploding_method, model_fn=model_fn, fusion_inputs=x, refine="none", guard=False)
    arrays2, _ = s2.aggregate_train(3, [reply(1, 1, n=20), reply(2, 2, n=60)])
    assert s2.history[-1]["guard"] is None
    torch.testing.assert_close(state_of(arrays2)["1.weight"], 30 * avg["1.weight"])


def test_guard_keeps_a_good_fusion():
    s = build_strategy("feddf", model_fn=model_fn, fusion_inputs=_x(100))
    s.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    h = s.history[-1]
    assert h["guard"] is None and h["fusion-info"]["guard-kl-fused"] <= h["fusion-info"]["guard-kl-average"] + 1e-6


def test_every_client_non_finite_stops_the_run_with_a_clear_error():
    s = build_strategy("average", model_fn=model_fn, fusion_inputs=_x())
    with pytest.raises(ClientsDivergedError, match="non-finite weights.*lr"):
        s.aggregate_train(5, [reply(1, 1, mutate=BAD["NaN weights"]), reply(2, 2, mutate=BAD["NaN weights"])])
    assert s.history[-1]["skipped"]
    # one diverged client among good ones is only rejected
    s2 = build_strategy("average", model_fn=model_fn, fusion_inputs=_x())
    arrays, metrics = s2.aggregate_train(5, [reply(1, 1, mutate=BAD["NaN weights"]), reply(2, 2)])
    assert arrays is not None and metrics["num-rejected"] == 1


def test_refine_check_keeps_calibration_only_when_it_moves_towards_the_ensemble():
    """The default strategy keeps a calibrated head only when KL(ensemble ‖ model) on the fusion set does not rise."""
    x = _x(100)
    replies = [reply(1, 1), reply(2, 2)]
    # a prior far from what both clients predict: calibrating to it moves the model away from their ensemble
    skewed = torch.tensor([1000.0] + [1.0] * 9)
    s = build_strategy("average", model_fn=model_fn, fusion_inputs=x)
    s.class_prior = lambda updates: (skewed, "test")
    arrays, _ = s.aggregate_train(1, replies)
    info = s.history[-1]["fusion-info"]
    assert info["refine-kept"] == 0 and info["refine-kl-after"] > info["refine-kl-before"]
    avg = average_state_dicts([_mlp(1).state_dict(), _mlp(2).state_dict()], [0.5, 0.5])
    for k, v in state_of(arrays).items():
        torch.testing.assert_close(v, avg[k])
    # the ensemble's own mean prediction as the prior: calibrating towards it is kept
    teachers = [_mlp(1), _mlp(2)]
    from fedfuse.fusion.distillation import teacher_probs
    ens_prior = teacher_probs(teachers, x, [0.5, 0.5]).mean(0)
    s2 = build_strategy("average", model_fn=model_fn, fusion_inputs=x, calibrate_min_gap=0.0)
    s2.class_prior = lambda updates: (ens_prior, "test")
    s2.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    info2 = s2.history[-1]["fusion-info"]
    assert info2["refine-kept"] == 1 and info2["refine-kl-after"] <= info2["refine-kl-before"]
    # a gap below calibrate_min_gap (default 0.2) leaves the aggregate as it is
    s3 = build_strategy("average", model_fn=model_fn, fusion_inputs=x)
    s3.class_prior = lambda updates: (ens_prior, "test")
    s3.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    info3 = s3.history[-1]["fusion-info"]
    assert info3["calibration-skipped"] == 1 and info3["calibration-gap-before"] < 0.2


def test_server_momentum_is_fedavgms_step_on_the_aggregate():
    """x_{t+1} = x_t + v_t, v_t = m v_{t-1} + (a_t - x_t); the first round is the aggregate itself."""
    x0 = _mlp(7).state_dict()
    s = build_strategy("average", model_fn=model_fn, fusion_inputs=_x(50), refine="none", server_momentum=0.5)
    assert build_strategy("average", model_fn=model_fn).momentum_step.momentum == 0.5  # the measured default
    s._global = ArrayRecord({k: v.clone() for k, v in x0.items()})
    a1, _ = s.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    avg1 = average_state_dicts([_mlp(1).state_dict(), _mlp(2).state_dict()], [0.5, 0.5])
    for k, v in state_of(a1).items():
        torch.testing.assert_close(v, avg1[k])
    s._global = a1
    a2, _ = s.aggregate_train(2, [reply(3, 3), reply(4, 4)])
    avg2 = average_state_dicts([_mlp(3).state_dict(), _mlp(4).state_dict()], [0.5, 0.5])
    for k, v in state_of(a2).items():
        expected = avg1[k] + 0.5 * (avg1[k] - x0[k]) + (avg2[k] - avg1[k])
        torch.testing.assert_close(v, expected, rtol=1e-5, atol=1e-6)
    assert s.history[-1]["fusion-info"]["step-norm"] > 0
    # a fallback restarts the momentum (the next global model did not come from it)
    s.reset_server_state()
    assert s.momentum_step.velocity is None
    with pytest.raises(ValueError, match="server_momentum"):
        build_strategy("average", model_fn=model_fn, server_momentum=1.0)
    with pytest.raises(ValueError, match="plain FedAvg"):
        build_strategy("fedavg", model_fn=model_fn, server_momentum=0.5)
    with pytest.raises(TypeError, match="server_momentum"):
        build_strategy("fedadam", model_fn=model_fn, server_momentum=0.5)


def test_a_linear_algebra_failure_inside_a_method_is_a_numerical_fusion_error():
    """An ill-conditioned eigen/least-squares step (torch LinAlgError) makes the round fall back, not the run crash."""
    from fedfuse.fusion import NumericalFusionError
    from fedfuse.fusion.registry import NoOptions

    @_register_once("test-linalg-fails", options=NoOptions, needs_data=False, any_module=True)
    def failing(models, **kw):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge (test)")
    with pytest.raises(NumericalFusionError, match="linear algebra failed"):
        fuse("test-linalg-fails", [_mlp(1), _mlp(2)])
