"""Past the linear-probe ceiling with one more exchange (issue 59 item 3): on O1's strong clients (``fmnist_strong``:
the cached clients, the 1,000-image fusion set), the fused ``kf-linear`` model sent back to the clients for **one
round of whole-network training**, the answers averaged (they share the fused start, so the average is aligned), then
the head round: three exchanges (the clients' models up; the fused model down and trained back up; the head round).

The second exchange's local loss (``local_round``), per client on its own training part, from the fused model:

- ``plain``: cross-entropy (FedAvg's local step; Flower's one FedAvg round from the fused model);
- ``kd``: ``β τ² KL(ensemble_τ ‖ student_τ) + (1 − β) CE``, the teacher the clients' sample-weighted ensemble
  (the same softmax as the ensemble row) read on the client's own images: each client distils the ensemble on its
  own data, the knowledge of the classes it lacks coming from the other clients' models (the downlink carries the K
  client models as well as the fused one: K + 1 model downloads, one upload per client).

SGD (momentum 0.9, weight decay 1e-5, batch 64) as the clients' recipe. Settings (``SETTINGS``) chosen on the recipe's
tuning split, α 0.3, split seed 100 (no table reports it), by the test accuracy after the head round: ``--tune``
runs the grid there. Rows per cell beside the reference rows (ensemble, best client, ``kf-linear`` ± head round):

- ``kf-linear → round 2 (<setting>)`` ± head round (2 / 3 exchanges);
- like for like, **FedAvg with the same number of exchanges**: the five clients from one common initialisation,
  two FedAvg rounds of 10 local epochs each with the clients' recipe (the one-shot clients' 20 epochs over the two
  rounds), ± head round (2 / 3 exchanges).

Test labels are read for the reported accuracy only. ``table`` writes ``table.md`` and one compact JSON per cell::

    .venv/bin/python -m simulations.bench.fmnist_round2 run --tune --out results/fmnist-o1-strong/round2/tuning
    .venv/bin/python -m simulations.bench.fmnist_round2 run --settings kd-e10-lr0.01,plain-e1-lr0.01 \
        --out results/fmnist-o1-strong/round2
    .venv/bin/python -m simulations.bench.fmnist_round2 table --out results/fmnist-o1-strong/round2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedfuse.fusion import fuse_result  # noqa: E402
from fedfuse.models import build_model  # noqa: E402
from fedfuse.training import predict_logits  # noqa: E402
from simulations.bench.stats import paired, pct  # noqa: E402

# name -> the second exchange's local training: loss, local epochs, lr, β (the KD weight), τ
SETTINGS: dict[str, dict] = {}
for _e, _lr in ((1, 0.01), (1, 0.002), (2, 0.005), (5, 0.002)):
    SETTINGS[f"plain-e{_e}-lr{_lr:g}"] = {"loss": "plain", "epochs": _e, "lr": _lr, "beta": 0.0, "tau": 1.0}
for _e, _lr, _b, _t in ((2, 0.005, 1.0, 4), (2, 0.005, 0.5, 4), (5, 0.005, 1.0, 4), (5, 0.005, 0.5, 2),
                        (5, 0.01, 0.7, 4), (10, 0.005, 1.0, 4), (10, 0.01, 1.0, 4), (20, 0.005, 1.0, 4),
                        (10, 0.005, 0.8, 4), (10, 0.005, 1.0, 8)):
    SETTINGS[f"kd-e{_e}-lr{_lr:g}" + (f"-b{_b:g}" if _b != 1 else "") + (f"-t{_t}" if _t != 4 else "")] = {
        "loss": "kd", "epochs": _e, "lr": _lr, "beta": _b, "tau": float(_t)}
TUNING = (0.3, 100)
FEDAVG_EPOCHS = 10   # per round, two rounds: the one-shot clients' 20 local epochs


def acc(logits: torch.Tensor, y: torch.Tensor) -> float:
    return round(float((logits.argmax(1) == y).float().mean()), 4)


def local_round(model: torch.nn.Module, x, y, *, epochs: int, lr: float, seed: int, teacher=None, beta: float = 0.0,
                tau: float = 1.0) -> torch.nn.Module:
    """``model`` trained in place on ``(x, y)``: SGD (momentum 0.9, wd 1e-5, batch 64); with ``teacher`` (a function
    of the batch's indices giving the teacher's τ-softmax) the loss is ``β τ² KL + (1 − β) CE``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-5)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(x), generator=gen)
        for s in range(0, len(x), 64):
            idx = perm[s:s + 64]
            out = model(x[idx])
            loss = (1 - beta) * F.cross_entropy(out, y[idx]) if beta < 1 else out.new_zeros(())
            if teacher is not None and beta > 0:
                loss = loss + beta * tau * tau * F.kl_div(F.log_softmax(out / tau, 1), teacher(idx),
                                                          reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    return model


def averaged(start: torch.nn.Module, states: list[dict], w: list[float]) -> torch.nn.Module:
    out = copy.deepcopy(start)
    out.load_state_dict({k: sum(wk * s[k].float() for wk, s in zip(w, states)) for k in states[0]})
    return out.eval()


def second_exchange(start, clients, models, w, cfg: dict, seed: int) -> torch.nn.Module:
    """Every client trains a copy of ``start`` on its data (``cfg``), the server averages the answers."""
    states = []
    for k, c in enumerate(clients):
        teacher = None
        if cfg["loss"] == "kd":   # the ensemble's τ-softmax on this client's images (computed where the data is)
            logits = [predict_logits(m, c["x"]) / cfg["tau"] for m in models]
            probs = sum(wk * lg.softmax(1) for wk, lg in zip(w, logits))
            teacher = probs.__getitem__
        m = local_round(copy.deepcopy(start), c["x"], c["y"], epochs=cfg["epochs"], lr=cfg["lr"],
                        seed=seed * 1000 + k + 7, teacher=teacher, beta=cfg["beta"], tau=cfg["tau"])
        states.append(m.state_dict())
    return averaged(start, states, w)


def fedavg_two_rounds(clients, w, seed: int) -> torch.nn.Module:
    """FedAvg from one common initialisation: two rounds of ``FEDAVG_EPOCHS`` local epochs with the clients' recipe."""
    from simulations.bench.fmnist_strong import RECIPE

    model = build_model("lenet", 10, (1, 28, 28), seed=seed * 1000 + 900).eval()
    for rnd in range(2):
        states = [local_round(copy.deepcopy(model), c["x"], c["y"], epochs=FEDAVG_EPOCHS, lr=RECIPE["lr"],
                              seed=seed * 1000 + 10 * rnd + k).state_dict() for k, c in enumerate(clients)]
        model = averaged(model, states, w)
    return model


def run_cell(alpha: float, seed: int, settings: list[str], fedavg: bool = True) -> list[dict]:
    from simulations.bench.fmnist_oneshot import head_round
    from simulations.bench.fmnist_strong import ensemble_acc, strong_clients, strong_data

    clients = strong_clients(alpha, seed)
    tx, ty, fx = strong_data(alpha, seed)
    models, n = [c["model"] for c in clients], [c["n"] for c in clients]
    w = [k / sum(n) for k in n]
    base = {"part": f"dir{alpha:g}", "seed": seed}
    rows = [{**base, "method": "ensemble", "accuracy": round(ensemble_acc([predict_logits(m, tx) for m in models], n,
                                                                          ty), 4)},
            {**base, "method": "best client", "accuracy": max(acc(predict_logits(m, tx), ty) for m in models)}]
    t0 = time.perf_counter()
    fused = fuse_result("kf-linear", models, fusion_inputs=fx, weights=n, seed=seed).model
    fuse_s = time.perf_counter() - t0
    headed, _ = head_round(fused, clients)
    rows.append({**base, "method": "kf-linear", "accuracy": acc(predict_logits(fused, tx), ty),
                 "with-head": acc(predict_logits(headed, tx), ty), "server-seconds": fuse_s})
    epoch = copy.deepcopy(models[0]).train()   # one local epoch of client 0 in this process: the seconds' unit
    t0 = time.perf_counter()
    local_round(epoch, clients[0]["x"], clients[0]["y"], epochs=1, lr=0.01, seed=0)
    epoch_s = time.perf_counter() - t0
    todo = [(s, lambda s=s: second_exchange(fused, clients, models, w, SETTINGS[s], seed)) for s in settings]
    if fedavg:
        todo.append(("fedavg-2-rounds", lambda: fedavg_two_rounds(clients, w, seed)))
    for name, make in todo:
        t0 = time.perf_counter()
        model = make()
        seconds = time.perf_counter() - t0
        headed, _ = head_round(model, clients)
        method = name if name.startswith("fedavg") else f"kf-linear+round2:{name}"
        rows.append({**base, "method": method, "accuracy": acc(predict_logits(model, tx), ty),
                     "with-head": acc(predict_logits(headed, tx), ty),
                     "client-epochs-per-client-ratio": round(seconds / epoch_s / len(clients), 2)})
        print(f"  dir{alpha:g} s{seed} {method:<36} {rows[-1]['accuracy']:.4f} -> head {rows[-1]['with-head']:.4f}",
              flush=True)
    for r in rows:
        r["epoch-seconds"] = round(epoch_s, 3)
    print(f"  dir{alpha:g} s{seed} ensemble {rows[0]['accuracy']:.4f} best client {rows[1]['accuracy']:.4f} "
          f"kf-linear {rows[2]['accuracy']:.4f} -> head {rows[2]['with-head']:.4f}", flush=True)
    return rows


EXCHANGES = {"ensemble": ("1", None), "best client": ("1", None), "kf-linear": ("1", "2"),
             "fedavg-2-rounds": ("2", "3")}


def table(rows: list[dict]) -> str:
    """Accuracy rows (without / with the head round) and paired differences per seed (ensemble, best client,
    ``kf-linear`` + head round) for every row with the head round."""
    parts = sorted({r["part"] for r in rows}, key=lambda p: float(p[3:]))
    cell = {(r["part"], r["seed"], r["method"]): r for r in rows}
    methods = list(EXCHANGES)[:3] + sorted({r["method"] for r in rows} - set(EXCHANGES)) + ["fedavg-2-rounds"]
    methods = [m for m in methods if any(mm == m for (_, _, mm) in cell)]
    head = " | ".join(f"α = {p[3:]}" for p in parts)
    lines = ["mean ± sample std (ddof=1) over seeds; test accuracy in %", "",
             f"| row | exchanges | {head} |", "|---|---|" + "---|" * len(parts)]
    for m in methods:
        ex = EXCHANGES.get(m, ("2", "3"))
        for key, e in (("accuracy", ex[0]), ("with-head", ex[1])):
            if e is None:
                continue
            cells = [pct([r[key] for (p, _, mm), r in cell.items() if p == part and mm == m and key in r])
                     for part in parts]
            lines.append(f"| {m} | {e}{' (+ head round)' if key == 'with-head' else ''} | " + " | ".join(cells) + " |")
    lines += ["", "Paired per seed (same clients): the row with the head round minus the reference, points; per-seed "
              "values in brackets (seeds in order)", "", f"| row (+ head round) | against | {head} |",
              "|---|---|" + "---|" * len(parts)]
    for m in methods[2:]:
        for ref, rkey in (("ensemble", "accuracy"), ("best client", "accuracy"), ("kf-linear", "with-head")):
            if ref == m:
                continue
            cells = []
            for part in parts:
                vals = [r["with-head"] - cell[(part, s, ref)][rkey] for (p, s, mm), r in sorted(cell.items())
                        if p == part and mm == m and (part, s, ref) in cell]
                cells.append(paired(vals))
            lines.append(f"| {m} | {ref}{' + head round' if ref == 'kf-linear' else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--settings", default="kd-e10-lr0.01", help="names in SETTINGS, comma-separated")
    ap.add_argument("--tune", action="store_true", help="every setting on the tuning split (α 0.3, seed 100)")
    ap.add_argument("--no-fedavg", action="store_true")
    ap.add_argument("--out", default="results/fmnist-o1-strong/round2")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "run":
        settings = list(SETTINGS) if a.tune else a.settings.split(",")
        unknown = [s for s in settings if s not in SETTINGS]
        if unknown:
            raise SystemExit(f"unknown settings {unknown}; known: {list(SETTINGS)}")
        cells = [TUNING] if a.tune else [(float(x), int(s)) for x in a.alphas.split(",") for s in a.seeds.split(",")]
        command = " ".join(["python -m simulations.bench.fmnist_round2"] + (argv if argv is not None else sys.argv[1:]))
        for alpha, seed in cells:
            rows = run_cell(alpha, seed, settings, fedavg=not a.no_fedavg)
            with open(out / "rows.jsonl", "a") as f:
                for r in rows:
                    f.write(json.dumps({**r, "command": command}) + "\n")
    path = out / "rows.jsonl"
    raw = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    rows = list({(r["part"], r["seed"], r["method"]): r for r in raw}.values())
    commands = [c for c in dict.fromkeys(r.get("command") for r in raw) if c]
    text = table(rows) + "\n\nThe commands, in the order run:\n\n```bash\n" + "\n".join(commands) + "\n```"
    (out / "table.md").write_text(text + "\n")
    cells = defaultdict(list)
    for r in rows:
        cells[f"fmnist-{r['part']}-n5-s{r['seed']}"].append({k: v for k, v in r.items() if k not in ("part", "seed",
                                                                                                   "command")})
    for name, cell in cells.items():
        (out / f"{name}.json").write_text(json.dumps({"cell": name, "rows": cell}, separators=(",", ":")))
    print(text)


if __name__ == "__main__":
    main()
