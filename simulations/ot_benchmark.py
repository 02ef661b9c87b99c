"""Benchmarks for issue #4 that the shared one-shot runner does not cover.

    python -m simulations.ot_benchmark hetero    --seeds 0,1,2 --out results/ot
    python -m simulations.ot_benchmark transport --seeds 0,1,2 --out results/ot
    python -m simulations.ot_benchmark timing    --out results/ot
    bash simulations/ot_one_shot.sh   # every issue-#4 benchmark (one-shot rows, hetero, transport, timing)

- ``hetero``: width-heterogeneous one-shot fusion. Even clients (incl. the reference, client 0) have
  width ``w``, odd clients ``2w``; ``ot`` fuses all of them into client 0's width (vanilla averaging
  is impossible). Compared with the ensemble, the best client, OT over the narrow clients only, and
  ``kd`` (distillation into client 0's architecture) when it accepts mixed widths.
- ``transport``: TransFusion's task-vector transport (seed 003, spec §2.1/§2.7) at small scale: two
  "base releases" θ_A, θ_B of a small timm ViT, pretrained from different seeds on the original task
  (digits / MNIST-1D); a delta τ fine-tuned from θ_A on a shifted task (digits rotated 90°, MNIST-1D
  time-reversed); θ_B + α·π(τ) vs θ_B + τ (naive) vs θ_B. Task and support (original task) accuracy.
- ``timing``: fusion time of 4 ViT clients (Sinkhorn OT and others) against ``average`` and one
  forward pass of one model over the fusion set (the issue's performance goal).

Outputs ``<out>/<case>.json`` (raw rows) and ``<out>/<case>.md`` (mean ± std over seeds).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedfuse.data import FederatedData, load_source
from fedfuse.fusion import fuse
from fedfuse.models import build_model
from fedfuse.rebase import match_bases, task_vector, transport
from fedfuse.training import evaluate, predict_logits, train


def _ms(vals, scale=100.0, digits=1):
    vals = [v for v in vals if v == v]
    if not vals:
        return "n/a"
    m = statistics.mean(vals) * scale
    s = (statistics.stdev(vals) * scale) if len(vals) > 1 else 0.0
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def _acc(model, x, y) -> float:
    return float(evaluate(model, x, y)["accuracy"])


# ------------------------------------------------------------------------------------------------------
# width-heterogeneous fusion
# ------------------------------------------------------------------------------------------------------

HETERO_METHODS = {
    "ot (emd, acts)": ("ot", dict(solver="emd")),
    "ot (sinkhorn, acts)": ("ot", dict(solver="sinkhorn", reg=0.05)),
    "ot (emd, weights)": ("ot", dict(solver="emd", cost="weights")),
    "ot (emd, acts) + finetune 10": ("ot", dict(solver="emd", finetune=dict(epochs=10))),
    "kd": ("kd", {}),
}


def run_hetero(seeds, datasets, partitions, models, width_of, epochs, out: Path, stem: str = "hetero"):
    rows = []
    for ds in datasets:
        for part in partitions:
            n = int("".join(c for c in part if c.isdigit()))
            method = part.rstrip("0123456789")
            for model in models:
                for seed in seeds:
                    data = FederatedData.build(ds, n, method, alpha=0.5, fusion_size=300, fusion_source="client0",
                                               seed=seed)
                    w = width_of[model]
                    clients, widths = [], []
                    for pid in range(n):
                        wk = w if pid % 2 == 0 else 2 * w
                        extra = {"num_heads": 4} if model == "vit" else {}
                        m = build_model(model, num_classes=data.num_classes, input_shape=data.input_shape, width=wk,
                                        seed=seed * 1000 + pid, **extra)
                        tr, _ = data.client_data(pid, 0.1, seed)
                        train(m, tr.x, tr.y, epochs=epochs[model], lr=1e-3, seed=seed * 1000 + pid)
                        clients.append(m.eval())
                        widths.append(wk)
                    tx, ty = data.test.x, data.test.y
                    base = dict(dataset=ds, partition=part, model=model, seed=seed, widths=widths)
                    accs = [_acc(m, tx, ty) for m in clients]
                    rows.append({**base, "method": "best client", "accuracy": max(accs), "seconds": 0.0})
                    rows.append({**base, "method": "reference client (narrow)", "accuracy": accs[0], "seconds": 0.0})
                    ens = fuse("ensemble", clients)
                    rows.append({**base, "method": "ensemble", "accuracy": _acc(ens, tx, ty), "seconds": 0.0})
                    narrow = [m for m, wk in zip(clients, widths) if wk == w]
                    t0 = time.perf_counter()
                    avg = fuse("average", narrow)
                    t_avg = time.perf_counter() - t0
                    rows.append({**base, "method": "average (narrow clients only)", "accuracy": _acc(avg, tx, ty),
                                 "seconds": t_avg})
                    t0 = time.perf_counter()
                    on = fuse("ot", narrow, fusion_inputs=data.fusion_x, solver="emd", seed=seed)
                    rows.append({**base, "method": "ot (emd, acts), narrow clients only", "accuracy": _acc(on, tx, ty),
                                 "seconds": time.perf_counter() - t0})
                    try:
                        fuse("average", clients)
                        status = "unexpected: average accepted mixed widths"
                    except ValueError as e:
                        status = f"n/a ({str(e)[:60]}...)"
                    rows.append({**base, "method": "average (all clients)", "accuracy": float("nan"), "seconds": 0.0,
                                 "status": status})
                    for label, (name, opts) in HETERO_METHODS.items():
                        t0 = time.perf_counter()
                        try:
                            fused = fuse(name, clients, fusion_inputs=data.fusion_x, seed=seed, **opts)
                            acc, st = _acc(fused, tx, ty), "ok"
                        except ValueError as e:
                            acc, st = float("nan"), f"n/a: {e}"
                        except Exception as e:  # keep the sweep going; recorded in the table
                            acc, st = float("nan"), f"error: {type(e).__name__}: {e}"
                        rows.append({**base, "method": label, "accuracy": acc, "seconds": time.perf_counter() - t0,
                                     "status": st})
                    print(f"{ds}/{part}/{model} seed {seed}: " + ", ".join(
                        f"{r['method']}={r['accuracy']:.3f}" for r in rows if r["seed"] == seed and r["dataset"] == ds
                        and r["partition"] == part and r["model"] == model), flush=True)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    lines = ["# Width-heterogeneous one-shot fusion (clients of widths w and 2w fused into client 0's width w)", "",
             f"Seeds {seeds}; fusion set: 300 samples from client 0; accuracy % (mean ± std); time in seconds.", ""]
    settings = sorted({(r["dataset"], r["partition"], r["model"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines.append("| method | " + " | ".join(f"{d}/{p}/{m}" for d, p, m in settings) + " | fusion s |")
    lines.append("|---" * (len(settings) + 2) + "|")
    for meth in methods:
        cells = []
        for s in settings:
            rs = [r for r in rows if (r["dataset"], r["partition"], r["model"]) == s and r["method"] == meth]
            if rs and all(r["accuracy"] != r["accuracy"] for r in rs):
                cells.append(rs[0].get("status", "n/a")[:40])
            else:
                cells.append(_ms([r["accuracy"] for r in rs]))
        secs = [r["seconds"] for r in rows if r["method"] == meth and r["accuracy"] == r["accuracy"]]
        lines.append(f"| {meth} | " + " | ".join(cells) + f" | {_ms(secs, 1.0, 2)} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ------------------------------------------------------------------------------------------------------
# task-vector transport
# ------------------------------------------------------------------------------------------------------


def _shift(ds: str, x: torch.Tensor) -> torch.Tensor:
    """The fine-tuning task's input shift: digits rotated 90°, MNIST-1D reversed in time."""
    if x.dim() == 4:
        return torch.rot90(x, 1, dims=(2, 3)).contiguous()
    return torch.flip(x, dims=(-1,)).contiguous()


