"""``strategy='auto'`` (``fedfuse.flower.aggregators.selection``): candidates checked naming the key, the scoring query through
fedfuse's real ClientApp, the choice is the candidate with the best client-scored accuracy, malformed or missing
scores are rejected with a logged reason, and momentum follows the chosen step."""

from unittest.mock import Mock

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfuse.config import ConfigError, parse_run_config
from fedfuse.flower import build_strategy
from fedfuse.flower.aggregators.candidates import read_score_query, score_query_content
from fedfuse.flower.client_app import make_client_app
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.flower.aggregators.selection import SelectionStrategy
from fedfuse.fusion import fuse_result
from fedfuse.models import build_model
from fedfuse.strategy_specs import check_candidates
from fedfuse.flower.runner.inprocess import (SERVER_TASK_ID, SUPERLINK_NODE_ID, LocalGrid, fused_run_config,
                                             task_identity)

SHAPE = (1, 8, 8)
RUN = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 2,
       "local-epochs": 1, "importance-samples": 32}


def model_fn(seed=0):
    return build_model("mlp", num_classes=10, input_shape=SHAPE, width=16, depth=1, seed=seed)


def test_candidates_are_checked_naming_the_bad_entry():
    assert check_candidates(["average", "fedavg", "kf-gradient"]) == ("average", "fedavg", "kf-gradient")
    with pytest.raises(ValueError, match="did you mean 'feddf'"):
        check_candidates(["average", "fedff"])
    with pytest.raises(ValueError, match="repeat"):
        check_candidates(["average", "average"])
    with pytest.raises(ValueError, match="not 'average', 'fedavg' or a fusion method"):
        check_candidates(["fedprox"])
    with pytest.raises(ValueError, match="not 'average', 'fedavg' or a fusion method"):
        check_candidates(["auto"])


def test_a_candidate_that_cannot_run_with_the_clients_is_refused_at_config_time():
    """Issue 45: hf-linear (at most 2 models) with 4 clients passed the check and was skipped every round, its warning
    hidden among Flower's. Now a ConfigError naming the key, the candidate and why."""
    with pytest.raises(ConfigError, match=r"'strategy-options.auto-candidates': candidate 'hf-linear' cannot run on this setup: .*at "
                                          r"most 2 models, got 4 \(4 clients per round"):
        parse_run_config({"strategy": "auto", "auto-candidates": "fedavg,hf-linear"})
    assert parse_run_config({"strategy": "auto", "auto-candidates": "fedavg,hf-linear", "num-clients": 2}
                            ).auto_candidate_names == ("fedavg", "hf-linear")
    # kf-linear takes residual models since issue 57 (its graph variant): a candidate there, not a refusal
    assert parse_run_config({"strategy": "auto", "auto-candidates": "average,kf-linear", "model": "resnet"}
                            ).auto_candidate_names == ("average", "kf-linear")


def test_the_tiered_default_note_is_said_once_by_the_server_and_recorded(caplog):
    """Issue 45: client-tiers with the default strategy printed the raw UserWarning with its source line about ten
    times (runner, server, every ClientApp parse). It is a ConfigNote: the ServerApp logs it once and records it; the
    ClientApps and runners collect theirs silently."""
    import logging
    import warnings
    from types import SimpleNamespace

    from fedfuse.config import ConfigNote, config_notes
    from fedfuse.flower.runner.run import preflight_or_exit
    from fedfuse.flower.server_app import check_run_config

    run_config = {"strategy": "auto", "client-tiers": "1,0.5"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # any warning escaping would raise here
        with config_notes() as notes:
            parse_run_config(run_config)
            parse_run_config(run_config)
        assert preflight_or_exit(run_config).strategy == "average"
    assert len(notes) == 1 and "no capacity-tier form" in notes[0]
    assert issubclass(ConfigNote, UserWarning)
    recorded: list[str] = []
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)   # Flower's logger may not propagate to the root one
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cfg = check_run_config(SimpleNamespace(run_config=run_config), recorded)
    finally:
        flwr_logger.removeHandler(caplog.handler)
    assert cfg.strategy == "average" and recorded == notes
    said = {id(r): r.getMessage() for r in caplog.records if "no capacity-tier form" in r.getMessage()}
    said = list(said.values())
    assert len(said) == 1 and said[0].startswith("fedfuse: run-config key 'strategy'")


