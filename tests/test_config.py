"""Run config: one schema, pyproject agrees with it, and every config error fails fast naming the key.

No Flower process here: ``parse_run_config`` / ``check_files`` / ``preflight`` and the runners' command
line are checked directly; one subprocess test runs the real runner entry point on a bad key.
"""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfuse.config import (SCHEMA, ConfigError, RunConfig, check_files, check_model, clients_per_round,
                            fusion_options_dict, parse_run_config, preflight, strategy_names)
from fedfuse.config_layout import path_of
from fedfuse.flower.runner.run import parse_run_config_arg, split_run_config

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_config() -> dict:
    """``[tool.flwr.app.config]`` as Flower reads it: its option tables flattened to dotted keys."""
    from flwr.common.config import flatten_dict

    return flatten_dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])


# ------------------------------------------------------------------------------------- one schema
def test_pyproject_matches_the_schema_value_by_value():
    defaults = _pyproject_config()
    assert sorted(defaults) == sorted(s.path for s in SCHEMA.values()), "pyproject and RunConfig declare different keys"
    for spec in SCHEMA.values():
        key = spec.path
        assert type(defaults[key]) is spec.type, f"{key}: pyproject {type(defaults[key]).__name__}, schema {spec.type}"
        assert defaults[key] == spec.default, f"{key}: pyproject {defaults[key]!r}, schema {spec.default!r}"
    assert parse_run_config(defaults) == RunConfig()
    assert RunConfig().fusion_set_size == 2000  # the value users run with (pyproject) is the single default


def test_every_key_has_help_and_test_faults_is_not_a_product_key():
    assert all(spec.help for spec in SCHEMA.values())
    assert "test-faults" not in SCHEMA
    with pytest.raises(ConfigError, match="test-faults"):
        parse_run_config({"test-faults": "1:crash"})


def test_allowed_values_live_in_config_and_data_uses_them():
    from fedfuse import config
    from fedfuse.data import PARTITIONERS, SOURCE_INFO, SOURCES

    assert PARTITIONERS is config.PARTITIONINGS
    assert set(SOURCES) == set(SOURCE_INFO) == set(config.DATASETS)
    assert SCHEMA["partitioning"].choices is config.PARTITIONINGS
    assert SCHEMA["fusion-fallback"].choices is config.FALLBACKS


def test_empty_config_gives_defaults():  # run_simulation hands the app an empty run_config
    assert parse_run_config({}) == RunConfig()


def test_strategies_are_fedavg_plus_same_architecture_methods():
    from fedfuse.fusion import METHOD_SPECS

    names = strategy_names()
    assert names[0] == "fedavg" and "kf-linear" in names and "ensemble" not in names
    from fedfuse.strategy_specs import NON_FUSION_STRATEGIES  # fedavg + Flower's baselines (fedfuse.flower.aggregators.baselines)

    from fedfuse.hetero.tiers import TIER_STRATEGIES  # heterofl / fedrolex: sub-model averaging (capacity tiers)

    from fedfuse.strategy_specs import DEPTH_TIER_STRATEGIES  # depthfl / depthfl-fedavg / inclusivefl: layer-wise (depth tiers)

    from fedfuse.strategy_specs import ONE_SHOT_ONLY_STRATEGIES  # stack: every client's model kept (one-shot only)

    assert ONE_SHOT_ONLY_STRATEGIES == ("stack",) and not METHOD_SPECS["stack"].same_architecture
    assert set(names) - set(NON_FUSION_STRATEGIES) - set(TIER_STRATEGIES) - set(DEPTH_TIER_STRATEGIES) - set(
        ONE_SHOT_ONLY_STRATEGIES) == {n for n, s in METHOD_SPECS.items() if s.same_architecture}


# ------------------------------------------------------------------------------------- fail fast
def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"unknown key 'num-round' \(did you mean 'num-server-rounds'\?\)"):
        parse_run_config({"num-round": 5})
    with pytest.raises(ConfigError, match="did you mean 'num-clients'"):
        parse_run_config({"num_clients": 3})  # flwr keys are hyphenated; underscores are another key
    with pytest.raises(ConfigError, match="quoted string"):
        parse_run_config({"fusion-options.ridge": 1e-3})  # an unquoted table that Flower flattened


