"""The Fashion-MNIST tables (docs/fashion-mnist.md) from the benches' rows: mean ± sample std over seeds, the
published numbers beside them, per-seed JSON for the docs.

    .venv/bin/python -m simulations.bench.fmnist_tables --o1 results/fmnist-o1 --m1 results/fmnist-m1-full --stock results/fmnist-stock --m2 results/fmnist-m2 --out results/fmnist-tables
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from fedfuse.flower.runner.console import format_mean_std
from simulations.bench.fmnist import PUBLISHED as M1_PUBLISHED
from simulations.bench.fmnist_m2 import PUBLISHED as M2_PUBLISHED
from simulations.bench.fmnist_oneshot import PUBLISHED as O1_PUBLISHED

NOTE = "mean ± sample std (ddof=1) over seeds; test accuracy in %"
O1_LABELS = {"average": "one-shot FedAvg (weighted average)", "kd": "KD (ensemble into client 0's model)",
             "feddf": "FedDF (ensemble into the average)", "kf-linear": "kf-linear", "ot": "ot", "rebasin": "rebasin",
             "auto": "fuse('auto')", "kf-gradient": "kf-gradient", "transfusion": "transfusion",
             "init": "untrained LeNet (no client training)",
             # issue 59 item 2: the published peers (fmnist_oneshot.PEERS), statistics of each client's own data
             "regmean": "RegMean (clients' Gram matrices)", "regmean-alignw": "RegMean, Re-Basin weight-matched first",
             "regmean-align": "RegMean, Re-Basin activation-matched first",
             "regmean-public": "RegMean, public-data variant (fusion-set Grams)",
             "fisher": "Fisher merging (clients' Fishers)", "fisher-align": "Fisher merging, activation-matched first"}
PUB_ROW = {"average": "one-shot FedAvg", "feddf": "FedDF", "ensemble": "ensemble"}


SECTIONS = ("o1", "m1", "m2")
HEADINGS = {"## O1": "o1", "## M1": "m1", "## M2": "m2"}


def read_sections(out: Path) -> dict[str, str]:
    """The tables already written to ``out``, one per section (``o1.md``, ``m1.md``, ``m2.md``; a ``tables.md`` of
    an earlier version is cut at its headings): a rerun of one table keeps the others, whose raw runs may not be
    on this machine."""
    found = {k: (out / f"{k}.md").read_text() for k in SECTIONS if (out / f"{k}.md").exists()}
    if not found and (out / "tables.md").exists():
        key = None
        for line in (out / "tables.md").read_text().splitlines(keepends=True):
            key = next((v for h, v in HEADINGS.items() if line.startswith(h)), key)
            if key:
                found[key] = found.get(key, "") + line
    return found


def rows_of(folder: Path) -> list[dict]:
    """A bench's rows; a run a later bench invocation read again (its cached folder) counts once."""
    path = folder / "rows.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return list({r.get("run") or id(r): r for r in rows}.values())


def _fmt(values: list[float]) -> str:
    return format_mean_std(values, scale=100.0, digits=1) + (f" (n={len(values)})" if values else "")


