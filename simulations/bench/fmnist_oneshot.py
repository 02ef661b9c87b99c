"""O1, one-shot Fashion-MNIST (DENSE, NeurIPS 2022, arXiv 2112.12371; FuseFL, NeurIPS 2024, arXiv 2410.20380,
Table 2): 5 clients, Dirichlet α, one round, every row computed from the same trained clients.

Clients: NIID-Bench's Dirichlet split (``fmnist_splits``, 5 clients, the public pool held out), each an
independently initialised LeNet-5 trained on 90 % of its data (10 % held out: its own validation split, which
the head round's choice reads) with SGD lr 0.01, momentum 0.9, weight decay 1e-5, batch 64, ``--epochs`` epochs.
The published rows used ResNet-18 and 200 local epochs; this is a LeNet-size model at ≤ 50.

Rows: each client, best and mean client, the clients' ensemble (mean softmax weighted by samples), and every
aggregation in ``--methods`` (``fedfuse.fusion.fuse``; ``average`` is one-shot FedAvg, ``feddf`` FedDF, ``kd``
the ensemble distilled into client 0's model), each **without** the head round (one exchange) and **with** it
(a second exchange: the clients send ridge statistics of their data on the fused model's frozen features, the
server solves a ridge and an LDA head; the one the clients score best on their validation splits is kept unless
it scores below the fused model's own head, as ``head-solver='best'`` does). The fusion set is ``--fusion-size``
images of the held-out public pool (disjoint from every client; ``average`` and the head round read none).
``init`` is an untrained LeNet given the same head round: what the closed-form head alone reaches on random features.
The published peers that merge with statistics of each client's own data (``PEERS``: RegMean, arXiv 2212.09849;
Fisher merging, arXiv 2111.09832) get them from ``fedfuse.fusion.client_statistics`` on each client's training part,
uploaded with its weights (still one exchange; their size is the row's ``traffic``, in model uploads), and their
computation is the clients' (``client-seconds``), not the server's.

    .venv/bin/python -m simulations.bench.fmnist_oneshot --alphas 0.1,0.3,0.5 --seeds 0,1,2 --epochs 20 --out results/fmnist-o1

``--clients strong``: the same rows on clients trained to their best (``fmnist_strong``: inputs normalised, lr,
weight decay and epochs tuned on a split no table reports; docs/fashion-mnist.md "O1 (strong clients)"):

    .venv/bin/python -m simulations.bench.fmnist_oneshot --clients strong --alphas 0.1,0.3,0.5 --seeds 0,1,2 --out results/fmnist-o1-strong
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedfuse.data.partition import split_train_val  # noqa: E402
from fedfuse.fusion import client_statistics, fuse_result  # noqa: E402
from fedfuse.models import build_model  # noqa: E402
from fedfuse.progressive import head_statistics, solve_classifier, with_head  # noqa: E402
from fedfuse.references import client_rows  # noqa: E402
from fedfuse.training import predict_logits, train  # noqa: E402
from simulations.bench.fmnist_splits import write_splits  # noqa: E402

SPLITS = Path("results/cache/fmnist-splits")
# fedfuse.references' keys -> this bench's row names
REF_METHODS = {"best-client": "best client", "mean-client": "mean client", "ensemble": "ensemble"}
PUBLIC = 1000
CLIENTS = 5
# FuseFL Table 2 (Fashion-MNIST, 5 clients; its baseline rows are DENSE's Table 1): α 0.1 / 0.3 / 0.5, ResNet-18,
# 200 local epochs, one run each
PUBLISHED = {"one-shot FedAvg": (41.69, 82.96, 83.72), "FedDF": (43.58, 80.67, 84.67), "DENSE": (50.29, 83.96, 85.94),
             "ensemble": (67.71, 87.25, 89.42), "FuseFL K=2": (83.15, 89.94, 89.47), "FuseFL K=4": (83.05, 84.58, 90.50)}


def acc(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean())


def clients_of(folder: Path, seed: int, epochs: int, cache: Path) -> list[dict]:
    """Train (or load) the cell's clients: model, train / val split, seconds of one local epoch."""
    out = []
    for pid in range(CLIENTS):
        with np.load(folder / f"node-{pid}.npz") as z:
            x, y = torch.from_numpy(z["x_train"]), torch.from_numpy(z["y_train"])
        tr, va = split_train_val(np.arange(len(y)), y.numpy(), 0.1, seed)
        tr, va = torch.as_tensor(tr), torch.as_tensor(va)
        model = build_model("lenet", 10, (1, 28, 28), seed=seed * 1000 + pid + 1)
        path = cache / f"{folder.name}-e{epochs}" / f"client{pid}.pt"
        if path.exists():
            rec = torch.load(path, weights_only=False)
            model.load_state_dict(rec["state"])
        else:
            info = train(model, x[tr], y[tr], epochs=epochs, batch_size=64, optimizer="sgd", lr=0.01,
                         weight_decay=1e-5, seed=seed * 1000 + pid)
            rec = {"state": model.state_dict(), "seconds": info["train-seconds"]}
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(rec, path)
        model.eval()
        out.append({"model": model, "x": x[tr], "y": y[tr], "vx": x[va], "vy": y[va],
                    "epoch-seconds": rec["seconds"] / epochs, "n": len(tr)})
    return out