def test_run_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="'strategy-options.auto-candidates'.*did you mean"):
        parse_run_config({"strategy": "auto", "auto-candidates": "average,kf-gradiant"})
    with pytest.raises(ConfigError, match="'strategy-options.auto-candidates' applies to strategy 'auto' only"):
        parse_run_config({"strategy": "average", "auto-candidates": "average,feddf"})
    with pytest.warns(UserWarning, match="no capacity-tier form"):
        assert parse_run_config({"strategy": "auto", "client-tiers": "1,0.5"}).strategy == "average"
    # one-shot width tiers: clients from their own initialisations, whose sub-model average is at chance: a fusion
    one_shot = {"strategy": "auto", "client-tiers": "1,0.5", "mode": "one-shot", "num-server-rounds": 1}
    with pytest.warns(UserWarning, match="uses 'kf-linear'"):
        assert parse_run_config(one_shot).strategy == "kf-linear"
    with pytest.warns(UserWarning, match="uses 'feddf'"):
        assert parse_run_config({**one_shot, "model": "vit"}).strategy == "feddf"
    with pytest.raises(ConfigError, match="'strategy-options.auto-fusion-epochs' applies to strategy 'auto' only"):
        parse_run_config({"strategy": "average", "auto-fusion-epochs": 3})
    with pytest.raises(ConfigError, match="'strategy-options.auto-fusion-epochs'"):
        parse_run_config({"strategy": "auto", "auto-candidates": "feddf", "local-epochs": 1})
    parse_run_config({"strategy": "auto", "auto-candidates": "feddf", "local-epochs": 1, "mode": "one-shot",
                      "num-server-rounds": 1})   # one round: fusion candidates are always on
    from fedfuse.flower.server_app import selection_options
    one = parse_run_config({"mode": "one-shot", "num-server-rounds": 1, "local-epochs": 2})
    assert selection_options(one)["local_epochs"] is None
    assert selection_options(one)["candidates"] == ("stack",)   # one-shot with the head round (default): stacked
    vit = parse_run_config({"mode": "one-shot", "num-server-rounds": 1, "model": "vit"})
    assert selection_options(vit)["candidates"] == ("feddf",)   # kf-linear takes no transformer blocks
    resnet = parse_run_config({"mode": "one-shot", "num-server-rounds": 1, "model": "resnet"})
    assert selection_options(resnet)["candidates"] == ("stack",)       # MNIST-1D ResNet: +9 over kf-linear + head
    many = parse_run_config({"mode": "one-shot", "num-server-rounds": 1, "model": "resnet", "num-clients": 20})
    assert selection_options(many)["candidates"] == ("kf-linear",)     # ResNet-18 and MNIST-1D ResNet: above FedDF
    assert selection_options(many)["candidate_refine"] == {}           # LeNet's distillation lowers it there
    lenet = parse_run_config({"mode": "one-shot", "num-server-rounds": 1, "model": "lenet", "num-clients": 20})
    assert selection_options(lenet)["candidates"] == ("kf-linear",)   # Fashion-MNIST O1: kf-linear's features best
    strict = parse_run_config({"mode": "one-shot", "num-server-rounds": 1, "head-round": False})
    # strict one-shot: no plain average of independently initialised models (at chance; a liars' target)
    assert selection_options(strict)["candidates"] == ("feddf", "kf-linear")
    given = parse_run_config({"mode": "one-shot", "num-server-rounds": 1, "auto-candidates": "average,feddf"})
    assert selection_options(given)["candidates"] == ("average", "feddf")   # a user's list is kept
    assert selection_options(parse_run_config({"local-epochs": 2}))["local_epochs"] == 2
    cfg = parse_run_config({"strategy": "auto", "auto-candidates": "fedavg, kf-gradient"})
    assert cfg.auto_candidate_names == ("fedavg", "kf-gradient")


def test_score_query_round_trip():
    states = [model_fn(s).state_dict() for s in (0, 1)]
    msg = Mock(spec=Message)
    msg.content = score_query_content(states)
    back = read_score_query(msg)
    assert len(back) == 2 and all(torch.equal(back[i][k], states[i][k]) for i in range(2) for k in states[i])
    msg.content = RecordDict({"config": ConfigRecord({"candidates": 3}), "candidate-0": ArrayRecord(states[0])})
    with pytest.raises(ValueError, match="arrays missing"):
        read_score_query(msg)


