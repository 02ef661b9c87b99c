"""Seed 000 at CPU scale: heterogeneous ViT clients fused (vanilla OT, selective OT, neuron interpolation),
then structurally pruned (``fedfuse.pruning.prune``), against the parents, their ensemble, the best parent
pruned alone and KD into the same pruned architecture (issue 14).

    .venv/bin/python -m simulations.bench.seed000 --datasets mnist1d --partition full2 --seeds 0,1,2 \\
        --archs 64x4x4,128x8x6 --out results/seed000
    .venv/bin/python -m simulations.bench.seed000 --ablation --datasets mnist1d --seeds 0,1,2 --out results/seed000

The committed ``results/seed000/table.md`` ran as one process per seed (``--seeds 0 --out
results/seed000/parts/mnist1d-s0`` etc.), merged by ``--report-only --merge
results/seed000/parts/mnist1d-s0/results.json,...-s1/...,...-s2/... --out results/seed000`` (same rows as the
single command; every part's command is the table's first line).

Clients: one ViT per entry of ``--archs`` (``<embed>x<heads>x<depth>``), each from its own initialisation
(``clients.client_seed``), trained with the harness's one-shot recipe (``clients.train_client``: AdamW,
cosine, label smoothing 0.1, early stopping on the client's validation split) on its partition (``full2``:
every client sees the whole training pool; ``iid2``; ``dirichlet2``), cached under ``--cache``. The server
holds ``--fusion-size`` unlabeled samples from the public pool no client trains on. Phases: ``--phase train``
(only train/cache the clients), ``--phase all`` (train, fuse, prune, evaluate, time, write the tables).

Rows (each evaluated on the test split): every parent; the ensemble; ``ot`` (vanilla, EMD on activations,
CKA block matching where depths differ), ``ot[selective=true]`` (importance-conditioned transport) and
``kf-gradient`` (neuron interpolation) fused into the larger parent's architecture; each fused model
followed by pruning to (a) the larger parent's parameter count, (b) the smaller parent's, (c) 50 % of the
larger parent's MACs, with and without recovery (distillation of the parents' ensemble on the fusion set);
baselines: the best parent (by federated validation accuracy, never test) pruned the same way, and KD of
the ensemble into the pruned architecture. Columns: accuracy (mean ± sample std, ddof = 1, over seeds),
parameters, MACs (``torch.utils.flop_counter``; MACs = FLOPs / 2), CPU latency per batch as a ratio to the
larger parent (interleaved medians, one process, one thread).
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from fedfuse.data import FederatedData
from fedfuse.models import build_model
from fedfuse.training import evaluate

from simulations.bench.clients import _atomic_save, cell_config, client_seed, train_client
from simulations.bench.specs import parse_ints, parse_partition, split_list


def parse_arch(text: str) -> tuple[int, int, int]:
    """``"64x4x4"`` → ``(embed 64, heads 4, depth 4)``."""
    try:
        w, h, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"arch {text!r}: expected <embed>x<heads>x<depth>, e.g. 64x4x4") from None
    if w % h:
        raise ValueError(f"arch {text!r}: embed {w} not divisible by {h} heads")
    return w, h, d


def load_data(dataset: str, partition: str, seed: int, fusion_size: int, alpha: float) -> FederatedData:
    spec = parse_partition(partition)
    return FederatedData.build(dataset, spec.num_clients, spec.method, alpha=alpha, fusion_size=fusion_size,
                               fusion_source="public", seed=seed)


def get_parents(dataset: str, partition: str, seed: int, archs: list[tuple[int, int, int]], data: FederatedData,
                cache: Path, epochs: int, lr: float, alpha: float, log=print) -> list[dict]:
    """Train (or load) one client per arch; client ``pid`` gets arch ``archs[pid]`` and seed
    ``client_seed(cfg, pid)``. Returns dicts with ``model``, ``arch``, ``val`` accuracy, ``train_info``."""
    out = []
    for pid, (w, h, d) in enumerate(archs):
        cfg = cell_config(dataset, partition, "vit", seed, width=w, depth=d, epochs=epochs, lr=lr, alpha=alpha,
                          fusion_source="public", model_options={"num_heads": h})
        path = cache / cfg.key() / f"client{pid}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        model = build_model("vit", num_classes=data.num_classes, input_shape=data.input_shape, width=w, depth=d,
                            num_heads=h, seed=client_seed(cfg, pid))
        tr, va = data.client_data(pid, cfg.val_fraction, seed)
        rec = torch.load(path, weights_only=False) if path.exists() else None
        if rec is None:
            info = train_client(model, tr.x, tr.y, cfg.recipe(), seed=client_seed(cfg, pid), val=(va.x, va.y))
            rec = {"state": {k: v.cpu() for k, v in model.state_dict().items()}, "train_info": info}
            _atomic_save(rec, path)
            log(f"  {dataset}/{partition} seed {seed} client {pid} ({w}x{h}x{d}): trained in "
                f"{info['train-seconds']:.0f}s, {info['epochs']} epochs (best {info['best-epoch']}), "
                f"val acc {info['val-accuracy']:.3f}")
        model.load_state_dict(rec["state"])
        model.eval()
        out.append({"model": model, "arch": (w, h, d), "val": va, "train_info": rec["train_info"]})
    return out


FUSIONS = {  # row label -> (fuse method, options); every fused model takes the larger parent's architecture
    "vanilla OT": ("ot", {}),
    "selective OT": ("ot", {"selective": True}),
    "neuron interpolation (kf-gradient)": ("kf-gradient", {}),  # shallower parent padded (``pad_depth``)
}
ABLATION = {  # selective OT variants (zero-shot and fused + recovery at the larger parent's size): --ablation
    "selective OT [mass=0.5]": {"selective": True, "mass": 0.5},
    "selective OT [mass=0.9]": {"selective": True, "mass": 0.9},
    "selective OT [transport=balanced]": {"selective": True, "transport": "balanced"},
    "selective OT [transport=unbalanced]": {"selective": True, "transport": "unbalanced"},
    "selective OT [importance=activation]": {"selective": True, "importance": "activation"},
    "selective OT [importance=uniform]": {"selective": True, "importance": "uniform"},
}
TARGETS = {"a": "larger parent's params", "b": "smaller parent's params", "c": "50% of larger parent's MACs"}


def pad_depth(model: nn.Module, anchor: nn.Module, x: torch.Tensor, seed: int) -> nn.Module:
    """``model`` (a ViT) at ``anchor``'s depth, the same function: its blocks keep the positions the CKA block
    matching of selective OT gives them (``fedfuse.fusion.selective.match_depth``), the anchor's unmatched
    positions get identity blocks (a copy of a neighbour with the attention and MLP output projections zeroed,
    so both residual branches add 0). Deeper models are returned unchanged (the method then refuses them)."""
    from fedfuse.fusion.selective import match_depth

    if len(model.blocks) >= len(anchor.blocks):
        return model
    match, _ = match_depth(model, anchor, x, device="cpu", max_rows=4096, seed=seed)
    blocks, last = [], model.blocks[0]
    for i in match:
        if i is None:
            blk = copy.deepcopy(last)
            with torch.no_grad():
                for lin in (blk.attn.proj, blk.mlp.fc2):
                    lin.weight.zero_()
                    if lin.bias is not None:
                        lin.bias.zero_()
        else:
            blk = last = copy.deepcopy(model.blocks[i])
        blocks.append(blk)
    out = copy.deepcopy(model)
    out.blocks = nn.Sequential(*blocks)
    return out.eval()


def _acc(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(evaluate(model, x, y)["accuracy"])


def _size(model: nn.Module, example: torch.Tensor) -> tuple[int, int]:
    from fedfuse.pruning import count_macs, count_params

    return count_params(model), count_macs(model, example)


def run_seed(ds: str, seed: int, args, archs, log=print) -> tuple[list[dict], dict[str, nn.Module]]:
    """Every row of one (dataset, seed): ``(rows, models by row label for the latency timing)``."""
    from fedfuse.fusion import fuse, fuse_result, normalise_weights
    from fedfuse.fusion.refine import DistillRefineOptions, distill_ensemble
    from fedfuse.pruning import prune_result

    data = load_data(ds, args.partition, seed, args.fusion_size, args.alpha)
    parents = get_parents(ds, args.partition, seed, archs, data, Path(args.cache), args.epochs, args.lr, args.alpha,
                          log=log)
    tx, ty, X = data.test.x, data.test.y, data.fusion_x
    example = X[:1]
    models = [p["model"] for p in parents]
    sizes = [_size(m, example) for m in models]
    big_i = max(range(len(models)), key=lambda i: sizes[i][0])
    small_i = min(range(len(models)), key=lambda i: sizes[i][0])
    big = models[big_i]
    # the best parent by its own validation split (federated validation; never the test split)
    val_acc = [_acc(p["model"], p["val"].x, p["val"].y) for p in parents]
    best_i = max(range(len(models)), key=lambda i: val_acc[i])
    order = [big_i] + [i for i in range(len(models)) if i != big_i]  # the larger parent is the anchor
    base = dict(dataset=ds, partition=args.partition, seed=seed)
    rows: list[dict] = []
    timed: dict[str, nn.Module] = {}

    def add(label: str, model: nn.Module | None, stage: str, **extra) -> None:
        row = {**base, "row": label, "stage": stage, **extra}
        if model is not None:
            row["accuracy"] = _acc(model, tx, ty)
            row["params"], row["macs"] = _size(model, example)
            timed[label] = model
        else:
            row.setdefault("accuracy", float("nan"))
        rows.append(row)
        log(f"    {ds} s{seed} {label}: " + (f"{row['accuracy']:.3f}" if model is not None else row.get("status", "")))

    for i, p in enumerate(parents):
        w, h, d = p["arch"]
        add(f"parent {w}x{h}x{d}" + (" (larger)" if i == big_i else ""), p["model"], "parent", val_accuracy=val_acc[i])
    add("best parent (validation)", models[best_i], "parent", parent=best_i)
    add("ensemble", fuse("ensemble", models), "reference")
    fused: dict[str, nn.Module] = {}
    for label, (method, opts) in FUSIONS.items():
        t0 = time.perf_counter()
        try:
            inputs = [models[i] for i in order]
            if method != "ot":  # neuron interpolation needs equal depths: pad the shallower parents (exactly)
                inputs = [inputs[0]] + [pad_depth(m, inputs[0], X, seed) for m in inputs[1:]]
            res = fuse_result(method, inputs, fusion_inputs=X, seed=seed, **opts)
            fused[label] = res.model
            add(label, res.model, "fused", fuse_seconds=time.perf_counter() - t0,
                info={k: v for k, v in res.info.items() if k in ("block_match", "matched_fraction")})
        except ValueError as exc:  # a FusionError: recorded in the table as n/a
            add(label, None, "fused", status=f"n/a: {type(exc).__name__}: {str(exc)[:160]}")
    big_params, big_macs = sizes[big_i]
    small_params = sizes[small_i][0]
    sources = {**fused, "best parent alone": models[best_i]}
    pruned_arch: dict[str, nn.Module] = {}
    for src, model in sources.items():
        params, macs = _size(model, example)
        for tk in TARGETS:
            how = ({"params_ratio": min(1.0, big_params / params)} if tk == "a" else
                   {"params_ratio": min(1.0, small_params / params)} if tk == "b" else
                   {"macs_ratio": min(1.0, 0.5 * big_macs / macs)})
            t0 = time.perf_counter()
            pr = prune_result(model, fusion_inputs=X, teachers=models, seed=seed, **how)
            pinfo = {k: pr.info.get(k) for k in ("params_ratio", "macs_ratio", "within_tolerance", "keep_fraction",
                                                 "blocks_removed")}
            add(f"{src} → ({tk})", pr.model, "pruned", source=src, target=tk, recover=False,
                prune_seconds=time.perf_counter() - t0, prune_info=pinfo)
            if src == "selective OT":
                pruned_arch[tk] = pr.model
            # recovery = prune(..., recover=True)'s step: the parents' ensemble distilled on the fusion set
            rec = copy.deepcopy(pr.model)
            t0 = time.perf_counter()
            rinfo = distill_ensemble(rec, models, normalise_weights(None, len(models)), X, DistillRefineOptions(),
                                     seed=seed)
            add(f"{src} → ({tk}) + recovery", rec.eval(), "pruned", source=src, target=tk, recover=True,
                recover_seconds=time.perf_counter() - t0, prune_info=pinfo, recover_info=rinfo)
    for tk, arch in pruned_arch.items():  # KD of the ensemble into the same pruned architecture (from scratch)
        t0 = time.perf_counter()
        kd = fuse("kd", models, fusion_inputs=X, target=arch, seed=seed)
        add(f"KD → ({tk}) arch", kd, "kd", target=tk, fuse_seconds=time.perf_counter() - t0)
    return rows, timed, big_i


def run_ablation(ds: str, seed: int, args, archs, log=print) -> list[dict]:
    """Selective-OT option variants: zero-shot accuracy and after recovery (no pruning: the larger parent's size)."""
    from fedfuse.fusion import fuse_result, normalise_weights
    from fedfuse.fusion.refine import DistillRefineOptions, distill_ensemble

    data = load_data(ds, args.partition, seed, args.fusion_size, args.alpha)
    parents = get_parents(ds, args.partition, seed, archs, data, Path(args.cache), args.epochs, args.lr, args.alpha,
                          log=log)
    models = [p["model"] for p in parents]
    big_i = max(range(len(models)), key=lambda i: sum(p.numel() for p in models[i].parameters()))
    order = [models[big_i]] + [m for i, m in enumerate(models) if i != big_i]
    rows = []
    for label, opts in ABLATION.items():
        res = fuse_result("ot", order, fusion_inputs=data.fusion_x, seed=seed, **opts)
        rec = copy.deepcopy(res.model)
        distill_ensemble(rec, models, normalise_weights(None, len(models)), data.fusion_x, DistillRefineOptions(),
                         seed=seed)
        for stage, m in (("fused", res.model), ("fused + recovery", rec.eval())):
            rows.append({"dataset": ds, "partition": args.partition, "seed": seed, "row": label, "stage": stage,
                         "accuracy": _acc(m, data.test.x, data.test.y),
                         "matched_fraction": res.info["matched_fraction"][0]})
            log(f"    {ds} s{seed} {label} {stage}: {rows[-1]['accuracy']:.3f}")
    return rows


def latency_ratios(timed: dict[str, nn.Module], ref: str, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median CPU wall time per batch ``x`` of every model, as a ratio to ``ref``'s (interleaved, one process)."""
    from simulations.bench.timing import interleaved_timings, medians

    def call(m):
        def f():
            with torch.no_grad():
                m(x)
        return f

    med = medians(interleaved_timings({k: call(m) for k, m in timed.items()}, repeats=repeats, warmup=2))
    return {k: v["wall"] / med[ref]["wall"] for k, v in med.items()}


def write_report(rows: list[dict], out: Path, invocation: str, seeds: list[int]) -> str:
    from simulations.bench.stats import format_mean_std, mean, std_note
    from simulations.bench.tables import markdown_table, write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json({"invocation": invocation, "rows": rows}, out / "results.json")
    text = ["# Seed 000 at CPU scale: fuse heterogeneous ViTs, then prune (issue 14)", "",
            f"Command: `{invocation}`", "",
            f"Accuracy: test accuracy %, {std_note(len(seeds))}; parameters and MACs per sample (means); latency: "
            "CPU wall time per batch of 256 test samples (1 thread), median of interleaved repeats, as a ratio to "
            "the larger parent measured in the same process (mean ± sample std over seeds). Pruning targets: "
            + "; ".join(f"({k}) {v}" for k, v in TARGETS.items()) + ". Recovery: distillation of the parents' "
            "ensemble on the 300-sample unlabeled fusion set (held-out early stopping). The fused models take the "
            "larger parent's architecture (it is the OT anchor).", ""]
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        rs = [r for r in rows if r["dataset"] == ds]
        text += [f"## {ds} ({rs[0]['partition']})", ""]
        table = []
        for label in dict.fromkeys(r["row"] for r in rs):
            g = [r for r in rs if r["row"] == label]
            acc = [r["accuracy"] for r in g]
            if all(a != a for a in acc):
                table.append([label, g[0].get("status", "n/a")[:90], "", "", "", ""])
                continue
            lat = [r.get("latency_ratio", float("nan")) for r in g]
            table.append([label, format_mean_std(acc, 100.0), f"{mean([r['params'] for r in g]) / 1e3:.1f}k",
                          f"{mean([r['macs'] for r in g]) / 1e6:.2f}M", format_mean_std(lat, 1.0, 2), len(g)])
        text.append(markdown_table(["row", "accuracy %", "params", "MACs/sample", "latency ratio", "seeds"], table))
    md = "\n".join(text)
    (out / "table.md").write_text(md)
    try:
        from simulations.bench.plots import accuracy_bars

        acc = {}
        for r in rows:
            acc.setdefault((r["row"], r["dataset"]), []).append(r["accuracy"])
        accuracy_bars(acc, list(dict.fromkeys(r["dataset"] for r in rows)),
                      list(dict.fromkeys(r["row"] for r in rows)), out / "accuracy.png",
                      references={"best parent (validation)": "best parent", "ensemble": "ensemble"})
    except Exception as exc:  # noqa: BLE001 - the plot is a convenience; the table is the result
        print(f"plot failed: {exc}", file=sys.stderr)
    return md


def write_ablation(rows: list[dict], out: Path, invocation: str) -> None:
    from simulations.bench.stats import format_mean_std, std_note
    from simulations.bench.tables import markdown_table, write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json({"invocation": invocation, "rows": rows}, out / "ablation.json")
    seeds = sorted({r["seed"] for r in rows})
    table = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        for label in dict.fromkeys(r["row"] for r in rows):
            g = [r for r in rows if r["dataset"] == ds and r["row"] == label]
            cells = [format_mean_std([r["accuracy"] for r in g if r["stage"] == st], 100.0)
                     for st in ("fused", "fused + recovery")]
            mf = [sum(r["matched_fraction"].values()) / len(r["matched_fraction"]) for r in g if r["stage"] == "fused"]
            table.append([ds, label, *cells, format_mean_std(mf, 1.0, 2)])
    text = ("# Selective OT ablation (seed 000 benchmark clients, fused into the larger parent's architecture)\n\n"
            f"Command: `{invocation}`\n\nTest accuracy %, {std_note(len(seeds))}; matched fraction = mean over "
            "groups of the anchor units' matched importance mass.\n\n"
            + markdown_table(["dataset", "variant", "zero-shot", "+ recovery", "matched fraction"], table))
    (out / "ablation.md").write_text(text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default="mnist1d")
    ap.add_argument("--partition", default="full2")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--archs", default="64x4x4,128x8x6")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--fusion-size", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=15, help="latency repeats per model")
    ap.add_argument("--cache", default="results/cache/seed000")
    ap.add_argument("--out", default="results/seed000")
    ap.add_argument("--phase", default="all", choices=["train", "all"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--merge", default="", help="results.json files whose rows are added (other datasets/seeds)")
    ap.add_argument("--ablation", action="store_true", help="only the selective-OT option variants (ablation.md)")
    ap.add_argument("--report-only", action="store_true", help="only rewrite the report from --merge")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    invocation = "python -m simulations.bench.seed000 " + " ".join(argv if argv is not None else sys.argv[1:])
    archs = [parse_arch(a) for a in split_list(args.archs)]
    seeds = parse_ints(args.seeds)
    rows: list[dict] = []
    parts = []
    for path in split_list(args.merge):
        blob = json.loads(Path(path).read_text())
        rows += blob["rows"]
        parts.append(blob.get("invocation", path))
    if parts:
        invocation = " ; ".join(parts) + f" ; merged by: {invocation}"
    out = Path(args.out)
    if args.report_only:
        print(write_report(rows, out, invocation, sorted({r["seed"] for r in rows})))
        return
    if args.ablation:
        for ds in split_list(args.datasets):
            for seed in seeds:
                rows += run_ablation(ds, seed, args, archs)
                write_ablation(rows, out, invocation)
        return
    for ds in split_list(args.datasets):
        for seed in seeds:
            if args.phase == "train":
                data = load_data(ds, args.partition, seed, args.fusion_size, args.alpha)
                parents = get_parents(ds, args.partition, seed, archs, data, Path(args.cache), args.epochs, args.lr,
                                      args.alpha)
                print(f"{ds} seed {seed}: parents test acc "
                      f"{[round(_acc(p['model'], data.test.x, data.test.y), 3) for p in parents]}", flush=True)
                continue
            seed_rows, timed, big_i = run_seed(ds, seed, args, archs)
            ref = next(r["row"] for r in seed_rows if r["row"].endswith("(larger)"))
            data = load_data(ds, args.partition, seed, args.fusion_size, args.alpha)
            lat = latency_ratios(timed, ref, data.test.x[:256], args.repeats)
            for r in seed_rows:
                r["latency_ratio"] = lat.get(r["row"], float("nan"))
            rows += seed_rows
            print(write_report(rows, out, invocation, sorted({r["seed"] for r in rows})), flush=True)


if __name__ == "__main__":
    main()
