"""The run configuration's layout: the top-level keys and the option table of each concern.

A run config is a few top-level keys (what a run is: mode, data, model, training, strategy, fusion set, head round,
tiers, where results go) and one option table per concern for everything else::

    bash scripts/run.sh --run-config "strategy='average' dp-options={noise-multiplier=1.0,clipping-norm=5.0}"
    flwr run . --run-config "dp-options.noise-multiplier=1.0 dp-options.clipping-norm=5.0"   # Flower's dotted form

``pyproject.toml`` declares each table as ``[tool.flwr.app.config.<table>]``, so Flower itself accepts the dotted
keys. Inside fedfuse a run config's *canonical* form is Flower's: flat, dotted keys (``"dp-options.noise-multiplier"``);
``canonical_run_config`` brings any accepted form there: an inline table (a TOML dict or its text), dotted keys, or a
former flat spelling (``dp-noise-multiplier``, accepted with a ``ConfigNote``). The typed schema
(``fedfuse.config.RunConfig``, one field per setting) does not change with the layout: a field's *path* is where a
user writes it. This module imports nothing of fedfuse but its exceptions' base classes.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
import warnings
from typing import Any, Mapping

#: option tables: table key -> {entry: the setting's field key (``fedfuse.config.RunConfig``, ``_`` as ``-``)}
OPTION_TABLES: dict[str, dict[str, str]] = {
    "data-options": {"classes-per-client": "classes-per-client", "val-fraction": "val-fraction",
                     "test-fraction": "test-fraction", "public-fraction": "public-fraction",
                     "partition-files": "partition-files", "test-set-path": "test-set-path"},
    "client-options": {"weight-decay": "weight-decay", "momentum": "momentum", "importance": "importance",
                       "importance-samples": "importance-samples", "tofu-r": "tofu-r"},
    "strategy-options": {"fraction-train": "fraction-train", "min-train-nodes": "min-train-nodes",
                         "round-timeout": "round-timeout", "fusion-fallback": "fusion-fallback",
                         "fusion-rounds": "fusion-rounds", "refine": "refine", "refine-prior": "refine-prior",
                         "divergence-guard": "divergence-guard", "server-lr": "server-lr",
                         "server-momentum": "server-momentum", "align-to": "align-to", "proximal-mu": "proximal-mu",
                         "trim-beta": "trim-beta", "num-malicious-nodes": "num-malicious-nodes",
                         "num-nodes-to-select": "num-nodes-to-select", "mom-beta": "mom-beta",
                         "auto-candidates": "auto-candidates", "auto-fusion-epochs": "auto-fusion-epochs",
                         "auto-momentum": "auto-momentum"},
    "report-options": {"one-shot-references": "one-shot-references", "client-references": "client-references"},
    "head-options": {"ridge": "head-ridge", "solver": "head-solver", "secure-aggregation": "secure-aggregation"},
    "robust-options": {"cluster": "robust-cluster", "cosine-mads": "robust-cosine-mads",
                       "cluster-min-samples": "robust-cluster-min-samples"},
    "dp-options": {"noise-multiplier": "dp-noise-multiplier", "clipping-norm": "dp-clipping-norm",
                   "clipping": "dp-clipping", "delta": "dp-delta", "max-epsilon": "dp-max-epsilon",
                   "head-noise-multiplier": "dp-head-noise-multiplier", "head-projection": "dp-head-projection"},
    "tier-options": {"models": "tier-models", "ordered-dropout": "ordered-dropout",
                     "ordered-dropout-draw": "ordered-dropout-draw"},
    "warm-start-options": {"epochs": "warm-start-epochs", "lr": "warm-start-lr", "fusion": "warm-start-fusion",
                           "fusion-options": "warm-start-fusion-options"},
}

#: the strategy-options entries that say how the federation runs (sampling, the round timeout, what a failed
#: aggregation does): they belong to the run, not to the strategy it names
FEDERATION_OPTIONS = ("fraction-train", "min-train-nodes", "round-timeout", "fusion-fallback")
#: where a strategy's own settings are written: its fusion method's options, every other strategy option (its steps,
#: its server optimizer, its Flower options, its candidates) and how capacity tiers derive their models. A run of
#: another strategy on the same federation (a comparison's baseline) leaves them out and keeps every other key
STRATEGY_OWN_PATHS: tuple[str, ...] = (
    ("fusion-options",)
    + tuple(f"strategy-options.{entry}" for entry in OPTION_TABLES["strategy-options"] if entry not in FEDERATION_OPTIONS)
    + ("tier-options.models", "tier-options.ordered-dropout"))

#: field key -> its path (``"dp-options.noise-multiplier"``) for the settings that live in a table
TABLE_PATHS: dict[str, str] = {key: f"{table}.{entry}" for table, entries in OPTION_TABLES.items()
                               for entry, key in entries.items()}
#: path -> field key, the inverse of ``TABLE_PATHS``
PATH_KEYS: dict[str, str] = {path: key for key, path in TABLE_PATHS.items()}
#: settings whose value is itself a TOML inline table written as text (a nested table is accepted and written back)
TEXT_TABLES = ("fusion-options", "warm-start-fusion-options")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def path_of(key: str) -> str:
    """Where the setting of field key ``key`` is written: its table path, or ``key`` itself at the top level."""
    return TABLE_PATHS.get(key, key)


def toml_inline(value: Any) -> str:
    """A Python value (from ``tomllib``) as TOML inline text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # inf / nan are TOML too
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        keys = (k if _BARE_KEY.fullmatch(k) else json.dumps(k) for k in value)
        return "{" + ", ".join(f"{k}={toml_inline(v)}" for k, v in zip(keys, value.values())) + "}"
    raise ValueError(f"cannot write {value!r} as TOML")


