"""One-shot references (``fedfuse.references``, issue 27 item 3): a one-shot run reports its fused model next to the
best and mean client, the ensembles, one-shot FedAvg, KD and FedDF computed from the same client models; the numbers
equal a direct evaluation of those models; without a server test set they are reported unavailable."""

import json

import pytest
import torch

from fedfuse.config import ConfigError, preflight
from fedfuse.fusion import fuse
from fedfuse.fusion.average import average_state_dicts
from fedfuse.models import build_model
from fedfuse.references import REFERENCE_KEYS, gap_recovered, one_shot_references
from fedfuse.training import evaluate, train

TINY = ("mode='one-shot' head-round=false num-server-rounds=1 num-clients=2 local-epochs=1 model-width=16 model-depth=1 "
        "fusion-set-size=60 importance='uniform' strategy='kf-linear' run-name='r'")


def _clients(n=3, seed=0):
    """``n`` independently initialised MLPs, each trained briefly on its own class-skewed slice, and a test set."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 8, generator=g) * 2
    y = torch.randint(0, 4, (600,), generator=g)
    x = centers[y] + torch.randn(600, 8, generator=g)
    models = []
    for i in range(n):
        m = build_model("mlp", 4, (8,), width=16, depth=1, seed=seed * 10 + i)
        keep = (y % n == i) | (torch.rand(600, generator=g) < 0.2)
        train(m, x[:400][keep[:400]], y[:400][keep[:400]], epochs=3, lr=1e-2)
        models.append(m)
    return models, x[400:500], x[500:], y[500:]


def test_references_equal_a_direct_evaluation_of_the_models():
    models, fusion_x, tx, ty = _clients()
    weights = [30, 10, 20]
    refs = one_shot_references(models, weights, [0, 1, 2], test_x=tx, test_y=ty, fusion_inputs=fusion_x, seed=1)
    rows = {r["key"]: r for r in refs["rows"]}
    assert list(rows) == list(REFERENCE_KEYS)
    direct = [evaluate(m, tx, ty)["accuracy"] for m in models]
    assert refs["client-accuracy"] == {str(i): a for i, a in enumerate(direct)}
    assert rows["best-client"]["accuracy"] == max(direct) and all(rows["best-client"]["accuracy"] >= a for a in direct)
    assert rows["best-client"]["partition-id"] == direct.index(max(direct))
    assert rows["mean-client"]["accuracy"] == pytest.approx(sum(direct) / 3)
    w = torch.tensor(weights, dtype=torch.float) / sum(weights)
    with torch.no_grad():
        probs = sum(wi * m.eval()(tx).softmax(-1) for wi, m in zip(w, models))
        uniform = sum(m(tx).softmax(-1) for m in models) / 3
    assert rows["ensemble"]["accuracy"] == pytest.approx((probs.argmax(-1) == ty).float().mean().item())
    assert rows["ensemble-uniform"]["accuracy"] == pytest.approx((uniform.argmax(-1) == ty).float().mean().item())
    avg = build_model("mlp", 4, (8,), width=16, depth=1)
    avg.load_state_dict(average_state_dicts([m.state_dict() for m in models], w.tolist()))
    assert rows["average"]["accuracy"] == evaluate(avg, tx, ty)["accuracy"]
    for method in ("kd", "feddf"):   # fuse's defaults, the fusion seed the references use
        fused = fuse(method, models, fusion_inputs=fusion_x, weights=weights, seed=1)
        assert rows[method]["accuracy"] == evaluate(fused, tx, ty)["accuracy"], method
        assert rows[method]["seconds"] > 0


def test_without_a_fusion_set_or_with_distill_off_the_distillations_say_so():
    models, _, tx, ty = _clients(2)
    rows = {r["key"]: r for r in one_shot_references(models, [1, 1], [0, 1], test_x=tx, test_y=ty,
                                                     fusion_inputs=None)["rows"]}
    assert "fusion set" in rows["kd"]["unavailable"] and "fusion set" in rows["feddf"]["unavailable"]
    keys = [r["key"] for r in one_shot_references(models, [1, 1], [0, 1], test_x=tx, test_y=ty, fusion_inputs=tx,
                                                  distill=False)["rows"]]
    assert "kd" not in keys and "feddf" not in keys and "average" in keys


def test_average_of_different_widths_is_unavailable_not_silent():
    models, fusion_x, tx, ty = _clients(2)
    narrow = build_model("mlp", 4, (8,), width=8, depth=1)
    rows = {r["key"]: r for r in one_shot_references([models[0], narrow], [1, 1], [0, 1], test_x=tx, test_y=ty,
                                                     fusion_inputs=fusion_x, distill=False)["rows"]}
    assert "unavailable" in rows["average"] and "accuracy" in rows["ensemble"]


def test_gap_recovered():
    assert gap_recovered(0.8, 0.6, 1.0) == pytest.approx(0.5)
    assert gap_recovered(0.5, 0.6, 0.6) is None


def test_the_key_applies_to_one_shot_only():
    assert preflight({"mode": "one-shot", "num-server-rounds": 1, "one-shot-references": "models"})
    with pytest.raises(ConfigError, match="'report-options.one-shot-references'.*one-shot"):
        preflight({"one-shot-references": "none"})
    with pytest.raises(ConfigError, match="one-shot-references"):
        preflight({"mode": "one-shot", "num-server-rounds": 1, "one-shot-references": "yes"})


def test_a_one_shot_run_prints_and_writes_the_references(tmp_path, capsys):
    from fedfuse.flower.runner.run import main

    assert main(["--engine", "inprocess", "--output-dir", str(tmp_path), "--run-config", TINY]) == 0
    out = capsys.readouterr().out
    assert "no second training run" in out and "fedavg 0/1" not in out   # the references replace FedAvg's rerun
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    refs, row = res["one-shot-references"], res["rounds"][-1]
    rows = {r["key"]: r for r in refs["rows"]}
    assert list(rows) == list(REFERENCE_KEYS) and all("accuracy" in r for r in rows.values())
    # the same client models as the round's reference columns
    assert rows["best-client"]["accuracy"] == row["best-client-accuracy"] == max(row["client-test-accuracy"])
    assert rows["ensemble-uniform"]["accuracy"] == pytest.approx(row["ensemble-accuracy"])
    for label in ("best client (client", "mean client", "ensemble (weighted by samples)", "one-shot FedAvg",
                  "KD (ensemble", "FedDF (ensemble", "**kf-linear**"):
        assert label in out, label
    md = (tmp_path / "r" / "comparison.md").read_text()
    assert "One-shot references" in md and (tmp_path / "r" / "comparison.png").exists()


def test_reference_bars_draw_the_fused_model_and_every_reference(tmp_path, monkeypatch):
    import matplotlib.axes

    from fedfuse.flower.runner.compare import RunSummary, reference_bars

    drawn = {}
    real = matplotlib.axes.Axes.barh
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", lambda self, y, w, **kw: drawn.update(zip(y, w)) or
                        real(self, y, w, **kw))
    refs = {"rows": [{"key": "best-client", "accuracy": 0.7, "partition-id": 2}, {"key": "ensemble", "accuracy": 0.8},
                     {"key": "kd", "unavailable": "no fusion set"}]}
    run = RunSummary("kf-linear", "in-process", rows=[{"round": 0, "test-accuracy": 0.1},
                                                      {"round": 1, "test-accuracy": 0.75}], references=refs)
    reference_bars(run, tmp_path / "c.png", "t")
    assert drawn == {"kf-linear (fused)": 0.75, "best client (client 2)": 0.7, "ensemble (weighted by samples)": 0.8}
    assert (tmp_path / "c.png").exists()


def test_the_verdict_line_splits_the_fused_rounds_part_from_the_head_rounds():
    """Issue 45: "ot is 62.7 points above the clients' ensemble (7600% of the gap)" while the fused round scored 0.30:
    the gain was the head round's. With a head round the line says the fused round's own standing and what the head
    round adds."""
    from fedfuse.flower.runner.compare import RunSummary, references_table

    refs = {"rows": [{"key": "best-client", "accuracy": 0.36}, {"key": "ensemble", "accuracy": 0.368}],
            "client-accuracy": {"0": 0.36, "1": 0.2}}
    rows = [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.30},
            {"round": 2, "test-accuracy": 0.995, "fusion-info": {"head-round": {"kept": "head"}}}]
    line = references_table(RunSummary("ot", "in-process", rows, references=refs)).splitlines()[-1]
    assert line.startswith("ot's fused round (round 1, 0.3000) is 6.0 points below the best client; ")
    assert "the head round adds +0.6950" in line and "model after the head round (0.9950) is 62.7 points above the clients' " \
        "ensemble (which is 0.8 points above the best client)" in line and "7600%" not in line
    # without a head round: one line about the fused model, as before
    plain = references_table(RunSummary("ot", "in-process", rows[:2], references=refs)).splitlines()[-1]
    assert plain == "ot is 6.0 points below the best client (one seed)"
    refs["rows"][1]["accuracy"] = 0.5   # between the two: the share of the gap, as before
    mid = references_table(RunSummary("ot", "in-process", rows[:2] + [{"round": 2, "test-accuracy": 0.43, "fusion-info":
                                                                       {"head-round": {}}}], references=refs))
    assert mid.splitlines()[-1] == ("ot's fused round (round 1, 0.3000) is 6.0 points below the best client; the head "
                                    "round adds +0.1300 (the classifier solved from the clients' statistics), so the "
                                    "model after the head round (0.4300) recovers 50% of the gap between the best "
                                    "client and the ensemble (one seed)")


def test_one_shot_fedavg_reference_equals_the_fedavg_run_on_the_same_split(tmp_path, capsys):
    """``--baseline fedavg`` trains the same clients again: its one round equals the 'one-shot FedAvg' reference."""
    from fedfuse.flower.runner.run import main

    assert main(["--engine", "inprocess", "--output-dir", str(tmp_path), "--baseline", "fedavg",
                 "--run-config", TINY + " one-shot-references='models'"]) == 0
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    base = json.loads((tmp_path / "r" / "baseline-fedavg" / "results.json").read_text())
    avg = next(r for r in res["one-shot-references"]["rows"] if r["key"] == "average")
    assert avg["accuracy"] == pytest.approx(base["rounds"][-1]["test-accuracy"], abs=1e-9)
    assert "one-shot-references" not in base and base["config"]["report-options.one-shot-references"] == "none"


def test_federated_evaluation_says_the_references_are_unavailable(tmp_path):
    from fedfuse.flower.runner.run import main

    assert main(["--engine", "inprocess", "--output-dir", str(tmp_path), "--no-compare", "--run-config",
                 TINY + " evaluation='federated'"]) == 0
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert "no test set" in res["one-shot-references"]["unavailable"]
    assert "one-shot-references" in (tmp_path / "r" / "run.log").read_text()
