"""Reusable pieces of the one-shot fusion benchmark (``python -m simulations.one_shot``).

One *setting* = (dataset, partition, model); one *cell* = a setting and a seed. Per cell the base
clients are trained once and cached on disk (``<cache>/<key>/``, the key hashes every setting that
changes them), each client computes its importance scores on its own validation split (as the
fedfuse ClientApp does), and every requested fusion method runs through ``fedfuse.fusion.fuse``,
timed, and is evaluated on the test split. Methods raising ``ValueError`` are recorded as n/a with
the reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import tomllib
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedfuse.data import FederatedData
from fedfuse.fusion import METHODS, fuse
from fedfuse.importance import neuron_importance
from fedfuse.models import build_model
from fedfuse.training import evaluate

CACHE_VERSION = 2

# Client training recipe (spec §3.3, the paper's base-model training scaled down): AdamW, batch 32,
# label smoothing 0.1, cosine annealing over ``epochs`` (the maximum), and early stopping on the
# client's own validation split (cross-entropy, patience ``patience`` epochs; the best epoch's weights
# are kept). ``epochs``/``lr``/``weight_decay`` per (dataset, model) were chosen on the clients'
# validation splits only (``simulations/client_recipe.py``), never on the test split.
RECIPE_DEFAULTS: dict[str, Any] = dict(optimizer="adamw", weight_decay=1e-4, label_smoothing=0.1, patience=10,
                                       schedule="cosine")
TRAIN_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("digits", "mlp"): dict(epochs=60, lr=3e-3),
    ("mnist1d", "mlp"): dict(epochs=60, lr=3e-3),
    ("digits", "cnn"): dict(epochs=30, lr=3e-3),
    ("mnist1d", "cnn"): dict(epochs=30, lr=3e-3),
    ("digits", "vit"): dict(epochs=40, lr=1e-3),
    ("mnist1d", "vit"): dict(epochs=40, lr=1e-3),
}
WIDTH_DEFAULTS = {"mlp": 128, "cnn": 16, "resnet": 16, "vit": 32}
DEPTH_DEFAULTS = {"mlp": 2, "cnn": 2, "resnet": 2, "vit": 2}


def parse_partition(text: str) -> tuple[str, int]:
    """``"shards2"`` → ("shards", 2); ``"dirichlet4"`` → ("dirichlet", 4); also iid/full."""
    m = re.fullmatch(r"(shards|dirichlet|iid|full)(\d+)", text)
    if not m:
        raise ValueError(f"--partitions: expected e.g. shards2, dirichlet4, iid4, full2; got {text!r}")
    return m.group(1), int(m.group(2))


def parse_method(text: str) -> tuple[str, str, dict[str, Any]]:
    """``"kf-gradient[setting=2,eps=0.5]"`` → (label, method name, options). Values are TOML."""
    m = re.fullmatch(r"([\w\-]+)(?:\[(.*)\])?", text.strip())
    if not m:
        raise ValueError(f"--methods: cannot parse {text!r}")
    name, opt_text = m.group(1), m.group(2)
    opts: dict[str, Any] = {}
    if opt_text:
        for item in opt_text.split(","):
            k, _, v = item.partition("=")
            opts[k.strip().replace("-", "_")] = tomllib.loads(f"v = {v.strip()}")["v"]
    return text.strip(), name, opts


def split_methods(text: str) -> list[str]:
    """Comma-separated list where commas inside ``[...]`` do not split."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur.strip():
                out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