def _strategy(**kw):
    return build_strategy("auto", model_fn=model_fn, fusion_inputs=torch.rand(40, *SHAPE), min_train_nodes=2,
                          min_available_nodes=2, **kw)


def test_auto_round_through_fedfuse_client_app_keeps_the_best_client_scored_candidate():
    s = _strategy(candidates=("average", "fedavg", "kd"))
    assert isinstance(s, SelectionStrategy)
    grid = LocalGrid(make_client_app(), fused_run_config(RUN), 2)
    with task_identity(grid.run.run_id, SUPERLINK_NODE_ID, SERVER_TASK_ID):
        msgs = list(s.configure_train(1, ArrayRecord(model_fn().state_dict()), ConfigRecord({}), grid))
        replies = list(grid.send_and_receive(msgs))
        arrays, _ = s.aggregate_train(1, replies)
    info = s.history[-1]["fusion-info"]
    assert arrays is not None and info["select-clients"] == 2 and info["select-fallback"] is False, info
    # the round's aggregation time split: building the candidates, then the clients' scoring exchange
    assert info["select-build-seconds"] > 0 and info["select-query-seconds"] > 0
    assert info["select-build-seconds"] + info["select-query-seconds"] <= s.history[-1]["fusion-seconds"]
    acc = info["select-accuracy"]
    assert set(acc) == {"average", "fedavg", "kd"} and all(0 <= a <= 1 for a in acc.values())
    best = max(acc.values())
    assert acc[info["select-choice"]] == best
    # first on a tie: round 1 has no momentum yet, so 'average' == 'fedavg' and 'fedavg' is never chosen
    assert info["select-choice"] != "fedavg"


class ScoringGrid:
    """Answers a scoring query with fixed accuracies per node (``None``: a malformed reply)."""

    def __init__(self, accs: dict[int, list[float] | None]):
        self.accs = accs
        self.sent = []

    def send_and_receive(self, msgs, timeout=None):
        out = []
        for m in msgs:
            self.sent.append(m)
            reply = Mock(spec=Message)
            reply.metadata = Mock(src_node_id=m.metadata.dst_node_id)
            reply.has_error.return_value = False
            accs = self.accs.get(m.metadata.dst_node_id)
            rec = {"num-examples": 10} if accs is None else {
                "num-examples": 10 * m.metadata.dst_node_id, **{f"accuracy-{i}": a for i, a in enumerate(accs)}}
            reply.content = RecordDict({"metrics": MetricRecord(rec)})
            out.append(reply)
        return out


def _updates():
    return [ClientUpdate(n, n, model_fn(n).state_dict(), None, 20, {}) for n in (1, 2, 3)]


@pytest.fixture
def identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):   # Message() needs a run identity
        monkeypatch.setattr(TaskIdentity, attr, value)


def test_choice_is_the_sample_weighted_best_and_malformed_scores_are_rejected(identity, caplog):
    s = _strategy(candidates=("average", "fedavg", "kd"))
    s._global = ArrayRecord(model_fn(9).state_dict())
    # node 1 (weight 10) prefers kd, node 2 (weight 20) prefers fedavg, node 3's reply is malformed
    s._grid = ScoringGrid({1: [0.1, 0.2, 0.9], 2: [0.1, 0.5, 0.3], 3: None})
    state, info, _ = s.aggregate(1, _updates())
    assert info["select-clients"] == 2
    assert info["select-accuracy"]["kd"] == pytest.approx((0.9 * 10 + 0.3 * 20) / 30)
    assert info["select-choice"] == "kd"
    assert "scoring replies rejected" in caplog.text and "node 3" in caplog.text
    # momentum restarts at the step taken: v = x_new - x
    prev = s._global.to_torch_state_dict()
    for k, v in s.momentum_step.velocity.items():
        assert torch.allclose(v, state[k].double() - prev[k].double())


def test_no_scores_keeps_the_first_candidate_loudly(identity, caplog):
    s = _strategy(candidates=("fedavg", "kd"))
    s._grid = ScoringGrid({1: None, 2: None, 3: None})
    ups = _updates()
    state, info, _ = s.aggregate(1, ups)
    assert info["select-choice"] == "fedavg" and info["select-fallback"] is True
    assert "no client scored the candidates" in caplog.text
    avg = s.weighted_average(ups)
    assert all(torch.equal(state[k], avg[k]) for k in avg)


