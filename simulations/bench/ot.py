"""OT-family benchmarks the one-shot benchmark does not cover (issue #4).

    python -m simulations.bench.ot hetero    --datasets mnist1d --partitions shards2,dirichlet4 --models mlp \\
        --seeds 0,1,2 --out results/ot --tag mnist1d
    python -m simulations.bench.ot transport --datasets mnist1d --seeds 1,2 --out results/ot --tag mnist1d_s12

- ``hetero``: width-heterogeneous one-shot fusion. Even clients (incl. the reference, client 0) have
  width ``w``, odd clients ``2w``; ``ot`` fuses all of them into client 0's width (vanilla averaging is
  impossible). Compared with the ensemble, the best client, OT over the narrow clients only, and ``kd``.
- ``transport``: TransFusion's task-vector transport (use (b): moving a fine-tuning delta to a new base) at small
  scale: two "base releases" θ_A, θ_B of a small timm ViT pretrained from different seeds on the original
  task; a delta τ fine-tuned from θ_A on a shifted task (digits rotated 90°, MNIST-1D time-reversed);
  θ_B + α·π(τ) vs θ_B + τ (naive) vs θ_B. Task and support (original task) accuracy.

Fusion time of ViT clients (the old ``timing`` case) is ``python -m simulations.bench.fusion_time``.
Outputs ``<out>/<case>[_<tag>].json`` (raw rows) and ``.md`` (mean ± sample std, ddof=1, over seeds).
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import time
from pathlib import Path

import torch

from fedfuse.data import FederatedData, load_source
from fedfuse.fusion import fuse, fuse_result
from fedfuse.models import build_model
from fedfuse.rebase import match_bases, task_vector, transport
from fedfuse.training import evaluate

from simulations.bench.clients import plain_recipe, train_client
from simulations.bench.specs import parse_ints, parse_partition, split_list
from simulations.bench.stats import format_mean_std, std_note
from simulations.bench.tables import markdown_table, write_json


def _acc(model, x, y) -> float:
    return float(evaluate(model, x, y)["accuracy"])


# ------------------------------------------------------------------------------------------------------
# width-heterogeneous fusion
# ------------------------------------------------------------------------------------------------------

HETERO_METHODS = {
    "ot (emd, acts)": ("ot", dict(solver="emd")),
    "ot (sinkhorn, acts)": ("ot", dict(solver="sinkhorn", reg=0.05)),
    "ot (emd, weights)": ("ot", dict(solver="emd", cost="weights")),
    "ot (emd, acts) + finetune 10": ("ot", dict(solver="emd", finetune=dict(epochs=10))),
    "kd": ("kd", {}),
}
HETERO_WIDTH = {"mlp": 64, "cnn": 16, "resnet": 16, "vit": 32}
HETERO_EPOCHS = {"mlp": 40, "cnn": 30, "resnet": 20, "vit": 30}


def hetero_clients(data: FederatedData, model: str, seed: int) -> tuple[list[torch.nn.Module], list[int]]:
    """Clients of widths w (even ids) and 2w (odd ids), trained with the plain recipe (Adam 1e-3)."""
    w = HETERO_WIDTH[model]
    clients, widths = [], []
    for pid in range(data.num_clients):
        wk = w if pid % 2 == 0 else 2 * w
        extra = {"num_heads": 4} if model == "vit" else {}
        m = build_model(model, num_classes=data.num_classes, input_shape=data.input_shape, width=wk,
                        seed=seed * 1000 + pid, **extra)
        tr, _ = data.client_data(pid, 0.1, seed)
        train_client(m, tr.x, tr.y, plain_recipe(HETERO_EPOCHS[model], 1e-3), seed=seed * 1000 + pid)
        clients.append(m.eval())
        widths.append(wk)
    return clients, widths


def run_hetero(seeds, datasets, partitions, models, out: Path, stem: str = "hetero") -> str:
    rows = []
    for ds in datasets:
        for part in partitions:
            spec = parse_partition(part)
            for model in models:
                for seed in seeds:
                    data = FederatedData.build(ds, spec.num_clients, spec.method, alpha=0.5, fusion_size=300,
                                               fusion_source="client0", seed=seed)
                    clients, widths = hetero_clients(data, model, seed)
                    w = HETERO_WIDTH[model]
                    tx, ty = data.test.x, data.test.y
                    base = dict(dataset=ds, partition=part, model=model, seed=seed, widths=widths)
                    accs = [_acc(m, tx, ty) for m in clients]
                    rows.append({**base, "method": "best client", "accuracy": max(accs), "seconds": 0.0})
                    rows.append({**base, "method": "reference client (narrow)", "accuracy": accs[0], "seconds": 0.0})
                    rows.append({**base, "method": "ensemble", "accuracy": _acc(fuse("ensemble", clients), tx, ty),
                                 "seconds": 0.0})
                    narrow = [m for m, wk in zip(clients, widths) if wk == w]
                    res = fuse_result("average", narrow)
                    rows.append({**base, "method": "average (narrow clients only)", "accuracy": _acc(res.model, tx, ty),
                                 "seconds": res.seconds})
                    res = fuse_result("ot", narrow, fusion_inputs=data.fusion_x, solver="emd", seed=seed)
                    rows.append({**base, "method": "ot (emd, acts), narrow clients only",
                                 "accuracy": _acc(res.model, tx, ty), "seconds": res.seconds, "info": res.info})
                    try:
                        fuse("average", clients)
                        status = "unexpected: average accepted mixed widths"
                    except ValueError as e:
                        status = f"n/a ({str(e)[:60]}...)"
                    rows.append({**base, "method": "average (all clients)", "accuracy": float("nan"), "seconds": 0.0,
                                 "status": status})
                    for label, (name, opts) in HETERO_METHODS.items():
                        t0 = time.perf_counter()
                        try:
                            res = fuse_result(name, clients, fusion_inputs=data.fusion_x, seed=seed, **opts)
                            row = dict(accuracy=_acc(res.model, tx, ty), status="ok", info=res.info)
                        except ValueError as e:  # FusionError: recorded in the table
                            row = dict(accuracy=float("nan"), status=f"n/a: {type(e).__name__}: {e}")
                        rows.append({**base, "method": label, "seconds": time.perf_counter() - t0, **row})
                    print(f"{ds}/{part}/{model} seed {seed}: " + ", ".join(
                        f"{r['method']}={r['accuracy']:.3f}" for r in rows if (r["seed"], r["dataset"], r["partition"],
                                                                              r["model"]) == (seed, ds, part, model)),
                          flush=True)
    write_json(rows, out / f"{stem}.json")
    settings = sorted({(r["dataset"], r["partition"], r["model"]) for r in rows})
    table = []
    for meth in dict.fromkeys(r["method"] for r in rows):
        cells = []
        for s in settings:
            rs = [r for r in rows if (r["dataset"], r["partition"], r["model"]) == s and r["method"] == meth]
            if rs and all(r["accuracy"] != r["accuracy"] for r in rs):
                cells.append(rs[0].get("status", "n/a")[:40])
            else:
                cells.append(format_mean_std([r["accuracy"] for r in rs], 100.0))
        secs = [r["seconds"] for r in rows if r["method"] == meth and r["accuracy"] == r["accuracy"]]
        table.append([meth, *cells, format_mean_std(secs, 1.0, 2)])
    text = ("# Width-heterogeneous one-shot fusion (clients of widths w and 2w fused into client 0's width w)\n\n"
            f"Seeds {list(seeds)}; fusion set: 300 samples from client 0; accuracy % ({std_note(len(seeds))}); "
            "time in seconds.\n\n"
            + markdown_table(["method", *[f"{d}/{p}/{m}" for d, p, m in settings], "fusion s"], table))
    (out / f"{stem}.md").write_text(text)
    return text


# ------------------------------------------------------------------------------------------------------
# task-vector transport
# ------------------------------------------------------------------------------------------------------


def _shift(x: torch.Tensor) -> torch.Tensor:
    """The fine-tuning task's input shift: images rotated 90°, sequences reversed in time."""
    if x.dim() == 4:
        return torch.rot90(x, 1, dims=(2, 3)).contiguous()
    return torch.flip(x, dims=(-1,)).contiguous()


