"""Why ``kf-linear`` stays below the best client on MNIST-1D Dirichlet-4 (issue 27 item 4): controlled variants.

    python -m simulations.bench.dirichlet4_diagnosis --seeds 0,1,2 --out results/one_shot/issue27-diag

The issue's setting: 4 MLP clients on a Dirichlet (α = 0.5) split of MNIST-1D, trained once (the one-shot
benchmark's cached clients and recipe, ``simulations.bench.clients``), a 400-sample fusion set drawn from client 0's
data, ``fuse(method, models, fusion_inputs=X, scores=client_scores, weights=sizes)`` with default options (client
scores: DeepLIFT on each client's validation split). Each variant changes one thing; all are evaluated on the whole
test split. Label oracles are marked as such: a *balanced* fusion set (40 samples per class drawn from the clients'
pooled training data: "what if the fusion set were not skewed"), and a "probe" (the model's classifier level
retrained on those labelled samples: how good its features are, whatever its head). Rows: test accuracy (mean ±
sample std over seeds), the accuracy on the classes client 0's fusion set holds well and on the others. Written:
``results.json`` (per seed) and ``table.md``.
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from fedfuse.fusion import fuse
from fedfuse.models.levels import levels
from fedfuse.training import metrics_from_logits, predict_logits
from simulations.bench.clients import cell_config, get_clients, load_data
from simulations.bench.specs import parse_ints

FUSION_SIZE = 400


def _balanced_pool(x: torch.Tensor, y: torch.Tensor, num_classes: int, per_class: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` samples of every class drawn (seeded) from the clients' pooled training data ``(x, y)``: the
    fusion set a server would hold with a class-balanced sample of the federation's data (an oracle)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    perm = torch.randperm(len(y), generator=g)
    take = torch.cat([perm[y[perm] == c][:per_class] for c in range(num_classes)])
    return x[take], y[take]


def probe(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> torch.nn.Module:
    """A copy of ``model`` whose classifier level alone is retrained (cross-entropy, Adam, 100 epochs) on the
    labelled ``(x, y)``: how good its features are, whatever its head (an oracle: it uses labels)."""
    import copy

    from fedfuse.training import train

    m = copy.deepcopy(model)
    head = set(id(p) for p in levels(m)[-1].layer.parameters())
    for p in m.parameters():
        p.requires_grad_(id(p) in head)
    train(m, x, y, epochs=100, lr=1e-2, seed=seed)
    return m.eval()


def variants(clients: list[dict], skewed: torch.Tensor, balanced: torch.Tensor, by: torch.Tensor, best: int,
             seed: int) -> dict[str, Callable]:
    """The variants' model builders (kf-linear changed in one thing each; label oracles marked as such)."""
    models = [c["model"] for c in clients]
    sizes = [c["train_size"] for c in clients]
    scores = [c["scores"]["deeplift"] for c in clients]
    counts = [c["class_counts"] for c in clients]
    head = levels(models[0])[-1].name   # the classifier level's name in the score dicts

    def kf(x: torch.Tensor, sc=scores, **opts: Any) -> Callable:
        return lambda: fuse("kf-linear", models, fusion_inputs=x, scores=sc, weights=sizes, seed=0, **opts)

    def head_to_ensemble() -> torch.nn.Module:   # the fused features, the head refit to the ensemble (lp)
        return fuse("lp", [kf(skewed)(), *models], fusion_inputs=skewed, weights=[0.0, *sizes], seed=0)

    return {
        "kf-linear (issue: client-0 fusion set, client scores)": kf(skewed),
        "kf-linear, uniform scores": kf(skewed, sc=None),
        "kf-linear, head_target='probs'": kf(skewed, head_target="probs"),
        "kf-linear, head_weights (class counts)": kf(skewed, head_weights=True, class_counts=counts),
        "kf-linear, ridge 1e-2": kf(skewed, ridge=1e-2),
        "kf-linear, head refit to the ensemble (lp)": head_to_ensemble,
        "kf-linear, refine='distill'": kf(skewed, refine="distill"),
        "kf-linear, client scores at hidden levels only": kf(skewed, sc=[{k: v for k, v in d.items() if k != head}
                                                                        for d in scores]),
        "kf-linear, client scores at the classifier only": kf(skewed, sc=[{k: v for k, v in d.items() if k == head}
                                                                         for d in scores]),
        "kf-linear, classifier scores rescaled to mean 1 per client": kf(skewed, sc=[{**d, head: d[head] / d[head].mean()}
                                                                                 for d in scores]),
        "kf-linear, head_scores=false (the option)": kf(skewed, head_scores=False),
        "kf-linear, head_scores=false, refine='distill'": kf(skewed, head_scores=False, refine="distill"),
        "kf-linear, normalize_scores": kf(skewed, normalize_scores=True),
        "kf-linear, uniform scores, head_target='probs'": kf(skewed, sc=None, head_target="probs"),
        "kf-linear, uniform scores, refine='distill'": kf(skewed, sc=None, refine="distill"),
        "kf-linear, fused_width 256 (2x wider model)": kf(skewed, fused_width=256),
        "kf-linear, fused_width 512 (every parent neuron)": kf(skewed, fused_width=512),
        "kf-linear, fused_width 512, head refit to the ensemble (lp)": lambda: fuse(
            "lp", [kf(skewed, fused_width=512)(), *models], fusion_inputs=skewed, weights=[0.0, *sizes], seed=0),
        "probe (oracle, labels): kf-linear fused_width 512's features": lambda: probe(
            kf(skewed, fused_width=512)(), balanced, by, seed),
        "kf-linear, balanced fusion set (oracle)": kf(balanced),
        "probe (oracle, labels): kf-linear's features": lambda: probe(kf(skewed)(), balanced, by, seed),
        "probe (oracle, labels): best client's features": lambda: probe(models[best], balanced, by, seed),
    }


