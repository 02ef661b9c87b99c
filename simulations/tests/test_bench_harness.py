"""The benchmark harness (simulations.bench): statistics, spec parsing, cache keys, one tiny one-shot run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from simulations.bench import clients as bench_clients
from simulations.bench.clients import CellConfig, Recipe, cell_config, plain_recipe, train_client
from simulations.bench.specs import parse_method, parse_partition, split_list
from simulations.bench.stats import format_mean_std, mean_std, std_note


def test_mean_std_is_sample_std_ddof1():
    m, s, n = mean_std([0.90, 0.92, 0.97])
    assert n == 3 and m == pytest.approx(0.93)
    assert s == pytest.approx(math.sqrt((0.03**2 + 0.01**2 + 0.04**2) / 2))  # ddof=1, not /3
    assert format_mean_std([0.90, 0.92, 0.97], scale=100.0) == "93.0 ± 3.6"  # ddof 0 would give 2.9


def test_format_mean_std_edge_cases():
    assert format_mean_std([0.5], scale=100.0) == "50.0"          # one value: no spread
    assert format_mean_std([float("nan")]) == "n/a"
    assert format_mean_std([1.0, 3.0, float("nan")], digits=2) == "2.00 ± 1.41 (2/3)"
    assert std_note(3) == "mean ± sample std (ddof=1) over 3 seeds"
    assert "ddof=1" in std_note(1) and "1 seed " in std_note(1)


def test_partition_spec_one_syntax():
    assert (parse_partition("shards2").method, parse_partition("shards2").num_clients) == ("shards", 2)
    assert parse_partition("dirichlet4").name == "dirichlet4"
    assert parse_partition("iid10").num_clients == 10
    for bad in ("shards", "dirichlet-4", "pathological2", "shards0", "4shards"):
        with pytest.raises(ValueError, match="partition spec"):
            parse_partition(bad)


def test_method_spec_and_lists():
    s = parse_method('kf-gradient[setting=2,head-weights=true,head_target="probs"]')
    assert s.name == "kf-gradient" and s.options == {"setting": 2, "head_weights": True, "head_target": "probs"}
    assert split_list('a,b[x=1,y=2], c,,') == ["a", "b[x=1,y=2]", "c"]
    with pytest.raises(ValueError, match="no valid TOML value"):
        parse_method("kd[epochs=many]")


def test_cache_key_is_stable():
    """Keys of cached clients must not drift: the value below is what the old oneshot_lib produced."""
    cfg = cell_config("digits", "shards2", "mlp", 1)
    assert (cfg.width, cfg.depth, cfg.epochs, cfg.lr) == (128, 2, 60, 3e-3)
    assert cfg.key() == "digits-shards2-mlp-s1-ccbad40920"
    assert cell_config("digits", "shards2", "mlp", 1, lr=1e-3).key() != cfg.key()  # every setting is hashed
    with pytest.raises(ValueError, match="unknown setting"):
        cell_config("digits", "shards2", "mlp", 1, epoch=3)
    with pytest.raises(ValueError, match="partition spec"):
        CellConfig(dataset="digits", partition="shard2", model="mlp", seed=0, width=8, depth=1, epochs=1, lr=0.1)


def test_plain_recipe_matches_fedfuse_train():
    """The harness trainer with the plain recipe is step for step fedfuse.training.train."""
    from fedfuse.models import build_model
    from fedfuse.training import train

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(70, 1, 8, 8, generator=g), torch.randint(0, 10, (70,), generator=g)
    a, b = (build_model("mlp", 10, (1, 8, 8), width=16, seed=3) for _ in range(2))
    train(a, x, y, epochs=2, lr=1e-2, seed=5)
    train_client(b, x, y, plain_recipe(2, 1e-2), seed=5)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError, match="schedule"):
        Recipe(epochs=1, lr=0.1, schedule="linear")


def test_one_shot_end_to_end_writes_table_with_ddof_note(tmp_path, monkeypatch):
    from simulations.bench import one_shot

    out, cache = tmp_path / "out", tmp_path / "cache"
    rc = one_shot.main(["--datasets", "digits", "--partitions", "shards2", "--models", "mlp",
                        "--methods", "average,kf-linear,kf-linear[refine='distill'],"
                        "average[refine='distill+calibrate',prior='class-counts']",
                        "--importance", "uniform", "--seeds", "0",
                        "--epochs", "2", "--width", "16", "--fusion-size", "50",
                        "--cache", str(cache), "--out", str(out)])
    assert rc == 0
    table = (out / "table.md").read_text()
    assert "mean ± sample std (ddof=1) over 1 seed" in table
    for row in ("| best-base |", "| ensemble |", "| average |", "| kf-linear (unif) |",
                "| kf-linear[refine='distill'] (unif) |", "| average[refine='distill+calibrate',prior='class-counts'] |",
                "| auto |"):
        assert row in table
    saved = json.loads((out / "results.json").read_text())
    rows = saved["rows"]
    assert {r["method"] for r in rows} >= {"base-0", "base-1", "best-base", "ensemble", "average", "kf-linear",
                                           "kf-linear[refine='distill']"}
    assert all(r["status"] == "ok" for r in rows)
    refined = [r for r in rows if r["method"] == "kf-linear[refine='distill']"]
    assert refined[0]["refine"] == "distill" and refined[0]["fusion_info"]["refine"] == "distill"
    calibrated = [r for r in rows if r["method"].startswith("average[")][0]["fusion_info"]
    assert calibrated["refine"] == "distill+calibrate" and "calibration-gap-after" in calibrated
    (auto,) = saved["auto"]
    cands = [r for r in rows if r["method"] not in ("best-base", "ensemble") and not r["method"].startswith("base-")]
    assert auto["val_accuracy"] == max(r["val_accuracy"] for r in cands) and auto["auto_candidates"] == len(cands)
    # the clients are cached under the cell's key; a second run loads them instead of training
    key = cell_config("digits", "shards2", "mlp", 0, width=16, epochs=2).key()
    assert sorted(p.name for p in (cache / key).glob("client*.pt")) == ["client0.pt", "client1.pt"]
    monkeypatch.setattr(bench_clients, "train_client", lambda *a, **k: pytest.fail("cached clients retrained"))
    assert one_shot.main(["--datasets", "digits", "--partitions", "shards2", "--models", "mlp", "--methods",
                          "average", "--importance", "uniform", "--seeds", "0", "--epochs", "2", "--width", "16",
                          "--fusion-size", "50", "--cache", str(cache), "--out", str(tmp_path / "out2")]) == 0


def test_one_shot_rejects_bad_specs_before_training(tmp_path):
    from simulations.bench import one_shot

    args = ["--datasets", "digits", "--models", "mlp", "--seeds", "0", "--cache", str(tmp_path / "c"),
            "--out", str(tmp_path / "o"), "--importance", "uniform"]
    with pytest.raises(ValueError, match="partition spec"):
        one_shot.main([*args, "--partitions", "shard2", "--methods", "average"])
    with pytest.raises(ValueError, match="ridg"):
        one_shot.main([*args, "--partitions", "shards2", "--methods", "kf-linear[ridg=1e-3]"])
    with pytest.raises(ValueError, match="did you mean 'distill'"):
        one_shot.main([*args, "--partitions", "shards2", "--methods", "kf-linear[refine='distil']"])
    with pytest.raises(ValueError, match="only used by refine's 'calibrate'"):
        one_shot.main([*args, "--partitions", "shards2", "--methods", "kd[refine='distill',prior='uniform']"])
    with pytest.raises(ValueError, match="prior='counts' is not one of"):
        one_shot.main([*args, "--partitions", "shards2", "--methods", "kd[refine='calibrate',prior='counts']"])
    assert not (tmp_path / "c").exists()


def test_refine_options_split_and_label():
    from simulations.bench.cells import row_label_of, split_options

    spec = parse_method("kf-gradient[setting=2]")
    opts, fuse_opts = split_options(spec, {"kf-gradient": {"refine": "calibrate + distill", "prior": "uniform"}})
    assert opts == {"setting": 2} and fuse_opts == {"refine": "calibrate+distill", "prior": "uniform"}
    # refine from --method-options is not in the spec text: the row label adds it
    assert row_label_of(spec, fuse_opts) == "kf-gradient[setting=2,refine='calibrate+distill',prior='uniform']"
    spec = parse_method("kd[refine='distill']")
    assert row_label_of(spec, split_options(spec)[1]) == "kd[refine='distill']"
    assert split_options(parse_method("kd"))[1] == {"refine": None}


def test_auto_row_chooses_by_validation_never_test():
    from simulations.bench.report import auto_rows, markdown_report

    base = dict(dataset="d", partition="p", model="mlp", fusion_size=10, fusion_source="client0",
                client_train_seconds=1.0, importance="", score_source="", loss=0.0, status="ok")
    rows = []
    for seed, (va_a, va_b) in enumerate([(0.6, 0.7), (0.8, 0.5)]):
        rows += [{**base, "seed": seed, "method": "base-0", "accuracy": 0.5, "val_accuracy": 0.9, "fuse_seconds": 0.0},
                 {**base, "seed": seed, "method": "best-base", "accuracy": 0.5, "fuse_seconds": 0.0},
                 {**base, "seed": seed, "method": "ensemble", "accuracy": 0.9, "val_accuracy": 0.99, "fuse_seconds": 1.0},
                 {**base, "seed": seed, "method": "a", "accuracy": 0.85, "val_accuracy": va_a, "fuse_seconds": 1.0},
                 {**base, "seed": seed, "method": "b[refine='distill']", "accuracy": 0.6, "val_accuracy": va_b,
                  "fuse_seconds": 2.0},
                 {**base, "seed": seed, "method": "c", "accuracy": float("nan"), "fuse_seconds": float("nan"),
                  "status": "n/a: FusionError: no"}]
    autos = sorted(auto_rows(rows), key=lambda r: r["seed"])
    assert [r["auto_choice"] for r in autos] == ["b[refine='distill']", "a"]  # not the base, not the ensemble
    assert [r["accuracy"] for r in autos] == [0.6, 0.85] and autos[0]["fuse_seconds"] == 3.0
    table = markdown_report(rows)
    assert "| auto | 72.5 ± 17.7 |" in table and "s0: b[refine='distill'] (60.0); s1: a (85.0)" in table
