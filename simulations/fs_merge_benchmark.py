"""FS-Merge benchmark (issue #5): one-shot fusion of independently trained clients, low-data sweep,
fusion wall time and peak memory as ratios to KD on the same fusion set.

    python -m simulations.fs_merge_benchmark --datasets digits,mnist1d --partitions shards2,dirichlet4 \
        --models mlp,vit --methods fs-merge,fs-merge-seq,kd,ensemble,average --sizes 50,200,800 \
        --seeds 0,1,2 --out results/fs_merge/sweep

Per (dataset, partition, model, seed) the clients are those of the shared one-shot runner
(``--clients oneshot``, default: ``simulations.oneshot_lib`` recipe and cache ``results/cache``, so the numbers
are comparable with ``results/one_shot``; ``--clients own`` = this script's older recipe, cached under
``<out>/../cache``). Every method fuses them with a fusion set of each size drawn from ``--fusion-source``
(default ``client0``: FINDINGS.md's skewed setting; sizes above the pool are capped and the actual size is
recorded). Rows go to ``<out>/rows.jsonl``; ``<out>/summary.md`` holds mean ± std over seeds and the time /
memory ratios to ``kd``.

Memory (``--memory``): ``profile`` (CPU default) = peak of the live bytes allocated by PyTorch's CPU allocator
during the call, from a ``torch.profiler`` memory profile (every tensor allocation/free, cumulative sum, max; the
baseline is what was live when the call started). It runs as a *separate, shortened* pass (fs-merge: 4 steps,
kd: 1 epoch; same data, pool, batch size and models) so that profiling does not distort the timing; the peak of
these methods does not depend on the number of steps (nothing is kept per step except scalar losses). On CUDA,
``torch.cuda.max_memory_allocated`` during the timed call. ``rss`` = the old sampled process-RSS delta (blind
to small allocations; kd showed < 1 MiB). ``tracemalloc`` is not used: it does not see tensor allocations.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from fedfuse.data import FederatedData
from fedfuse.fusion import METHODS, fuse
from fedfuse.models import build_model
from fedfuse.training import evaluate, resolve_device, train

PARTITIONS = {"shards2": (2, "shards"), "shards4": (4, "shards"), "dirichlet4": (4, "dirichlet")}
MODEL_CFG = {"mlp": dict(width=128, depth=2, lr=5e-3, epochs=40),
             "vit": dict(width=32, depth=2, lr=2e-3, epochs=40)}


# ------------------------------------------------------------------------------------------- measurement
class PeakRSS:
    """Context manager: peak RSS delta in bytes (sampled every ``interval`` s) → ``self.peak``."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss() - self.start)
            time.sleep(self.interval)

    def __enter__(self):
        self.start = self._rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss() - self.start)