@pytest.mark.parametrize("override,key", [
    ({"num-clients": "four"}, "num-clients"),
    ({"num-clients": 2.5}, "num-clients"),
    ({"lr": "fast"}, "lr"),
    ({"resume": "yes"}, "resume"),
    ({"dataset": 3}, "dataset"),
    ({"lr": float("nan")}, "lr"),
])
def test_wrong_type_names_the_key(override, key):
    with pytest.raises(ConfigError, match=f"run-config key '{key}': expected"):
        parse_run_config(override)


@pytest.mark.parametrize("override,key", [
    ({"dataset": "imagenet"}, "dataset"),
    ({"dataset": "hf:"}, "dataset"),
    ({"model": "gpt"}, "model"),
    ({"partitioning": "random"}, "partitioning"),
    ({"importance": "shap"}, "importance"),
    ({"optimizer": "lion"}, "optimizer"),
    ({"fusion-set-source": "server"}, "fusion-set-source"),
    ({"fusion-fallback": "ignore"}, "fusion-fallback"),
    ({"lr": -1.0}, "lr"),
    ({"val-fraction": 1.5}, "val-fraction"),
    ({"test-fraction": 0.0}, "test-fraction"),
    ({"fraction-train": 0.0}, "fraction-train"),
    ({"num-clients": 0}, "num-clients"),
    ({"fusion-rounds": -1}, "fusion-rounds"),
    ({"round-timeout": 0}, "round-timeout"),
    ({"seed": -3}, "seed"),
    ({"device": "tpu"}, "device"),
    ({"device": "cuda:x"}, "device"),
    ({"mode": "one-shot", "num-server-rounds": 3}, "num-server-rounds"),
    ({"min-train-nodes": 9, "num-clients": 4}, "min-train-nodes"),
    ({"resume": True}, "resume"),
    ({"tofu-r": 2}, "tofu-r"),
    ({"num-clients": 12, "partitioning": "shards"}, "num-clients"),             # class-disjoint shards: 12 clients > 10 digit classes
    ({"classes-per-client": 11, "partitioning": "shards"}, "classes-per-client"),
    ({"strategy": "kf-linaer"}, "strategy"),
    ({"strategy": "feddf", "fusion-set-size": 1}, "fusion-set-size"),   # before any client trains, not after 48 s
    ({"momentum": 0.0}, "momentum"),                                   # the default optimizer is adam: no momentum
    ({"optimizer": "sgd", "momentum": 1.0}, "momentum"),
    ({"mode": "one-shot", "num-server-rounds": 1, "client-references": False}, "client-references"),
    ({"mode": "one-shot", "num-server-rounds": 1, "fusion-rounds": 2}, "fusion-rounds"),   # one round: did nothing
])
def test_bad_value_or_range_names_the_key(override, key):
    with pytest.raises(ConfigError, match=f"'{path_of(key)}'"):
        parse_run_config(override)


def test_krum_runs_with_the_default_min_train_nodes():
    """Issue 45: strategy='krum' with the default 4 clients was refused (min-train-nodes 2 < f + 3). Left at its
    default, min-train-nodes becomes what the strategy needs, said in a ConfigNote; set too low, it still fails."""
    from fedfuse.config import config_notes

    for strategy, need in (("krum", 3), ("multikrum", 3), ("bulyan", 3)):
        with config_notes() as notes:
            cfg = parse_run_config({"strategy": strategy})
        assert cfg.min_train_nodes == need
        assert len(notes) == 1 and f"the run uses {need}" in notes[0] and "'strategy-options.min-train-nodes'" in notes[0]
    with config_notes() as notes:
        assert parse_run_config({"strategy": "krum", "num-malicious-nodes": 1}).min_train_nodes == 4
    with pytest.raises(ConfigError, match="'strategy-options.min-train-nodes' is 1"):
        parse_run_config({"strategy": "krum", "min-train-nodes": 1})
    with pytest.raises(ConfigError, match="'strategy-options.min-train-nodes'"):   # 4f + 3 = 7 > the 4 clients: nothing to raise it to
        parse_run_config({"strategy": "bulyan", "num-malicious-nodes": 1})
    with config_notes() as notes:
        assert parse_run_config({"strategy": "fedavg"}).min_train_nodes == 2
    assert notes == []


def test_message_is_one_line_with_suggestion():
    with pytest.raises(ConfigError) as e:
        parse_run_config({"strategy": "kf-linaer"})
    assert "\n" not in str(e.value) and "did you mean 'kf-linear'" in str(e.value)