# issue 59 item 2: row name -> (fusion method, options, where the statistics come from: "clients" = each client's
# training part, "public" = the fusion set through each model, the public-data variant). "-align": every client
# permuted onto client 0 first (Git Re-Basin activation matching on the fusion set), its statistics moved with it;
# "-alignw": weight matching (no data at the server). Fisher: the exact Fisher on FISHER_SAMPLES images of each
# client's training part (a seeded draw), for cost.
PEERS = {"regmean": ("regmean", {}, "clients"), "regmean-align": ("regmean", {"align": "activations"}, "clients"),
         "regmean-alignw": ("regmean", {"align": "weights"}, "clients"),
         "regmean-public": ("regmean", {}, "public"),
         "fisher": ("fisher", {}, "clients"), "fisher-align": ("fisher", {"align": "activations"}, "clients")}
FISHER_SAMPLES = 2000


def peer_inputs(method: str, clients: list[dict], seed: int, cache: dict) -> dict | None:
    """A peer row's fusion method, options and client statistics (each client's, on its own training part; computed
    once per cell and statistic, timed as the clients' work), or ``None`` for any other row."""
    if method not in PEERS:
        return None
    name, options, source = PEERS[method]
    row = {"statistics": source, "traffic": 1.0, "client-seconds": 0.0}
    if source == "public":
        return {"method": name, "options": options, "statistics": None, "row": row}
    if name not in cache:
        stats, secs = [], []
        for c in clients:
            t0 = time.perf_counter()
            if name == "fisher":
                pick = torch.randperm(len(c["x"]), generator=torch.Generator().manual_seed(seed))[:FISHER_SAMPLES]
                stats.append(client_statistics(name, c["model"], c["x"][pick], c["y"][pick]))
            else:
                stats.append(client_statistics(name, c["model"], c["x"]))
            secs.append(time.perf_counter() - t0)
        size = sum(p.numel() for p in clients[0]["model"].parameters())
        cache[name] = (stats, float(np.mean(secs)), 1.0 + sum(v.numel() for v in stats[0].values()) / size)
    stats, secs, traffic = cache[name]
    row.update({"traffic": traffic, "client-seconds": secs})
    return {"method": name, "options": options, "statistics": stats, "row": row}


def head_round(model, clients, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict]:
    """The head round as ``head-solver='best'``: ridge and LDA heads from the clients' statistics, the one the clients
    score best on their validation splits kept unless below the model's own head (statistics and scores on
    ``device``)."""
    t0 = time.perf_counter()
    stats = [head_statistics(model, c["x"], c["y"], 10, device=device) for c in clients]

    def val_acc(m):
        return sum(acc(predict_logits(m, c["vx"], device=device), c["vy"]) * len(c["vy"]) for c in clients) / \
            sum(len(c["vy"]) for c in clients)

    scored = {"before": (val_acc(model), model)}
    for solver in ("ridge", "lda"):
        m = with_head(copy.deepcopy(model), solve_classifier(stats, solver))
        scored[solver] = (val_acc(m), m)
    pick = max(("ridge", "lda"), key=lambda s: scored[s][0])
    keep = pick if scored[pick][0] >= scored["before"][0] else "before"
    return scored[keep][1], {"solver": keep, "seconds": time.perf_counter() - t0,
                             "client-val": {k: v[0] for k, v in scored.items()}}


