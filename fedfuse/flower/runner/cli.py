"""The command-line side of the runners: the ``--run-config`` tokenizer and the check before Flower starts.

``--run-config`` takes what ``flwr run --run-config`` takes: space-separated ``key=value`` pairs whose
values are TOML (``num-server-rounds=5 strategy='kf-linear' fusion-options="{ridge=1e-3, solver='x'}"``),
or the path of a ``.toml`` file of such keys. Splitting on whitespace breaks values that hold spaces, so
``split_run_config`` scans the text: a value runs to the next whitespace that is outside quotes
(``'...'`` literal, ``"..."`` with backslash escapes, as in TOML) and outside ``{...}`` / ``[...]``.
Each value is then read with ``tomllib``; an unquoted inline table (``fusion-options={ridge=1e-3}``) is
kept as its text, the form ``fusion-options`` takes. The runners pass the values on to ``flwr run``
unchanged (``flwr_runner.run_config_arg`` quotes them so that flwr's escape-less parser reads them back).

``preflight_or_exit`` runs ``fedfuse.config.preflight`` and turns a ``ConfigError`` into one line,
``fedfuse: config error: ...``, and exit status 2, before any SuperLink or Ray process exists.

``run_with_engine`` runs one config on either engine (``--engine flwr|inprocess`` of ``run`` and ``sweep``);
``split_list`` splits comma lists outside quotes and brackets (``--strategies``).
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

from fedfuse.config import ConfigError, RunConfig, config_notes, preflight
from fedfuse.flower.runner.flwr_runner import run_app

EXIT_CONFIG_ERROR = 2
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def split_run_config(text: str) -> list[tuple[str, str]]:
    """``"k1=v1 k2='a b'"`` → ``[("k1", "v1"), ("k2", "'a b'")]``: keys and raw TOML value texts, in order.

    Raises ``ConfigError`` on a token without ``=``, an empty key or value, an unterminated quote or
    unbalanced braces, naming the key.
    """
    pairs: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        if text[i].isspace():
            i += 1
            continue
        start = i
        while i < n and text[i] != "=" and not text[i].isspace():
            i += 1
        key = text[start:i]
        if i >= n or text[i] != "=":
            raise ConfigError(f"--run-config: expected key=value, got {key!r}")
        if not key:
            raise ConfigError(f"--run-config: a value without a key at {text[start:start + 30]!r}")
        i += 1
        vstart, depth, quote = i, 0, ""
        while i < n:
            c = text[i]
            if quote:
                if quote == '"' and c == "\\":
                    i += 2
                    continue
                if c == quote:
                    quote = ""
            elif c in "'\"":
                quote = c
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
            elif c.isspace() and depth <= 0:
                break
            i += 1
        raw = text[vstart:i]
        if quote:
            raise ConfigError(f"run-config key {key!r}: unterminated {quote} quote in {raw!r}")
        if depth != 0:
            raise ConfigError(f"run-config key {key!r}: unbalanced braces/brackets in {raw!r}")
        if not raw:
            raise ConfigError(f"run-config key {key!r}: no value (write {key}='' for an empty string)")
        pairs.append((key, raw))
    return pairs


def split_list(text: str, sep: str = ",") -> list[str]:
    """Split ``text`` on ``sep`` outside quotes and ``[...]`` / ``{...}``; items stripped, empty ones dropped.

    ``"fedavg,kf-linear[fusion-options='{a=1, b=2}']"`` → ``["fedavg", "kf-linear[fusion-options='{a=1, b=2}']"]``.
    Shared by the sweep's strategy list and the benchmarks' comma lists.
    """
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == sep and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


def toml_inline(value: Any) -> str:
    """A Python value (from ``tomllib``) back as TOML inline text (for tables read from a ``.toml`` file)."""
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
    raise ConfigError(f"run-config: cannot write {value!r} as TOML")


def parse_run_config_arg(text: str) -> dict[str, Any]:
    """``--run-config`` text (pairs or a ``.toml`` path) → ``{key: value}``; ``ConfigError`` naming the key."""
    text = text.strip()
    if text.endswith(".toml") and "=" not in text:
        path = Path(text).expanduser()
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"--run-config: cannot read {str(path)!r} ({exc})") from None
        return {k: (toml_inline(v) if isinstance(v, dict) else v) for k, v in data.items()}
    out: dict[str, Any] = {}
    for key, raw in split_run_config(text):
        if key in out:
            raise ConfigError(f"run-config key {key!r}: given twice")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"run-config key {key!r}: {raw!r} is not a TOML value ({exc}); strings need quotes, "
                              f"e.g. {key}='text'") from None
        out[key] = raw if isinstance(value, dict) else value  # an inline table stays its text
    return out


def absolute_paths(cfg: dict[str, Any]) -> dict[str, Any]:
    """Relative ``output-dir`` / ``fusion-set-path`` / ``data-root`` taken from the caller's directory: the
    Flower processes run elsewhere."""
    out = dict(cfg)
    for key in ("output-dir", "fusion-set-path", "test-set-path", "data-root", "partition-files"):
        value = out.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            out[key] = str(Path(value).expanduser().resolve())
    return out


def config_error_exit(exc: ConfigError) -> "SystemExit":
    print(f"fedfuse: config error: {exc}", file=sys.stderr, flush=True)
    return SystemExit(EXIT_CONFIG_ERROR)


def preflight_or_exit(run_config: dict[str, Any]) -> RunConfig:
    """``fedfuse.config.preflight`` or exit with ``fedfuse: config error: ...`` (status 2)."""
    try:
        with config_notes():   # what the check resolved is the ServerApp's to say (logged once, recorded)
            return preflight(run_config)
    except ConfigError as exc:
        raise config_error_exit(exc) from None


def overrides_or_exit(text: str) -> dict[str, Any]:
    """``parse_run_config_arg`` + ``absolute_paths`` or exit with the one-line config error."""
    try:
        return absolute_paths(parse_run_config_arg(text))
    except ConfigError as exc:
        raise config_error_exit(exc) from None


ENGINES = ("flwr", "inprocess")
ENGINE_HELP = ("flwr: a real `flwr run` (SuperLink + Ray simulation engine); inprocess: the same ServerApp body and "
               "ClientApp in this process on a LocalGrid (fedfuse.flower.runner.inprocess; no Ray, no transport, "
               "faster on small models: simulations/README.md, 'In-process engine'; same numbers with "
               "fraction-train=1)")


def run_with_engine(engine: str, run_config: dict[str, Any], *, num_supernodes: int, timeout: float, echo: bool,
                    check_config: bool | None = None, on_line=None, partitions: list[int] | None = None):
    """One run on ``engine`` (``ENGINES``); the ``flwr_runner.RunOutcome`` either way (``timeout`` bounds the
    ``flwr run`` process; the in-process engine holds each client call to the run's ``round-timeout``).
    ``on_line`` receives every log line of the run (``fedfuse.flower.runner.console.QuietConsole``).
    ``partitions``: host only these partition ids (in-process engine only; ``LocalGrid``)."""
    if partitions is not None and engine != "inprocess":
        raise ValueError("a subset of partitions (partitions=) needs engine 'inprocess'")
    if engine == "flwr":
        return run_app(run_config, num_supernodes=num_supernodes, timeout=timeout, echo=echo,
                       check_config=check_config, on_line=on_line)
    if engine == "inprocess":
        from fedfuse.flower.runner.inprocess import run_app_inprocess  # deferred: its import sets OMP_*, HF_* env

        return run_app_inprocess(run_config, num_supernodes=num_supernodes, echo=echo, check_config=check_config,
                                 on_line=on_line, partitions=partitions)
    raise ValueError(f"--engine: unknown engine {engine!r}; choose one of {list(ENGINES)}")
