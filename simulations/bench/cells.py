"""One one-shot cell: a (dataset, partition, model, seed) with its clients, references and fused models.

Per cell the clients come from the cache (``clients.get_clients``), every requested method runs through
``fedfuse.fusion.fuse_result`` (timed; its diagnostics ``info`` is kept in the row) and every model is
evaluated on the test split and on the union of the clients' validation splits ("federated validation",
what the clients can measure; method options are chosen on it, never on the test split). A method that
raises ``ValueError`` (every ``FusionError`` is one) is recorded as n/a with the reason; any other
exception is a bug and propagates.

Besides the method's own options a spec takes the fuse-level options ``refine`` (``fedfuse.fusion.refine``:
``"calibrate"``, ``"distill"``, ``"calibrate+distill"``, ``"distill+calibrate"``; applied after any method)
and ``prior`` (the class prior of ``calibrate``: ``"uniform"`` or ``"class-counts"`` = the clients' summed
per-class training counts, what each client can report): ``kf-linear[refine="distill"]``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from fedfuse.fusion import FusionOptionError, fuse_result, get_spec
from fedfuse.fusion.refine import parse_refine
from fedfuse.training import evaluate

from simulations.bench.clients import CellConfig, get_clients, load_data
from simulations.bench.specs import MethodSpec, parse_method
from simulations.bench.stats import mean
from simulations.bench.tables import jsonable

REFERENCES = ("average", "ensemble")  # always measured: the time and accuracy references
FUSE_OPTIONS = ("refine", "prior")  # options of fuse() itself, valid for every method
PRIORS = ("uniform", "class-counts")


def split_options(spec: MethodSpec, method_options: dict[str, dict] | None = None) -> tuple[dict, dict]:
    """``(method options, fuse-level options)`` of a spec: ``method_options[name]`` defaults under the
    spec's own options, ``refine``/``prior`` separated from the method's options dataclass fields.

    Raises ``FusionOptionError`` naming the spec when ``refine`` has an unknown step, ``prior`` is not one
    of ``PRIORS``, or a ``prior`` is given without a ``calibrate`` step (it would be ignored).
    """
    merged = {**(method_options or {}).get(spec.name, {}), **spec.options}
    fuse_opts = {k: merged.pop(k) for k in FUSE_OPTIONS if k in merged}
    where = f"method spec {spec.label!r}"
    try:
        steps = parse_refine(fuse_opts.get("refine"))
    except ValueError as exc:
        raise FusionOptionError(f"{where}: {exc}") from None
    fuse_opts["refine"] = "+".join(steps) or None
    prior = fuse_opts.get("prior")
    if prior is not None:
        if prior not in PRIORS:
            raise FusionOptionError(f"{where}: prior={prior!r} is not one of {PRIORS}")
        if "calibrate" not in steps:
            raise FusionOptionError(f"{where}: prior={prior!r} is only used by refine's 'calibrate' step, "
                                    f"and refine is {fuse_opts['refine']!r}")
    return merged, fuse_opts


def row_label_of(spec: MethodSpec, fuse_opts: dict) -> str:
    """The table row of a spec: its text, with the fuse-level options that came from ``--method-options``
    (not written in the spec) added in brackets, so the refine step always shows."""
    extra = [f"{k}='{fuse_opts[k]}'" for k in FUSE_OPTIONS if fuse_opts.get(k) and k not in spec.options]
    if not extra:
        return spec.label
    if spec.label.endswith("]"):
        return spec.label[:-1] + "," + ",".join(extra) + "]"
    return f"{spec.label}[{','.join(extra)}]"


def check_methods(methods: list[str], method_options: dict[str, dict] | None = None) -> list[MethodSpec]:
    """Parse method specs and validate their names, options and fuse-level options (``refine``, ``prior``)
    before any client trains (``FusionOptionError`` naming the method and key)."""
    specs = [parse_method(m) for m in methods]
    for s in specs:
        opts, _ = split_options(s, method_options)
        get_spec(s.name).parse_options(opts)
    return specs


def class_prior(clients: list[dict[str, Any]]) -> torch.Tensor:
    """``[classes]`` summed per-class training counts of the clients, normalised (``prior="class-counts"``)."""
    counts = torch.tensor([c["class_counts"] for c in clients], dtype=torch.float).sum(0)
    return counts / counts.sum()


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
    jobs: list[tuple[MethodSpec, dict, dict, str, str]] = []
    for s in specs:
        opts, fuse_opts = split_options(s, method_options)
        if get_spec(s.name).uses_scores:
            for imp in importance:
                for src in (score_sources if imp != "uniform" else ["client"]):
                    jobs.append((s, opts, fuse_opts, imp, src))
        else:
            jobs.append((s, opts, fuse_opts, "", ""))
    for s, opts, fuse_opts, imp, src in jobs:
        kw = dict(opts)
        refine = fuse_opts.get("refine")
        prior = class_prior(clients) if fuse_opts.get("prior") == "class-counts" else None  # None = uniform
        if kw.get("head_weights"):  # class-count head weighting: each client reports its class counts
            kw.setdefault("class_counts", [c["class_counts"] for c in clients])
        scores = None
        if imp and imp != "uniform":
            if src == "client":
                scores = [c["scores"][imp] for c in clients]
            else:  # the server scores on its own (skewed) fusion set with its labels
                kw.update(importance=imp, fusion_labels=data.fusion_y)
        label = row_label_of(s, fuse_opts)
        row = {**base, "method": label, "importance": imp, "score_source": src, "refine": refine or ""}
        t0 = time.perf_counter()
        try:
            res = fuse_result(s.name, models, fusion_inputs=data.fusion_x, scores=scores, device=device,
                              seed=cfg.seed, refine=refine, prior=prior, **kw)
            secs = time.perf_counter() - t0
            ev = evaluate(res.model, tx, ty, num_classes=data.num_classes)
            row.update(accuracy=ev["accuracy"], loss=ev["loss"], fuse_seconds=secs, status="ok",
                       val_accuracy=evaluate(res.model, vx, vy)["accuracy"])
            if res.info:
                row["fusion_info"] = jsonable(res.info)
        except ValueError as e:  # FusionError and legacy n/a reasons: recorded, shown in the table
            row.update(accuracy=float("nan"), loss=float("nan"), fuse_seconds=float("nan"),
                       status=f"n/a: {type(e).__name__}: {e}")
        tag = label + (f" ({imp}/{src})" if imp else "")
        log(f"    {tag:<44} acc {row['accuracy']:.4f}  {row['fuse_seconds']:.2f}s  {row['status'][:80]}")
        rows.append(row)
    return rows