def run_cell(folder: Path, seed: int, epochs: int, methods: list[str], fusion_size: int, cache: Path,
             references: bool = True, strong: bool = False) -> list[dict]:
    """The cell's rows. ``strong``: the clients trained to their best (``fmnist_strong``: normalised inputs, the
    tuned recipe; cached there) instead of O1's ``epochs``-epoch clients; test and fusion inputs normalised alike."""
    if strong:
        from simulations.bench.fmnist_strong import RECIPE, recipe_tag, test_data, train_clients

        clients = train_clients(folder, seed)
        tx, ty, fx = test_data(folder, RECIPE["normalise"], fusion_size)
        epochs = RECIPE["epochs"]
    else:
        clients = clients_of(folder, seed, epochs, cache)
        with np.load(folder / "test.npz") as z:
            tx, ty = torch.from_numpy(z["x"]), torch.from_numpy(z["y"])
        with np.load(SPLITS / f"fmnist-public{PUBLIC}.npz") as z:
            fx = torch.from_numpy(z["x"][:fusion_size])
    meta = json.loads((folder / "split.json").read_text())
    base = {"part": meta["part"], "seed": seed, "epochs": epochs, "fusion-size": fusion_size,
            "epoch-seconds": float(np.mean([c["epoch-seconds"] for c in clients]))}
    if strong:
        base.update({"clients": recipe_tag(RECIPE), "best-epochs": [c["best-epoch"] for c in clients]})
    models, n = [c["model"] for c in clients], [c["n"] for c in clients]
    rows = []
    if references:   # the one-shot references fedfuse's runs print: each client, best, mean, weighted ensemble
        accs, refs = client_rows([predict_logits(m, tx) for m in models], range(len(models)), n, ty)
        rows = [{**base, "method": f"client-{p}", "accuracy": a} for p, a in accs.items()]
        rows += [{**base, "method": REF_METHODS[r["key"]], "accuracy": r["accuracy"]} for r in refs
                 if r["key"] in REF_METHODS]
    stats_cache: dict = {}
    for method in methods:
        peer = peer_inputs(method, clients, seed, stats_cache)   # the clients' part, before the server's clock starts
        t0 = time.perf_counter()
        try:
            if method == "init":   # no training at all: a fresh LeNet, so the head round's own share is visible
                res = type("R", (), {"model": build_model("lenet", 10, (1, 28, 28), seed=seed * 1000 + 999).eval()})
            elif peer is not None:
                res = fuse_result(peer["method"], models, fusion_inputs=fx, weights=n, seed=seed,
                                  statistics=peer["statistics"], **peer["options"])
            else:
                res = fuse_result(method, models, fusion_inputs=fx, weights=n, seed=seed)
        except ValueError as exc:
            rows.append({**base, "method": method, "accuracy": float("nan"), "status": f"n/a: {exc}"})
            continue
        secs = time.perf_counter() - t0
        fused = res.model
        a0 = acc(predict_logits(fused, tx), ty)
        headed, info = head_round(fused, clients)
        a1 = acc(predict_logits(headed, tx), ty)
        rows.append({**base, "method": method, "accuracy": a0, "with-head": a1, "head": info, "fuse-seconds": secs,
                     "fuse-per-epoch": secs / base["epoch-seconds"], **(peer["row"] if peer else {})})
        print(f"  {folder.name} {method:<12} {a0:.4f} -> head {a1:.4f} ({info['solver']})  {secs:.1f}s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--methods", default="average,kd,feddf,kf-linear,ot,rebasin,auto")
    ap.add_argument("--fusion-size", type=int, default=PUBLIC)
    ap.add_argument("--no-references", action="store_true", help="leave out the client / ensemble rows (a second pass)")
    ap.add_argument("--clients", choices=("o1", "strong"), default="o1",
                    help="o1: --epochs of O1's recipe; strong: fmnist_strong's tuned recipe (its own cache)")
    ap.add_argument("--cache", default="results/cache/fmnist-oneshot")
    ap.add_argument("--out", default="results/fmnist-o1")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    parts = [f"dir{float(x):g}" for x in a.alphas.split(",")]
    for folder in write_splits(SPLITS, parts, CLIENTS, seeds, PUBLIC):
        seed = json.loads((folder / "split.json").read_text())["seed"]
        rows = run_cell(folder, seed, a.epochs, a.methods.split(","), a.fusion_size, Path(a.cache),
                        references=not a.no_references, strong=a.clients == "strong")
        with open(out / "rows.jsonl", "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
