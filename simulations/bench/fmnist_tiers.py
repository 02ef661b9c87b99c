"""Capacity tiers on Fashion-MNIST (issue 47, part 3): fedfuse's default ``average`` with width tiers (and one width ×
depth cell) against HeteroFL, FedRolex, FedDF, DepthFL and FedAvg trained with every client at the smallest tier's
size, on a cheap recipe that fits one CPU core (``docs/tiers.md``, "Fashion-MNIST (issue 47)").

The data: per seed, a seeded subset of ``--train`` images (default 6,000) of the 59,000 client images of
``simulations.bench.fmnist_splits`` (its public pool of 1,000 held out: the server's fusion set), split over 10
clients with NIID-Bench's Dirichlet split (``dir<α>``), and a fixed subset of ``--test`` images (default 2,000) of
the 10,000 test images. Written as node files (``partition-files``) under ``<out>/splits`` (git-ignored), so every
row of a (cell, seed) trains on byte-identical client data. Each (cell, seed) is one
``fedfuse.flower.runner.sweep --engine inprocess`` call over the cell's rows, its raw runs in
``<out>/runs/<cell>/s<seed>`` (git-ignored); every row gets the head round (``head-round=true``, the default), one
lr for every row. ``table`` reads the raw runs and keeps the tracked ``<out>/runs.json``'s rows that have none here.

    .venv/bin/python -m simulations.bench.fmnist_tiers run --cells w-a0.5,w-a0.1 --seeds 0,1,2 --out results/fmnist-tiers
    .venv/bin/python -m simulations.bench.fmnist_tiers table --out results/fmnist-tiers
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from simulations.bench.fmnist_splits import _data, dirichlet_niid, public_split  # noqa: E402

PUBLIC = 1000
TEST_SEED = 47
# the recipe every cell shares (a run config; the cell adds its model, tiers and split files)
BASE = ("dataset='fashion-mnist' num-clients=10 num-server-rounds={rounds} local-epochs={epochs} optimizer='{opt}' "
        "lr={lr} batch-size=32 val-fraction=0.0 fusion-set-size=500 head-round=true")
# cell -> (Dirichlet α, model config, tiers, rows)
WIDTH_ROWS = ("average,heterofl,fedrolex,feddf,fedavg[model-width=4 client-tiers='' sweep-as-tier=0.25]")
DEPTH_ROWS = ("average,depthfl,fedavg[model-width=8 model-depth=1 client-tiers='' sweep-as-tier='0.5x0.5']")
CELLS = {
    "w-a0.5": (0.5, "model='cnn' model-width=16 model-depth=2", "1,0.5,0.25", WIDTH_ROWS),
    "w-a0.1": (0.1, "model='cnn' model-width=16 model-depth=2", "1,0.5,0.25", WIDTH_ROWS),
    "wd-a0.5": (0.5, "model='cnn' model-width=16 model-depth=2", "1x1,1x0.5,0.5x0.5", DEPTH_ROWS),
    # depth 3: at 28×28 the depth-2 cnn pools a 7×7 map globally and barely trains in this recipe (FedAvg at full
    # width, seed 0, Adam 1e-3: 0.240 before the head round after 5 rounds; depth 3: 0.479; depth 3 at lr 3e-3: 0.645)
    "w3-a0.5": (0.5, "model='cnn' model-width=16 model-depth=3", "1,0.5,0.25", WIDTH_ROWS),
    # the depth-3 cnn across width x depth tiers (the 0.5x0.5 tier: width 8, ceil(0.5 x 3) = 2 blocks) and across
    # depths alone (1x0.5: 2 of the 3 blocks), against DepthFL (and InclusiveFL, which takes one width)
    "wd3-a0.5": (0.5, "model='cnn' model-width=16 model-depth=3", "1x1,1x0.5,0.5x0.5",
                 "average,depthfl,fedavg[model-width=8 model-depth=2 client-tiers='' sweep-as-tier='0.5x0.5']"),
    "d3-a0.5": (0.5, "model='cnn' model-width=16 model-depth=3", "1x1,1x0.5",
                "average,depthfl,inclusivefl,fedavg[model-depth=2 client-tiers='' sweep-as-tier='1x0.5']"),
    # the same width x depth tiers at alpha 0.1, and on fedfuse's ResNet (3 stages of one block, 16 / 32 / 64
    # channels, batch norm: the family whose width x depth tiers died, issue 47 part 1)
    "wd3-a0.1": (0.1, "model='cnn' model-width=16 model-depth=3", "1x1,1x0.5,0.5x0.5",
                 "average,depthfl,fedavg[model-width=8 model-depth=2 client-tiers='' sweep-as-tier='0.5x0.5']"),
    "wdr3-a0.5": (0.5, "model='resnet' model-width=16 model-depth=3", "1x1,1x0.5,0.5x0.5",
                  "average,depthfl,fedavg[model-width=8 model-depth=2 client-tiers='' sweep-as-tier='0.5x0.5']"),
    # depth tiers on fedfuse's ViT (timm, width 64, 4 blocks; 1x0.5: 2 blocks with an exit), where one fits a shared
    # 2-core machine (a batch costs about 5x the depth-3 cnn's)
    "dv-a0.5": (0.5, "model='vit' model-width=64 model-depth=4", "1x1,1x0.5",
                "average,depthfl,inclusivefl,fedavg[model-depth=2 client-tiers='' sweep-as-tier='1x0.5']"),
}


def write_split(out: Path, alpha: float, seed: int, train: int, test: int, clients: int = 10) -> Path:
    """The (α, seed) node files: ``train`` images drawn (seeded) from the client pool, split by NIID-Bench's
    Dirichlet; ``test`` test images (a fixed draw, the same for every seed); the public pool of 1,000."""
    folder = out / "splits" / f"fmnist-dir{alpha}-n{clients}-t{train}-s{seed}"
    if (folder / "split.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    x, y, xt, yt = _data()
    pub, pool = public_split(y, PUBLIC)
    pub_path = out / "splits" / f"fmnist-public{PUBLIC}.npz"
    if not pub_path.exists():
        np.savez(pub_path, x=x[pub], y=y[pub])
    rng = np.random.default_rng([seed, 47])
    sub = np.sort(rng.permutation(pool)[:train])
    counts = []
    for i, local in enumerate(dirichlet_niid(y[sub], clients, alpha, np.random.default_rng(seed))):
        idx = sub[np.sort(local)]
        np.savez(folder / f"node-{i}.npz", x_train=x[idx], y_train=y[idx].astype(np.int64))
        counts.append(np.bincount(y[idx], minlength=10).tolist())
    keep = np.sort(np.random.default_rng(TEST_SEED).permutation(len(yt))[:test])
    np.savez(folder / "test.npz", x=xt[keep], y=yt[keep].astype(np.int64))
    (folder / "split.json").write_text(json.dumps({"alpha": alpha, "clients": clients, "seed": seed, "train": train,
                                                   "test": test, "class-counts": counts}))
    return folder


def run_config(cell: str, folder: Path, out: Path, rounds: int, epochs: int, lr: float, opt: str) -> str:
    alpha, model, tiers, _ = CELLS[cell]
    return (BASE.format(rounds=rounds, epochs=epochs, lr=lr, opt=opt) + f" {model} client-tiers='{tiers}' dirichlet-alpha={alpha}"
            f" partition-files='{folder.resolve()}/node-{{partition-id}}.npz'"
            f" test-set-path='{folder.resolve()}/test.npz'"
            f" fusion-set-path='{(out / 'splits' / f'fmnist-public{PUBLIC}.npz').resolve()}'")


def run(a) -> None:
    out = Path(a.out)
    cmds = out / "commands.txt"
    for cell in a.cells.split(","):
        rows = a.rows or CELLS[cell][3]
        for seed in (int(s) for s in a.seeds.split(",")):
            folder = write_split(out, CELLS[cell][0], seed, a.train, a.test)
            cmd = [sys.executable, "-m", "fedfuse.flower.runner.sweep", "--engine", "inprocess", "--partitions",
                   "dirichlet", "--seeds", str(seed), "--strategies", rows, "--run-config",
                   run_config(cell, folder, out, a.rounds, a.epochs, a.lr, a.optimizer), "--out", str(out / "runs" / cell / f"s{seed}")]
            line = " ".join(shlex.quote(c if c != sys.executable else ".venv/bin/python") for c in cmd)
            with open(cmds, "a") as f:
                f.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} cell {cell} seed {seed}\n{line}\n")
            t = time.time()
            print(f"{time.strftime('%H:%M:%S')} {cell} seed {seed}: {rows}", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            with open(out / "runs" / cell / f"s{seed}.log", "a") as f:   # a later call (more rows) appends
                f.write(proc.stdout + proc.stderr)
            print(f"  rc {proc.returncode} {time.time() - t:.0f}s; "
                  + " | ".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if "sweep:" in ln)[-1500:],
                  flush=True)


def _ms(v: list[float]) -> str:
    if not v:
        return "—"
    return f"{statistics.mean(v):.3f} ± {statistics.stdev(v):.3f}" if len(v) > 1 else f"{v[0]:.3f} (1 seed)"


def _tkey(t: str) -> float:
    if "x" in t:
        w, d = (float(s) for s in t.split("x"))
        return w * d + d * 1e-3
    return float(t)


ROW_KEYS = ("strategy", "seed", "status", "error", "seconds", "final-accuracy", "final-tier-accuracy", "as-tier",
            "accuracy-per-round", "tier-accuracy-per-round", "run-config")


def collect(out: Path) -> list[dict]:
    """Every run's row: the raw runs' (``<out>/runs/<cell>/s*/sweep.json``, git-ignored), and the tracked
    ``<out>/runs.json``'s rows whose raw run is not here (a fresh clone that adds a row keeps the others)."""
    rows: dict[tuple, dict] = {}
    if (out / "runs.json").exists():
        for r in json.loads((out / "runs.json").read_text()):
            rows[r["cell"], r["strategy"], r["seed"]] = r
    for path in sorted((out / "runs").glob("*/s*/sweep.json")) if (out / "runs").exists() else []:
        cell = path.parent.parent.name
        for r in json.loads(path.read_text()):
            rows[cell, r["strategy"], r["seed"]] = {"cell": cell, **{k: r.get(k) for k in ROW_KEYS}}
    return list(rows.values())


