"""Score inflation, before and after per-level score normalisation (issue 25): what one client gains by multiplying
its importance scores, in one-shot fusion on stock Flower's MNIST-1D splits.

Each seed: the 10 clients of ``../shared/anchors/splits/mnist1d-a<α>-s<seed>`` train an MLP 256×2 from their own
initialisations (the one-shot setting: Adam 1e-3, 20 epochs, batch 32) and score their neurons with DeepLIFT on 256
of their samples (fedfuse's client default). The server fuses them with each score-reading method (300 fusion
samples from the public pool), with honest scores and with the largest client's scores × 1000 (or concentrated on one
unit per level), once with ``fuse``'s normalisation (``normalise_scores``, the product) and once without it (the
scores as sent: the code before issue 25). Columns: test accuracy, and the liar's effect in points.

    .venv/bin/python -m simulations.bench.score_inflation --out results/score-inflation
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import json
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import fedfuse.fusion as fusion
from fedfuse.flower.runner.stats import format_mean_std
from fedfuse.importance import neuron_importance
from fedfuse.models import build_model
from fedfuse.training import evaluate, train
from simulations.bench.anchor_cell import ANCHORS

METHODS = "kf-linear,kf-gradient,rebasin,ot[marginals=importance]"


def _method(label: str) -> tuple[str, dict]:
    if "[" not in label:
        return label, {}
    name, rest = label[:-1].split("[", 1)
    key, value = rest.split("=")
    return name, {key: value}


def clients(split: Path, seed: int, epochs: int) -> tuple[list[torch.nn.Module], list[dict], list[int]]:
    models, scores, counts = [], [], []
    for pid in range(10):
        d = np.load(split / f"node-{pid}.npz")
        x, y = torch.as_tensor(d["x_train"]), torch.as_tensor(d["y_train"]).long()
        m = build_model("mlp", num_classes=10, input_shape=(40,), width=256, depth=2, seed=seed * 1000 + pid + 1)
        train(m, x, y, epochs=epochs, batch_size=32, optimizer="adam", lr=1e-3, seed=seed * 131 + pid)
        scores.append(neuron_importance(m, x[:256], y[:256], method="deeplift"))
        models.append(m.eval())
        counts.append(len(x))
    return models, scores, counts


def lie(scores: dict, how: str) -> dict:
    if how == "inflate":
        return {k: v * 1000.0 for k, v in scores.items()}
    out = {}
    for k, v in scores.items():
        t = torch.zeros_like(v)
        t[int(v.argmax())] = float(v.sum()) * 1000.0
        out[k] = t
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--out", default="results/score-inflation")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        split = ANCHORS / "splits" / f"mnist1d-a{args.alpha:g}-s{seed}"
        test = np.load(split / "test.npz")
        tx, ty = torch.as_tensor(test["x"]), torch.as_tensor(test["y"]).long()
        pool = np.load(ANCHORS / "splits" / "mnist1d-public.npz")["x"]
        fx = torch.as_tensor(pool[np.random.default_rng(seed).permutation(len(pool))[:300]])
        models, scores, counts = clients(split, seed, args.epochs)
        liar = int(np.argmax(counts))
        for label in args.methods.split(","):
            name, opts = _method(label)
            for normalised in (True, False):
                patch = mock.patch.object(fusion, "normalise_scores", side_effect=lambda s: s) if not normalised \
                    else mock.patch.object(fusion, "normalise_scores", wraps=fusion.normalise_scores)
                accs = {}
                with patch:
                    for how in ("honest", "inflate", "concentrate"):
                        sc = list(scores) if how == "honest" else [lie(s, how) if i == liar else s
                                                                    for i, s in enumerate(scores)]
                        fused = fusion.fuse(name, models, fusion_inputs=fx, scores=sc, weights=counts, seed=seed,
                                            **opts)
                        accs[how] = float(evaluate(fused, tx, ty, num_classes=10)["accuracy"])
                row = {"method": label, "seed": seed, "normalised": normalised, **accs}
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    lines = ["# Score inflation by the largest client, one-shot, stock Flower's MNIST-1D splits "
             f"(α = {args.alpha:g}, 10 clients)", "",
             "Command: `python -m simulations.bench.score_inflation`. Test accuracy, mean ± sample std over seeds "
             f"{args.seeds}; effect = liar's − honest, in points (per seed, then mean ± std).", "",
             "| method | scores | honest | × 1000: accuracy | × 1000: effect | concentrated: accuracy | "
             "concentrated: effect |", "|---|---|---|---|---|---|---|"]
    for label in args.methods.split(","):
        for normalised in (False, True):
            got = [r for r in rows if r["method"] == label and r["normalised"] == normalised]
            fx3 = lambda key: format_mean_std([r[key] for r in got], digits=3)  # noqa: E731
            eff = lambda key: format_mean_std([100 * (r[key] - r["honest"]) for r in got], digits=1)  # noqa: E731
            lines.append(f"| `{label}` | {'normalised (now)' if normalised else 'as sent (before)'} | {fx3('honest')} | "
                         f"{fx3('inflate')} | {eff('inflate')} | {fx3('concentrate')} | {eff('concentrate')} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
