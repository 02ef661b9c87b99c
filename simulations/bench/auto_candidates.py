"""Which candidates should the label-free ``fuse("auto")`` try? Each candidate set's choice against the best fixed
method, one-shot, on the MNIST-1D cells the rule is chosen on and the Fashion-MNIST cells it is checked on.

``fuse("auto")`` without labels keeps the candidate whose top class agrees most often with the clients' ensemble on a
held-out 30 % of the fusion set (``fedfuse.fusion.auto``). Its default candidates leave distillation out (``kd``,
``feddf``): under the old criterion (lowest KL to the ensemble) distillation won whatever its accuracy. On the
Fashion-MNIST one-shot cells (issue 44, O1) distillation is the best one-exchange method and ``auto`` is 5.7–8.7
points below it; on the MNIST-1D cells ``kf-linear`` is the best and distillation 10+ points below. This bench asks
whether top-1 agreement, given distillation as a candidate, picks each cell's better method.

Every row of a cell is computed from the same trained clients:

- each fixed candidate, ``fuse(method)`` on the whole fusion set (the table's fixed rows);
- ``fuse("auto", candidates=S)`` for every set ``S`` of ``--sets`` (``;``-separated, ``|`` between methods;
  ``default`` is ``fedfuse.fusion.auto.DEFAULT_CANDIDATES``, ``old`` the candidates before this bench: average,
  kf-linear, kf-gradient, ot; a trailing ``|no-refit`` returns the choice as fitted on the fit part, ``refit=False``),
  its choice and test accuracy.

Cells: ``mnist1d`` = ``simulations.bench.progressive``'s (the anchors' MLP, 20 epochs of SGD lr 0.05, 300 public
fusion samples; 5 and 10 clients, α 0.1 / 0.3 / 0.5); ``fmnist`` = ``simulations.bench.fmnist_oneshot``'s O1 (5
LeNet-5 clients, 20 epochs, 1,000 public images; α 0.1 / 0.3 / 0.5). Seeds 0–2. ::

    .venv/bin/python -m simulations.bench.auto_candidates --data mnist1d --out results/auto-candidates
    .venv/bin/python -m simulations.bench.auto_candidates --data fmnist --out results/auto-candidates
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedfuse.fusion import fuse_result  # noqa: E402
from fedfuse.fusion.auto import DEFAULT_CANDIDATES  # noqa: E402

FIXED = ("average", "kf-linear", "kf-gradient", "ot", "feddf", "kd")
#: fuse("auto")'s candidates before this bench (no distillation), its choice returned as fitted on the fit part
OLD = ("average", "kf-linear", "kf-gradient", "ot")


def anchors_cell(alpha: float, clients: int, seed: int, dataset: str = "mnist1d", model: str = "mlp"):
    """progressive's one-shot cell (its clients, fusion set and test set, as ``simulations.bench.progressive``
    builds them): the clients' models, the fusion set, the test set, the sample counts."""
    from fedfuse.models import build_model
    from simulations.bench.anchor_lr_screen import SPLITS, train_local
    from simulations.bench.progressive import anchor_mlp, load_cell

    xs, ys, xt, yt, _ = load_cell(alpha, clients, seed, dataset)
    if model != "mlp":
        xs, xt = [x.unsqueeze(1) for x in xs], xt.unsqueeze(1)
    gen = torch.Generator().manual_seed(seed)
    if dataset == "mnist1d":   # 300 of the anchors' public pool
        pub = torch.tensor(np.load(SPLITS / "mnist1d-public.npz")["x"])
        fusion = pub[torch.randperm(len(pub), generator=gen)[:300]]
        fusion = fusion.unsqueeze(1) if model != "mlp" else fusion
    else:   # digits: the anchors have no pool, 300 of client 0's data
        fusion = xs[0][torch.randperm(len(xs[0]), generator=gen)[:300]]
    models = []
    for i in range(clients):
        torch.manual_seed(1000 * seed + i)
        if model == "cnn":
            m = build_model("cnn", 10, (1, xs[0].shape[-1]), width=32, depth=3, seed=1000 * seed + i)
        elif model == "vit":
            m = build_model("vit", 10, (1, xs[0].shape[-1]), seed=1000 * seed + i)
        else:
            m = anchor_mlp(xs[0].shape[1], 256 if dataset == "mnist1d" else 128)
        train_local(m, xs[i], ys[i], 20, 0.05, torch.Generator().manual_seed(100 * seed + i))
        models.append(m.eval())
    return models, fusion, xt, yt, [float(len(y)) for y in ys]


def fmnist_cell(alpha: float, seed: int, cache: Path):
    """fmnist_oneshot's O1 cell (its clients cached under ``cache``)."""
    from simulations.bench.fmnist_oneshot import CLIENTS, PUBLIC, SPLITS, clients_of
    from simulations.bench.fmnist_splits import write_splits

    folder = write_splits(SPLITS, [f"dir{alpha:g}"], CLIENTS, [seed], PUBLIC)[0]
    clients = clients_of(folder, seed, 20, cache)
    with np.load(folder / "test.npz") as z:
        xt, yt = torch.from_numpy(z["x"]), torch.from_numpy(z["y"])
    with np.load(SPLITS / f"fmnist-public{PUBLIC}.npz") as z:
        fusion = torch.from_numpy(z["x"][:PUBLIC])
    return [c["model"] for c in clients], fusion, xt, yt, [float(c["n"]) for c in clients]


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return float((model.eval()(x).argmax(1) == y).float().mean())


