"""Published one-shot peers on O1's strong clients (issue 59 item 2, second set): OTFusion as Singh & Jaggi ran it,
PFNM and FedFisher, each without and with the head round, on the cached clients of ``fmnist_strong``.

Rows (``ROWS``; each ``fuse_result`` of a registered method on the cell's five clients, then ``head_round``):

- ``ot-sj``: OTFusion (Singh & Jaggi, NeurIPS 2020, arXiv 1910.05653) with the settings of the authors' one-shot
  activation command (``sidak/otfusion`` README, MNIST + MLPNet; the same for ResNet-18): exact EMD, ground cost the
  (not squared) Euclidean distance between the units' **raw** pre-activations (no z-scoring) on **200** samples, every
  spatial position of every sample kept (``max_rows`` = 200 × 24 × 24), the aligned models averaged with **equal**
  weights (their ``ensemble_step`` 0.5). fedfuse's ``ot`` defaults (the O1 row ``ot``): z-scored activations on
  4,096 (sample, position) rows drawn from all 1,000 fusion images, sample-count weights.
- ``ot-sj-classes``: ``ot-sj`` with the class layer transported as the authors' code does (their last layer gets an
  EMD plan from the logits too; ``ot`` aligns it on its inputs only): each client's class rows first moved by its
  plan onto client 0's classes (``class_plans``), then ``ot-sj``. On these clients the plan is a non-identity
  permutation for most clients (``class-plans-moved``: classes moved per client k ≥ 1), so it mislabels.
- ``ot-sj-nk``: the same alignment, the models averaged with their sample counts (as FedFisher's OTFusion baseline).
- ``ot-wts``: the weight cost (FedFisher's OTFusion baseline runs ``geom-ensemble-type wts``), sample-count weights;
  fedfuse's weight cost normalises each unit's weight row (``--normalize-wts``, off in the authors' commands).
- ``pfnm``: ``fedfuse.fusion.pfnm`` (Yurochkin et al., ICML 2019, arXiv 1905.12022) layer by layer as FedFisher's
  / FedMA's public code runs it on LeNet, the last layer averaged per class with the clients' class counts (their
  ``client_statistics('pfnm', ...)``, 10 numbers per client). ``pfnm-code``: the public code's weighting of the
  popularity term (``popularity=0.5``: a match cheaper, the global model narrower).
- ``fedfisher`` / ``fedfisher-align``: ``fedfuse.fusion.fedfisher`` (Jhunjhunwala et al., AISTATS 2024, arXiv
  2403.12329), diagonal Fisher; the clients' Fishers as the ``fisher`` rows compute them (exact Fisher on 2,000
  images of each client's training part, ``fmnist_oneshot.FISHER_SAMPLES``); ``-align``: every client permuted onto
  client 0 first (Git Re-Basin activation matching on the fusion set, its Fisher moved with it), as ``fisher-align``.
- ``fedfisher-kfac`` / ``fedfisher-kfac-align``: the K-FAC Fisher (``kind='kfac'``).

Per row: test accuracy without / with the head round, exchanges (1 / 2), uplink traffic per client in LeNet uploads
(44,426 numbers = 1: the model, its statistics, the head round's ridge statistics), the server's seconds and the
clients' statistics seconds, each divided by **one local epoch timed in the same process** (the strong recipe: the
mean over the five clients of one epoch of ``fmnist_strong.fit`` on a copy, once per cell just before its rows). The
paired references (the ensemble, ``kf-linear`` with / without the head round, and the O1 row the method's family runs
with fedfuse's defaults: ``SAME_METHOD``) are the cell's rows of the O1 (strong) table
(``results/fmnist-o1-strong/fmnist-dir<α>-n5-s<seed>.json``): the same clients, deterministic.

The commands as run (seeds 0, 1, 2 in that order, every α per seed; ``table`` rewrites ``table.md`` and the per-seed
JSON from ``rows.jsonl``, which stays local):

    .venv/bin/python -m simulations.bench.fmnist_peers run --rows ot-sj,ot-sj-classes,ot-sj-nk,ot-wts \
        --out results/fmnist-o1-strong/peers
    .venv/bin/python -m simulations.bench.fmnist_peers run --rows pfnm --out results/fmnist-o1-strong/peers
    .venv/bin/python -m simulations.bench.fmnist_peers run \
        --rows fedfisher,fedfisher-align,fedfisher-kfac,fedfisher-kfac-align --out results/fmnist-o1-strong/peers
    .venv/bin/python -m simulations.bench.fmnist_peers run --rows pfnm-code --out results/fmnist-o1-strong/peers
    .venv/bin/python -m simulations.bench.fmnist_peers table --out results/fmnist-o1-strong/peers
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedfuse.fusion import client_statistics, fuse_result  # noqa: E402
from fedfuse.training import predict_logits  # noqa: E402

LENET = 44426          # one LeNet upload (numbers)
SJ_SAMPLES = 200       # the authors' --act-num-samples in their one-shot commands
FISHER_SAMPLES = 2000  # as fmnist_oneshot's fisher rows
O1 = Path("results/fmnist-o1-strong")


def acc(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean())


def _ot(options: dict, weights: str, samples: int | None):
    def run(models, n, fx, seed, stats):
        x = fx if samples is None else fx[:samples]
        w = [1.0] * len(models) if weights == "equal" else n
        return fuse_result("ot", models, fusion_inputs=x, weights=w, seed=seed, **options)
    return run


def class_plans(models: list[torch.nn.Module], x: torch.Tensor) -> list[np.ndarray]:
    """The authors' code transports the class layer's outputs too: an exact EMD plan (uniform marginals, equal sizes:
    a permutation) between model k's and model 0's class units, the cost the Euclidean distance between their logit
    vectors over the samples ``x``; ``ot`` aligns the class layer on its inputs only. ``[perm_k]`` for k = 0..n-1:
    model k's class unit ``c`` goes to ``perm_k[c]`` (identity for model 0)."""
    from scipy.optimize import linear_sum_assignment

    ref = predict_logits(models[0], x).double()
    out = [np.arange(ref.shape[1])]
    for m in models[1:]:
        cost = torch.cdist(predict_logits(m, x).double().T, ref.T)   # [classes of k, classes of 0]
        rows, cols = linear_sum_assignment(cost.numpy())
        perm = np.empty_like(cols)
        perm[rows] = cols
        out.append(perm)
    return out


