"""FENS on O1's strong clients (issue 59 item 2): Allouah et al., "Revisiting Ensembling in One-Shot Federated
Learning", NeurIPS 2024, arXiv 2411.07182 — the published peer run like for like on fedfuse's cached strong clients
(``fmnist_strong``: the same cells, models, train / validation parts).

FENS in two phases, as its paper and public code (github.com/sacs-epfl/fens: ``models/smallnn.py``,
``distoptim/FedAdam.py``, ``scripts/train_aggregator.sh``, ``generate_logits_v2.py``) define it, written fresh here:

1. The clients upload their trained models once (one exchange; here the cached strong clients).
2. A small **aggregator** over the M clients' stacked logits is trained **with federated learning on the clients'
   data**: the public code's ``SmallNN`` with ``d = 2`` — Linear(M·C → M·d) - ReLU - Linear(M·d → C), here
   50 → 10 → 10, 620 parameters (0.014 LeNet) — on each client's **proxy split**: its held-out share of its data,
   never used in local training (``proxy_ratio 0.1``; here each client's own held-out 10 %, ``vx`` / ``vy``, which the
   strong clients never trained on), its input the M models' logits on it. Optimizer **FedAdam** as the public code's:
   every round each client takes ``local_steps`` = 1 SGD step (lr 1, no momentum, batch 128, a fresh draw) from the
   global aggregator, the server averages the deltas (weights: the samples each client saw) and takes an Adam step
   without bias correction (server lr 1e-3, β1 0.9, β2 0.99, ε 1e-3), **500 rounds**. The result is the M client
   models + the aggregator: inference runs all M models (size 5.01 × LeNet).

Exchanges: 1 model upload + R aggregator rounds; uplink per client 1 + R × 620 / 44,426 LeNet uploads.

Rows (``CONFIGS``): ``fens`` (the public code's setting, R = 500); ``fens-trainparts`` (the same on the clients'
training parts instead of the held-out proxy: the logits of a model on its own training data are overconfident, which
is why the paper holds a proxy out); ``fens-r2`` (R = 2 with the paper's optimizer: 3 exchanges, like for like with
the two- and three-exchange rows); ``fens-r2-fedavg`` (R = 2, FedAvg: each round E local epochs of SGD over the proxy
split, the server averaging the models by samples; lr and E chosen on the tuning split α 0.3 seed 100 by test accuracy,
grid lr 0.01 / 0.1 × E 1 / 10 / 50: ``tune``). No selection of rounds or states (the public code reports the best test
accuracy over rounds; here the last round's aggregator, test labels read for the reported accuracy only). The head
round does not apply (FENS's aggregator is the trained head).

Deviations: the paper's clients upload INT8-quantised models and the logits are the quantised models' (here fp32: the
upload counts 1); its client models are ResNet-8 on CIFAR-10 / SVHN / CIFAR-100 with 20 clients, here O1's five
LeNet-5 strong clients; no early stopping of the aggregator on test accuracy.

Seconds, ÷ one local epoch of one client timed in the same process (``fmnist_fusefl.one_epoch_seconds``): the
server's (the R aggregation steps) and the clients' (their M models' logits on their proxy data and their R × local
steps; per client).

    .venv/bin/python -m simulations.bench.fmnist_fens tune --out results/fmnist-o1-strong/fens/tuning
    .venv/bin/python -m simulations.bench.fmnist_fens run --alphas 0.1,0.3,0.5 --seeds 0,1,2 --out results/fmnist-o1-strong/fens
    .venv/bin/python -m simulations.bench.fmnist_fens table --out results/fmnist-o1-strong/fens
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fedfuse.training import predict_logits  # noqa: E402
from simulations.bench.fmnist_fusefl import LENET_PARAMS, acc, n_params, one_epoch_seconds  # noqa: E402

# the public code's FedAdam (distoptim/FedAdam.py) and train_aggregator.sh: client lr 1, server lr 1e-3, gmf 0.9
PAPER = {"optimizer": "fedadam", "rounds": 500, "local-steps": 1, "lr": 1.0, "slr": 1e-3, "beta1": 0.9,
         "beta2": 0.99, "eps": 1e-3, "batch-size": 128, "d": 2, "data": "proxy"}
# R = 2 with FedAvg: the grid ``tune`` runs on the tuning split; FEDAVG_CHOICE is its choice (tuning/choice.json)
FEDAVG_GRID = [{"optimizer": "fedavg", "rounds": 2, "local-epochs": e, "lr": lr, "batch-size": 128, "d": 2,
                "data": "proxy"} for lr in (0.01, 0.1) for e in (1, 10, 50)]
FEDAVG_CHOICE: dict | None = None   # set from tuning/choice.json when present
CONFIGS = {"fens": PAPER, "fens-trainparts": {**PAPER, "data": "train"}, "fens-r2": {**PAPER, "rounds": 2}}
TUNING = (0.3, 100)


def aggregator(m: int, classes: int, d: int, seed: int) -> nn.Module:
    """The public code's SmallNN: Linear(m·C → m·d) - ReLU - Linear(m·d → C), PyTorch's initialisation, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(m * classes, m * d), nn.ReLU(), nn.Linear(m * d, classes))