def run_transport(seeds, datasets, out: Path, width=32, depth=2, heads=4, pre_epochs=30, ft_epochs=10,
                  alphas=(0.5, 1.0, 1.5), stem: str = "transport"):
    rows = []
    for ds in datasets:
        for seed in seeds:
            train_set, test_set = load_source(ds, seed=seed)
            x, y = train_set.x, train_set.y
            tx, ty = test_set.x, test_set.y
            sx, stx = _shift(ds, x), _shift(ds, tx)
            nc = int(y.max()) + 1
            shape = tuple(x.shape[1:])
            bases = []
            for r in range(2):  # two "releases": same data and recipe, different initialisation / data order
                m = build_model("vit", num_classes=nc, input_shape=shape, width=width, depth=depth, num_heads=heads,
                                seed=seed * 100 + r)
                train(m, x, y, epochs=pre_epochs, lr=1e-3, seed=seed * 100 + r)
                bases.append(m.eval())
            a, b = bases
            ft = build_model("vit", num_classes=nc, input_shape=shape, width=width, depth=depth, num_heads=heads)
            ft.load_state_dict(a.state_dict())
            half = len(sx) // 2  # the fine-tuning task sees half the training set, shifted
            train(ft, sx[:half], y[:half], epochs=ft_epochs, lr=5e-4, seed=seed)
            tau = task_vector(ft.eval(), a)

            def rec(label, model, secs=0.0):
                rows.append(dict(dataset=ds, seed=seed, method=label, task=_acc(model, stx, ty),
                                 support=_acc(model, tx, ty), seconds=secs))

            rec("θ_A (old base)", a)
            rec("θ_A + τ (fine-tuned, source)", ft)
            rec("θ_B (new base, zero-shot)", b)
            for alpha in alphas:
                naive = build_model("vit", num_classes=nc, input_shape=shape, width=width, depth=depth, num_heads=heads)
                naive.load_state_dict({k: v + alpha * tau[k] if k in tau else v for k, v in b.state_dict().items()})
                rec(f"θ_B + {alpha}·τ (naive)", naive.eval())
            for method, residual in (("transfusion", "untied"), ("transfusion", "tied"), ("rebasin", "untied")):
                t0 = time.perf_counter()
                maps, _, _ = match_bases(a, b, residual=residual, method=method, seed=seed)
                secs = time.perf_counter() - t0
                for alpha in alphas:
                    moved = transport(tau, a, b, alpha=alpha, residual=residual, maps=maps)
                    rec(f"θ_B + {alpha}·π(τ), {method} ({residual})", moved.eval(), secs)
            # control: the new release is a permuted copy of the old one → transport must be exact
            from fedfuse.fusion.permute import build_spec, permute_model, random_perms
            pb = permute_model(a, random_perms(build_spec(a), seed=seed))
            rec("control: θ_B' = π0(θ_A); θ_B' + π(τ), transfusion", transport(tau, a, pb).eval())
            print(f"{ds} seed {seed}: " + ", ".join(f"{r['method']}: {r['task']:.3f}/{r['support']:.3f}"
                                                    for r in rows if r["seed"] == seed and r["dataset"] == ds),
                  flush=True)
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    lines = ["# Task-vector transport between two base releases of a small ViT (TransFusion use (b))", "",
             f"ViT width {width}, depth {depth}, {heads} heads; bases pretrained {pre_epochs} epochs from different "
             f"seeds on the original task; τ = {ft_epochs} epochs of fine-tuning θ_A on the shifted task (digits "
             "rotated 90°, MNIST-1D time-reversed; half the training set). Task = shifted test set, support = "
             f"original test set. Accuracy % (mean ± std over seeds {seeds}); Δ vs θ_B.", ""]
    for ds in datasets:
        lines += [f"## {ds}", "", "| method | task acc | support acc | Δ task vs θ_B | Δ support vs θ_B | match s |",
                  "|---|---|---|---|---|---|"]
        dr = [r for r in rows if r["dataset"] == ds]
        for meth in dict.fromkeys(r["method"] for r in dr):
            rs = [r for r in dr if r["method"] == meth]
            bs = {r["seed"]: r for r in dr if r["method"].startswith("θ_B (new base")}
            dt = [r["task"] - bs[r["seed"]]["task"] for r in rs]
            dsu = [r["support"] - bs[r["seed"]]["support"] for r in rs]
            lines.append(f"| {meth} | {_ms([r['task'] for r in rs])} | {_ms([r['support'] for r in rs])} | "
                         f"{_ms(dt)} | {_ms(dsu)} | {_ms([r['seconds'] for r in rs], 1.0, 2)} |")
        lines.append("")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ------------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------------