def test_coercion():
    cfg = parse_run_config({"num-clients": "3", "lr": 1, "dirichlet-alpha": "0.3", "resume": "false"})
    assert cfg.num_clients == 3 and cfg.lr == 1.0 and cfg.dirichlet_alpha == 0.3 and cfg.resume is False


# ------------------------------------------------------------------------------ fusion options / method
@pytest.mark.parametrize("text", ["ridge=1e-3", "[1, 2]", "{ridge=}", "{ridge=1e-3"])
def test_bad_fusion_options_toml(text):
    with pytest.raises(ConfigError, match="run-config key 'fusion-options'"):
        parse_run_config({"fusion-options": text})


def test_fusion_options_inline_table():
    cfg = parse_run_config({"strategy": "kf-linear", "fusion-options": "{head_weights=true, ridge=1e-3}"})
    assert fusion_options_dict(cfg) == {"head_weights": True, "ridge": 1e-3}
    assert fusion_options_dict(parse_run_config({})) == {}


def test_unknown_fusion_option_for_the_method_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as e:
        parse_run_config({"strategy": "kf-linear", "fusion-options": "{ridg=1e-3}"})
    msg = str(e.value)
    assert "fusion-options" in msg and "'ridg'" in msg and "did you mean 'ridge'" in msg


def test_fusion_option_of_the_wrong_type_is_named():
    with pytest.raises(ConfigError, match="fusion-options.*ridge"):
        parse_run_config({"strategy": "kf-linear", "fusion-options": "{ridge='big'}"})


def test_fedavg_takes_no_fusion_options():
    with pytest.raises(ConfigError, match="fusion-options.*fedavg"):
        parse_run_config({"strategy": "fedavg", "fusion-options": "{ridge=1e-3}"})


def test_two_model_method_with_four_clients():
    with pytest.raises(ConfigError, match="'strategy'/'num-clients'.*hf-linear.*at most 2"):
        parse_run_config({"strategy": "hf-linear"})  # 4 clients by default
    parse_run_config({"strategy": "hf-linear", "num-clients": 2})
    # clients per round, as Flower's FedAvg samples them: max(int(fraction * n), min-train-nodes)
    cfg = parse_run_config({"strategy": "fedavg", "num-clients": 10, "fraction-train": 0.25, "min-train-nodes": 3})
    assert clients_per_round(cfg) == 3
    parse_run_config({"strategy": "hf-linear", "num-clients": 10, "fraction-train": 0.2})


@pytest.mark.parametrize("strategy", ["kf-linear", "hf-linear"])
@pytest.mark.parametrize("model", ["vit", "resnet"])
def test_closed_form_method_with_block_models(strategy, model):
    # residual / transformer models: the graph variant of linear neuron interpolation takes them (issue 57)
    cfg = parse_run_config({"strategy": strategy, "model": model, "dataset": "mnist1d", "num-clients": 2})
    assert cfg.strategy == strategy


def test_method_needing_a_fusion_set_without_one():
    with pytest.raises(ConfigError, match="'strategy'.*needs a fusion set.*public-fraction=0"):
        parse_run_config({"strategy": "kf-linear", "public-fraction": 0.0})
    parse_run_config({"strategy": "fedavg", "public-fraction": 0.0})            # no fusion set needed
    parse_run_config({"strategy": "kf-linear", "public-fraction": 0.0, "fusion-set-source": "client0"})


# ------------------------------------------------------------------------------------- files
def _digits_x(n=8, scale=1.0, dtype=np.float32):
    return (np.random.default_rng(0).random((n, 1, 8, 8)) * scale).astype(dtype)


def _cfg(path, **kw):
    return parse_run_config({"fusion-set-path": str(path), **kw})


def test_good_fusion_files_pass(tmp_path):
    np.savez(tmp_path / "f.npz", x=_digits_x(), y=np.arange(8) % 10)
    check_files(_cfg(tmp_path / "f.npz"))
    torch.save({"x": torch.rand(5, 1, 8, 8), "y": torch.arange(5)}, tmp_path / "f.pt")
    check_files(_cfg(tmp_path / "f.pt"))
    torch.save(torch.rand(5, 64), tmp_path / "flat.pt")
    check_files(_cfg(tmp_path / "flat.pt", dataset="digits-flat"))


