"""The default run (``scripts/run.sh`` = ``fedfuse run``): the baseline's config, the side-by-side table, the quiet
console (one line per round, the warnings that matter, everything in run.log), progress off without a terminal,
and one small in-process run of the whole command (strategy + FedAvg, table, plot, logs)."""

import io
import json
from pathlib import Path

import pytest

from fedfuse.flower.runner.compare import STRATEGY_ONLY_KEYS, RunSummary, baseline_config, comparison_table, verdict
from fedfuse.flower.runner.console import QuietConsole, classify, format_round, parse_log_line

ESC = "\x1b"


# ------------------------------------------------------------------------------------------ baseline config
def test_baseline_config_keeps_the_split_and_drops_strategy_keys():
    from fedfuse.config import preflight

    cfg = {"dataset": "digits", "partitioning": "shards", "seed": 3, "num-clients": 4, "local-epochs": 1,
           "strategy": "kf-linear", "fusion-options": "{ridge=1e-3}", "refine": "distill", "fusion-rounds": 2,
           "divergence-guard": False, "output-dir": "/x", "run-name": "main"}
    b = baseline_config(cfg, output_dir="/x/main", run_name="baseline-fedavg")
    assert b["strategy"] == "fedavg" and b["output-dir"] == "/x/main" and b["run-name"] == "baseline-fedavg"
    for key in ("dataset", "partitioning", "seed", "num-clients", "local-epochs"):
        assert b[key] == cfg[key]
    assert not set(STRATEGY_ONLY_KEYS) & set(b)
    preflight({k: v for k, v in b.items() if k not in ("output-dir", "run-name")})  # a valid fedavg config


@pytest.mark.parametrize("cfg, baseline", [
    ({"strategy": "krum", "strategy-options.num-malicious-nodes": 1}, "fedavg"),
    ({"strategy": "multikrum", "strategy-options.num-malicious-nodes": 1,
      "strategy-options.num-nodes-to-select": 2}, "fedavg"),
    ({"strategy": "fedtrimmedavg", "strategy-options.trim-beta": 0.1}, "fedavg"),
    ({"strategy": "auto", "strategy-options.auto-candidates": "average,kf-linear",
      "strategy-options.auto-momentum": "off"}, "fedavg"),
    ({"strategy": "rebasin", "strategy-options.align-to": "global"}, "fedavg"),
    ({"strategy": "fedprox", "strategy-options.proximal-mu": 0.1}, "fedavgm"),
    ({"strategy": "inclusivefl", "client-tiers": "1x1,1x0.5", "strategy-options.mom-beta": 0.3}, "depthfl"),
])
def test_a_baseline_never_inherits_another_strategys_own_setting(cfg, baseline):
    """Every strategy option but the federation's (sampling, timeout, fallback) is the strategy's own: the baseline
    runs with its own defaults and its config is valid (Krum's ``num-malicious-nodes``, auto's candidates, ... made
    the baseline's config an error before ``STRATEGY_OWN_PATHS``)."""
    from fedfuse.config import parse_run_config

    cfg = {**cfg, "strategy-options.fraction-train": 1.0, "strategy-options.min-train-nodes": 4}
    parse_run_config(cfg)
    b = baseline_config(cfg, baseline)
    assert b["strategy-options.fraction-train"] == 1.0 and b["strategy-options.min-train-nodes"] == 4
    assert parse_run_config(b).strategy == baseline


def test_every_strategy_specific_key_is_a_strategy_own_path():
    from fedfuse.config_layout import path_of
    from fedfuse.strategy_specs import STRATEGY_KEYS_ALL

    assert {path_of(k) for k in STRATEGY_KEYS_ALL} <= set(STRATEGY_ONLY_KEYS)


# --------------------------------------------------------------------------------------------- the table
def _rows(accs, **marks):
    rows = [{"round": r, "test-accuracy": a, "test-loss": 1.0} for r, a in enumerate(accs)]
    for key, rounds in marks.items():
        for r in rounds:
            rows[r][key] = "x"
    for r in rows[1:]:
        r["ensemble-accuracy"] = 0.7
        r["best-client-accuracy"] = 0.65
    return rows