@dataclass
class CellConfig:
    """Everything that determines the trained clients of one cell (hashed into the cache key)."""

    dataset: str
    partition: str
    model: str
    seed: int
    width: int
    depth: int
    epochs: int
    lr: float
    batch_size: int = 32
    val_fraction: float = 0.1
    alpha: float = 0.5
    fusion_source: str = "client0"
    importance_samples: int = 256
    model_options: dict = field(default_factory=dict)
    optimizer: str = RECIPE_DEFAULTS["optimizer"]
    weight_decay: float = RECIPE_DEFAULTS["weight_decay"]
    label_smoothing: float = RECIPE_DEFAULTS["label_smoothing"]
    patience: int = RECIPE_DEFAULTS["patience"]      # 0 = no early stopping (train all epochs)
    schedule: str = RECIPE_DEFAULTS["schedule"]      # "cosine" | "constant"

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "v": CACHE_VERSION}, sort_keys=True)
        return f"{self.dataset}-{self.partition}-{self.model}-s{self.seed}-" + hashlib.sha1(blob.encode()).hexdigest()[:10]


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_client(model: torch.nn.Module, tr, va, cfg: CellConfig, seed: int, device: str = "cpu") -> dict[str, Any]:
    """Train ``model`` in place on ``tr`` with the recipe in ``cfg``; early stopping on ``va``.

    Returns ``train-seconds``, ``train-loss`` (last epoch), ``epochs`` run, ``best-epoch`` and the
    best epoch's validation cross-entropy / accuracy (the model is left at that epoch's weights).
    """
    import torch.nn.functional as F
    from fedfuse.training import make_optimizer

    model.to(device).train()
    opt = make_optimizer(model.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, cfg.epochs))
             if cfg.schedule == "cosine" else None)
    gen = torch.Generator().manual_seed(seed)
    x, y = tr.x, tr.y
    n = len(x)

    def val_metrics() -> tuple[float, float]:
        if len(va) == 0:
            return float("nan"), float("nan")
        model.eval()
        with torch.no_grad():
            lg = torch.cat([model(va.x[i:i + 512].to(device)).float().cpu() for i in range(0, len(va), 512)])
        model.train()
        return F.cross_entropy(lg, va.y).item(), (lg.argmax(1) == va.y).float().mean().item()

    t0 = time.perf_counter()
    best = (float("inf"), float("nan"), 0)
    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bad, last, ep = 0, float("nan"), 0
    for ep in range(1, cfg.epochs + 1):
        perm = torch.randperm(n, generator=gen)
        total, count = 0.0, 0
        for start in range(0, n, cfg.batch_size):
            idx = perm[start:start + cfg.batch_size]
            if len(idx) < 2 and n >= 2:
                continue
            xb, yb = x[idx].to(device), y[idx].to(device)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb, label_smoothing=cfg.label_smoothing)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            count += len(idx)
        last = total / max(count, 1)
        if sched is not None:
            sched.step()
        vl, va_acc = val_metrics()
        if cfg.patience <= 0 or vl != vl:
            best, best_state = (vl, va_acc, ep), None
            continue
        if vl < best[0] - 1e-6:
            best, bad = (vl, va_acc, ep), 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            bad += 1
            if bad >= cfg.patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return {"train-seconds": time.perf_counter() - t0, "train-loss": last, "epochs": ep, "best-epoch": best[2],
            "val-loss": best[0], "val-accuracy": best[1]}


def load_data(cfg: CellConfig, fusion_size: int) -> FederatedData:
    method, n = parse_partition(cfg.partition)
    return FederatedData.build(cfg.dataset, n, method, alpha=cfg.alpha, fusion_size=fusion_size,
                               fusion_source=cfg.fusion_source, seed=cfg.seed)


def get_clients(cfg: CellConfig, data: FederatedData, importance: list[str], cache_dir: Path,
                device: str = "cpu", log=print) -> list[dict[str, Any]]:
    """Train (or load from cache) every client of a cell; compute missing client-side scores.

    Returns one dict per client: ``model`` (eval mode, CPU), ``train_seconds``, ``scores``
    ``{method: {level: [width]}}`` (computed on the client's own validation split), ``val_size``.
    """
    d = cache_dir / cfg.key()
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(asdict(cfg), indent=1, sort_keys=True))
    out = []
    for pid in range(data.num_clients):
        path = d / f"client{pid}.pt"
        model = build_model(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape, width=cfg.width,
                            depth=cfg.depth, seed=cfg.seed * 1000 + pid, **cfg.model_options)
        tr, va = data.client_data(pid, cfg.val_fraction, cfg.seed)
        rec = torch.load(path, weights_only=False) if path.exists() else None
        if rec is None:
            info = train_client(model, tr, va, cfg, seed=cfg.seed * 1000 + pid, device=device)
            rec = {"state": {k: v.cpu() for k, v in model.state_dict().items()},
                   "train_seconds": info["train-seconds"], "train_loss": info["train-loss"], "train_info": info,
                   "scores": {}}
            log(f"    client {pid}: trained {len(tr)} samples in {info['train-seconds']:.1f}s "
                f"({info['epochs']} epochs, best {info['best-epoch']}, val loss {info['val-loss']:.3f}, "
                f"val acc {info['val-accuracy']:.3f})")
            _atomic_save(rec, path)
        model.load_state_dict(rec["state"])
        model.eval()
        changed = False
        for imp in importance:
            if imp not in rec["scores"]:
                k = min(cfg.importance_samples, len(va))
                rec["scores"][imp] = neuron_importance(model, va.x[:k], va.y[:k], method=imp, device=device)
                changed = True
        if changed:
            _atomic_save(rec, path)
        out.append({"model": model, "train_seconds": rec["train_seconds"], "scores": rec["scores"],
                    "val_size": len(va), "train_size": len(tr), "val": va,
                    "class_counts": torch.bincount(tr.y, minlength=data.num_classes)[:data.num_classes].tolist()})
    return out


