"""Issue 47 part 3: the Fashion-MNIST width-tier cell's table from the per-seed sweeps in results/fmnist-tiers-sgd/runs/.

    .venv/bin/python results/fmnist-tiers-sgd/table.py     (writes results/fmnist-tiers-sgd/sweep.json and table.md)

Merges every runs/<cell>-s<seed>/sweep.json into one sweep.json (the runs' final and per-tier accuracies, no
per-round curves) and tables each row's global model and every tier: mean ± sample std (ddof 1) over the seeds that
finished, then the issue's goals (the default `average` above every baseline on the global model and on every tier;
the smallest tier >= FedAvg trained at that width alone + 3 points)."""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIERS = ("1", "0.5", "0.25")
KEEP = ("strategy", "seed", "status", "seconds", "final-accuracy", "final-tier-accuracy", "run-config")


def ms(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    if len(xs) == 1:
        return f"{100 * xs[0]:.2f} (n=1)"
    return f"{100 * statistics.mean(xs):.2f} ± {100 * statistics.stdev(xs):.2f}"


def main():
    runs = []
    for p in sorted((HERE / "runs").glob("*/sweep.json")):
        runs += [{k: r.get(k) for k in KEEP} | {"cell": p.parent.name.rsplit("-s", 1)[0]} for r in json.loads(p.read_text())]
    for r in runs:   # the FedAvg row at the smallest width (sweep-as-tier=0.25, no tiers): its global model is that tier's
        if r["strategy"].startswith("fedavg[") and not r["final-tier-accuracy"] and "sweep-as-tier=0.25" in r["strategy"]:
            r["final-tier-accuracy"] = {"0.25": r["final-accuracy"]}
    (HERE / "sweep.json").write_text(json.dumps(runs, indent=1) + "\n")
    cfg = runs[0]["run-config"] if runs else {}
    cfg = " ".join(f"{k}={v!r}" for k, v in cfg.items() if k not in ("strategy", "partitioning", "seed", "run-name"))
    out = [f"Run config (the `average` row's): `{cfg}`; seeds {sorted({r['seed'] for r in runs})}", "",
           "Final test accuracy, % (mean ± sample std, ddof 1, over seeds; Fashion-MNIST's 10,000 test images)", ""]
    for cell in sorted({r["cell"] for r in runs}):
        rows = {}
        for r in runs:
            if r["cell"] == cell:
                rows.setdefault(r["strategy"], []).append(r)
        out += [f"#### {cell}", "", "| row | seeds (finished/run) | global | tier 1 | tier 0.5 | tier 0.25 | s/run |",
                "|---|---|---|---|---|---|---|"]
        for s, rs in rows.items():
            ok = [r for r in rs if str(r["status"]).startswith("finished")]
            t = lambda k: ms([(r["final-tier-accuracy"] or {}).get(k) for r in ok])
            sec = statistics.mean(r["seconds"] for r in rs) if rs else 0
            out.append(f"| `{s}` | {len(ok)}/{len(rs)} | {ms([r['final-accuracy'] for r in ok])} | {t('1')} | {t('0.5')} | {t('0.25')} | {sec:.0f} |")
        mean = lambda s, k: (statistics.mean(v) if (v := [(r["final-accuracy"] if k == "g" else (r["final-tier-accuracy"] or {}).get(k))
                                                         for r in rows.get(s, []) if str(r["status"]).startswith("finished")]) and None not in v else None)
        out += ["", "Goals (on the means):"]
        for b in ("heterofl", "fedrolex", "feddf", "depthfl"):
            if b not in rows:
                out.append(f"- above {b}: not run")
                continue
            res = []
            for k in ("g",) + TIERS:
                a, c = mean("average", k), mean(b, k)
                res.append(f"{'global' if k == 'g' else 'tier ' + k}: " + ("n/a" if a is None or c is None else
                           f"{'met' if a > c else 'MISSED'} ({100 * (a - c):+.2f})"))
            out.append(f"- above {b}: " + "; ".join(res))
        fa = [s for s in rows if s.startswith("fedavg[")]
        for s in fa:
            a, c = mean("average", "0.25"), mean(s, "0.25")
            out.append(f"- tier 0.25 >= `{s}` + 3 points: " + ("n/a" if a is None or c is None else
                       f"{'met' if a >= c + 0.03 else 'MISSED'} ({100 * (a - c):+.2f} points)"))
        out.append("")
    (HERE / "table.md").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
