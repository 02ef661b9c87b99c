"""Issue 58 item 7: the comparison the front door prints and draws. Every row both ways (the head round), the verdict
leads with what the aggregation adds on top of FedAvg given the same head round, and the plots show every row: no
curve hidden under an identical one, the head round its own step."""

import json
import os

import pytest

from fedfuse.flower.runner.compare import (HEAD_SUFFIX, RunSummary, baseline_runs, both_ways, comparison_table,
                                           head_round_steps, reference_bars, round_curves, verdict)

HEAD = {"head-round": {"kept": "head"}}


def _rows(accs, head=False, ensemble=0.6, best=0.55):
    rows = [{"round": r, "test-accuracy": a} for r, a in enumerate(accs)]
    for r in rows[1:]:
        r["ensemble-accuracy"], r["best-client-accuracy"] = ensemble, best
    if head:
        rows[-1]["fusion-info"] = HEAD
        rows[-1]["ensemble-accuracy"] = 0.99   # a head-round row carrying another number is not the clients' ensemble
    return rows


def test_every_run_is_shown_both_ways_with_its_ensemble_and_best_client():
    fused = RunSummary("kf-linear", "flwr run", _rows([0.1, 0.72, 0.83], head=True))
    base = RunSummary("fedavg", "in-process", _rows([0.1, 0.10, 0.78], head=True, ensemble=0.6, best=0.55))
    runs = both_ways([fused] + base.split_head())
    assert [r.label for r in runs] == ["kf-linear", "kf-linear + head round", "fedavg", "fedavg + head round"]
    assert both_ways(runs) == runs   # already split: left as it is
    assert fused.ensemble_final() == 0.6 and fused.best_client_final() == 0.55   # the last training round's
    table = comparison_table([fused] + base.split_head(), "fedavg").splitlines()
    assert "| best client (final round) |" in table[0]
    assert table[2] == "| kf-linear | flwr run | 0.7200 | 0.7200 (1) | 1 | 0.6000 | 0.5500 | 0 / 0 / 0 |"
    assert table[3].startswith("| kf-linear + head round | flwr run | 0.8300 | 0.8300 (head round) | 1 |")
    assert table[4].startswith("| fedavg (baseline) | in-process | 0.1000 |")
    assert table[5].startswith("| fedavg + head round | in-process | 0.7800 |")


def test_the_verdict_says_what_the_fusion_adds_on_top_of_fedavg_given_the_same_head_round():
    fused = RunSummary("kf-linear", "flwr run", _rows([0.1, 0.72, 0.83], head=True))
    base = RunSummary("fedavg", "in-process", _rows([0.1, 0.10, 0.78], head=True))
    line = verdict([fused] + base.split_head(), "fedavg")
    assert line == ("final accuracy, given the same head round: kf-linear adds +5.00 points on top of fedavg "
                    "(kf-linear + head round 0.8300 vs fedavg + head round 0.7800); before the head round "
                    "+62.00 points (0.7200 vs 0.1000); the head round itself adds +11.00 points to kf-linear and "
                    "+68.00 points to "
                    "fedavg; kf-linear + head round vs kf-linear's clients of round 1: their ensemble 0.6000 "
                    "(+23.00 points), the best of them 0.5500 (+28.00 points) (one seed; mean ± std over seeds: "
                    "`fedfuse compare` / fedfuse.flower.runner.sweep)")
    # the same runs unsplit (as a caller may pass them) give the same line
    assert verdict([fused, base], "fedavg") == line
    # a run below the baseline says so with the sign; no client references: no clause about them
    worse = RunSummary("ot", "flwr run", [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.2},
                                          {"round": 2, "test-accuracy": 0.75, "fusion-info": HEAD}])
    low = verdict([worse, base], "fedavg")
    assert "ot adds -3.00 points on top of fedavg" in low and "clients of round" not in low
    # the baseline without the head round: the head round's share of the strategy's gain, as before
    plain = RunSummary("fedavg", "in-process", _rows([0.1, 0.10]))
    assert verdict([fused, plain], "fedavg").startswith(
        "final accuracy vs fedavg: kf-linear +0.7300 (+0.1100 of it from the head round)")


