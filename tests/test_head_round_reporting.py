"""Issue 60 items 4-6: what the console, the tables and the plots say a run did.

Item 5: "final accuracy" meant the head round's figure without a comparison and the training rounds' within one, and
the round header counted the head round as an 11th round: every header, table and plot title now says which rows
include the head round, counted as its own step ("10 rounds + head round").
Item 6: a one-shot run's references table credited the head round to the fusion ("kf-linear minus it" compared the
head-rounded model with references that had no head round).
Item 4: a DP run's (ε, δ) only in run.log and results.json; a head-round line that contradicted its numbers; a run the
DP noise drove to chance blamed the learning rate.
"""

import json

import pytest

from fedfuse.flower.runner.compare import RunSummary, comparison_table, references_table
from fedfuse.flower.runner.console import format_round

HEAD = {"head-round": {"kept": "head"}}


def _rows(accs, head=True):
    rows = [{"round": r, "test-accuracy": a, "test-loss": 1.0} for r, a in enumerate(accs)]
    for r in rows[1:]:
        r["ensemble-accuracy"], r["best-client-accuracy"] = 0.4, 0.38
    if head:
        rows[-1]["fusion-info"] = HEAD
    return rows


# ------------------------------------------------------------------------------------------------- item 5
def test_the_head_round_is_its_own_step_on_the_console():
    head = {"round": 3, "test-accuracy": 0.9081, "test-loss": 0.34, "ensemble-accuracy": 0.38, "fusion-info": HEAD}
    line = format_round(head, 2, "krum")
    # before: "krum        round 3/3    acc 0.9081 ... head round (classifier solved ...)" for num-server-rounds=2
    assert line.startswith("krum        head round   acc 0.9081") and "3/3" not in line and "round 3" not in line
    assert line.endswith("(after round 2: the classifier solved from the clients' statistics)")
    assert format_round({"round": 2, "test-accuracy": 0.1}, 2, "krum").startswith("krum        round 2/2 ")
    from fedfuse.results import rounds_text

    assert rounds_text(10, True) == "10 rounds + head round" and rounds_text(1, False) == "1 round"


def test_every_table_row_says_whether_it_includes_the_head_round():
    krum = RunSummary("krum", "in-process", _rows([0.11, 0.0975, 0.0975, 0.9081]))
    table = comparison_table([krum], "fedavg")
    lines = table.splitlines()
    assert lines[2].startswith("| krum | in-process | 0.0975 |")            # its own rounds
    assert lines[3].startswith("| krum + head round | in-process | 0.9081 | 0.9081 (head round) |")
    assert lines[-1] == ("2 rounds + head round: rows '<strategy> + head round' include the head round (one more "
                         "exchange after round 2: the classifier solved from the clients' statistics); the other rows "
                         "(krum) are the model of round 2, without it")
    # the baseline's strategy alone is not labelled '(baseline)': nothing is compared with it
    alone = comparison_table([RunSummary("fedavg", "in-process", _rows([0.1, 0.452, 0.486]))], "fedavg")
    assert "(baseline)" not in alone and "| fedavg | in-process | 0.4520 |" in alone
    assert "| fedavg + head round | in-process | 0.4860 |" in alone
    # beside another strategy it is, and it is the row without the head round, as the note says
    both = comparison_table([krum, RunSummary("fedavg", "in-process", _rows([0.1, 0.452, 0.486]))], "fedavg")
    assert "| fedavg (baseline) | in-process | 0.4520 |" in both and "(krum, fedavg)" in both
    # no head round anywhere: no note, nothing to tell apart
    plain = comparison_table([RunSummary("krum", "in-process", _rows([0.1, 0.2], head=False))], "fedavg")
    assert "head round" not in plain
    from fedfuse.flower.runner.compare import steps_title

    assert steps_title([krum]) == "2 rounds + head round: the '+ head round' rows include it (★), the others end at round 2"
    assert steps_title([RunSummary("krum", "in-process", _rows([0.1, 0.2], head=False))]) == "1 round"


def _titles(monkeypatch):
    import matplotlib.pyplot as plt

    seen = []
    real = plt.Figure.savefig

    def spy(fig, path, *a, **kw):
        titles = [fig._suptitle.get_text()] if fig._suptitle is not None else []
        seen.append((str(path), titles + [ax.get_title() for ax in fig.axes]))
        return real(fig, path, *a, **kw)
    monkeypatch.setattr(plt.Figure, "savefig", spy)
    return seen


def test_an_in_process_run_without_comparison_counts_the_head_round_as_its_own_step(tmp_path, capsys, monkeypatch):
    from fedfuse.flower.runner.run import main

    seen = _titles(monkeypatch)
    rc = main(["--engine", "inprocess", "--no-compare", "--output-dir", str(tmp_path), "--run-config",
               "strategy='fedavg' num-clients=2 num-server-rounds=2 local-epochs=1 model-width=16 model-depth=1 "
               "run-name='solo'"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fedavg: 2 rounds + head round, 2 clients" in out and "3 rounds" not in out   # before: "fedavg: 3 rounds"
    lines = out.splitlines()
    assert any(ln.startswith("fedavg      round 2/2") for ln in lines)
    assert any(ln.startswith("fedavg      head round") for ln in lines) and "round 3/3" not in out
    assert "(baseline)" not in out and "| fedavg + head round | in-process |" in out
    assert "rows '<strategy> + head round' include the head round" in out
    res = json.loads((tmp_path / "solo" / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [0, 1, 2, 3]   # results.json keeps the head round's row number
    titles = {path.rsplit("/", 1)[-1]: t for path, t in seen}
    assert any("2 rounds + head round" in t for t in titles["accuracy.png"])
    assert any("2 rounds + head round: the '+ head round' rows include it" in t for t in titles["comparison.png"])
