"""Run config: pyproject defaults parse, and every bad key or value fails fast naming the key."""

import tomllib
from pathlib import Path

import pytest

from fedfuse.config import ConfigError, RunConfig, parse_run_config

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_defaults_are_valid_and_complete():
    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = parse_run_config(defaults)
    assert set(defaults) == set(RunConfig().to_dict()), "pyproject and RunConfig declare different keys"
    assert cfg.to_dict() == {**RunConfig().to_dict(), **defaults}


def test_empty_config_gives_defaults():  # run_simulation hands the app an empty run_config
    assert parse_run_config({}) == RunConfig()


@pytest.mark.parametrize("override,key", [
    ({"num-clinets": 3}, "num-clinets"),
    ({"num-clients": "four"}, "num-clients"),
    ({"dataset": "imagenet"}, "dataset"),
    ({"model": "gpt"}, "model"),
    ({"partitioning": "random"}, "partitioning"),
    ({"importance": "shap"}, "importance"),
    ({"lr": -1.0}, "lr"),
    ({"val-fraction": 1.5}, "val-fraction"),
    ({"fusion-set-source": "server"}, "fusion-set-source"),
    ({"device": "tpu"}, "device"),
    ({"fusion-options": "ridge=1e-3"}, "fusion-options"),
    ({"fusion-options": "[1, 2]"}, "fusion-options"),
    ({"mode": "one-shot", "num-server-rounds": 3}, "num-server-rounds"),
    ({"min-train-nodes": 9, "num-clients": 4}, "min-train-nodes"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        parse_run_config(override)


def test_unknown_strategy_names_key():
    with pytest.raises(ConfigError, match="strategy"):
        parse_run_config({"strategy": "fedmagic"}, known_strategies=("fedavg", "average"))


def test_fusion_options_inline_table():
    from fedfuse.config import fusion_options_dict

    cfg = parse_run_config({"fusion-options": "{head_weights=true, ridge=1e-3, setting=2}"})
    assert fusion_options_dict(cfg) == {"head_weights": True, "ridge": 1e-3, "setting": 2}
    assert fusion_options_dict(parse_run_config({})) == {}


def test_coercion():
    cfg = parse_run_config({"num-clients": "3", "lr": 1, "dirichlet-alpha": "0.3"})
    assert cfg.num_clients == 3 and cfg.lr == 1.0 and cfg.dirichlet_alpha == 0.3


def test_fusion_rounds_must_be_non_negative():
    from fedfuse.config import ConfigError, parse_run_config

    assert parse_run_config({"fusion-rounds": 3}).fusion_rounds == 3
    with pytest.raises(ConfigError, match="fusion-rounds"):
        parse_run_config({"fusion-rounds": -1})


def test_runner_passes_quoted_values_through_flwr_run_config_parser():
    """fusion-options with double quotes must survive flwr's --run-config parser (no escapes there)."""
    from flwr.common.config import parse_config_args

    from simulations.runners.flwr_runner import run_config_arg

    cfg = {"fusion-options": '{match="balanced", ridge=0.01}', "seed": 3, "dataset": "digits", "resume": True,
           "lr": 0.005, "data-root": "/tmp/a b"}
    assert parse_config_args([run_config_arg(cfg)]) == cfg
    with pytest.raises(ValueError, match="quote"):
        run_config_arg({"fusion-options": "{a=\"x\", b='y'}"})
