"""Fusion time against baselines measured in the same run: ``average``, one forward pass of one client
over the fusion set, and one client's local training.

    # 4 MLP clients of the one-shot cache, KF-linear with uniform and client DeepLIFT scores
    python -m simulations.bench.fusion_time --dataset mnist1d --partition dirichlet4 --model mlp \\
        --methods kf-linear,"kf-linear[kmeans_restarts=10]" --importance uniform,deeplift --out results/fusion_time/mlp
    # 4 ViT clients, OT / re-basin / TransFusion (results/ot/timing.md)
    python -m simulations.bench.fusion_time --dataset digits --partition dirichlet4 --model vit \\
        --epochs 10 --lr 1e-3 --optimizer adam --weight-decay 0 --label-smoothing 0 --patience 0 --schedule constant \\
        --model-options '{"vit": {"num_heads": 4}}' --importance uniform --repeats 9 --out results/ot/timing \\
        --methods 'ot[solver="sinkhorn"],ot[solver="emd"],ot[solver="emd",cost="weights"],rebasin,rebasin[matching="weights"],transfusion'

Clients come from the harness cache (same flags as ``one_shot``). Every case runs ``--repeats`` times,
interleaved with the others, and the median is reported; ratios use process CPU time (with one torch
thread, what the wall time would be on an idle core), wall time is shown beside it. Writes
``<out>/table.md`` and ``<out>/timing.json``.
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from fedfuse.fusion import fuse, get_spec
from fedfuse.models import build_model
from fedfuse.training import evaluate, predict_logits

from simulations.bench.cells import check_methods
from simulations.bench.clients import add_client_arguments, cell_from_args, client_seed, get_clients, load_data, \
    train_client
from simulations.bench.specs import parse_partition, split_list
from simulations.bench.tables import markdown_table, write_json
from simulations.bench.timing import interleaved_timings, medians

AVERAGE = "average"
FORWARD = "one forward pass of one client over the fusion set"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench.fusion_time", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="mnist1d")
    ap.add_argument("--partition", default="dirichlet4")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="kf-linear")
    ap.add_argument("--importance", default="uniform,deeplift", help="scores for methods that use them")
    ap.add_argument("--fusion-size", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-train-reference", action="store_true", help="skip timing one client's local training")
    ap.add_argument("--out", default="results/fusion_time/default")
    add_client_arguments(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parse_partition(args.partition)
    specs = check_methods(split_list(args.methods))
    importance = split_list(args.importance) or ["uniform"]
    cfg = cell_from_args(args, args.dataset, args.partition, args.model, args.seed)
    data = load_data(cfg, args.fusion_size)
    clients = get_clients(cfg, data, [i for i in importance if i != "uniform"], Path(args.cache), args.device)
    models = [c["model"] for c in clients]
    x = data.fusion_x

    cases = {AVERAGE: lambda: fuse(AVERAGE, models), FORWARD: lambda: predict_logits(models[0], x)}
    fused_by_case = {}
    for s in specs:
        for imp in (importance if get_spec(s.name).uses_scores else [""]):
            scores = [c["scores"][imp] for c in clients] if imp and imp != "uniform" else None
            label = s.label + (f" ({imp})" if imp else "")

            def run(s=s, scores=scores, label=label):
                fused_by_case[label] = fuse(s.name, models, fusion_inputs=x, scores=scores, seed=args.seed,
                                            device=args.device, **s.options)
            cases[label] = run
    res = medians(interleaved_timings(cases, args.repeats, warmup=1))

    train_cpu = train_wall = float("nan")
    tr = None
    if not args.no_train_reference:  # client 0's local training, from scratch (same seed), with its recipe
        m = build_model(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape, width=cfg.width,
                        depth=cfg.depth, seed=client_seed(cfg, 0), **cfg.model_options)
        tr, va = data.client_data(0, cfg.val_fraction, cfg.seed)
        c0 = time.process_time()
        info = train_client(m, tr.x, tr.y, cfg.recipe(), seed=client_seed(cfg, 0), val=(va.x, va.y))
        train_cpu, train_wall = time.process_time() - c0, info["train-seconds"]

    avg, fwd = res[AVERAGE], res[FORWARD]
    rows = []
    for case, t in res.items():
        acc = (evaluate(fused_by_case[case], data.test.x, data.test.y)["accuracy"] if case in fused_by_case
               else evaluate(fuse(AVERAGE, models), data.test.x, data.test.y)["accuracy"] if case == AVERAGE else None)
        rows.append([case, f"{t['cpu']:.4f}", f"{t['cpu'] / avg['cpu']:.1f}", f"{t['cpu'] / (avg['cpu'] + fwd['cpu']):.1f}",
                     f"{t['cpu'] / train_cpu:.3g}" if train_cpu == train_cpu else "-", f"{t['wall']:.4f}",
                     f"{100 * acc:.1f}" if acc is not None else ""])
    title = (f"# Fusion time: {len(models)} {cfg.model} clients (width {cfg.width}, depth {cfg.depth}), "
             f"{cfg.dataset}/{cfg.partition} seed {cfg.seed}, {len(x)} fusion samples, {args.device}, "
             f"{torch.get_num_threads()} torch thread(s)\n\n"
             f"Median of {args.repeats} interleaved repeats; every ratio uses process CPU time measured in this run "
             f"(robust on a shared machine), wall time beside it. One client's local training (client 0, "
             f"{len(tr) if tr is not None else '-'} samples, retrained from scratch): CPU "
             f"{train_cpu:.2f} s, wall {train_wall:.2f} s. Load average at the end: {os.getloadavg()[0]:.1f}.\n\n")
    text = title + markdown_table(["case", "CPU s", "× average", "× (average + forward pass)",
                                   "× one client's training", "wall s", "test acc %"], rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    write_json({"argv": sys.argv if argv is None else argv, "cases": res, "train_cpu": train_cpu,
                "train_wall": train_wall}, out / "timing.json")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
