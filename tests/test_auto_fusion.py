"""``fuse("auto", ...)`` and the ``auto`` strategy: the average at once when the clients agree; otherwise the
candidate that agrees best with the clients' ensemble on a held-out part of the fusion set, with what was tried in
``info``."""

import copy

import pytest
import torch
from torch import nn

from fedfuse.fusion import FusionOptionError, fuse_result, register
from fedfuse.fusion.auto import split_fusion_set
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.fusion.refine import kl_to
from fedfuse.models import build_model
from fedfuse.training import train

X = torch.randn(200, 20, generator=torch.Generator().manual_seed(3))


def _client(seed, classes, init_seed=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=torch.Generator().manual_seed(99))).argmax(1)
    keep = torch.isin(y, torch.tensor(classes))
    m = build_model("mlp", num_classes=4, input_shape=(20,), width=32, depth=1,
                    seed=seed if init_seed is None else init_seed)
    train(m, x[keep], y[keep], epochs=15, lr=0.01, optimizer="adam", seed=seed)
    return m.eval()


def _broken(models, *, fusion_inputs, scores, weights, device, seed, options, info) -> nn.Module:
    out = copy.deepcopy(models[0])
    with torch.no_grad():
        for p in out.parameters():
            p.mul_(-30.0)
    return out


def _fails_on_the_whole_set(models, *, fusion_inputs, scores, weights, device, seed, options, info) -> nn.Module:
    from fedfuse.fusion import FusionError

    if len(fusion_inputs) == len(X):
        raise FusionError("test: refuses the whole fusion set")
    return fuse_result("feddf", models, fusion_inputs=fusion_inputs, seed=seed).model   # beats the average's KL


@pytest.fixture(autouse=True)
def broken_method():
    """A deliberately bad candidate, registered when a test runs (not at import: the contract suite parametrizes
    over every registered method when it is collected)."""
    from fedfuse.fusion import METHOD_SPECS

    if "test-auto-broken" not in METHOD_SPECS:
        register("test-auto-broken", needs_data=False, any_module=True)(_broken)
    if "test-auto-partial" not in METHOD_SPECS:
        register("test-auto-partial", any_module=True)(_fails_on_the_whole_set)


def test_agreeing_clients_get_the_average_without_trying_the_candidates():
    a = _client(0, [0, 1, 2, 3])
    res = fuse_result("auto", [a, copy.deepcopy(a)], fusion_inputs=X, seed=0)
    assert res.info["auto-choice"] == "average" and res.info["auto-seconds"] == {}
    assert res.info["auto-disagreement"] < 1e-6
    assert all(torch.allclose(v, a.state_dict()[k]) for k, v in res.model.state_dict().items())


def test_drifted_clients_get_the_candidate_with_the_best_held_out_agreement():
    models = [_client(1, [0, 1], init_seed=1), _client(2, [2, 3], init_seed=2)]
    res = fuse_result("auto", models, fusion_inputs=X, seed=5, agree_kl=0.0, criterion="kl",
                      candidates=["average", "kd", "test-auto-broken"], refit=False)
    scores = res.info["auto-scores"]
    assert set(scores) == {"average", "kd", "test-auto-broken"}
    assert res.info["auto-choice"] == min(scores, key=scores.get) != "test-auto-broken"
    _, held = split_fusion_set(X, 0.3, 5)
    target = teacher_probs(models, held, [0.5, 0.5])
    with torch.no_grad():
        assert kl_to(target, res.model(held)) == pytest.approx(scores[res.info["auto-choice"]], rel=1e-5)


def test_by_default_the_candidate_whose_top_class_agrees_most_with_the_ensemble_is_kept():
    models = [_client(1, [0, 1], init_seed=1), _client(2, [2, 3], init_seed=2)]
    res = fuse_result("auto", models, fusion_inputs=X, seed=5, agree_kl=0.0, candidates=["average", "kd", "kf-linear"],
                      refit=False)
    agree, kls = res.info["auto-agreement"], res.info["auto-scores"]
    assert res.info["auto-criterion"] == "agreement" and set(agree) == set(kls) == {"average", "kd", "kf-linear"}
    best = max(agree.values())
    # the first candidate (in the given order) with the highest agreement
    assert res.info["auto-choice"] == next(n for n in ("average", "kd", "kf-linear") if agree[n] == best)
    _, held = split_fusion_set(X, 0.3, 5)
    target = teacher_probs(models, held, [0.5, 0.5])
    with torch.no_grad():
        assert (res.model(held).argmax(-1) == target.argmax(-1)).float().mean().item() == pytest.approx(best)