def run_cell(models, fusion, xt, yt, n, seed: int, sets: dict, fixed: bool = True) -> dict:
    rec: dict = {"fixed": {}, "auto": {}, "choice": {}, "agreement": {}}
    for method in FIXED if fixed else ():
        try:
            rec["fixed"][method] = accuracy(fuse_result(method, models, fusion_inputs=fusion, weights=n,
                                                        seed=seed).model, xt, yt)
        except ValueError as exc:   # a method that cannot take the models: recorded, not a row
            rec["fixed"][method] = None
            rec.setdefault("n/a", {})[method] = str(exc)[:200]
    for name, (cands, refit) in sets.items():
        res = fuse_result("auto", models, fusion_inputs=fusion, weights=n, seed=seed, candidates=cands, refit=refit)
        rec["auto"][name] = accuracy(res.model, xt, yt)
        rec["choice"][name] = res.info.get("auto-choice")
        rec["agreement"][name] = res.info.get("auto-agreement")
    return rec


def parse_sets(text: str) -> dict[str, tuple[tuple[str, ...], bool]]:
    """``{set text: (candidates, refit)}``."""
    named = {"default": DEFAULT_CANDIDATES, "old": OLD}
    out = {}
    for s in text.split(";"):
        parts = s.split("|")
        refit = parts[-1] != "no-refit"
        cands = tuple(m for part in parts if part != "no-refit" for m in named.get(part, (part,)))
        out[s] = (tuple(dict.fromkeys(cands)), refit)
    return out


def _model(row: dict) -> str:
    return row.get("model") or ("lenet" if row["data"] == "fmnist" else "mlp")


def summarise(rows: list[dict]) -> str:
    """Per cell: the best fixed method (on the mean over seeds), each set's auto, its gap and its choices."""
    cells = sorted({(r["data"], _model(r), r["clients"], r["alpha"]) for r in rows})
    sets = list(dict.fromkeys(k for r in rows for k in r["auto"]))
    lines = ["| data | model | clients | α | best fixed (mean) | " + " | ".join(f"auto [{s.replace('|', ' + ')}]" for s in sets) + " |",
             "|---|---|---|---|---|" + "---|" * len(sets)]
    for cell in cells:
        rs = [r for r in rows if (r["data"], _model(r), r["clients"], r["alpha"]) == cell]
        means = {m: statistics.mean(100 * r["fixed"][m] for r in rs) for m in FIXED
                 if all(r["fixed"].get(m) is not None for r in rs)}
        best = max(means, key=means.get)
        cols = []
        for s in sets:
            a = [100 * r["auto"][s] for r in rs if s in r["auto"]]
            if not a:
                cols.append("")
                continue
            sd = f" ± {statistics.stdev(a):.1f}" if len(a) > 1 else ""
            picks = "/".join(r["choice"][s] for r in rs if s in r["choice"])
            cols.append(f"{statistics.mean(a):.1f}{sd} ({statistics.mean(a) - means[best]:+.1f}; {picks})")
        lines.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | {cell[3]:g} | {best} {means[best]:.1f} | " + " | ".join(cols) + " |")
    fixed = ["", "| data | model | clients | α | " + " | ".join(FIXED) + " |", "|---|---|---|---|" + "---|" * len(FIXED)]
    for cell in cells:
        rs = [r for r in rows if (r["data"], _model(r), r["clients"], r["alpha"]) == cell]
        vals = []
        for m in FIXED:
            v = [100 * r["fixed"][m] for r in rs if r["fixed"].get(m) is not None]
            vals.append(f"{statistics.mean(v):.1f}" if v else "n/a")
        fixed.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | {cell[3]:g} | " + " | ".join(vals) + " |")
    return "\n".join(lines + fixed) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", choices=("mnist1d", "digits", "fmnist"), default="mnist1d")
    ap.add_argument("--model", choices=("mlp", "cnn", "vit"), default="mlp", help="mnist1d: progressive's models")
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--clients", default="5,10", help="mnist1d only (fmnist: 5)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sets", default="old|no-refit;old;default|no-refit;default")
    ap.add_argument("--cache", default="results/cache/fmnist-oneshot")
    ap.add_argument("--out", default="results/auto-candidates")
    ap.add_argument("--summary-only", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rows.jsonl"
    if not a.summary_only:
        sets = parse_sets(a.sets)
        rows = [json.loads(line) for line in path.open()] if path.exists() else []
        clients = [int(c) for c in a.clients.split(",")] if a.data != "fmnist" else [5]
        model = {"mnist1d": a.model, "fmnist": "lenet"}.get(a.data, "mlp")
        alphas, seeds = [float(x) for x in a.alphas.split(",")], [int(s) for s in a.seeds.split(",")]
        for c, alpha, seed in itertools.product(clients, alphas, seeds):
            key = (a.data, model, c, alpha, seed)
            prev = next((r for r in rows if (r["data"], _model(r), r["clients"], r["alpha"], r["seed"]) == key), None)
            todo = {k: v for k, v in sets.items() if prev is None or k not in prev["auto"]}
            if not todo:
                continue
            cell = fmnist_cell(alpha, seed, Path(a.cache)) if a.data == "fmnist" else anchors_cell(
                alpha, c, seed, a.data, model)
            rec = {"data": a.data, "model": model, "clients": c, "alpha": alpha, "seed": seed,
                   **run_cell(*cell, seed=seed, sets=todo, fixed=prev is None)}
            if prev is not None:   # the same clients (seeded): the new sets join the cell's row
                rec = {**rec, "fixed": prev["fixed"], **{k: {**prev[k], **rec[k]} for k in ("auto", "choice", "agreement")}}
                rows.remove(prev)
            rows.append(rec)
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            print(json.dumps({k: rec[k] for k in ("data", "model", "clients", "alpha", "seed", "auto", "choice")}),
                  flush=True)
    text = summarise([json.loads(line) for line in path.open()])
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
