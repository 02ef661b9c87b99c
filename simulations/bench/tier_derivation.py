"""Cost of deriving the narrower tiers' models by pruning (``tier-models='prune'``, the default of ``average`` and the
fusion methods with width tiers), per round, against one local epoch of a widest-tier client, before and after the
per-round ranking path (``fedfuse.hetero.prune.tier_kept_units``).

For each MNIST-1D capacity-tier cell of ``results/tiers/`` (MLP 256×2 and CNN 32×2, tiers ``1,0.125`` and
``1,0.5,0.25``, Dirichlet α 0.1, 10 clients, the cells' run config) one process times, interleaved (repeat 1 of
every case, then repeat 2, …; medians):

- ``epoch``: one local epoch (SGD lr 0.2, batch 32) of every widest-tier client of the cell on its own partition;
  the mean over those clients is the unit;
- ``prune, pruning every round``: ``prune_order`` as it was (``prune_result`` to each tier, then ``kept_units``
  matches the pruned model's tensors; the dependency graph and MAC counts rebuilt every call);
- ``prune, ranked``: ``prune_order`` now (the ranking on the cached graph; checked once per architecture, not timed).

Every call gets other global weights (a fresh perturbation), as every round does. Prints and writes
``table.md``/``runs.json``: seconds and the ratio to the local epoch.

    .venv/bin/python -m simulations.bench.tier_derivation --out results/tier-derivation
    .venv/bin/python -m simulations.bench.tier_derivation --sweeps results/tiers results/tier-derivation/sweeps

``--sweeps ROOT ...``: from the capacity-tier sweeps' ``sweep.json`` (``average``, the default), per cell the
median over rounds of the whole round's tier derivation (``tier-derivation-seconds``: pruning, reordering, the
tier guard) and of the aggregation (fusion + derivation) over one widest-tier local epoch of the same round, mean
over seeds; the first round (imports, the one check per architecture) is left out.
"""

from __future__ import annotations

import simulations.bench  # noqa: F401  (sets OMP_WAIT_POLICY before torch is imported)

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch

import fedfuse.hetero.prune as hp
from fedfuse.config import parse_run_config
from fedfuse.hetero.tiers import parse_tiers
from fedfuse.models import adapter_for
from fedfuse.task import federated_data, global_model
from fedfuse.training import train
from simulations.bench.timing import interleaved_timings, medians

CELLS = {"mlp": {"model": "mlp", "model-width": 256, "model-depth": 2},
         "cnn": {"model": "cnn", "model-width": 32, "model-depth": 2}}
TIERS = ("1,0.125", "1,0.5,0.25")


def cell(family: str, tiers: str, alpha: float, repeats: int) -> dict:
    cfg = parse_run_config({"dataset": "mnist1d", "dirichlet-alpha": alpha, "num-clients": 10, "batch-size": 32,
                            "optimizer": "sgd", "lr": 0.2, "fusion-set-size": 300, "client-tiers": tiers,
                            "strategy": "average", **CELLS[family]})
    data = federated_data(cfg)
    glob = global_model(cfg, data.num_classes, data.input_shape)
    rs = parse_tiers(tiers)
    narrow = {str(r): adapter_for(glob).at_width_mult(glob, r) for r in rs if r != 1}
    widest = [p for p in range(10) if rs[p % len(rs)] == 1]   # round-robin by partition id
    local = [data.client_data(p, cfg.val_fraction, cfg.seed)[0] for p in widest]
    x = torch.as_tensor(data.fusion_x).float()
    calls = {"n": 0}

    def weights() -> torch.nn.Module:
        calls["n"] += 1
        g = copy.deepcopy(glob)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(calls["n"])
            for p in g.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        return g

    def epoch() -> None:
        for p, ds in zip(widest, local):
            train(copy.deepcopy(glob), ds.x, ds.y, epochs=1, batch_size=32, optimizer="sgd", lr=0.2, seed=p)

    real_ranking = hp._kept_by_ranking

    def pruning() -> None:
        hp._kept_by_ranking = lambda *a, **k: (None, "")
        try:
            hp.prune_order(weights(), narrow, fusion_inputs=x)
        finally:
            hp._kept_by_ranking = real_ranking

    def ranked() -> None:
        info = hp.prune_order(weights(), narrow, fusion_inputs=x)[2]
        if not all(v["ranked"] for v in info.values()):
            raise RuntimeError(f"{family} {tiers}: the ranking path was not used ({info})")

    hp.prune_order(weights(), narrow, fusion_inputs=x)   # the one check per architecture (not timed)
    med = medians(interleaved_timings({"epoch": epoch, "pruning": pruning, "ranked": ranked}, repeats=repeats))
    ep = med["epoch"]["wall"] / len(widest)
    return {"cell": f"mnist1d-{family}-a{alpha}-t{tiers.replace(',', '-').replace('.', '')}", "family": family,
            "tiers": tiers, "alpha": alpha, "widest-clients": len(widest), "epoch-s": ep,
            "pruning-s": med["pruning"]["wall"], "ranked-s": med["ranked"]["wall"]}


def sweep_ratios(roots: list[str], strategy: str = "average") -> str:
    """The per-epoch derivation and aggregation of ``strategy`` in every MNIST-1D cell under ``roots`` (a table)."""
    lines = ["| sweep root | cell | seeds | derivation per widest-tier local epoch | aggregation per epoch |",
             "|---|---|---|---|---|"]
    for root in roots:
        for path in sorted(Path(root).glob("mnist1d-*/sweep.json")):
            der, agg = [], []
            for r in json.loads(path.read_text()):
                if r.get("strategy") != strategy or not r.get("largest-tier-epoch-seconds"):
                    continue
                rows = list(zip(r["tier-derivation-seconds"], r["fusion-seconds"], r["largest-tier-epoch-seconds"]))[1:]
                der.append(statistics.median(d / e for d, f, e in rows if d is not None and e))
                agg.append(statistics.median((d + f) / e for d, f, e in rows if d is not None and f is not None and e))
            if der:
                lines.append(f"| {root} | {path.parent.name} | {len(der)} | {statistics.mean(der):.2f}× | "
                             f"{statistics.mean(agg):.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/tier-derivation")
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sweeps", nargs="+", help="summarise these sweep roots instead of timing")
    a = ap.parse_args(argv)
    if a.sweeps:
        print(sweep_ratios(a.sweeps))
        return
    torch.set_num_threads(1)
    rows = [cell(f, t, a.alpha, a.repeats) for f in CELLS for t in TIERS]
    lines = ["| cell | local epoch (s) | prune, pruning every round (s) | per epoch | prune, ranked (s) | per epoch | "
             "speed-up |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cell']} | {r['epoch-s']:.4f} | {r['pruning-s']:.4f} | {r['pruning-s'] / r['epoch-s']:.2f}× "
                     f"| {r['ranked-s']:.4f} | {r['ranked-s'] / r['epoch-s']:.2f}× | "
                     f"{r['pruning-s'] / r['ranked-s']:.1f}× |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = ("Tier-model derivation by pruning, per round (medians of interleaved repeats, one process, 1 thread): "
            "seconds and ratio to one local epoch of a widest-tier client (mean over the cell's widest-tier "
            f"clients). Command: `.venv/bin/python -m simulations.bench.tier_derivation --out {a.out}`\n\n"
            + "\n".join(lines) + "\n")
    (out / "table.md").write_text(text)
    (out / "runs.json").write_text(json.dumps(rows, indent=1))
    print(text)
    print("median speed-up", statistics.median(r["pruning-s"] / r["ranked-s"] for r in rows))


if __name__ == "__main__":
    main()