def _fails(cfg, *needles):
    with pytest.raises(ConfigError) as e:
        check_files(cfg)
    msg = str(e.value)
    assert msg.startswith("run-config key 'fusion-set-path'") and cfg.fusion_set_path in msg and "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_missing_fusion_file(tmp_path):
    _fails(_cfg(tmp_path / "nope.npz"), "does not exist")


def test_corrupt_fusion_files(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"not a zip at all")
    _fails(_cfg(tmp_path / "bad.npz"), "not a readable .npz")
    (tmp_path / "bad.pt").write_bytes(b"\x00garbage")
    _fails(_cfg(tmp_path / "bad.pt"), "not a readable torch file")
    (tmp_path / "f.csv").write_text("1,2")
    _fails(_cfg(tmp_path / "f.csv"), "unknown format")
    np.savez(tmp_path / "noname.npz", inputs=_digits_x())
    _fails(_cfg(tmp_path / "noname.npz"), "'x'")


def test_wrong_shape_fusion_file(tmp_path):
    np.savez(tmp_path / "f.npz", x=np.random.rand(4, 64).astype(np.float32))
    _fails(_cfg(tmp_path / "f.npz"), "(64,)", "(1, 8, 8)")


def test_raw_scale_digits_file_is_rejected_with_the_expected_scale(tmp_path):
    np.savez(tmp_path / "raw.npz", x=_digits_x(scale=16.0))  # sklearn's raw 0..16 pixels
    _fails(_cfg(tmp_path / "raw.npz"), "[0, 1]", "divided by 16")
    np.savez(tmp_path / "int.npz", x=_digits_x(scale=16.0).astype(np.int64))
    _fails(_cfg(tmp_path / "int.npz"), "dtype", "[0, 1]")


def test_non_finite_and_bad_labels(tmp_path):
    x = _digits_x()
    x[0, 0, 0, 0] = np.nan
    np.savez(tmp_path / "nan.npz", x=x)
    _fails(_cfg(tmp_path / "nan.npz"), "non-finite")
    np.savez(tmp_path / "y.npz", x=_digits_x(), y=np.full(8, 10))
    _fails(_cfg(tmp_path / "y.npz"), "labels", "0..9")
    np.savez(tmp_path / "y2.npz", x=_digits_x(), y=np.zeros(3, dtype=np.int64))
    _fails(_cfg(tmp_path / "y2.npz"), "labels", "one per input")


def test_one_sample_fusion_file_is_refused_before_training(tmp_path):
    """Issue 45: feddf with a 1-sample fusion-set file passed the check and failed after round 1's training (FedDF
    holds part of the set out to early-stop on and fits on the rest: at least 2 samples, as fusion-set-size)."""
    np.savez(tmp_path / "one.npz", x=_digits_x(n=1))
    _fails(_cfg(tmp_path / "one.npz", strategy="feddf"), "1 sample", "at least 2")
    np.savez(tmp_path / "two.npz", x=_digits_x(n=2))
    check_files(_cfg(tmp_path / "two.npz", strategy="feddf"))


def test_standardised_dataset_rejects_pixel_scale(tmp_path):
    np.savez(tmp_path / "m.npz", x=(np.random.rand(6, 1, 40) * 255).astype(np.float32))
    _fails(_cfg(tmp_path / "m.npz", dataset="mnist1d"), "standardised")
    np.savez(tmp_path / "ok.npz", x=np.random.default_rng(0).normal(size=(6, 1, 40)).astype(np.float32))
    check_files(_cfg(tmp_path / "ok.npz", dataset="mnist1d"))


def test_hf_shape_is_checked_when_the_server_knows_it(tmp_path):
    np.savez(tmp_path / "f.npz", x=_digits_x())
    cfg = _cfg(tmp_path / "f.npz", dataset="hf:someone/data")
    check_files(cfg)  # shape unknown before loading: format, dtype and values only
    with pytest.raises(ConfigError, match="fusion-set-path.*shape"):
        check_files(cfg, input_shape=(3, 32, 32))


def test_data_root_checks(tmp_path):
    with pytest.raises(ConfigError, match="'data-root'"):
        check_files(parse_run_config({"dataset": "cifar10"}))
    with pytest.raises(ConfigError, match="'data-root'"):
        check_files(parse_run_config({"data-root": str(tmp_path / "missing")}))
    check_files(parse_run_config({"dataset": "cifar10", "data-root": str(tmp_path)}))