def run_cell(cfg: CellConfig, methods: list[str], importance: list[str], score_sources: list[str],
             fusion_size: int, cache_dir: Path, device: str = "cpu", method_options: dict | None = None,
             log=print) -> list[dict[str, Any]]:
    """Rows (one per base model, reference and method × importance × score source) for one cell."""
    data = load_data(cfg, fusion_size)
    clients = get_clients(cfg, data, [i for i in importance if i != "uniform"] + ["uniform"], cache_dir, device,
                          log)
    models = [c["model"] for c in clients]
    tx, ty = data.test.x, data.test.y
    # federated validation: the union of the clients' validation splits (what the clients can measure for
    # the server; method options are chosen on this, never on the test split)
    vx = torch.cat([c["val"].x for c in clients])
    vy = torch.cat([c["val"].y for c in clients])
    base = dict(dataset=cfg.dataset, partition=cfg.partition, model=cfg.model, seed=cfg.seed,
                num_clients=len(models), fusion_size=int(len(data.fusion_x)), fusion_source=cfg.fusion_source,
                client_train_seconds=float(np.mean([c["train_seconds"] for c in clients])))
    rows: list[dict[str, Any]] = []
    for i, m in enumerate(models):
        ev = evaluate(m, tx, ty, num_classes=data.num_classes)
        rows.append({**base, "method": f"base-{i}", "importance": "", "score_source": "",
                     "accuracy": ev["accuracy"], "loss": ev["loss"], "fuse_seconds": 0.0, "status": "ok",
                     "val_accuracy": evaluate(m, vx, vy)["accuracy"]})
    best = max(r["accuracy"] for r in rows)
    rows.append({**base, "method": "best-base", "importance": "", "score_source": "", "accuracy": best,
                 "loss": float("nan"), "fuse_seconds": 0.0, "status": "ok"})
    jobs: list[tuple[str, str, dict, str, str]] = []
    labels = [parse_method(m)[0] for m in methods]
    for ref in ("average", "ensemble"):  # always measured: the time and accuracy references
        if ref not in labels:
            methods = [ref] + list(methods)
    for text in methods:
        label, name, opts = parse_method(text)
        opts = {**(method_options or {}).get(name, {}), **opts}
        uses_scores = getattr(METHODS.get(name), "uses_scores", False)
        if uses_scores:
            for imp in importance:
                for src in (score_sources if imp != "uniform" else ["client"]):
                    jobs.append((label, name, opts, imp, src))
        else:
            jobs.append((label, name, opts, "", ""))
    for label, name, opts, imp, src in jobs:
        kw = dict(opts)
        if kw.get("head_weights"):  # class-count head weighting: each client reports its class counts
            kw.setdefault("class_counts", [c["class_counts"] for c in clients])
        scores = None
        if imp and imp != "uniform":
            if src == "client":
                scores = [c["scores"][imp] for c in clients]
            else:  # the server scores on its own (skewed) fusion set with its labels (FINDINGS #2)
                kw.update(importance=imp, fusion_labels=data.fusion_y)
        row = {**base, "method": label, "importance": imp, "score_source": src}
        if name not in METHODS:
            rows.append({**row, "accuracy": float("nan"), "loss": float("nan"), "fuse_seconds": float("nan"),
                         "status": f"n/a: unknown method {name!r}"})
            continue
        t0 = time.perf_counter()
        try:
            fused = fuse(name, models, fusion_inputs=data.fusion_x, scores=scores, device=device, seed=cfg.seed, **kw)
            secs = time.perf_counter() - t0
            ev = evaluate(fused, tx, ty, num_classes=data.num_classes)
            row.update(accuracy=ev["accuracy"], loss=ev["loss"], fuse_seconds=secs, status="ok",
                       val_accuracy=evaluate(fused, vx, vy)["accuracy"])
        except ValueError as e:
            row.update(accuracy=float("nan"), loss=float("nan"), fuse_seconds=float("nan"), status=f"n/a: {e}")
        except Exception as e:  # keep the sweep going, but record loudly
            traceback.print_exc()
            row.update(accuracy=float("nan"), loss=float("nan"), fuse_seconds=float("nan"),
                       status=f"error: {type(e).__name__}: {e}")
        tag = f"{label}" + (f" ({imp}/{src})" if imp else "")
        log(f"    {tag:<44} acc {row['accuracy']:.4f}  {row['fuse_seconds']:.2f}s  {row['status'][:80]}")
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------
# reporting
# ----------------------------------------------------------------------------------------------------

