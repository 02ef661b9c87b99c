"""The app with its defaults, one-shot (issue 59's last goal): ``fedfuse run`` with only the issue's keys set, on
Fashion-MNIST, LeNet-5, 5 clients, Dirichlet α ∈ {0.1, 0.3, 0.5}, seeds 0–2, ``mode='one-shot'``, 10 local epochs;
everything else (strategy ``auto``, the fusion set, the optimizer, the head round) the app's defaults at the commit run.

Each run is the real ServerApp / ClientApp on the in-process engine (``--engine inprocess``: the same bodies on a
Flower Grid, the same numbers as ``flwr run`` with ``fraction-train=1``); its one-shot references (best client, the
clients' ensemble, KD, FedDF, one-shot FedAvg) are computed by the run on the same client models. ``table`` writes
``table.md`` (mean ± sample std over seeds, paired differences per seed) and ``runs.json`` (the rows, compact); the
run folders stay local (``--out``/runs). ::

    .venv/bin/python -m simulations.bench.app_oneshot run --out results/app-one-shot-default
    .venv/bin/python -m simulations.bench.app_oneshot table --out results/app-one-shot-default

Since issue 59's stacking rule the default itself is ``auto`` -> ``stack`` (``fedfuse.plan.auto_candidates``); its
nine runs, paired with the ``strategy='stack'`` runs below (``auto-candidates='kf-linear'`` gives the single-model
default of the runs recorded at the top folder)::

    .venv/bin/python -m simulations.bench.app_oneshot run --out results/app-one-shot-default/default-stack
    .venv/bin/python -m simulations.bench.app_oneshot table --out results/app-one-shot-default/default-stack \
        --name "the default (auto -> stack)" --against results/app-one-shot-default/stack

``strategy='stack'`` on the same cells (the same seeds train the same clients), paired with the default's runs::

    for s in 0 1 2; do for a in 0.5 0.3 0.1; do .venv/bin/python -m simulations.bench.app_oneshot run --alphas $a \
        --seeds $s --extra "strategy='stack' run-name='a$a-s$s'" --out results/app-one-shot-default/stack; done; done
    .venv/bin/python -m simulations.bench.app_oneshot table --out results/app-one-shot-default/stack \
        --name "strategy='stack'" --against results/app-one-shot-default

The fusion-set size's tuning runs (α 0.3, seed 100, the default keys otherwise; the table lists each run)::

    for n in 250 1000 2000 4000; do .venv/bin/python -m simulations.bench.app_oneshot run --alphas 0.3 --seeds 100 \
        --extra "fusion-set-size=$n run-name='fs$n'" --out results/app-one-shot-default/tuning; done
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from simulations.bench.stats import paired, pct

KEYS = ("dataset='fashion-mnist' model='lenet' partitioning='dirichlet' dirichlet-alpha={alpha} seed={seed} "
        "num-clients=5 mode='one-shot' num-server-rounds=1 local-epochs=10")


def run(out: Path, alphas: list[str], seeds: list[int], extra: str = "") -> None:
    runs = out / "runs"
    for seed in seeds:
        for alpha in alphas:
            # the run's folder: run-name in --extra, else a<α>-s<seed>
            name = next((w.split("=", 1)[1].strip("'") for w in extra.split() if w.startswith("run-name=")),
                        f"a{alpha}-s{seed}")
            if (runs / name / "results.json").exists():
                continue
            cfg = " ".join(w for w in (KEYS.format(alpha=alpha, seed=seed), extra) if w)
            cfg += "" if "run-name=" in extra else f" run-name='{name}'"
            subprocess.run([sys.executable, "-m", "fedfuse.flower.runner.run", "--run-config", cfg, "--engine",
                            "inprocess", "--no-compare", "--output-dir", str(runs)], check=True,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})


def row(path: Path) -> dict:
    r = json.loads(path.read_text())
    refs = {x["key"]: x["accuracy"] for x in r["one-shot-references"]["rows"]}
    fused = next(x for x in r["rounds"] if x["round"] == 1)
    head = r["rounds"][-1]
    info = fused.get("fusion-info") or {}
    return {"run": path.parent.name, "alpha": r["config"]["dirichlet-alpha"], "seed": r["config"]["seed"],
            "fusion-set-size": r["config"]["fusion-set-size"], "chose": info.get("select-choice"),
            "fused": fused["test-accuracy"], "with-head": head["test-accuracy"],
            **{k: refs[k] for k in ("best-client", "mean-client", "ensemble", "average", "kd", "feddf") if k in refs}}


LABELS = {"best-client": "best client", "mean-client": "mean client", "ensemble": "clients' ensemble (by samples)",
          "average": "one-shot FedAvg (weighted average)", "kd": "KD (ensemble into client 0's model)",
          "feddf": "FedDF (ensemble into the average)", "fused": "the default (`auto`), fused round",
          "with-head": "**the default (`auto`) + head round**"}


def table(rows: list[dict], name: str = "the default (`auto`)", against: list[dict] | None = None) -> str:
    """The rows' table; ``name``: the runs' strategy as the rows say it; ``against``: another folder's runs on the
    same cells (the same seeds train the same clients), its fused + head round rows paired with these."""
    labels = {**LABELS, "fused": f"{name}, fused round", "with-head": f"**{name} + head round**"}
    alphas = sorted({r["alpha"] for r in rows})
    head = " | ".join(f"α = {a:g}" for a in alphas)
    lines = ["Test accuracy in %, mean ± sample std (ddof=1) over seeds", "", f"| row | exchanges | {head} |",
             "|---|---|" + "---|" * len(alphas)]
    for key in ("best-client", "mean-client", "ensemble", "average", "kd", "feddf", "fused", "with-head"):
        cells = [pct([r[key] for r in rows if r["alpha"] == a and key in r]) for a in alphas]
        lines.append(f"| {labels[key]} | {'2' if key == 'with-head' else '1'} | " + " | ".join(cells) + " |")
    lines += ["", f"Paired per seed: {name} + head round minus the reference, points; per-seed values in brackets "
              "(seeds in order)", "", f"| against | {head} |", "|---|" + "---|" * len(alphas)]
    for ref in ("ensemble", "best-client", "kd", "feddf"):
        cells = []
        for a in alphas:
            d = [r["with-head"] - r[ref] for r in sorted(rows, key=lambda r: r["seed"]) if r["alpha"] == a]
            cells.append(paired(d))
        lines.append(f"| {labels[ref]} | " + " | ".join(cells) + " |")
    if against:
        other = {(r["alpha"], r["seed"]): r for r in against}
        same = all(abs(r["ensemble"] - other[(r["alpha"], r["seed"])]["ensemble"]) < 1e-9
                   for r in rows if (r["alpha"], r["seed"]) in other)
        cells = [paired([r["with-head"] - other[(a, r["seed"])]["with-head"]
                         for r in sorted(rows, key=lambda r: r["seed"]) if r["alpha"] == a and (a, r["seed"]) in other])
                 for a in alphas]
        lines.append(f"| the other folder's runs + head round (same clients: {same}) | " + " | ".join(cells) + " |")
    sizes = sorted({r["fusion-set-size"] for r in rows})
    chose = sorted({str(r["chose"]) for r in rows})
    lines += ["", f"fusion-set-size {sizes}; `auto` chose {chose}; runs: {len(rows)}"]
    return "\n".join(lines)


def tuning_table(rows: list[dict]) -> str:
    """One cell, one run per fusion-set size (the rule's tuning runs): every value, in %."""
    lines = ["One cell, a run per fusion-set size: α = {alpha:g}, seed {seed}; test accuracy in %".format(**rows[0]), "",
             "| fusion-set-size | fused round | + head round | best client | ensemble | KD | FedDF |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["fusion-set-size"]):
        lines.append(f"| {r['fusion-set-size']} | " + " | ".join(f"{100 * r[k]:.2f}" for k in (
            "fused", "with-head", "best-client", "ensemble", "kd", "feddf")) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--alphas", default="0.1,0.3,0.5")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--extra", default="", help="more run-config keys (a variant of the defaults)")
    ap.add_argument("--out", default="results/app-one-shot-default")
    ap.add_argument("--name", default="the default (`auto`)", help="table: the runs' strategy as its rows say it")
    ap.add_argument("--against", default="", help="table: another folder whose runs.json rows to pair with")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.what == "run":
        run(out, a.alphas.split(","), [int(s) for s in a.seeds.split(",")], a.extra)
    rows = [row(p) for p in sorted((out / "runs").glob("*/results.json"))
            if "one-shot-references" in json.loads(p.read_text())]   # a run still going has none yet
    (out / "runs.json").write_text(json.dumps(rows, separators=(",", ":")))
    against = json.loads((Path(a.against) / "runs.json").read_text()) if a.against else None
    text = tuning_table(rows) if len({(r["alpha"], r["seed"]) for r in rows}) == 1 else table(rows, a.name, against)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
