"""The ``--run-config`` text of the command line, read into ``{key: value}`` (``parse_run_config_arg``).

``--run-config`` takes what ``flwr run --run-config`` takes: space-separated ``key=value`` pairs whose
values are TOML (``num-server-rounds=5 strategy='kf-linear' fusion-options="{ridge=1e-3, solver='x'}"``),
or the path of a ``.toml`` file of such keys. Splitting on whitespace breaks values that hold spaces, so
``split_run_config`` scans the text: a value runs to the next whitespace that is outside quotes
(``'...'`` literal, ``"..."`` with backslash escapes, as in TOML) and outside ``{...}`` / ``[...]``.
Each value is then read with ``tomllib``; an unquoted inline table (``fusion-options={ridge=1e-3}``) is
kept as its text, the form ``fusion-options`` takes. The runners pass the values on to ``flwr run``
unchanged (``fedfuse.flower.runner.flwr_runner.run_config_arg`` quotes them so that flwr's escape-less parser
reads them back).

It lives outside ``fedfuse.flower`` (whose import loads Flower and every strategy) so that ``fedfuse run`` reads
and checks a run config before it imports the runner (``fedfuse.cli``): a config error is reported in about a
second. It imports ``fedfuse.config`` only, for ``ConfigError``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from fedfuse.config import ConfigError
from fedfuse.config_layout import toml_inline



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