def test_comparison_table_final_best_reach_ensemble_and_marks():
    avg = RunSummary("average", "flwr run", _rows([0.1, 0.5, 0.45, 0.6], guard=[2]))
    fedavg = RunSummary("fedavg", "in-process", _rows([0.1, 0.2, 0.3, 0.4]))
    never = RunSummary("kf-linear", "flwr run", _rows([0.1, 0.2, 0.2, 0.3], fallback=[1, 3]))
    table = comparison_table([avg, fedavg, never], "fedavg").splitlines()
    assert "first round ≥ fedavg's final (0.4000)" in table[0] and "client ensemble, uniform (final round)" in table[0]
    assert "best client (final round)" in table[0]
    assert table[2] == "| average | flwr run | 0.6000 | 0.6000 (3) | 1 | 0.7000 | 0.6500 | 0 / 1 / 0 |"
    assert table[3] == "| fedavg (baseline) | in-process | 0.4000 | 0.4000 (3) | 3 | 0.7000 | 0.6500 | 0 / 0 / 0 |"
    assert table[4] == "| kf-linear | flwr run | 0.3000 | 0.3000 (3) | never | 0.7000 | 0.6500 | 2 / 0 / 0 |"
    assert verdict([avg, fedavg], "fedavg").startswith("final accuracy vs fedavg: average +0.2000 (one seed")
    head = RunSummary(label="auto", engine="flwr run", rows=[
        {"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.5},
        {"round": 2, "test-accuracy": 0.8, "fusion-info": {"head-round": {"kept": "head"}}}])
    assert "auto +0.4000 (+0.3000 of it from the head round)" in verdict([head, fedavg], "fedavg")
    # the baseline with the head round too (one run, two rows): the verdict says what the aggregation adds on top
    base = RunSummary("fedavg", "in-process", [{"round": 0, "test-accuracy": 0.1}, {"round": 1, "test-accuracy": 0.4},
                                               {"round": 2, "test-accuracy": 0.75,
                                                "fusion-info": {"head-round": {"kept": "head"}}}])
    plain, headed = base.split_head()
    assert (plain.label, plain.final, headed.label, headed.final) == ("fedavg", 0.4, "fedavg + head round", 0.75)
    line = verdict([head, plain, headed], "fedavg")
    # like for like: what the aggregation adds given the same head round leads, then before it and the head round's part
    assert line.startswith("final accuracy, given the same head round: auto adds +5.00 points on top of fedavg "
                           "(auto + head round 0.8000 vs fedavg + head round 0.7500); before the head round "
                           "+10.00 points (0.5000 vs 0.4000); the head round itself adds +30.00 points to auto and "
                           "+35.00 points to fedavg")
    table = comparison_table([head, plain, headed], "fedavg")
    # every run that ends with the head round is shown both ways, the strategy too
    assert "| auto | flwr run | 0.5000 |" in table and "| auto + head round | flwr run | 0.8000 |" in table
    assert "| fedavg + head round | in-process | 0.7500 |" in table
    assert fedavg.split_head() == [fedavg]


def test_federated_evaluation_runs_are_compared_on_the_federated_accuracy(tmp_path):
    """Issue 45: evaluation='federated' (no server test set) completed, but the table and comparison.md said 'failed: no
    rounds' and comparison.png was empty. The comparison reads the clients' federated accuracy, and says so."""
    from fedfuse.flower.runner.run import write_comparison

    def fed(accs, head=False):
        rows = [{"round": 0, "test-accuracy": None}] + [
            {"round": r, "federated-accuracy": a, "federated-loss": 1.0, "federated-clients": 3}
            for r, a in enumerate(accs, 1)]
        if head:
            rows[-1]["fusion-info"] = {"head-round": {"kept": "head"}}
        return rows

    run = RunSummary("average", "in-process", fed([0.3, 0.6, 0.9], head=True))
    plain, headed = RunSummary("fedavg", "in-process", fed([0.2, 0.4, 0.85], head=True)).split_head()
    assert run.metric == "federated-accuracy" and run.final == 0.9 and plain.final == 0.4 and headed.final == 0.85
    table = comparison_table([run, plain, headed], "fedavg")
    assert "failed" not in table
    assert "| average + head round | in-process | 0.9000 (federated) | 0.9000 (head round) | 2 |" in table
    assert "| average | in-process | 0.6000 (federated) | 0.6000 (2) | 2 |" in table
    line = verdict([run, plain, headed], "fedavg")
    assert line.startswith("final federated accuracy (clients' validation splits), given the same head round: average "
                           "adds +5.00 points on top of fedavg (average + head round 0.9000 vs fedavg + head round "
                           "0.8500); before the head round +20.00 points (0.6000 vs 0.4000)")
    write_comparison([run, plain, headed], tmp_path, "fedavg", "t")
    assert "0.9000 (federated)" in (tmp_path / "comparison.md").read_text()
    # a run with rounds but no accuracy at all says that, not 'no rounds'
    empty = RunSummary("average", "in-process", [{"round": 0}, {"round": 1}])
    assert "no round has an accuracy" in comparison_table([empty], "fedavg")


def test_the_baseline_gets_the_head_round_when_the_strategy_does():
    assert baseline_config({"strategy": "auto"})["head-round"] is True
    assert baseline_config({"strategy": "auto", "head-round": False})["head-round"] is False
    assert baseline_config({"strategy": "auto", "head-solver": "lda"})["head-options.solver"] == "lda"


def test_comparison_table_reports_a_failed_run_and_a_missing_baseline(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"rounds": _rows([0.1, 0.1]), "status": "failed",
                                                       "error": "fusion never succeeded: 1 of 1 rounds fell back"}))
    failed = RunSummary.load("kf-linear", "flwr run", tmp_path)
    assert failed.error.startswith("fusion never succeeded")
    missing = RunSummary.load("fedavg", "in-process", tmp_path / "none")
    table = comparison_table([failed, missing], "fedavg").splitlines()
    assert "failed: fusion never succeeded" in table[2] and "failed: no results.json" in table[3]
    assert table[0].split(" | ")[4] == "first round ≥ fedavg's final"  # no target: no number
    assert verdict([failed, missing], "fedavg") is None