def test_model_that_cannot_take_the_inputs():
    with pytest.raises(ConfigError, match="'model'.*cnn.*digits-flat"):
        check_model(parse_run_config({"model": "cnn", "dataset": "digits-flat", "strategy": "fedavg"}))
    check_model(parse_run_config({"model": "cnn", "dataset": "digits", "strategy": "fedavg"}))


def test_preflight_is_complete():
    assert preflight({"strategy": "kf-linear", "num-server-rounds": 2}) == RunConfig(strategy="kf-linear", num_server_rounds=2)


# ------------------------------------------------------------------------------------- --run-config
def test_run_config_string_with_spaces_quotes_and_braces_is_kept():
    text = ("num-server-rounds=2  fusion-options=\"{head_weights=true, ridge=1e-3}\" run-name='a b' "
            "data-root=\"/tmp/x y\" other={match='balanced', k=[1, 2]} lr=1e-3 resume=true esc=\"say \\\"hi\\\"\"")
    assert split_run_config(text) == [
        ("num-server-rounds", "2"), ("fusion-options", "\"{head_weights=true, ridge=1e-3}\""), ("run-name", "'a b'"),
        ("data-root", "\"/tmp/x y\""), ("other", "{match='balanced', k=[1, 2]}"), ("lr", "1e-3"),
        ("resume", "true"), ("esc", "\"say \\\"hi\\\"\"")]
    assert parse_run_config_arg(text) == {
        "num-server-rounds": 2, "fusion-options": "{head_weights=true, ridge=1e-3}", "run-name": "a b",
        "data-root": "/tmp/x y", "other": "{match='balanced', k=[1, 2]}", "lr": 1e-3, "resume": True,
        "esc": 'say "hi"'}


def test_readme_examples_parse_and_pass_preflight():
    for text in ['strategy=\'kf-linear\' fusion-options="{head_weights=true, ridge=1e-3}"',
                 "strategy='fedavg' dataset='mnist1d' partitioning='dirichlet' dirichlet-alpha=0.3 num-server-rounds=10",
                 "mode='one-shot' num-server-rounds=1 local-epochs=30 strategy='kf-linear' fusion-set-source='client0'",
                 "strategy='kf-linear' fusion-options={match='balanced'}",
                 "strategy='feddf' dirichlet-alpha=0.1 refine='none'",
                 "strategy='average' refine='calibrate+distill' refine-prior='uniform'"]:
        preflight(parse_run_config_arg(text))