def o1_table(rows: list[dict]) -> str:
    alphas = sorted({r["part"] for r in rows}, key=lambda p: float(p[3:]))
    pub_alpha = {"dir0.1": 0, "dir0.3": 1, "dir0.5": 2}
    by = defaultdict(lambda: defaultdict(list))
    secs = defaultdict(list)
    for r in rows:
        m = r["method"] + (f"@{r['fusion-size']}" if r.get("fusion-size", 1000) != 1000 and "with-head" in r else "")
        by[(m, "one")][r["part"]].append(r["accuracy"])
        if "with-head" in r:
            by[(m, "head")][r["part"]].append(r["with-head"])
            if "fuse-per-epoch" in r:   # a table read back from per-seed JSON that keep no seconds has none
                secs[m].append(r["fuse-per-epoch"])
    head = " | ".join(f"α = {p[3:]}" for p in alphas)
    lines = [f"| row | exchanges | {head} | published (FuseFL Table 2, ResNet-18, 200 epochs) | fusion s ÷ one local epoch |",
             "|---|---|" + "---|" * len(alphas) + "---|---|"]

    def pub(key):
        vals = O1_PUBLISHED.get(key)
        return " / ".join(f"{vals[pub_alpha[p]]:.2f}" for p in alphas if p in pub_alpha) if vals else ""

    for ref, label in (("best client", "best client"), ("mean client", "mean client"), ("ensemble", "clients' ensemble")):
        cells = " | ".join(_fmt(by[(ref, "one")].get(p, [])) for p in alphas)
        lines.append(f"| {label} | 1 | {cells} | {pub(PUB_ROW.get(ref, ''))} | |")
    methods = [m for m in O1_LABELS if (m, "one") in by]
    methods += sorted(m for m, kind in by if kind == "one" and "@" in m)
    for m in methods:
        s = secs.get(m, [])
        cost = f"{sum(s) / len(s):.2f}" if s else ""
        for kind, ex in (("one", "1"), ("head", "2 (+ head round)")):
            cells = " | ".join(_fmt(by[(m, kind)].get(p, [])) for p in alphas)
            p = pub(PUB_ROW.get(m, "")) if kind == "one" else ""
            name, _, size = m.partition("@")
            label = O1_LABELS.get(name, name) + (f", {size} fusion images" if size else "")
            lines.append(f"| {label} | {ex} | {cells} | {p if not size else ''} | {cost if kind == 'one' else ''} |")
    for key in ("DENSE", "FuseFL K=2", "FuseFL K=4"):
        lines.append(f"| {key} (published) | {'1' if key == 'DENSE' else key[-1]} | " + " | ".join("" for _ in alphas)
                     + f" | {pub(key)} | |")
    return "\n".join(lines)


def partial_row(run: Path) -> dict:
    """An M1 run folder stopped before its last round (no ``DONE``): its config and ``rounds.csv`` so far."""
    import csv

    cfg = json.loads((run / "config.json").read_text())
    cfg = cfg.get("run-config", cfg)
    curve = [float(r["test-accuracy"]) for r in csv.DictReader((run / "rounds.csv").open())]
    files = cfg.get("data-options.partition-files") or cfg["partition-files"]   # the layered config, or a flat one
    split = Path(files).parent.name   # fmnist-<part>-n<K>-s<seed>
    return {"part": split.split("-")[1], "seed": int(cfg["seed"]), "strategy": cfg["strategy"],
            "rounds": len(curve) - 1, "planned": int(cfg["num-server-rounds"]), "epochs": int(cfg["local-epochs"]),
            "best": max(curve[1:]), "final": curve[-1], "with-head": None, "curve": curve, "run": str(run)}


def central_rows(folder: Path) -> list[str]:
    """The pooled-data ceiling (``simulations.bench.fmnist_central``) as M1 rows: best over epochs and final."""
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("seed*-e*.json"))]
    by = defaultdict(list)
    for r in runs:
        by[r["epochs"]].append(r)
    return [f"| all (pooled) | centralised LeNet-5 (no federation: every client's images in one model) | "
            f"{e} epochs | {_fmt([r['best'] for r in rs])} | {_fmt([r['final'] for r in rs])} | — | | |"
            for e, rs in sorted(by.items())]


