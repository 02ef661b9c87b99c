"""Offline: the head round's closed-form classifiers on a finished depth-tier benchmark's models, side by side.

For every run of a ``simulations.bench.depth_tiers`` output folder (``OUT/runs/<label>-a<α>-s<seed>``) the model of its
last training round (the checkpoint before the head round) is read back, every node's ridge statistics are computed on
its own training split (the run's partition files) at every classifier of the model (``fedfuse.progressive.head_sites``:
the final one and every depth exit), and the test accuracy of each classifier is reported as trained, with the ridge
head (``solve_head``) and with the LDA head (``solve_lda_head``) solved from the pooled statistics: what the head round's
candidates would score on the test set, without the clients' check. Mean over the runs; the per-run rows beside it.

    .venv/bin/python -m simulations.bench.head_solvers results/depth-tiers-head-each-a01 [--runs 'average-*']
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedfuse.config import dataset_info, parse_run_config  # noqa: E402
from fedfuse.progressive import SiteView, head_sites, head_statistics, solve_head, solve_lda_head, with_head  # noqa: E402
from fedfuse.task import global_model  # noqa: E402
from fedfuse.training import evaluate  # noqa: E402


def _arrays(path: Path, shape: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
    z = np.load(path)
    kx = next(k for k in z.files if k.startswith("x"))
    ky = next(k for k in z.files if k.startswith("y"))
    x = torch.tensor(z[kx]).float()
    return (x if shape is None else x.reshape(-1, *shape)), torch.tensor(z[ky]).long()


def run_row(run: Path) -> dict[str, float]:
    """``{"<site> trained|ridge|lda": test accuracy}`` for one run (site ``F``: the final classifier)."""
    raw = json.loads((run / "config.json").read_text())
    cfg = parse_run_config(raw, strict=False)
    ck = next(c for c in (torch.load(run / "checkpoint" / f, weights_only=False)
                          for f in ("global_model.prev.pt", "global_model.pt"))
              if c["round"] == cfg.num_server_rounds)
    nodes = sorted(glob.glob(raw["partition-files"].replace("{partition-id}", "*")))
    x0, _ = _arrays(Path(nodes[0]), None)
    shape = tuple(x0.shape[1:])
    xt, yt = _arrays(Path(raw["test-set-path"]), shape)
    classes = dataset_info(cfg.dataset).num_classes
    model = global_model(cfg, classes, shape)
    model.load_state_dict(ck["state_dict"])
    data = [_arrays(Path(f), shape) for f in nodes]
    row = {}
    for site in head_sites(model):
        stats = [head_statistics(model, x, y, classes, site=site) for x, y in data]

        def acc(m, site=site):
            return evaluate(SiteView(m, site) if site else m, xt, yt, num_classes=classes)["accuracy"]

        name = site or "F"
        row[f"{name} trained"] = acc(model)
        row[f"{name} ridge"] = acc(with_head(copy.deepcopy(model), solve_head(stats, cfg.head_ridge), site))
        row[f"{name} lda"] = acc(with_head(copy.deepcopy(model), solve_lda_head(stats), site))
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--runs", default="average-*", help="glob of run folders under OUT/runs")
    a = ap.parse_args(argv)
    runs = sorted(p for p in Path(a.out, "runs").glob(a.runs) if (p / "checkpoint").is_dir())
    if not runs:
        raise SystemExit(f"no runs with checkpoints match {a.out}/runs/{a.runs}")
    rows = {r.name: run_row(r) for r in runs}
    keys = list(next(iter(rows.values())))
    sites = list(dict.fromkeys(k.split()[0] for k in keys))
    lines = [f"Head solvers on the last training round's models of `{a.out}` (runs `{a.runs}`): test accuracy of "
             "every classifier as trained, with the ridge head and with the LDA head solved from every node's "
             "statistics (no clients' check). Command: `.venv/bin/python -m simulations.bench.head_solvers "
             f"{a.out} --runs '{a.runs}'`.\n",
             "| classifier | trained | ridge | LDA |", "|---|---|---|---|"]
    for site in sites:
        cells = []
        for kind in ("trained", "ridge", "lda"):
            v = [r[f"{site} {kind}"] for r in rows.values()]
            cells.append(f"{statistics.mean(v):.3f}" + (f" ± {statistics.stdev(v):.3f}" if len(v) > 1 else ""))
        lines.append(f"| {'final' if site == 'F' else 'exit ' + site} | " + " | ".join(cells) + " |")
    lines += ["", "| run | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    lines += [f"| {n} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |" for n, r in rows.items()]
    text = "\n".join(lines) + "\n"
    (Path(a.out) / "head-solvers.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
