"""The front door's setting with the 2,000-image default fusion set (issue 59: the default raised from 250).

The README's front door (``presets/front-door.toml``: Fashion-MNIST, LeNet-5, 4 clients, Dirichlet α 0.1, one-shot,
10 local epochs, SGD lr 0.02, ``kf-linear`` + head round) reads the default ``fusion-set-size``. Its seeds 0–4 were
measured with 250 images (``results/front-door-seeds``); this reruns the ``kf-linear`` row with today's default on the
same clients (the fusion set does not change the clients' partitions or training) and pairs it per seed with the
250-image row and with FedAvg's rows there (which read no fusion set, so they stand as measured). ::

    B="dataset='fashion-mnist' model='lenet' optimizer='sgd' batch-size=64 num-clients=4 mode='one-shot' num-server-rounds=1"
    .venv/bin/python -m fedfuse.flower.runner.sweep --engine inprocess --partitions dirichlet --seeds 0,1,2,3,4 \\
        --strategies kf-linear --run-config "$B lr=0.02 dirichlet-alpha=0.1 local-epochs=10" --out results/front-door-fs2000/sweep
    .venv/bin/python -m simulations.bench.front_door_fusion_set
"""

from __future__ import annotations

import json
from pathlib import Path

from simulations.bench.stats import pct

OUT = Path("results/front-door-fs2000")
OLD = Path("results/front-door-seeds/runs.json")


def main() -> None:
    new = {r["seed"]: r for r in json.loads((OUT / "sweep" / "sweep.json").read_text())}
    old = [r for r in json.loads(OLD.read_text()) if r["lr"] == 0.02 and r["local-epochs"] == 10
           and r["dirichlet-alpha"] == 0.1]
    by = {(r["row"].split("[")[0] + ("-shared" if r["mode"] == "multi-round" else ""), r["seed"]): r for r in old}
    seeds = sorted(new)
    rows = {"kf-linear, 2,000 fusion images (today's default)": [new[s]["final-accuracy"] for s in seeds],
            "kf-linear, 250 fusion images (the former default)": [by[("kf-linear", s)]["head"] for s in seeds],
            "one-shot FedAvg (the same clients; no fusion set)": [by[("fedavg", s)]["head"] for s in seeds],
            "FedAvg from one shared initialisation (its own clients)": [by[("fedavg-shared", s)]["head"] for s in seeds]}
    fused = {"kf-linear, 2,000 fusion images (today's default)": [new[s]["final-accuracy-before-head-round"]
                                                                  for s in seeds],
             "kf-linear, 250 fusion images (the former default)": [by[("kf-linear", s)]["trained"] for s in seeds]}
    lines = [f"The front door's setting, seeds {', '.join(map(str, seeds))}; test accuracy in %, mean ± sample std",
             "", "| row | fused / trained | + head round | per seed, + head round |", "|---|---|---|---|"]
    for name, vals in rows.items():
        before = pct(fused[name], count=False) if name in fused else ""
        per_seed = " / ".join(f"{100 * v:.1f}" for v in vals)
        lines.append(f"| {name} | {before} | {pct(vals, count=False)} | {per_seed} |")
    head = rows["kf-linear, 2,000 fusion images (today's default)"]
    lines += ["", "Paired per seed, + head round (points):", ""]
    for name in list(rows)[1:]:
        d = [a - b for a, b in zip(head, rows[name])]
        lines.append(f"- kf-linear (2,000) minus {name}: {pct(d, signed=True, count=False)} ("
                     + " / ".join(f"{100 * x:+.1f}" for x in d) + ")")
    (OUT / "table.md").write_text("\n".join(lines) + "\n")
    (OUT / "runs.json").write_text(json.dumps([{k: new[s][k] for k in ("seed", "final-accuracy",
                                                                        "final-accuracy-before-head-round",
                                                                        "ensemble-accuracy", "best-client-accuracy")}
                                               for s in seeds], separators=(",", ":")))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
