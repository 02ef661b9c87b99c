"""False positives of the score-consistency check (``fedfuse.fusion.score_check``) on honest clients.

``kf-linear`` on stock Flower's MNIST-1D splits with the clients' own importance scores (DeepLIFT, the default), in
multi-round (1 local epoch, lr 0.2) and one-shot (40 local epochs, lr 0.02) runs: how many honest replies the check
rejected. Every reply here is honest, so every rejection is a false positive.

    .venv/bin/python -m simulations.bench.score_check --out results/score-check
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from simulations.bench.anchor_cell import ANCHORS, anchor_recipe  # noqa: E402

REGIMES = {"multi-round": {"local-epochs": 1, "lr": 0.2, "num-server-rounds": 4},
           "one-shot": {"mode": "one-shot", "local-epochs": 40, "lr": 0.02, "num-server-rounds": 1}}


def main(argv: list[str] | None = None) -> None:
    from fedfuse.flower.runner.inprocess import run_inprocess

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", default="0.1,0.5")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--anchors", default=str(ANCHORS))
    ap.add_argument("--out", default="results/score-check")
    args = ap.parse_args(argv)
    splits, out = Path(args.anchors) / "splits", Path(args.out)
    lines = ["| α | seed | regime | honest replies checked | rejected |", "|---|---|---|---|---|"]
    for alpha in [float(a) for a in args.alphas.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for regime, extra in REGIMES.items():
                cfg = {**anchor_recipe(splits / f"mnist1d-a{alpha:g}-s{seed}", splits / "mnist1d-public.npz",
                                       "mnist1d", seed, 1), "strategy": "kf-linear", **extra,
                       "output-dir": str(out / "runs"), "run-name": f"kf-linear-a{alpha:g}-s{seed}-{regime}"}
                res = json.loads((run_inprocess(cfg, echo=False) / "results.json").read_text())
                hist = [h for h in res["strategy-history"] if h.get("method") == "kf-linear"]   # not the head round
                checked = sum(int(h.get("valid") or 0) for h in hist)
                rejected = sum(1 for h in hist for r in h.get("rejected", []) if r.get("inconsistent-scores"))
                lines.append(f"| {alpha:g} | {seed} | {regime} | {checked} | {rejected} |")
                print(lines[-1], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text("# Score-consistency check on honest clients (kf-linear, DeepLIFT scores)\n\n"
                                  "Command: `python -m simulations.bench.score_check`.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
