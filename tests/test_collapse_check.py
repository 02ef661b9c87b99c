"""A fused model that predicts one class for (almost) every fusion-set input, while the models' ensemble spreads its
predictions, is reported loudly (``fedfuse.fusion.output_checks``): a ``RuntimeWarning`` and
``info["collapse-warning"]``, carried into a strategy's round record. Finite weights and outputs, so no other check
sees it (``kd`` on ResNet-18 clients ended there at chance level, silently, before this check)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from fedfuse.flower import FusionStrategy
from fedfuse.fusion import METHOD_SPECS, METHODS, fuse_result
from fedfuse.fusion.output_checks import COLLAPSED_SHARE, collapse_reason, teacher_predictions
from fedfuse.models import build_model

from tests.test_strategies import SHAPE, _register_once, model_fn, reply

torch.set_num_threads(1)


def _mlp(seed):
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=1, seed=seed)


def _x(n=200, seed=0):
    return torch.randn(n, *SHAPE, generator=torch.Generator().manual_seed(seed))


def _collapse(model: torch.nn.Module, cls: int = 3) -> torch.nn.Module:
    """``model`` with its classifier's weights zeroed and a bias that picks ``cls``: one class for every input."""
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.zero_()
        last.bias[cls] = 5.0
    return model


@pytest.fixture
def collapsing_method():
    """A 'fusion' that returns model 0 collapsed to class 3 (finite weights and outputs)."""
    def _fn(models, **_):
        return _collapse(copy.deepcopy(models[0]))

    _register_once("test-collapsing", needs_data=True)(_fn)
    yield "test-collapsing"
    METHOD_SPECS.pop("test-collapsing", None)
    METHODS.pop("test-collapsing", None)


def test_collapse_reason_needs_one_class_against_a_spread_ensemble():
    spread = torch.arange(100) % 10
    one = torch.full((100,), 4)
    assert "class 4 for 100% of 100" in collapse_reason(one, spread, 10)
    assert "predicts 10 classes" in collapse_reason(one, spread, 10)
    almost = one.clone()
    assert COLLAPSED_SHARE == 0.8
    almost[:20] = 0      # 80 %: the threshold share, still collapsed
    assert collapse_reason(almost, spread, 10) is not None
    almost[:21] = 0      # 79 %: just below it
    assert collapse_reason(almost, spread, 10) is None
    assert collapse_reason(spread, spread, 10) is None          # a spread fused model
    assert collapse_reason(one, one, 10) is None                # the ensemble predicts one class too
    assert collapse_reason(one, torch.where(spread < 6, 4, spread), 10) is None   # ensemble's top class on 60 %
    assert collapse_reason(one[:10], spread[:10], 10) is None   # too few samples to judge


def test_teacher_predictions_are_the_weighted_ensemble_and_none_for_non_class_outputs():
    models, x = [_mlp(1), _mlp(2)], _x()
    with torch.no_grad():
        want = (0.25 * models[0](x).softmax(-1) + 0.75 * models[1](x).softmax(-1)).argmax(1)
    assert torch.equal(teacher_predictions("kd", models, x, [0.25, 0.75]), want)
    regressors = [torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 1)) for _ in range(2)]
    assert teacher_predictions("kd", regressors, x) is None


def test_a_collapsed_fusion_warns_and_records_it(collapsing_method):
    models, x = [_mlp(1), _mlp(2), _mlp(3)], _x()
    with pytest.warns(RuntimeWarning, match="'test-collapsing': the fused model predicts class 3 for 100% of 200"):
        res = fuse_result(collapsing_method, models, fusion_inputs=x)
    assert "collapsed to one prediction" in res.info["collapse-warning"]


def test_a_sound_fusion_and_models_that_agree_on_one_class_do_not_warn(collapsing_method):
    models, x = [_mlp(1), _mlp(2), _mlp(3)], _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = fuse_result("kd", models, fusion_inputs=x, epochs=2)
        assert "collapse-warning" not in res.info
        # every model predicts class 3 everywhere: the collapsed result is what they say, not a collapse
        same = [_collapse(_mlp(s)) for s in (1, 2, 3)]
        assert "collapse-warning" not in fuse_result(collapsing_method, same, fusion_inputs=x).info
        # data-free methods read no teacher outputs: not judged (no extra forward passes)
        assert "collapse-warning" not in fuse_result("average", [_collapse(_mlp(1)), _mlp(2)], fusion_inputs=x).info


def test_the_round_record_and_the_log_carry_the_warning(collapsing_method, caplog):
    s = FusionStrategy(collapsing_method, model_fn=model_fn, fusion_inputs=_x(), refine="none", guard=False)
    with pytest.warns(RuntimeWarning, match="collapsed"), caplog.at_level("WARNING", logger="flwr"):
        s.aggregate_train(1, [reply(1, 1), reply(2, 2)])
    assert "predicts class 3" in s.history[-1]["fusion-info"]["collapse-warning"]
    assert "round 1: fusion method 'test-collapsing': the fused model predicts class 3" in caplog.text


def test_a_collapsed_reference_keeps_its_row_with_the_warning_and_the_table_says_so(monkeypatch):
    """The app's one-shot references (KD, FedDF) fuse through ``fuse_result``; a collapsed one keeps its accuracy
    row with the ``warning``, and the run's references table marks it."""
    import fedfuse.references as references
    from fedfuse.flower.runner.compare import RunSummary, references_table

    real = references.fuse_result

    def kd_collapses(method, models, **kw):
        res = real(method, models, **kw)
        if method == "kd":
            res.model = _collapse(res.model)
            res.info["collapse-warning"] = "fusion method 'kd': the fused model predicts class 3 for 100% of 40 ..."
        return res

    monkeypatch.setattr(references, "fuse_result", kd_collapses)
    models, x = [_mlp(1), _mlp(2)], _x(60)
    ty = torch.arange(20) % 10
    refs = references.one_shot_references(models, [1, 1], [0, 1], test_x=x[40:], test_y=ty, fusion_inputs=x[:40])
    rows = {r["key"]: r for r in refs["rows"]}
    assert rows["kd"]["warning"].startswith("fusion method 'kd'") and rows["kd"]["accuracy"] == pytest.approx(0.1)
    assert "warning" not in rows["feddf"]
    table = references_table(RunSummary("kf-linear", "in-process", [{"round": 1, "test-accuracy": 0.5}],
                                        references=refs))
    kd_line = next(line for line in table.splitlines() if line.startswith("| KD"))
    assert "(collapsed: one class for almost every fusion-set input)" in kd_line
    assert "collapsed" not in next(line for line in table.splitlines() if line.startswith("| FedDF"))
