"""FS-Merge benchmark (issue #5): one-shot fusion of the harness's clients over a low-data sweep of fusion-set
sizes, with fusion wall time and peak memory as ratios to KD on the same fusion set.

    python -m simulations.bench.fs_merge --datasets digits,mnist1d --partitions shards2,dirichlet4 \\
        --models mlp --methods fs-merge,fs-merge-seq,kd,ensemble,average --sizes 50,200,800 \\
        --seeds 0,1,2 --out results/fs_merge/mlp_v2
    # ViT (results/fs_merge/vit_v2): --models vit --partitions shards2 --sizes 50,200 \\
    #     --options '{"fs-merge": {"steps": 300}}'

Clients are the one-shot benchmark's (same flags, same cache, so numbers compare with ``results/one_shot``).
Every method fuses them with a fusion set of each size drawn from ``--fusion-source`` (default ``client0``;
sizes above the pool are capped and the actual size is recorded). Rows are appended to ``<out>/rows.jsonl``
(an interrupted run resumes where it stopped; ``--merge`` adds rows of other runs, e.g. split jobs);
``<out>/summary.md`` has mean ± sample std (ddof=1) over seeds and the ratios to ``kd``. Each row keeps
the method's diagnostics (``fuse_result(...).info``: FS-Merge losses and stage timings).

Memory (``--memory``): ``profile`` (CPU default) = peak live bytes of PyTorch's CPU allocator from a
``torch.profiler`` memory profile of a separate, shortened pass (fs-merge: 4 steps, kd: 1 epoch; the peak
does not depend on the number of steps); on CUDA ``torch.cuda.max_memory_allocated`` during the timed call;
``rss`` = sampled process-RSS delta (blind to small allocations); ``none``.

Option selection for FS-Merge: give several variants (``fs-merge[init="average"]``, …) to
``python -m simulations.bench.one_shot``; its table picks the variant by federated validation accuracy.
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import json
import statistics
from pathlib import Path

import torch

from fedfuse.training import evaluate, resolve_device

from simulations.bench.cells import check_methods
from simulations.bench.clients import add_client_arguments, cell_from_args, get_clients, load_data
from simulations.bench.specs import parse_ints, parse_partition, split_list
from simulations.bench.stats import format_mean_std, std_note
from simulations.bench.tables import append_jsonl, jsonable, markdown_table, read_jsonl
from simulations.bench.timing import MEMORY_MEASURES, timed_fuse

# options of the shortened memory pass (the peak of these methods does not depend on the step count)
SHORT_PASS = {"fs-merge": {"steps": 4, "epochs": None}, "fs-merge-seq": {"steps": 4, "stage_steps": 4, "epochs": None},
              "kd": {"epochs": 1}}
REFERENCE = "kd"


def _ms(values: list[float]) -> str:
    return format_mean_std(values, 1.0, 3) if values else "-"


def summarise(rows: list[dict]) -> str:
    """Markdown: accuracy per setting/size/method; time and memory ratios to kd; accuracy minus kd."""
    methods = sorted({r["method"] for r in rows}, key=lambda m: (m not in ("fs-merge", "fs-merge-seq"), m))
    others = [m for m in methods if m != "ensemble"]
    settings = sorted({(r["dataset"], r["partition"], r["model"]) for r in rows})
    sizes = sorted({r["size"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    acc_rows = []
    for ds, part, mod in settings:
        for s in sizes:
            sel = [r for r in rows if (r["dataset"], r["partition"], r["model"], r["size"]) == (ds, part, mod, s)]
            if not sel:
                continue
            actual = sorted({r["actual_size"] for r in sel})
            best = [r["best_client"] for r in sel if r["method"] == sel[0]["method"]]
            ens = [r["accuracy"] for r in sel if r["method"] == "ensemble"]
            acc_rows.append([ds, part, mod, f"{s} ({'/'.join(map(str, actual))})", _ms(best), _ms(ens),
                             *[_ms([r["accuracy"] for r in sel if r["method"] == m]) for m in others]])
    key = lambda r: (r["dataset"], r["partition"], r["model"], r["size"], r["seed"])  # noqa: E731
    kd = {key(r): r for r in rows if r["method"] == REFERENCE}
    cost_rows = []
    for m in methods:
        for mod in sorted({r["model"] for r in rows}):
            sel = [r for r in rows if r["method"] == m and r["model"] == mod]
            if not sel:
                continue
            tr = [r["seconds"] / kd[key(r)]["seconds"] for r in sel if key(r) in kd and kd[key(r)]["seconds"] > 0]
            # sampled-RSS deltas below 1 MiB are allocator noise: no ratio from those (profiled/CUDA bytes are exact)
            mr = [r["peak_bytes"] / kd[key(r)]["peak_bytes"] for r in sel
                  if key(r) in kd and kd[key(r)]["peak_bytes"] >= (2**20 if r.get("memory_measure", "rss") == "rss" else 1)]
            cost_rows.append([m, mod, _ms(tr), _ms(mr), f"{statistics.median(r['seconds'] for r in sel):.2f}",
                              f"{statistics.median(r['peak_bytes'] for r in sel) / 2**20:.1f}"])
    delta_rows = []
    for ds, part, mod in settings:
        for s in sizes:
            for m in ("fs-merge", "fs-merge-seq"):
                d = [r["accuracy"] - kd[key(r)]["accuracy"] for r in rows if r["method"] == m and key(r) in kd
                     and (r["dataset"], r["partition"], r["model"], r["size"]) == (ds, part, mod, s)]
                if d:
                    delta_rows.append([ds, part, mod, s, m, _ms(d), f"{sum(v >= 0 for v in d)}/{len(d)}"])
    return ("Accuracy (fraction), " + std_note(len(seeds)) + f" {seeds}.\n\n"
            + markdown_table(["dataset", "partition", "model", "fusion size (actual)", "best client", "ensemble",
                              *others], acc_rows)
            + "\nFusion wall time and peak memory as ratios to kd on the same fusion set (per-row ratio, then "
              "mean ± sample std (ddof=1) over settings × sizes × seeds); absolute medians beside.\n\n"
            + markdown_table(["method", "model", "time / kd", "peak mem / kd", "median time s", "median peak MiB"],
                             cost_rows)
            + "\nAccuracy minus kd on the same fusion set and seed (mean ± sample std (ddof=1) over seeds; wins = "
              "seeds with method ≥ kd).\n\n"
            + markdown_table(["dataset", "partition", "model", "size", "method", "Δ vs kd", "wins"], delta_rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench.fs_merge", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="digits,mnist1d")
    ap.add_argument("--partitions", default="shards2,dirichlet4")
    ap.add_argument("--models", default="mlp,vit")
    ap.add_argument("--methods", default="fs-merge,fs-merge-seq,kd,ensemble,average")
    ap.add_argument("--sizes", default="50,200,800")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--fusion-device", default="auto", help="where fusion runs (clients train on --device)")
    ap.add_argument("--options", default="{}", help='JSON per method: {"fs-merge": {"steps": 300}, ...}')
    ap.add_argument("--memory", default="profile", choices=list(MEMORY_MEASURES))
    ap.add_argument("--merge", default="", help="comma-separated rows.jsonl files of other runs to include")
    ap.add_argument("--out", default="results/fs_merge/sweep")
    add_client_arguments(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.fusion_device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    methods = split_list(args.methods)
    options = json.loads(args.options)
    check_methods(methods, options)
    partitions = [parse_partition(p).name for p in split_list(args.partitions)]
    rows_path = out / "rows.jsonl"
    rows = read_jsonl(rows_path) if rows_path.exists() else []
    done = {(r["dataset"], r["partition"], r["model"], r["seed"], r["size"], r["method"]) for r in rows}
    merged = [r for f in split_list(args.merge) for r in read_jsonl(Path(f))]
    for ds in split_list(args.datasets):
        for part in partitions:
            for mod in split_list(args.models):
                for seed in parse_ints(args.seeds):
                    cfg = cell_from_args(args, ds, part, mod, seed)
                    data = load_data(cfg, 1)
                    clients = get_clients(cfg, data, ["uniform"], Path(args.cache), args.device,
                                          log=lambda s: print(s, flush=True))
                    models = [c["model"] for c in clients]
                    xt, yt = data.test.x, data.test.y
                    client_acc = [evaluate(m, xt, yt)["accuracy"] for m in models]
                    for size in parse_ints(args.sizes):
                        x = load_data(cfg, size).fusion_x
                        for m in methods:
                            if (ds, part, mod, seed, size, m) in done:
                                continue
                            res, sec, peak = timed_fuse(m, models, x, device, seed, options.get(m, {}), args.memory,
                                                        short_options=SHORT_PASS.get(m))
                            acc = evaluate(res.model, xt, yt)["accuracy"]
                            row = dict(dataset=ds, partition=part, model=mod, seed=seed, size=size,
                                       actual_size=len(x), method=m, accuracy=acc, seconds=sec, peak_bytes=peak,
                                       best_client=max(client_acc), clients=client_acc, device=str(device),
                                       options=options.get(m, {}), clients_recipe="oneshot",
                                       memory_measure=args.memory if device.type != "cuda" else "cuda",
                                       info=jsonable(res.info))
                            rows.append(row)
                            append_jsonl(row, rows_path)
                            print(f"{ds} {part} {mod} s{seed} n={len(x)} {m:14s} acc={acc:.3f} "
                                  f"({sec:.1f}s, {peak / 2**20:.0f} MiB) best-client={max(client_acc):.3f}", flush=True)
    text = summarise(rows + merged)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
