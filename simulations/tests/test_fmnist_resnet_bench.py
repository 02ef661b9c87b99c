"""``simulations.bench.fmnist_resnet`` (issue 59 item 4): the ResNet-18 the clients train is torchvision's with the
28 × 28 stem and fedfuse reads it through its torchvision adapter; a smoke run writes whole cells (every method with
and without the head round, the references); a log's finished cells read back as rows; the table pairs per seed."""

import json

import pytest
import torch

from simulations.bench import fmnist_resnet as fr

LOG = """[   125 s]   average: 0.1000 / + head 0.2645 (7.2 s)
[   237 s]   kf-linear: 0.7099 / + head 0.8866 (37.0 s)
[   386 s] cell α 0.3 seed 0: 385 s, clients [0.6082, 0.5786, 0.5566], ensemble 0.8563
[   400 s]   average: 0.1000 / + head 0.3000 (7.0 s)
"""


def test_the_model_is_torchvisions_resnet18_for_grey_28px_images():
    from fedfuse.models import model_family

    m = fr.net(0).eval()
    assert model_family(m) == "torchvision-resnet" and m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_a_log_gives_the_rows_of_its_finished_cells_only():
    rows = fr.from_log(LOG, 0.05)
    got = {r["method"]: r for r in rows}
    assert {r["alpha"] for r in rows} == {0.3} and len(rows) == 5          # the unfinished cell's row is dropped
    assert got["best client"]["accuracy"] == 0.6082 and got["ensemble"]["accuracy"] == 0.8563
    assert got["kf-linear"]["with-head"] == 0.8866 and all(r["from-log"] for r in rows)


def test_the_table_pairs_rows_on_the_same_seeds(tmp_path):
    base = {"alpha": 0.1, "lr": 0.05}
    rows = []
    for seed, (ens, kf, kfd, fd) in enumerate([(0.5, 0.8, 0.7, 0.6), (0.6, 0.9, 0.85, 0.7)]):
        rows += [{**base, "seed": seed, "method": "ensemble", "accuracy": ens},
                 {**base, "seed": seed, "method": "best client", "accuracy": ens - 0.1},
                 {**base, "seed": seed, "method": "kf-linear", "accuracy": 0.3, "with-head": kf, "fuse-seconds": 2.0,
                  "fuse-per-epoch": 4.0},
                 {**base, "seed": seed, "method": "kf-linear+distill", "accuracy": 0.4, "with-head": kfd,
                  "fuse-seconds": 5.0, "fuse-per-epoch": 10.0},
                 {**base, "seed": seed, "method": "feddf", "accuracy": 0.4, "with-head": fd, "fuse-seconds": 3.0,
                  "fuse-per-epoch": 6.0}]
    doc = {"device": "cpu", "gpu": None, "torch": "x", "lr": 0.05, "tuning": {"0.05": {"ensemble": 0.5}},
           "recipe": {"lrs": [0.05], "epochs": 10, "batch": 128}, "rows": rows, "stopped": None}
    (tmp_path / "c.json").write_text(json.dumps(doc))
    fr.main(["table", "--runs", str(tmp_path / "c.json"), "--out", str(tmp_path / "t")])
    text = (tmp_path / "t" / "table.md").read_text()
    assert "| `kf-linear` (+ head round) | ensemble | +30.0 ± 0.0 (n=2) [+30.0, +30.0] |" in text
    assert "[-10.0, -5.0]" in text   # kf-linear + distillation against kf-linear + head round, seed by seed


@pytest.mark.slow
def test_a_smoke_run_writes_whole_cells(tmp_path):
    pytest.importorskip("torchvision")
    fr.main(["run", "--device", "cpu", "--smoke", "8", "--cells", "0.5:0", "--lr", "0.05",
             "--methods", "average,kf-linear", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "cells.json").read_text())
    methods = {r["method"] for r in doc["rows"]}
    assert methods == {"best client", "mean client", "ensemble", "average", "kf-linear"}
    assert all(0 <= r["with-head"] <= 1 for r in doc["rows"] if "with-head" in r)