def m1_table(rows: list[dict], stock: list[dict], partial: list[dict] = (), central: list[str] = ()) -> str:
    lines = ["| split | row | recipe | best over rounds | final | + head round (final model) | "
             "aggregation s ÷ one local epoch | published (NIID-Bench, 50 × 10) |",
             "|---|---|---|---|---|---|---|---|"]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["part"], r["strategy"], r["rounds"], r["epochs"], "fedfuse")].append(r)
    for r in stock:
        part = Path(r["split"]).name.split("-")[1]
        stopped = r.get("planned", r["rounds"]) > r["rounds"]   # a run stopped early: its progress lines so far
        who = f"stock Flower (unfinished: {r['rounds']} of {r['planned']} rounds)" if stopped else "stock Flower"
        groups[(part, r["strategy"], r["rounds"], r["epochs"], who)].append(r)
        # like for like with a shorter stock run: fedfuse's same-recipe run cut at the stock run's round count
        for f in rows:
            if (f["part"], f["strategy"], f["epochs"], f["seed"]) == (part, r["strategy"], r["epochs"], r["seed"]) \
                    and f["rounds"] > r["rounds"]:
                cut = f["curve"][1:r["rounds"] + 1]
                groups[(part, r["strategy"], r["rounds"], r["epochs"], f"fedfuse (its first {r['rounds']} rounds)")]\
                    .append({"best": max(cut), "final": cut[-1]})
    for r in partial:   # a run stopped before its recipe's last round: every other row cut at its round count
        groups[(r["part"], r["strategy"], r["rounds"], r["epochs"], f"fedfuse (unfinished: {r['rounds']} of "
                f"{r['planned']} rounds)")].append(r)
        for f in rows:
            if (f["part"], f["epochs"], f["seed"]) == (r["part"], r["epochs"], r["seed"]) and f["rounds"] > r["rounds"]:
                cut = f["curve"][1:r["rounds"] + 1]
                groups[(r["part"], f["strategy"], r["rounds"], r["epochs"], f"fedfuse (its first {r['rounds']} rounds)")]\
                    .append({"best": max(cut), "final": cut[-1]})
    for (part, strat, rounds, epochs, who), rs in sorted(groups.items()):
        heads = [r["with-head"] for r in rs if r.get("with-head") is not None]
        label = f"{who} {strat}"
        costs = [c for r in rs if r.get("run") and (Path(r["run"]) / "results.json").exists()
                 for c in [aggregation_cost(Path(r["run"]) / "results.json", r["rounds"], epochs)[0]] if c is not None]
        lines.append(f"| {part} | {label} | {rounds} rounds × {epochs} epochs | {_fmt([r['best'] for r in rs])} | "
                     f"{_fmt([r['final'] for r in rs])} | {_fmt(heads) if heads else '—'} | "
                     f"{f'{statistics.median(costs):.3g} (median of {len(costs)})' if costs else ''} | "
                     f"{M1_PUBLISHED.get((strat, part), '') if (rounds, epochs) == (50, 10) else ''} |")
    return "\n".join(lines + list(central))


def m2_stats(row: dict) -> dict:
    """A M2 row's curve read out: final, best, at round 250, with the head round, and the seconds of the aggregation
    and of one client's local epoch (from the run's ``results.json`` where the run folder is here)."""
    train = row["curve"][1:row["rounds"] + 1]
    out = {"final": train[-1], "best": max(train), "at-250": train[min(250, len(train)) - 1],
           "with-head": row.get("with-head"), "curve": row["curve"]}
    res = Path(row["run"]) / "results.json"
    if res.exists():
        out["aggregation-per-epoch"], out["epoch-seconds"] = aggregation_cost(res, row["rounds"], 1)
        out["head-seconds"] = json.loads(res.read_text())["rounds"][-1].get("fusion-seconds")
    return out


def aggregation_cost(res: Path, rounds: int, epochs: int) -> tuple[float | None, float | None]:
    """``(the aggregation's seconds a round ÷ one client's local epoch, one local epoch's seconds)`` over the first
    ``rounds`` training rounds of a run's ``results.json`` (its clients train ``epochs`` local epochs a round; the
    two timed in the same run)."""
    rows = json.loads(res.read_text())["rounds"][1:rounds + 1]
    epoch = [r["client-train-seconds-mean"] / epochs for r in rows if r.get("client-train-seconds-mean")]
    agg = [r["fusion-seconds"] for r in rows if r.get("fusion-seconds") is not None]
    if not (agg and epoch):
        return None, None
    one = sum(epoch) / len(epoch)
    return (sum(agg) / len(agg)) / one, one