def table(a) -> None:
    out = Path(a.out)
    rows_out, text = collect(out), []
    for cell in sorted({r["cell"] for r in rows_out}):
        runs = [r for r in rows_out if r["cell"] == cell]
        labels = list(dict.fromkeys(r["strategy"] for r in runs))
        tiers = sorted({t for r in runs for t in (r.get("final-tier-accuracy") or {})}, key=_tkey, reverse=True)
        alpha, model, ctiers, _ = CELLS.get(cell, ("?", "?", "?", ""))
        cfg = next((r.get("run-config") for r in runs), {}) or {}
        text.append(f"\n### {cell}: `{model}`, tiers `{ctiers}`, Dirichlet α {alpha}\n")
        text.append(f"{cfg.get('num-server-rounds')} rounds × {cfg.get('local-epochs')} local epoch(s), "
                    f"{cfg.get('optimizer')} lr {cfg.get('lr')} (every row), batch 32, every row with the head round.\n")
        text.append("| row | seeds ok / run | global | " + " | ".join(f"tier {t}" for t in tiers)
                    + " | global, last training round (no head) | s per run |")
        text.append("|---|---|---|" + "---|" * len(tiers) + "---|---|")
        for label in labels:
            rs = [r for r in runs if r["strategy"] == label]
            ok = [r for r in rs if r.get("final-accuracy") is not None and r["status"] != "failed"]
            fails = [f"seed {r['seed']}: {str(r.get('error'))[:120]}" for r in rs if r not in ok]
            tier_cells = []
            for t in tiers:
                v = [r["final-tier-accuracy"][t] for r in ok if t in (r.get("final-tier-accuracy") or {})]
                if not v and ok and all(r.get("as-tier") is not None and str(r["as-tier"]) == t for r in ok):
                    v = [r["final-accuracy"] for r in ok]   # FedAvg at the smallest size: its model is that tier
                tier_cells.append(_ms(v))
            glob = "" if all(r.get("as-tier") is not None for r in ok) and ok else _ms([r["final-accuracy"] for r in ok])
            secs = statistics.mean(r["seconds"] for r in rs if r.get("seconds")) if rs else 0
            pre = _ms([r["accuracy-per-round"][-2] for r in ok if len(r.get("accuracy-per-round") or []) > 1])
            text.append(f"| `{label}` | {len(ok)} / {len(rs)} | {glob} | " + " | ".join(tier_cells)
                        + f" | {pre} | {secs:.0f} |" + (f" failed: {'; '.join(fails)}" if fails else ""))
        text.append("")
        text.append(goal(runs, tiers))
    (out / "runs.json").write_text(json.dumps(rows_out, indent=1))
    head = ("Capacity tiers on Fashion-MNIST (issue 47, part 3): final test accuracy after the head round, mean ± "
            "sample std over the seeds, on the cheap recipe of `simulations/bench/fmnist_tiers.py` (per seed a "
            "6,000-image subset of the 59,000 client images split over 10 clients by NIID-Bench's Dirichlet, 2,000 "
            "test images, the 1,000-image public pool as the fusion set). The global model is the full-width model; "
            "FedAvg at the smallest size trains every client at that size (its model is that tier). Exact commands: "
            "`commands.txt`; every run of every seed: `runs.json`. Table: `.venv/bin/python -m "
            "simulations.bench.fmnist_tiers table --out " + a.out + "`.\n")
    body = head + "\n".join(text)
    (out / "table.md").write_text(body + "\n")
    print(body)