def _series(runs):
    return [{"label": f"{r.label} ({r.engine})", "points": r.curve(), "fell_back": r.marked_rounds("fallback"),
             "guarded": r.marked_rounds("guard"), "skipped": r.marked_rounds("skipped")} for r in runs]


def test_head_round_steps_are_read_from_the_comparisons_rows_or_said():
    same = _rows([0.1, 0.5, 0.6, 0.8], head=True)
    runs = [RunSummary("auto", "flwr run", same)] + RunSummary("fedavg", "in-process", same).split_head()
    steps, twins = head_round_steps(_series(runs))
    assert steps == {0: 3, 2: 3} and twins == {2: 1}   # fedavg's own series (index 1) ends at round 2
    series = _series(runs[:2])   # no '+ head round' twin: nothing to read it from, unless a series says so
    assert head_round_steps(series) == ({}, {})
    series[0]["head_round"] = True
    assert head_round_steps(series) == ({0: 3}, {})


def _capture(monkeypatch):
    import matplotlib.pyplot as plt

    seen = {}
    real = plt.Figure.savefig

    def spy(fig, *a, **kw):
        ax, side = fig.axes[0], fig.axes[1]
        fig.canvas.draw()
        seen["lines"] = [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata()), ln.get_marker(),
                          ln.get_markersize()) for ln in ax.get_lines()]
        seen["xticklabels"] = [t.get_text() for t in ax.get_xticklabels()]
        seen["legend"] = ax.get_legend_handles_labels()[1]
        seen["rows"] = [t.get_text() for t in side.get_yticklabels()]
        return real(fig, *a, **kw)
    monkeypatch.setattr(plt.Figure, "savefig", spy)
    return seen


def test_identical_curves_stay_visible_and_the_head_round_is_its_own_step(tmp_path, monkeypatch):
    """The default run's plot drew three identical curves ('auto' is FedAvg's average at 2 local epochs): each run now
    has its own marker, size and offset, the head round its own step, and the right panel one row per table row."""
    seen = _capture(monkeypatch)
    same = _rows([0.1, 0.5, 0.6, 0.8], head=True)
    runs = [RunSummary("auto", "flwr run", same)] + RunSummary("fedavg", "in-process", same).split_head()
    assert round_curves(_series(runs), tmp_path / "c.png", title="t").exists()
    curves = {label: (xs, ys, marker, size) for label, xs, ys, marker, size in seen["lines"]
              if label in ("auto (flwr run)", "fedavg (in-process)")}
    (ax, ay, am, asz), (fx, fy, fm, fsz) = curves["auto (flwr run)"], curves["fedavg (in-process)"]
    assert ay == fy == [0.1, 0.5, 0.6] and len(ax) == 3            # the training rounds only
    assert all(a != f for a, f in zip(ax, fx)) and am != fm and asz > fsz   # beside and under each other, not hidden
    stars = [(xs, ys) for label, xs, ys, marker, _ in seen["lines"] if marker == "*" and xs]
    assert len(stars) == 2 and all(ys == [0.8] for _, ys in stars)   # auto's and fedavg's head round
    assert all(2.5 < xs[0] < 3.5 for xs, _ in stars) and stars[0][0] != stars[1][0]
    assert seen["xticklabels"][-1] == "head\nround" and seen["xticklabels"][:3] == ["0", "1", "2"]
    assert "fedavg + head round (in-process)" in seen["legend"]
    assert any(label.startswith("after the head round") for label in seen["legend"])
    assert sorted(seen["rows"]) == ["auto + head round", "auto, round 2", "fedavg + head round", "fedavg, round 2"]


