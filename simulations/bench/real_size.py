"""Fusion cost at real model size (issue 24): every fusion method on k clients of a ResNet-18 or a ViT-S, as ratios.

Clients are models as users have them (torchvision's ``resnet18``, fedfuse's ResNet at ResNet-18 size, timm's
``vit_tiny_patch16_224`` / ``vit_small_patch16_224``), each from its own seed and trained ``--steps`` SGD steps on
random data: this measures cost, not accuracy. For each number of clients the run measures, in this order:

- the **forward-pass floor**: one forward pass of every client over the fusion set (what any data-based fusion pays;
  the median of 3 after a warm-up pass);
- **one local epoch** of one client over ``--epoch-samples`` samples (timed on ``--epoch-probe`` samples and scaled);
- ``average`` (the weighted average of the weights);
- every method of ``--methods``, each in its own process (``spawn``) so that its peak resident memory is its own and
  a method running past ``--timeout`` is stopped and reported as such (each process first runs every client on two
  samples, untimed, so that no method pays the kernels' one-time set-up the floor does not pay).

Ratios are of process CPU time (each measurement runs one torch thread: what the wall time would be on an idle core),
so jobs beside the benchmark change them little; wall seconds, the process's peak RSS (``ru_maxrss``) and the peak
RSS growth during the fusion are printed beside them. With ``--device cuda`` times are wall times and the peak is
``torch.cuda.max_memory_allocated``.

    .venv/bin/python -m simulations.bench.real_size --model resnet18 --clients 2,4,10 --fusion-size 500 \\
        --out results/real-size/resnet18
    .venv/bin/python -m simulations.bench.real_size --model vit_small_patch16_224 --clients 2,4 --fusion-size 64 \\
        --out results/real-size/vit-small
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

MODELS = ("resnet18", "resnet34", "resnet50", "fedfuse-resnet18", "vit_tiny_patch16_224", "vit_small_patch16_224")


def build(name: str, seed: int, image_size: int) -> torch.nn.Module:
    """Model ``name`` for 10 classes at ``image_size`` px, initialised from ``seed``."""
    torch.manual_seed(seed)
    if name in ("resnet18", "resnet34", "resnet50"):   # torchvision's, as users have them (34: twice 18's blocks)
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10)
    if name == "fedfuse-resnet18":
        from fedfuse.models import build_model

        return build_model("resnet", num_classes=10, input_shape=(3, image_size, image_size), width=64, depth=4,
                           blocks_per_stage=2, seed=seed)
    if name.startswith("vit_"):
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, img_size=image_size)
    raise SystemExit(f"--model: unknown {name!r}; choose one of {MODELS}")


def clients(name: str, k: int, image_size: int, steps: int) -> list[torch.nn.Module]:
    """``k`` models of ``name``, each from its own seed, trained ``steps`` SGD steps on its own random data."""
    out = []
    for i in range(k):
        m = build(name, 1000 + i, image_size)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator().manual_seed(i)
        for _ in range(steps):
            x = torch.randn(16, 3, image_size, image_size, generator=gen)
            y = torch.randint(0, 10, (16,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m.train()(x), y).backward()
            opt.step()
        out.append(m.eval())
    return out


def floors(models, inputs: torch.Tensor, args, device: torch.device) -> dict[str, float]:
    """CPU seconds (wall on CUDA) of the forward-pass floor and of one local epoch (scaled from ``--epoch-probe``
    samples), and their wall seconds."""
    def forward():
        with torch.no_grad():
            for m in models:
                m.to(device)
                for s in range(0, len(inputs), 64):
                    m(inputs[s:s + 64].to(device))

    def epoch():
        m = models[0].to(device).train()
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator().manual_seed(0)
        for _ in range(0, args.epoch_probe, 32):
            x = torch.randn(32, *inputs.shape[1:], generator=gen).to(device)
            y = torch.randint(0, 10, (32,), generator=gen).to(device)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        m.eval()

    from simulations.bench.timing import interleaved_timings, medians

    # the floor: median of 3 after a warm-up (one cold pass costs up to 20 % more, which moved every ratio between
    # runs); the epoch: one probe (minutes for a ViT)
    t = {**medians(interleaved_timings({"floor": forward}, repeats=3, warmup=1, device=device)),
         **medians(interleaved_timings({"epoch": epoch}, repeats=1, warmup=0, device=device))}
    clock = "wall" if device.type == "cuda" else "cpu"   # CUDA work is not this process's CPU time
    scale = {"floor": 1.0, "epoch": args.epoch_samples / args.epoch_probe}
    return {**{k: t[k][clock] * scale[k] for k in t}, **{f"{k}-wall": t[k]["wall"] * scale[k] for k in t}}


def _measure(method: str, path: str, device: str, options: dict, queue) -> None:
    """Child process: fuse the saved clients with ``method``; put (status, cpu s, wall s, RSS growth, peak RSS)."""
    torch.set_num_threads(1)
    from fedfuse.fusion import FusionError
    from simulations.bench.timing import timed_fuse

    saved = torch.load(path, weights_only=False)
    dev = torch.device(device)
    with torch.no_grad():   # warm the kernels up (untimed), as the floor's forward passes are
        for m in saved["models"]:
            m.to(dev)(saved["inputs"][:2].to(dev))
    c0 = time.process_time()
    try:
        _, wall, peak = timed_fuse(method, saved["models"], saved["inputs"], dev, 0, options,
                                   memory="rss" if dev.type == "cpu" else "none")
        status = "ok"
    except FusionError as exc:
        wall, peak, status = float("nan"), 0, f"refused: {str(exc)[:160]}"
    cpu = time.process_time() - c0 if dev.type == "cpu" else wall
    queue.put((status, cpu, wall, peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def run_method(method: str, path: Path, device: str, timeout: float, options: dict | None = None) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(method, str(path), device, options or {}, queue))
    proc.start()
    try:
        status, cpu, wall, peak, maxrss = queue.get(timeout=timeout)
    except Exception:   # queue.Empty: still running past the timeout (or the child died)
        proc.kill()
        proc.join()
        return {"method": method, "status": f"stopped after {timeout:.0f} s" if proc.exitcode in (-9, None)
                else f"crashed (exit {proc.exitcode})"}
    proc.join()
    return {"method": method, "status": status, "cpu": cpu, "wall": wall, "peak": peak, "maxrss": maxrss}


def median_run(runs: list[dict]) -> dict:
    """The run of median CPU time among a method's repeats (all ``ok``; else the last one), with every repeat's CPU
    seconds (``cpu-repeats``)."""
    ok = [r for r in runs if r["status"] == "ok"]
    if len(ok) != len(runs) or not ok:
        return runs[-1]
    ranked = sorted(ok, key=lambda r: r["cpu"])
    return {**ranked[(len(ranked) - 1) // 2], "cpu-repeats": [r["cpu"] for r in ok]}


def table_row(r: dict, rows: list[dict]) -> list:
    """One method's row: CPU time × the forward floor, × ``average`` at the same client count, × one local epoch."""
    ok = r["status"] == "ok"
    avg = next((a.get("cpu") for a in rows if a["method"] == "average" and a["clients"] == r["clients"]), None)
    ratios = [r["cpu"] / d if ok and d else None for d in (r["floor"], avg, r["epoch"])]
    return [r["clients"], f"`{r['method']}`", r["status"] if not ok else "ok",
            *("—" if v is None else f"{v:.1f}" for v in ratios), f"{r['wall']:.1f}" if ok else "—",
            f"{r['peak'] / 2**20:.0f}" if ok else "—", f"{r['maxrss'] / 2**20:.0f}" if ok else "—"]


