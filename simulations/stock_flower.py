"""A stock Flower app on fedfuse's Fashion-MNIST client files: Flower's own strategy (FedAvg, FedProx, FedAvgM),
a plain PyTorch LeNet-5 and training loop, Flower's simulation engine; **no fedfuse code** (nothing here imports
``fedfuse``), so its numbers are what a Flower user gets on the same splits with NIID-Bench's recipe.

Clients: ``node-<partition-id>.npz`` of a split folder (``simulations.bench.fmnist_splits``), all of it trained on;
SGD (``--momentum`` 0.9, ``--weight-decay`` 1e-5: NIID-Bench's), batch 64, ``--epochs`` local epochs, a fresh
optimizer each round; FedProx's proximal term ``mu/2 ||w - w_global||^2`` when the strategy sends ``proximal-mu``.
Server: ``--rounds`` rounds, ``--per-round`` of ``--clients`` sampled each round (all by default), central evaluation
on the folder's ``test.npz`` each round (``evaluate_fn``); the global model starts from ``torch.manual_seed(seed)``.

    .venv/bin/python -m simulations.stock_flower --split results/cache/fmnist-splits/fmnist-dir0.5-n10-s0 \\
        --strategy fedavg --rounds 50 --epochs 10 --seed 0 --out results/fmnist-stock/dir0.5-s0-fedavg.json
    # a run stopped early (its stdout kept): its curve so far, as the JSON a finished run writes
    .venv/bin/python -m simulations.stock_flower --split ... --rounds 50 --epochs 10 --seed 0 --out ... --from-log run.log
    # M2, Flower's fedavgm baseline recipe: 100 clients, 5 a round, plain SGD lr 0.01, 1 local epoch
    .venv/bin/python -m simulations.stock_flower --split results/cache/fmnist-splits/fmnist-lda0.1-n100-s0 \
        --clients 100 --per-round 5 --momentum 0 --weight-decay 0 --strategy fedavgm --rounds 1000 --epochs 1 ...
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


def lenet() -> nn.Module:
    """NIID-Bench's CNN for 28x28 grey images (``CNNMnist`` of Flower's ``baselines/niid_bench``)."""
    return nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def build_apps(split: str, rounds: int, epochs: int, lr: float, strategy_name: str, seed: int, mu: float,
               server_momentum: float, log: list, clients: int = 10, per_round: int = 10, momentum: float = 0.9,
               weight_decay: float = 1e-5, server_lr: float = 1.0):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg, FedAvgM, FedProx

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        return _train(msg, context)

    def _train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        pid = int(context.node_config["partition-id"])
        with np.load(os.path.join(split, f"node-{pid}.npz")) as z:
            x, y = torch.from_numpy(z["x_train"]), torch.from_numpy(z["y_train"])
        model = lenet()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        cfg = msg.content["config"]
        prox = float(cfg.get("proximal-mu", 0.0))
        anchor = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]), momentum=momentum, weight_decay=weight_decay)
        gen = torch.Generator().manual_seed(seed * 100003 + int(cfg["server-round"]) * 101 + pid)
        model.train()
        for _ in range(epochs):
            perm = torch.randperm(len(y), generator=gen)
            for i in range(0, len(y), 64):
                idx = perm[i:i + 64]
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                if prox > 0:
                    loss = loss + 0.5 * prox * sum((p - a).pow(2).sum() for p, a in zip(model.parameters(), anchor))
                loss.backward()
                opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": len(y)})}), reply_to=msg)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        with np.load(os.path.join(split, "test.npz")) as z:
            tx, ty = torch.from_numpy(z["x"]), torch.from_numpy(z["y"])

        def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            model = lenet()
            model.load_state_dict(arrays.to_torch_state_dict())
            model.eval()
            with torch.no_grad():
                acc = float((model(tx).argmax(1) == ty).float().mean())
            log.append({"round": server_round, "test-accuracy": acc, "time": time.time()})
            print(json.dumps({"progress": log[-1]}), flush=True)   # a run cut short still leaves its curve
            return MetricRecord({"accuracy": acc})

        common = dict(fraction_train=per_round / clients, fraction_evaluate=0.0, min_train_nodes=per_round,
                      min_available_nodes=clients)
        strategy = {"fedavg": lambda: FedAvg(**common), "fedprox": lambda: FedProx(**common, proximal_mu=mu),
                    "fedavgm": lambda: FedAvgM(**common, server_momentum=server_momentum,
                                                         server_learning_rate=server_lr)}[strategy_name]()
        torch.manual_seed(seed)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(lenet().state_dict()), num_rounds=rounds,
                       train_config=ConfigRecord({"lr": lr}), evaluate_fn=evaluate_fn)

    return server_app, client_app


def from_log(a) -> None:
    """``--from-log LOG``: the result of a run stopped before its last round, from the progress lines it printed
    (``rounds`` = the rounds done, ``planned`` = ``--rounds``)."""
    curve = [json.loads(line)["progress"]["test-accuracy"] for line in Path(a.from_log).read_text().splitlines()
             if line.startswith('{"progress"')]
    if len(curve) < 2:
        raise SystemExit(f"{a.from_log}: no finished round")
    out = {"split": a.split, "strategy": a.strategy, "rounds": len(curve) - 1, "planned": a.rounds, "epochs": a.epochs,
           "lr": a.lr, "clients": a.clients, "per-round": a.per_round or a.clients, "momentum": a.momentum,
           "weight-decay": a.weight_decay, "seed": a.seed, "curve": curve, "best": max(curve[1:]),
           "final": curve[-1], "engine": "flwr.simulation.run_simulation (Ray)",
           "stopped": f"after {len(curve) - 1} of {a.rounds} rounds"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out))
    print(json.dumps({k: out[k] for k in ("strategy", "seed", "rounds", "best", "final")}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", required=True)
    ap.add_argument("--strategy", default="fedavg", choices=["fedavg", "fedprox", "fedavgm"])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--mu", type=float, default=0.01)
    ap.add_argument("--server-momentum", type=float, default=0.9)
    ap.add_argument("--server-lr", type=float, default=1.0)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=0, help="clients sampled each round (0 = all)")
    ap.add_argument("--momentum", type=float, default=0.9, help="client SGD momentum")
    ap.add_argument("--weight-decay", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpus", type=int, default=1, help="Ray CPUs (one client trains per CPU)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--from-log", help="a stopped run's stdout: write its result so far (rounds done) and exit")
    a = ap.parse_args(argv)
    if a.from_log:
        return from_log(a)
    from flwr.simulation import run_simulation

    log: list = []
    server_app, client_app = build_apps(a.split, a.rounds, a.epochs, a.lr, a.strategy, a.seed, a.mu,
                                        a.server_momentum, log, a.clients, a.per_round or a.clients, a.momentum,
                                        a.weight_decay, a.server_lr)
    t0 = time.time()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=a.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": a.cpus, "include_dashboard": False}})
    if len(log) != a.rounds + 1:
        raise SystemExit(f"stock Flower run ended after {len(log) - 1} of {a.rounds} rounds")
    accs = [r["test-accuracy"] for r in log]
    out = {"split": a.split, "strategy": a.strategy, "rounds": a.rounds, "epochs": a.epochs, "lr": a.lr,
           "clients": a.clients, "per-round": a.per_round or a.clients, "momentum": a.momentum,
           "weight-decay": a.weight_decay, "server-momentum": a.server_momentum, "server-lr": a.server_lr,
           "seed": a.seed, "curve": accs, "best": max(accs[1:]), "final": accs[-1], "seconds": time.time() - t0,
           "engine": "flwr.simulation.run_simulation (Ray)"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out))
    print(json.dumps({k: out[k] for k in ("strategy", "seed", "best", "final", "seconds")}))


if __name__ == "__main__":
    main()
