"""``partition-files``: a simulation on given client splits (node-local ``.npz`` per partition id). Each client
trains on exactly its file's samples; the server evaluates on ``test-set-path`` and draws ``fusion-set-size`` samples
(seeded) from the pool in ``fusion-set-path``; bad patterns, paths and formats fail before anything runs, naming the
key."""

import json

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict

from fedfuse.config import ConfigError, preflight
from fedfuse.flower.client_app import _setup
from fedfuse.flower.server_app import setup

SHAPE = 40


def _write_splits(tmp_path, n=3, per=60, seed=0):
    rng = np.random.default_rng(seed)
    files = []
    for i in range(n):
        x = rng.standard_normal((per + 7 * i, SHAPE)).astype(np.float32)
        y = x[:, :10].argmax(1).astype(np.int64)   # learnable: a run at chance level fails (dead-model check)
        np.savez(tmp_path / f"node-{i}.npz", x_train=x, y_train=y)
        files.append((x, y))
    xt = rng.standard_normal((50, SHAPE)).astype(np.float32)
    np.savez(tmp_path / "test.npz", x=xt, y=xt[:, :10].argmax(1).astype(np.int64))
    np.savez(tmp_path / "pool.npz", x=rng.standard_normal((500, SHAPE)).astype(np.float32))
    return files


def _cfg(tmp_path, **extra):
    return {"dataset": "mnist1d-flat", "partition-files": str(tmp_path / "node-{partition-id}.npz"),
            "test-set-path": str(tmp_path / "test.npz"), "fusion-set-path": str(tmp_path / "pool.npz"),
            "fusion-set-size": 100, "num-clients": 3, "min-train-nodes": 3, "val-fraction": 0.0, "head-round": False,
            **extra}


def test_each_client_trains_on_exactly_its_file(tmp_path):
    files = _write_splits(tmp_path)
    run_config = _cfg(tmp_path)
    preflight(run_config)
    for pid, (x, y) in enumerate(files):
        ctx = Context(run_id=1, node_id=pid + 1, node_config={"partition-id": pid, "num-partitions": 3},
                      state=RecordDict(), run_config=run_config)
        _, node = _setup(ctx)
        assert torch.equal(node.train.x, torch.from_numpy(x)) and torch.equal(node.train.y, torch.from_numpy(y))
        assert len(node.val) == 0   # val-fraction=0: all of the client's data trains, as in plain Flower


def test_the_server_uses_the_test_file_and_a_seeded_draw_from_the_pool(tmp_path):
    _write_splits(tmp_path)
    cfg = preflight(_cfg(tmp_path))
    data, _, strategy = setup(cfg)
    pool = torch.from_numpy(np.load(tmp_path / "pool.npz")["x"])
    assert len(data.test) == 50 and strategy.fusion_inputs.shape == (100, SHAPE)
    rows = {tuple(r.tolist()) for r in pool}
    assert all(tuple(r.tolist()) in rows for r in strategy.fusion_inputs)   # drawn from the pool
    again = setup(cfg)[2].fusion_inputs
    assert torch.equal(again, strategy.fusion_inputs)   # seeded
    other = setup(preflight(_cfg(tmp_path, seed=1)))[2].fusion_inputs
    assert not torch.equal(other, strategy.fusion_inputs)


@pytest.mark.parametrize("change, match", [
    ({"partition-files": "/tmp/nowhere/node.npz"}, "partition-id"),
    ({"partition-files": "/tmp/nowhere/node-{partition-id}.npz"}, "partition-files.*client 0"),
    ({"test-set-path": ""}, "test-set-path"),
    ({"fusion-set-source": "client0"}, "fusion-set-source"),
    ({"dataset": "hf:foo"}, "partition-files"),
])
def test_bad_patterns_and_paths_fail_before_anything_runs_naming_the_key(tmp_path, change, match):
    _write_splits(tmp_path)
    with pytest.raises(ConfigError, match=match):
        preflight(_cfg(tmp_path, **change))


def test_a_file_of_the_wrong_format_names_the_key_and_the_client(tmp_path):
    _write_splits(tmp_path)
    np.savez(tmp_path / "node-1.npz", x_train=np.zeros((5, 7), np.float32), y_train=np.zeros(5, np.int64))
    with pytest.raises(ConfigError, match="partition-files.*client 1"):
        preflight(_cfg(tmp_path))


def test_a_run_on_partition_files_end_to_end(tmp_path):
    from fedfuse.flower.runner.inprocess import run_inprocess

    _write_splits(tmp_path)
    out = run_inprocess({**_cfg(tmp_path), "strategy": "fedavg", "num-server-rounds": 2, "model-width": 16,
                         "output-dir": str(tmp_path / "out"), "run-name": "pf"}, echo=False)
    res = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in res["rounds"]] == [0, 1, 2]
    assert [h["valid"] for h in res["strategy-history"]] == [3, 3]   # every client's reply, every round
