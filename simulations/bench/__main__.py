"""The experiments' own entry point: ``python -m simulations.bench <benchmark> [options]``.

    python -m simulations.bench --help                      every benchmark, one line each
    python -m simulations.bench one-shot --datasets digits  = python -m simulations.bench.one_shot --datasets digits
    python -m simulations.bench one-shot --help             the benchmark's own options

The benchmarks are experiments of the repository, not part of the installed package: the product's command
(``fedfuse``) neither names nor imports them. A benchmark is a module of this package with a top-level ``main`` and
a ``__main__`` block; the list is read from the sources (no benchmark is imported to list them). Names are the
module names, with ``-`` or ``_`` (``fs-merge`` = ``fs_merge``).
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

EXIT_USAGE = 2
PACKAGE = __package__ or "simulations.bench"
HERE = Path(__file__).resolve().parent
PROG = "python -m simulations.bench"


def _is_benchmark(tree: ast.Module) -> bool:
    has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    has_block = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    return has_main and has_block


def _summary(tree: ast.Module) -> str:
    """The docstring's first sentence (at most 160 characters)."""
    doc = " ".join((ast.get_docstring(tree) or "").split("\n\n")[0].split()).replace("``", "`")
    first = re.split(r"(?<=[a-z0-9)`][.?!])\s+(?=[A-Z])", doc)[0]
    first = first if first.endswith((".", "?", "!")) else first + "."
    return first if len(first) <= 160 else textwrap.shorten(first, width=160, placeholder=" …")


def benchmarks() -> dict[str, tuple[str, str]]:
    """``{name: (module, one-line summary)}`` for every benchmark module here, by name (``one-shot``: dashes)."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if _is_benchmark(tree):
            found[path.stem.replace("_", "-")] = (f"{PACKAGE}.{path.stem}", _summary(tree))
    return found


def help_text(width: int = 110) -> str:
    table = benchmarks()
    pad = max(len(n) for n in table)
    lines = [f"usage: {PROG} <benchmark> [options]   ({PROG} <benchmark> --help: its options)", "",
             "The repository's experiments (seeded; tables and plots under each benchmark's --out). They are not part",
             "of the installed fedfuse package: run them from a checkout (bash scripts/setup.sh first).", "",
             "benchmarks:"]
    for name, (_, what) in table.items():
        lines += textwrap.wrap(what, width=width, initial_indent=f"  {name:<{pad}}  ",
                               subsequent_indent=" " * (pad + 4)) or [f"  {name}"]
    return "\n".join(lines)


def resolve(name: str) -> str:
    """The module of benchmark ``name`` (``one-shot`` or ``one_shot``); ``SystemExit(2)`` naming the close match."""
    table = benchmarks()
    key = name.replace("_", "-")
    if key not in table:
        close = difflib.get_close_matches(key, list(table), n=1)
        print(f"{PROG}: unknown benchmark {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "") +
              f"; {PROG} --help lists them", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    return table[key][0]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return 0 if argv else EXIT_USAGE
    module_name, rest = resolve(argv[0]), argv[1:]
    module = importlib.import_module(module_name)
    # the benchmark parses sys.argv[1:] when main takes no argv: make both forms see the same arguments
    sys.argv = [f"python -m {module_name}", *rest]
    result = module.main(rest) if inspect.signature(module.main).parameters else module.main()
    return int(result) if isinstance(result, int) and not isinstance(result, bool) else 0


if __name__ == "__main__":
    sys.exit(main())