def stacked_logits(models: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([predict_logits(mod, x) for mod in models], 1)


def train_aggregator(data: list[tuple[torch.Tensor, torch.Tensor]], cfg: dict, seed: int, m: int) -> tuple:
    """FENS's phase 2: the aggregator trained by FL over the clients' (stacked logits, labels); returns it and the
    server's seconds."""
    agg = aggregator(m, 10, cfg["d"], seed)
    gens = [torch.Generator().manual_seed(seed * 1000 + 500 + i) for i in range(len(data))]
    state = {k: v.clone() for k, v in agg.state_dict().items()}
    mom = {k: torch.zeros_like(v) for k, v in state.items()}
    var = {k: torch.zeros_like(v) for k, v in state.items()}
    server_s = 0.0
    bs = cfg["batch-size"]
    keys = list(state)
    for rnd in range(cfg["rounds"]):
        deltas, seen = [], []
        for (z, y), gen in zip(data, gens):
            # the client's local SGD from the global state (functional: the aggregator is tiny, a module copy per
            # client and round would cost more than its steps)
            params = {k: state[k].clone().requires_grad_(True) for k in keys}
            if cfg["optimizer"] == "fedadam":   # local steps, each on a fresh draw of a batch (the loader re-shuffled)
                batches = [torch.randperm(len(z), generator=gen)[:bs] for _ in range(cfg["local-steps"])]
                seen.append(min(len(z), bs * cfg["local-steps"]))
            else:                               # local epochs over the client's set
                batches = []
                for _ in range(cfg["local-epochs"]):
                    perm = torch.randperm(len(z), generator=gen)
                    batches += [perm[s:s + bs] for s in range(0, len(z), bs)]
                seen.append(len(z))
            for idx in batches:
                loss = F.cross_entropy(torch.func.functional_call(agg, params, (z[idx],)), y[idx])
                grads = torch.autograd.grad(loss, [params[k] for k in keys])
                with torch.no_grad():
                    for k, g in zip(keys, grads):
                        params[k] -= cfg["lr"] * g
            deltas.append({k: params[k].detach() - state[k] for k in keys})
        t0 = time.perf_counter()
        w = torch.tensor(seen, dtype=torch.float32) / sum(seen)
        delta = {k: sum(wi * dl[k] for wi, dl in zip(w, deltas)) for k in state}
        if cfg["optimizer"] == "fedadam":   # the public code's FedAdam: no bias correction
            for k in state:
                if rnd == 0:
                    mom[k] = (1 - cfg["beta1"]) * delta[k]
                    var[k] = (1 - cfg["beta2"]) * delta[k] ** 2
                else:
                    mom[k] = cfg["beta1"] * mom[k] + (1 - cfg["beta1"]) * delta[k]
                    var[k] = cfg["beta2"] * var[k] + (1 - cfg["beta2"]) * delta[k] ** 2
                state[k] = state[k] + cfg["slr"] * mom[k] / (var[k].sqrt() + cfg["eps"])
        else:                               # FedAvg: the models averaged by samples
            state = {k: state[k] + delta[k] for k in state}
        server_s += time.perf_counter() - t0
    agg.load_state_dict(state)
    return agg.eval(), server_s


def run_cell(alpha: float, seed: int, configs: dict[str, dict]) -> list[dict]:
    from simulations.bench.fmnist_fusefl import reference_rows
    from simulations.bench.fmnist_strong import RECIPE, ensemble_acc, strong_clients, strong_data

    clients = strong_clients(alpha, seed)
    tx, ty, _ = strong_data(alpha, seed)
    models, n, m = [c["model"] for c in clients], [c["n"] for c in clients], len(clients)
    base = {"part": f"dir{alpha:g}", "seed": seed}
    test_z = stacked_logits(models, tx)
    ens = ensemble_acc([test_z[:, 10 * j:10 * j + 10] for j in range(m)], n, ty)
    rows = [{**base, "method": "ensemble", "accuracy": ens, **reference_rows(alpha, seed)}]
    epoch_s = one_epoch_seconds(clients[0], seed, RECIPE)
    sets, logit_s = {}, {}
    for src, (kx, ky) in (("proxy", ("vx", "vy")), ("train", ("x", "y"))):
        t0 = time.perf_counter()
        sets[src] = [(stacked_logits(models, c[kx]), c[ky]) for c in clients]
        logit_s[src] = (time.perf_counter() - t0) / m
    size = (sum(n_params(mod) for mod in models) + n_params(aggregator(m, 10, 2, 0))) / LENET_PARAMS
    for name, cfg in configs.items():
        t0 = time.perf_counter()
        agg, server_s = train_aggregator(sets[cfg["data"]], cfg, seed, m)
        client_s = (time.perf_counter() - t0 - server_s) / m + logit_s[cfg["data"]]
        a = acc(agg(test_z), ty)
        rows.append({**base, "method": name, "accuracy": a, "config": cfg, "exchanges": 1 + cfg["rounds"],
                     "traffic": 1 + cfg["rounds"] * n_params(agg) / LENET_PARAMS, "size": size,
                     "epoch-seconds": epoch_s, "server-per-epoch": server_s / epoch_s,
                     "client-per-epoch": client_s / epoch_s})
        print(f"  dir{alpha:g} s{seed} ensemble {ens:.4f}  {name:<16} {a:.4f}  (server {server_s:.2f}s, clients "
              f"{client_s:.2f}s each, epoch {epoch_s:.2f}s)", flush=True)
    return rows


def tune(out: Path) -> dict:
    """The R = 2 FedAvg grid on the tuning split (α 0.3, seed 100); the choice: the highest test accuracy there."""
    alpha, seed = TUNING
    grid = {f"fens-r2-fedavg-lr{c['lr']:g}-e{c['local-epochs']}": c for c in FEDAVG_GRID}
    rows = run_cell(alpha, seed, {"fens": PAPER, **grid})
    out.mkdir(parents=True, exist_ok=True)
    best = max((r for r in rows if r["method"] in grid), key=lambda r: r["accuracy"])
    choice = {"choice": best["config"], "name": best["method"], "accuracy": best["accuracy"],
              "rule": "highest test accuracy on the tuning split (α 0.3, seed 100)",
              "grid": {r["method"]: r["accuracy"] for r in rows}}
    (out / "choice.json").write_text(json.dumps(choice, indent=1))
    print(json.dumps(choice, indent=1))
    return choice


LABELS = {"fens": "FENS (R = 500, FedAdam, paper's code; inference: 5 LeNets + aggregator)",
          "fens-trainparts": "FENS on the training parts (R = 500)",
          "fens-r2": "FENS R = 2 (paper's optimizer)",
          "fens-r2-fedavg": "FENS R = 2, FedAvg (lr, E tuned on α 0.3 s100)"}


def main(argv: list[str] | None = None) -> None:
    from simulations.bench.fmnist_fusefl import per_seed, rows_of, table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("tune", "run", "table"))
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="results/fmnist-o1-strong/fens")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    if a.what == "tune":
        tune(out)
        return
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "run":
        configs = dict(CONFIGS)
        choice_path = out / "tuning" / "choice.json"
        if choice_path.exists():
            configs["fens-r2-fedavg"] = json.loads(choice_path.read_text())["choice"]
        command = " ".join(["python -m simulations.bench.fmnist_fens"] + (argv if argv is not None else sys.argv[1:]))
        for seed in (int(s) for s in a.seeds.split(",")):
            for alpha in (float(x) for x in a.alphas.split(",")):
                rows = run_cell(alpha, seed, configs)
                with open(out / "rows.jsonl", "a") as f:
                    for r in rows:
                        f.write(json.dumps({**r, "command": command}) + "\n")
    rows = rows_of(out)
    raw = (out / "rows.jsonl").read_text().splitlines() if (out / "rows.jsonl").exists() else []
    commands = [c for c in dict.fromkeys(json.loads(x).get("command") for x in raw if x.strip()) if c]
    if (out / "tuning" / "choice.json").exists():   # the R = 2 FedAvg choice the run read
        commands.insert(0, f"python -m simulations.bench.fmnist_fens tune --out {out / 'tuning'}")
    exchanges = {k: (str(1 + v["rounds"]) if k in CONFIGS else "3", "") for k, v in CONFIGS.items()}
    exchanges["fens-r2-fedavg"] = ("3", "")
    text = table(rows, LABELS, exchanges)
    text += "\n\nThe commands, in the order run:\n\n```bash\n" + "\n".join(commands) + "\n```"
    (out / "table.md").write_text(text + "\n")
    per_seed(out, rows, commands)
    print(text)


if __name__ == "__main__":
    main()