def _table_entries(table: str, value: Any, error: type[Exception]) -> dict[str, Any]:
    """An option table given as a dict or as its inline-table text -> ``{entry: value}``."""
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError as exc:
            raise error(f"run-config key {table!r}: {text!r} is not a TOML inline table ({exc}), e.g. "
                        f"{table}={{{next(iter(OPTION_TABLES[table]))}=...}}") from None
    if not isinstance(value, dict):
        raise error(f"run-config key {table!r}: expected a table of options, got {value!r}")
    return value


def _unknown_entry(table: str, entry: str, error: type[Exception]) -> Exception:
    entries = list(OPTION_TABLES[table])
    close = difflib.get_close_matches(entry, entries, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return error(f"run-config key {table!r}: unknown option {entry!r}{hint}; its options: {entries}")


def canonical_run_config(run_config: Mapping[str, Any] | None, *, top_level: tuple[str, ...],
                         error: type[Exception], note: type[Warning]) -> dict[str, Any]:
    """``run_config`` in its canonical form: top-level keys and dotted table paths (Flower's flat form).

    Accepts an option table as a dict or inline-table text (``dp-options={noise-multiplier=1.0}``), dotted keys
    (``dp-options.noise-multiplier=1.0``) and a setting's former flat spelling (``dp-noise-multiplier``: a ``note``
    warning says the path). A setting given twice is an ``error``; unknown keys are left for the caller (who knows
    whether it is strict). ``top_level``: the top-level setting keys."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}   # path -> how the user wrote it

    def put(path: str, value: Any, written: str) -> None:
        if path in out:
            raise error(f"run-config key {path!r}: given twice ({given[path]!r} and {written!r})")
        key = PATH_KEYS.get(path, path)
        if key in TEXT_TABLES and isinstance(value, dict):
            value = toml_inline(value)   # a nested table written back as the text the setting holds
        out[path], given[path] = value, written

    for key, value in dict(run_config or {}).items():
        if key in OPTION_TABLES:
            for entry, v in _table_entries(key, value, error).items():
                if entry not in OPTION_TABLES[key]:
                    raise _unknown_entry(key, entry, error)
                put(f"{key}.{entry}", v, f"{key}={{{entry}=...}}")
        elif key in PATH_KEYS or key in top_level:
            put(key, value, key)
        elif key in TABLE_PATHS:
            warnings.warn(f"run-config key {key!r} is now written {TABLE_PATHS[key]!r} (the former spelling still "
                          "works; docs/configuration.md)", note, stacklevel=3)
            put(TABLE_PATHS[key], value, key)
        elif "." in key and key.split(".", 1)[0] in OPTION_TABLES:
            table, entry = key.split(".", 1)
            raise _unknown_entry(table, entry, error)
        else:
            out[key] = value   # unknown: the caller decides
    return out


__all__ = ["OPTION_TABLES", "TABLE_PATHS", "PATH_KEYS", "TEXT_TABLES", "path_of", "toml_inline",
           "canonical_run_config"]
