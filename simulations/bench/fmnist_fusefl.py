"""FuseFL on O1's strong cell (issue 59 item 2): Tang et al., "FuseFL: One-Shot Federated Learning through the Lens of
Causality with Progressive Model Fusion", NeurIPS 2024, arXiv 2410.20380 — the published one-shot peer run like for
like on fedfuse's strong clients' data (``fmnist_strong``: the same cells, the same five clients' train / validation
parts, initialisations and batch-order seeds, the recipe ``RECIPE``, the 20-epoch local budget).

Not fedfuse's own K = 2 "after FuseFL" variant (``fedfuse/progressive.py``: one-shot fusion, then lifted suffixes or
the head round); this is FuseFL as its paper and public code (github.com/wizard1203/FuseFL: ``models/fl_exnn.py``,
``alg_train.fed_expandable``) define it, written fresh here:

- **Blocks.** The client network (LeNet-5, ``fedfuse.models`` ``lenet``: conv 6 - pool - conv 16 - pool - fc 120 -
  fc 84 - fc 10) is cut into K blocks plus its classifier (the last Linear). K = 2: [conv1, conv2] | [fc1, fc2];
  K = 4: [conv1] | [conv2] | [fc1] | [fc2] (each block with its ReLU / pooling). As the public code's ResNet-18 split
  (K = 2: stem + layer1-2 | layer3-4 + pool), the cut falls at a stage boundary.
- **Step k = 1 … K** (one exchange each). Every client trains, from its current weights, its own blocks k … K and its
  classifier on its own data, reading the *fused, frozen* lower levels 1 … k−1; it uploads block k (with its adaptor)
  and, at step K, its classifier. The fused level k is the M clients' blocks k side by side: its output is the
  **concatenation** of the M clients' block-k outputs (channels of all clients). From step 2 on, each client's
  block k reads that concatenation through its own **adaptor** — a 1×1 convolution M·C → C on feature maps (the
  public code's ``cnn1x1``), a Linear M·d → d on vectors (after the flatten; the 1×1 convolution's equivalent) —
  created at the step it is first trained, trained with the block and kept frozen in the fused level afterwards.
  **Its initialisation** (deviation): the average of the M clients' outputs (weights I/M side by side, bias 0 — the
  public code's parameter-free ``avg`` adapter as the trainable adaptor's start), not PyTorch's default. Chosen on the
  tuning split (α 0.3, seed 100; no reported cell): with the default initialisation K = 4 diverges (NaN at step 4:
  LeNet has no normalisation after the adaptor, unlike the public code's ResNet blocks, and the Linear 600 → 120
  reads unnormalised fc1 activations up to ~180); at K = 2 the two were level there (+ head round 88.0 / 87.8).
- **Initialisation**: every client starts step 1 from one model (client 0's initialisation of the cell; the public
  code deep-copies one model to every client, as an FL server broadcasts it), not the strong clients' own
  independent initialisations; the batch-order seeds are the strong clients'.
- **Local epochs per step**: the total budget split over the steps, as the public scripts do (200 local epochs at
  K = 1 for the ensemble's clients; 100 per step at K = 2, 50 at K = 4): here 20 → **10 per step at K = 2, 5 at
  K = 4**, each step with a fresh SGD optimizer (the recipe: lr 0.02, momentum 0.9, weight decay 1e-5, batch 64).
- **The final model** (the public code's ``fedexnn_classifer='avg'``): the M columns' last-block outputs are
  **summed** and fed to the **average** of the M clients' classifiers. Its size: M columns plus the adaptors (≈ 5×
  LeNet's parameters): every inference runs all M columns.
- **Not run** (deviations): ResNet-18 and 200 epochs (a LeNet-5 at 20, as every O1 row); the public code's CCVR
  calibration of the final classifier (``locals/ccvr.calibrate_classifier``: the clients send per-class feature means
  and covariances of the fused model — one more exchange — and the server trains the classifier on sampled virtual
  features) is not part of the ``K exchanges`` row: the closest thing here is the row ``+ head round`` (the clients
  send ridge / LDA statistics of the fused model's final features, ``fmnist_oneshot.head_round``; K + 1 exchanges).
  No data augmentation (O1's clients have none). The upper blocks train on the fused lower levels' outputs computed
  once per step (the lower levels are frozen and deterministic: no dropout, batch norm or augmentation in LeNet), which
  is exact, not an approximation.

Efficiency, exact: K = 4's step 1 (5 epochs) is the first half of K = 2's step 1 (10 epochs): both start from the same
initialisation with the same batch order, so one 10-epoch run per client gives both (the state after epoch 5 copied).

Rows per cell (``results/fmnist-o1-strong/fusefl``): ``fusefl-k2`` / ``fusefl-k4`` with and without the head round,
their exchanges (K; K + 1 with the head round), uplink traffic per client in LeNet uploads (blocks + adaptors + the
classifier; the head round's statistics on top), the fused model's size ÷ LeNet's, FuseFL's own step-1 ensemble, and
the seconds: the server's (assembling the fused levels: nothing else) and the clients' (all FuseFL local training and
the forward passes of the fused levels over their data), both ÷ one local epoch of one client timed in the same
process (``fit`` with the recipe, client 0, one epoch, right before). Paired differences per seed against the strong
clients' ensemble (computed here) and against ``kf-linear`` + head round (read from the O1 (strong) per-seed JSON).

The commands as run (the first stopped after its α 0.1 cell for time — the machine's 2 cores were shared with other
jobs — the rest by K, K = 2 first):

    .venv/bin/python -m simulations.bench.fmnist_fusefl run --alphas 0.1,0.3,0.5 --seeds 0 --out results/fmnist-o1-strong/fusefl
    .venv/bin/python -m simulations.bench.fmnist_fusefl run --k 2 --alphas 0.3,0.5 --seeds 0 --out results/fmnist-o1-strong/fusefl
    .venv/bin/python -m simulations.bench.fmnist_fusefl run --k 2 --alphas 0.1,0.3,0.5 --seeds 1,2 --out results/fmnist-o1-strong/fusefl
    .venv/bin/python -m simulations.bench.fmnist_fusefl run --k 4 --alphas 0.3,0.5 --seeds 0 --out results/fmnist-o1-strong/fusefl
    .venv/bin/python -m simulations.bench.fmnist_fusefl run --k 4 --alphas 0.1,0.3,0.5 --seeds 1,2 --out results/fmnist-o1-strong/fusefl
    .venv/bin/python -m simulations.bench.fmnist_fusefl table --out results/fmnist-o1-strong/fusefl

A rerun from scratch: ``run --alphas 0.1,0.3,0.5 --seeds 0,1,2`` (both K per cell; the same rows).
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
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fedfuse.models import build_model  # noqa: E402
from fedfuse.progressive import HeadSite  # noqa: E402
from fedfuse.training import predict_logits  # noqa: E402

# LeNet-5 (fedfuse.models 'lenet', an nn.Sequential of 12 modules) cut into blocks: module index ranges; the
# classifier is module 11 (Linear 84 -> 10)
BLOCKS = {2: [(0, 6), (6, 11)], 4: [(0, 3), (3, 6), (6, 9), (9, 11)]}
CLASSIFIER = 11
LENET_PARAMS = 44426
O1_STRONG = Path("results/fmnist-o1-strong")


def acc(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean())


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class FuseFLNet(nn.Module):
    """The fused model: ``levels[k]`` holds the M clients' columns of level k (level 0: block 1; level k ≥ 1:
    Sequential(adaptor, block k+1)); every level but the last outputs the concatenation of its columns' outputs
    (dim 1: channels or features), the last their sum, which ``classifier`` (the clients' classifiers averaged)
    reads. ``head_sites`` exposes that classifier to the head round (``fedfuse.progressive``)."""

    def __init__(self, levels: list[list[nn.Module]], classifier: nn.Linear) -> None:
        super().__init__()
        self.levels = nn.ModuleList(nn.ModuleList(cols) for cols in levels)
        self.classifier = classifier

    def features(self, x: torch.Tensor) -> torch.Tensor:
        z = x
        for k, cols in enumerate(self.levels):
            outs = [col(z) for col in cols]
            z = torch.cat(outs, 1) if k < len(self.levels) - 1 else torch.stack(outs).sum(0)
        return z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def head_sites(self) -> dict[str, HeadSite]:
        return {"": HeadSite(self.features, self.classifier, self)}


def _adaptor(shape: tuple[int, ...], clients: int, seed: int, init: str = "avg") -> nn.Module:
    """The adaptor of a level's input: the concatenation of ``clients`` outputs of ``shape`` (C, H, W) or (d,) → one
    client's ``shape``: a 1×1 convolution on maps, a Linear on vectors. ``init``: ``"default"`` — PyTorch's
    initialisation, seeded (the public code's); ``"avg"`` — the average of the clients' outputs (weights I/M side by
    side, bias 0: the public code's parameter-free ``avg`` adapter as the trainable adaptor's start)."""
    torch.manual_seed(seed)
    ad = (nn.Conv2d(clients * shape[0], shape[0], kernel_size=1) if len(shape) == 3
          else nn.Linear(clients * shape[0], shape[0]))
    if init == "avg":
        with torch.no_grad():
            eye = torch.eye(shape[0]) / clients
            ad.weight.copy_(torch.cat([eye] * clients, 1).reshape(ad.weight.shape))
            ad.bias.zero_()
    return ad


def _train(modules: nn.Module, z: torch.Tensor, y: torch.Tensor, epochs: int, recipe: dict, gen: torch.Generator,
           opt: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
    """``epochs`` of the recipe's SGD on ``modules`` (an nn.Sequential from the cached input ``z`` to logits), in
    place; returns the optimizer (step 1 continues with it, so 5 + 5 epochs are one 10-epoch run)."""
    params = [p for p in modules.parameters() if p.requires_grad]
    if opt is None:
        opt = torch.optim.SGD(params, lr=recipe["lr"], momentum=recipe.get("momentum", 0.9),
                              weight_decay=recipe["weight-decay"])
    bs = recipe.get("batch-size", 64)
    modules.train()
    for _ in range(epochs):
        perm = torch.randperm(len(z), generator=gen)
        for s in range(0, len(z), bs):
            idx = perm[s:s + bs]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(modules(z[idx]), y[idx]).backward()
            opt.step()
    modules.eval()
    return opt


@torch.no_grad()
def _level_out(cols: list[nn.Module], z: torch.Tensor, last: bool, batch: int = 2048) -> torch.Tensor:
    outs = []
    for s in range(0, len(z), batch):
        o = [c(z[s:s + batch]) for c in cols]
        outs.append(torch.stack(o).sum(0) if last else torch.cat(o, 1))
    return torch.cat(outs)


def fusefl(data: list[dict], seed: int, k_blocks: int, recipe: dict, step1: list[nn.Module],
           adaptor_init: str = "avg") -> dict:
    """FuseFL with ``k_blocks`` steps on the clients ``data`` (dicts with x, y, n), from ``step1``: each client's
    LeNet after step 1 (trained by the caller: the whole network, the step's epochs). Returns the fused model, its
    traffic and the seconds of the clients' and the server's work after step 1."""
    m = len(data)
    per_step = recipe["epochs"] // k_blocks
    blocks = BLOCKS[k_blocks]
    cols = [[nn.Sequential(*[copy.deepcopy(net[i]) for i in range(a, b)]) for a, b in blocks] for net in step1]
    heads = [copy.deepcopy(net[CLASSIFIER]) for net in step1]
    # the output shape of every block, for the adaptors
    with torch.no_grad():
        probe, shapes = data[0]["x"][:1], []
        for blk in cols[0]:
            probe = blk(probe)
            shapes.append(tuple(probe.shape[1:]))
    client_s = server_s = 0.0
    uplink = [n_params(cols[c][0]) for c in range(m)]
    levels: list[list[nn.Module]] = []
    t0 = time.perf_counter()
    levels.append([freeze(cols[c][0]) for c in range(m)])   # the server: level 1 = the clients' blocks 1
    server_s += time.perf_counter() - t0
    for k in range(1, k_blocks):
        last = k == k_blocks - 1
        for c, d in enumerate(data):
            t0 = time.perf_counter()
            z = d["x"]
            for j, lev in enumerate(levels):        # the fused, frozen lower levels' output on this client's data
                z = _level_out(lev, z, last=False)
            adaptor = _adaptor(shapes[k - 1], m, seed * 1000 + c + 1 + 7919 * k, adaptor_init)
            col = nn.Sequential(adaptor, cols[c][k])
            upper = nn.Sequential(col, *cols[c][k + 1:], heads[c])
            gen = torch.Generator().manual_seed(seed * 1000 + c + 7919 * k)
            _train(upper, z, d["y"], per_step, recipe, gen)
            cols[c][k] = col
            uplink[c] += n_params(col) + (n_params(heads[c]) if last else 0)
            client_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        levels.append([freeze(cols[c][k]) for c in range(m)])
        server_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    head = copy.deepcopy(heads[0])
    with torch.no_grad():   # the public code's average_weights: a plain mean of the clients' classifiers
        head.weight.copy_(torch.stack([h.weight for h in heads]).mean(0))
        head.bias.copy_(torch.stack([h.bias for h in heads]).mean(0))
    model = FuseFLNet(levels, head).eval()
    server_s += time.perf_counter() - t0
    return {"model": model, "uplink": float(np.mean(uplink)) / LENET_PARAMS, "client-seconds": client_s,
            "server-seconds": server_s, "size": n_params(model) / LENET_PARAMS}


def freeze(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


def step_one(data: list[dict], seed: int, recipe: dict, budgets: tuple[int, ...], init: str = "shared"
             ) -> tuple[dict, float]:
    """Each client's whole LeNet trained with the recipe and the strong clients' batch-order seeds, the state copied
    after each epoch count in ``budgets`` (one run: a shorter budget is a prefix of a longer one). ``init``:
    ``"shared"`` — every client starts from one model (client 0's initialisation, as the server of FL broadcasts
    it; the public code deep-copies one model to every client), ``"own"`` — the strong clients' own initialisations.
    Returns {budget: [models]} and the seconds per client-epoch."""
    out = {b: [] for b in budgets}
    secs = 0.0
    for pid, d in enumerate(data):
        net = build_model("lenet", 10, (1, 28, 28), seed=seed * 1000 + (1 if init == "shared" else pid + 1))
        gen = torch.Generator().manual_seed(seed * 1000 + pid)
        opt, done = None, 0
        t0 = time.perf_counter()
        for b in sorted(budgets):
            opt = _train(net, d["x"], d["y"], b - done, recipe, gen, opt)
            done = b
            out[b].append(copy.deepcopy(net).eval())
        secs += time.perf_counter() - t0
    return out, secs / (len(data) * max(budgets))


def one_epoch_seconds(d: dict, seed: int, recipe: dict) -> float:
    """One local epoch of one client (client 0's data, a fresh LeNet, the recipe) timed in this process."""
    from simulations.bench.fmnist_strong import fit

    net = build_model("lenet", 10, (1, 28, 28), seed=seed * 1000 + 1)
    info = fit(net, d["x"], d["y"], d["vx"], d["vy"], lr=recipe["lr"], weight_decay=recipe["weight-decay"], epochs=1,
               seed=seed * 1000, batch_size=recipe.get("batch-size", 64), momentum=recipe.get("momentum", 0.9),
               early_stop=False)
    return info["train-seconds"]


def reference_rows(alpha: float, seed: int) -> dict:
    """``kf-linear`` (+ head round) of O1 (strong) for this cell, from its per-seed JSON (or rows.jsonl)."""
    from simulations.bench.fmnist_strong import all_rows

    part = f"dir{alpha:g}"
    for r in all_rows(O1_STRONG):
        if r["part"] == part and r["seed"] == seed and r["method"] == "kf-linear":
            return {"kf-linear": r["accuracy"], "kf-linear+head": r["with-head"]}
    return {}


def run_cell(alpha: float, seed: int, ks: tuple[int, ...]) -> list[dict]:
    from simulations.bench.fmnist_oneshot import head_round
    from simulations.bench.fmnist_strong import RECIPE, ensemble_acc, strong_clients, strong_data

    clients = strong_clients(alpha, seed)
    tx, ty, _ = strong_data(alpha, seed)
    n = [c["n"] for c in clients]
    base = {"part": f"dir{alpha:g}", "seed": seed}
    ens = ensemble_acc([predict_logits(c["model"], tx) for c in clients], n, ty)
    rows = [{**base, "method": "ensemble", "accuracy": ens, **reference_rows(alpha, seed)}]
    epoch_s = one_epoch_seconds(clients[0], seed, RECIPE)
    budgets = tuple(RECIPE["epochs"] // k for k in ks)
    first, step1_epoch_s = step_one(clients, seed, RECIPE, budgets)
    for k in ks:
        b = RECIPE["epochs"] // k
        own_ens = ensemble_acc([predict_logits(m, tx) for m in first[b]], n, ty)
        res = fusefl(clients, seed, k, RECIPE, first[b])
        model = res["model"]
        a0 = acc(predict_logits(model, tx), ty)
        t0 = time.perf_counter()
        headed, info = head_round(model, clients)
        head_s = time.perf_counter() - t0
        a1 = acc(predict_logits(headed, tx), ty)
        d = model.classifier.in_features
        head_traffic = ((d + 1) * (d + 2) // 2 + (d + 1) * 10) / LENET_PARAMS   # HeadStatistics.numbers_sent
        client_epochs = b * step1_epoch_s * len(clients) + res["client-seconds"]
        row = {**base, "method": f"fusefl-k{k}", "accuracy": a0, "with-head": a1, "solver": info["solver"],
               "exchanges": k, "traffic": res["uplink"], "head-traffic": head_traffic, "size": res["size"],
               "step1-ensemble": own_ens, "epoch-seconds": epoch_s,
               "server-per-epoch": res["server-seconds"] / epoch_s, "head-server-per-epoch": head_s / epoch_s,
               "client-per-epoch": client_epochs / len(clients) / epoch_s}
        rows.append(row)
        print(f"  dir{alpha:g} s{seed} ensemble {ens:.4f}  FuseFL K={k}: {a0:.4f} -> head {a1:.4f} ({info['solver']}) "
              f"step-1 ensemble {own_ens:.4f} size {res['size']:.2f}x traffic {res['uplink']:.3f} "
              f"client epochs/client {row['client-per-epoch']:.1f}", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------- table

def rows_of(out: Path) -> list[dict]:
    """The rows of ``out/rows.jsonl`` (a (cell, method) written twice counts once: the last), or where that is absent
    the per-seed JSON."""
    path = out / "rows.jsonl"
    if path.exists():
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    else:
        rows = []
        for p in sorted(out.glob("fmnist-*-n5-s*.json")):
            cell = json.loads(p.read_text())
            rows += [{"part": cell["part"], "seed": cell["seed"], **r} for r in cell["rows"]]
    for r in rows:   # correct test images / 10,000 in float32: the exact fraction
        r.update({k: round(r[k], 4) for k in ("accuracy", "with-head") if k in r})
    return list({(r["part"], r["seed"], r["method"]): r for r in rows}.values())


def _ms(v: list[float], signed: bool = False, scale: float = 100.0, digits: int = 1) -> str:
    if not v:
        return ""
    m = scale * float(np.mean(v))
    text = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return text + (f" ± {scale * float(np.std(v, ddof=1)):.{digits}f}" if len(v) > 1 else "") + f" (n={len(v)})"


def table(rows: list[dict], labels: dict[str, str], exchanges: dict[str, tuple[str, str]],
          notes: dict[str, str] | None = None) -> str:
    """Per method of ``labels`` (row name), both ways (``accuracy``; ``with-head`` where the rows have it), the
    exchanges, traffic, size and seconds ratios (means over the cells), and the paired differences per seed against
    the ensemble and against ``kf-linear`` + head round (per-seed values in brackets, seeds in order)."""
    parts = sorted({r["part"] for r in rows}, key=lambda p: float(p[3:]))
    cell = {(r["part"], r["seed"], r["method"]): r for r in rows}
    head = " | ".join(f"α = {p[3:]}" for p in parts)
    lines = ["mean ± sample std (ddof=1) over seeds; test accuracy in %; traffic: uplink per client in LeNet uploads; "
             "size: the result's parameters ÷ LeNet-5's (44,426); seconds: ÷ one local epoch of one client, timed in "
             "the same process (means over the cells); server s of a '+ head round' row: the head round timed whole "
             "(the clients' statistics, their validation scores of the candidate heads and the server's solves, as "
             "`fmnist_oneshot.head_round` runs them in one process) added; clients' s: each client's own local work "
             "(FuseFL: all its local training and its forward passes through the fused levels; FENS: its M models' "
             "logits on its data and its aggregator steps)", "",
             f"| row | exchanges | traffic | size | server s ÷ epoch | clients' s ÷ epoch | {head} |",
             "|---|---|---|---|---|---|" + "---|" * len(parts)]
    ens = [_ms([r["accuracy"] for (p, _, m), r in cell.items() if p == part and m == "ensemble"]) for part in parts]
    lines.append("| clients' ensemble (strong clients) | 1 | 1 | 5 | | | " + " | ".join(ens) + " |")
    kf = [_ms([r["kf-linear+head"] for (p, _, m), r in cell.items() if p == part and m == "ensemble"
               and "kf-linear+head" in r]) for part in parts]
    lines.append("| `kf-linear` + head round (O1 strong) | 2 | | 1 | | | " + " | ".join(kf) + " |")
    for m, label in labels.items():
        mine = [r for (_, _, mm), r in cell.items() if mm == m]
        if not mine:
            continue
        for key, ex in (("accuracy", exchanges[m][0]), ("with-head", exchanges[m][1])):
            if not ex or not all(key in r for r in mine):
                continue
            traffic = np.mean([r["traffic"] + (r.get("head-traffic", 0.0) if key == "with-head" else 0.0) for r in mine])
            server = np.mean([r["server-per-epoch"] + (r.get("head-server-per-epoch", 0.0) if key == "with-head"
                                                       else 0.0) for r in mine])
            client = np.mean([r["client-per-epoch"] for r in mine])
            cells = [_ms([r[key] for (p, _, mm), r in cell.items() if p == part and mm == m]) for part in parts]
            name = label + (" + head round" if key == "with-head" else "")
            lines.append(f"| {name} | {ex} | {traffic:.3g} | {mine[0]['size']:.2f} | {server:.3g} | {client:.3g} | "
                         + " | ".join(cells) + " |")
    lines += ["", "Paired per seed (same cell): the row minus the reference, points; per-seed values in brackets (seeds "
              "in order)", "", f"| row | against | {head} |", "|---|---|" + "---|" * len(parts)]
    for m, label in labels.items():
        for key in ("accuracy", "with-head"):
            for rname, rkey in (("ensemble", "accuracy"), ("`kf-linear` + head round", "kf-linear+head")):
                cells, any_ = [], False
                for part in parts:
                    d = [r[key] - cell[(part, s, "ensemble")][rkey] for (p, s, mm), r in sorted(cell.items())
                         if p == part and mm == m and key in r and rkey in cell.get((part, s, "ensemble"), {})]
                    any_ |= bool(d)
                    cells.append(_ms(d, signed=True) + (" [" + ", ".join(f"{100 * x:+.1f}" for x in d) + "]" if d else ""))
                if any_:
                    name = label + (" + head round" if key == "with-head" else "")
                    lines.append(f"| {name} | {rname} | " + " | ".join(cells) + " |")
    if notes:
        lines += [""] + [f"- {k}: {v}" for k, v in notes.items()]
    return "\n".join(lines)


def per_seed(out: Path, rows: list[dict], commands: list[str]) -> None:
    """One compact JSON per cell (the tracked evidence; rows.jsonl stays local): floats to 6 significant digits, the
    accuracies as computed."""
    from simulations.bench.fmnist_strong import _rounded

    cells: dict[str, list] = {}
    for r in rows:
        cells.setdefault(f"fmnist-{r['part']}-n5-s{r['seed']}", []).append(r)
    for name, cell in cells.items():
        own = [_rounded({k: v for k, v in r.items() if k not in ("part", "seed", "command")}) for r in cell]
        (out / f"{name}.json").write_text(json.dumps({"cell": name, "part": cell[0]["part"], "seed": cell[0]["seed"],
                                                      "commands": commands, "rows": own}, separators=(",", ":")))


LABELS = {"fusefl-k2": "FuseFL K=2 (LeNet-5, 10 + 10 epochs)", "fusefl-k4": "FuseFL K=4 (LeNet-5, 4 × 5 epochs)"}
EXCHANGES = {"fusefl-k2": ("2", "3 (+ head round)"), "fusefl-k4": ("4", "5 (+ head round)")}


def write_table(out: Path) -> str:
    rows = rows_of(out)
    raw = (out / "rows.jsonl").read_text().splitlines() if (out / "rows.jsonl").exists() else []
    commands = [c for c in dict.fromkeys(json.loads(x).get("command") for x in raw if x.strip()) if c]
    if not commands and list(out.glob("fmnist-*.json")):
        commands = json.loads(next(out.glob("fmnist-*.json")).read_text()).get("commands", [])
    own = {}
    for m in LABELS:
        v = [r["step1-ensemble"] for r in rows if r["method"] == m]
        if v:
            own[m] = v
    text = table(rows, LABELS, EXCHANGES, notes={
        f"{LABELS[m]}: FuseFL's own step-1 clients' ensemble (each client after step 1)":
            "; ".join(_ms([r["step1-ensemble"] for r in rows if r["method"] == m and r["part"] == p])
                      + f" at α {p[3:]}" for p in sorted({r['part'] for r in rows}, key=lambda p: float(p[3:])))
        for m in own})
    text += ("\n\nThe commands, in the order run (a command stopped part-way or run beside another: every cell's "
             "row is the last one written for it):\n\n```bash\n"
             + "\n".join(commands) + "\n```")
    (out / "table.md").write_text(text + "\n")
    per_seed(out, rows, commands)
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--k", default="2,4", help="the numbers of blocks / steps, comma-separated, of 2, 4")
    ap.add_argument("--out", default="results/fmnist-o1-strong/fusefl")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "run":
        command = " ".join(["python -m simulations.bench.fmnist_fusefl"] + (argv if argv is not None else sys.argv[1:]))
        ks = tuple(int(k) for k in a.k.split(","))
        for seed in (int(s) for s in a.seeds.split(",")):
            for alpha in (float(x) for x in a.alphas.split(",")):
                rows = run_cell(alpha, seed, ks)
                with open(out / "rows.jsonl", "a") as f:
                    for r in rows:
                        f.write(json.dumps({**r, "command": command}) + "\n")
    print(write_table(out))


if __name__ == "__main__":
    main()
