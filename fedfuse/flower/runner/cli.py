"""The command-line side of the runners: the check before Flower starts and the engine switch.

``--run-config`` is read by ``fedfuse.run_config_text.parse_run_config_arg`` (outside ``fedfuse.flower``, so that
``fedfuse run`` checks a run config before it imports Flower); ``flwr_runner.run_config_arg`` quotes the values
so that flwr's escape-less parser reads them back.

``preflight_or_exit`` runs ``fedfuse.config.preflight`` and turns a ``ConfigError`` into one line,
``fedfuse: config error: ...``, and exit status 2, before any SuperLink or Ray process exists.

``run_with_engine`` runs one config on either engine (``--engine flwr|inprocess`` of ``run`` and ``sweep``);
``split_list`` splits comma lists outside quotes and brackets (``--strategies``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fedfuse.config import ConfigError, RunConfig, canonical, config_notes, preflight
from fedfuse.flower.runner.flwr_runner import run_app
from fedfuse.run_config_text import parse_run_config_arg, split_run_config  # noqa: F401  split_run_config: its old home

EXIT_CONFIG_ERROR = 2


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


def absolute_paths(cfg: dict[str, Any]) -> dict[str, Any]:
    """Relative ``output-dir`` / ``fusion-set-path`` / ``data-root`` taken from the caller's directory: the
    Flower processes run elsewhere."""
    out = dict(cfg)
    for key in ("output-dir", "fusion-set-path", "data-options.test-set-path", "data-root",
                "data-options.partition-files"):
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
        return absolute_paths(canonical(parse_run_config_arg(text)))
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