def _accuracies(logits_or_probs: torch.Tensor, y: torch.Tensor, major: torch.Tensor, probs: bool = False
                ) -> dict[str, float]:
    m = metrics_from_logits(logits_or_probs, y, probabilities=probs)
    pred = logits_or_probs.argmax(-1)
    in_major = torch.isin(y, major)

    def acc(mask: torch.Tensor) -> float | None:   # None: no test sample in that group
        return float((pred[mask] == y[mask]).float().mean()) if bool(mask.any()) else None

    return {"accuracy": m["accuracy"], "major": acc(in_major), "minor": acc(~in_major)}


def run_seed(seed: int, cache: Path, extra: Callable[[list[dict], torch.Tensor, torch.Tensor], dict] | None = None
             ) -> dict[str, Any]:
    """One seed's rows: references (clients, ensemble) and every variant, on the evaluation half of the test split."""
    cfg = cell_config("mnist1d", "dirichlet4", "mlp", seed, fusion_source="client0")
    data = load_data(cfg, FUSION_SIZE, "client0")
    clients = get_clients(cfg, data, ["deeplift"], cache)
    nc = data.num_classes
    pool = torch.cat([torch.as_tensor(p) for p in data.partitions])
    balanced, by = _balanced_pool(data.train.x[pool], data.train.y[pool], nc, FUSION_SIZE // nc, seed)
    tx, ty = data.test.x, data.test.y
    fy = torch.bincount(data.fusion_y, minlength=nc)
    major = torch.nonzero(fy >= 0.5 * fy.float().mean()).flatten()   # client 0's well-represented classes
    sizes = torch.tensor([c["train_size"] for c in clients], dtype=torch.float)
    logits = [predict_logits(c["model"], tx) for c in clients]
    rows = {f"client {i}": _accuracies(lg, ty, major) for i, lg in enumerate(logits)}
    best = max(range(len(clients)), key=lambda i: rows[f"client {i}"]["accuracy"])
    rows["best client"] = dict(rows[f"client {best}"])
    w = sizes / sizes.sum()
    rows["ensemble (weighted)"] = _accuracies(sum(wi * lg.softmax(-1) for wi, lg in zip(w, logits)), ty, major,
                                              probs=True)
    # the target kf-linear's classifier regresses: the weighted mean of the clients' raw logits
    rows["ensemble of logits (kf-linear's head target)"] = _accuracies(sum(wi * lg for wi, lg in zip(w, logits)), ty,
                                                                       major)
    todo = variants(clients, data.fusion_x, balanced, by, best, seed)
    if extra is not None:
        todo.update(extra(clients, data.fusion_x, balanced))
    for name, make in todo.items():
        rows[name] = _accuracies(predict_logits(make(), tx), ty, major)
    return {"seed": seed, "fusion-class-counts": fy.tolist(), "major-classes": sorted(major.tolist()),
            "best-client": best, "rows": rows}


def table(per_seed: list[dict[str, Any]]) -> str:
    """Markdown: every row's accuracy, on client 0's majority classes and on the others (mean ± std over seeds)."""
    def ms(vals: list[float | None]) -> str:
        vals = [v for v in vals if v is not None]
        if not vals:
            return "-"
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return f"{100 * statistics.mean(vals):.1f} ± {100 * sd:.1f}"

    names = [k for k in per_seed[0]["rows"] if not k.startswith("client ")]
    lines = ["| row | test accuracy % | on client 0's majority classes | on the other classes |", "|---|---|---|---|"]
    for n in names:
        vals = [s["rows"][n] for s in per_seed]
        lines.append(f"| {n} | {ms([v['accuracy'] for v in vals])} | {ms([v['major'] for v in vals])} | "
                     f"{ms([v['minor'] for v in vals])} |")
    skew = "; ".join(f"seed {s['seed']}: classes {s['major-classes']} (≥ half the mean count) hold "
                     f"{100 * sum(s['fusion-class-counts'][c] for c in s['major-classes']) / FUSION_SIZE:.0f}%"
                     for s in per_seed)
    return "\n".join(lines) + f"\n\nFusion set from client 0 ({FUSION_SIZE} samples): {skew}.\n"


def main(argv: list[str] | None = None, extra=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench.dirichlet4_diagnosis", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--cache", default="results/cache")
    ap.add_argument("--out", default="results/one_shot/issue27-diag")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    per_seed = []
    for seed in parse_ints(args.seeds):
        per_seed.append(run_seed(seed, Path(args.cache), extra))
        print(f"seed {seed} done", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"argv": sys.argv, "per-seed": per_seed}, indent=1))
    text = table(per_seed)
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
