"""Issue 59 item 4: the one-shot rows on a second model, a torchvision ResNet-18, so that the LeNet finding is not
LeNet's alone.

The O1 cell of ``fmnist_strong`` (Fashion-MNIST, NIID-Bench's Dirichlet split into 5 clients, the 1,000-image public
pool held out, every client's own 10 % validation split, inputs normalised by the dataset's mean / std), with each
client a ``torchvision.models.resnet18(num_classes=10)`` as a user would adapt it to 28 × 28 grey images (``net``: a
3 × 3 stride-1 one-channel stem, no max-pool; 11.2 M parameters, the published FuseFL rows' model). fedfuse reads it
through its own graph (the ``torchvision-resnet`` adapter); nothing in fedfuse was written for it.

Client recipe: SGD, momentum 0.9, weight decay 5e-4, batch 128, cosine schedule over ``EPOCHS`` (10) epochs, bf16
autocast on CUDA; the lr (``LRS``) chosen on the tuning split that no table reports (α 0.3, seed 100) by the clients'
ensemble test accuracy, as ``fmnist_strong`` chose LeNet's. Rows per cell, each without and with the head round (the
clients' ridge / LDA statistics on the fused model's frozen features, ``fmnist_oneshot.head_round``'s rule): one-shot
FedAvg (``average``), KD, FedDF, OT fusion (``ot``), ``kf-linear``, and ``kf-linear`` distilled from the ensemble as
the app's one-shot default does (``fedfuse.plan.ONE_SHOT_DISTILL``), plus the clients, their ensemble and (time
allowing) the pooled model with the same recipe. Every fusion runs through ``fedfuse.fusion.fuse_result`` on
``--device``. Cells run seed by seed and the rows are written after each cell, so a run stopped by its time budget
(``--budget-s``: no cell is started that the slowest cell so far would not finish in time) keeps whole cells.

Run on a GPU (one H200: ``scripts/gpu_item4.sh``), then the table here::

    python3 -m simulations.bench.fmnist_resnet run --device cuda --out OUT
    .venv/bin/python -m simulations.bench.fmnist_resnet table --runs OUT/cells.json --out results/fmnist-resnet18
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from simulations.bench.fmnist_oneshot import acc, head_round
from simulations.bench.fmnist_strong import ensemble_acc

ALPHAS = (0.1, 0.3, 0.5)
SEEDS = (0, 1, 2)
TUNING = ("dir0.3", 100)
LRS = (0.05, 0.1)
EPOCHS, BATCH, WD = 10, 128, 5e-4
FUSION_SIZE = 1000
METHODS = ("average", "kd", "feddf", "ot", "kf-linear", "kf-linear+distill")
ROWS = {"average": "one-shot FedAvg (weighted average)", "kd": "KD (ensemble into client 0's model)",
        "feddf": "FedDF (ensemble into the average)", "ot": "OT fusion (`ot`)", "kf-linear": "`kf-linear`",
        "kf-linear+distill": "`kf-linear` + ensemble distillation (LeNet-5's one-shot default)"}


def net(seed: int) -> nn.Module:
    """torchvision's ResNet-18 for 28 × 28 grey images: a 3 × 3 stride-1 one-channel stem and no max-pool."""
    import torchvision

    torch.manual_seed(seed)
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(1, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def fit(model: nn.Module, x, y, *, lr: float, epochs: int, seed: int, device: torch.device) -> float:
    """The client recipe, in place; returns the training seconds."""
    model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=WD, nesterov=True)
    steps = epochs * math.ceil(len(x) / BATCH)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    xd, yd = x.to(device), y.to(device)
    t0 = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen).to(device)
        for s in range(0, len(x), BATCH):
            idx = perm[s:s + BATCH]
            if len(idx) < 2:   # BatchNorm needs two samples
                continue
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = F.cross_entropy(model(xd[idx]), yd[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    model.eval()
    return time.perf_counter() - t0


def logits_of(model: nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    from fedfuse.training import predict_logits

    return predict_logits(model, x, batch_size=1000, device=device)


SMOKE = {"max-samples": 0}   # the test's smoke run: clients, test set and validation splits cut to this many


def cell_data(alpha, seed: int):
    from simulations.bench.fmnist_strong import client_data, split_folder, test_data

    folder = split_folder(alpha, seed)
    tx, ty, fx = test_data(folder, True, FUSION_SIZE)
    clients = client_data(folder, seed, True)
    k = SMOKE["max-samples"]
    if k:
        clients = [{**c, "x": c["x"][:k], "y": c["y"][:k], "vx": c["vx"][:k], "vy": c["vy"][:k],
                    "n": min(k, c["n"])} for c in clients]
        tx, ty, fx = tx[:k], ty[:k], fx[:k]
    return clients, tx, ty, fx


def train_cell(clients: list[dict], seed: int, lr: float, device: torch.device) -> float:
    secs = 0.0
    for pid, c in enumerate(clients):
        c["model"] = net(seed * 1000 + pid + 1)
        secs += fit(c["model"], c["x"], c["y"], lr=lr, epochs=SMOKE.get("epochs", EPOCHS), seed=seed * 1000 + pid, device=device)
        c["model"] = c["model"].cpu().eval()
    return secs / (len(clients) * SMOKE.get("epochs", EPOCHS))


def tune(device: torch.device, log) -> dict:
    clients, tx, ty, _ = cell_data(*TUNING)
    out = {}
    for lr in LRS:
        epoch_s = train_cell(clients, TUNING[1], lr, device)
        lg = [logits_of(c["model"], tx, device) for c in clients]
        out[lr] = {"ensemble": ensemble_acc(lg, [c["n"] for c in clients], ty),
                   "clients": [acc(g, ty) for g in lg], "epoch-seconds": epoch_s}
        log(f"tune lr {lr}: ensemble {out[lr]['ensemble']:.4f} clients {[round(a, 4) for a in out[lr]['clients']]}")
    return out


def run_cell(alpha: float, seed: int, lr: float, device: torch.device, methods, log) -> list[dict]:
    from fedfuse.fusion import fuse_result
    from fedfuse.plan import ONE_SHOT_DISTILL

    t_cell = time.perf_counter()
    clients, tx, ty, fx = cell_data(alpha, seed)
    epoch_s = train_cell(clients, seed, lr, device)
    models, n = [c["model"] for c in clients], [c["n"] for c in clients]
    base = {"alpha": alpha, "seed": seed, "lr": lr, "epochs": EPOCHS, "epoch-seconds": epoch_s,
            "fusion-size": len(fx), "device": str(device)}
    lg = [logits_of(m, tx, device) for m in models]
    accs = [acc(g, ty) for g in lg]
    rows = [{**base, "method": "best client", "accuracy": max(accs)},
            {**base, "method": "mean client", "accuracy": float(np.mean(accs))},
            {**base, "method": "ensemble", "accuracy": ensemble_acc(lg, n, ty)}]
    for method in methods:
        name, extra = (("kf-linear", {"refine": "distill", "refine_options": ONE_SHOT_DISTILL})
                       if method == "kf-linear+distill" else (method, {}))
        t0 = time.perf_counter()
        try:
            res = fuse_result(name, models, fusion_inputs=fx, weights=n, seed=seed, device=device, **extra)
        except ValueError as exc:
            rows.append({**base, "method": method, "accuracy": float("nan"), "status": f"n/a: {exc}"})
            log(f"  {method}: n/a: {exc}")
            continue
        secs = time.perf_counter() - t0
        a0 = acc(logits_of(res.model, tx, device), ty)
        headed, head = head_round(res.model, clients, device)
        a1 = acc(logits_of(headed, tx, device), ty)
        rows.append({**base, "method": method, "accuracy": a0, "with-head": a1, "head-solver": head["solver"],
                     "fuse-seconds": secs, "fuse-per-epoch": secs / epoch_s,
                     **{k: v for k, v in res.info.items() if k.startswith("distill-")}})
        log(f"  {method}: {a0:.4f} / + head {a1:.4f} ({secs:.1f} s)")
    log(f"cell α {alpha} seed {seed}: {time.perf_counter() - t_cell:.0f} s, clients {[round(a, 4) for a in accs]}, "
        f"ensemble {rows[2]['accuracy']:.4f}")
    return rows


def pooled(alpha: float, seed: int, lr: float, device: torch.device) -> dict:
    """The pooled model with the clients' recipe on the union of their training parts (the ceiling row)."""
    clients, tx, ty, _ = cell_data(alpha, seed)
    x, y = torch.cat([c["x"] for c in clients]), torch.cat([c["y"] for c in clients])
    m = net(seed * 1000 + 999)
    secs = fit(m, x, y, lr=lr, epochs=EPOCHS, seed=seed * 1000 + 999, device=device)
    return {"alpha": alpha, "seed": seed, "lr": lr, "method": "pooled model", "accuracy": acc(logits_of(m, tx, device), ty),
            "train-seconds": secs}


def run(args) -> None:
    from fedfuse.training import resolve_device

    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "log.txt", "a")
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        line = f"[{time.perf_counter() - t_start:6.0f} s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    doc = {"device": str(device), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
           "torch": torch.__version__, "recipe": {"epochs": EPOCHS, "batch": BATCH, "weight-decay": WD,
                                                  "lrs": list(LRS), "momentum": 0.9, "schedule": "cosine"},
           "tuning": None, "rows": [], "stopped": None, "smoke": SMOKE["max-samples"] or None}

    def save():
        (out / "cells.json").write_text(json.dumps(doc, indent=1))

    lr = args.lr
    if lr is None:
        doc["tuning"] = {str(k): v for k, v in tune(device, log).items()}
        lr = max(LRS, key=lambda v: (doc["tuning"][str(v)]["ensemble"], -v))
        log(f"tuning: lr {lr}")
    doc["lr"] = lr
    save()
    slowest = 0.0
    methods = [m for m in args.methods.split(",") if m]
    cells = ([(float(c.split(":")[0]), int(c.split(":")[1])) for c in args.cells.split(",")] if args.cells else
             [(float(a), int(s)) for s in args.seeds.split(",") for a in args.alphas.split(",")])
    for alpha, seed in cells:
        left = args.budget_s - (time.perf_counter() - t_start)
        if slowest and left < slowest * 1.1:
            doc["stopped"] = f"budget: {left:.0f} s left, a cell took up to {slowest:.0f} s; not run: α {alpha} seed {seed} on"
            log(doc["stopped"])
            break
        t0 = time.perf_counter()
        doc["rows"] += run_cell(alpha, seed, lr, device, methods, log)
        slowest = max(slowest, time.perf_counter() - t0)
        save()
    if args.pooled and doc["stopped"] is None:
        for alpha in args.alphas.split(","):
            left = args.budget_s - (time.perf_counter() - t_start)
            if left < slowest * 0.6:
                break
            doc["rows"].append(pooled(float(alpha), 0, lr, device))
            log(f"pooled α {alpha} seed 0: {doc['rows'][-1]['accuracy']:.4f}")
            save()
    save()


def from_log(text: str, lr: float) -> list[dict]:
    """The rows of the cells a run's log finished (``run``'s printed lines), for a run whose ``cells.json`` did not
    come back: per method the accuracy without / with the head round and the fusion seconds, the clients and their
    ensemble. Marked ``"from-log": True`` (no head solver, no seconds per local epoch)."""
    import re

    rows, pending = [], []
    for line in text.splitlines():
        m = re.search(r"\]   (\S+): ([0-9.]+) / \+ head ([0-9.]+) \(([0-9.]+) s\)", line)
        if m:
            pending.append({"method": m[1], "accuracy": float(m[2]), "with-head": float(m[3]),
                            "fuse-seconds": float(m[4])})
            continue
        m = re.search(r"cell α ([0-9.]+) seed (\d+): \d+ s, clients \[([^\]]*)\], ensemble ([0-9.]+)", line)
        if m:
            base = {"alpha": float(m[1]), "seed": int(m[2]), "lr": lr, "epochs": EPOCHS, "from-log": True}
            accs = [float(v) for v in m[3].split(",")]
            rows += [{**base, "method": "best client", "accuracy": max(accs)},
                     {**base, "method": "mean client", "accuracy": float(np.mean(accs))},
                     {**base, "method": "ensemble", "accuracy": float(m[4])}]
            rows += [{**base, **r} for r in pending]
            pending = []
    return rows


def table(args) -> None:
    from simulations.bench.stats import paired, pct

    docs = [json.loads(Path(p).read_text()) for p in args.runs.split(",") if p]
    doc = next((d for d in docs if d.get("tuning")), docs[0])
    rows = [r for d in docs for r in d["rows"]]
    if args.logs:
        rows += [r for p in args.logs.split(",") for r in from_log(Path(p).read_text(), doc["lr"])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    alphas = sorted({r["alpha"] for r in rows})

    def vals(method, key="accuracy"):
        return {a: [r[key] for r in sorted(rows, key=lambda r: r["seed"])
                    if r["method"] == method and r["alpha"] == a and key in r] for a in alphas}

    def by_seed(method, key):
        return {a: {r["seed"]: r[key] for r in rows if r["method"] == method and r["alpha"] == a and key in r}
                for a in alphas}

    lines = [f"torchvision ResNet-18 clients (28 × 28 stem), Fashion-MNIST, 5 clients, Dirichlet α; {doc['device']}"
             f" ({doc.get('gpu')}), torch {doc['torch']}; lr {doc['lr']} chosen on the tuning split (α 0.3, seed 100)"
             f" from {doc['recipe']['lrs']}; {doc['recipe']['epochs']} epochs, batch {doc['recipe']['batch']}, cosine.",
             "", "mean ± sample std (ddof=1) over seeds; test accuracy in %", "",
             "| row | exchanges | " + " | ".join(f"α = {a:g}" for a in alphas) + " |",
             "|---|---|" + "---|" * len(alphas)]
    for ref in ("pooled model", "best client", "mean client", "ensemble"):
        if any(r["method"] == ref for r in rows):
            v = vals(ref)
            lines.append(f"| {ref} | {'-' if ref == 'pooled model' else 1} | " + " | ".join(pct(v[a]) for a in alphas) + " |")
    for m in METHODS:
        if not any(r["method"] == m for r in rows):
            continue
        for key, ex in (("accuracy", "1"), ("with-head", "2 (+ head round)")):
            v = vals(m, key)
            lines.append(f"| {ROWS[m]} | {ex} | " + " | ".join(pct(v[a]) for a in alphas) + " |")
    lines += ["", "Paired per seed (same clients): the row minus the reference, points; per-seed values in brackets", "",
              "| row | against | " + " | ".join(f"α = {a:g}" for a in alphas) + " |", "|---|---|" + "---|" * len(alphas)]
    ens = by_seed("ensemble", "accuracy")
    best = by_seed("best client", "accuracy")
    kfh = by_seed("kf-linear", "with-head")
    fdh = by_seed("feddf", "with-head")
    for m, key, ref, refname in (("kf-linear+distill", "with-head", ens, "ensemble"),
                                 ("kf-linear+distill", "with-head", best, "best client"),
                                 ("kf-linear+distill", "with-head", kfh, "`kf-linear` + head round"),
                                 ("kf-linear+distill", "with-head", fdh, "FedDF + head round"),
                                 ("kf-linear", "with-head", ens, "ensemble"),
                                 ("feddf", "with-head", ens, "ensemble")):
        mine = by_seed(m, key)
        lines.append(f"| {ROWS[m]} (+ head round) | {refname} | " +
                     " | ".join(paired([mine[a][k] - ref[a][k] for k in sorted(mine[a]) if k in ref[a]])
                                for a in alphas) + " |")
    secs = [r for r in rows if "fuse-seconds" in r]
    if secs:
        lines += ["", "Server seconds of each fusion ÷ one local epoch of one client (same device, same run), median "
                  "over cells:", "", "| row | fuse seconds | ÷ one local epoch |", "|---|---|---|"]
        for m in METHODS:
            s = [r for r in secs if r["method"] == m]
            if s:
                per = [r["fuse-per-epoch"] for r in s if "fuse-per-epoch" in r]
                lines.append(f"| {ROWS[m]} | {np.median([r['fuse-seconds'] for r in s]):.1f} | "
                             f"{np.median(per):.1f} |")
    stops = [d["stopped"] for d in docs if d.get("stopped")]
    if stops:
        lines += ["", "Runs stopped by their time budget: " + "; ".join(stops) + "."]
    if any(r.get("from-log") for r in rows):
        cells = sorted({(r["alpha"], r["seed"]) for r in rows if r.get("from-log")})
        lines += ["", f"Cells read from a run's log (its cells.json did not come back): {cells}."]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "cells.json").write_text(json.dumps({**doc, "rows": rows, "stopped": stops}, separators=(",", ":")))
    print("\n".join(lines))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--alphas", default=",".join(str(a) for a in ALPHAS))
    ap.add_argument("--seeds", default=",".join(str(s) for s in SEEDS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--cells", default="", help="alpha:seed pairs (instead of --alphas x --seeds), e.g. 0.5:1,0.1:2")
    ap.add_argument("--lr", type=float, default=None, help="skip the tuning and use this lr")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--pooled", action="store_true")
    ap.add_argument("--runs", default="", help="table: the runs' cells.json files, comma-separated")
    ap.add_argument("--logs", default="", help="table: logs of runs whose cells.json did not come back")
    ap.add_argument("--smoke", type=int, default=0, help="tests only: this many samples per client, 1 epoch")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.smoke:
        SMOKE.update({"max-samples": args.smoke, "epochs": 1})
    run(args) if args.what == "run" else table(args)


if __name__ == "__main__":
    main()
