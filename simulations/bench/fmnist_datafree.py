"""Data-free one-shot peers on O1's strong clients (issue 59 item 2): DENSE and Co-Boosting, each a generator trained
against the clients' ensemble alternating with a fresh LeNet-5 student distilled from the ensemble on the generated
images; rows of docs/fashion-mnist.md's "O1 (strong clients)" table, with and without the head round.

- **DENSE** — Zhang et al., "DENSE: Data-Free One-Shot Federated Learning", NeurIPS 2022, arXiv 2112.12371; public
  code ``zj-jayzhang/DENSE`` (``loop_df_fl.py``, ``helpers/synthesizers.py``: ``AdvSynthesizer``, ``kd_train``).
  Per epoch: the generator is re-initialised (DCGAN init: N(0, 0.02) weights, BN scales N(1, 0.02)), a batch of latent
  codes z ~ N(0, I) and labels (sorted) is drawn, and generator + z are trained ``g_steps`` steps (Adam lr 1e-3,
  betas 0.5 / 0.999) on ``oh · CE(ensemble(aug(G(z))), labels) + adv · L_adv (+ bn · L_BN)``, the ensemble being the
  unweighted mean of the clients' logits, ``aug`` a random crop (padding 4) and a horizontal flip, ``L_adv`` minus the
  student-to-ensemble KL on the samples where their argmax disagree (mean over the batch); the batch of the step with
  the lowest loss is added to a pool that keeps every epoch's batch; then the student is distilled on the whole pool
  (random horizontal flips), KL at temperature T = 20 (× T²), SGD lr 0.005, momentum 0.9, batch 256 (the README's
  command; oh = bn = adv = 1, nz 256).
- **Co-Boosting** — Dai et al., "Enhancing One-Shot Federated Learning Through Data and Ensemble Co-Boosting",
  ICLR 2024, arXiv 2402.15070; public code ``rong-dai/Co-Boosting`` (``datafree/synthesis/coboost.py``,
  ``datafree_kd.py``: ``cb_kd_train``, ``co_boosting.sh``). DENSE's loop with (1) hard-sample weighting of the
  generator's cross-entropy, each sample's term times ``(1 − p_y)^hs`` (p_y the ensemble's probability of its label,
  detached; hs 1) and the adversarial term on every sample (KL at T = 3, × 9, no mask); the generator's gradient
  norm clipped at 10; unsorted labels, no augmentation in the synthesis step; (2) the ensemble's client weights
  re-weighted every epoch after the first on the synthetic pool: for each pool batch one signed-gradient step of the
  ensemble's cross-entropy to the pool's labels, ``w ← clip(w − μ · wdc^epoch · sign(∇w), 0, 1)`` (μ 0.01, wdc 0.99,
  one pass, |w − w₀| ≤ 1), the ensemble being Σ wᵢ · logitsᵢ / Σ wᵢ (w₀ = 1/m); (3) the student distilled on hard
  samples: every pool batch moved by ODS (output-diversified sampling: eps · sign of the gradient of a random
  direction (U(−1, 1)) of the ensemble's softmax at T 4; eps = 8/255, on the normalised images as the public code's
  pool transform normalises them) before the KD step, KL at T = 4 (× T²), SGD lr 0.01, momentum 0.9, weight decay
  1e-4, cosine schedule over the epochs, gradient norm clipped at 10, batch 128 (``co_boosting.sh``).

Both are **data-free**: the server uses only the five uploaded models (one exchange); fedfuse's 1,000-image fusion
set is not used, nor are test labels except for the reported accuracy (and the per-epoch curve, which changes
nothing). The student is a fresh LeNet-5 (``build_model('lenet', seed=…)``), as both public codes start from a fresh
global model.

**Deviations from the papers / public code** (all fixed before any reported cell was run; CPU, 1 thread):

- No BatchNorm term: fedfuse's LeNet-5 (``fedfuse/models/lenet.py``) has no BatchNorm layer, so DENSE's BN-statistics
  loss (DeepInversion hooks on the teachers' BN layers) has nothing to match and is dropped (as Co-Boosting's public
  code does by default, ``--bn 0``).
- Budget: ``EPOCHS`` epochs of ``G_STEPS`` generator steps, the same for both methods and all cells, against the
  papers' 200 epochs × 30 steps: 40 × 30, chosen by the time one epoch takes on the tuning split α 0.3 seed 100
  (``time --epochs 3``: 3.0 s DENSE, 3.7 s Co-Boosting per epoch, about 6 local epochs of a client; 20 runs had to
  fit in about 70 minutes of 2 shared cores); the accuracy curve over epochs there is in ``results/fmnist-o1-strong/datafree/tuning-curve.json``).
- The generator's width ``NGF`` is 16 (the public codes' ngf 64: 16× the multiply-adds), and DENSE's batch is
  Co-Boosting's 128 (its README: 256), for the CPU; the generator makes 28×28 images directly (init size 7; Co-Boosting's code makes 32×32 for MNIST-like
  data). Its output (sigmoid, pixels in [0, 1]) is normalised by the clients' mean / std (the strong clients take
  normalised inputs). The pool keeps float images (the public codes save and reload 8-bit PNGs).
- No checkpoint selection on test accuracy: the student after the last epoch is reported (DENSE's code logs the best
  test accuracy over epochs; that would read test labels).

Per cell: the ensemble (fedfuse's: mean softmax weighted by samples), each method's student with and without the
head round (``fmnist_oneshot.head_round``), the server seconds of the whole data-free loop and, in the same process
right before it, one local epoch of client 0 with the clients' recipe (``fmnist_strong.fit``, a copy of its model).
``run`` appends to ``rows.jsonl`` (untracked); ``table`` writes ``table.md`` and one compact JSON per cell.

    .venv/bin/python -m simulations.bench.fmnist_datafree time --epochs 3 --out /tmp/dftest
    .venv/bin/python -m simulations.bench.fmnist_datafree tune --out results/fmnist-o1-strong/datafree
    .venv/bin/python -m simulations.bench.fmnist_datafree run --alphas 0.1,0.3,0.5 --seeds 0 --out results/fmnist-o1-strong/datafree
    .venv/bin/python -m simulations.bench.fmnist_datafree run --alphas 0.1,0.3,0.5 --seeds 1 --out results/fmnist-o1-strong/datafree
    .venv/bin/python -m simulations.bench.fmnist_datafree run --alphas 0.1,0.3,0.5 --seeds 2 --out results/fmnist-o1-strong/datafree
      (stopped for time after α 0.1: seed 2 of α 0.3 / 0.5 is missing)
    .venv/bin/python -m simulations.bench.fmnist_datafree table --out results/fmnist-o1-strong/datafree
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fedfuse.models import build_model  # noqa: E402
from fedfuse.training import predict_logits  # noqa: E402

# the budget, the same for both methods and every cell (papers: 200 epochs × 30 generator steps, ngf 64,
# batches 256 (DENSE) / 128 (Co-Boosting)); see the module docstring
EPOCHS, G_STEPS, NGF, NZ = 40, 30, 16, 256
METHODS = {
    "dense": {"batch": 128, "kd_lr": 0.005, "kd_T": 20.0, "weight_decay": 0.0, "cosine": False, "clip": None,
              "oh": 1.0, "adv": 1.0, "adv_T": 1.0, "adv_mask": True, "hs": 0.0, "sorted_labels": True,
              "synth_aug": True, "kd_flip": True, "reweight": False, "ods": 0.0, "g_clip": None},
    "co-boosting": {"batch": 128, "kd_lr": 0.01, "kd_T": 4.0, "weight_decay": 1e-4, "cosine": True, "clip": 10.0,
                    "oh": 1.0, "adv": 1.0, "adv_T": 3.0, "adv_mask": False, "hs": 1.0, "sorted_labels": False,
                    "synth_aug": False, "kd_flip": False, "reweight": True, "mu": 0.01, "wdc": 0.99,
                    "ods": 8 / 255, "g_clip": 10.0},
}
OUT = Path("results/fmnist-o1-strong/datafree")
MEAN, STD = 0.2860, 0.3530


class Generator(nn.Module):
    """DENSE's / Co-Boosting's DCGAN-style generator (Linear → BN → up ×2 → conv-BN-LReLU → up ×2 → conv-BN-LReLU →
    conv → sigmoid), for 28×28 single-channel images; output normalised as the clients' inputs."""

    def __init__(self, nz: int = NZ, ngf: int = NGF, size: int = 28, channels: int = 1):
        super().__init__()
        self.init = size // 4
        self.l1 = nn.Linear(nz, 2 * ngf * self.init ** 2)
        self.body = nn.Sequential(
            nn.BatchNorm2d(2 * ngf), nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, 2 * ngf, 3, padding=1, bias=False), nn.BatchNorm2d(2 * ngf), nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, ngf, 3, padding=1, bias=False), nn.BatchNorm2d(ngf), nn.LeakyReLU(0.2),
            nn.Conv2d(ngf, channels, 3, padding=1), nn.Sigmoid())

    def forward(self, z: torch.Tensor) -> torch.Tensor:   # pixels in [0, 1]
        return self.body(self.l1(z).view(len(z), -1, self.init, self.init))

    def reset(self) -> None:
        """The public codes' ``reset_model``: DCGAN initialisation, every epoch."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.normal_(m.weight, 1.0, 0.02)
                nn.init.zeros_(m.bias)


def normalise(x: torch.Tensor) -> torch.Tensor:
    return (x - MEAN) / STD


def crop_flip(x: torch.Tensor, gen: torch.Generator, pad: int = 4) -> torch.Tensor:
    """DENSE's synthesis augmentation, per sample and differentiable: a random crop of the zero-padded image (pixel
    space) and a random horizontal flip."""
    b, _, h, w = x.shape
    p = F.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=gen)
    rows = (oy[:, None] + torch.arange(h))[:, :, None]
    cols = (ox[:, None] + torch.arange(w))[:, None, :]
    out = p[torch.arange(b)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)
    return flip(out, gen)


def flip(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    f = torch.rand(len(x), generator=gen) < 0.5
    return torch.where(f[:, None, None, None], x.flip(-1), x)


def ens_logits(teachers: list[nn.Module], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ wᵢ · logitsᵢ / Σ wᵢ (DENSE: w uniform, the mean of the logits; Co-Boosting: its re-weighted w)."""
    return sum(wi * t(x) for wi, t in zip(w, teachers)) / w.sum()


