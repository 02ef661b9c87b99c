"""The cost of ``auto``'s aggregation in rounds where it averages, as a ratio to FedAvg's, in one process.

The anchors' MLP (40-256-256-10), ``--clients`` validated replies, ``local_epochs`` below ``auto-fusion-epochs`` (no
fusion candidate, so ``auto`` averages without a query); each strategy aggregates the same replies ``--rounds`` times,
the two alternating round by round; the median round time of each and their ratio are printed (issue goal: ≤ 1.2).
The ratio is of process CPU time (one torch thread: what the wall time would be on an idle core), so jobs beside it
on a shared machine change it little; the wall-time ratio is printed beside it.

    .venv/bin/python -m simulations.bench.auto_cost --out results/auto-cost
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    from flwr.app import ArrayRecord

    from fedfuse.flower import build_strategy
    from fedfuse.flower.round.replies import ClientUpdate
    from fedfuse.models import build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", help="write table.md here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.ERROR)

    def model_fn():
        return build_model("mlp", 10, (40,), width=256, depth=2, seed=0)

    updates = [ClientUpdate(i, i, build_model("mlp", 10, (40,), width=256, depth=2, seed=i + 1).state_dict(), None,
                            100 + 7 * i, {}) for i in range(args.clients)]
    strategies = {"fedavg": build_strategy("fedavg", model_fn=model_fn),
                  "auto": build_strategy("auto", model_fn=model_fn, fusion_inputs=torch.randn(300, 40),
                                         local_epochs=1)}
    cpu: dict[str, list[float]] = {k: [] for k in strategies}
    wall: dict[str, list[float]] = {k: [] for k in strategies}
    for s in strategies.values():
        s._global = ArrayRecord(model_fn().state_dict())
        s.aggregate(0, updates)   # warm-up
    for r in range(args.rounds):   # alternating round by round: both see the same machine state
        for name, s in strategies.items():
            t0, c0 = time.perf_counter(), time.process_time()
            s.aggregate(r + 1, updates)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    medw = {k: statistics.median(v) for k, v in wall.items()}
    text = ("| strategy | median aggregation per round (CPU) | ratio to fedavg (CPU) | ratio to fedavg (wall) |\n"
            "|---|---|---|---|\n"
            + "".join(f"| `{k}` | {1000 * v:.2f} ms | {v / med['fedavg']:.2f} | {medw[k] / medw['fedavg']:.2f} |\n"
                      for k, v in med.items())
            + f"\n{args.clients} clients, MLP 40-256-256-10, {args.rounds} rounds each (alternating), 1 torch thread, "
              f"`auto` below auto-fusion-epochs (no fusion candidate, no query). Command: `python -m "
              f"simulations.bench.auto_cost --rounds {args.rounds} --out results/auto-cost`.\n")
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "table.md").write_text(text)


if __name__ == "__main__":
    main()
