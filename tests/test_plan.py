"""The run plan (``fedfuse.plan``): the measured defaults resolved once, recorded, read by the server; ``auto`` is the
clients' vote, not the fusion method ``auto``, so a run that only averages needs no fusion set."""

import json

import pytest

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.flower.server_app import selection_options
from fedfuse.plan import AUTO_SERVER_MOMENTUM, make_plan

TINY = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 3,
        "num-server-rounds": 2, "local-epochs": 1, "fusion-set-size": 60}


def test_the_default_plan_says_auto_averages_and_why():
    plan = make_plan(parse_run_config({}))
    assert plan.round_aggregation == "fedavg" and not plan.fuses and plan.server_momentum is None
    (decision,) = plan.decisions
    assert decision.setting == "strategy" and decision.value == "auto -> fedavg"
    assert "auto-fusion-epochs 10" in decision.why and decision.doc == "docs/multi-round.md"
    as_json = json.loads(json.dumps(plan.to_json()))
    assert as_json["round-aggregation"] == "fedavg" and as_json["decisions"][0]["value"] == "auto -> fedavg"


def test_plain_sgd_clients_get_the_momentum_step_from_the_plan():
    plan = make_plan(parse_run_config({"optimizer": "sgd", "client-options.momentum": 0.0}))
    assert plan.round_aggregation == "average" and plan.server_momentum == AUTO_SERVER_MOMENTUM
    assert plan.candidates[0] == "average"


@pytest.mark.parametrize("given", [
    {"mode": "one-shot", "num-server-rounds": 1},
    {"mode": "one-shot", "num-server-rounds": 1, "head-round": False},
    {"mode": "one-shot", "num-server-rounds": 1, "model": "vit"},
    {"local-epochs": 10},
    {"strategy-options.auto-candidates": "average,feddf", "local-epochs": 12},
])
def test_the_server_builds_auto_from_the_plan(given):
    cfg = parse_run_config(given)
    plan = make_plan(cfg)
    assert selection_options(cfg)["candidates"] == plan.candidates and plan.fuses
    assert plan.round_aggregation is None and plan.decisions[0].setting == "strategy-options.auto-candidates"


def test_a_run_that_only_averages_needs_no_fusion_set():
    for given in ({}, {"strategy": "fedavg"}, {"strategy": "average", "strategy-options.refine": "none"}):
        cfg = parse_run_config({**given, "data-options.public-fraction": 0.0})
        assert not make_plan(cfg).fuses
    # a run whose auto builds fusion candidates still needs one, named with the candidate
    with pytest.raises(ConfigError, match=r"candidate 'feddf' cannot run on this setup: .*needs a fusion set"):
        parse_run_config({"local-epochs": 10, "data-options.public-fraction": 0.0})


def test_auto_is_not_the_fusion_method_auto():
    with pytest.raises(ConfigError, match="strategy 'auto' is not a fusion method and takes no fusion_options"):
        parse_run_config({"fusion-options": "{refines=['none']}"})
    with pytest.raises(ConfigError, match="strategy 'auto' chooses between candidate aggregations and takes no "
                                          "refinement"):
        parse_run_config({"strategy-options.refine": "distill"})


def test_an_averaging_run_without_a_fusion_set_completes_and_records_its_plan(tmp_path):
    from fedfuse.flower.runner.inprocess import run_inprocess

    out = run_inprocess({**TINY, "data-options.public-fraction": 0.0, "output-dir": str(tmp_path), "run-name": "p"},
                        3, echo=False)
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["fusion-set-samples"] == 0 and res["plan"]["round-aggregation"] == "fedavg"
    assert res["plan"]["decisions"][0]["value"] == "auto -> fedavg"
    assert len(res["rounds"]) == 1 + 2 + 1 and res["rounds"][-1]["test-accuracy"] > 0.2   # rounds 0..2, head round


def test_a_client_app_parses_the_run_config_once(monkeypatch):
    """Every message handed the ClientApp the whole run config, re-parsed (and re-checked) each time; now the first
    message's parse is reused for the run (``RunConfig`` is frozen)."""
    from fedfuse import config
    from fedfuse.flower import client_app
    from fedfuse.flower.tiers import client_tiers

    calls = []
    real = config.parse_run_config
    monkeypatch.setattr(config, "parse_run_config", lambda rc, **kw: calls.append(1) or real(rc, **kw))
    config._parse_items.cache_clear()
    run = {**TINY, "seed": 7}
    first = config.parse_once(run)
    assert all(config.parse_once(dict(run)) is first for _ in range(5)) and len(calls) == 1
    assert config.parse_once({**run, "seed": 8}).seed == 8 and len(calls) == 2
    assert client_app.parse_once is config.parse_once and client_tiers.parse_once is config.parse_once