def test_the_choice_is_refitted_on_the_whole_fusion_set_by_default():
    """The held-out part chooses; the returned model is the chosen method fused on the whole fusion set, the same
    model ``fuse(choice, ...)`` gives with the same seed (``refit=False``: the fit-part model the scores describe)."""
    models = [_client(1, [0, 1], init_seed=1), _client(2, [2, 3], init_seed=2)]
    res = fuse_result("auto", models, fusion_inputs=X, seed=5, agree_kl=0.0, candidates=["kd", "kf-linear"])
    choice = res.info["auto-choice"]
    assert choice in ("kd", "kf-linear") and res.info["auto-refit"] > 0
    whole = fuse_result(choice, models, fusion_inputs=X, seed=5).model
    assert all(torch.equal(v, whole.state_dict()[k]) for k, v in res.model.state_dict().items())
    part = fuse_result("auto", models, fusion_inputs=X, seed=5, agree_kl=0.0, candidates=["kd", "kf-linear"],
                       refit=False)
    assert part.info["auto-choice"] == choice and "auto-refit" not in part.info
    assert not all(torch.equal(v, whole.state_dict()[k]) for k, v in part.model.state_dict().items())


def test_a_refit_that_fails_keeps_the_fit_part_model_and_says_so():
    models = [_client(1, [0, 1], init_seed=1), _client(2, [2, 3], init_seed=2)]
    with pytest.warns(RuntimeWarning, match="refitting 'test-auto-partial'"):
        res = fuse_result("auto", models, fusion_inputs=X, seed=0, agree_kl=0.0, candidates=["test-auto-partial"],
                          criterion="kl")
    assert res.info["auto-choice"] == "test-auto-partial"
    assert res.info["auto-refit"].startswith("failed, the fit-part model kept: FusionError: test: refuses")


def test_the_default_candidates_include_distillation_and_neuron_interpolation():
    """Distillation joined the label-free candidates with the top-1 agreement criterion (measured across the
    MNIST-1D and Fashion-MNIST one-shot cells, docs/one-shot.md)."""
    from fedfuse.fusion.auto import DEFAULT_CANDIDATES

    assert {"kf-linear", "feddf", "kd"} <= set(DEFAULT_CANDIDATES)
    models = [_client(1, [0, 1], init_seed=1), _client(2, [2, 3], init_seed=2)]
    res = fuse_result("auto", models, fusion_inputs=X, seed=0, agree_kl=0.0)
    assert set(res.info["auto-agreement"]) == set(DEFAULT_CANDIDATES)
    with pytest.raises(FusionOptionError, match="refit"):
        fuse_result("auto", models, fusion_inputs=X, refit="yes")


def test_refine_variants_are_candidates_too():
    models = [_client(1, [0, 1], init_seed=1), _client(2, [2, 3], init_seed=2)]
    val = [(X[:40], models[0](X[:40]).argmax(-1).detach())]
    res = fuse_result("auto", models, fusion_inputs=X, seed=0, candidates=["average", "kf-linear"],
                      refines=["none", "calibrate"], validation=val)
    assert set(res.info["auto-accuracy"]) == {"average", "average+calibrate", "kf-linear", "kf-linear+calibrate"}
    best = max(res.info["auto-accuracy"].values())
    assert res.info["auto-accuracy"][res.info["auto-choice"]] == best
    with pytest.raises(FusionOptionError, match="refines"):
        fuse_result("auto", models, fusion_inputs=X, refines=["polish"])


def test_candidates_that_cannot_take_the_models_are_skipped_and_reported():
    models = [_client(1, [0, 1]), _client(2, [2, 3])]
    res = fuse_result("auto", models, fusion_inputs=X, seed=0, agree_kl=0.0, candidates=("average", "hf-linear"),
                      max_seconds=0.0)
    assert "auto-choice" in res.info
    three = models + [_client(3, [1, 2])]
    res3 = fuse_result("auto", three, fusion_inputs=X, seed=0, agree_kl=0.0, candidates=("average", "hf-linear"))
    assert "hf-linear" in res3.info["auto-skipped"] and res3.info["auto-choice"] == "average"


@pytest.mark.parametrize("options, match", [({"candidates": ["auto"]}, "candidates"),
                                            ({"candidates": ["kf-linaer"]}, "candidates"),
                                            ({"candidates": ["ensemble"]}, "candidates"),
                                            ({"holdout": 1.0}, "holdout"),
                                            ({"criterion": "accuracy"}, "criterion")])
def test_bad_options_name_the_key(options, match):
    with pytest.raises(FusionOptionError, match=match):
        fuse_result("auto", [_client(0, [0, 1])] * 2, fusion_inputs=X, **options)


