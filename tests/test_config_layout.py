"""The run config in layers: a few top-level keys, one option table per concern, every accepted form the same config.

What Flower itself accepts (``flwr run . --run-config "dp-options.noise-multiplier=1.0"``, an inline table, a TOML file
with ``[dp-options]``) and what fedfuse's runner accepts parse to the same ``RunConfig``; a former flat spelling still
works with a note; mistakes inside a table name the table and the option.
"""

import warnings
from pathlib import Path

import pytest
from flwr.common.config import get_fused_config_from_dir, parse_config_args

from fedfuse.config import (SCHEMA, TOP_LEVEL_KEYS, ConfigError, ConfigNote, RunConfig, canonical, parse_run_config)
from fedfuse.config_layout import OPTION_TABLES, PATH_KEYS, TABLE_PATHS
from fedfuse.flower.runner.run import parse_run_config_arg

ROOT = Path(__file__).resolve().parents[1]
DP = RunConfig(strategy="fedavg", dp_noise_multiplier=1.0, dp_clipping_norm=5.0)


def test_at_most_40_top_level_keys_and_every_setting_has_one_place():
    assert len(TOP_LEVEL_KEYS) <= 40, TOP_LEVEL_KEYS
    paths = [spec.path for spec in SCHEMA.values()]
    assert len(set(paths)) == len(paths) == len(SCHEMA)
    assert set(TABLE_PATHS) <= set(SCHEMA) and set(PATH_KEYS) == set(TABLE_PATHS.values())
    # the keys API.md promises stay top-level
    for key in ("strategy", "dataset", "partitioning", "dirichlet-alpha", "num-clients", "num-server-rounds",
                "local-epochs", "optimizer", "lr", "batch-size", "model", "model-width", "model-depth", "seed",
                "output-dir", "run-name", "fusion-options", "client-tiers"):
        assert SCHEMA[key].path == key


@pytest.mark.parametrize("given", [
    {"strategy": "fedavg", "dp-options": "{noise-multiplier=1.0, clipping-norm=5.0}"},     # inline-table text
    {"strategy": "fedavg", "dp-options": {"noise-multiplier": 1.0, "clipping-norm": 5}},    # a TOML table
    {"strategy": "fedavg", "dp-options.noise-multiplier": 1.0, "dp-options.clipping-norm": 5.0},  # Flower's dotted keys
])
def test_every_form_of_a_table_is_the_same_config(given):
    assert parse_run_config(given) == DP


def test_a_former_flat_spelling_works_with_a_note_naming_the_new_path():
    with pytest.warns(ConfigNote, match="'dp-options.noise-multiplier'"):
        cfg = parse_run_config({"strategy": "fedavg", "dp-noise-multiplier": 1.0, "dp-options.clipping-norm": 5.0})
    assert cfg == DP


@pytest.mark.parametrize("given, message", [
    ({"dp-options": "{noise-multplier=1.0}"}, r"'dp-options': unknown option 'noise-multplier' \(did you mean "
                                              r"'noise-multiplier'\?\)"),
    ({"dp-options.clip-norm": 1.0}, r"'dp-options': unknown option 'clip-norm'"),
    ({"dp-option.noise-multiplier": 1.0}, r"unknown key 'dp-option.noise-multiplier' \(did you mean "),
    ({"dp-options": "{noise-multiplier=}"}, r"'dp-options': .* is not a TOML inline table"),
    ({"dp-options": 3}, r"'dp-options': expected a table of options"),
    ({"dp-noise-multiplier": 1.0, "dp-options.noise-multiplier": 2.0}, r"'dp-options.noise-multiplier': given twice"),
    ({"strategy-options.server-momentum": 2.0}, r"'strategy-options.server-momentum' must be >= -1 and < 1"),
    ({"head-options.solver": "qr"}, r"'head-options.solver': 'qr' is not one of"),
])
def test_mistakes_in_a_table_name_the_table_and_the_option(given, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigNote)
        with pytest.raises(ConfigError, match=message):
            parse_run_config(given)


def test_the_canonical_form_round_trips_and_is_what_results_record():
    cfg = parse_run_config({"strategy": "kf-linear", "head-options": "{solver='lda'}", "tier-options.models": "slice",
                            "client-tiers": "1,0.5"})
    flat = cfg.to_dict()
    assert flat["head-options.solver"] == "lda" and flat["tier-options.models"] == "slice"
    assert not set(flat) & set(TABLE_PATHS)   # no former spelling in the record
    assert parse_run_config(flat) == cfg


def test_a_nested_fusion_options_table_is_kept_as_its_text():
    cfg = parse_run_config({"mode": "warm-start", "warm-start-options": {"fusion": "ot", "fusion-options": {}}})
    assert cfg.warm_start_fusion == "ot" and cfg.warm_start_fusion_options == "{}"


def test_flowers_own_parser_and_pyproject_take_the_layout():
    """``flwr run . --run-config`` as a user types it: Flower parses it, fuses it with pyproject's tables (unknown keys
    raise there), and the ServerApp's parse gives the same config as fedfuse's runner."""
    for text in ("strategy='fedavg' dp-options.noise-multiplier=1.0 dp-options.clipping-norm=5.0",
                 "strategy='fedavg' dp-options={noise-multiplier=1.0,clipping-norm=5.0}"):
        fused = get_fused_config_from_dir(ROOT, parse_config_args([text]))
        assert parse_run_config(fused) == DP
        assert parse_run_config(canonical(parse_run_config_arg(text))) == DP
    assert parse_run_config(get_fused_config_from_dir(ROOT, {})) == RunConfig()


def test_a_toml_file_with_table_sections(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "fedavg"\n\n[dp-options]\nnoise-multiplier = 1.0\nclipping-norm = 5.0\n')
    assert parse_run_config(canonical(parse_run_config_arg(str(path)))) == DP


def test_every_table_entry_is_a_setting_of_that_concern():
    for table, entries in OPTION_TABLES.items():
        assert table.endswith("-options") and entries
        for entry, key in entries.items():
            assert key in SCHEMA and SCHEMA[key].path == f"{table}.{entry}"
