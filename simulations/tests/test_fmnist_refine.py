"""``simulations.bench.fmnist_refine``: the distillation of the clients' ensemble into every parameter of a model keeps
the best held-out state, and the tables pair each row with the ensemble and ``kf-linear`` + head round per seed."""

from __future__ import annotations

import json

import torch

from simulations.bench.fmnist_refine import CONFIGS, distill_whole, per_seed, rows_of, table, tuning_table


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3)).eval()


def test_distilling_the_ensemble_moves_the_student_towards_it_and_never_away():
    teachers, student = [_net(1), _net(2)], _net(3)
    fx = torch.randn(200, 6, generator=torch.Generator().manual_seed(0))
    for name in ("default", "lr0.001-long-mixup-t4"):
        s = _net(3)
        info = distill_whole(s, teachers, [0.5, 0.5], fx, CONFIGS[name], seed=0)
        assert info["kl-best"] <= info["kl-start"]
        assert any(not torch.equal(a, b) for a, b in zip(s.parameters(), student.parameters())) == (info["best-epoch"] > 0)


def test_the_tables_pair_every_row_per_seed(tmp_path):
    rows = []
    for s in (0, 1, 2):
        rows += [{"part": "dir0.3", "seed": s, "method": "ensemble", "accuracy": 0.80 + s / 100},
                 {"part": "dir0.3", "seed": s, "method": "kf-linear", "accuracy": 0.7, "with-head": 0.82},
                 {"part": "dir0.3", "seed": s, "method": "kf-linear+distill:default", "config": CONFIGS["default"],
                  "distill": {"epochs-run": 9, "best-epoch": 4, "kl-start": 1.0, "kl-best": 0.1234567},
                  "accuracy": 0.75, "with-head": 0.83, "command": "python -m x"}]
    text = table(rows)
    assert "| kf-linear+distill:default (+ head round) | kf-linear + head round | +1.0 ± 0.0 (n=3) [+1.0, +1.0, +1.0] |" in text
    assert "| kf-linear+distill:default (+ head round) | ensemble | +2.0 ± 1.0 (n=3) [+3.0, +2.0, +1.0] |" in text
    one = tuning_table([r for r in rows if r["seed"] == 0])
    assert "| default | 0.001 | 50 (5) | none | 1 | 9 / 4 | 75.00 | 83.00 | +1.00 | +3.00 |" in one
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + rows[-1:]))
    assert len(rows_of(tmp_path)) == len(rows)   # a (cell, method) written twice counts once
    per_seed(tmp_path, rows)
    cell = json.loads((tmp_path / "fmnist-dir0.3-n5-s1.json").read_text())
    assert cell["seed"] == 1 and cell["rows"][-1] == {"method": "kf-linear+distill:default", "accuracy": 0.75,
                                                      "with-head": 0.83, "epochs": [9, 4]}


def test_accuracies_are_read_back_as_the_exact_fraction_of_10000_images(tmp_path):
    row = {"part": "dir0.1", "seed": 0, "method": "kf-linear", "accuracy": 0.26519998908042908,
           "with-head": 0.8429999947547913}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    assert rows_of(tmp_path)[0] == {**row, "accuracy": 0.2652, "with-head": 0.843}