def m2_table(rows: list[dict]) -> str:
    """M2: per strategy, the final / best / round-250 accuracy, the first round reaching FedAvg's final accuracy of
    the same seed, the head round, the published number."""
    stats = [{**r, **m2_stats(r)} for r in rows]
    fedavg_final = {(r["part"], r["seed"]): r["final"] for r in stats if r["strategy"] == "fedavg"}
    lines = ["| split | row | rounds | final | best | at round 250 | first round ≥ FedAvg's final (same seed) | "
             "+ head round (final model) | aggregation s ÷ one local epoch | published (Flower fedavgm, its CNN) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups = defaultdict(list)
    for r in stats:
        groups[(r["part"], r["strategy"], r["rounds"])].append(r)
    for part, n in {(r["part"], r["rounds"]) for r in stats}:   # a shorter run: every longer one cut at its length
        for r in (r for r in stats if r["part"] == part and r["rounds"] > n):
            curve = r["curve"][:n + 1]
            groups[(part, f"{r['strategy']} (its first {n} rounds)", n)].append(
                {**r, "rounds": n, "curve": curve, "final": curve[-1], "best": max(curve[1:]),
                 "at-250": curve[min(250, n)], "with-head": None, "aggregation-per-epoch": None})
    for (part, strat, rounds), rs in sorted(groups.items()):
        reach = []
        for r in rs:
            target = fedavg_final.get((part, r["seed"]))
            hit = next((i + 1 for i, a in enumerate(r["curve"][1:rounds + 1]) if target is not None and a >= target),
                       None)
            reach.append(str(hit) if hit else "never")
        cost = [r["aggregation-per-epoch"] for r in rs if r.get("aggregation-per-epoch") is not None]
        lines.append(f"| {part} | fedfuse {strat} | {rounds} | {_fmt([r['final'] for r in rs])} | "
                     f"{_fmt([r['best'] for r in rs])} | {_fmt([r['at-250'] for r in rs])} | {' / '.join(reach)} | "
                     f"{_fmt([r['with-head'] for r in rs if r.get('with-head') is not None])} | "
                     f"{f'{sum(cost) / len(cost):.3f}' if cost else ''} | "
                     f"{M2_PUBLISHED.get((strat, part), '') if rounds == 1000 else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--o1", nargs="*", default=[])
    ap.add_argument("--m1", nargs="*", default=[])
    ap.add_argument("--stock", nargs="*", default=[])
    ap.add_argument("--m1-partial", nargs="*", default=[], help="M1 run folders stopped before their last round")
    ap.add_argument("--central", nargs="*", default=[], help="fmnist_central output folders (the pooled ceiling)")
    ap.add_argument("--m2", nargs="*", default=[])
    ap.add_argument("--out", default="results/fmnist-tables")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    o1 = [r for f in a.o1 for r in rows_of(Path(f))]
    m1 = [r for f in a.m1 for r in rows_of(Path(f))]
    stock = [json.loads(p.read_text()) for f in a.stock for p in sorted(Path(f).glob("*.json"))]
    partial = [partial_row(Path(f)) for f in a.m1_partial]
    central = [line for f in a.central for line in central_rows(Path(f))]
    sections = read_sections(out)
    if o1:
        sections["o1"] = "\n".join(["## O1: one-shot, 5 clients", "", NOTE, "", o1_table(o1), ""])
        (out / "o1-per-seed.json").write_text(json.dumps(
            [{k: r.get(k) for k in ("part", "seed", "method", "accuracy", "with-head", "fuse-seconds", "epoch-seconds",
                                    "fusion-size", "epochs")} for r in o1], indent=0))
    if m1 or stock:
        sections["m1"] = "\n".join(["## M1: NIID-Bench, 10 clients", "", NOTE, "", m1_table(m1, stock, partial, central),
                                    ""])
        keys = ("part", "seed", "strategy", "rounds", "planned", "epochs", "best", "final", "with-head", "curve")
        (out / "m1-per-seed.json").write_text(json.dumps(
            [{k: r.get(k) for k in keys} for r in m1 + partial]
            + [{**{k: r.get(k) for k in ("strategy", "seed", "rounds", "planned", "epochs", "best", "final", "curve")},
                "split": Path(r["split"]).name, "engine": r.get("engine")} for r in stock], indent=0))
    m2 = [r for f in a.m2 for r in rows_of(Path(f))]
    if m2:
        sections["m2"] = "\n".join(["## M2: cross-device, 100 clients, 5 a round (Flower's fedavgm baseline recipe, "
                                    "LeNet)", "", NOTE, "", m2_table(m2), ""])
        (out / "m2-per-seed.json").write_text(json.dumps(
            [{**{k: r.get(k) for k in ("part", "seed", "strategy", "rounds")},
              **{k: v for k, v in m2_stats(r).items()}} for r in m2], indent=0))
    for key, body in sections.items():
        (out / f"{key}.md").write_text(body)
    text = "\n".join(sections[k] for k in SECTIONS if k in sections)
    (out / "tables.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