def _ot_classes(options: dict, samples: int):
    """``ot`` with each model's class layer first transported by its class plan (``class_plans``): the class layer's
    output rows moved to the class units of model 0 they are matched to. The hidden layers' plans come from the
    hidden activations, which the class layer does not change, so this is the authors' code's last step in full."""
    def run(models, n, fx, seed, stats):
        x = fx[:samples]
        moved = []
        for m, perm in zip(models, class_plans(models, x)):
            m = copy.deepcopy(m)
            last = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)][-1]
            with torch.no_grad():
                w, b = last.weight.clone(), last.bias.clone()
                last.weight[torch.as_tensor(perm)] = w
                last.bias[torch.as_tensor(perm)] = b
            moved.append(m)
        return fuse_result("ot", moved, fusion_inputs=x, weights=[1.0] * len(models), seed=seed, **options)
    return run


def _stat(method: str, **kw):
    def run(models, n, fx, seed, stats):
        return fuse_result(method, models, fusion_inputs=fx, weights=n, seed=seed, statistics=stats, **kw)
    return run


SJ = {"cost": "activations", "solver": "emd", "std": False, "max_rows": SJ_SAMPLES * 24 * 24}
# row -> (server step, which client statistic it reads: None / "pfnm" / "fisher" / "fisher-kfac")
ROWS = {
    "ot-sj": (_ot(SJ, "equal", SJ_SAMPLES), None),
    "ot-sj-classes": (_ot_classes(SJ, SJ_SAMPLES), None),
    "ot-sj-nk": (_ot(SJ, "counts", SJ_SAMPLES), None),
    "ot-wts": (_ot({"cost": "weights", "solver": "emd"}, "counts", None), None),
    "pfnm": (_stat("pfnm"), "pfnm"),
    "pfnm-code": (_stat("pfnm", popularity=0.5), "pfnm"),
    "fedfisher": (_stat("fedfisher"), "fisher"),
    "fedfisher-align": (_stat("fedfisher", align="activations"), "fisher"),
    "fedfisher-kfac": (_stat("fedfisher", kind="kfac"), "fisher-kfac"),
    "fedfisher-kfac-align": (_stat("fedfisher", kind="kfac", align="activations"), "fisher-kfac"),
}