# ------------------------------------------------------------------------------------------ quiet console
FLWR_LINES = [
    "Successfully started run 1221\n",
    f"{ESC}[92mINFO {ESC}[0m:      fedfuse: average on digits/mlp, 4 clients (shards), results in /r\n",
    f"{ESC}[93mWARNING {ESC}[0m:   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n",
    f"{ESC}[93mWARNING {ESC}[0m:   fraction_evaluate is set to 0.0. Federated evaluation will be skipped.\n",
    "/x/ray/_private/worker.py:2051: FutureWarning: Tip: In future versions of Ray, Ray will no longer override\n",
    f"{ESC}[92mINFO {ESC}[0m:      fedfuse round 0: test-accuracy 0.1142\n",
    f"{ESC}[92mINFO {ESC}[0m:      \t└──> Aggregated MetricRecord: {{'num-examples': 1035}}\n",
    f"{ESC}[93mWARNING {ESC}[0m:   aggregate_train: round 1: rejected reply from node 42: contains NaN or Inf\n",
    f"{ESC}[93mWARNING {ESC}[0m:   aggregate_train: round 1: divergence guard: KL 0.9 > 0.3; this round uses the "
    "weighted average\n",
    f"{ESC}[92mINFO {ESC}[0m:      fedfuse round 1: test-accuracy 0.5153, ensemble 0.4708, fusion 0.01s\n",
    f"{ESC}[91mERROR {ESC}[0m:     ServerApp failed with exception: boom\n",
]


def _logged_warnings() -> list[tuple[str, str]]:
    """``(file, leading text)`` of every ``log(WARNING, "...")`` call in fedfuse's sources."""
    import ast

    root = Path(__file__).resolve().parents[1] / "fedfuse"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "log" and len(node.args) >= 2
                    and getattr(node.args[0], "id", None) == "WARNING"):
                msg = node.args[1]
                if isinstance(msg, ast.JoinedStr):
                    msg = msg.values[0] if msg.values else ast.Constant("")
                if isinstance(msg, ast.Constant) and isinstance(msg.value, str):
                    found.append((str(path.relative_to(root)), msg.value))
    return found


def test_the_products_own_warnings_are_shown_never_counted_as_flower_or_rays():
    """Issue 45: auto's "candidate 'hf-linear' skipped" warning was folded into "3 other warning(s) from Flower/Ray".
    Every WARNING fedfuse logs starts with a prefix the console shows, and a Python warning raised in fedfuse's own
    code is shown (its text, without the source path); Flower's and Ray's are still counted."""
    logged = _logged_warnings()
    assert len(logged) > 20   # the scan sees them
    from fedfuse.flower.runner.console import is_user_warning

    assert [(f, m) for f, m in logged if not is_user_warning(m)] == []
    assert classify("WARNING :   auto: round 1: candidate 'hf-linear' skipped: takes at most 2 models, got 4\n")[0] == \
        "warning"
    assert classify("WARNING :   robust screen: node 3 (partition 1) dropped: free rider\n")[0] == "warning"
    line = "/w/.venv/lib/python3.11/site-packages/fedfuse/data/partition.py:149: UserWarning: client 3 holds no sample\n"
    assert classify(line) == ("warning", "UserWarning: client 3 holds no sample")
    assert classify(FLWR_LINES[4])[0] == "hidden-warning"   # Ray's own