def run_transport(seeds, datasets, out: Path, width=32, depth=2, heads=4, pre_epochs=30, ft_epochs=10,
                  alphas=(0.5, 1.0, 1.5), stem: str = "transport") -> str:
    rows = []
    for ds in datasets:
        for seed in seeds:
            train_set, test_set = load_source(ds, seed=seed)
            x, y, tx, ty = train_set.x, train_set.y, test_set.x, test_set.y
            sx, stx = _shift(x), _shift(tx)
            nc, shape = int(y.max()) + 1, tuple(x.shape[1:])
            vit = lambda s=0: build_model("vit", num_classes=nc, input_shape=shape, width=width,  # noqa: E731
                                             depth=depth, num_heads=heads, seed=s)
            bases = []
            for r in range(2):  # two "releases": same data and recipe, different initialisation / data order
                m = vit(seed * 100 + r)
                train_client(m, x, y, plain_recipe(pre_epochs, 1e-3), seed=seed * 100 + r)
                bases.append(m.eval())
            a, b = bases
            ft = vit()
            ft.load_state_dict(a.state_dict())
            half = len(sx) // 2  # the fine-tuning task sees half the training set, shifted
            train_client(ft, sx[:half], y[:half], plain_recipe(ft_epochs, 5e-4), seed=seed)
            tau = task_vector(ft.eval(), a)

            def rec(label, model, secs=0.0):
                rows.append(dict(dataset=ds, seed=seed, method=label, task=_acc(model, stx, ty),
                                 support=_acc(model, tx, ty), seconds=secs))

            rec("θ_A (old base)", a)
            rec("θ_A + τ (fine-tuned, source)", ft)
            rec("θ_B (new base, zero-shot)", b)
            for alpha in alphas:
                naive = vit()
                naive.load_state_dict({k: v + alpha * tau[k] if k in tau else v for k, v in b.state_dict().items()})
                rec(f"θ_B + {alpha}·τ (naive)", naive.eval())
            for method, residual in (("transfusion", "untied"), ("transfusion", "tied"), ("rebasin", "untied")):
                t0 = time.perf_counter()
                maps, _, _ = match_bases(a, b, residual=residual, method=method, seed=seed)
                secs = time.perf_counter() - t0
                for alpha in alphas:
                    moved = transport(tau, a, b, alpha=alpha, residual=residual, maps=maps)
                    rec(f"θ_B + {alpha}·π(τ), {method} ({residual})", moved.eval(), secs)
            # control: the new release is a permuted copy of the old one → transport must be exact
            from fedfuse.fusion.permute import build_spec, permute_model, random_perms
            pb = permute_model(a, random_perms(build_spec(a), seed=seed))
            rec("control: θ_B' = π0(θ_A); θ_B' + π(τ), transfusion", transport(tau, a, pb).eval())
            print(f"{ds} seed {seed}: " + ", ".join(f"{r['method']}: {r['task']:.3f}/{r['support']:.3f}"
                                                    for r in rows if r["seed"] == seed and r["dataset"] == ds),
                  flush=True)
    write_json(rows, out / f"{stem}.json")
    text = ["# Task-vector transport between two base releases of a small ViT (TransFusion use (b))\n\n"
            f"ViT width {width}, depth {depth}, {heads} heads; bases pretrained {pre_epochs} epochs from different "
            f"seeds on the original task; τ = {ft_epochs} epochs of fine-tuning θ_A on the shifted task (digits "
            "rotated 90°, MNIST-1D time-reversed; half the training set). Task = shifted test set, support = "
            f"original test set. Accuracy % ({std_note(len(seeds))} {list(seeds)}); Δ vs θ_B.\n"]
    for ds in datasets:
        dr = [r for r in rows if r["dataset"] == ds]
        bs = {r["seed"]: r for r in dr if r["method"].startswith("θ_B (new base")}
        table = []
        for meth in dict.fromkeys(r["method"] for r in dr):
            rs = [r for r in dr if r["method"] == meth]
            table.append([meth, format_mean_std([r["task"] for r in rs], 100.0),
                          format_mean_std([r["support"] for r in rs], 100.0),
                          format_mean_std([r["task"] - bs[r["seed"]]["task"] for r in rs], 100.0),
                          format_mean_std([r["support"] - bs[r["seed"]]["support"] for r in rs], 100.0),
                          format_mean_std([r["seconds"] for r in rs], 1.0, 2)])
        text.append(f"\n## {ds}\n\n" + markdown_table(["method", "task acc", "support acc", "Δ task vs θ_B",
                                                       "Δ support vs θ_B", "match s"], table))
    (out / f"{stem}.md").write_text("".join(text))
    return "".join(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulations.bench.ot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=["hetero", "transport"])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--datasets", default="digits,mnist1d")
    ap.add_argument("--partitions", default="shards2,dirichlet4")
    ap.add_argument("--models", default="mlp,vit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/ot")
    ap.add_argument("--tag", default="", help="output stem suffix: <out>/<case>_<tag>.{json,md} (keeps earlier runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = parse_ints(args.seeds)
    datasets = split_list(args.datasets)
    stem = f"{args.case}_{args.tag}" if args.tag else args.case
    if args.case == "hetero":
        partitions = [parse_partition(p).name for p in split_list(args.partitions)]
        models = split_list(args.models)
        unknown = [m for m in models if m not in HETERO_WIDTH]
        if unknown:
            raise SystemExit(f"--models: {unknown} not in {sorted(HETERO_WIDTH)}")
        print(run_hetero(seeds, datasets, partitions, models, out, stem))
    else:
        print(run_transport(seeds, datasets, out, stem=stem))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
