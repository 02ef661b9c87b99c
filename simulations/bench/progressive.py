"""One-shot and progressive few-round fusion on MNIST-1D at the anchor data size (issue 27, items 1–2).

Cells: MNIST-1D, 12,000 samples (the anchors' generation: ``mnist1d`` ``make_dataset``, ``num_samples=12000``,
``seed=11``, its 80/20 split), Dirichlet α ∈ {0.1, 0.3, 0.5} over 5 or 10 clients. The 10-client α = 0.1 / 0.5
cells are the anchors' own files (``../shared/anchors/splits``, the data stock Flower FedAvg was measured on); the
others are cut with the anchors' recipe (per class, Dirichlet proportions, ``numpy.random.default_rng(seed)``,
redrawn until every client has ≥ 20 samples). The server's fusion set: 300 samples of the anchors' public pool
(``--fusion-source public``), 300 of client 0's data (``client0``), or both (``mixed``, 600). ``--alphas 0``: class
shards (2 shards of the label-sorted data per client). ``--dataset digits``:
the anchors' digits cells (10 clients, α = 0.1 / 0.5, MLP 64-128-128-10; no public pool, so ``client0``).

Clients: the anchors' MLP 40-256-256-10, each from its own initialisation (one-shot), ``--epochs`` (20) of SGD
(momentum 0.9, lr ``--lr`` 0.05, batch 32) on its data. Rows, all from the same client models:

- each client (best, mean), the sample-weighted ensemble, one-shot FedAvg (weighted average of the weights), KD
  and FedDF (``fuse("kd")`` / ``fuse("feddf")``), ``kf-linear`` (``fuse`` defaults: K = 1, today's one-shot),
  ``auto`` (label-free, ``fuse("auto")`` defaults) and ``auto[validation]`` (the clients' training data as
  federated validation sets);
- K = 2 (``fedfuse.progressive``: the fused model's feature levels frozen, the head refitted in closed form from
  the clients' ridge statistics) on top of kf-linear, FedDF and auto[validation];
- K = 3 (level-wise): kf-linear's first hidden level frozen, the clients lift and retrain their upper levels on it
  (``--suffix-epochs``), the upper parts fused by kf-linear on the fusion set through the frozen level, then the
  head round.

Each row records its uplink communication per client in model-equivalents (the numbers a client sends over the
run, divided by the model's parameter count). Test accuracy on the cell's 2,400 test samples. ::

    .venv/bin/python -m simulations.bench.progressive --alphas 0.1,0.3,0.5 --clients 5,10 --seeds 0,1,2 \
        --out results/progressive
    .venv/bin/python -m simulations.bench.progressive --dataset digits --alphas 0.1,0.5 --fusion-source client0 \
        --out results/progressive-digits
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from fedfuse.fusion import fuse_result  # noqa: E402
from fedfuse.models import build_model  # noqa: E402
from fedfuse.progressive import (cut_points, freeze, fuse_suffixes, head_statistics, lift_suffix,  # noqa: E402
                                 model_equivalents, solve_head, split, with_head)
from simulations.bench.anchor_lr_screen import SPLITS, load_split, train_local  # noqa: E402
from simulations.bench.stats import format_mean_std, std_note  # noqa: E402
from simulations.bench.tables import markdown_table  # noqa: E402

NAN = float("nan")
NI_METHOD = {"mlp": "kf-linear", "cnn": "kf-linear", "vit": "kf-gradient"}   # kf-linear takes affine levels only
ROWS = ["best client", "mean client", "ensemble", "one-shot FedAvg", "KD", "FedDF", "kf-linear (K=1)", "auto",
        "auto[validation]", "K=2 kf-linear+head", "K=2 FedDF+head", "K=2 auto[validation]+head",
        "K=3 kf-linear level-wise+head", "K=4 kf-linear level-wise+head"]


def generated_cell(alpha: float, clients: int, seed: int):
    """``(xs, ys, x_test, y_test)``: the anchors' MNIST-1D cut with their Dirichlet recipe for other α / counts;
    ``alpha = 0`` means class shards instead: the training set sorted by label, cut into 2 × ``clients`` shards, two
    random shards per client (McMahan et al.'s pathological split; most clients hold 2 classes)."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = 12000, 11
    d = make_dataset(args)
    x, y = np.asarray(d["x"], np.float32), np.asarray(d["y"], np.int64)
    rng = np.random.default_rng(seed)
    if alpha == 0:
        order = np.argsort(y, kind="stable")
        shards = np.array_split(order, 2 * clients)
        pick = rng.permutation(2 * clients)
        parts = [np.concatenate([shards[pick[2 * i]], shards[pick[2 * i + 1]]]) for i in range(clients)]
        return ([torch.tensor(x[p]) for p in parts], [torch.tensor(y[p]) for p in parts],
                torch.tensor(np.asarray(d["x_test"], np.float32)), torch.tensor(np.asarray(d["y_test"])))
    from simulations.bench.anchor_splits import dirichlet_parts

    parts = dirichlet_parts(y, clients, alpha, seed, sort=False)
    xs = [torch.tensor(x[p]) for p in parts]
    ys = [torch.tensor(y[p]) for p in parts]
    return xs, ys, torch.tensor(np.asarray(d["x_test"], np.float32)), torch.tensor(np.asarray(d["y_test"]))


def load_cell(alpha: float, clients: int, seed: int, dataset: str = "mnist1d"):
    """One cell's client data and test set; ``alpha = 0``: class shards (``generated_cell``)."""
    anchor = SPLITS / f"{dataset}-a{alpha:g}-s{seed}"
    if clients == 10 and anchor.is_dir():
        return (*load_split(anchor), "anchor")
    if dataset != "mnist1d":
        raise ValueError(f"{dataset}: only the anchors' own cells (10 clients, α 0.1 / 0.5) are available")
    return (*generated_cell(alpha, clients, seed), "generated")


def anchor_mlp(d: int, width: int, depth: int = 2) -> nn.Module:
    """The anchors' MLP: ``d``-width-width-10 with ReLU (width 256 for MNIST-1D, 128 for digits); ``depth`` hidden
    layers (the anchors' 2; 3 gives K = 4 a level-wise round more)."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(d if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model.eval()(x).argmax(1) == y).float().mean())


def head_round(model: nn.Module, xs, ys, ridge: float) -> tuple[nn.Module, int]:
    """The K-th round: every client's ridge statistics on ``model``'s frozen features, the head solved on the
    server. Returns the model with the new head and the numbers one client sends."""
    stats = [head_statistics(model, x, y, 10) for x, y in zip(xs, ys)]
    return with_head(copy.deepcopy(model), solve_head(stats, ridge)), stats[0].numbers_sent


def run_cell(alpha: float, clients: int, seed: int, args) -> dict:
    xs, ys, xt, yt, source = load_cell(alpha, clients, seed, args.dataset)
    if args.model in ("cnn", "vit"):
        xs, xt = [x.unsqueeze(1) for x in xs], xt.unsqueeze(1)
    gen = torch.Generator().manual_seed(seed)
    if args.dataset != "mnist1d" and args.fusion_source != "client0":
        raise ValueError(f"{args.dataset}: the anchors have no public pool; use --fusion-source client0")
    pub = torch.tensor(np.load(SPLITS / "mnist1d-public.npz")["x"])
    fs = {"public": lambda: pub[torch.randperm(len(pub), generator=gen)[:300]],
          "client0": lambda: xs[0][torch.randperm(len(xs[0]), generator=gen)[:300]]}
    X = (torch.cat([fs["public"](), fs["client0"]()]) if args.fusion_source == "mixed"
         else fs[args.fusion_source]())
    if args.model in ("cnn", "vit") and X.dim() == 2:
        X = X.unsqueeze(1)
    n = [float(len(y)) for y in ys]
    t0 = time.perf_counter()
    models = []
    for i in range(clients):
        torch.manual_seed(1000 * seed + i)
        if args.model == "cnn":   # fedfuse's VGG-style CNN on the signal as one channel
            m = build_model("cnn", 10, (1, xs[0].shape[-1]), width=32, depth=3, seed=1000 * seed + i)
        elif args.model == "vit":   # fedfuse's timm ViT (its default CPU size) on the signal as a 1 × 40 image
            m = build_model("vit", 10, (1, xs[0].shape[-1]), seed=1000 * seed + i)
        else:
            m = anchor_mlp(xs[0].shape[1], 256 if args.dataset == "mnist1d" else 128, args.depth)
        train_local(m, xs[i], ys[i], args.epochs, args.lr, torch.Generator().manual_seed(100 * seed + i))
        models.append(m.eval())
    train_s = time.perf_counter() - t0
    params = sum(p.numel() for p in models[0].parameters())
    acc: dict[str, float] = {}
    comm: dict[str, float] = {}
    secs: dict[str, float] = {}
    info: dict[str, object] = {}
    client_acc = [accuracy(m, xt, yt) for m in models]
    acc["best client"], acc["mean client"] = max(client_acc), sum(client_acc) / clients
    w = torch.tensor(n) / sum(n)
    with torch.no_grad():
        ens = sum(w[i] * models[i](xt).softmax(1) for i in range(clients))
    acc["ensemble"] = float((ens.argmax(1) == yt).float().mean())
    comm.update({"best client": 1.0, "mean client": 1.0, "ensemble": 1.0})
    validation = list(zip(xs, ys))

    def run(row: str, method: str, **kw):
        res = fuse_result(method, models, fusion_inputs=X, weights=n, seed=seed, **kw)
        acc[row], comm[row], secs[row] = accuracy(res.model, xt, yt), 1.0, res.seconds
        return res

    run("one-shot FedAvg", "average")
    run("KD", "kd")
    feddf = run("FedDF", "feddf").model
    ni = NI_METHOD[args.model]   # neuron interpolation: the closed-form variant where the family allows it
    kf = run(f"{ni} (K=1)", ni, **args.ni_options).model
    info["auto"] = run("auto", "auto").info.get("auto-choice")
    auto_val = run("auto[validation]", "auto", validation=validation)
    info["auto[validation]"] = auto_val.info.get("auto-choice")
    for row, base, base_row in ((f"K=2 {ni}+head", kf, f"{ni} (K=1)"), ("K=2 FedDF+head", feddf, "FedDF"),
                                ("K=2 auto[validation]+head", auto_val.model, "auto[validation]")):
        t = time.perf_counter()
        model, numbers = head_round(base, xs, ys, args.ridge)
        acc[row], secs[row] = accuracy(model, xt, yt), secs[base_row] + time.perf_counter() - t
        comm[row] = 1.0 + model_equivalents(numbers, models[0])
    for k in (3, 4):   # level-wise rounds: K - 2 of them, then the head round
        row = f"K={k} {ni} level-wise+head"
        if args.model != "mlp" or k - 2 > len(cut_points(kf)) - 1:   # n/a: level-wise rounds take MLPs that deep
            acc[row], secs[row], comm[row] = float("nan"), float("nan"), float("nan")
            continue
        t = time.perf_counter()
        fused, sent = levelwise(models, kf, X, xs, ys, n, seed, args, k - 2)
        model, numbers = head_round(fused, xs, ys, args.ridge)
        acc[row], secs[row] = accuracy(model, xt, yt), secs[f"{ni} (K=1)"] + time.perf_counter() - t
        comm[row] = 1.0 + model_equivalents(sent + numbers, models[0])
        info[f"K={k} upper-part accuracy before the head round"] = accuracy(fused, xt, yt)
    return _record(args, alpha, clients, seed, source, X, train_s, params, acc, comm, secs, client_acc, info)


def levelwise(models, fused: nn.Sequential, X, xs, ys, n, seed: int, args, rounds: int) -> tuple[nn.Sequential, int]:
    """``rounds`` level-wise rounds after the one-shot fusion ``fused``: round j freezes the fused model's levels up
    to cut j; each client lifts its current upper part onto them, trains it (``--suffix-epochs``; the frozen levels
    stay bit-identical) and sends it; the server fuses the upper parts with kf-linear on the fusion set through the
    frozen levels. Returns the fused model and the numbers one client sent (its upper parts)."""
    current, clients, sent = fused, list(models), 0
    for j, cut in enumerate(cut_points(fused)[:-1][:rounds]):   # each leaves a hidden level above the cut
        prefix = freeze(copy.deepcopy(split(current, cut)[0]))
        before = {k: v.clone() for k, v in prefix.state_dict().items()}
        suffixes = []
        for i, m in enumerate(clients):
            own_prefix, own_suffix = split(m, cut)
            upper = lift_suffix(prefix, own_prefix, own_suffix, xs[i], args.ridge)
            train_local(nn.Sequential(*prefix, *upper).train(), xs[i], ys[i], args.suffix_epochs, args.lr,
                        torch.Generator().manual_seed(100 * seed + i + 50 + 1000 * j))
            suffixes.append(upper.eval())
            clients[i] = nn.Sequential(*prefix, *upper).eval()
        assert all(torch.equal(before[k], v) for k, v in prefix.state_dict().items()), "a frozen level moved"
        current = fuse_suffixes("kf-linear", prefix, suffixes, X, weights=n, seed=seed)
        sent += sum(p.numel() for p in suffixes[0].parameters())
    return current, sent


def _record(args, alpha, clients, seed, source, X, train_s, params, acc, comm, secs, client_acc, info) -> dict:
    return {"dataset": args.dataset, "model": args.model, "method": NI_METHOD[args.model],
            "ni-options": args.ni_options, "alpha": alpha, "clients": clients, "seed": seed,
            "source": source, "fusion-source": args.fusion_source, "fusion-samples": len(X), "train-seconds": train_s,
            "params": params, "accuracy": acc, "uplink-model-equivalents": comm, "seconds": secs,
            "client-accuracy": client_acc, "info": info}


def rows_for(results: list[dict]) -> list[str]:
    """``ROWS`` with the run's neuron-interpolation method (kf-gradient for ViTs)."""
    method = results[0].get("method", "kf-linear")
    return [r.replace("kf-linear", method) for r in ROWS]


def summarise(results: list[dict], out: Path) -> None:
    cells = sorted({(r["clients"], r["alpha"]) for r in results})
    seeds = sorted({r["seed"] for r in results})
    header = ["row", "uplink (model-eq.)"] + [f"{c} clients " + (f"α={a:g}" if a else "shards") for c, a in cells]
    lines = []
    rows = rows_for(results)
    for row in rows:
        vals = []
        for c, a in cells:
            v = [100 * r["accuracy"].get(row, NAN) for r in results if (r["clients"], r["alpha"]) == (c, a)]
            vals.append(format_mean_std(v, 1))
        ups = sorted({round(r["uplink-model-equivalents"].get(row, NAN), 2) for r in results
                      if r["uplink-model-equivalents"].get(row, NAN) == r["uplink-model-equivalents"].get(row, NAN)}) \
            or ["n/a"]
        lines.append([row, "/".join(u if isinstance(u, str) else f"{u:g}" for u in ups)] + vals)
    gaps = []
    for row in rows[3:]:
        v = []
        for c, a in cells:
            rs = [r for r in results if (r["clients"], r["alpha"]) == (c, a)]
            v.append(format_mean_std([100 * (r["accuracy"].get(row, NAN) - r["accuracy"]["ensemble"]) for r in rs], 1))
        gaps.append([row] + v)
    name = {"mnist1d": "MNIST-1D (12,000 samples)", "digits": "digits (the anchors' splits)"}[results[0].get(
        "dataset", "mnist1d")] + f", {results[0].get('model', 'mlp').upper()}"
    text = (f"# Progressive few-round fusion, {name}, fusion set: {results[0]['fusion-source']} "
            f"({results[0]['fusion-samples']} samples)\n\nTest accuracy %, {std_note(len(seeds))} "
            f"({', '.join(map(str, seeds))}). Uplink: numbers one client sends over the run / the model's "
            f"{results[0]['params']:,} parameters (10-client cells; the 5-client ones are the same).\n\n"
            + markdown_table(header, lines)
            + "\n\n## Minus the ensemble (points)\n\n" + markdown_table(["row"] + header[2:], gaps) + "\n")
    (out / "table.md").write_text(text)
    print(text)


def plot(results: list[dict], out: Path) -> None:
    """Accuracy vs uplink communication, one panel per cell, one marker per row (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["clients"], r["alpha"]) for r in results})
    cols = min(3, len(cells))
    nrows = (len(cells) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows + 1.2), squeeze=False)
    markers = "os^vD<>pP*Xh"
    for ax, (c, a) in zip(axes.flat, cells):
        rs = [r for r in results if (r["clients"], r["alpha"]) == (c, a)]
        for k, row in enumerate(rows_for(results)[2:]):
            y = np.mean([100 * r["accuracy"].get(row, NAN) for r in rs])
            x = np.mean([r["uplink-model-equivalents"].get(row, NAN) for r in rs])
            ax.scatter(x, y, s=36, marker=markers[k % len(markers)], color=plt.cm.tab20(k), label=row)
        ax.set_title(f"{c} clients, " + (f"α={a:g}" if a else "class shards"), fontsize=9)
        ax.set_xlabel("uplink per client (model-equivalents)", fontsize=8)
        ax.set_ylabel("test accuracy %", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(cells):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.12 if nrows == 1 else 0.08, 1, 1))
    fig.savefig(out / "accuracy_vs_communication.png", dpi=130)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", choices=["mnist1d", "digits"], default="mnist1d")
    p.add_argument("--depth", type=int, default=2, help="hidden layers of the MLP (3: K = 4 is measured too)")
    p.add_argument("--model", choices=["mlp", "cnn", "vit"], default="mlp",
                   help="mlp: the anchors' MLP; cnn: fedfuse's CNN (width 32, depth 3); vit: fedfuse's ViT (MNIST-1D "
                        "only; neuron interpolation by kf-gradient, which takes transformer blocks)")
    p.add_argument("--alphas", default="0.1,0.3,0.5")
    p.add_argument("--clients", default="10")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--suffix-epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ridge", type=float, default=1e-3)
    p.add_argument("--fusion-source", choices=["public", "client0", "mixed"], default="public")
    p.add_argument("--ni-options", type=json.loads, default={},
                   help="JSON options of the neuron-interpolation fusion, e.g. '{\"eps\": 1.0}' (kf-gradient's "
                        "setting-1 re-initialisation of the blocks)")
    p.add_argument("--out", type=Path, default=Path("results/progressive"))
    p.add_argument("--summary-only", action="store_true", help="rebuild table.md and the plot from results.jsonl")
    args = p.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.jsonl"
    if not args.summary_only:
        done = set()
        if path.exists():
            done = {(r["clients"], r["alpha"], r["seed"]) for r in map(json.loads, path.read_text().splitlines())}
        for c in map(int, args.clients.split(",")):
            for a in map(float, args.alphas.split(",")):
                for s in map(int, args.seeds.split(",")):
                    if (c, a, s) in done:
                        continue
                    t = time.perf_counter()
                    r = run_cell(a, c, s, args)
                    with path.open("a") as f:
                        f.write(json.dumps(r) + "\n")
                    print(f"{c} clients α={a:g} seed {s} ({time.perf_counter() - t:.0f}s): " + ", ".join(
                        f"{k} {v:.3f}" for k, v in r["accuracy"].items()), flush=True)
    results = [json.loads(line) for line in path.read_text().splitlines()]
    summarise(results, args.out)
    plot(results, args.out)


if __name__ == "__main__":
    main()
