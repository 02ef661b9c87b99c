"""The ``fedfuse`` command: parsing and dispatch of every subcommand (no Flower run), config listing, the
fusion-set round trip (file written by the command passes the run's fusion-set checks)."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedfuse import cli

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_installs_the_fedfuse_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"fedfuse": "fedfuse.cli:main"}
    assert any(d.startswith("tqdm") for d in project["dependencies"])


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("run", "compare", "bench", "fusion-set", "config"):
        assert f"  {command} " in out
    assert cli.main([]) == 2  # no command: the help, usage status


def test_unknown_command_is_one_line_with_a_suggestion(capsys):
    assert cli.main(["rnu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedfuse: unknown command 'rnu' (did you mean 'run'?); commands: run, compare, bench, fusion-set, "
                   "config (fedfuse --help)"]


@pytest.mark.parametrize("command,module,prog", [("run", "fedfuse.flower.runner.run", "fedfuse run"),
                                                 ("compare", "fedfuse.flower.runner.sweep", "fedfuse compare")])
def test_run_and_compare_pass_their_arguments_through(monkeypatch, command, module, prog):
    import importlib

    seen = {}
    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, "main", lambda argv, prog=None: seen.update(argv=argv, prog=prog) or 3)
    argv = ["--run-config", "strategy='fedavg' num-server-rounds=2", "--engine", "inprocess"]
    assert cli.main([command, *argv]) == 3
    assert seen == {"argv": argv, "prog": prog}


@pytest.mark.parametrize("command", ["run", "compare"])
def test_subcommand_help_is_the_runners_help(capsys, command):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: fedfuse {command} ") and "--run-config" in out
    if command == "run":
        assert "--no-compare" in out and "--verbose" in out and "--baseline" in out


def test_bench_dispatches_to_the_benchmark_module(monkeypatch, capsys):
    import simulations.bench.one_shot as one_shot

    seen = {}
    monkeypatch.setattr(one_shot, "main", lambda argv: seen.setdefault("argv", argv) and None)
    assert cli.main(["bench", "one-shot", "--datasets", "digits", "--seeds", "0"]) == 0
    assert seen["argv"] == ["--datasets", "digits", "--seeds", "0"]
    assert cli.main(["bench", "one-shot", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: fedfuse bench one-shot")
    assert cli.main(["bench", "--help"]) == 0 and "one-shot" in capsys.readouterr().out
    assert cli.main(["bench", "one_shot"]) == 2
    assert "did you mean 'one-shot'?" in capsys.readouterr().err


def test_run_and_compare_need_no_repository_but_bench_does(monkeypatch, capsys):
    """Without the repository's experiments (an installed wheel), ``run`` and ``compare`` still work (package
    runners); ``bench`` says the benchmarks are repository scripts and how to run them in a checkout."""
    import importlib

    real = importlib.import_module

    def no_simulations(name, *a, **k):
        if name.startswith("simulations"):
            raise ModuleNotFoundError(f"No module named {name!r}", name="simulations")
        return real(name, *a, **k)

    monkeypatch.setattr(cli.importlib, "import_module", no_simulations)
    for argv in (["bench", "one-shot"], ["bench", "ot", "--seeds", "0"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fedfuse: `fedfuse {' '.join(argv[:2])}` runs a benchmark") and err.count("\n") == 1
        assert "repository" in err and f"python -m {cli.BENCHMARKS[argv[1]][0]}" in err
    assert cli.main(["bench", "--help"]) == 0  # the list is there, saying where the benchmarks live
    assert "not part of the installed" in capsys.readouterr().out
    for command in ("run", "compare"):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--help"])
        assert exc.value.code == 0 and capsys.readouterr().out.startswith(f"usage: fedfuse {command} ")


def test_the_product_never_imports_the_experiments():
    """``fedfuse/`` is the installable product: no module of it imports ``simulations`` (at any level); the
    only mention is ``fedfuse bench``'s table of repository benchmark modules, imported by name on demand."""
    import ast

    for path in (ROOT / "fedfuse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "simulations" or n.startswith("simulations.") for n in names), path
    assert all(mod.startswith("simulations.bench.") for mod, _ in cli.BENCHMARKS.values())


def test_config_lists_every_key_with_type_and_default(capsys):
    from fedfuse.config import SCHEMA

    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    for key, spec in SCHEMA.items():
        assert f"{key}  ({spec.type.__name__}, default {spec.default!r})" in out
    assert cli.main(["config", "strategy", "--markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| key |") and len(lines) == 3 and lines[2].startswith("| `strategy` |")
    assert cli.main(["config", "num-round"]) == 2
    assert "did you mean 'num-server-rounds'?" in capsys.readouterr().err


def test_fusion_set_round_trip_passes_the_runs_checks(tmp_path, capsys):
    from fedfuse.config import preflight, read_fusion_set

    path = tmp_path / "fusion.npz"
    assert cli.main(["fusion-set", str(path), "--dataset", "digits", "--size", "60", "--seed", "1",
                     "--test-set", str(tmp_path / "test.npz")]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}: x [60, 1, 8, 8] float32" in out and "fusion-set-path=" in out
    x, y = read_fusion_set(str(path), dataset="digits")
    assert tuple(x.shape) == (60, 1, 8, 8) and y is not None and len(y) == 60
    preflight({"dataset": "digits", "fusion-set-path": str(path)})  # the run's own check of the file
    assert (tmp_path / "test.npz").exists()
    # the run-config form, and a bad value named by its key
    assert cli.main(["fusion-set", str(tmp_path / "m.pt"), "--run-config", "dataset='mnist1d' fusion-set-size=30",
                     "--no-labels"]) == 0
    assert "x [30, 1, 40]" in capsys.readouterr().out
    assert cli.main(["fusion-set", str(path), "--source", "server"]) == 2
    assert "fusion-set-source" in capsys.readouterr().err


def test_installed_entry_point_runs(tmp_path):
    exe = Path(sys.executable).parent / "fedfuse"
    # scripts/setup.sh (pip install -e .) installs the command; the test suite always runs after it
    assert exe.exists(), f"{exe} missing: run bash scripts/setup.sh (it installs the fedfuse command)"
    res = subprocess.run([str(exe), "config", "seed"], cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("seed  (int, default 0)"), res.stderr
