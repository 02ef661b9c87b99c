"""Issue 60 items 7-10: what a user does by accident is a correct result or one line before anything trains.

- 7: ``--num-supernodes`` and ``num-clients`` are one number (a Flower SuperNode holds partition ``i`` of
  ``num-partitions`` = the node count): given alone it sets ``num-clients`` (the header and the run agree), with a
  different ``num-clients`` it is a config error naming both, below 1 a config error;
- 8: the preflight catches ``device='cuda'`` without CUDA, an ``output-dir`` that cannot be created, a ``run-name``
  that would write outside ``output-dir``; a failed run's last line lists only the files it wrote;
- 9: one line, not a traceback: ``fedfuse compare --seeds a``, ``fedfuse fusion-set x.txt``, ``fuse()`` with a model
  on the ``meta`` device, ``fuse('auto', validation=(x of 50, y of 40))`` (names the length mismatch);
- 10: the help and the docs name ``auto`` as the default strategy.

Everything here runs in-process; ``run_with_engine`` / ``start_local_superlink`` are replaced by a tripwire where the
point is that nothing starts.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from fedfuse import cli
from fedfuse.config import ConfigError, parse_run_config, preflight
from fedfuse.flower.runner import run as run_cli
from fedfuse.flower.runner import sweep

ROOT = Path(__file__).resolve().parents[1]
FAST = "num-server-rounds=1 local-epochs=1 head-round=false"


def _nothing_starts(monkeypatch):
    """A tripwire in place of the engines: the test fails if a run starts."""
    import fedfuse.flower.runner.flwr_runner as flwr_runner

    def started(*args, **kwargs):
        raise AssertionError("a run started; the config should have been refused first")

    monkeypatch.setattr(run_cli, "run_with_engine", started)
    monkeypatch.setattr(flwr_runner, "start_local_superlink", started)


def _config_error(capsys, argv) -> str:
    """``fedfuse run argv``: exit status 2 with one stderr line, returned."""
    with pytest.raises(SystemExit) as exc:
        run_cli.main(argv, prog="fedfuse run")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedfuse: config error: "), err
    return err[0]


# ------------------------------------------------------------------------------------------- 7: --num-supernodes
def test_num_supernodes_other_than_num_clients_is_a_config_error_naming_both(tmp_path, monkeypatch, capsys):
    _nothing_starts(monkeypatch)
    line = _config_error(capsys, ["--engine", "inprocess", "--no-compare", "--num-supernodes", "2", "--output-dir",
                                  str(tmp_path), "--run-config", f"num-clients=4 {FAST}"])
    assert "--num-supernodes 2" in line and "num-clients=4" in line
    for bad in ("-1", "0"):
        line = _config_error(capsys, ["--engine", "inprocess", "--num-supernodes", bad, "--output-dir", str(tmp_path)])
        assert f"--num-supernodes {bad}" in line
    assert not any(tmp_path.iterdir())   # nothing written


def test_the_engines_refuse_a_node_count_other_than_num_clients(tmp_path, monkeypatch):
    from fedfuse.flower.runner.flwr_runner import run_app
    from fedfuse.flower.runner.inprocess import run_app_inprocess

    _nothing_starts(monkeypatch)
    cfg = {"num-clients": 4, "output-dir": str(tmp_path), "run-name": "x"}
    with pytest.raises(ConfigError, match=r"--num-supernodes 2 but run-config num-clients=4"):
        run_app_inprocess(dict(cfg), num_supernodes=2, echo=False)
    with pytest.raises(ConfigError, match=r"--num-supernodes 2 but run-config num-clients=4"):
        run_app(dict(cfg), num_supernodes=2, echo=False)   # before any SuperLink starts
    with pytest.raises(ConfigError, match=r"--num-supernodes -1"):
        run_app_inprocess(dict(cfg), num_supernodes=-1, echo=False)


def test_num_supernodes_alone_is_the_federations_size(tmp_path, capsys):
    """A Flower user's ``--num-supernodes 2``: a federation of 2 clients, each one half of the data; the header says 2
    clients as the run does (it said 4, the default num-clients, then 2)."""
    code = run_cli.main(["--engine", "inprocess", "--no-compare", "--num-supernodes", "2", "--output-dir",
                         str(tmp_path), "--run-config", f"{FAST} run-name='n2'"], prog="fedfuse run")
    out = capsys.readouterr().out
    assert code == 0, out
    counts = re.findall(r"(\d+) clients", out)
    assert counts and set(counts) == {"2"}, out
    results = json.loads((tmp_path / "n2" / "results.json").read_text())
    assert results["config"]["num-clients"] == 2


# ------------------------------------------------------------------------------------------------ 8: preflight
def test_cuda_without_cuda_is_a_config_error_naming_device(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=r"run-config key 'device': '" + device + "', but CUDA is not available"):
            preflight({"device": device})
    preflight({"device": "auto"})   # CUDA when present: never an error
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"'cuda:2', but this machine has 1 CUDA device"):
        preflight({"device": "cuda:2"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _nothing_starts(monkeypatch)   # `fedfuse run` stops before any engine (flwr run: after ~60 s of SuperLink/Ray)
    line = _config_error(capsys, ["--no-compare", "--output-dir", str(tmp_path), "--run-config", "device='cuda'"])
    assert "'device'" in line


def test_an_output_dir_that_cannot_be_created_is_a_config_error(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match=r"run-config key 'output-dir': .* is not a folder"):
        preflight({"output-dir": str(a_file)})
    with pytest.raises(ConfigError, match=r"run-config key 'output-dir': .* cannot be created: .* is a file"):
        preflight({"output-dir": str(a_file / "x")})
    preflight({"output-dir": str(tmp_path / "new" / "deeper")})   # creatable: fine, and nothing is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    if Path("/proc/self").is_dir():   # Linux: nothing can be made under /proc, even as root
        with pytest.raises(ConfigError, match=r"run-config key 'output-dir': '/proc/x' cannot be created"):
            preflight({"output-dir": "/proc/x"})
        _nothing_starts(monkeypatch)
        line = _config_error(capsys, ["--engine", "inprocess", "--run-config", "output-dir='/proc/x'"])
        assert "'output-dir'" in line   # not a FileNotFoundError traceback


def test_a_run_name_must_be_one_folder_inside_output_dir(tmp_path, monkeypatch, capsys):
    for name in ("../escape", "a/b", "..", ".", "/tmp/abs", "a\\b"):
        with pytest.raises(ConfigError, match=r"run-config key 'run-name'"):
            parse_run_config({"run-name": name})
    parse_run_config({"run-name": "a..b"})   # a folder name with dots is one folder
    _nothing_starts(monkeypatch)
    out = tmp_path / "out"
    line = _config_error(capsys, ["--engine", "inprocess", "--output-dir", str(out), "--run-config",
                                  "run-name='../escape'"])
    assert "'run-name'" in line
    assert not (tmp_path / "escape").exists() and not out.exists()


def test_a_failed_runs_last_line_lists_only_the_files_it_wrote(tmp_path, monkeypatch, capsys):
    from fedfuse.flower.runner.flwr_runner import RunOutcome

    def failing(engine, cfg, **kwargs):   # a ServerApp that failed before it wrote results.json
        return RunOutcome(run_id=1, status="finished:failed", details="ServerApp failed with exception: boom",
                          out_dir=Path(cfg["output-dir"]) / cfg["run-name"], log="", seconds=0.1)

    monkeypatch.setattr(run_cli, "run_with_engine", failing)
    code = run_cli.main(["--engine", "inprocess", "--no-compare", "--output-dir", str(tmp_path), "--run-config",
                         f"{FAST} run-name='failed'"], prog="fedfuse run")
    assert code == 1
    last = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fedfuse: results in")][-1]
    assert "results.json" not in last and "rounds.csv" not in last, last
    listed = last.split(": ", 2)[2].replace(" (accuracy per round)", "").split(", ")
    assert listed and all((tmp_path / "failed" / name).is_file() for name in listed), last


# ---------------------------------------------------------------------------------------- 9: one line, not a traceback
def test_compare_with_seeds_that_are_not_integers_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--seeds", "a", "--engine", "inprocess", "--out", str(tmp_path / "sweep")], prog="fedfuse compare")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedfuse: config error: --seeds 'a': give comma-separated integers, e.g. --seeds 0,1,2"]


def test_fusion_set_with_an_unsupported_suffix_is_one_line_before_drawing(tmp_path, monkeypatch, capsys):
    files = cli._fusion_files()   # the module (the package's name `fusion_set` is a function)

    def drawn(*args, **kwargs):
        raise AssertionError("the dataset was drawn before the file type was checked")

    monkeypatch.setattr(files, "write_fusion_set_file", drawn)
    assert cli.main(["fusion-set", str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'.txt'" in err[0] and ".npz" in err[0], err
    assert cli.main(["fusion-set", str(tmp_path / "x.npz"), "--test-set", str(tmp_path / "t.csv")]) == 2
    assert "--test-set" in capsys.readouterr().err


def _mlp(seed: int):
    from fedfuse.models import build_model

    return build_model("mlp", input_shape=(40,), num_classes=10, seed=seed)


def test_fuse_with_a_model_on_the_meta_device_says_why():
    from fedfuse.fusion import fuse

    x = torch.randn(32, 40)
    for models in ([_mlp(0), _mlp(1).to("meta")], [_mlp(0).to("meta"), _mlp(1).to("meta")]):
        with pytest.raises(ValueError, match=r"'meta' device"):
            fuse("average", models, fusion_inputs=x)
    with pytest.raises(ValueError, match=r"reference's .* 'meta' device"):
        fuse("ot", [_mlp(0), _mlp(1)], fusion_inputs=x, reference=_mlp(2).to("meta"))


def test_auto_validation_of_mismatched_lengths_names_the_mismatch():
    from fedfuse.fusion import fuse

    x, vx, vy = torch.randn(32, 40), torch.randn(50, 40), torch.randint(0, 10, (40,))
    for validation in ((vx, vy), [(vx, vy)]):
        with pytest.raises(ValueError, match=r"set 0 has 50 inputs \(x\) but 40 labels \(y\)"):
            fuse("auto", [_mlp(0), _mlp(1)], fusion_inputs=x, validation=validation)
    # one (x, y) pair is one validation set
    fused = fuse("auto", [_mlp(0), _mlp(1)], fusion_inputs=x, validation=(vx, torch.randint(0, 10, (50,))),
                 candidates=("average",))
    assert isinstance(fused, torch.nn.Module)


# ---------------------------------------------------------------------------------------------- 10: stale text
def test_help_and_docs_name_auto_as_the_default_strategy(capsys):
    from fedfuse.config import SCHEMA

    assert SCHEMA["strategy"].default == "auto"
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "# auto vs FedAvg" in out and "average vs FedAvg" not in out
    stale = re.compile(r"default aggregation `average`|`average` \(default|`average` 0\.801 vs FedAvg|"
                       r"average vs FedAvg")
    for page in ("README.md", "docs/index.md", "docs/configuration.md"):
        text = (ROOT / page).read_text()
        assert not stale.search(text), (page, stale.search(text).group(0))
    assert "default aggregation `auto`" in (ROOT / "docs/index.md").read_text()