def test_the_label_free_auto_method_as_a_round_aggregation_records_its_choice_every_round():
    """``fuse('auto')`` as a ``FusionStrategy`` method (strategy name ``auto`` is the client-scored selection of
    ``fedfuse.flower.aggregators.selection``; the library's label-free ``auto`` stays usable as a round's aggregation)."""
    from unittest.mock import Mock

    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    from fedfuse.flower import FusionStrategy
    from fedfuse.strategy_specs import fusion_spec

    def reply(node, model):
        msg = Mock(spec=Message)
        msg.metadata = Mock(src_node_id=node)
        msg.has_error.return_value = False
        msg.content = RecordDict({"arrays": ArrayRecord({k: Array(v.numpy().copy())
                                                         for k, v in model.state_dict().items()}),
                                  "metrics": MetricRecord({"num-examples": 50, "partition-id": node})})
        return msg

    def model_fn():
        return build_model("mlp", num_classes=4, input_shape=(20,), width=32, depth=1, seed=0)

    a = _client(0, [0, 1, 2, 3], init_seed=0)
    s = FusionStrategy(method="auto", registry_entry=fusion_spec("auto"), model_fn=model_fn, fusion_inputs=X,
                       refine="none", guard=False, fusion_options={"candidates": ["average", "kd"], "criterion": "kl"})
    s.aggregate_train(1, [reply(1, a), reply(2, copy.deepcopy(a))])
    assert s.history[-1]["fusion-info"]["auto-choice"] == "average"
    drift = [_client(1, [0, 1], init_seed=0), _client(2, [2, 3], init_seed=0)]
    s.aggregate_train(2, [reply(1, drift[0]), reply(2, drift[1])])
    info = s.history[-1]["fusion-info"]
    assert info["auto-disagreement"] > 0.02 and set(info["auto-scores"]) == {"average", "kd"}
    assert info["auto-choice"] == min(info["auto-scores"], key=info["auto-scores"].get)


def test_with_validation_sets_it_chooses_by_validation_accuracy():
    models = [_client(1, [0, 1], init_seed=1), _client(2, [2, 3], init_seed=2)]
    g = torch.Generator().manual_seed(7)
    xv = torch.randn(200, 20, generator=g)
    yv = (xv @ torch.randn(20, 4, generator=torch.Generator().manual_seed(99))).argmax(1)
    val = [(xv[:100], yv[:100]), (xv[100:], yv[100:])]
    res = fuse_result("auto", models, fusion_inputs=X, seed=0, validation=val,
                      candidates=("average", "kd", "test-auto-broken"))
    acc = res.info["auto-accuracy"]
    assert set(acc) == {"average", "kd", "test-auto-broken"}
    assert res.info["auto-choice"] == max(acc, key=acc.get) != "test-auto-broken"
    with torch.no_grad():
        got = float((res.model(xv).argmax(-1) == yv).float().mean())
    assert got == pytest.approx(acc[res.info["auto-choice"]])
    with pytest.raises(FusionOptionError, match="validation"):
        fuse_result("auto", models, fusion_inputs=X, validation=[xv])


@pytest.mark.parametrize("case,match", [("labels", r"set 1's labels span \[0, 7\], but the models have 4 classes"),
                                        ("negative", r"set 0's labels span \[-1, "),
                                        ("nan", r"set 0's inputs x have NaN"),
                                        ("float-labels", r"set 0's labels y must be a 1-D integer"),
                                        ("shape", r"model 0 cannot take set 1's inputs of shape \[10, 7\]")])
def test_bad_validation_sets_are_refused_at_the_door(case, match):
    """Issue 45: labels out of range or NaN inputs silently picked 'average' (every candidate scored alike); a wrong x
    shape was a raw RuntimeError. Each is a FusionOptionError (a ValueError) before any candidate runs."""
    models = [build_model("mlp", num_classes=4, input_shape=(20,), width=8, depth=1, seed=s) for s in (1, 2)]
    g = torch.Generator().manual_seed(0)
    val = [(torch.randn(10, 20, generator=g), torch.arange(10) % 4) for _ in range(2)]
    if case == "labels":
        val[1] = (val[1][0], torch.arange(10) % 8)
    elif case == "negative":
        val[0] = (val[0][0], val[0][1] - 1)
    elif case == "nan":
        val[0][0][3, 2] = float("nan")
    elif case == "float-labels":
        val[0] = (val[0][0], val[0][1].float())
    else:
        val[1] = (torch.randn(10, 7), val[1][1])
    with pytest.raises(FusionOptionError, match=match):
        fuse_result("auto", models, fusion_inputs=X, validation=val, candidates=("average", "kf-linear"))
