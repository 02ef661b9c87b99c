"""Wall time of ``kf-linear`` fusing 4 MLP clients (width 128, 300 fusion samples) on this machine.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m simulations.time_kf_linear [--dataset mnist1d] [--repeats 5]

Loads (or trains) the Dirichlet-4 clients of the one-shot benchmark cache, then in the same process
times ``average``, ``kf-linear`` with uniform and with client DeepLIFT scores (median of ``--repeats``
runs) and one client's local training (client 0's recipe, retrained from scratch once), and prints
the ratios plus the fused test accuracy (to check a speed-up keeps accuracy).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import time
from pathlib import Path

import torch

from fedfuse.fusion import fuse
from fedfuse.models import build_model
from fedfuse.training import evaluate
from simulations.oneshot_lib import TRAIN_DEFAULTS, CellConfig, get_clients, load_data, train_client


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="mnist1d")
    ap.add_argument("--partition", default="dirichlet4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--options", default="", help="extra kf-linear options as k=v,... (TOML values)")
    ap.add_argument("--cache", default="results/cache")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = TRAIN_DEFAULTS[(args.dataset, "mlp")]
    cfg = CellConfig(dataset=args.dataset, partition=args.partition, model="mlp", seed=args.seed, width=128, depth=2,
                     epochs=d["epochs"], lr=d["lr"])
    data = load_data(cfg, 300)
    clients = get_clients(cfg, data, ["deeplift", "uniform"], Path(args.cache))
    models = [c["model"] for c in clients]
    extra = {}
    if args.options:
        import tomllib
        for item in args.options.split(","):
            k, _, v = item.partition("=")
            extra[k.strip()] = tomllib.loads(f"v = {v.strip()}")["v"]

    def timed(method, **kw):
        times, cpu, fused = [], [], None
        for r in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            fused = fuse(method, models, fusion_inputs=data.fusion_x, seed=args.seed, **kw)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        acc = evaluate(fused, data.test.x, data.test.y)["accuracy"]
        return statistics.median(times), statistics.median(cpu), acc

    t_avg, c_avg, a_avg = timed("average")
    t_u, c_u, a_u = timed("kf-linear", **extra)
    t_d, c_d, a_d = timed("kf-linear", scores=[c["scores"]["deeplift"] for c in clients], **extra)
    tr, va = data.client_data(0, cfg.val_fraction, cfg.seed)
    m = build_model("mlp", num_classes=data.num_classes, input_shape=data.input_shape, width=128, depth=2, seed=123)
    c0 = time.process_time()
    info = train_client(m, tr, va, cfg, seed=123)
    t_train = info["train-seconds"]
    c_train = time.process_time() - c0
    print(f"{args.dataset}/{args.partition} seed {args.seed}: 4 MLP clients (128 wide), {len(data.fusion_x)} fusion "
          f"samples, {torch.get_num_threads()} torch thread(s), os.cpu_count()={os.cpu_count()}, "
          f"load avg {os.getloadavg()[0]:.1f}")
    print("  (median over repeats; wall = elapsed, cpu = this process's CPU time, which is what the wall time "
          "would be on an idle core with 1 thread)")
    print(f"  average                 wall {t_avg * 1e3:8.1f} ms  cpu {c_avg * 1e3:8.1f} ms   acc {a_avg:.3f}")
    for lab, t, c, a in (("kf-linear (uniform)", t_u, c_u, a_u), ("kf-linear (deeplift)", t_d, c_d, a_d)):
        print(f"  {lab:<22}  wall {t * 1e3:8.1f} ms  cpu {c * 1e3:8.1f} ms   acc {a:.3f}   = {c / c_avg:.0f}x average, "
              f"{c / c_train:.3f}x one client's local training (cpu time ratios)")
    print(f"  one client's local training: wall {t_train:.2f} s, cpu {c_train:.2f} s ({info['epochs']} epochs, "
          f"{len(tr)} samples)")


if __name__ == "__main__":
    main()
