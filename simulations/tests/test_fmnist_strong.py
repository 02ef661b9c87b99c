"""``simulations.bench.fmnist_strong``: early stopping keeps the best validation epoch's weights, and the strong O1
table carries the pooled ceiling row."""

from __future__ import annotations

import json

import torch

from simulations.bench.fmnist_strong import fit, predict_logits, recipe_tag, table


def test_early_stopping_keeps_the_weights_of_the_best_validation_epoch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 8, generator=g)
    y = (x[:, 0] > 0).long()
    vx, vy = x[:50], y[:50]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    info = fit(model, x[50:], y[50:], vx, vy, lr=0.5, weight_decay=0.0, epochs=6, seed=0)
    best = max(info["val-curve"])
    assert info["best-epoch"] == info["val-curve"].index(best) + 1
    assert float((predict_logits(model, vx).argmax(1) == vy).float().mean()) == best
    assert recipe_tag({"normalise": True, "lr": 0.02, "weight-decay": 5e-4, "epochs": 20}) == "norm-lr0.02-wd0.0005-e20-es"


def test_the_table_has_the_pooled_ceiling_row(tmp_path):
    rows = [{"part": p, "seed": s, "method": m, "accuracy": a} for p in ("dir0.1", "dir0.5") for s in (0, 1)
            for m, a in (("best client", 0.7), ("mean client", 0.6), ("ensemble", 0.8))]
    rows += [{"part": "dir0.5", "seed": s, "method": "kf-linear", "accuracy": 0.7, "with-head": 0.85,
              "fuse-per-epoch": 1.0} for s in (0, 1)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for p in ("dir0.1", "dir0.5"):
        for s, a in ((0, 0.89), (1, 0.90)):
            (tmp_path / f"pooled-fmnist-{p}-n5-s{s}.json").write_text(json.dumps({"part": p, "seed": s,
                                                                                  "accuracy": a}))
    text = table(tmp_path)
    assert "| pooled model (unfederated ceiling, same recipe) | - | 89.5 ± 0.7 (n=2) | 89.5 ± 0.7 (n=2) | |" in text
    assert "one local epoch" not in text
    assert text.splitlines()[2].startswith("| pooled model")


def test_the_per_seed_json_gives_the_table_back_without_rows_jsonl(tmp_path):
    """``rows.jsonl`` stays local (untracked): the tracked per-seed JSON, written compact (the values a cell's rows
    share once, the other floats but the accuracies rounded, no seconds), read back give the same table."""
    from simulations.bench.fmnist_strong import all_rows, per_seed

    rows = [{"part": p, "seed": s, "epochs": 20, "best-epochs": [3, 4], "method": m, "accuracy": a}
            for p in ("dir0.1", "dir0.5") for s in (0, 1, 2)
            for m, a in (("best client", 0.7), ("mean client", 0.6), ("ensemble", 0.8))]
    # accuracies whose mean sits on a rounding tie (33.65): kept as computed, the table prints the same
    rows += [{"part": p, "seed": s, "epochs": 20, "best-epochs": [3, 4], "method": "fisher-align", "accuracy": a,
              "with-head": 0.8 + s / 100, "head": {"seconds": 1.23456789, "solver": "lda", "client-val": {"lda": 0.8}},
              "fuse-per-epoch": 0.1}
             for p in ("dir0.1", "dir0.5") for s, a in ((0, 0.26519998908042908), (1, 0.34159999489784241),
                                                        (2, 0.40270000696182251))]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = table(tmp_path)
    per_seed(tmp_path, ["python -m x"])
    cell = json.loads((tmp_path / "fmnist-dir0.5-n5-s1.json").read_text())
    assert cell["shared"] == {"part": "dir0.5", "seed": 1, "epochs": 20, "best-epochs": [3, 4]}
    assert cell["commands"] == ["python -m x"]
    # the seconds (measured beside other jobs) and the head round's candidate scores stay in rows.jsonl
    assert {"method": "fisher-align", "accuracy": 0.34159999489784241, "with-head": 0.81,
            "head": {"solver": "lda"}} in cell["rows"]
    (tmp_path / "rows.jsonl").unlink()
    assert len(all_rows(tmp_path)) == len(rows)
    assert table(tmp_path) == before