# the O1 (strong) row the same method family ran as fedfuse runs it by default: what the published settings change
SAME_METHOD = {"ot-sj": "ot", "ot-sj-classes": "ot", "ot-sj-nk": "ot", "ot-wts": "ot", "fedfisher": "fisher",
               "fedfisher-align": "fisher-align", "fedfisher-kfac": "fisher", "fedfisher-kfac-align": "fisher-align"}


def statistics_of(kind: str, clients: list[dict], seed: int) -> tuple[list[dict], float, float]:
    """Each client's statistic on its own training part: (the list, mean client seconds, numbers uploaded)."""
    stats, secs = [], []
    for c in clients:
        t0 = time.perf_counter()
        if kind == "pfnm":
            st = client_statistics("pfnm", c["model"], c["x"], c["y"])
        else:
            pick = torch.randperm(len(c["x"]), generator=torch.Generator().manual_seed(seed))[:FISHER_SAMPLES]
            st = client_statistics("fedfisher", c["model"], c["x"][pick], c["y"][pick],
                                   kind="kfac" if kind == "fisher-kfac" else "diagonal")
        secs.append(time.perf_counter() - t0)
        stats.append(st)
    return stats, float(np.mean(secs)), float(sum(v.numel() for v in stats[0].values()))


def one_epoch_seconds(clients: list[dict], seed: int) -> float:
    """One local epoch with the strong recipe, timed here (the server's seconds are divided by it): the mean over the
    five clients of one epoch of ``fmnist_strong.fit`` on a copy of each (their data sizes differ several-fold)."""
    from simulations.bench.fmnist_strong import RECIPE, fit

    secs = []
    for c in clients:
        model = copy.deepcopy(c["model"])
        info = fit(model, c["x"], c["y"], c["vx"][:1], c["vy"][:1], lr=RECIPE["lr"],
                   weight_decay=RECIPE["weight-decay"], epochs=1, seed=seed, batch_size=RECIPE["batch-size"],
                   momentum=RECIPE["momentum"], early_stop=False)
        secs.append(float(info["train-seconds"]))
    return float(np.mean(secs))


def run_cell(alpha: float, seed: int, rows: list[str]) -> list[dict]:
    from simulations.bench.fmnist_oneshot import head_round
    from simulations.bench.fmnist_strong import strong_clients, strong_data

    clients = strong_clients(alpha, seed)
    tx, ty, fx = strong_data(alpha, seed)
    models, n = [c["model"] for c in clients], [c["n"] for c in clients]
    base = {"part": f"dir{alpha:g}", "seed": seed}
    cache: dict = {}
    out = []
    epoch = one_epoch_seconds(clients, seed)
    for name in rows:
        step, kind = ROWS[name]
        if kind is not None and kind not in cache:
            cache[kind] = statistics_of(kind, clients, seed)
        stats, client_secs, stat_numbers = cache[kind] if kind else (None, 0.0, 0.0)
        t0 = time.perf_counter()
        res = step(models, n, fx, seed, stats)
        secs = time.perf_counter() - t0
        fused = res.model
        a0 = acc(predict_logits(fused, tx), ty)
        headed, hinfo = head_round(fused, clients)
        a1 = acc(predict_logits(headed, tx), ty)
        feat = sum(p.numel() for p in list(fused.modules())[-1].parameters()) // 10   # features + 1 (bias)
        head_up = (feat * feat + feat * 10) / LENET     # ridge statistics: Gram [d+1]² and cross [d+1, C]
        info = {k: v for k, v in res.info.items() if k in ("widths", "statistics", "align", "steps", "kind",
                                                           "objective", "last_layer")}
        if name.startswith("ot-sj"):
            plans = class_plans(models, fx[:SJ_SAMPLES])[1:]
            info["class-plans-moved"] = [int((p != np.arange(len(p))).sum()) for p in plans]
        row = {**base, "method": name, "accuracy": a0, "with-head": a1, "solver": hinfo["solver"],
               "traffic": 1.0 + stat_numbers / LENET, "traffic-head": 1.0 + stat_numbers / LENET + head_up,
               "server-seconds": secs, "client-seconds": client_secs, "epoch-seconds": epoch,
               "server-per-epoch": secs / epoch, "client-per-epoch": client_secs / epoch,
               "params": sum(p.numel() for p in fused.parameters()), "info": info}
        out.append(row)
        print(f"  dir{alpha:g} s{seed} {name:<22} {a0:.4f} -> head {a1:.4f} ({hinfo['solver']})  server {secs:.1f}s "
              f"= {secs / epoch:.2f} epochs (epoch {epoch:.1f}s)  {info}", flush=True)
    return out


