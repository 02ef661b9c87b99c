"""Which importance criterion should ``fedfuse.pruning``'s ``criterion="auto"`` pick? A small measurement.

Models trained on scikit-learn digits (8×8, 10 classes); 250 training images held out as the server's
*unlabeled* fusion set (also the clients' labelled validation data for the ``scores`` criterion: DeepLIFT
``neuron_importance`` as a client computes it); test accuracy on the digits test split. Each trained model is
pruned to ``params_ratio`` 0.5 and 0.3 with every criterion, then recovered (``recover=True``: the unpruned
model distilled on the fusion set). Reported: test accuracy (%) mean over the seeds, and the KL from the
unpruned model to the pruned one on the test inputs (lower = closer), before and after recovery.

    .venv/bin/python -m simulations.bench.prune_criteria --seeds 0,1 --out results/pruning/criteria.md
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from fedfuse.data import load_source
from fedfuse.importance import neuron_importance
from fedfuse.models import build_model
from fedfuse.pruning import prune_result
from fedfuse.training import train

MODELS = {"mlp": dict(width=128, depth=2), "cnn": dict(width=16, depth=2), "resnet": dict(width=16, depth=2),
          "vit": dict(width=64, depth=4, num_heads=4)}
EPOCHS = {"mlp": 30, "cnn": 30, "resnet": 15, "vit": 40}
CRITERIA = ("magnitude", "taylor", "scores")  # variants "<criterion>+blocks" / "<criterion>+<n>" also drop blocks


@torch.no_grad()
def accuracy(model, x, y) -> float:
    return float((model(x).argmax(-1) == y).float().mean())


@torch.no_grad()
def kl(teacher, student, x) -> float:
    return float(F.kl_div(F.log_softmax(student(x), -1), F.softmax(teacher(x), -1), reduction="batchmean"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--models", default="mlp,cnn,resnet,vit")
    ap.add_argument("--ratios", default="0.5,0.3")
    ap.add_argument("--variants", default=",".join(CRITERIA),
                    help="criteria; '<criterion>+blocks' adds prune_blocks=True, '<criterion>+<n>' prune_blocks=n")
    ap.add_argument("--teachers", action="store_true",
                    help="a second model (seed + 100) joins the model as the ensemble: Taylor's KL and recovery use both")
    ap.add_argument("--out", default="results/pruning/criteria.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in a.seeds.split(",")]
    ratios = [float(r) for r in a.ratios.split(",")]
    variants = a.variants.split(",")
    train_set, test_set = load_source("digits", seed=0)
    xf, yf = train_set.x[:250], train_set.y[:250]
    xt, yt = train_set.x[250:], train_set.y[250:]
    rows: dict[tuple, list[tuple[float, float, float, float]]] = {}
    base: dict[str, list[float]] = {}
    for name in a.models.split(","):
        for seed in seeds:
            m = build_model(name, num_classes=10, input_shape=(1, 8, 8), seed=seed, **MODELS[name])
            train(m, xt, yt, epochs=EPOCHS[name], lr=1e-3, seed=seed)
            m.eval()
            base.setdefault(name, []).append(accuracy(m, test_set.x, test_set.y))
            teachers = None
            if a.teachers:
                m2 = build_model(name, num_classes=10, input_shape=(1, 8, 8), seed=seed + 100, **MODELS[name])
                train(m2, xt, yt, epochs=EPOCHS[name], lr=1e-3, seed=seed + 100)
                teachers = [m, m2.eval()]
            scores = neuron_importance(m, xf, yf, method="deeplift")
            for r in ratios:
                for crit in variants:
                    c, _, extra = crit.partition("+")
                    blocks = True if extra == "blocks" else int(extra) if extra else False
                    kw = dict(params_ratio=r, fusion_inputs=xf, criterion=c, prune_blocks=blocks,
                              scores=scores if c == "scores" else None, teachers=teachers)
                    res = prune_result(m, **kw)
                    rec = prune_result(m, **kw, recover=True, seed=seed)
                    rows.setdefault((name, r, crit), []).append(
                        (accuracy(res.model, test_set.x, test_set.y), kl(m, res.model, test_set.x),
                         accuracy(rec.model, test_set.x, test_set.y), kl(m, rec.model, test_set.x),
                         len(res.info["blocks_removed"])))
                    print(name, seed, r, crit, rows[(name, r, crit)][-1], flush=True)
    mean = statistics.fmean
    lines = ["# Pruning criteria (digits, params_ratio, test accuracy %)", "",
             f"`python -m simulations.bench.prune_criteria --seeds {a.seeds} --models {a.models} --ratios {a.ratios} "
             f"--variants {a.variants}{' --teachers' if a.teachers else ''}`; "
             "models trained on digits, 250 held-out training images as the unlabeled fusion set (and the labelled "
             "scoring data for `scores` = DeepLIFT `neuron_importance`), mean over seeds "
             f"{a.seeds}. KL = KL(unpruned ‖ pruned) on the test inputs. 'recovered' = `recover=True` (the unpruned "
             "model distilled on the fusion set, held-out early stopping); '+blocks' = `prune_blocks=True`, '+n' = "
             "`prune_blocks=n` (the n most redundant blocks dropped, then widths pruned to the ratio; blocks "
             "dropped: mean over seeds)."
             + (" `--teachers`: a second model of the family (seed + 100) and the model form the ensemble "
                "(`teachers=`): Taylor's loss is the KL to it and recovery distils it; KL columns still to the "
                "unpruned model." if a.teachers else ""), "",
             "| model | unpruned acc | params ratio | criterion | acc pruned | KL pruned | acc recovered | KL recovered "
             "| blocks dropped |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (name, r, crit), v in rows.items():
        lines.append(f"| {name} | {100 * mean(base[name]):.1f} | {r} | {crit} | {100 * mean(x[0] for x in v):.1f} | "
                     f"{mean(x[1] for x in v):.3f} | {100 * mean(x[2] for x in v):.1f} | {mean(x[3] for x in v):.3f} | "
                     f"{mean(x[4] for x in v):.1f} |")
    summary = {c: mean(mean(x[0] for x in v) for (n, r, cc), v in rows.items() if cc == c) for c in variants}
    summary_rec = {c: mean(mean(x[2] for x in v) for (n, r, cc), v in rows.items() if cc == c) for c in variants}
    lines += ["", "Mean over all cells (accuracy %): "
              + ", ".join(f"{c} {100 * summary[c]:.1f} pruned / {100 * summary_rec[c]:.1f} recovered" for c in variants)]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