def run_timing(out: Path, repeats: int = 9, seed: int = 0):
    data = FederatedData.build("digits", 4, "dirichlet", alpha=0.5, fusion_size=300, fusion_source="client0", seed=seed)
    clients = []
    for pid in range(4):
        m = build_model("vit", num_classes=data.num_classes, input_shape=data.input_shape, width=32, depth=2,
                        num_heads=4, seed=pid)
        tr, _ = data.client_data(pid, 0.1, seed)
        train(m, tr.x, tr.y, epochs=10, lr=1e-3, seed=pid)
        clients.append(m.eval())
    X = data.fusion_x
    fuse("ot", clients, fusion_inputs=X, solver="sinkhorn")  # warm-up (POT import etc.)

    cases = {
        "average": lambda: fuse("average", clients),
        "one forward pass of one client over the fusion set (300)": lambda: predict_logits(clients[0], X),
        "ot sinkhorn, activations (4 clients)": lambda: fuse("ot", clients, fusion_inputs=X, solver="sinkhorn"),
        "ot emd, activations": lambda: fuse("ot", clients, fusion_inputs=X, solver="emd"),
        "ot emd, weights": lambda: fuse("ot", clients, fusion_inputs=X, solver="emd", cost="weights"),
        "rebasin, activations": lambda: fuse("rebasin", clients, fusion_inputs=X),
        "rebasin, weights": lambda: fuse("rebasin", clients, matching="weights"),
        "transfusion": lambda: fuse("transfusion", clients),
    }
    # repeats interleaved over the cases (load drifts on a shared machine hit every case alike);
    # process CPU time (1 torch thread) is the primary measure, wall time is reported beside it
    wall = {k: [] for k in cases}
    cpu = {k: [] for k in cases}
    for _ in range(repeats):
        for k, fn in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[k].append(time.process_time() - c0)
            wall[k].append(time.perf_counter() - t0)
    res = {k: {"cpu": statistics.median(cpu[k]), "wall": statistics.median(wall[k])} for k in cases}
    avg_k, fwd_k = "average", "one forward pass of one client over the fusion set (300)"
    lines = ["# Fusion time, 4 timm ViT clients (width 32, depth 2, 4 heads, digits 8×8), CPU, 1 thread", "",
             f"Median of {repeats} interleaved repeats. Fusion set: 300 samples. Ratios use process CPU time (robust "
             "on a shared machine); wall time beside it.", "",
             "| method | CPU s | × average | × (average + one forward pass) | wall s | wall × (avg + fwd) |",
             "|---|---|---|---|---|---|"]
    for k, v in res.items():
        unit_c = res[avg_k]["cpu"] + res[fwd_k]["cpu"]
        unit_w = res[avg_k]["wall"] + res[fwd_k]["wall"]
        lines.append(f"| {k} | {v['cpu']:.4f} | {v['cpu'] / res[avg_k]['cpu']:.1f} | {v['cpu'] / unit_c:.1f} | "
                     f"{v['wall']:.4f} | {v['wall'] / unit_w:.1f} |")
    cases = res
    (out / "timing.md").write_text("\n".join(lines) + "\n")
    (out / "timing.json").write_text(json.dumps(cases, indent=1))
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=["hetero", "transport", "timing"])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--datasets", default="digits,mnist1d")
    ap.add_argument("--partitions", default="shards2,dirichlet4")
    ap.add_argument("--models", default="mlp,vit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/ot")
    ap.add_argument("--tag", default="", help="output stem suffix: <out>/<case>_<tag>.{json,md} (keeps earlier runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    datasets = [d for d in args.datasets.split(",") if d]
    stem = f"{args.case}_{args.tag}" if args.tag else args.case
    if args.case == "hetero":
        run_hetero(seeds, datasets, [p for p in args.partitions.split(",") if p], [m for m in args.models.split(",") if m],
                   {"mlp": 64, "cnn": 16, "resnet": 16, "vit": 32}, {"mlp": 40, "cnn": 30, "resnet": 20, "vit": 30}, out, stem)
    elif args.case == "transport":
        run_transport(seeds, datasets, out, stem=stem)
    else:
        run_timing(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