def test_fusion_candidates_are_off_below_the_local_epochs_threshold(identity):
    """Short local training: the clients agree, so no fusion candidate and no vote; the first array candidate is
    taken at the cost of the average (no query message)."""
    s = _strategy(candidates=("fedavg", "average", "kd"), local_epochs=1, fusion_min_epochs=10)
    s._grid = ScoringGrid({1: [0.1, 0.9], 2: [0.1, 0.9], 3: [0.1, 0.9]})
    ups = _updates()
    state, info, _ = s.aggregate(1, ups)
    assert info["select-choice"] == "fedavg" and info["select-query"] is False and info["select-accuracy"] is None
    assert "local epochs 1 < 10" in info["select-skipped"]["kd"] and info["select-fallback"] is False
    assert s._grid.sent == []
    avg = s.weighted_average(ups)
    assert all(torch.equal(state[k], avg[k]) for k in avg)
    # with the momentum candidate first it is that step, still without a query
    m = _strategy(candidates=("average", "fedavg"), local_epochs=1, fusion_min_epochs=10)
    m._grid = ScoringGrid({1: [0.1, 0.9], 2: [0.1, 0.9], 3: [0.1, 0.9]})
    _, info, _ = m.aggregate(1, _updates())
    assert info["select-choice"] == "average" and m._grid.sent == []
    on = _strategy(candidates=("average", "kd"), local_epochs=10, fusion_min_epochs=10)
    assert on.fusion_off is None
    with pytest.raises(ValueError, match="every candidate is a fusion"):
        _strategy(candidates=("kd",), local_epochs=1)


def test_auto_momentum_rule_takes_fedavgm_step_for_plain_sgd_clients():
    """Below auto-fusion-epochs auto takes one array candidate with no query: the momentum step (FedAvgM, 0.5) when
    the clients train plain SGD, else the plain average; ``auto-momentum`` overrides, and where it cannot apply it
    names the key."""
    from fedfuse.config import auto_round_aggregation
    from fedfuse.flower.server_app import selection_options

    plain = {"optimizer": "sgd", "momentum": 0.0, "local-epochs": 1, "num-clients": 10}
    for participation in (0.5, 1.0):
        cross = parse_run_config({**plain, "fraction-train": participation})
        assert auto_round_aggregation(cross) == "average"
        opts = selection_options(cross)
        assert opts["candidates"][0] == "average" and opts["server_momentum"] == 0.5
    # clients with their own momentum, or Adam (the default): the plain average as before
    for other in ({**plain, "fraction-train": 0.5, "momentum": 0.9}, {"optimizer": "adam", "fraction-train": 0.5}, {}):
        cfg = parse_run_config(other)
        assert auto_round_aggregation(cfg) == "fedavg"
        assert selection_options(cfg)["candidates"][0] == "fedavg" and "server_momentum" not in selection_options(cfg)
    # a user's server momentum is kept (baseline_options passes it), 'off' and 'on' override the rule
    assert "server_momentum" not in selection_options(parse_run_config({**plain, "fraction-train": 0.5,
                                                                          "server-momentum": 0.5}))
    assert auto_round_aggregation(parse_run_config({**plain, "fraction-train": 0.5, "auto-momentum": "off"})) == "fedavg"
    assert auto_round_aggregation(parse_run_config({"auto-momentum": "on", "local-epochs": 1})) == "average"
    # long local training: the clients' vote, not the rule; one-shot: no rounds to carry momentum
    assert auto_round_aggregation(parse_run_config({**plain, "fraction-train": 0.5, "local-epochs": 10})) is None
    with pytest.raises(ConfigError, match="'strategy-options.auto-momentum'"):
        parse_run_config({"auto-momentum": "on", "local-epochs": 10})
    with pytest.raises(ConfigError, match="'strategy-options.auto-momentum'"):
        parse_run_config({"auto-momentum": "on", "mode": "one-shot", "num-server-rounds": 1})
    with pytest.raises(ConfigError, match="'strategy-options.auto-momentum'"):
        parse_run_config({"auto-momentum": "on", "local-epochs": 1, "auto-candidates": "fedavg,feddf"})
    with pytest.raises(ConfigError, match="'strategy-options.auto-momentum' applies to strategy 'auto' only"):
        parse_run_config({"strategy": "fedavg", "auto-momentum": "off"})