def growth(rows: list[dict]) -> list[list]:
    """Per method run at two or more client counts: the log-log exponents of its CPU seconds and of its peak RSS
    growth in the number of clients (``scaling.fit_growth``), next to the forward floor's."""
    from simulations.bench.scaling import fit_growth

    out = []
    floor = {r["clients"]: r["floor"] for r in rows}
    if len(floor) > 1:
        out.append(["forward floor", len(floor), f"{fit_growth(list(floor), list(floor.values()))['exponent']:.2f}", "–"])
    for method in dict.fromkeys(r["method"] for r in rows):
        ok = [r for r in rows if r["method"] == method and r["status"] == "ok"]
        if len(ok) > 1:
            ks = [r["clients"] for r in ok]
            out.append([f"`{method}`", len(ok), f"{fit_growth(ks, [r['cpu'] for r in ok])['exponent']:.2f}",
                        f"{fit_growth(ks, [max(r['peak'], 1) for r in ok])['exponent']:.2f}"])
    return out


def plot_cost(rows: list[dict], path: Path, title: str) -> None:
    """CPU seconds against clients, log-log, one line per method, the forward floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    floor = sorted({(r["clients"], r["floor"]) for r in rows})
    ax.plot(*zip(*floor), "k--", label="forward floor")
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["clients"], r["cpu"]) for r in rows if r["method"] == method and r["status"] == "ok")
        if pts:
            ax.plot(*zip(*pts), "o-", label=method)
    ax.set(xscale="log", yscale="log", xlabel="clients", ylabel="CPU seconds (one thread)" if rows[0].get("device-name", "cpu") == "cpu"
           else f"wall seconds ({rows[0]['device-name']})", title=title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from fedfuse.fusion import METHODS
    from simulations.bench.tables import markdown_table, write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", choices=MODELS)
    ap.add_argument("--clients", default="2,4,10")
    ap.add_argument("--image-size", type=int, default=0, help="px (default: 32 for ResNets, 224 for ViTs)")
    ap.add_argument("--fusion-size", type=int, default=500)
    ap.add_argument("--methods", default=",".join(m for m in METHODS if m != "average"))
    ap.add_argument("--steps", type=int, default=5, help="SGD steps each client takes on random data")
    ap.add_argument("--epoch-samples", type=int, default=5000)
    ap.add_argument("--epoch-probe", type=int, default=256, help="samples actually timed for the local epoch")
    ap.add_argument("--repeats", type=int, default=1, help="runs per method (interleaved); the table shows the run "
                    "of median CPU time (one run of a method varied 2.6-4.7x the floor on ResNet-18)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a method may run before it is stopped")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--options", default="{}", help="JSON options for every method, e.g. '{\"epochs\": 5}' "
                    "(cost per epoch of the fitting methods; the default = each method's defaults)")
    ap.add_argument("--out", default="results/real-size/resnet18")
    ap.add_argument("--render", action="store_true", help="rewrite table.md and cost.png from <out>/runs.json")
    args = ap.parse_args(argv)
    try:   # before any client is built or timed
        options = json.loads(args.options)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--options: not JSON ({exc}): {args.options!r}") from None
    torch.set_num_threads(1)
    size = args.image_size or (224 if args.model.startswith("vit_") else 32)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:   # the table, growth and plot again from a finished run's runs.json
        rows = json.loads((out / "runs.json").read_text())
    else:
        rows = []
        for k in [int(c) for c in args.clients.split(",")]:
            models = clients(args.model, k, size, args.steps)
            inputs = torch.randn(args.fusion_size, 3, size, size, generator=torch.Generator().manual_seed(7))
            path = out / f"clients-{k}.pt"
            torch.save({"models": models, "inputs": inputs}, path)
            ref = floors(models, inputs, args, device)
            methods = ["average", *args.methods.split(",")]
            runs = {m: [] for m in methods}
            for _ in range(args.repeats):   # interleaved: repeat 1 of every method, then repeat 2, ...
                for m in methods:
                    if not runs[m] or runs[m][-1]["status"] == "ok":   # a refusal or a timeout is not repeated
                        runs[m].append(run_method(m, path, args.device, args.timeout,
                                                  None if m == "average" else options))
                        print(f"  {k} clients, {m}: {runs[m][-1]['status']} {runs[m][-1].get('wall', 0):.2f} s wall",
                              flush=True)
            results = [median_run(runs[m]) for m in methods]
            path.unlink()
            for r in results:
                r.update({"clients": k, **ref, "device-name": torch.cuda.get_device_name(device) if device.type == "cuda"
                          else "cpu"})
                rows.append(r)
                print(" | ".join(map(str, table_row(r, rows))), flush=True)
            write_json(rows, out / "runs.json")   # after each client count: a run stopped later keeps these
    table = [table_row(r, rows) for r in rows]
    cuda = device.type == "cuda"
    header = ["clients", "method", "status", "× forward floor", "× average", "× local epoch", "wall s",
              "peak CUDA MiB (above the clients)" if cuda else "RSS growth MiB", "peak RSS MiB"]
    n_params = sum(p.numel() for p in build(args.model, 0, size).parameters())
    text = (f"# Fusion cost: {args.model} ({n_params / 1e6:.1f} M parameters, 3×{size}×{size}), "
            f"{args.fusion_size} fusion samples, {args.device}\n\nCommand: `python -m simulations.bench.real_size "
            f"--model {args.model} --clients {args.clients} --fusion-size {args.fusion_size} --image-size {size}"
            f"{'' if args.options == '{}' else f' --options {args.options!r}'} --methods {args.methods}"
            f"{'' if args.repeats == 1 else f' --repeats {args.repeats}'}{' --device ' + args.device if cuda else ''}`. "
            + (f"Ratios of wall time on {rows[0].get('device-name', 'CUDA')}" if cuda
               else "Ratios of process CPU time (one torch thread)")
            + f"; the local epoch is {args.epoch_samples} samples, timed on "
            f"{args.epoch_probe} and scaled.\n\n" + markdown_table(header, table))
    laws = growth(rows)
    if laws:
        text += ("\n\nGrowth with the number of clients (log-log exponents: 1 = linear):\n\n"
                 + markdown_table(["method", "client counts", f"{'wall' if cuda else 'CPU'} time exponent",
                                 f"peak {'CUDA memory' if cuda else 'RSS growth'} exponent"], laws))
        plot_cost(rows, out / "cost.png", f"{args.model}, {args.fusion_size} fusion samples")
    (out / "table.md").write_text(text)
    write_json(rows, out / "runs.json")
    print(text)


if __name__ == "__main__":
    main()