def test_one_shot_auto_stacks_the_clients_where_the_run_allows_it_and_says_why_not_elsewhere():
    """The one-shot default with the head round, on a measured family and at most ONE_SHOT_STACK_MAX_CLIENTS clients:
    ``stack`` alone (the plan, its decision, the strategy's options, a run config whose check passes); the
    single-model candidate, with the reason in the plan's decision, where stacking is not measured or not possible."""
    from fedfuse.plan import ONE_SHOT_STACK_FAMILIES, ONE_SHOT_STACK_MAX_CLIENTS

    base = {"dataset": "fashion-mnist", "model": "lenet", "mode": "one-shot", "num-server-rounds": 1,
            "local-epochs": 10, "num-clients": 5}
    for model in ONE_SHOT_STACK_FAMILIES:
        cfg = parse_run_config({**base, "model": model})
        plan = make_plan(cfg)
        assert plan.candidates == ("stack",) and plan.candidate_refine == {} and plan.fuses, model
        assert selection_options(cfg)["candidates"] == ("stack",) and selection_options(cfg)["one_shot"]
        [decision] = [d for d in plan.decisions if d.setting == "strategy-options.auto-candidates"]
        assert decision.value == "stack" and "5 x the clients' model" in decision.why
    limit = ONE_SHOT_STACK_MAX_CLIENTS
    for extra, single, why in (
            ({"head-round": False}, ("feddf", "kf-linear"), None),
            ({"auto-candidates": "kf-linear"}, ("kf-linear",), None),
            ({"strategy-options.refine": "none"}, ("kf-linear",), "refine is set"),
            ({"model": "vit"}, ("feddf",), "'vit' is not measured stacked"),
            ({"num-clients": limit + 1}, ("kf-linear",), f"num-clients {limit + 1} > {limit}"),
            ({"secure-aggregation": True}, ("kf-linear",), "secure-aggregation is on"),
            ({"robust": True}, ("kf-linear",), "robust is on")):
        plan = make_plan(parse_run_config({**base, **extra}))
        assert plan.candidates == single, extra
        if why is not None:
            [decision] = [d for d in plan.decisions if d.setting == "strategy-options.auto-candidates"]
            assert "not 'stack': " in decision.why and why in decision.why, (extra, decision.why)
    assert make_plan(parse_run_config({**base, "mode": "multi-round", "num-server-rounds": 3})).candidates != (
        "stack",)


def test_one_shot_with_the_head_round_distils_its_kf_linear_candidate_and_says_so():
    """The single-model one-shot choice (auto, head round, LeNet, ``auto-candidates='kf-linear'`` or where ``stack``
    is not taken): kf-linear distilled from the clients' ensemble (τ 4, mixup) before the head round, in the plan, its
    decisions and the strategy's options; not without the head round, not with ``refine='none'``, not where the
    candidate is FedDF (ViT), not for a family it is not measured on (CNN: kf-linear + head round) nor in multi-round
    runs."""
    from fedfuse.plan import ONE_SHOT_DISTILL

    base = {"dataset": "fashion-mnist", "model": "lenet", "mode": "one-shot", "num-server-rounds": 1,
            "local-epochs": 10, "num-clients": 5, "auto-candidates": "kf-linear"}
    cfg = parse_run_config(base)
    plan = make_plan(cfg)
    assert plan.candidates == ("kf-linear",) and plan.candidate_refine == {"kf-linear": ONE_SHOT_DISTILL}
    assert ONE_SHOT_DISTILL["augmentation"] == "mixup" and ONE_SHOT_DISTILL["temperature"] == 4.0
    assert any(d.setting == "strategy-options.refine" and "distill" in str(d.value) for d in plan.decisions)
    assert selection_options(cfg)["candidate_refine"] == plan.candidate_refine
    assert plan.to_json()["candidate-refine"] == plan.candidate_refine
    assert make_plan(parse_run_config({**base, "num-clients": 11})
                     ).candidate_refine == {"kf-linear": ONE_SHOT_DISTILL}
    for extra in ({"head-round": False}, {"strategy-options.refine": "none"}, {"model": "vit", "auto-candidates": "feddf"},
                  {"model": "cnn"}, {"mode": "multi-round", "num-server-rounds": 3}):
        assert make_plan(parse_run_config({**base, **extra})).candidate_refine == {}, extra