@pytest.mark.parametrize("text,needle", [
    ("num-server-rounds", "expected key=value"),
    ("strategy=fedavg", "'strategy'.*quotes"),
    ("run-name='unterminated", "'run-name'.*unterminated"),
    ("fusion-options={a=1", "'fusion-options'.*unbalanced"),
    ("seed=1 seed=2", "'seed'.*twice"),
    ("run-name=", "'run-name'.*no value"),
])
def test_bad_run_config_strings(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_run_config_arg(text)


def test_run_config_toml_file(tmp_path):
    (tmp_path / "c.toml").write_text("num-server-rounds = 2\nstrategy = \"kf-linear\"\nfusion-options = {match = \"balanced\", ridge = 0.01}\n")
    cfg = parse_run_config_arg(str(tmp_path / "c.toml"))
    assert cfg["num-server-rounds"] == 2
    assert fusion_options_dict(parse_run_config({"strategy": "kf-linear", "fusion-options": cfg["fusion-options"]})) == {
        "match": "balanced", "ridge": 0.01}


def test_runner_passes_quoted_values_through_flwr_run_config_parser():
    """Values with spaces, braces and double quotes survive flwr's --run-config parser (no escapes there)."""
    from flwr.common.config import parse_config_args

    from fedfuse.flower.runner.flwr_runner import run_config_arg

    cfg = {"fusion-options": '{match="balanced", ridge=0.01}', "seed": 3, "dataset": "digits", "resume": True,
           "lr": 0.005, "data-root": "/tmp/a b"}
    assert parse_config_args([run_config_arg(cfg)]) == cfg
    parsed = parse_run_config_arg('fusion-options="{head_weights=true, ridge=1e-3}" run-name=\'x y\'')
    assert parse_config_args([run_config_arg(parsed)]) == parsed
    with pytest.raises(ValueError, match="quote"):
        run_config_arg({"fusion-options": "{a=\"x\", b='y'}"})


def test_sweep_strategy_labels_keep_quoted_commas():
    from fedfuse.flower.runner.sweep import parse_strategy, split_strategies

    labels = split_strategies("fedavg, kf-linear[fusion-rounds=3 fusion-options=\"{ridge=1e-3, head_weights=true}\"]")
    assert labels == ["fedavg", "kf-linear[fusion-rounds=3 fusion-options=\"{ridge=1e-3, head_weights=true}\"]"]
    assert parse_strategy(labels[1]) == ("kf-linear", {"fusion-rounds": 3,
                                                       "fusion-options": "{ridge=1e-3, head_weights=true}"})


# ------------------------------------------------------------------------------------- runner
def test_runner_exits_on_a_bad_key_before_any_flower_process(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "fedfuse.flower.runner.run", "--run-config", "num-round=5",
                          "--output-dir", str(tmp_path / "out")], cwd=str(ROOT), env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines == ["fedfuse: config error: run-config: unknown key 'num-round' (did you mean 'num-server-rounds'?); "
                     "`python -m fedfuse.config` lists all keys"], res.stderr
    assert "code: 15" not in res.stdout + res.stderr
    # run_app makes a private FLWR_HOME under TMPDIR before it starts the SuperLink: there is none
    # how fast is measured (farm-bench, the issue 58 closing note), not asserted here: a loaded machine is slow
    assert not list(tmp_path.glob("fedfuse-flwr-home-*")) and not (tmp_path / "out").exists()


def test_run_app_checks_the_config_before_starting_flower(tmp_path, monkeypatch):
    from fedfuse.flower.runner import flwr_runner

    def no_superlink(*a, **k):
        raise AssertionError("a SuperLink was started for a bad config")

    monkeypatch.setattr(flwr_runner, "start_local_superlink", no_superlink)
    with pytest.raises(ConfigError, match="fusion-options"):
        flwr_runner.run_app({"fusion-options": "{ridg=1e-3}", "output-dir": str(tmp_path)})


def test_summary_marks_fallbacks_and_failed_runs(tmp_path, capsys):
    import json

    from fedfuse.flower.runner.run import report

    rounds = [{"round": 0, "test-accuracy": 0.1, "fallback": None},
              {"round": 1, "test-accuracy": 0.1, "fallback": "IncompatibleModelsError: hf-linear takes 2 models"}]
    (tmp_path / "results.json").write_text(json.dumps({"rounds": rounds, "fallbacks": 1, "status": "failed",
                                                       "error": "fusion never succeeded (1 of 1 rounds fell back)"}))
    assert report(tmp_path, True, "finished:completed") == 1
    out = capsys.readouterr()
    assert "fallback" in out.out.splitlines()[0] and "IncompatibleModelsError" in out.out
    assert "fusion never succeeded" in out.err
    (tmp_path / "results.json").write_text(json.dumps({"rounds": rounds[:1], "status": "completed"}))
    assert report(tmp_path, True, "finished:completed") == 0
    assert report(tmp_path, False, "finished:failed") == 1
    assert report(tmp_path / "none", True, "finished:completed") == 1


def test_preflight_rejects_partitionings_that_leave_a_client_empty():
    """``num-clients=1000`` on digits used to start Flower, fail hundreds of clients with raw Ray tracebacks and
    still end 'completed'; the preflight now names the key and the smallest clients before anything starts."""
    from fedfuse.config import preflight

    with pytest.raises(ConfigError, match=r"'num-clients': 1000 clients over \d+ training samples.*fewer than 2"):
        preflight({"num-clients": 1000})
    assert preflight({"num-clients": 4}).num_clients == 4


def test_default_fusion_set_size_is_an_upper_bound_a_set_size_warns():
    """The default fusion-set-size takes a small dataset's whole public pool without a warning (digits: 287 < 2000);
    a size the user sets that the pool cannot hold warns."""
    import warnings

    from fedfuse.config import data_options
    from fedfuse.data.fusion_set import FederatedData

    base = {"dataset": "digits", "num-clients": 2, "partitioning": "iid"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = FederatedData.build(**data_options(parse_run_config(base)))
    assert 0 < len(data.fusion_x) < RunConfig().fusion_set_size and len(data.fusion_x) == len(data.reserved)
    with pytest.warns(UserWarning, match="fewer than the 1999 requested"):
        FederatedData.build(**data_options(parse_run_config({**base, "fusion-set-size": 1999})))
