"""``fedfuse``: the command line installed with the package (``[project.scripts]``).

    fedfuse run [--run-config "..."] [--no-compare] [--verbose]     the default run: the strategy through `flwr run`,
                                                                    then FedAvg on the same split and seed, a table
    fedfuse compare --strategies average,fedavg --seeds 0,1,2 ...   several strategies on the same splits and seeds
    fedfuse fusion-set /abs/fusion.npz [--dataset digits --size 250 --seed 0 | --run-config "..."]
                                                                    the server's fusion-set file for a deployment
    fedfuse config [KEY ...] [--markdown]                           the run-config keys: type, default, help

``run`` and ``compare`` are the package's runners (``fedfuse.flower.runner``): installed from a wheel they use the
Flower app configuration shipped in the package and write under ``./results``; in a checkout they use the
checkout's ``pyproject.toml`` and ``results/``. The command is the product's only: the repository's experiments
(benchmarks) have their own entry point in the repository and are neither named nor imported here.
``fedfuse <command> --help`` shows each command's options. This module imports no Flower itself (the runners it
calls do). ``fedfuse run`` checks its ``--run-config`` (``fedfuse.config.parse_run_config``) before it imports the
runner, and with it Flower, Ray and every strategy: a config error is one line and exit status 2 in about a second.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from fedfuse.config_layout import OPTION_TABLES, PATH_KEYS   # light: no torch (the config itself is imported lazily)
from fedfuse.processes import default_flwr_home, stop_local_superlink   # light: stdlib only
from fedfuse.run_control import RunFolderBusy, RunInterrupted, interrupt_signals, signal_name_of   # light: stdlib only


EXIT_USAGE = 2


def _config():
    """``fedfuse.config``, imported on first use: it loads torch, which ``fedfuse --help`` does not need."""
    import fedfuse.config  # deferred: torch, for a fast `fedfuse --help`

    return fedfuse.config


def _fusion_files():
    """``fedfuse.data.fusion_set`` (the fusion-set file writers), imported on first use (torch, as ``_config``)."""
    import fedfuse.data.fusion_set  # noqa: F401  deferred: torch, for a fast `fedfuse --help`

    return sys.modules["fedfuse.data.fusion_set"]   # the package's name `fusion_set` is a function


def _parse_run_config_arg(text: str) -> dict:
    """``--run-config`` text → ``{key: value}`` (``fedfuse.run_config_text``, imported on first use: it imports
    ``fedfuse.config``)."""
    from fedfuse.run_config_text import parse_run_config_arg  # deferred: fedfuse.config (torch), for a fast --help

    return parse_run_config_arg(text)


COMMANDS = {
    "run": "the default run: the strategy through `flwr run`, then FedAvg on the same split and seed, side by side "
           "(fedfuse.flower.runner.run)",
    "compare": "several strategies x partitionings x seeds, mean ± std table and plot (fedfuse.flower.runner.sweep)",
    "fusion-set": "write the server's fusion-set file (.npz/.pt), preprocessed exactly as a run loads it",
    "config": "list the run-config keys (type, default, allowed values, meaning)",
    "stop-superlink": "stop the local SuperLink (and its SuperExec, ServerApp, Ray) that a plain `flwr run` left "
                      "running",
}


class CliError(Exception):
    """A usage problem reported as one ``fedfuse: ...`` line with exit status 2."""


def _exit_code(value: object) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


# -------------------------------------------------------------------------------------------------- run / compare
def check_run_config(argv: list[str]) -> None:
    """``fedfuse run``'s ``--run-config`` read and checked (``fedfuse.config.parse_run_config``) before the runner is
    imported: a bad key or value fails as the runner reports it (``fedfuse: config error: ...``, status 2) without
    loading Flower, Ray or the strategies first. The runner checks again, and more (``preflight``: the files, the
    model, the baseline's config). Nothing to check with ``--help``, or arguments the runner's parser will reject."""
    if "-h" in argv or "--help" in argv:
        return
    ap = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    ap.add_argument("--run-config", default="")
    try:
        text = ap.parse_known_args(argv)[0].run_config
    except argparse.ArgumentError:
        return
    config = _config()
    try:
        with config.config_notes():   # the runner's check says what it resolved
            config.parse_run_config(_parse_run_config_arg(text))
    except config.ConfigError as exc:
        raise CliError(f"config error: {exc}") from None


def cmd_run(argv: list[str]) -> int:
    check_run_config(argv)
    from fedfuse.flower.runner import run  # deferred: Flower (flwr), imported by fedfuse.flower only

    return _exit_code(run.main(argv, prog="fedfuse run"))


def cmd_compare(argv: list[str]) -> int:
    from fedfuse.flower.runner import sweep  # deferred: Flower (flwr), imported by fedfuse.flower only

    return _exit_code(sweep.main(argv, prog="fedfuse compare"))


# ------------------------------------------------------------------------------------------------- fusion-set
def fusion_set_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fedfuse fusion-set", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write the server's fusion set to PATH (.npz: x [B, *input_shape] float32, y [B] int64; .pt: "
                    "{'x', 'y'}), drawn and preprocessed exactly as a run with the same run-config keys loads it, so "
                    "that run-config fusion-set-path=PATH passes the shape and value-range checks "
                    "(fedfuse.data.fusion_set.write_fusion_set_file).",
        epilog="examples:\n"
               "  fedfuse fusion-set /srv/fedfuse/fusion.npz --dataset digits --size 250 --seed 0\n"
               "  fedfuse fusion-set fusion.npz --run-config \"dataset='mnist1d' fusion-set-size=300 seed=1\" "
               "--test-set test.npz\n"
               "then: flwr run . <connection> --run-config \"fusion-set-path='/srv/fedfuse/fusion.npz' ...\"")
    ap.add_argument("path", help="output file, .npz or .pt")
    ap.add_argument("--run-config", default="",
                    help="run-config keys the file must match (dataset, fusion-set-size, fusion-set-source, seed, "
                         "public-fraction, num-clients, partitioning, ...), as for a run; the flags below override")
    schema = _config().SCHEMA
    ap.add_argument("--dataset", default=None, help=f"run-config dataset (default {schema['dataset'].default!r})")
    ap.add_argument("--size", type=int, default=None,
                    help=f"run-config fusion-set-size (default {schema['fusion-set-size'].default})")
    ap.add_argument("--seed", type=int, default=None, help=f"run-config seed (default {schema['seed'].default})")
    ap.add_argument("--source", default=None, help="run-config fusion-set-source: public (held-out pool no client "
                    f"sees) or client0 (default {schema['fusion-set-source'].default!r})")
    ap.add_argument("--data-root", default=None, help="run-config data-root (torchvision / local datasets)")
    ap.add_argument("--no-labels", action="store_true", help="write the inputs only (labels are needed only for "
                    "server-side importance scores)")
    ap.add_argument("--test-set", default="", metavar="PATH",
                    help="also write the dataset's test split to PATH (same format), for a server that evaluates "
                         "centrally without the training data")
    return ap


def fusion_set_config(args: argparse.Namespace):
    """The validated run config the file is drawn for (``fedfuse.config.parse_run_config``: a bad value fails
    naming its run-config key)."""
    overrides: dict = {}
    if args.run_config:
        overrides.update(_parse_run_config_arg(args.run_config))
    for key, value in (("dataset", args.dataset), ("fusion-set-size", args.size), ("seed", args.seed),
                       ("fusion-set-source", args.source), ("data-root", args.data_root)):
        if value is not None:
            overrides[key] = value
    return _config().parse_run_config(overrides)


def cmd_fusion_set(argv: list[str]) -> int:
    args = fusion_set_parser().parse_args(argv)
    try:
        cfg = fusion_set_config(args)
    except _config().ConfigError as exc:
        raise CliError(f"config error: {exc}") from None
    if cfg.fusion_set_size <= 0:
        raise CliError("config error: run-config key 'fusion-set-size' must be > 0 to write a fusion set")
    path = Path(args.path).expanduser().resolve()
    files = _fusion_files()
    test_path = Path(args.test_set).expanduser().resolve() if args.test_set else None
    for what, p in (("PATH", path), ("--test-set", test_path)):   # before the dataset is drawn
        if p is not None and p.suffix not in files.FUSION_FILE_SUFFIXES:
            raise CliError(f"fusion-set: {what} {str(p)!r}: unknown file type {p.suffix or '(none)'!r}; "
                           f"write one of {', '.join(files.FUSION_FILE_SUFFIXES)}")
    try:
        written = files.write_fusion_set_file(path, dataset=cfg.dataset, size=cfg.fusion_set_size, seed=cfg.seed,
                                              source=cfg.fusion_set_source, public_fraction=cfg.public_fraction,
                                              num_clients=cfg.num_clients, partitioning=cfg.partitioning,
                                              alpha=cfg.dirichlet_alpha, classes_per_client=cfg.classes_per_client,
                                              data_root=cfg.data_root, test_fraction=cfg.test_fraction,
                                              with_labels=not args.no_labels)
    except OSError as exc:
        raise CliError(f"fusion-set: cannot write {str(path)!r}: {exc.strerror or exc}") from None
    x, y = files.load_fusion_file(written)  # read back: what the server will load
    print(f"fedfuse: wrote {written}: x {list(x.shape)} {str(x.dtype).replace('torch.', '')}, values "
          f"[{float(x.min()):.3g}, {float(x.max()):.3g}]" + (f", y {list(y.shape)}" if y is not None else ", no labels") +
          f" ({cfg.dataset}, fusion-set-source={cfg.fusion_set_source!r}, seed {cfg.seed})")
    print(f"fedfuse: use it with --run-config \"fusion-set-path='{written}' dataset='{cfg.dataset}'\"")
    if test_path is not None:
        try:
            test = files.write_test_set_file(test_path, dataset=cfg.dataset, seed=cfg.seed, data_root=cfg.data_root,
                                             test_fraction=cfg.test_fraction)
        except OSError as exc:
            raise CliError(f"fusion-set: cannot write --test-set {str(test_path)!r}: {exc.strerror or exc}") from None
        tx, ty = files.load_fusion_file(test)
        print(f"fedfuse: wrote {test}: test split x {list(tx.shape)}, y {list(ty.shape) if ty is not None else None}")
    return 0


# ----------------------------------------------------------------------------------------------------- config
def config_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedfuse config", description="The run-config keys (schema "
                                 "fedfuse.config.RunConfig): type, default, allowed values or range, meaning. Set them "
                                 "with --run-config \"key=value ...\" (fedfuse run, flwr run).")
    ap.add_argument("keys", nargs="*", help="only these keys")
    ap.add_argument("--markdown", action="store_true", help="a markdown table (what README's key table mirrors)")
    return ap


def config_text(keys: list[str] | None = None, width: int | None = None) -> str:
    """The schema as plain text, one block per key: ``key  type  default  allowed`` and the help, wrapped."""
    schema = _config().SCHEMA
    every = list(_config().TOP_LEVEL) + [key for entries in OPTION_TABLES.values() for key in entries.values()]
    known = {**{k: [k] for k in schema}, **{p: [k] for p, k in PATH_KEYS.items()},
             **{t: list(entries.values()) for t, entries in OPTION_TABLES.items()}}   # a key, a path or a table
    unknown = [k for k in keys or () if k not in known]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, list(known), n=1)
        raise CliError(f"config: unknown run-config key {k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    keys = [key for k in keys for key in known[k]] if keys else every
    width = width or min(110, shutil.get_terminal_size((100, 20)).columns)
    blocks = []
    for key in keys:
        s = schema[key]
        allowed = " | ".join(map(str, s.choices)) if s.choices else s.range_text()
        if key == "dataset":
            allowed += f" | {_config().HF_PREFIX}<name>"
        if key == "strategy":
            allowed = " | ".join(_config().strategy_names())
        head = f"{s.path}  ({s.type.__name__}, default {s.default!r})"
        body = s.help.rstrip() + ("" if s.help.rstrip().endswith(".") else ".") + (f" Allowed: {allowed}." if allowed else "")
        blocks.append(head + "\n" + textwrap.fill(body, width=width, initial_indent="    ", subsequent_indent="    ",
                                                  break_on_hyphens=False))
    return "\n".join(blocks)


def cmd_config(argv: list[str]) -> int:
    args = config_parser().parse_args(argv)
    if args.markdown:
        text = _config().describe()
        if args.keys:
            config_text(args.keys)  # unknown keys fail the same way
            text = "\n".join(line for i, line in enumerate(text.splitlines())
                             if i < 2 or any(line.startswith(f"| `{_config().SCHEMA[k].path}` |")
                                             for k in _config().SCHEMA if k in args.keys
                                             or _config().SCHEMA[k].path in args.keys))
        print(text)
    else:
        print(config_text(args.keys))
    return 0


# --------------------------------------------------------------------------------------------- stop-superlink
def cmd_stop_superlink(argv: list[str]) -> int:
    """Stop the SuperLink that a plain ``flwr run <app>`` (no SuperLink address: a local simulation) starts in the
    background and leaves running for the next ``flwr run`` (Flower's managed local SuperLink), with everything it
    started; found by PID from its ``--log-file`` under the Flower home. ``fedfuse run`` and the other runners stop
    their own SuperLinks themselves."""
    ap = argparse.ArgumentParser(prog="fedfuse stop-superlink", description=cmd_stop_superlink.__doc__)
    ap.add_argument("--flwr-home", default=None, help="the Flower home of that flwr run (default: $FLWR_HOME, else "
                    "~/.flwr, as flwr reads it)")
    args = ap.parse_args(argv)
    home = Path(args.flwr_home).expanduser() if args.flwr_home else default_flwr_home()
    stopped = stop_local_superlink(home)
    if stopped:
        print(f"fedfuse: stopped the local SuperLink of {home} and what it started (pids "
              f"{', '.join(map(str, stopped))})")
    else:
        print(f"fedfuse: no local SuperLink of {home} is running")
    return 0


# ------------------------------------------------------------------------------------------------------- main
HANDLERS: dict[str, Callable[[list[str]], int]] = {"run": cmd_run, "compare": cmd_compare,
                                                   "fusion-set": cmd_fusion_set, "config": cmd_config,
                                                   "stop-superlink": cmd_stop_superlink}


def main_help() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: fedfuse <command> [options]      (fedfuse <command> --help: the command's options)", "",
             "Federated learning on Flower where the server fuses the clients' models.", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    lines += ["", "examples:", "  fedfuse run                                   # auto vs FedAvg, digits Dirichlet "
              "α=0.1, 4 clients, 10 rounds",
              "  fedfuse run --run-config \"dataset='mnist1d' partitioning='dirichlet' num-server-rounds=10\"",
              "  fedfuse compare --strategies average,fedavg,fedavgm --partitions shards --seeds 0,1,2 "
              "--engine inprocess",
              "  fedfuse config strategy refine"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``fedfuse <command> ...``; the exit status (2 for a usage or config problem)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(main_help())
        return 0 if argv else EXIT_USAGE
    if argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"fedfuse {version('fedfuse')}")
        except PackageNotFoundError:
            print("fedfuse (not installed as a package)")
        return 0
    command, rest = argv[0], argv[1:]
    handler = HANDLERS.get(command)
    try:
        if handler is None:
            close = difflib.get_close_matches(command, list(HANDLERS), n=1)
            raise CliError(f"unknown command {command!r}" + (f" (did you mean {close[0]!r}?)" if close else "") +
                           f"; commands: {', '.join(HANDLERS)} (fedfuse --help)")
        with interrupt_signals():   # Ctrl-C / SIGTERM: the runners stop what they started, then one line here
            return handler(rest)
    except CliError as exc:
        print(f"fedfuse: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunFolderBusy as exc:   # fedfuse compare: a run folder another run holds (fedfuse run says it itself)
        print(f"fedfuse: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:   # fedfuse run says it itself; compare, sweeps and the rest here
        stop = exc if isinstance(exc, RunInterrupted) else RunInterrupted(signal_name_of(exc))
        print(stop.line(stop.label), file=sys.stderr, flush=True)
        return stop.exit_status


if __name__ == "__main__":
    sys.exit(main())
