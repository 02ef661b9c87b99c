"""The one-shot default's rules, checked through the app on cells that did not choose them (issue 59 items 3 and 4).

1. ``distill``: LeNet-5's one-shot default distils ``kf-linear``'s model from the clients' ensemble before the head
   round (``fedfuse.plan.ONE_SHOT_DISTILL``, chosen on the strong-client bench). Checked on the README front door's
   setting (4 clients, Dirichlet α 0.1, SGD lr 0.02, 10 local epochs: another client recipe, another split), seeds
   0–4: ``strategy='auto'`` (the default: kf-linear distilled, then the head round) against ``strategy='kf-linear'``
   (the same fusion with the same client scores, no distillation; ``results/front-door-fs2000``) on the same clients.
2. ``resnet``: which candidate ``auto`` takes in one-shot runs with the head round for fedfuse's ResNet family. On
   torchvision ResNet-18 clients (``results/fmnist-resnet18``) ``kf-linear`` + head round was 5–6 points above FedDF
   + head round, the rule for ResNets until then (chosen when kf-linear could not read ResNets). Checked on
   MNIST-1D, 5 clients, α 0.1 / 0.3 / 0.5, seeds 0–2, 10 local epochs: ``strategy='auto'`` as it was (FedDF + head
   round) against ``strategy='kf-linear'`` (+ head round) on the same clients.

Each run is ``fedfuse.flower.runner.sweep`` (in-process engine, the real ServerApp / ClientApp); ``table`` reads the
sweeps' ``sweep.json`` and writes ``table.md`` and the compact rows ``runs.json``. ::

    B="dataset='fashion-mnist' model='lenet' optimizer='sgd' batch-size=64 num-clients=4 mode='one-shot' num-server-rounds=1"
    .venv/bin/python -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet --seeds 0,1,2,3,4 \\
        --strategies auto --run-config "$B lr=0.02 dirichlet-alpha=0.1 local-epochs=10" --out results/front-door-auto/sweep
    .venv/bin/python -m simulations.bench.oneshot_default_checks distill
    B="dataset='mnist1d' model='resnet' num-clients=5 mode='one-shot' num-server-rounds=1 local-epochs=10"
    for a in 0.1 0.3 0.5; do .venv/bin/python -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet \\
        --seeds 0,1,2 --strategies auto,kf-linear --run-config "$B dirichlet-alpha=$a" --out results/resnet-mnist1d-oneshot/a$a; done
    for a in 0.1 0.3 0.5; do .venv/bin/python -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet \
        --seeds 0,1,2 --strategies stack --run-config "$B dirichlet-alpha=$a" --out results/resnet-mnist1d-oneshot/stack-a$a
        .venv/bin/python -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet --seeds 0,1,2 \
        --strategies kf-linear --run-config "$B dirichlet-alpha=$a" --out results/resnet-mnist1d-oneshot/rerun-a$a; done
    .venv/bin/python -m simulations.bench.oneshot_default_checks resnet

The ``stack`` sweeps (issue 59: ``auto``'s one-shot rule with the head round became ``stack``) and ``kf-linear``
rerun beside them train the same clients run for run (the earlier sweeps' clients, from another environment, differ),
so the table's second part pairs those two.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from simulations.bench.stats import paired, pct

KEEP = ("strategy", "seed", "final-accuracy", "final-accuracy-before-head-round", "ensemble-accuracy",
        "best-client-accuracy", "fusion-seconds")


def rows_of(path: Path, alpha: float | None = None) -> list[dict]:
    """A sweep's runs, the fields the tables read (``alpha`` added when given)."""
    out = []
    for r in json.loads(path.read_text()):
        if r["status"] != "finished:completed":
            raise ValueError(f"{path}: run {r['run-config'].get('run-name')} did not complete: {r['status']}")
        out.append({**{k: r[k] for k in KEEP if k in r}, **({"alpha": alpha} if alpha is not None else {})})
    return out


def cell(values: list[float]) -> str:
    return pct(values, count=False)


def distill(out: Path, reference: Path) -> list[str]:
    auto = {r["seed"]: r for r in rows_of(out / "sweep" / "sweep.json")}
    kf = {r["seed"]: r for r in json.loads(reference.read_text())}
    seeds = sorted(s for s in auto if s in kf)
    same = all(abs(auto[s]["ensemble-accuracy"] - kf[s]["ensemble-accuracy"]) < 1e-9 for s in seeds)
    lines = [f"The front door's setting (4 clients, Dirichlet α 0.1, SGD lr 0.02, 10 local epochs), seeds "
             f"{', '.join(map(str, seeds))}; test accuracy in %, mean ± sample std; same clients in both rows: {same}",
             "", "| row | fused round | + head round | per seed, + head round |", "|---|---|---|---|"]
    for name, rows in (("the default (`auto`: kf-linear distilled from the ensemble)", auto),
                       ("`kf-linear` (no distillation; results/front-door-fs2000)", kf)):
        lines.append(f"| {name} | {cell([rows[s]['final-accuracy-before-head-round'] for s in seeds])} | "
                     f"{cell([rows[s]['final-accuracy'] for s in seeds])} | "
                     + " / ".join(f"{100 * rows[s]['final-accuracy']:.1f}" for s in seeds) + " |")
    lines += ["", "Paired per seed (points): the default minus `kf-linear`, + head round: "
              + paired([auto[s]["final-accuracy"] - kf[s]["final-accuracy"] for s in seeds])
              + "; the fused round: " + paired([auto[s]["final-accuracy-before-head-round"]
                                                 - kf[s]["final-accuracy-before-head-round"] for s in seeds]),
              "", "Server seconds of the default's fusion (the distillation included), per seed: "
              + " / ".join(f"{auto[s]['fusion-seconds'][0]:.0f}" for s in seeds)]
    (out / "runs.json").write_text(json.dumps([auto[s] for s in seeds], separators=(",", ":")))
    return lines