def goal(runs: list[dict], tiers: list[str]) -> str:
    """The issue's goals on means: the default above every baseline on the global model and every tier; its
    smallest tier − FedAvg at that size."""
    ok = [r for r in runs if r.get("final-accuracy") is not None and r["status"] != "failed"]
    mean = {}
    for label in dict.fromkeys(r["strategy"] for r in ok):
        rs = [r for r in ok if r["strategy"] == label]
        m = {"global": statistics.mean(r["final-accuracy"] for r in rs)}
        for t in tiers:
            v = [r["final-tier-accuracy"][t] for r in rs if t in (r.get("final-tier-accuracy") or {})]
            if v:
                m[t] = statistics.mean(v)
        mean[label] = m
    if "average" not in mean:
        return "Goal: no finished `average` row."
    lines = []
    for label, m in mean.items():
        if label == "average" or label.startswith("fedavg"):
            continue
        worse = [k for k in m if k in mean["average"] and mean["average"][k] <= m[k]]
        lines.append(f"`average` above `{label}` on global and every tier: {'yes' if not worse else 'no (not above on ' + ', '.join(worse) + ')'}")
    fed = [label for label in mean if label.startswith("fedavg")]
    small = tiers[-1] if tiers else None
    if fed and small and small in mean["average"]:
        d = 100 * (mean["average"][small] - mean[fed[0]]["global"])
        lines.append(f"smallest tier {small} − FedAvg at that size: {d:+.1f} points (goal ≥ +3: {'met' if d >= 3 else 'missed'})")
    return "Goals (means): " + "; ".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--cells", default="w-a0.5,w-a0.1")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rows", default="", help="override the cell's rows (a --strategies list)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--lr", type=float, default=0.001)
    ap.add_argument("--train", type=int, default=6000)
    ap.add_argument("--test", type=int, default=2000)
    ap.add_argument("--out", default="results/fmnist-tiers")
    a = ap.parse_args(argv)
    run(a) if a.what == "run" else table(a)


if __name__ == "__main__":
    main()