def rows_of(out: Path) -> list[dict]:
    path = out / "rows.jsonl"
    if path.exists():
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    else:   # rebuilt from the tracked per-seed JSON
        rows = []
        for p in sorted(out.glob("fmnist-dir*-n5-s*.json")):
            d = json.loads(p.read_text())
            rows += [{"part": d["part"], "seed": d["seed"], **r} for r in d["rows"]]
    return list({(r["part"], r["seed"], r["method"]): r for r in rows}.values())


def references(part: str, seed: int) -> dict:
    """The cell's rows of the O1 (strong) table: ensemble, kf-linear (+ head), ot (+ head), fisher-align (+ head)."""
    d = json.loads((O1 / f"fmnist-{part}-n5-s{seed}.json").read_text())
    return {r["method"]: r for r in d["rows"]}


def _ms(v: list[float], signed: bool = False, scale: float = 100.0, digits: int = 1) -> str:
    if not v:
        return ""
    m = scale * float(np.mean(v))
    text = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    return text + (f" ± {scale * float(np.std(v, ddof=1)):.{digits}f}" if len(v) > 1 else "") + f" (n={len(v)})"


def table(rows: list[dict]) -> str:
    parts = sorted({r["part"] for r in rows}, key=lambda p: float(p[3:]))
    head = " | ".join(f"α = {p[3:]}" for p in parts)
    names = [m for m in ROWS if any(r["method"] == m for r in rows)]
    refs = {(p, s): references(p, s) for p, s in {(r["part"], r["seed"]) for r in rows}}
    lines = ["mean ± sample std (ddof=1) over seeds; test accuracy in %; traffic: uplink per client in LeNet uploads "
             "(44,426 numbers); seconds: the server's (and the clients' statistics') ÷ one local epoch timed in the "
             "same process", "", f"| row | exchanges | traffic | server s ÷ epoch | {head} |",
             "|---|---|---|---|" + "---|" * len(parts)]
    for ref, label in (("ensemble", "clients' ensemble (O1 strong)"), ("kf-linear", "kf-linear (O1 strong)"),
                       ("ot", "ot, fedfuse's defaults (O1 strong)"),
                       ("fisher-align", "Fisher merging, activation-matched first (O1 strong)")):
        for key, ex in (("accuracy", "1"), ("with-head", "2 (+ head round)")):
            if ref == "ensemble" and key == "with-head":
                continue
            cells = [_ms([v[ref][key] for (p, s), v in sorted(refs.items()) if p == part and ref in v])
                     for part in parts]
            lines.append(f"| {label} | {ex} | | | " + " | ".join(cells) + " |")
    for m in names:
        mine = [r for r in rows if r["method"] == m]
        for key, ex, tk in (("accuracy", "1", "traffic"), ("with-head", "2 (+ head round)", "traffic-head")):
            cells = [_ms([r[key] for r in mine if r["part"] == part]) for part in parts]
            traffic = f"{np.mean([r[tk] for r in mine]):.2f}"
            sec = f"{np.mean([r['server-per-epoch'] for r in mine]):.2g}"
            if mine[0].get("client-per-epoch"):
                sec += f" (clients {np.mean([r['client-per-epoch'] for r in mine]):.2g})"
            lines.append(f"| {m} | {ex} | {traffic} | {sec} | " + " | ".join(cells) + " |")
    lines += ["", "Paired per seed (same clients): the row minus the reference, points; per-seed values in brackets "
              "(seeds in order)", "", f"| row | against | {head} |", "|---|---|" + "---|" * len(parts)]
    for m in names:
        for key, ex in (("accuracy", "1 exchange"), ("with-head", "+ head round")):
            own = SAME_METHOD.get(m)
            for ref, rkey, rname in (("ensemble", "accuracy", "ensemble"),
                                     ("kf-linear", key, "kf-linear" + (" + head round" if key == "with-head" else "")),
                                     *([(own, key, f"{own} (O1 strong)" + (" + head round" if key == "with-head"
                                                                          else ""))] if own else [])):
                cells = []
                for part in parts:
                    d = [r[key] - refs[(part, r["seed"])][ref][rkey] for r in sorted(
                        (r for r in rows if r["method"] == m and r["part"] == part), key=lambda r: r["seed"])]
                    cells.append(_ms(d, signed=True) + (" [" + ", ".join(f"{100 * x:+.1f}" for x in d) + "]"
                                                        if d else ""))
                lines.append(f"| {m} ({ex}) | {rname} | " + " | ".join(cells) + " |")
    widths = [r for r in rows if r["method"].startswith("pfnm") and "widths" in r.get("info", {})]
    if widths:
        lines += ["", "PFNM's global widths (conv1, conv2, fc1, fc2; the clients' 6, 16, 120, 84) and parameters per "
                  "cell: " + "; ".join(f"{r['method']} {r['part']} s{r['seed']} {r['info']['widths']} {r['params']}"
                                       for r in sorted(widths, key=lambda r: (r["method"], r["part"], r["seed"])))]
    return "\n".join(lines)


