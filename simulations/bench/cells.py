"""One one-shot cell: a (dataset, partition, model, seed) with its clients, references and fused models.

Per cell the clients come from the cache (``clients.get_clients``), every requested method runs through
``fedfuse.fusion.fuse_result`` (timed; its diagnostics ``info`` is kept in the row) and every model is
evaluated on the test split and on the union of the clients' validation splits ("federated validation",
what the clients can measure; method options are chosen on it, never on the test split). A method that
raises ``ValueError`` (every ``FusionError`` is one) is recorded as n/a with the reason; any other
exception is a bug and propagates.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from fedfuse.fusion import fuse_result, get_spec
from fedfuse.training import evaluate

from simulations.bench.clients import CellConfig, get_clients, load_data
from simulations.bench.specs import MethodSpec, parse_method
from simulations.bench.stats import mean
from simulations.bench.tables import jsonable

REFERENCES = ("average", "ensemble")  # always measured: the time and accuracy references


def check_methods(methods: list[str], method_options: dict[str, dict] | None = None) -> list[MethodSpec]:
    """Parse method specs and validate their names and options against the fusion registry before any
    client trains (``FusionOptionError`` naming the method and key)."""
    specs = [parse_method(m) for m in methods]
    for s in specs:
        get_spec(s.name).parse_options({**(method_options or {}).get(s.name, {}), **s.options})
    return specs


def run_cell(cfg: CellConfig, methods: list[str], importance: list[str], score_sources: list[str],
             fusion_size: int, cache_dir: Path, device: str = "cpu", method_options: dict | None = None,
             log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Rows (one per base model, best base, and method × importance × score source) for one cell.

    ``score_sources``: ``client`` = each client's scores on its own validation split; ``server`` = the
    server scores on its fusion set with its labels. ``method_options`` ``{method name: options}`` are
    defaults under the options in a method's spec.
    """
    data = load_data(cfg, fusion_size)
    clients = get_clients(cfg, data, [i for i in importance if i != "uniform"] + ["uniform"], cache_dir, device, log)
    models = [c["model"] for c in clients]
    tx, ty = data.test.x, data.test.y
    vx = torch.cat([c["val"].x for c in clients])
    vy = torch.cat([c["val"].y for c in clients])
    base = dict(dataset=cfg.dataset, partition=cfg.partition, model=cfg.model, seed=cfg.seed,
                num_clients=len(models), fusion_size=int(len(data.fusion_x)), fusion_source=cfg.fusion_source,
                client_train_seconds=mean(c["train_seconds"] for c in clients))
    rows: list[dict[str, Any]] = []
    for i, m in enumerate(models):
        ev = evaluate(m, tx, ty, num_classes=data.num_classes)
        rows.append({**base, "method": f"base-{i}", "importance": "", "score_source": "",
                     "accuracy": ev["accuracy"], "loss": ev["loss"], "fuse_seconds": 0.0, "status": "ok",
                     "val_accuracy": evaluate(m, vx, vy)["accuracy"]})
    rows.append({**base, "method": "best-base", "importance": "", "score_source": "",
                 "accuracy": max(r["accuracy"] for r in rows), "loss": float("nan"), "fuse_seconds": 0.0,
                 "status": "ok"})
    specs = check_methods(methods, method_options)
    labels = [s.label for s in specs]
    for ref in REFERENCES:  # inserted in front: ensemble, average, ... (the old run order)
        if ref not in labels:
            specs.insert(0, parse_method(ref))
    jobs: list[tuple[MethodSpec, dict, str, str]] = []
    for s in specs:
        opts = {**(method_options or {}).get(s.name, {}), **s.options}
        if get_spec(s.name).uses_scores:
            for imp in importance:
                for src in (score_sources if imp != "uniform" else ["client"]):
                    jobs.append((s, opts, imp, src))
        else:
            jobs.append((s, opts, "", ""))
    for s, opts, imp, src in jobs:
        kw = dict(opts)
        if kw.get("head_weights"):  # class-count head weighting: each client reports its class counts
            kw.setdefault("class_counts", [c["class_counts"] for c in clients])
        scores = None
        if imp and imp != "uniform":
            if src == "client":
                scores = [c["scores"][imp] for c in clients]
            else:  # the server scores on its own (skewed) fusion set with its labels
                kw.update(importance=imp, fusion_labels=data.fusion_y)
        row = {**base, "method": s.label, "importance": imp, "score_source": src}
        t0 = time.perf_counter()
        try:
            res = fuse_result(s.name, models, fusion_inputs=data.fusion_x, scores=scores, device=device,
                              seed=cfg.seed, **kw)
            secs = time.perf_counter() - t0
            ev = evaluate(res.model, tx, ty, num_classes=data.num_classes)
            row.update(accuracy=ev["accuracy"], loss=ev["loss"], fuse_seconds=secs, status="ok",
                       val_accuracy=evaluate(res.model, vx, vy)["accuracy"])
            if res.info:
                row["fusion_info"] = jsonable(res.info)
        except ValueError as e:  # FusionError and legacy n/a reasons: recorded, shown in the table
            row.update(accuracy=float("nan"), loss=float("nan"), fuse_seconds=float("nan"),
                       status=f"n/a: {type(e).__name__}: {e}")
        tag = s.label + (f" ({imp}/{src})" if imp else "")
        log(f"    {tag:<44} acc {row['accuracy']:.4f}  {row['fuse_seconds']:.2f}s  {row['status'][:80]}")
        rows.append(row)
    return rows
