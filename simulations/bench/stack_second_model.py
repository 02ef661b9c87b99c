"""``stack`` + head round on a second model and dataset (issue 59: so that the finding is not LeNet's and
Fashion-MNIST's alone): fedfuse's residual CNN (``model='resnet'``) on MNIST-1D, 5 clients, Dirichlet α 0.1 / 0.3 /
0.5, seeds 0–2, clients trained by the benchmarks' one trainer (``simulations.bench.clients``: AdamW, cosine, early
stopping on each client's validation loss; the per-dataset defaults), a 1,000-sample public fusion set.

Rows per cell, all on the same cached clients in one process: the clients' ensemble, the best client, ``kf-linear``,
FedDF and ``stack`` (pre-logits; ``features='logits'``) alone and + head round (``fmnist_oneshot.head_round``: the
clients' ridge / LDA statistics of their training parts, the one their validation parts score best kept). Nothing is
tuned here: ``stack``'s settings are the ones looked at on the Fashion-MNIST tuning split.

    .venv/bin/python -m simulations.bench.stack_second_model run --alphas 0.1,0.3,0.5 --seeds 0,1,2 --out results/stack-mnist1d-resnet
    .venv/bin/python -m simulations.bench.stack_second_model table --out results/stack-mnist1d-resnet
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fedfuse.fusion import fuse_result  # noqa: E402
from fedfuse.training import predict_logits  # noqa: E402
from simulations.bench.fmnist_strong import acc  # noqa: E402
from simulations.bench.stats import paired, pct  # noqa: E402

METHODS = (("kf-linear", {}), ("feddf", {}), ("stack", {}), ("stack-logits", {"features": "logits"}))


def run_cell(alpha: float, seed: int, model: str, dataset: str, cache: Path, num_clients: int = 5) -> list[dict]:
    from simulations.bench.clients import cell_config, get_clients, load_data
    from simulations.bench.fmnist_oneshot import head_round

    cfg = cell_config(dataset, f"dirichlet{num_clients}", model, seed, alpha=alpha, fusion_source="public")
    data = load_data(cfg, 1000)
    trained = get_clients(cfg, data, [], cache)
    clients = []
    for pid, c in enumerate(trained):
        tr, va = data.client_data(pid, cfg.val_fraction, cfg.seed)
        clients.append({"model": c["model"], "x": tr.x, "y": tr.y, "vx": va.x, "vy": va.y, "n": len(tr)})
    tx, ty, fx = data.test.x, data.test.y, data.fusion_x
    models, n = [c["model"] for c in clients], [c["n"] for c in clients]
    w = torch.tensor(n, dtype=torch.float32) / sum(n)
    base = {"dataset": dataset, "model": model, "clients": num_clients, "alpha": alpha, "seed": seed}
    probs = sum(wi * predict_logits(m, tx).softmax(1) for wi, m in zip(w, models))
    rows = [{**base, "method": "ensemble", "accuracy": acc(probs, ty)},
            {**base, "method": "best-client", "accuracy": max(acc(predict_logits(m, tx), ty) for m in models)}]
    for name, options in METHODS:
        method = "stack" if name.startswith("stack") else name
        fused = fuse_result(method, models, fusion_inputs=fx, weights=n, seed=seed, **options).model
        headed, info = head_round(fused, clients)
        rows.append({**base, "method": name, "accuracy": acc(predict_logits(fused, tx), ty),
                     "with-head": acc(predict_logits(headed, tx), ty), "solver": info["solver"]})
        print(f"  {dataset} {model} α {alpha:g} s{seed} {name:<13} {rows[-1]['accuracy']:.4f} -> head "
              f"{rows[-1]['with-head']:.4f}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    alphas = sorted({r["alpha"] for r in rows})
    cell = {(r["alpha"], r["seed"], r["method"]): r for r in rows}
    head = " | ".join(f"α = {a:g}" for a in alphas)
    lines = ["mean ± sample std (ddof=1) over seeds; test accuracy in %", "", f"| row | exchanges | {head} |",
             "|---|---|" + "---|" * len(alphas)]
    for m in ("best-client", "ensemble") + tuple(name for name, _ in METHODS):
        for key, ex in (("accuracy", "1"), ("with-head", "2 (+ head round)")):
            vals = [[r[key] for (a, _, mm), r in cell.items() if a == al and mm == m and key in r] for al in alphas]
            if any(vals):
                lines.append(f"| {m} | {ex} | " + " | ".join(pct(v) for v in vals) + " |")
    lines += ["", "Paired per seed: the row minus the reference, points; per-seed values in brackets", "",
              f"| row | against | {head} |", "|---|---|" + "---|" * len(alphas)]
    for m, key, ref, rkey in (("stack", "with-head", "ensemble", "accuracy"),
                              ("stack", "with-head", "kf-linear", "with-head"),
                              ("stack", "with-head", "feddf", "with-head"),
                              ("stack-logits", "with-head", "stack", "with-head"),
                              ("kf-linear", "with-head", "ensemble", "accuracy")):
        cells = [paired([r[key] - cell[(al, s, ref)][rkey] for (a, s, mm), r in sorted(cell.items())
                         if a == al and mm == m and (al, s, ref) in cell]) for al in alphas]
        lines.append(f"| {m}{' + head round' if key == 'with-head' else ''} | {ref}"
                     f"{' + head round' if rkey == 'with-head' else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--dataset", default="mnist1d")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--cache", default="results/cache")
    ap.add_argument("--out", default="results/stack-mnist1d-resnet")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rows.jsonl"
    if a.what == "run":
        command = " ".join(["python -m simulations.bench.stack_second_model"] + (argv if argv is not None
                                                                                 else sys.argv[1:]))
        for alpha in (float(x) for x in a.alphas.split(",")):
            for seed in (int(s) for s in a.seeds.split(",")):
                with open(path, "a") as f:
                    for r in run_cell(alpha, seed, a.model, a.dataset, Path(a.cache), a.clients):
                        f.write(json.dumps({**r, "command": command}) + "\n")
    raw = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows = list({(r["alpha"], r["seed"], r["method"]): r for r in raw}.values())
    commands = list(dict.fromkeys(r["command"] for r in raw))
    text = table(rows) + "\n\nThe commands, in the order run:\n\n```bash\n" + "\n".join(commands) + "\n```\n"
    (out / "table.md").write_text(text)
    (out / "runs.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "command"} for r in rows],
                                              separators=(",", ":")))
    print(text)


if __name__ == "__main__":
    main()
