"""The stacking benches' tables (``simulations.bench.fmnist_stack`` ``peers``, ``oneshot_default_checks`` ``resnet``):
the pairings they print are the per-seed differences of the rows they read, and they say whether the runs share their
clients."""

from __future__ import annotations

import json
from pathlib import Path


def _cell(folder: Path, part: str, seed: int, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"fmnist-{part}-n5-s{seed}.json").write_text(json.dumps({"part": part, "seed": seed, "rows": rows}))


def test_peers_table_pairs_stack_with_each_peer_per_cell_seed(tmp_path):
    from simulations.bench.fmnist_stack import peers_table

    for seed, (stack, fens, fusefl) in enumerate([(0.88, 0.86, 0.87), (0.90, 0.87, 0.89)]):
        _cell(tmp_path, "dir0.3", seed, [{"method": "ensemble", "accuracy": 0.80 + seed / 100},
                                         {"method": "stack", "accuracy": 0.8, "with-head": stack}])
        _cell(tmp_path / "fens", "dir0.3", seed, [{"method": "ensemble", "accuracy": 0.80 + seed / 100},
                                                  {"method": "fens", "accuracy": fens}])
        _cell(tmp_path / "fusefl", "dir0.3", seed, [{"method": "ensemble", "accuracy": 0.5},   # other clients
                                                    {"method": "fusefl-k2", "accuracy": 0.7, "with-head": fusefl}])
    text = peers_table(tmp_path)
    fens_line = next(line for line in text.splitlines() if line.startswith("| − FENS"))
    fusefl_line = next(line for line in text.splitlines() if line.startswith("| − FuseFL"))
    assert "same clients' ensemble: True" in fens_line and "[+2.0, +3.0]" in fens_line
    assert "same clients' ensemble: False" in fusefl_line and "[+1.0, +1.0]" in fusefl_line


def test_resnet_check_pairs_stack_with_the_rerun_not_the_earlier_runs(tmp_path):
    from simulations.bench.oneshot_default_checks import resnet

    def sweep(folder: str, strategy: str, final: list[float], ensemble: list[float]) -> None:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "sweep.json").write_text(json.dumps([
            {"status": "finished:completed", "strategy": strategy, "seed": s, "final-accuracy": f,
             "final-accuracy-before-head-round": f - 0.1, "ensemble-accuracy": e, "best-client-accuracy": e - 0.1}
            for s, (f, e) in enumerate(zip(final, ensemble))]))

    sweep("a0.1", "auto", [0.90, 0.91], [0.70, 0.71])          # the earlier check, another environment's clients
    sweep("a0.1-kf", "kf-linear", [0.0, 0.0], [0.0, 0.0])      # not a folder the table reads
    sweep("stack-a0.1", "stack", [0.97, 0.98], [0.72, 0.73])
    sweep("rerun-a0.1", "kf-linear", [0.96, 0.96], [0.72, 0.73])
    text = "\n".join(resnet(tmp_path))
    line = next(x for x in text.splitlines() if x.startswith("| `stack` + head round − `kf-linear`"))
    assert "[+1.0, +2.0]" in line
    assert text.splitlines()[-1] == "Same clients in these runs (identical ensembles): True"
    assert json.loads((tmp_path / "runs.json").read_text())[-1]["strategy"] == "kf-linear (rerun)"
