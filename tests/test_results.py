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