def test_a_candidate_that_reads_importance_scores_gets_the_clients_scores(monkeypatch):
    """auto's kf-linear candidate is the kf-linear strategy's fusion: the clients are asked for their importance
    scores and the candidate is fused with them (not with uniform scores, the library's answer to none)."""
    from fedfuse.flower.aggregators import selection

    calls, real = [], selection.fuse_result

    def spy(name, models, **kw):
        calls.append((name, kw.get("scores")))
        return real(name, models, **kw)

    monkeypatch.setattr(selection, "fuse_result", spy)
    s = _strategy(candidates=("fedavg", "kf-linear"))
    assert s.wants_client_scores
    grid = LocalGrid(make_client_app(), fused_run_config({**RUN, "importance": "deeplift"}), 2)
    with task_identity(grid.run.run_id, SUPERLINK_NODE_ID, SERVER_TASK_ID):
        msgs = list(s.configure_train(1, ArrayRecord(model_fn().state_dict()), ConfigRecord({}), grid))
        assert all(m.content["config"]["need-importance"] for m in msgs)
        replies = list(grid.send_and_receive(msgs))
        arrays, _ = s.aggregate_train(1, replies)
    assert arrays is not None and [name for name, _ in calls] == ["kf-linear"]
    scores = calls[0][1]
    assert scores is not None and len(scores) == 2
    level = next(iter(scores[0]))
    assert not torch.equal(scores[0][level], torch.ones_like(scores[0][level]))   # computed, not uniform
    # fusion off (short local training): no candidate reads scores, so the clients are not asked for them
    assert not _strategy(candidates=("fedavg", "kf-linear"), local_epochs=1, fusion_min_epochs=10).wants_client_scores
    assert not _strategy(candidates=("fedavg", "kd")).wants_client_scores


def test_a_candidate_with_a_refinement_is_distilled_before_it_is_scored(identity, caplog):
    """``candidate_refine`` (one-shot's kf-linear with the head round): the candidate's fused model is distilled from
    the clients' ensemble with the given options, the round records what the distillation did, and a bad entry is a
    ValueError at construction naming it."""
    import logging

    caplog.set_level(logging.INFO)
    ups = _updates()
    # 4 epochs at most: refine='distill' with its own options (50 epochs, patience 5) would run 5 without a better one
    opts = {"temperature": 4.0, "epochs": 4, "patience": 2, "augmentation": "mixup"}
    s = _strategy(candidates=("kf-linear",), candidate_refine={"kf-linear": opts})
    s._grid = ScoringGrid({1: [0.5], 2: [0.5], 3: [0.5]})
    state, info, _ = s.aggregate(1, ups)
    plain = _strategy(candidates=("kf-linear",))
    plain._grid = ScoringGrid({1: [0.5], 2: [0.5], 3: [0.5]})
    _, base_info, _ = plain.aggregate(1, ups)
    refined = info["select-refine"]["kf-linear"]
    # the candidate is fuse(..., refine='distill', refine_options=opts) on the round's models: same model, same record
    direct = fuse_result("kf-linear", [s.build_model(u.state) for u in ups], fusion_inputs=s.fusion_inputs,
                         weights=[u.num_examples for u in ups], seed=s.seed + 1, refine="distill", refine_options=opts)
    assert refined == {k: v for k, v in direct.info.items() if k.startswith("distill-")}
    assert all(torch.equal(state[k], v) for k, v in direct.model.state_dict().items())
    assert refined["distill-epochs"] <= opts["epochs"]
    assert base_info["select-refine"] is None and "distilled from the clients' ensemble" in caplog.text
    with pytest.raises(ValueError, match="not one of the fusion candidates"):
        _strategy(candidates=("fedavg", "kf-linear"), candidate_refine={"fedavg": opts})
    with pytest.raises(ValueError, match=r"candidate_refine\['kf-linear'\]: unknown option 'epoch'"):
        _strategy(candidates=("kf-linear",), candidate_refine={"kf-linear": {"epoch": 3}})
    with pytest.raises(ValueError, match="needs fusion_inputs"):
        build_strategy("auto", model_fn=model_fn, fusion_inputs=None, min_train_nodes=2, min_available_nodes=2,
                       candidates=("kf-linear",), candidate_refine={"kf-linear": opts})