def test_classify_flower_lines():
    kinds = [classify(line)[0] for line in FLWR_LINES]
    assert kinds == ["log", "log", "hidden-warning", "hidden-warning", "hidden-warning", "round", "log", "warning",
                     "warning", "round", "error"]
    assert parse_log_line(FLWR_LINES[7]) == ("WARNING", "aggregate_train: round 1: rejected reply from node 42: "
                                                        "contains NaN or Inf")
    # the in-process engine's format (fedfuse.flower.runner.inprocess._LineHandler)
    assert classify("WARNING : fedfuse round 2: fusion fell back: previous: FusionError: x\n") == (
        "warning", "fedfuse round 2: fusion fell back: previous: FusionError: x")
    assert classify("INFO    : fedfuse round 2: test-accuracy 0.5\n") == ("round", "2")


def test_format_round_marks_fallback_guard_skip_rejected_failures():
    row = {"round": 2, "test-accuracy": 0.55712, "test-loss": 1.69338, "ensemble-accuracy": 0.3482,
           "fallback": "previous: NumericalFusionError: nan", "guard": "KL", "rejected": [{"node-id": 1}],
           "failures": [], "skipped": None}
    assert format_round(row, 3, "average") == ("average     round 2/3    acc 0.5571  loss 1.6934  ensemble 0.3482  "
                                               "[FELL BACK (previous), GUARDED (average used), rejected 1]")
    assert format_round({"round": 0, "test-accuracy": 0.1, "test-loss": 2.3}, 3) == (
        "round 0/3    acc 0.1000  loss 2.3000  (initial model)")
    assert "[SKIPPED, failures 2]" in format_round({"round": 1, "test-accuracy": 0.1, "skipped": "too few",
                                                    "failures": [{}, {}]})


def test_quiet_console_prints_rounds_and_user_warnings_and_logs_everything(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"rounds": [{"round": 0, "test-accuracy": 0.1142, "test-loss": 2.3033},
                                              {"round": 1, "test-accuracy": 0.5153, "test-loss": 2.1142,
                                               "ensemble-accuracy": 0.4708, "guard": "KL 0.9",
                                               "rejected": [{"node-id": 42, "reason": "NaN"}]}]}))
    log, out = io.StringIO(), io.StringIO()
    console = QuietConsole(log, results, num_rounds=3, label="average", out=out)
    for line in FLWR_LINES:
        console(line)
    shown = out.getvalue().splitlines()
    assert shown == [
        "average     round 0/3    acc 0.1142  loss 2.3033  (initial model)",
        "            WARNING: aggregate_train: round 1: rejected reply from node 42: contains NaN or Inf",
        "            WARNING: aggregate_train: round 1: divergence guard: KL 0.9 > 0.3; this round uses the weighted "
        "average",
        "average     round 1/3    acc 0.5153  loss 2.1142  ensemble 0.4708  [GUARDED (average used), rejected 1]",
        "            ERROR: ServerApp failed with exception: boom"]
    assert log.getvalue() == "".join(FLWR_LINES).replace(f"{ESC}[92m", "").replace(f"{ESC}[93m", "").replace(
        f"{ESC}[91m", "").replace(f"{ESC}[0m", "")   # every line in run.log, without colour codes
    assert console.hidden_warnings == 3
    assert console.hidden_note(Path("run.log")) == "3 other warning(s) from Flower/Ray are in run.log"
    # without results.json the round line still shows the accuracy of the log line
    out2 = io.StringIO()
    QuietConsole(io.StringIO(), tmp_path / "absent.json", 3, "fedavg", out=out2)(FLWR_LINES[9])
    assert out2.getvalue().startswith("fedavg      round 1/3    acc 0.5153  loss -")
    # verbose: the engine echoes; the console only logs
    out3 = io.StringIO()
    QuietConsole(io.StringIO(), results, 3, "average", verbose=True, out=out3)(FLWR_LINES[5])
    assert out3.getvalue() == ""


