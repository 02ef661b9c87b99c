"""``simulations.bench.fmnist_tables``: rerunning one table keeps the others (their raw runs are git-ignored and
may be absent), and the pooled-data ceiling joins the M1 table."""

from __future__ import annotations

import json

from simulations.bench.fmnist_tables import main, read_sections


def _m1_run(folder, part, seed, strategy, curve):
    folder.mkdir(parents=True, exist_ok=True)
    row = {"part": part, "seed": seed, "strategy": strategy, "rounds": len(curve) - 2, "epochs": 10,
           "best": max(curve[1:-1]), "final": curve[-2], "with-head": curve[-1], "curve": curve}
    with open(folder / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def test_an_m1_rerun_keeps_the_o1_and_m2_tables_of_an_older_tables_md(tmp_path):
    out = tmp_path / "tables"
    out.mkdir()
    (out / "tables.md").write_text("## O1: one-shot, 5 clients\n\n| o1 row |\n\n## M1: NIID-Bench, 10 clients\n\n| old m1 |"
                                   "\n\n## M2: cross-device\n\n| m2 row |\n")
    assert set(read_sections(out)) == {"o1", "m1", "m2"}
    m1 = tmp_path / "m1"
    for seed, last in ((0, 0.80), (1, 0.84)):
        _m1_run(m1, "dir0.5", seed, "fedavg", [0.1, 0.6, last, last + 0.02])
    central = tmp_path / "central"
    central.mkdir()
    for seed, best in ((0, 0.90), (1, 0.88)):
        (central / f"seed{seed}-e30.json").write_text(json.dumps({"seed": seed, "epochs": 30, "best": best,
                                                                  "final": best - 0.01}))
    main(["--m1", str(m1), "--central", str(central), "--out", str(out)])
    text = (out / "tables.md").read_text()
    assert "| o1 row |" in text and "| m2 row |" in text and "| old m1 |" not in text
    assert text.index("## O1") < text.index("## M1") < text.index("## M2")
    assert "| dir0.5 | fedfuse fedavg | 2 rounds × 10 epochs | 82.0 ± 2.8 (n=2) |" in text
    assert "| all (pooled) | centralised LeNet-5" in text and "| 30 epochs | 89.0 ± 1.4 (n=2) | 88.0 ± 1.4 (n=2) |" in text
    assert (out / "o1.md").exists() and (out / "m2.md").exists()   # the next rerun reads the section files
    main(["--m1", str(m1), "--out", str(out)])
    assert "| o1 row |" in (out / "tables.md").read_text()