def kl(s: torch.Tensor, t: torch.Tensor, T: float) -> torch.Tensor:
    """Per-sample KL(softmax(t / T) ‖ softmax(s / T)) × T² (the public codes' ``kldiv``, summed over classes)."""
    return F.kl_div(F.log_softmax(s / T, 1), F.softmax(t / T, 1), reduction="none").sum(1) * T * T


def datafree(teachers: list[nn.Module], method: str, seed: int, epochs: int = EPOCHS, g_steps: int = G_STEPS,
             ngf: int = NGF, test=None, num_classes: int = 10) -> tuple[nn.Module, dict]:
    """DENSE or Co-Boosting (``METHODS``) on the frozen ``teachers``: a fresh LeNet-5 student and its info (the
    ensemble weights, the seconds of the loop, and with ``test`` = (tx, ty) its test accuracy after every epoch, not
    timed)."""
    cfg = METHODS[method]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    teachers = [copy.deepcopy(t).eval().requires_grad_(False) for t in teachers]
    student = build_model("lenet", num_classes, (1, 28, 28), seed=seed * 1000 + 777)
    generator = Generator(ngf=ngf)
    w = torch.full((len(teachers),), 1.0 / len(teachers))
    opt = torch.optim.SGD(student.parameters(), lr=cfg["kd_lr"], momentum=0.9, weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs) if cfg["cosine"] else None
    pool_x, pool_y = [], []
    curve, weights, seconds, b = [], [], 0.0, cfg["batch"]
    for ep in range(epochs):
        t0 = time.perf_counter()
        # 1. synthesis: a re-initialised generator and fresh codes, g_steps of Adam, the lowest-loss batch kept
        generator.reset()
        generator.train()
        student.eval()
        z = torch.randn(b, NZ, generator=gen).requires_grad_(True)
        y = torch.randint(0, num_classes, (b,), generator=gen)
        if cfg["sorted_labels"]:
            y = y.sort().values
        gopt = torch.optim.Adam([{"params": generator.parameters()}, {"params": [z]}], lr=1e-3, betas=(0.5, 0.999))
        best, best_x = math.inf, None
        for _ in range(g_steps):
            gopt.zero_grad(set_to_none=True)
            px = generator(z)
            x = normalise(crop_flip(px, gen) if cfg["synth_aug"] else px)
            t_out = ens_logits(teachers, x, w)
            ce = F.cross_entropy(t_out, y, reduction="none")
            if cfg["hs"]:
                p_y = F.softmax(t_out, 1).gather(1, y[:, None])[:, 0].detach()
                ce = (1 - p_y).pow(cfg["hs"]) * ce
            s_out = student(x)
            d = kl(s_out, t_out, cfg["adv_T"])
            if cfg["adv_mask"]:
                d = d * (s_out.argmax(1) != t_out.argmax(1)).float()
            loss = cfg["oh"] * ce.mean() - cfg["adv"] * d.mean()
            loss.backward()
            if cfg["g_clip"]:
                nn.utils.clip_grad_norm_(generator.parameters(), cfg["g_clip"])
            gopt.step()
            if loss.item() < best:   # the public codes keep the inputs of the lowest-loss step (before its update)
                best, best_x = loss.item(), px.detach().clone()
        pool_x.append(best_x)
        pool_y.append(y)
        px_all, y_all = torch.cat(pool_x), torch.cat(pool_y)
        # 2. Co-Boosting: the ensemble's client weights re-weighted on the synthetic pool (after the first epoch)
        if cfg["reweight"] and ep > 0:
            w0, step = w.clone(), cfg["mu"] * cfg["wdc"] ** ep
            for idx in torch.randperm(len(y_all), generator=gen).split(b):
                wv = w.clone().requires_grad_(True)
                F.cross_entropy(ens_logits(teachers, normalise(px_all[idx]), wv), y_all[idx]).backward()
                w = torch.clamp(w0 + torch.clamp(w - step * wv.grad.sign() - w0, -1, 1), 0.0, 1.0).detach()
        # 3. the student distilled on the whole pool
        student.train()
        for idx in torch.randperm(len(y_all), generator=gen).split(b):
            px = px_all[idx]
            x = normalise(flip(px, gen) if cfg["kd_flip"] else px)
            if cfg["ods"]:
                x = x.clone().requires_grad_(True)
                t = ens_logits(teachers, x, w)
                r = torch.rand(t.shape, generator=gen) * 2 - 1
                (r * F.softmax(t / 4, 1)).sum().backward()
                x = (x + cfg["ods"] * x.grad.sign()).detach()
            with torch.no_grad():
                t_out = ens_logits(teachers, x, w)
            opt.zero_grad(set_to_none=True)
            kl(student(x), t_out, cfg["kd_T"]).mean().backward()
            if cfg["clip"]:
                nn.utils.clip_grad_norm_(student.parameters(), cfg["clip"])
            opt.step()
        if sched is not None:
            sched.step()
        student.eval()
        seconds += time.perf_counter() - t0
        weights.append([float(v) for v in w])
        if test is not None:
            curve.append(float((predict_logits(student, test[0]).argmax(1) == test[1]).float().mean()))
    return student, {"seconds": seconds, "weights": weights[-1], "curve": curve, "pool": int(len(torch.cat(pool_y)))}


