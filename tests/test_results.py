"""Run results: the fusion outcome (fallback count, failed status), the CSV fallback column, the plot."""

import csv
import json

from fedfuse.results import RunRecorder, fusion_outcome


def _h(r, fallback=None, skipped=None):
    return {"round": r, "fallback": fallback, "skipped": skipped}


def test_fusion_outcome_counts_fallbacks_and_fails_when_fusion_never_succeeded():
    ok = fusion_outcome([_h(1), _h(2, "average: IncompatibleModelsError: x"), _h(3)])
    assert ok == {"status": "completed", "error": None, "fallbacks": 1, "fallback-rounds": [2], "guarded-rounds": []}
    bad = fusion_outcome([_h(1, "previous: NumericalFusionError: nan"), _h(2, skipped="round 2 skipped: 0 valid")])
    assert bad["status"] == "failed" and bad["fallbacks"] == 1 and bad["fallback-rounds"] == [1]
    assert "fusion never succeeded" in bad["error"] and "NumericalFusionError: nan" in bad["error"]
    assert fusion_outcome([_h(1, skipped="round 1 skipped")])["status"] == "failed"
    assert fusion_outcome([])["status"] == "completed"  # no aggregation round (e.g. resumed after the last)


def test_recorder_writes_fallback_column_and_marks_the_plot(tmp_path):
    rec = RunRecorder(tmp_path, {"strategy": "kf-linear"})
    rec.add_round({"round": 0, "test-accuracy": 0.1})
    rec.add_round({"round": 1, "test-accuracy": 0.5, "fallback": None, "fusion-info": {"loss": 0.1}})
    rec.add_round({"round": 2, "test-accuracy": 0.5, "fallback": "previous: FusionError: boom"})
    rec.extra.update(fusion_outcome([_h(1), _h(2, "previous: FusionError: boom")]))
    rec.write()
    rows = list(csv.DictReader((tmp_path / "rounds.csv").open()))
    assert [r["fallback"] for r in rows] == ["", "", "previous: FusionError: boom"]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["fallbacks"] == 1 and res["fallback-rounds"] == [2] and res["rounds"][1]["fusion-info"] == {"loss": 0.1}
    import matplotlib.pyplot as plt

    seen = {}
    real = plt.Axes.legend

    def spy(ax, *a, **kw):
        seen["labels"] = [t for t in ax.get_legend_handles_labels()[1]]
        return real(ax, *a, **kw)
    plt.Axes.legend = spy
    try:
        assert rec.plot("t").exists()
    finally:
        plt.Axes.legend = real
    assert "fusion fell back" in seen["labels"]


def test_rounds_csv_has_per_class_per_client_rejected_and_failure_columns(tmp_path):
    rec = RunRecorder(tmp_path, {"strategy": "average"})
    rec.add_round({"round": 0, "test-accuracy": 0.1, "test-loss": 2.3, "per-class-accuracy": [0.0, 0.2]})
    rec.add_round({"round": 1, "test-accuracy": 0.6, "test-loss": 1.1, "per-class-accuracy": [0.5, 0.7],
                   "client-test-accuracy": [0.3, 0.4], "client-partition-ids": [0, 2],
                   "rejected": [{"node-id": 7, "reason": "contains NaN"}],
                   "failures": [{"node-id": 9, "partition-id": 1, "reason": "no reply\nwithin timeout"}],
                   "guard": "KL 0.9 > 0.3", "fusion-info": {"refine": "calibrate"}, "fallback": None})
    rows = list(csv.DictReader((tmp_path / "rounds.csv").open()))
    header = list(rows[0])
    for col in ("round", "test-accuracy", "test-loss", "class-0-accuracy", "class-1-accuracy", "fallback",
                "client-0-test-accuracy", "client-2-test-accuracy", "rejected", "rejected-reasons", "failures",
                "failure-reasons", "guard"):
        assert col in header, (col, header)
    assert "fusion-info" not in header and "client-partition-ids" not in header and "client-1-test-accuracy" not in header
    assert rows[0]["class-1-accuracy"] == "0.2" and rows[0]["client-0-test-accuracy"] == ""
    r1 = rows[1]
    assert r1["class-1-accuracy"] == "0.7" and r1["client-2-test-accuracy"] == "0.4"
    assert r1["rejected"] == "1" and r1["rejected-reasons"] == "node 7: contains NaN"
    assert r1["failures"] == "1" and r1["failure-reasons"] == "node 9 (partition 1): no reply within timeout"


def test_accuracy_plot_has_integer_round_ticks(tmp_path):
    import matplotlib.pyplot as plt

    rec = RunRecorder(tmp_path, {"strategy": "average"})
    for r in range(3):
        rec.add_round({"round": r, "test-accuracy": 0.1 + 0.2 * r, "guard": "x" if r == 2 else None})
    ticks = {}
    real = plt.Figure.savefig

    def spy(fig, *a, **kw):
        ax = fig.axes[0]
        fig.canvas.draw()
        ticks["x"] = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        ticks["labels"] = ax.get_legend_handles_labels()[1]
        return real(fig, *a, **kw)
    plt.Figure.savefig = spy
    try:
        rec.plot("t")
    finally:
        plt.Figure.savefig = real
    assert ticks["x"] and all(float(t).is_integer() for t in ticks["x"]), ticks["x"]
    assert "guarded (weighted average used)" in ticks["labels"]


def test_dead_model_is_a_collapse_to_chance_not_a_slow_start():
    from fedfuse.results import dead_model

    init = {"round": 0, "test-accuracy": 0.1, "test-loss": 2.30}
    dead = {"round": 3, "test-accuracy": 0.098, "test-loss": 2.3026, "per-class-accuracy": [0, 0, 1.0] + [0] * 7}
    slow = {"round": 2, "test-accuracy": 0.10, "test-loss": 2.31, "per-class-accuracy": [0.2, 0.1, 0, 0.3] + [0] * 6}
    assert "dead after round 3" in dead_model([init, dead], 10)
    assert "never rose above chance" in dead_model([init, dead], 10)        # too high or too low an lr: both named
    risen = {"round": 2, "test-accuracy": 0.5, "test-loss": 1.5}
    assert "never rose" not in dead_model([init, risen, dead], 10)          # it learned, then collapsed
    leaky = {**dead, "per-class-accuracy": [0, 0, 0, 1.0, 0, 0, 0.04, 0, 0.01, 0]}   # measured: lr 0.2 at E = 20
    assert "dead after round 3" in dead_model([init, leaky], 10)
    assert dead_model([init, slow], 10) is None                      # still spreads its predictions: not dead
    assert dead_model([init, {**slow, "test-loss": float("nan")}], 10)   # a non-finite loss always is
    assert dead_model([init, {"round": 1, "test-accuracy": 0.6, "test-loss": 1.1,
                              "per-class-accuracy": [1.0] + [0] * 9}], 10) is None
    assert dead_model([init], 10) is None and dead_model([{"round": 1}], 10) is None
