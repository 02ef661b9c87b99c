"""M2, cross-device Fashion-MNIST: Flower's ``baselines/fedavgm`` recipe (Hsu et al., "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification", arXiv 1909.06335), fedfuse's rows and a stock
Flower app's on the same client files.

Recipe (the baseline's ``conf/base.yaml`` and README "Expected Results"): 100 clients holding equal shares
(``lda<α>`` of ``simulations.bench.fmnist_splits``, the baseline's LDA split), 5 sampled a round, 1 local epoch,
batch 64, plain SGD (no momentum) at lr 0.01, 1,000 rounds, the final round's central test accuracy; FedAvgM with
server momentum 0.9 and server lr 1.0. Two differences, stated in every table: the model is NIID-Bench's LeNet
(44k parameters, as the M1 cell) instead of the baseline's 64-64-384-192 CNN (about 50x the compute a sample, out of
reach of 2 CPU cores at 1,000 rounds), and the clients share 59,000 images (the server's public pool of 1,000 is held
out first). fedfuse's FedAvgM is its ``fedavgm`` (Flower's heavy-ball FedAvgM); the baseline's default strategy is
a Nesterov "custom-fedavgm".

The per-round client reference columns are off (``client-references=false``: five test-set passes a round, more
than the clients' training). Each fedfuse row runs with the head round, so one run gives the strategy without it (the training rounds: final,
best, the round it first reaches a target) and with it (the closed-form head on the round-1,000 model).
``strategy='auto'`` at one local epoch (below ``auto-fusion-epochs``) is the plain average by rule, so the default's
row is the ``fedavg`` row with its head round; ``--strategies auto`` runs it anyway to show it.

    .venv/bin/python -m simulations.bench.fmnist_m2 --seeds 0,1,2 --strategies fedavg,fedavgm --stock fedavg,fedavgm
    .venv/bin/python -m simulations.bench.fmnist_m2 --seeds 0 --rounds 20 --out /tmp/m2-quick     # a smoke test

Tables: ``simulations.bench.fmnist_tables``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from simulations.bench.fmnist import PUBLIC, SPLITS, run_one, write_row  # noqa: E402
from simulations.bench.fmnist_splits import write_splits  # noqa: E402

CLIENTS, PER_ROUND = 100, 5
# Flower baselines/fedavgm README, "Expected Results" figure (1,000 rounds, final round, one run, FMNIST, the
# baseline's CNN), read off the plot: FedAvg ≈ 88.5; the default "custom-fedavgm" (Nesterov) ≈ 87.4, Flower's
# built-in FedAvgM ≈ 85.1 (α 0.1); α 0.01: 76.5 / 84.7 / ≈ 65.8
PUBLISHED = {("fedavg", "lda0.1"): "≈ 88.5", ("fedavgm", "lda0.1"): "≈ 87.4 (Nesterov) / ≈ 85.1 (built-in)",
             ("fedavg", "lda0.01"): "≈ 76.5", ("fedavgm", "lda0.01"): "≈ 84.7 (Nesterov) / ≈ 65.8 (built-in)"}
ROWS = {"fedavg": {"strategy": "fedavg"}, "fedavgm": {"strategy": "fedavgm", "server-momentum": 0.9, "server-lr": 1.0},
        "auto": {"strategy": "auto"}}


def m2_config(folder: Path, seed: int, rounds: int, out: Path, label: str, overrides: dict) -> dict:
    """The fedavgm baseline's client recipe on one split folder, through fedfuse's ServerApp/ClientApp."""
    return {"dataset": "fashion-mnist", "model": "lenet", "partition-files": str(folder / "node-{partition-id}.npz"),
            "test-set-path": str(folder / "test.npz"), "fusion-set-path": str(SPLITS / f"fmnist-public{PUBLIC}.npz"),
            "fusion-set-size": PUBLIC, "num-clients": CLIENTS, "fraction-train": PER_ROUND / CLIENTS,
            "min-train-nodes": PER_ROUND, "optimizer": "sgd", "momentum": 0.0, "lr": 0.01, "batch-size": 64,
            "weight-decay": 0.0, "local-epochs": 1, "num-server-rounds": rounds, "val-fraction": 0.0,
            "importance": "uniform", "head-round": True, "client-references": False, "seed": seed, **overrides,
            "output-dir": str(out), "run-name": f"{folder.name}-r{rounds}-{label}"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="lda0.1")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--strategies", default="fedavg,fedavgm")
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--stock", default="", help="Flower strategies to run through the stock Flower app on the same "
                    "files (simulations/stock_flower.py), e.g. fedavg,fedavgm")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    out = Path(a.out or "results/fmnist-m2")
    out.mkdir(parents=True, exist_ok=True)
    folders = write_splits(SPLITS, a.parts.split(","), CLIENTS, [int(s) for s in a.seeds.split(",")], PUBLIC)
    for folder in folders:
        meta = json.loads((folder / "split.json").read_text())
        for label in filter(None, a.strategies.split(",")):
            cfg = m2_config(folder, meta["seed"], a.rounds, out, label, ROWS[label])
            row = {"cell": "m2", "part": meta["part"], "seed": meta["seed"], "strategy": label, "rounds": a.rounds,
                   "epochs": 1, **run_one(cfg)}
            write_row(out, row, ("part", "seed", "strategy", "best", "final", "with-head"))
        for label in filter(None, a.stock.split(",")):
            path = out / "stock" / f"{folder.name}-r{a.rounds}-{label}.json"
            if not path.exists():
                subprocess.run([sys.executable, "-m", "simulations.stock_flower", "--split", str(folder), "--strategy",
                                label, "--rounds", str(a.rounds), "--epochs", "1", "--seed", str(meta["seed"]),
                                "--clients", str(CLIENTS), "--per-round", str(PER_ROUND), "--momentum", "0",
                                "--weight-decay", "0", "--lr", "0.01", "--server-momentum", "0.9",
                                "--out", str(path)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(json.dumps({k: json.loads(path.read_text())[k]
                              for k in ("strategy", "seed", "best", "final", "seconds")}), flush=True)


if __name__ == "__main__":
    main()