def test_the_ensemble_and_the_best_client_are_drawn_when_given(tmp_path, monkeypatch):
    seen = _capture(monkeypatch)
    runs = [RunSummary("kf-linear", "flwr run", _rows([0.1, 0.72, 0.83], head=True))]
    series = _series(runs)
    series[0].update(ensemble=0.6, best_client=0.55, head_round=True)
    round_curves(series, tmp_path / "c.png")
    assert "clients' ensemble (kf-linear's last round)" in seen["legend"]
    assert set(seen["rows"]) == {"kf-linear, round 1", "kf-linear + head round", "best client (kf-linear's last round)",
                                 "clients' ensemble (kf-linear's last round)"}


def test_one_shot_bars_show_the_head_round_both_ways_and_the_baseline(tmp_path, monkeypatch):
    import matplotlib

    drawn = {}
    real = matplotlib.axes.Axes.barh
    monkeypatch.setattr(matplotlib.axes.Axes, "barh", lambda self, y, w, **kw: drawn.update(zip(y, w)) or
                        real(self, y, w, **kw))
    refs = {"rows": [{"key": "best-client", "accuracy": 0.57, "partition-id": 1}, {"key": "ensemble", "accuracy": 0.66},
                     {"key": "average", "accuracy": 0.10}]}
    out = tmp_path / "run"
    out.mkdir()
    rows = _rows([0.1, 0.74, 0.83], head=True)
    (out / "results.json").write_text(json.dumps({"rounds": rows, "status": "completed"}))
    run = RunSummary.load("kf-linear", "flwr run", out)
    run.references = refs
    base = out / "baseline-fedavg"
    base.mkdir()
    (base / "results.json").write_text(json.dumps({"rounds": _rows([0.1, 0.10, 0.78], head=True),
                                                   "status": "completed"}))
    reference_bars(run, tmp_path / "c.png", "t")
    assert drawn == {"kf-linear, fused round (round 1)": 0.74, f"kf-linear{HEAD_SUFFIX}": 0.83,
                     "fedavg, round 1": 0.10, "fedavg + head round": 0.78, "best client (client 1)": 0.57,
                     "ensemble (weighted by samples)": 0.66, "one-shot FedAvg (weighted average)": 0.10}
    # a baseline folder older than the run (an earlier command's) is not this comparison's
    old = os.stat(out / "results.json").st_mtime - 100
    os.utime(base / "results.json", (old, old))
    assert baseline_runs(run) == []
    drawn.clear()
    reference_bars(run, tmp_path / "c.png", "t", others=[])
    assert "fedavg + head round" not in drawn and "kf-linear + head round" in drawn


@pytest.mark.parametrize("head", [False, True])
def test_accuracy_plot_marks_the_head_round_as_its_own_step(tmp_path, monkeypatch, head):
    import matplotlib.pyplot as plt

    from fedfuse.results import RunRecorder

    rec = RunRecorder(tmp_path, {"strategy": "auto"})
    for r in range(3):
        rec.add_round({"round": r, "test-accuracy": 0.1 + 0.2 * r, "ensemble-accuracy": 0.4 if r else None})
    if head:
        rec.add_round({"round": 3, "test-accuracy": 0.8, "ensemble-accuracy": 0.4, "fusion-info": HEAD})
    seen = {}
    real = plt.Figure.savefig

    def spy(fig, *a, **kw):
        ax = fig.axes[0]
        fig.canvas.draw()
        seen["ticks"] = [t.get_text() for t in ax.get_xticklabels()]
        seen["lines"] = {ln.get_label(): list(ln.get_xdata()) for ln in ax.get_lines()}
        return real(fig, *a, **kw)
    monkeypatch.setattr(plt.Figure, "savefig", spy)
    rec.plot("t")
    assert seen["lines"]["global model"] == [0, 1, 2]
    assert seen["lines"]["ensemble of clients (reference)"] == [1, 2]   # the head round trains no client
    label = "after the head round (classifier solved from the clients' statistics)"
    if head:
        assert seen["lines"][label] == [3] and seen["ticks"][-1] == "head\nround"
    else:
        assert label not in seen["lines"] and "head\nround" not in seen["ticks"]