def timed_fuse(method: str, models, x, device: torch.device, seed: int, options: dict, memory: str = "profile"):
    """``fuse`` with wall time (s) and peak memory (bytes; CUDA allocated, CPU profiled allocations or RSS delta)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fused = fuse(method, models, fusion_inputs=x, device=device, seed=seed, **options)
        torch.cuda.synchronize()
        return fused, time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base
    if memory == "rss":
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            fused = fuse(method, models, fusion_inputs=x, device=device, seed=seed, **options)
            sec = time.perf_counter() - t0
        return fused, sec, mem.peak
    t0 = time.perf_counter()
    fused = fuse(method, models, fusion_inputs=x, device=device, seed=seed, **options)
    sec = time.perf_counter() - t0
    peak = -1
    if memory == "profile":
        short = {**options, **SHORT_PASS.get(method, {})}
        peak = profiled_peak_bytes(lambda: fuse(method, models, fusion_inputs=x, device=device, seed=seed, **short))
    return fused, sec, peak


# options of the shortened memory pass (peak is step-count invariant for these methods)
SHORT_PASS = {"fs-merge": {"steps": 4, "epochs": None}, "fs-merge-seq": {"steps": 4, "stage_steps": 4, "epochs": None},
              "kd": {"epochs": 1}}


def profiled_peak_bytes(fn) -> int:
    """Peak live bytes of PyTorch CPU tensor allocations while ``fn()`` runs (torch.profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    ev = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nb in ev:
        live += nb
        peak = max(peak, live)
    return peak


# ------------------------------------------------------------------------------------------- clients
def get_clients(dataset: str, partition: str, model: str, seed: int, cache: Path, device, alpha: float):
    """Train (or load) the clients of one setting; returns (models, FederatedData)."""
    k, method = PARTITIONS[partition]
    fd = FederatedData.build(dataset, k, method, alpha=alpha, fusion_size=1, fusion_source="client0", seed=seed)
    cfg = MODEL_CFG[model]
    models = []
    for c in range(k):
        path = cache / f"{dataset}-{partition}-a{alpha}-{model}-w{cfg['width']}d{cfg['depth']}-s{seed}-c{c}.pt"
        net = build_model(model, fd.num_classes, fd.input_shape, width=cfg["width"], depth=cfg["depth"],
                          seed=1000 * seed + c)                      # different initialisations per client
        if path.exists():
            net.load_state_dict(torch.load(path))
        else:
            tr, _ = fd.client_data(c, 0.0, seed)
            train(net, tr.x, tr.y, epochs=cfg["epochs"], batch_size=32, lr=cfg["lr"], device=device, seed=seed + c)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(net.state_dict(), path)
        models.append(net.cpu().eval())
    return models, fd


def get_oneshot_clients(dataset: str, partition: str, model: str, seed: int, alpha: float,
                        cache: Path = Path("results/cache")):
    """The shared one-shot runner's clients (its default recipe; trained and cached there if missing)."""
    from simulations.oneshot_lib import (DEPTH_DEFAULTS, TRAIN_DEFAULTS, WIDTH_DEFAULTS, CellConfig, get_clients,
                                         load_data)

    d = TRAIN_DEFAULTS.get((dataset, model), dict(epochs=30, lr=1e-3))
    cfg = CellConfig(dataset=dataset, partition=partition, model=model, seed=seed, width=WIDTH_DEFAULTS[model],
                     depth=DEPTH_DEFAULTS[model], epochs=d["epochs"], lr=d["lr"], alpha=alpha)
    data = load_data(cfg, 1)
    clients = get_clients(cfg, data, ["uniform"], cache, log=lambda s: print(s, flush=True))
    return [c["model"] for c in clients], data


def fusion_inputs(dataset: str, partition: str, seed: int, size: int, source: str, alpha: float) -> torch.Tensor:
    k, method = PARTITIONS[partition]
    return FederatedData.build(dataset, k, method, alpha=alpha, fusion_size=size, fusion_source=source,
                               seed=seed).fusion_x


# ------------------------------------------------------------------------------------------- summary
def _ms(v: list[float]) -> str:
    if not v:
        return "-"
    return f"{statistics.mean(v):.3f} ± {statistics.stdev(v):.3f}" if len(v) > 1 else f"{v[0]:.3f}"


def summarise(rows: list[dict], out: Path) -> str:
    """Markdown: accuracy mean ± std per setting/size/method; time and memory ratios to kd (per seed, then mean)."""
    methods = sorted({r["method"] for r in rows}, key=lambda m: (m not in ("fs-merge", "fs-merge-seq"), m))
    lines = []
    settings = sorted({(r["dataset"], r["partition"], r["model"]) for r in rows})
    sizes = sorted({r["size"] for r in rows})
    lines.append("| dataset | partition | model | fusion size (actual) | best client | ensemble | "
                 + " | ".join(m for m in methods if m != "ensemble") + " |")
    lines.append("|" + "---|" * (6 + len([m for m in methods if m != "ensemble"])))
    for ds, part, mod in settings:
        for s in sizes:
            sel = [r for r in rows if (r["dataset"], r["partition"], r["model"], r["size"]) == (ds, part, mod, s)]
            if not sel:
                continue
            actual = sorted({r["actual_size"] for r in sel})
            best = [r["best_client"] for r in sel if r["method"] == sel[0]["method"]]
            ens = [r["accuracy"] for r in sel if r["method"] == "ensemble"]
            cells = [_ms([r["accuracy"] for r in sel if r["method"] == m]) for m in methods if m != "ensemble"]
            lines.append(f"| {ds} | {part} | {mod} | {s} ({'/'.join(map(str, actual))}) | {_ms(best)} | {_ms(ens)} | "
                         + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Fusion wall time and peak memory as ratios to kd on the same fusion set (mean ± std over "
                 "settings × sizes × seeds; per-row ratio first); absolute medians in brackets.")
    lines.append("")
    lines.append("| method | model | time / kd | peak mem / kd | median time s | median peak MiB |")
    lines.append("|---|---|---|---|---|---|")
    key = lambda r: (r["dataset"], r["partition"], r["model"], r["size"], r["seed"])  # noqa: E731
    kd = {key(r): r for r in rows if r["method"] == "kd"}
    for m in methods:
        for mod in sorted({r["model"] for r in rows}):
            sel = [r for r in rows if r["method"] == m and r["model"] == mod]
            if not sel:
                continue
            tr = [r["seconds"] / kd[key(r)]["seconds"] for r in sel if key(r) in kd and kd[key(r)]["seconds"] > 0]
            # CPU RSS deltas below 1 MiB are allocator noise: no ratio from those (profiled/CUDA bytes are exact)
            mr = [r["peak_bytes"] / kd[key(r)]["peak_bytes"] for r in sel
                  if key(r) in kd and kd[key(r)]["peak_bytes"] >= (2**20 if r.get("memory_measure", "rss") == "rss" else 1)]
            lines.append(f"| {m} | {mod} | {_ms(tr)} | {_ms(mr)} | {statistics.median(r['seconds'] for r in sel):.2f} | "
                         f"{statistics.median(r['peak_bytes'] for r in sel) / 2**20:.1f} |")
    lines += ["", "Accuracy minus kd on the same fusion set and seed (mean ± std over seeds; wins = seeds with "
              "method ≥ kd).", "", "| dataset | partition | model | size | method | Δ vs kd | wins |", "|---|---|---|---|---|---|---|"]
    for ds, part, mod in settings:
        for s in sizes:
            for m in ("fs-merge", "fs-merge-seq"):
                d = [r["accuracy"] - kd[key(r)]["accuracy"] for r in rows if r["method"] == m and key(r) in kd
                     and (r["dataset"], r["partition"], r["model"], r["size"]) == (ds, part, mod, s)]
                if d:
                    lines.append(f"| {ds} | {part} | {mod} | {s} | {m} | {_ms(d)} | {sum(v >= 0 for v in d)}/{len(d)} |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


# ------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="digits,mnist1d")
    ap.add_argument("--partitions", default="shards2,dirichlet4")
    ap.add_argument("--models", default="mlp,vit")
    ap.add_argument("--methods", default="fs-merge,fs-merge-seq,kd,ensemble,average")
    ap.add_argument("--sizes", default="50,200,800")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--fusion-source", default="client0", choices=["client0", "public"])
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--options", default="{}", help='JSON: {"fs-merge": {"steps": 300}, ...}')
    ap.add_argument("--out", default="results/fs_merge/sweep")
    ap.add_argument("--clients", default="oneshot", choices=["oneshot", "own"])
    ap.add_argument("--memory", default="profile", choices=["profile", "rss", "none"])
    ap.add_argument("--wait-kd", type=float, default=0, help="seconds to wait for 'kd' to be registered")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("FEDFUSE_TORCH_THREADS", "1")))
    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = out.parent / "cache"
    methods = args.methods.split(",")
    deadline = time.time() + args.wait_kd
    while "kd" in methods and "kd" not in METHODS and time.time() < deadline:
        time.sleep(30)
        import importlib

        import fedfuse.fusion as ff
        try:
            importlib.import_module("fedfuse.fusion.distillation")
        except Exception:  # noqa: BLE001 - not written yet
            pass
        _ = ff
    missing = [m for m in methods if m not in METHODS]
    if missing:
        raise SystemExit(f"fs_merge_benchmark: methods not registered: {missing}; have {sorted(METHODS)}")
    options = json.loads(args.options)
    rows_path = out / "rows.jsonl"
    done = set()
    rows = []
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            r = json.loads(line)
            rows.append(r)
            done.add((r["dataset"], r["partition"], r["model"], r["seed"], r["size"], r["method"]))
    for ds in args.datasets.split(","):
        for part in args.partitions.split(","):
            for mod in args.models.split(","):
                for seed in map(int, args.seeds.split(",")):
                    if args.clients == "oneshot":
                        models, fd = get_oneshot_clients(ds, part, mod, seed, args.alpha)
                    else:
                        models, fd = get_clients(ds, part, mod, seed, cache, device, args.alpha)
                    xt, yt = fd.test.x, fd.test.y
                    client_acc = [evaluate(m, xt, yt)["accuracy"] for m in models]
                    for size in map(int, args.sizes.split(",")):
                        x = fusion_inputs(ds, part, seed, size, args.fusion_source, args.alpha)
                        for m in methods:
                            if (ds, part, mod, seed, size, m) in done:
                                continue
                            fused, sec, peak = timed_fuse(m, models, x, device, seed, options.get(m, {}), args.memory)
                            acc = evaluate(fused, xt, yt)["accuracy"]
                            row = dict(dataset=ds, partition=part, model=mod, seed=seed, size=size,
                                       actual_size=len(x), method=m, accuracy=acc, seconds=sec, peak_bytes=peak,
                                       best_client=max(client_acc), clients=client_acc, device=str(device),
                                       options=options.get(m, {}), clients_recipe=args.clients,
                                       memory_measure=args.memory if device.type != "cuda" else "cuda")
                            rows.append(row)
                            with rows_path.open("a") as f:
                                f.write(json.dumps(row) + "\n")
                            print(f"{ds} {part} {mod} s{seed} n={len(x)} {m:14s} acc={acc:.3f} "
                                  f"({sec:.1f}s, {peak / 2**20:.0f} MiB) best-client={max(client_acc):.3f}", flush=True)
    print(summarise(rows, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
