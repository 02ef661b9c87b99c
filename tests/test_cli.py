"""The ``fedfuse`` command: parsing and dispatch of every subcommand (no Flower run), config listing, the
fusion-set round trip (file written by the command passes the run's fusion-set checks), and the config error
of ``fedfuse run`` reported before the runner (Flower) is imported."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedfuse import cli
from tests.support.layout import EXPERIMENTS

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_installs_the_fedfuse_command():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"fedfuse": "fedfuse.cli:main"}
    assert any(d.startswith("tqdm") for d in project["dependencies"])


def test_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("run", "compare", "fusion-set", "config"):
        assert f"  {command} " in out
    assert EXPERIMENTS and "bench" not in out and not any(e in out for e in EXPERIMENTS)  # they have their own
    assert cli.main([]) == 2  # no command: the help, usage status


def test_unknown_command_is_one_line_with_a_suggestion(capsys):
    assert cli.main(["rnu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedfuse: unknown command 'rnu' (did you mean 'run'?); commands: run, compare, fusion-set, config, "
                   "stop-superlink (fedfuse --help)"]


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


def test_the_product_never_names_the_experiments(capsys):
    """``fedfuse/`` is the installable product: no module of it imports the experiments (at any level), and its
    command line does not even name them; ``fedfuse bench`` is an unknown command."""
    import ast

    assert EXPERIMENTS
    for path in (ROOT / "fedfuse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "import_module", "__import__", "run_module"):
                names += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            assert not any(n == e or n.startswith(e + ".") for n in names for e in EXPERIMENTS), path
    source = (ROOT / "fedfuse" / "cli.py").read_text()
    assert not any(e in source for e in EXPERIMENTS) and "BENCHMARKS" not in source and not hasattr(cli, "cmd_bench")
    assert cli.main(["bench", "one-shot"]) == 2
    assert "unknown command 'bench'" in capsys.readouterr().err


def test_config_lists_every_key_with_type_and_default(capsys):
    from fedfuse.config import SCHEMA

    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    for key, spec in SCHEMA.items():
        assert f"{spec.path}  ({spec.type.__name__}, default {spec.default!r})" in out
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


_BAD_RUN_CONFIGS = {"num-round=5": {"num-round": 5}, "num-server-rounds=0": {"num-server-rounds": 0},
                    "lr='fast'": {"lr": "fast"}, "dataset='mnist2'": {"dataset": "mnist2"}}
_FIRST_CONTACT = """
import contextlib, io, json, sys
from fedfuse.cli import main
out = {}
for text in sys.argv[1:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out[text] = [main(["run", "--run-config", text]), err.getvalue()]
out["loaded"] = sorted(m for m in ("flwr", "ray", "fedfuse.flower", "fedfuse.fusion", "scipy", "torch") if m in sys.modules)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def first_contact():
    """``fedfuse run`` with bad run configs in a fresh interpreter: each one's status and stderr, and what was loaded."""
    res = subprocess.run([sys.executable, "-c", _FIRST_CONTACT, *_BAD_RUN_CONFIGS], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_run_reports_a_config_error_before_it_imports_flower(first_contact):
    """Issue 58 (fast first contact): a bad key or value exits 2 with the runner's own one line, before the runner is
    imported, so before Flower, Ray, the strategies and the fusion methods are."""
    from fedfuse.config import ConfigError, parse_run_config

    for text, mapping in _BAD_RUN_CONFIGS.items():
        with pytest.raises(ConfigError) as exc:
            parse_run_config(mapping)
        assert first_contact[text] == [2, f"fedfuse: config error: {exc.value}\n"], text
    assert not set(first_contact["loaded"]) & {"flwr", "ray", "fedfuse.flower", "fedfuse.fusion", "scipy"}


@pytest.mark.xfail(strict=True, reason="fedfuse.config imports fedfuse.data, fedfuse.models and fedfuse.hetero (torch) "
                                       "at module level; the schema needs a torch-free home first (issue 58 item 8)")
def test_run_reports_a_config_error_before_it_imports_torch(first_contact):
    assert "torch" not in first_contact["loaded"]
