"""The experiments' own entry point, ``python -m simulations.bench``: the benchmarks it lists and dispatches (the
``fedfuse`` command has none: tests/test_cli.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_experiments_entry_point_lists_and_dispatches(monkeypatch, capsys):
    """``python -m simulations.bench``: every benchmark module listed (read from the sources), one dispatched
    with its arguments (dash or underscore name), a close match suggested for an unknown name."""
    from simulations.bench import __main__ as bench

    table = bench.benchmarks()
    for name in ("one-shot", "ot", "fs-merge", "fusion-time", "tofu", "scaling", "load", "warm-start", "progressive"):
        assert name in table and table[name][0] == "simulations.bench." + name.replace("-", "_"), name
    assert not {"clients", "specs", "stats", "tables", "plots", "report", "cells", "timing"} & set(table)
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m simulations.bench <benchmark>") and all(f"  {n} " in out for n in table)
    assert bench.main([]) == 2

    import simulations.bench.one_shot as one_shot

    seen = {}
    monkeypatch.setattr(one_shot, "main", lambda argv: seen.setdefault("argv", argv) and None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert bench.main(["one-shot", "--datasets", "digits", "--seeds", "0"]) == 0
    assert bench.main(["one_shot", "--seeds", "1"]) == 0 and seen["argv"] == ["--datasets", "digits", "--seeds", "0"]
    with pytest.raises(SystemExit) as exc:
        bench.main(["one-sht"])
    assert exc.value.code == 2 and "did you mean 'one-shot'?" in capsys.readouterr().err


def test_the_experiments_entry_point_runs_as_a_module():
    res = subprocess.run([sys.executable, "-m", "simulations.bench", "--help"], cwd=str(ROOT), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "one-shot" in res.stdout and "fs-merge" in res.stdout, res.stderr