def test_progress_is_off_without_a_terminal(monkeypatch, capsys):
    from fedfuse.flower.runner import console as prog

    monkeypatch.delenv("FEDFUSE_PROGRESS", raising=False)
    items = [1, 2, 3]
    assert prog.progress(items, desc="x") is items           # pytest's stdout is not a terminal
    prog.progress_print("step 1 done")
    assert capsys.readouterr().out == "step 1 done\n"
    monkeypatch.setenv("FEDFUSE_PROGRESS", "1")
    bar = prog.progress(items, desc="sweep", unit="run")
    assert list(bar) == items and type(bar).__name__ == "tqdm"
    assert "sweep: 100%" in capsys.readouterr().out          # the bar, with its rate / ETA fields


# ---------------------------------------------------------------------------------- the whole command
def test_default_run_command_in_process_prints_rounds_table_and_writes_plot_and_logs(tmp_path, capsys):
    from fedfuse.flower.runner.run import main

    rc = main(["--engine", "inprocess", "--output-dir", str(tmp_path), "--run-config",
               "num-clients=2 num-server-rounds=2 local-epochs=1 model-width=16 model-depth=1 fusion-set-size=60 "
               "importance='uniform' run-name='r'"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    rounds = [ln for ln in lines if " round " in ln and " acc " in ln]
    # issue 60 item 5: the head round is its own step, not round 3/3 of num-server-rounds=2
    assert [" ".join(ln.split()[:3]) for ln in rounds] == [
        "auto round 0/2", "auto round 1/2", "auto round 2/2", "auto head round", "fedavg round 0/2",
        "fedavg round 1/2", "fedavg round 2/2", "fedavg head round"]   # like for like: both end with the head round
    assert "(after round 2: the classifier solved from the clients' statistics)" in rounds[3]
    assert "auto: 2 rounds + head round, 2 clients" in out and "fedavg: 2 rounds + head round, 2 clients" in out
    assert ("2 rounds + head round: rows '<strategy> + head round' include the head round (one more exchange after "
            "round 2: the classifier solved from the clients' statistics); the other rows (auto, fedavg) are the model "
            "of round 2, without it") in out
    assert "Aggregated MetricRecord" not in out and "Starting" not in out  # Flower's dump stays in run.log
    table = [ln for ln in lines if ln.startswith("|")]
    assert table[0].startswith("| strategy | engine | final accuracy") and table[2].startswith("| auto | in-process")
    assert table[3].startswith("| auto + head round | in-process")   # every row both ways
    assert table[4].startswith("| fedavg (baseline) | in-process") and len(table) == 6
    assert table[5].startswith("| fedavg + head round | in-process")
    assert "given the same head round: auto adds " in out   # the verdict: what auto adds over FedAvg + the head round
    run = tmp_path / "r"
    for name in ("comparison.png", "comparison.md", "run.log", "results.json", "rounds.csv", "accuracy.png",
                 "baseline-fedavg/results.json", "baseline-fedavg/run.log"):
        assert (run / name).exists(), name
    log = (run / "run.log").read_text()
    assert "Aggregated MetricRecord" in log and "fedfuse round 2: test-accuracy" in log and "test-acc" in log
    b = json.loads((run / "baseline-fedavg" / "results.json").read_text())["config"]
    a = json.loads((run / "results.json").read_text())["config"]
    assert b["strategy"] == "fedavg" and a["strategy"] == "auto"
    assert "auto chose" in log   # the round line names the default's per-round choice
    assert all(" chose " in ln for ln in rounds[1:3])   # and so does the console's
    assert a["head-round"] is True and b["head-round"] is True
    assert {k: v for k, v in a.items() if k not in ("strategy", "run-name", "output-dir")} == \
        {k: v for k, v in b.items() if k not in ("strategy", "run-name", "output-dir")}


def test_no_compare_runs_the_strategy_only(tmp_path, capsys):
    from fedfuse.flower.runner.run import main

    rc = main(["--engine", "inprocess", "--no-compare", "--output-dir", str(tmp_path), "--run-config",
               "num-clients=2 num-server-rounds=1 local-epochs=1 model-width=16 model-depth=1 fusion-set-size=60 "
               "importance='uniform' run-name='solo'"])
    out = "\n".join(line for line in capsys.readouterr().out.splitlines() if " plan: " not in line)  # auto -> fedavg
    assert rc == 0 and "fedavg" not in out.replace("fedavg's", "").replace("chose fedavg", "") and not (tmp_path / "solo" / "baseline-fedavg").exists()


def test_a_bad_baseline_config_exits_before_anything_runs(tmp_path, capsys):
    from fedfuse.flower.runner.run import main

    with pytest.raises(SystemExit) as exc:   # hf-linear fuses exactly 2 models; the default run has 4 clients
        main(["--engine", "inprocess", "--baseline", "hf-linear", "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and not any(tmp_path.iterdir())
    assert err.startswith("fedfuse: config error:") and "baseline 'hf-linear'" in err


def test_comparison_plot_has_both_curves_marks_and_integer_ticks(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from fedfuse.flower.runner.compare import round_curves

    seen = {}
    real = plt.Figure.savefig

    def spy(fig, *a, **kw):
        ax = fig.axes[0]
        fig.canvas.draw()
        lo, hi = ax.get_xlim()
        seen["ticks"] = [t for t in ax.get_xticks() if lo <= t <= hi]
        seen["labels"] = ax.get_legend_handles_labels()[1]
        return real(fig, *a, **kw)
    monkeypatch.setattr(plt.Figure, "savefig", spy)
    series = [{"label": "average (flwr run)", "points": [(0, 0.1), (1, 0.5), (2, 0.55), (3, 0.6)], "guarded": [2],
               "fell_back": [3]},
              {"label": "fedavg (in-process)", "points": [(0, 0.1), (1, 0.12), (2, 0.25), (3, 0.38)], "guarded": [3]}]
    assert round_curves(series, tmp_path / "c.png", title="t").exists()
    assert all(float(t).is_integer() for t in seen["ticks"]) and seen["ticks"]
    # both curves; each mark kind once in the legend although both runs have guarded rounds
    assert sorted(seen["labels"]) == ["average (flwr run)", "fedavg (in-process)", "fusion fell back",
                                      "guarded (weighted average used)"]


def test_with_capacity_tiers_the_default_baseline_is_heterofl(tmp_path, capsys):
    """README's tier example (``client-tiers`` set): FedAvg cannot aggregate clients of different widths, so the
    default run compares with HeteroFL (and runs HeteroFL alone when it is the strategy)."""
    from fedfuse.config import parse_run_config, preflight
    from fedfuse.flower.runner.run import default_baseline, main

    tiered = {"client-tiers": "1,0.5,0.25", "strategy": "kf-linear", "tier-models": "fuse", "dataset": "mnist1d"}
    assert default_baseline(parse_run_config(tiered)) == "heterofl"
    assert default_baseline(parse_run_config({})) == "fedavg"
    preflight(baseline_config(tiered, "heterofl"))        # the baseline's config is valid (tier-models dropped)
    # the baseline is the paper's HeteroFL: fedfuse's ordered dropout is not carried over to it
    assert "ordered-dropout" not in baseline_config({**tiered, "ordered-dropout": "all"}, "heterofl")
    rc = main(["--engine", "inprocess", "--output-dir", str(tmp_path), "--run-config",
               "client-tiers='1,0.5' strategy='average' num-clients=2 num-server-rounds=1 local-epochs=1 "
               "model-width=16 model-depth=1 fusion-set-size=60 importance='uniform' run-name='t'"])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert table[2].startswith("| average |") and table[3].startswith("| average + head round |")
    assert table[4].startswith("| heterofl (baseline) |")
    assert (tmp_path / "t" / "baseline-heterofl" / "results.json").exists()


def test_with_depth_tiers_the_default_baseline_is_depthfl(tmp_path, capsys):
    """Depth tiers (``client-tiers`` ``<width>x<depth>``): the default run (strategy 'auto' → the layer-wise average)
    compares with DepthFL."""
    from fedfuse.config import parse_run_config, preflight
    from fedfuse.flower.runner.run import default_baseline, main

    depth = {"client-tiers": "1x1,1x0.5", "model-depth": 2}
    assert default_baseline(parse_run_config({**depth, "strategy": "average"})) == "depthfl"
    preflight(baseline_config({**depth, "strategy": "average"}, "depthfl"))
    rc = main(["--engine", "inprocess", "--output-dir", str(tmp_path), "--run-config",
               "client-tiers='1x1,1x0.5' num-clients=2 num-server-rounds=1 local-epochs=1 model-width=16 "
               "model-depth=2 fusion-set-size=60 run-name='d'"])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert table[2].startswith("| average |") and table[3].startswith("| average + head round |")
    assert table[4].startswith("| depthfl (baseline) |")
