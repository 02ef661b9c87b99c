"""Stacking on O1's strong clients (issue 59): the five clients' feature extractors kept side by side, one classifier
over their concatenated features solved by the head round — the kind of model FuseFL + head round and FENS end with
(five LeNets' parameters), built in two exchanges — and, to keep a single LeNet, that model as the teacher of the
one-shot default's distillation.

On the cached strong clients and cells of ``fmnist_strong`` (retrained here when absent: so every row of a cell is
recomputed on the same clients in one process, the references too). Rows per cell (test accuracy; "with-head": after
the head round, ``fmnist_oneshot.head_round``: ridge or LDA, the clients' validation choosing):

- ``ensemble``, ``best-client``; ``kf-linear`` (+ head round);
- ``default``: the one-shot default for LeNet-5, ``kf-linear`` distilled from the clients' ensemble on the server
  (``fedfuse.plan.ONE_SHOT_DISTILL``: τ 4, mixup, ≤ 200 epochs, patience 20, lr 1e-3) (+ head round);
- ``stack``: ``fuse('stack')`` (pre-logit features; its head fitted to the ensemble on the fusion set) alone and +
  head round (2 exchanges; 5 × LeNet); ``stack-logits``: the same over the clients' logits (FENS's aggregator inputs,
  a linear aggregator solved in closed form);
- ``stack-distilled``: ``kf-linear`` distilled on the server from ``stack`` + head round (the teacher's scale matched
  to the ensemble's confidence on the fusion set, ``fit_temperature``) with the default's settings: alone after 2
  exchanges (the upload, the stack's head round), + head round after 3 — a single LeNet.

The settings: ``stack``'s (head ``fit``, ridge 1e-2; pre-logits against logits) were looked at on the recipe's tuning
split (α 0.3, seed 100: no table reports it; ``tune``); the distillation's are the default's, chosen on α 0.3 seed 0
(``fmnist_refine``). Seconds: the server's fusion and each head round ÷ one local epoch of one client, timed in the
same process (the cores were shared by other jobs: rough).

    .venv/bin/python -m simulations.bench.fmnist_stack tune --out results/fmnist-o1-strong/stack/tuning
    .venv/bin/python -m simulations.bench.fmnist_stack run --alphas 0.1,0.3,0.5 --seeds 0,1,2 --out results/fmnist-o1-strong/stack
    .venv/bin/python -m simulations.bench.fmnist_stack table --out results/fmnist-o1-strong/stack

The peers that keep every client's feature extractor, rerun beside it on this machine (FENS on the same cached
clients; FuseFL K = 2, which trains its own columns), and ``stack`` + head round paired with them (``peers.md``)::

    mkdir -p results/fmnist-o1-strong/stack/fens/tuning
    cp results/fmnist-o1-strong/fens/tuning/choice.json results/fmnist-o1-strong/stack/fens/tuning/
    .venv/bin/python -m simulations.bench.fmnist_fens run --out results/fmnist-o1-strong/stack/fens
    .venv/bin/python -m simulations.bench.fmnist_fusefl run --k 2 --out results/fmnist-o1-strong/stack/fusefl
    .venv/bin/python -m simulations.bench.fmnist_stack peers --out results/fmnist-o1-strong/stack
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

from fedfuse.fusion import fuse_result  # noqa: E402
from fedfuse.plan import ONE_SHOT_DISTILL  # noqa: E402
from fedfuse.progressive import fit_temperature  # noqa: E402
from fedfuse.training import predict_logits  # noqa: E402
from simulations.bench.fmnist_strong import acc  # noqa: E402
from simulations.bench.stats import paired, pct  # noqa: E402

DISTILL = {"lr": 1e-3, "aug": ONE_SHOT_DISTILL["augmentation"], **{k: ONE_SHOT_DISTILL[k] for k in
                                                                     ("temperature", "epochs", "patience")}}
TUNING = ("dir0.3", 100)
# (row, exchanges alone, exchanges with the head round, size × LeNet-5)
ROWS = [("best-client", "1", None, "1"), ("ensemble", "1", None, "5"), ("kf-linear", "1", "2", "1"),
        ("default", "1", "2", "1"), ("stack", "1", "2", "5.09"), ("stack-logits", "1", "2", "5.01"),
        ("stack-distilled", "2", "3", "1")]
NAMES = {"best-client": "best client", "ensemble": "clients' ensemble", "kf-linear": "`kf-linear`",
         "default": "one LeNet: `kf-linear` distilled from the ensemble (the single-model default)",
         "stack": "`stack` (pre-logit features, head fitted on the fusion set)",
         "stack-logits": "`stack`, `features='logits'`",
         "stack-distilled": "`kf-linear` distilled from `stack` + head round"}


def run_cell(alpha: float | str, seed: int, features: tuple[str, ...] = ("pre-logits", "logits")) -> list[dict]:
    from simulations.bench.fmnist_fusefl import one_epoch_seconds
    from simulations.bench.fmnist_oneshot import head_round
    from simulations.bench.fmnist_refine import distill_whole
    from simulations.bench.fmnist_strong import RECIPE, ensemble_acc, strong_clients, strong_data

    clients = strong_clients(alpha, seed)
    tx, ty, fx = strong_data(alpha, seed)
    models, n = [c["model"] for c in clients], [c["n"] for c in clients]
    w = [k / sum(n) for k in n]
    epoch = one_epoch_seconds(clients[0], seed, RECIPE)
    part = alpha if isinstance(alpha, str) else f"dir{alpha:g}"
    base = {"part": part, "seed": seed}
    rows = [{**base, "method": "ensemble", "accuracy": round(ensemble_acc([predict_logits(m, tx) for m in models], n,
                                                                           ty), 4)},
            {**base, "method": "best-client", "accuracy": max(acc(predict_logits(m, tx), ty) for m in models)}]

    def row(method: str, model, seconds: float, **extra) -> dict:
        t0 = time.perf_counter()
        headed, hinfo = head_round(model, clients)
        r = {**base, "method": method, "accuracy": acc(predict_logits(model, tx), ty),
             "with-head": acc(predict_logits(headed, tx), ty), "solver": hinfo["solver"],
             "server-epochs": round(seconds / epoch, 3), "head-epochs": round((time.perf_counter() - t0) / epoch, 3),
             **extra}
        rows.append(r)
        print(f"  {part} s{seed} {method:<16} {r['accuracy']:.4f} -> head {r['with-head']:.4f} ({r['solver']})",
              flush=True)
        return headed

    t0 = time.perf_counter()
    fused = fuse_result("kf-linear", models, fusion_inputs=fx, weights=n, seed=seed).model
    kf_seconds = time.perf_counter() - t0
    if "pre-logits" in features and "logits" in features:
        row("kf-linear", fused, kf_seconds)

    def distilled(teachers, weights, name: str, seconds: float, **extra):
        student = copy.deepcopy(fused)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        d = distill_whole(student, teachers, weights, fx, DISTILL, seed)
        return row(name, student, seconds + time.perf_counter() - t0, distill=[d["epochs-run"], d["best-epoch"]],
                   **extra)

    if "pre-logits" in features and "logits" in features:
        distilled(models, w, "default", kf_seconds)
    teacher = None
    for kind in features:
        t0 = time.perf_counter()
        res = fuse_result("stack", models, fusion_inputs=fx, weights=n, seed=seed, features=kind)
        name = "stack" if kind == "pre-logits" else "stack-logits"
        headed = row(name, res.model, time.perf_counter() - t0, parameters=res.info["parameters"])
        if kind == "pre-logits":
            teacher = headed
    if teacher is not None and "logits" in features:
        ens = sum(wi * predict_logits(m, fx).softmax(1) for wi, m in zip(w, models))
        tau = fit_temperature(teacher, fx, ens)
        distilled([teacher], [1.0], "stack-distilled", kf_seconds, teacher_scale=tau)
    return rows


def rows_of(out: Path) -> list[dict]:
    path = out / "rows.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return list({(r["part"], r["seed"], r["method"]): r for r in rows}.values())


def table(rows: list[dict]) -> str:
    parts = sorted({r["part"] for r in rows}, key=lambda p: float(p[3:]))
    cell = {(r["part"], r["seed"], r["method"]): r for r in rows}
    head = " | ".join(f"α = {p[3:]}" for p in parts)
    lines = ["mean ± sample std (ddof=1) over seeds; test accuracy in %; size: parameters ÷ LeNet-5's; seconds: ÷ one "
             "local epoch of one client timed in the same process (the server's fusion; the head round whole: the "
             "clients' statistics, their validation scores and the solves), medians over the cells", "",
             f"| row | exchanges | size | server s ÷ epoch | {head} |", "|---|---|---|---|" + "---|" * len(parts)]
    for m, ex1, ex2, size in ROWS:
        for key, ex in (("accuracy", ex1), ("with-head", ex2)):
            if ex is None:
                continue
            got = [r for (p, _, mm), r in cell.items() if mm == m and key in r]
            if not got:
                continue
            secs = sorted(r["server-epochs"] + (r["head-epochs"] if key == "with-head" else 0.0) for r in got
                          if "server-epochs" in r)
            cells = [pct([r[key] for (p, _, mm), r in cell.items() if p == part and mm == m and key in r])
                     for part in parts]
            label = NAMES[m] + (" + head round" if key == "with-head" else "")
            sec = f"{secs[len(secs) // 2]:.1f}" if secs else ""
            lines.append(f"| {label} | {ex} | {size} | {sec} | " + " | ".join(cells) + " |")
    lines += ["", "Paired per seed (same clients): the row minus the reference, points; per-seed values in brackets "
              "(seeds in order)", "", f"| row | against | {head} |", "|---|---|" + "---|" * len(parts)]
    pairs = [("stack", "with-head", "ensemble", "accuracy"), ("stack", "with-head", "default", "with-head"),
             ("stack-logits", "with-head", "stack", "with-head"), ("stack", "accuracy", "ensemble", "accuracy"),
             ("stack-distilled", "accuracy", "default", "with-head"),
             ("stack-distilled", "with-head", "default", "with-head"),
             ("stack-distilled", "with-head", "ensemble", "accuracy"), ("default", "with-head", "ensemble", "accuracy")]
    for m, key, ref, rkey in pairs:
        cells = []
        for part in parts:
            d = [r[key] - cell[(part, s, ref)][rkey] for (p, s, mm), r in sorted(cell.items())
                 if p == part and mm == m and key in r and (part, s, ref) in cell]
            cells.append(paired(d))
        lines.append(f"| {NAMES[m]}{' + head round' if key == 'with-head' else ''} | {NAMES[ref]}"
                     f"{' + head round' if rkey == 'with-head' else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_seed(out: Path, rows: list[dict]) -> None:
    cells = defaultdict(list)
    for r in rows:
        cells[f"fmnist-{r['part']}-n5-s{r['seed']}"].append(r)
    for name, cell in cells.items():
        own = [{k: v for k, v in r.items() if k not in ("part", "seed")} for r in cell]
        (out / f"{name}.json").write_text(json.dumps({"cell": name, "part": cell[0]["part"], "seed": cell[0]["seed"],
                                                      "rows": own}, separators=(",", ":")))


#: the peers rerun beside ``stack`` on this machine (``peers``): (folder under --out, method, accuracy key, label)
PEERS = (("fens", "fens", "accuracy", "FENS (R = 500; 501 exchanges, 5.01 × LeNet)"),
         ("fusefl", "fusefl-k2", "with-head", "FuseFL K = 2 + head round (3 exchanges, 5.07 × LeNet)"))


def peers_table(out: Path) -> str:
    """``stack`` + head round paired per cell-seed with the peers that keep every client's feature extractor, rerun
    beside it (``out/fens``: FENS on the same cached clients, so the same ensemble; ``out/fusefl``: FuseFL, which
    trains its own columns on the same cells' data from client 0's initialisation), from their per-seed JSON."""
    def cells(folder: Path) -> dict:
        return {(d["part"], d["seed"]): {r["method"]: r for r in d["rows"]}
                for d in (json.loads(p.read_text()) for p in sorted(folder.glob("fmnist-dir*-n5-s*.json")))}

    mine = cells(out)
    parts = sorted({p for p, _ in mine}, key=lambda p: float(p[3:]))
    head = " | ".join(f"α = {p[3:]}" for p in parts)
    lines = ["`stack` + head round (2 exchanges, 5.09 × LeNet) against the peers rerun beside it, test accuracy in %, "
             "mean ± sample std; paired per cell-seed: `stack` + head round minus the peer, points (per-seed values in "
             "brackets, seeds in order)", "", f"| row | {head} |", "|---|" + "---|" * len(parts)]
    lines.append("| `stack` + head round | " + " | ".join(
        pct([c["stack"]["with-head"] for (p, _), c in sorted(mine.items()) if p == part]) for part in parts) + " |")
    diffs = []
    for folder, method, key, label in PEERS:
        theirs = cells(out / folder)
        if not theirs:
            continue
        lines.append(f"| {label} | " + " | ".join(
            pct([c[method][key] for (p, _), c in sorted(theirs.items()) if p == part and method in c])
            for part in parts) + " |")
        same = all(abs(theirs[k]["ensemble"]["accuracy"] - mine[k]["ensemble"]["accuracy"]) < 1e-9
                   for k in theirs if k in mine and "ensemble" in theirs[k])
        diffs.append(f"| − {label} (same clients' ensemble: {same}) | " + " | ".join(
            paired([mine[k]["stack"]["with-head"] - theirs[k][method][key] for k in sorted(mine)
                    if k[0] == part and k in theirs and method in theirs[k]]) for part in parts) + " |")
    return "\n".join(lines + ["", f"| `stack` + head round minus | {head} |", "|---|" + "---|" * len(parts)] + diffs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("tune", "run", "table", "peers"))
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="results/fmnist-o1-strong/stack")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "peers":
        text = peers_table(out)
        (out / "peers.md").write_text(text + "\n")
        print(text)
        return
    command = " ".join(["python -m simulations.bench.fmnist_stack"] + (argv if argv is not None else sys.argv[1:]))
    cells = ([TUNING] if a.what == "tune" else
             [(float(x), int(s)) for x in a.alphas.split(",") for s in a.seeds.split(",")] if a.what == "run" else [])
    for alpha, seed in cells:
        with open(out / "rows.jsonl", "a") as f:
            for r in run_cell(alpha, seed):
                f.write(json.dumps({**r, "command": command}) + "\n")
    rows = rows_of(out)
    raw = (out / "rows.jsonl").read_text().splitlines() if (out / "rows.jsonl").exists() else []
    commands = [c for c in dict.fromkeys(json.loads(x).get("command") for x in raw if x.strip()) if c]
    text = table(rows) + "\n\nThe commands, in the order run:\n\n```bash\n" + "\n".join(commands) + "\n```"
    (out / "table.md").write_text(text + "\n")
    per_seed(out, rows)
    print(text)


if __name__ == "__main__":
    main()