def _six(x):
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _six(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_six(v) for v in x]
    return x


def per_seed(out: Path, rows: list[dict]) -> None:
    """One compact JSON per cell (tracked; ``rows.jsonl`` stays local): the rows, floats to 6 significant digits."""
    cells = defaultdict(list)
    for r in rows:
        cells[(r["part"], r["seed"])].append(r)
    for (part, seed), cell in cells.items():
        own = [_six({k: v for k, v in r.items() if k not in ("part", "seed", "command")}) for r in cell]
        (out / f"fmnist-{part}-n5-s{seed}.json").write_text(json.dumps(
            {"cell": f"fmnist-{part}-n5-s{seed}", "part": part, "seed": seed, "rows": own}, separators=(",", ":")))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rows", default="ot-sj,ot-sj-classes,ot-sj-nk,ot-wts", help=f"comma-separated, of {list(ROWS)}")
    ap.add_argument("--out", default="results/fmnist-o1-strong/peers")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "run":
        names = a.rows.split(",")
        unknown = [r for r in names if r not in ROWS]
        if unknown:
            raise SystemExit(f"unknown rows {unknown}; known: {list(ROWS)}")
        command = " ".join(["python -m simulations.bench.fmnist_peers"] + (argv if argv is not None else sys.argv[1:]))
        for seed in (int(s) for s in a.seeds.split(",")):
            for alpha in (float(x) for x in a.alphas.split(",")):
                rows = run_cell(alpha, seed, names)
                with open(out / "rows.jsonl", "a") as f:
                    for r in rows:
                        f.write(json.dumps({**r, "command": command}) + "\n")
    rows = rows_of(out)
    text = table(rows)
    raw = (out / "rows.jsonl").read_text().splitlines() if (out / "rows.jsonl").exists() else []
    commands = [c for c in dict.fromkeys(json.loads(x).get("command") for x in raw if x.strip()) if c]
    text += "\n\nThe commands, in the order run:\n\n```bash\n" + "\n".join(commands) + "\n```"
    (out / "table.md").write_text(text + "\n")
    per_seed(out, rows)
    print(text)


if __name__ == "__main__":
    main()
