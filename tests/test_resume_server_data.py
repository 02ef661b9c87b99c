"""A resumed run reads what the interrupted one read: the server's fusion set and test set are recorded by their
SHA-256 in ``results.json`` and the checkpoint, and a resume whose fusion-set file was replaced in between fails
before any client trains, naming ``fusion-set-path``, instead of mixing two runs' data (issue 60; the deployment
misuse study's ``fusion-set-replaced`` case)."""

import json

from fedfuse.data import write_fusion_set_file
from fedfuse.flower.runner.inprocess import run_app_inprocess

RUN = {"dataset": "digits", "model": "mlp", "model-width": 16, "model-depth": 1, "num-clients": 2,
       "partitioning": "shards", "local-epochs": 1, "fusion-set-size": 60, "strategy": "kf-linear",
       "importance": "uniform", "head-round": False}


def test_a_resume_with_a_replaced_fusion_set_fails_naming_the_key(tmp_path):
    path = tmp_path / "fusion.npz"
    write_fusion_set_file(str(path), dataset="digits", size=60, seed=0)
    cfg = {**RUN, "fusion-set-path": str(path), "output-dir": str(tmp_path), "run-name": "r"}
    first = run_app_inprocess({**cfg, "num-server-rounds": 1}, echo=False)
    assert first.ok, first.details
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    digest = res["server-data"]["fusion-set-sha256"]
    assert len(digest) == 64 and res["server-data"]["test-set-sha256"] is not None
    state = json.loads((tmp_path / "r" / "checkpoint" / "state.json").read_text())
    assert state["server-data"]["fusion-set-sha256"] == digest

    write_fusion_set_file(str(path), dataset="digits", size=60, seed=7)   # another draw under the same name
    bad = run_app_inprocess({**cfg, "num-server-rounds": 2, "resume": True}, echo=False)
    assert bad.status == "finished:failed"
    assert "fusion-set-path" in bad.details and "mix two runs" in bad.details, bad.details
    rows = json.loads((tmp_path / "r" / "checkpoint" / "state.json").read_text())["rows"]
    assert [r["round"] for r in rows] == [0, 1]   # nothing trained on the other set

    write_fusion_set_file(str(path), dataset="digits", size=60, seed=0)   # the file restored: the resume goes on
    good = run_app_inprocess({**cfg, "num-server-rounds": 2, "resume": True}, echo=False)
    assert good.ok, good.details
    res = json.loads((tmp_path / "r" / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [0, 1, 2] and res["server-data"]["fusion-set-sha256"] == digest
