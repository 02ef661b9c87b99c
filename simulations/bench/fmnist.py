"""Fashion-MNIST cells of the published tables, like for like: fedfuse's rows and a stock Flower app's on the same
client files (``simulations.bench.fmnist_splits``), every run seeded, rows as mean ± sample std over seeds.

**M1, NIID-Bench** (Li et al., arXiv 2102.02079; Flower ``baselines/niid_bench``): 10 clients, all every round,
LeNet, SGD lr 0.01 momentum 0.9 weight decay 1e-5, batch 64; the published recipe is 10 local epochs and 50 rounds
(``--recipe full``), reported as the best test accuracy over rounds. ``--recipe R,E`` runs R rounds of E local
epochs (a cheaper recipe, stated next to the published one in every table). ``--stock`` runs the stock Flower app
(``simulations/stock_flower.py``, no fedfuse code) on the same files with the same recipe.

Each fedfuse row runs with the head round (``head-round=true``), so one run gives the strategy *without* it (the
training rounds: best over rounds, and final) and *with* it (the closed-form head on the final model): both ways
shown, for every strategy, FedAvg included. The server's fusion set is the public pool held out by
``fmnist_splits`` (1,000 images, disjoint from every client; ``fusion-set-size`` of them are drawn).

    .venv/bin/python -m simulations.bench.fmnist --parts dir0.5 --seeds 0 --strategies fedavg --recipe full --out results/fmnist-m1-full
    .venv/bin/python -m simulations.bench.fmnist --parts dir0.5,c2 --seeds 0,1,2 --strategies fedavg,auto --stock fedavg --recipe 2,10

Tables: ``simulations.bench.fmnist_tables``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from simulations.bench.anchor_cell import run_or_read  # noqa: E402
from simulations.bench.fmnist_splits import write_splits  # noqa: E402

SPLITS = Path("results/cache/fmnist-splits")
PUBLIC = 1000
# NIID-Bench's FedAvg / FedProx (mu 0.01) on Fashion-MNIST, best accuracy over 50 rounds (Flower baselines/niid_bench
# README, "Expected Results"; mean ± std over an unstated number of trials, partition seed fixed at 42)
PUBLISHED = {("fedavg", "iid"): "89.23 ± 0.45", ("fedavg", "dir0.5"): "88.09 ± 0.29", ("fedavg", "c1"): "28.39 ± 17.09",
             ("fedavg", "c2"): "78.10 ± 2.51", ("fedavg", "c3"): "82.43 ± 1.52",
             ("fedprox", "iid"): "89.42 ± 0.09", ("fedprox", "dir0.5"): "88.15 ± 0.42", ("fedprox", "c1"): "32.65 ± 6.68",
             ("fedprox", "c2"): "78.05 ± 0.99", ("fedprox", "c3"): "82.99 ± 0.48"}
# strategy rows: label -> run-config overrides
ROWS = {"fedavg": {"strategy": "fedavg"}, "fedprox": {"strategy": "fedprox", "proximal-mu": 0.01},
        "fedavgm": {"strategy": "fedavgm", "server-momentum": 0.9}, "auto": {"strategy": "auto"},
        "feddf": {"strategy": "feddf"}, "average": {"strategy": "average"}, "kf-linear": {"strategy": "kf-linear"},
        "ot": {"strategy": "ot"}, "rebasin": {"strategy": "rebasin"}}


def recipe(text: str) -> tuple[int, int]:
    """``full`` (NIID-Bench: 50 rounds of 10 local epochs) or ``R,E``."""
    if text == "full":
        return 50, 10
    r, e = (int(v) for v in text.split(","))
    return r, e


def m1_config(folder: Path, seed: int, rounds: int, epochs: int, out: Path, label: str, overrides: dict) -> dict:
    """NIID-Bench's client recipe on one split folder, through fedfuse's ServerApp/ClientApp."""
    return {"dataset": "fashion-mnist", "model": "lenet", "partition-files": str(folder / "node-{partition-id}.npz"),
            "test-set-path": str(folder / "test.npz"), "fusion-set-path": str(SPLITS / f"fmnist-public{PUBLIC}.npz"),
            "fusion-set-size": PUBLIC, "num-clients": 10, "optimizer": "sgd", "lr": 0.01, "batch-size": 64,
            "weight-decay": 1e-5, "local-epochs": epochs, "num-server-rounds": rounds, "val-fraction": 0.0,
            "importance": "uniform", "head-round": True, "seed": seed, **overrides,
            "output-dir": str(out), "run-name": f"{folder.name}-{label}"}


def run_one(cfg: dict) -> dict:
    """Run (or read a finished) in-process run; the row: best / final without the head round, with it."""
    out, res, failed = run_or_read(cfg)
    if failed:
        raise RuntimeError(f"{out}: {failed}")
    accs = [r["test-accuracy"] for r in res["rounds"]]
    head = cfg.get("head-round", True)
    train_accs = accs[1:-1] if head else accs[1:]   # row 0: the initial model; the last row: the head round
    return {"run": str(out), "best": max(train_accs), "final": train_accs[-1], "with-head": accs[-1] if head else None,
            "curve": accs, "seconds": res.get("seconds"),
            "fusion-seconds": [h.get("fusion-seconds", 0.0) for h in res.get("strategy-history", [])]}


def write_row(out: Path, row: dict, shown: tuple[str, ...]) -> None:
    """Print ``row``'s ``shown`` keys and append the whole row to ``out/rows.jsonl``."""
    print(json.dumps({k: row[k] for k in shown}), flush=True)
    with open(out / "rows.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="dir0.5,c2")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--strategies", default="fedavg")
    ap.add_argument("--recipe", default="full")
    ap.add_argument("--stock", default="", help="Flower strategies to run through the stock Flower app on the same "
                    "files (simulations/stock_flower.py), e.g. fedavg,fedprox")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    rounds, epochs = recipe(a.recipe)
    out = Path(a.out or f"results/fmnist-m1-r{rounds}e{epochs}")
    seeds = [int(s) for s in a.seeds.split(",")]
    folders = write_splits(SPLITS, a.parts.split(","), 10, seeds, PUBLIC)
    rows = []
    for folder in folders:
        meta = json.loads((folder / "split.json").read_text())
        for label in a.strategies.split(","):
            cfg = m1_config(folder, meta["seed"], rounds, epochs, out, label, ROWS[label])
            row = {"part": meta["part"], "seed": meta["seed"], "strategy": label, "rounds": rounds, "epochs": epochs,
                   **run_one(cfg)}
            rows.append(row)
            write_row(out, row, ("part", "seed", "strategy", "best", "final", "with-head"))
        for label in filter(None, a.stock.split(",")):
            path = out / "stock" / f"{folder.name}-{label}.json"
            if not path.exists():
                import subprocess
                import sys

                subprocess.run([sys.executable, "-m", "simulations.stock_flower", "--split", str(folder), "--strategy",
                                label, "--rounds", str(rounds), "--epochs", str(epochs), "--seed", str(meta["seed"]),
                                "--out", str(path)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(json.dumps({k: json.loads(path.read_text())[k]
                                                     for k in ("strategy", "seed", "best", "final")}), flush=True)


if __name__ == "__main__":
    main()