def _resnet_rows(out: Path, prefix: str, tag: str = "") -> list[dict]:
    """The sweeps ``out/<prefix><α>/sweep.json``' rows, ``tag`` appended to their strategy."""
    return [{**r, "strategy": r["strategy"] + tag} for a in ("0.1", "0.3", "0.5")
            if (out / f"{prefix}{a}" / "sweep.json").exists()
            for r in rows_of(out / f"{prefix}{a}" / "sweep.json", float(a))]


def _resnet_table(rows: list[dict], named: tuple, pairs: tuple, same: tuple[str, ...]) -> list[str]:
    alphas = sorted({r["alpha"] for r in rows})

    def by(strategy, key, a):
        return {r["seed"]: r[key] for r in rows if r["strategy"] == strategy and r["alpha"] == a}

    lines = ["| row | " + " | ".join(f"α = {a:g}" for a in alphas) + " |", "|---|" + "---|" * len(alphas)]
    for name, strategy, key in named:
        lines.append(f"| {name} | " + " | ".join(cell(list(by(strategy, key, a).values())) for a in alphas) + " |")
    lines += ["", "Paired per seed, + head round (points; seeds in order):", "",
              "| against | " + " | ".join(f"α = {a:g}" for a in alphas) + " |", "|---|" + "---|" * len(alphas)]
    for label, row, strategy, key in pairs:
        diffs = []
        for a in alphas:
            mine, ref = by(row, "final-accuracy", a), by(strategy, key, a)
            diffs.append(paired([mine[s] - ref[s] for s in sorted(mine) if s in ref]))
        lines.append(f"| {label} | " + " | ".join(diffs) + " |")
    identical = all(abs(x - y) < 1e-9 for a in alphas for other in same[1:]
                    for s, x in by(same[0], "ensemble-accuracy", a).items()
                    for y in [by(other, "ensemble-accuracy", a).get(s, x)])
    return lines + ["", f"Same clients in these runs (identical ensembles): {identical}"]


def resnet(out: Path) -> list[str]:
    """The earlier check (``a<α>``: ``auto`` as it was, FedDF + head round, against ``kf-linear``), then ``stack``
    against ``kf-linear`` rerun on this machine (``stack-a<α>``, ``rerun-a<α>``: the same clients run for run; the
    earlier runs' clients came from another environment and differ)."""
    first = _resnet_rows(out, "a")
    second = _resnet_rows(out, "stack-a") + _resnet_rows(out, "rerun-a", " (rerun)")
    head = ("MNIST-1D, fedfuse's ResNet, 5 clients, Dirichlet α, one-shot, 10 local epochs; test accuracy in %, "
            "mean ± sample std over seeds")
    lines = [head, "", "**The ResNet rule's check (FedDF + head round, `auto`'s rule until then, against `kf-linear`):**",
             ""] + _resnet_table(first, (
                 ("best client", "auto", "best-client-accuracy"),
                 ("clients' ensemble", "auto", "ensemble-accuracy"),
                 ("FedDF, fused round", "auto", "final-accuracy-before-head-round"),
                 ("FedDF + head round (`auto`'s rule for ResNets until this check)", "auto", "final-accuracy"),
                 ("`kf-linear`, fused round", "kf-linear", "final-accuracy-before-head-round"),
                 ("`kf-linear` + head round", "kf-linear", "final-accuracy")), (
                 ("`kf-linear` + head round − FedDF + head round", "kf-linear", "auto", "final-accuracy"),
                 ("`kf-linear` + head round − clients' ensemble", "kf-linear", "auto", "ensemble-accuracy")),
                 ("auto", "kf-linear"))
    if second:
        lines += ["", "**The stacking rule's check (issue 59: `auto`'s one-shot choice with the head round became "
                  "`stack`), against `kf-linear` on the same clients:**", ""] + _resnet_table(second, (
                      ("best client", "stack", "best-client-accuracy"),
                      ("clients' ensemble", "stack", "ensemble-accuracy"),
                      ("`kf-linear`, fused round", "kf-linear (rerun)", "final-accuracy-before-head-round"),
                      ("`kf-linear` + head round", "kf-linear (rerun)", "final-accuracy"),
                      ("`stack`, fused round", "stack", "final-accuracy-before-head-round"),
                      ("`stack` + head round (`auto`'s rule now)", "stack", "final-accuracy")), (
                      ("`stack` + head round − `kf-linear` + head round", "stack", "kf-linear (rerun)",
                       "final-accuracy"),
                      ("`stack` + head round − clients' ensemble", "stack", "stack", "ensemble-accuracy"),
                      ("`stack` + head round − best client", "stack", "stack", "best-client-accuracy")),
                      ("stack", "kf-linear (rerun)"))
    (out / "runs.json").write_text(json.dumps(first + second, separators=(",", ":")))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("distill", "resnet"))
    ap.add_argument("--out", default="")
    ap.add_argument("--reference", default="results/front-door-fs2000/runs.json")
    args = ap.parse_args(argv)
    out = Path(args.out or ("results/front-door-auto" if args.what == "distill" else "results/resnet-mnist1d-oneshot"))
    lines = distill(out, Path(args.reference)) if args.what == "distill" else resnet(out)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