def local_epoch_seconds(clients: list[dict], seed: int) -> float:
    """One local epoch of client 0 with the clients' recipe (a copy of its model), timed in this process."""
    from simulations.bench.fmnist_strong import RECIPE, fit

    c = clients[0]
    info = fit(copy.deepcopy(c["model"]), c["x"], c["y"], c["vx"][:10], c["vy"][:10], lr=RECIPE["lr"],
               weight_decay=RECIPE["weight-decay"], epochs=1, seed=seed, early_stop=False)
    return info["train-seconds"]


def head_traffic(clients: list[dict]) -> float:
    """The head round's uplink per client in model uploads: its ridge statistics (Gram + cross) over the model size."""
    size = sum(p.numel() for p in clients[0]["model"].parameters())
    f = list(clients[0]["model"].parameters())[-1].numel()   # classes
    d = list(clients[0]["model"].parameters())[-2].shape[1] + 1   # features + bias
    return (d * d + d * f) / size


def run_cell(alpha: float | str, seed: int, methods: list[str], epochs: int = EPOCHS, curve: bool = True) -> list[dict]:
    from simulations.bench.fmnist_oneshot import head_round
    from simulations.bench.fmnist_strong import ensemble_acc, strong_clients, strong_data

    clients = strong_clients(alpha, seed)
    tx, ty, _ = strong_data(alpha, seed)   # the fusion set is not used: data-free
    models, n = [c["model"] for c in clients], [c["n"] for c in clients]
    part = alpha if isinstance(alpha, str) else f"dir{float(alpha):g}"
    base = {"part": part, "seed": seed}
    rows = [{**base, "method": "ensemble", "accuracy": ensemble_acc([predict_logits(m, tx) for m in models], n, ty)}]
    for method in methods:
        ep_secs = local_epoch_seconds(clients, seed)
        student, info = datafree(models, method, seed, epochs=epochs, test=(tx, ty) if curve else None)
        headed, hinfo = head_round(student, clients)
        row = {**base, "method": method, "accuracy": float((predict_logits(student, tx).argmax(1) == ty).float().mean()),
               "with-head": float((predict_logits(headed, tx).argmax(1) == ty).float().mean()),
               "solver": hinfo["solver"], "epochs": epochs, "g-steps": G_STEPS, "ngf": NGF,
               "batch": METHODS[method]["batch"], "server-seconds": info["seconds"], "epoch-seconds": ep_secs,
               "seconds-ratio": info["seconds"] / ep_secs, "traffic": 1.0, "traffic-head": 1.0 + head_traffic(clients),
               "ensemble-weights": info["weights"], "curve": info["curve"], "pool": info["pool"]}
        rows.append(row)
        print(f"  {part} s{seed} {method:<12} {row['accuracy']:.4f} -> head {row['with-head']:.4f} "
              f"({hinfo['solver']}); {info['seconds']:.0f}s = {row['seconds-ratio']:.1f} local epochs "
              f"({ep_secs:.2f}s); ensemble {rows[0]['accuracy']:.4f}; curve "
              + " ".join(f"{100 * a:.1f}" for a in info["curve"]), flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------- table

def rows_of(out: Path) -> list[dict]:
    path = out / "rows.jsonl"
    if path.exists():
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    else:   # rebuilt from the tracked per-cell JSON
        rows = []
        for p in sorted(out.glob("fmnist-dir*-n5-s*.json")):
            d = json.loads(p.read_text())
            rows += [{"part": d["part"], "seed": d["seed"], **r} for r in d["rows"]]
    return list({(r["part"], r["seed"], r["method"]): r for r in rows}.values())


def references(part: str, seed: int) -> dict:
    """``kf-linear`` + head round and the ensemble of the cell, from O1 (strong)'s tracked per-seed JSON."""
    p = Path("results/fmnist-o1-strong") / f"fmnist-{part}-n5-s{seed}.json"
    if not p.exists():
        return {}
    rows = {r["method"]: r for r in json.loads(p.read_text())["rows"]}
    return {"kf-linear + head round": rows["kf-linear"]["with-head"], "ensemble": rows["ensemble"]["accuracy"]}


def _ms(v: list[float], signed: bool = False, scale: float = 100.0, digits: int = 1) -> str:
    if not v:
        return ""
    m = scale * float(np.mean(v))
    text = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return text + (f" ± {scale * float(np.std(v, ddof=1)):.{digits}f}" if len(v) > 1 else "") + f" (n={len(v)})"


NAMES = {"dense": "DENSE", "co-boosting": "Co-Boosting"}


def table(rows: list[dict]) -> str:
    parts = sorted({r["part"] for r in rows}, key=lambda p: float(p[3:]))
    cell = {(r["part"], r["seed"], r["method"]): r for r in rows}
    methods = [m for m in NAMES if any(r["method"] == m for r in rows)]
    head = " | ".join(f"α = {p[3:]}" for p in parts)
    lines = ["mean ± sample std (ddof=1) over seeds; test accuracy in %; data-free (the fusion set is not used)", "",
             f"| row | exchanges | uplink per client (model uploads) | server s ÷ one local epoch | {head} |",
             "|---|---|---|---|" + "---|" * len(parts)]
    ens = [_ms([r["accuracy"] for (p, _, m), r in cell.items() if p == part and m == "ensemble"]) for part in parts]
    lines.append("| clients' ensemble | 1 | 1 | | " + " | ".join(ens) + " |")
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        ratio = f"{np.mean([r['seconds-ratio'] for r in rs]):.0f} ({min(r['seconds-ratio'] for r in rs):.0f}–" \
                f"{max(r['seconds-ratio'] for r in rs):.0f})"
        for key, ex, tr in (("accuracy", "1", "1"), ("with-head", "2 (+ head round)",
                                                       f"{np.mean([r['traffic-head'] for r in rs]):.2f}")):
            cells = [_ms([r[key] for (p, _, mm), r in cell.items() if p == part and mm == m]) for part in parts]
            lines.append(f"| {NAMES[m]} ({rs[0]['epochs']} epochs × {rs[0]['g-steps']} generator steps) | {ex} | {tr} "
                         f"| {ratio} | " + " | ".join(cells) + " |")
    lines += ["", "Paired per seed (same clients): the row minus the reference, points; per-seed values in brackets "
              "(seeds in order). References from O1 (strong)'s per-seed JSON (`results/fmnist-o1-strong/`).", "",
              f"| row | against | {head} |", "|---|---|" + "---|" * len(parts)]
    for m in methods:
        for key, label in (("accuracy", "1 exchange"), ("with-head", "+ head round")):
            for ref in ("kf-linear + head round", "ensemble"):
                cells = []
                for part in parts:
                    vals = []
                    for (p, s, mm), r in sorted(cell.items()):
                        if p == part and mm == m:
                            refs = references(p, s)
                            if ref in refs:
                                vals.append(r[key] - refs[ref])
                    cells.append(_ms(vals, signed=True) + (" [" + ", ".join(f"{100 * x:+.1f}" for x in vals) + "]"
                                                           if vals else ""))
                lines.append(f"| {NAMES[m]} ({label}) | {ref} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curves(out: Path, rows: list[dict], every: int = 5) -> str:
    """The students' test accuracy over the epochs: on the tuning split (``tuning-curve.json``) and the mean over the
    reported cells per α, every ``every`` epochs, so that the reader sees whether a larger budget would help."""
    lines = ["", "", "Test accuracy (%) of the student (one exchange) after epoch e: the tuning split α 0.3 seed 100, and "
             "the mean over the reported cells' seeds", ""]
    tuning = out / "tuning-curve.json"
    series = []
    if tuning.exists():
        series += [(f"{NAMES[r['method']]}, tuning split", [r["curve"]]) for r in json.loads(tuning.read_text())["rows"]
                   if r["method"] in NAMES]
    for m in NAMES:
        for part in sorted({r["part"] for r in rows}, key=lambda p: float(p[3:])):
            cs = [r["curve"] for r in rows if r["method"] == m and r["part"] == part and r.get("curve")]
            if cs:
                series.append((f"{NAMES[m]}, α = {part[3:]} (n={len(cs)})", cs))
    if not series:
        return ""
    length = max(len(c[0]) for _, c in series)
    marks = [e for e in range(every, length + 1, every)] or [length]
    lines += ["| student | " + " | ".join(f"e {e}" for e in marks) + " |", "|---|" + "---|" * len(marks)]
    for name, cs in series:
        lines.append(f"| {name} | " + " | ".join(f"{100 * float(np.mean([c[e - 1] for c in cs])):.1f}" for e in marks)
                     + " |")
    return "\n".join(lines)


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def per_seed(out: Path, rows: list[dict]) -> None:
    cells = defaultdict(list)
    for r in rows:
        cells[f"fmnist-{r['part']}-n5-s{r['seed']}"].append(r)
    for name, cell in cells.items():
        own = [_rounded({k: v for k, v in r.items() if k not in ("part", "seed", "command")}) for r in cell]
        (out / f"{name}.json").write_text(json.dumps({"cell": name, "part": cell[0]["part"], "seed": cell[0]["seed"],
                                                      "rows": own}, separators=(",", ":")))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("tune", "time", "run", "table"))
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default="dense,co-boosting")
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m simulations.bench.fmnist_datafree"] + (argv if argv is not None else sys.argv[1:]))
    if a.what in ("tune", "time"):   # the tuning split α 0.3, seed 100: the accuracy curve over epochs
        rows = run_cell("dir0.3", 100, a.methods.split(","), epochs=a.epochs)
        if a.what == "tune":
            (out / "tuning-curve.json").write_text(json.dumps(
                {"split": "dir0.3 seed 100 (tuning; no table reports it)", "command": command,
                 "rows": [_rounded(r) for r in rows]}, separators=(",", ":")))
        return
    if a.what == "run":
        for alpha in (float(x) for x in a.alphas.split(",")):
            for seed in (int(s) for s in a.seeds.split(",")):
                rows = run_cell(alpha, seed, a.methods.split(","), epochs=a.epochs)
                with open(out / "rows.jsonl", "a") as f:
                    for r in rows:
                        f.write(json.dumps({**r, "command": command}) + "\n")
    rows = rows_of(out)
    raw = (out / "rows.jsonl").read_text().splitlines() if (out / "rows.jsonl").exists() else []
    commands = [c for c in dict.fromkeys(json.loads(x).get("command") for x in raw if x.strip()) if c]
    text = table(rows) + curves(out, rows) + "\n\nThe commands, in the order run:\n\n```bash\n" + "\n".join(commands) + "\n```"
    (out / "table.md").write_text(text + "\n")
    per_seed(out, rows)
    print(text)


if __name__ == "__main__":
    main()