def _setting(r: dict) -> str:
    return f"{r['dataset']}/{r['partition']}/{r['model']}"


def _row_label(r: dict) -> str:
    if not r["importance"]:
        return r["method"]
    src = "" if r["score_source"] in ("client", "") else ", server"
    return f"{r['method']} ({r['importance'][:4]}{src})"


def _ms(vals: list[float], scale: float = 100.0, digits: int = 1) -> str:
    v = [x for x in vals if x == x]
    if not v:
        return "n/a"
    mean = float(np.mean(v)) * scale
    std = float(np.std(v)) * scale
    return f"{mean:.{digits}f} ± {std:.{digits}f}" + ("" if len(v) == len(vals) else f" ({len(v)}/{len(vals)})")


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate rows: per (row label, setting) the accuracy list, gap recoveries and time ratios."""
    settings = sorted({_setting(r) for r in rows})
    order: list[str] = []
    for r in rows:
        lab = _row_label(r)
        if lab not in order and not r["method"].startswith("base-"):
            order.append(lab)
    acc: dict[tuple[str, str], list[float]] = {}
    vacc: dict[tuple[str, str], list[float]] = {}
    gap: dict[tuple[str, str], list[float]] = {}
    t_avg: dict[tuple[str, str], list[float]] = {}
    t_cli: dict[tuple[str, str], list[float]] = {}
    status: dict[tuple[str, str], str] = {}
    by_cell: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_cell.setdefault((_setting(r), r["seed"]), {})[_row_label(r)] = r
    for (st, _seed), cell in by_cell.items():
        best = cell.get("best-base", {}).get("accuracy", float("nan"))
        ens = cell.get("ensemble", {}).get("accuracy", float("nan"))
        avg_t = cell.get("average", {}).get("fuse_seconds", float("nan"))
        for lab, r in cell.items():
            if lab.startswith("base-"):
                continue
            a = r["accuracy"]
            acc.setdefault((lab, st), []).append(a)
            if lab != "best-base":
                vacc.setdefault((lab, st), []).append(r.get("val_accuracy", float("nan")))
            g = (a - best) / (ens - best) if ens - best > 1e-9 else float("nan")
            gap.setdefault((lab, st), []).append(g)
            t_avg.setdefault((lab, st), []).append(r["fuse_seconds"] / avg_t if avg_t and avg_t > 0 else float("nan"))
            t_cli.setdefault((lab, st), []).append(r["fuse_seconds"] / r["client_train_seconds"]
                                                   if r["client_train_seconds"] > 0 else float("nan"))
            if r["status"] != "ok":
                status[(lab, st)] = r["status"]
    if "best-base" in order:  # best base by federated validation accuracy: the max over the bases
        for (st, _seed), cell in by_cell.items():
            vb = [r.get("val_accuracy", float("nan")) for lab, r in cell.items() if lab.startswith("base-")]
            if "best-base" in cell:
                vacc.setdefault(("best-base", st), []).append(max(vb) if vb and all(v == v for v in vb) else float("nan"))
    return dict(settings=settings, order=order, acc=acc, vacc=vacc, gap=gap, t_avg=t_avg, t_cli=t_cli, status=status)


def validation_selected(summary: dict[str, Any]) -> dict[tuple[str, str], str]:
    """``{(family, setting): row label}``: per method family (name without options, plus the score
    marker) the variant with the highest mean federated validation accuracy; families with a single
    variant and variants with ``fused_width`` (another model size) are skipped."""
    import re

    fams: dict[tuple[str, str], list[str]] = {}
    for lab in summary["order"]:
        if lab in ("best-base", "ensemble") or "fused_width" in lab:
            continue
        fam = re.sub(r"\[.*\]", "", lab)
        for st in summary["settings"]:
            if (lab, st) in summary["vacc"]:
                fams.setdefault((fam, st), []).append(lab)
    out = {}
    for key, labs in fams.items():
        scored = [(np.nanmean(summary["vacc"][(lab, key[1])]), lab) for lab in labs
                  if any(v == v for v in summary["vacc"][(lab, key[1])])]
        if len(scored) > 1:
            out[key] = max(scored)[1]
    return out


def markdown_table(rows: list[dict[str, Any]], title: str = "One-shot fusion") -> str:
    s = summarise(rows)
    settings, order = s["settings"], s["order"]
    seeds = sorted({r["seed"] for r in rows})
    head = "| method | " + " | ".join(settings) + " |\n|---|" + "---|" * len(settings) + "\n"
    out = [f"# {title}\n", f"Test accuracy (%), mean ± std over seeds {seeds}. Scores: client-side "
           "(each client on its own validation split) unless marked `server` (the server on its fusion set). "
           "n/a = the method raised ValueError (reason below).\n", "## Accuracy\n", head]

    def cell(d, lab, st, scale=100.0, digits=1):
        if (lab, st) not in d:
            return ""
        if all(v != v for v in d[(lab, st)]):
            return "n/a"
        return _ms(d[(lab, st)], scale, digits)

    for lab in order:
        out.append(f"| {lab} | " + " | ".join(cell(s["acc"], lab, st) for st in settings) + " |\n")
    out += ["\n## Gap recovery = (fused − best base) / (ensemble − best base), %\n", head]
    for lab in order:
        if lab in ("best-base", "ensemble"):
            continue
        out.append(f"| {lab} | " + " | ".join(cell(s["gap"], lab, st, 100.0, 0) for st in settings) + " |\n")
    if any(v == v for vals in s["vacc"].values() for v in vals):
        out += ["\n## Federated validation accuracy (%, the union of the clients' validation splits; "
                "the selection criterion for method options)\n", head]
        for lab in order:
            out.append(f"| {lab} | " + " | ".join(cell(s["vacc"], lab, st) for st in settings) + " |\n")
    sel = validation_selected(s)
    if sel:
        out += ["\n## Validation-selected options (per method family and setting: the variant with the highest mean "
                "federated validation accuracy; variants with another `fused_width` are a different model size "
                "and are not candidates). Test accuracy %; gap recovery as mean of per-seed ratios / ratio of "
                "the means\n", "| method family | setting | chosen variant | test acc | gap recovery |\n"
                "|---|---|---|---|---|\n"]
        for (fam, st), lab in sorted(sel.items()):
            accs, ens = s["acc"][(lab, st)], s["acc"].get(("ensemble", st))
            best = s["acc"].get(("best-base", st))
            ratio = ((np.mean(accs) - np.mean(best)) / (np.mean(ens) - np.mean(best))
                     if ens and best and np.mean(ens) - np.mean(best) > 1e-9 else float("nan"))
            out.append(f"| {fam} | {st} | {lab} | {_ms(accs)} | {cell(s['gap'], lab, st, 100.0, 0)} / "
                       f"{100 * ratio:.0f} |\n")
    out += ["\n## Fusion wall time: × `average` / × one client's local training\n", head]
    for lab in order:
        if lab == "best-base":
            continue
        vals = []
        for st in settings:
            a, c = s["t_avg"].get((lab, st)), s["t_cli"].get((lab, st))
            if a is None:
                vals.append("")
                continue
            ma = [v for v in a if v == v]
            mc = [v for v in c if v == v]
            vals.append("n/a" if not ma else f"{np.mean(ma):.3g}× / {np.mean(mc):.3g}×")
        out.append(f"| {lab} | " + " | ".join(vals) + " |\n")
    tr = {}
    for r in rows:
        if r["method"] == "best-base":
            tr.setdefault(_setting(r), []).append(r["client_train_seconds"])
    avg_secs = {}
    for r in rows:
        if r["method"] == "average":
            avg_secs.setdefault(_setting(r), []).append(r["fuse_seconds"])
    out.append("\nOne client's local training (s, mean over clients and seeds): "
               + ", ".join(f"{st} {np.mean(v):.2f}" for st, v in sorted(tr.items())) + "\n")
    out.append("\n`average` wall time (s): " + ", ".join(f"{st} {np.mean(v):.4f}" for st, v in sorted(avg_secs.items()))
               + "\n")
    if s["status"]:
        out.append("\n## n/a and errors\n")
        seen = set()
        for (lab, st), msg in sorted(s["status"].items()):
            if (lab, msg) in seen:
                continue
            seen.add((lab, msg))
            out.append(f"- {lab} @ {st}: {msg}\n")
    return "".join(out)


def _short_label(label: str) -> str:
    """Plot tick label: common NI options abbreviated so long variant names fit."""
    import re

    for pat, rep in [(r'head_target="probs"', "probs"), (r"head_weights=true", "hw"), (r"fused_width=", "w"),
                     (r"ridge=", "ridge"), (r"\((deep|unif|cond)[a-z]*", r"(\1")]:
        label = re.sub(pat, rep, label)
    return label


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per setting: horizontal bars (mean ± std accuracy) per method; ensemble / best base lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarise(rows)
    settings, order = s["settings"], [o for o in s["order"] if o not in ("best-base",)]
    ncol = min(3, len(settings))
    nrow = math.ceil(len(settings) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 0.28 * len(order) * nrow + 1.5 * nrow), squeeze=False,
                             sharey=True)
    for i, (ax, st) in enumerate(zip(axes.flat, settings)):
        means, stds = [], []
        for lab in order:
            v = [x for x in s["acc"].get((lab, st), []) if x == x]
            means.append(np.mean(v) * 100 if v else 0.0)
            stds.append(np.std(v) * 100 if v else 0.0)
        y = np.arange(len(order))
        colors = ["tab:gray" if lab in ("ensemble", "average") else
                  "tab:orange" if lab.startswith(("kd", "lp")) else "tab:blue" for lab in order]
        ax.barh(y, means, xerr=stds, color=colors, alpha=0.85)
        ax.set_yticks(y, [_short_label(o) for o in order], fontsize=7)
        if i == 0:
            ax.invert_yaxis()
        best = [x for x in s["acc"].get(("best-base", st), []) if x == x]
        if best:
            ax.axvline(np.mean(best) * 100, color="k", ls="--", lw=1, label="best base")
        ens = [x for x in s["acc"].get(("ensemble", st), []) if x == x]
        if ens:
            ax.axvline(np.mean(ens) * 100, color="tab:red", ls=":", lw=1, label="ensemble")
        ax.set_title(st, fontsize=9)
        ax.set_xlabel("test accuracy (%)")
        ax.legend(fontsize=6, loc="lower right")
    for ax in list(axes.flat)[len(settings):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def write_results(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    """``results.json`` (every raw row + the invocation), ``table.md``, ``accuracy.png``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_jsonable({"meta": meta, "rows": rows}), indent=1))
    (out / "table.md").write_text(markdown_table(rows, title=meta.get("title", "One-shot fusion")))
    try:
        plot(rows, out / "accuracy.png")
    except Exception:  # a plotting problem must not lose the numbers
        traceback.print_exc()


def load_rows(path: Path) -> list[dict[str, Any]]:
    rows = json.loads(Path(path).read_text())["rows"]
    for r in rows:
        for k in ("accuracy", "loss", "fuse_seconds"):
            if r.get(k) is None:
                r[k] = float("nan")
    return rows
