"""The trust benchmark (issue 25): lying clients against FedAvg, Flower's robust strategies, FedDF, fusion and fedfuse's
default with and without its robust setting, on stock Flower's MNIST-1D splits.

Each run is fedfuse's real ServerApp and ClientApp (in-process engine) with the anchor cell's client recipe
(``simulations.bench.anchor_cell.anchor_recipe``: MLP 256×2, SGD 0.9 / lr 0.2, batch 32, 1 local epoch, every client
every round) and ``head-round=false`` (the aggregation's robustness is measured; the head round's statistics are not
screened, docs/trust.md). ``f`` of the 10 clients (drawn per seed; the 1 liar is one of the 3) run a threat of
``simulations.attacks`` in every round. Defences get their best honest setting: Krum is told f
(``num-malicious-nodes``), FedTrimmedAvg cuts f/10 at each end (``trim-beta``; at least 0.1).

Columns (mean ± sample std over seeds): final test accuracy; for ``backdoor`` the attack success rate (test samples
not of the target class, trigger stamped, classified as the target); for the robust setting the share of rounds in
which an honest client was dropped (false positives) and in which every liar was dropped.

    .venv/bin/python -m simulations.bench.trust --out results/trust
    .venv/bin/python -m simulations.bench.trust --threats clean,scale --liars 1 --seeds 0 --rounds 5   # a smoke run
    .venv/bin/python -m simulations.bench.trust --summary results/trust

FLAME's clustering in the robust screen (``robust-cluster``; docs/trust.md, "Clustering the updates"): the
strategies ``auto[robust=true robust-cluster='core']``, ``...='core-positive'``, ``...='core-positive'
robust-cluster-min-samples=0`` and ``...='flame'`` with ``--liars 3 --threats clean,random,sign-flip,label-flip,scale``
and ``--liars 1 --threats random,sign-flip`` into ``--out results/trust-cluster``, and at 20 clients ``--liars 6
--threats clean`` (``random,sign-flip`` too for min-samples 0) into ``--out results/trust-cluster-c20``; the commands
are in docs/trust.md. The screen's table counts honest client-rounds dropped too.

The oracle (``--threats absent``, ``simulations.attacks``: the liars' clients answer every message with an error,
so each round is the honest clients' alone, the round's quorum lowered to them): what a screen that drops exactly
the liars and nothing else would reach, for the goal "3 of 10 liars at most 5 points below clean":

    .venv/bin/python -m simulations.bench.trust --threats absent --liars 1,3 --strategies "fedavg,auto[robust=true]" \
        --jobs 1 --out results/trust-oracle

The clients' answers to the server's queries (``--head-round``: every run ends with the head round; the query
threats ``lie-head``, statistics of reversed labels claiming 100 × the samples and votes for the solved head, and
``lie-votes``, votes for the worst candidate; ``fedfuse.flower.trust.screen``), multi-round, at 10 local epochs
(``auto``'s vote), and one-shot:

    .venv/bin/python -m simulations.bench.trust --head-round --threats clean,lie-head,lie-votes,label-flip,random,sign-flip \
        --liars 3 --strategies "fedavg,auto[robust=true]" --jobs 1 --out results/trust-answers
    .venv/bin/python -m simulations.bench.trust --head-round --local-epochs 10 --lr 0.05 --rounds 5 \
        --threats clean,lie-votes --liars 3 --strategies "auto,auto[robust=true]" --jobs 1 --out results/trust-vote
    .venv/bin/python -m simulations.bench.trust --mode one-shot --local-epochs 20 --lr 0.05 --head-round \
        --threats clean,lie-votes,lie-head --liars 3 --strategies "auto,auto[robust=true]" --jobs 1 \
        --out results/trust-answers-one-shot
    .venv/bin/python -m simulations.bench.trust --mode one-shot --local-epochs 20 --lr 0.05 --threats clean,lie-votes \
        --liars 3 --strategies "auto,auto[robust=true]" --jobs 1 --out results/trust-vote-one-shot

Other cells: 20 clients (splits made with the anchors' recipe by ``simulations.bench.anchor_splits``) and one-shot
(clients train from independent initialisations, one round, the server aggregates once; ``robust`` does not apply):

    .venv/bin/python -m simulations.bench.anchor_splits --clients 20 --out results/cache/anchor-splits
    .venv/bin/python -m simulations.bench.trust --clients 20 --splits results/cache/anchor-splits --liars 2,6 \
        --threats clean,sign-flip,random,label-flip --strategies "fedavg,fedtrimmedavg,auto[robust=true]" \
        --out results/trust-c20
    .venv/bin/python -m simulations.bench.trust --mode one-shot --local-epochs 20 --lr 0.05 --threats clean \
        --strategies fedavg --out results/trust-one-shot
    .venv/bin/python -m simulations.bench.trust --mode one-shot --local-epochs 20 --lr 0.05 \
        --threats clean,sign-flip,random,label-flip,backdoor --strategies feddf,kf-linear,auto --out results/trust-one-shot
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from fedfuse.flower.trust.screen import CLASS_MEAN_THRESHOLD  # noqa: E402
from fedfuse.flower.runner.console import format_mean_std  # noqa: E402
from fedfuse.flower.runner.sweep import parse_strategy, split_strategies  # noqa: E402
from simulations.bench.anchor_cell import ANCHORS, anchor_recipe, run_or_read  # noqa: E402

# `auto` (the default) at 1 local epoch is FedAvg's average exactly (no fusion candidate below auto-fusion-epochs), so
# the `fedavg` column is the default's; `auto[robust=true]` is the default with the robust setting
STRATEGIES = "fedavg,fedmedian,fedtrimmedavg,krum,feddf,auto[robust=true],kf-linear"
THREATS = "clean,scale,sign-flip,random,label-flip,backdoor,free-ride,inflate-scores"
SCORE_THREATS = ("inflate-scores", "concentrate")   # only strategies that read client scores see them
SCORE_READERS = ("kf-linear", "kf-gradient", "hf-linear", "hf-gradient")   # run clean and under the score threats only


def liars(seed: int, f: int, clients: int = 10) -> list[int]:
    """The ``f`` lying partition ids of seed ``seed`` (nested: the 1 liar is one of the 3)."""
    return sorted(np.random.default_rng(1000 + seed).permutation(clients)[:f].tolist())


def defence_options(name: str, f: int, clients: int = 10) -> dict:
    """A robust Flower strategy's best honest setting for ``f`` liars of ``clients`` (it is told f)."""
    if name in ("krum", "multikrum", "bulyan"):
        return {"num-malicious-nodes": f}
    if name == "fedtrimmedavg":
        return {"trim-beta": max(0.1, f / clients)}
    return {}


def _run(job: dict) -> dict:
    import torch

    from fedfuse.flower.client_app import make_client_app
    from fedfuse.models import build_model
    from simulations.attacks import BACKDOOR_CLASS, Attack, stamp

    cfg = job["config"]
    attack = None if job["threat"] == "clean" else \
        Attack(job["threat"], frozenset(job["liars"]), workdir=Path(cfg["output-dir"]) / "poisoned", seed=job["seed"])
    mods = [] if attack is None else [attack.mod]
    # an attack that kills the model fails the run (by design): its accuracy is the result
    out, res, failed = run_or_read(cfg, client_app=make_client_app(mods=mods))
    row = {k: job[k] for k in ("label", "threat", "f", "seed", "liars")}
    row["clients"] = job.get("clients", 10)
    row["one-shot"] = cfg.get("mode") == "one-shot"
    row["failed"] = failed
    row["final"] = res["rounds"][-1]["test-accuracy"]
    row["curve"] = [r["test-accuracy"] for r in res["rounds"]]
    head = next((h["fusion-info"]["head-round"] for h in res.get("strategy-history", [])
                 if h.get("post-step") == "head-round"), None)
    if head is not None:   # the last training round's model vs the head round's, and what the head round dropped
        row["before-head"] = row["curve"][-2] if len(row["curve"]) > 1 else None
        row["head"] = {"kept": head.get("kept"), "valid": head.get("valid"), "capped": len(head.get("capped", [])),
                       "rejected": [r["reason"][:60] for r in head.get("rejected", [])],
                       "class-mean-scores": head.get("class-mean-scores"),
                       "liar-nodes": sorted(attack.nodes) if attack is not None else [],
                       "client-accuracy": head.get("client-accuracy")}
    hist = res.get("strategy-history", [])
    honest_dropped = liars_dropped = 0
    screened_rounds = 0
    for h in hist:
        s = h.get("screened")
        if not s:
            continue
        screened_rounds += 1
        gone = {d.get("partition-id") for d in s.get("dropped", [])}
        honest_dropped += bool(gone - set(job["liars"]))
        liars_dropped += bool(job["liars"]) and set(job["liars"]) <= gone
    # what the screen saw: every client's cosine (relative to the round's median cosine) and norm ratio, per side
    seen: dict[str, list[float]] = {"cos-honest": [], "cos-liar": [], "norm-honest": [], "norm-liar": []}
    for h in hist:
        clients = (h.get("screened") or {}).get("clients", {})
        med = float(np.median([v["cosine"] for v in clients.values()])) if clients else 0.0
        for pid, v in clients.items():
            side = "liar" if int(pid) in job["liars"] else "honest"
            if med > 0:
                seen[f"cos-{side}"].append(v["cosine"] / med)
            if v.get("norm") is not None:
                seen[f"norm-{side}"].append(v["norm"])
    row["screen-seen"] = {k: [round(min(v), 3), round(max(v), 3)] if v else None for k, v in seen.items()}
    row["screened-rounds"] = screened_rounds
    row.update(client_round_drops(hist, job["liars"]))
    row["honest-dropped"] = honest_dropped
    row["liars-dropped"] = liars_dropped
    if job["threat"] == "backdoor":
        test = np.load(cfg["test-set-path"])
        x, y = test["x"], test["y"]
        keep = y != BACKDOOR_CLASS
        model = build_model(cfg["model"], num_classes=int(res["config"]["num-classes"]), input_shape=tuple(x.shape[1:]),
                            width=cfg["model-width"], depth=cfg["model-depth"])
        model.load_state_dict(torch.load(out / "global_model.pt", map_location="cpu", weights_only=True))
        with torch.no_grad():
            pred = model.eval()(torch.as_tensor(stamp(x[keep]))).argmax(1).numpy()
        row["attack-success"] = float((pred == BACKDOOR_CLASS).mean())
    return row


def client_round_drops(hist: list[dict], bad: list[int]) -> dict:
    """The screen's drops counted per client-round: honest client-rounds screened and dropped."""
    honest = dropped = 0
    for h in hist:
        s = h.get("screened")
        if not s:
            continue
        honest += sum(1 for pid in s.get("clients", {}) if int(pid) not in bad)
        dropped += sum(1 for d in s.get("dropped", []) if d.get("partition-id") not in bad)
    return {"honest-client-rounds": honest, "honest-client-rounds-dropped": dropped}


def jobs_for(args) -> list[dict]:
    anchors, out = Path(args.anchors), Path(args.out)
    public = anchors / "splits" / "mnist1d-public.npz"
    one_shot = args.mode == "one-shot"
    # the cell's run-config beyond the anchor recipe (the 10-client multi-round cell's run names carry none of it)
    cell = {"mode": "one-shot", "num-server-rounds": 1, "one-shot-references": "none"} if one_shot else {}
    cell.update({k: v for k, v in (("local-epochs", args.local_epochs), ("lr", args.lr)) if v is not None})
    if args.head_round:   # the head round's statistics and check under the query threats (lie-head, lie-votes)
        cell["head-round"] = True
    suffix = "".join(f"-{k}={v}" for k, v in cell.items() if k not in ("num-server-rounds", "one-shot-references"))
    jobs, seen = [], set()
    for seed in [int(s) for s in args.seeds.split(",")]:
        split = (Path(args.splits) / f"mnist1d-c{args.clients}-a{args.alpha:g}-s{seed}" if args.splits
                 else anchors / "splits" / f"mnist1d-a{args.alpha:g}-s{seed}")
        for f in [int(v) for v in args.liars.split(",")]:
            for threat in args.threats.split(","):
                for label in split_strategies(args.strategies):
                    name, extra = parse_strategy(label)
                    if threat in SCORE_THREATS and name not in SCORE_READERS:
                        continue
                    # multi-round kf-linear at 1 local epoch is unstable clean: it runs clean and under score threats
                    if not one_shot and name in SCORE_READERS and threat not in SCORE_THREATS + ("clean",):
                        continue
                    defence = defence_options(name, f, args.clients)
                    opts = {**defence, **extra}
                    bad = liars(seed, f, args.clients) if threat != "clean" else []
                    tag = "-".join([label] + [f"{k}={v}" for k, v in defence.items()])
                    # the name holds what makes a run differ (a clean run without f-dependent options is one run)
                    fed = "" if args.clients == 10 else f"-c{args.clients}"
                    run_name = f"{tag}-{threat}-{len(bad)}liars{fed}{suffix}-a{args.alpha:g}-s{seed}"
                    if run_name in seen:
                        continue
                    seen.add(run_name)
                    per_round = args.per_round or args.clients
                    cfg = {**anchor_recipe(split, public, "mnist1d", seed, args.rounds, args.clients, per_round),
                           "head-round": False, **cell, "strategy": name, **opts, "output-dir": str(out / "runs"),
                           "run-name": run_name}
                    if threat == "absent":   # the oracle: the honest replies are the round (fedfuse's quorum is
                        cfg["min-train-nodes"] = per_round - len(bad)   # min-train-nodes)
                    jobs.append({"label": label, "threat": threat, "f": f, "seed": seed, "liars": bad,
                                 "clients": args.clients, "config": cfg})
    return jobs


def _cell(rows: list[dict], label: str, threat: str, f: int) -> list[dict]:
    return sorted((r for r in rows if r["label"] == label and r["threat"] == threat
                   and (r["f"] == f or (threat == "clean"
                                         and not defence_options(parse_strategy(label)[0], f, r.get("clients", 10))))),
                  key=lambda r: r["seed"])


def table(rows: list[dict]) -> str:
    clients = rows[0].get("clients", 10) if rows else 10
    labels = list(dict.fromkeys(r["label"] for r in rows))
    threats = list(dict.fromkeys(r["threat"] for r in rows))
    fs = sorted({r["f"] for r in rows if r["threat"] != "clean"}) or [1]
    lines = []
    for f in fs:
        lines += [f"## {f} of {clients} clients lying", "",
                  "Final test accuracy (mean ± sample std over seeds; `n` seeds); backdoor: attack success rate in "
                  "brackets; †k: in k runs the global model died (chance level) and fedfuse failed the run with an "
                  "error, as it does any run that trains itself to chance.", "",
                  "| threat | " + " | ".join(f"`{lab}`" for lab in labels) + " |",
                  "|---|" + "---|" * len(labels)]
        for threat in threats:
            cells = []
            for lab in labels:
                got = _cell(rows, lab, threat, f)
                if not got:
                    cells.append("—")
                    continue
                text = f"{format_mean_std([r['final'] for r in got], digits=3)} (n={len(got)})"
                dead = sum(1 for r in got if r.get("failed"))
                if dead:
                    text += f" †{dead}"
                if threat == "backdoor":
                    text += f" [{format_mean_std([r['attack-success'] for r in got], digits=2)}]"
                cells.append(text)
            lines.append(f"| {threat} | " + " | ".join(cells) + " |")
        lines.append("")
    screened = [r for r in rows if r.get("screened-rounds")]
    if screened:
        per_client = all("honest-client-rounds" in r for r in screened)
        lines += ["## The robust screen's decisions", "",
                  "| strategy | threat | liars | rounds screened | rounds an honest client was dropped | "
                  "rounds every liar was dropped |" + (" honest client-rounds dropped |" if per_client else ""),
                  "|---|---|---|---|---|---|" + ("---|" if per_client else "")]
        for (lab, threat, f) in dict.fromkeys((r["label"], r["threat"], r["f"] if r["threat"] != "clean" else 0)
                                              for r in screened):
            got = [r for r in screened if (r["label"], r["threat"]) == (lab, threat)
                   and (r["f"] == f or threat == "clean")]
            n = sum(r["screened-rounds"] for r in got)
            hcr = max(1, sum(r.get("honest-client-rounds", 0) for r in got))
            client_rate = (f" {100 * sum(r.get('honest-client-rounds-dropped', 0) for r in got) / hcr:.1f} % |"
                           if per_client else "")
            lines.append(f"| `{lab}` | {threat} | {f} | {n} | {100 * sum(r['honest-dropped'] for r in got) / n:.1f} % | "
                         + ("—" if threat == "clean" else f"{100 * sum(r['liars-dropped'] for r in got) / n:.1f} %")
                         + " |" + client_rate)
    lines += head_table(rows)
    seen = [r for r in screened if r.get("screen-seen")]
    if seen:
        lines += ["", "## What the screen saw (every round, before it decided)", "",
                  "Range over the rounds and seeds of each client's update cosine with the round's median update, "
                  "divided by the replies' median cosine (the screen drops below 0.4), and of its update norm over "
                  "the round's median (free riders below 0.1 are dropped, the rest shrunk to 2).", "",
                  "| threat | liars | honest: cosine / median | liars: cosine / median | honest: norm / median | "
                  "liars: norm / median |", "|---|---|---|---|---|---|"]
        for (threat, f) in dict.fromkeys((r["threat"], r["f"] if r["threat"] != "clean" else 0) for r in seen):
            got = [r["screen-seen"] for r in seen if r["threat"] == threat and (r["f"] == f or threat == "clean")]

            def span(key: str) -> str:
                vals = [v for g in got if g.get(key) for v in g[key]]
                return f"{min(vals):.2f} – {max(vals):.2f}" if vals else "—"
            lines.append(f"| {threat} | {f} | {span('cos-honest')} | {span('cos-liar')} | {span('norm-honest')} | "
                         f"{span('norm-liar')} |")
    return "\n".join(lines) + "\n"


def head_table(rows: list[dict]) -> list[str]:
    """``--head-round``: the model before the head round and after it, how often the solved head was kept, and which
    statistics the head round dropped (liars' / honest nodes', by the liars' node ids the attack saw)."""
    headed = [r for r in rows if r.get("head")]
    if not headed:
        return []
    lines = ["", "## The head round", "",
             "Test accuracy before the head round (the last training round's model) and after it, mean ± sample std "
             "over seeds; the solved head kept in k of n runs; head statistics dropped (the robust setting's class-"
             "mean screen) of the liars and of the honest nodes, over the runs; class-mean scores (the screen drops "
             "above its threshold) of the honest nodes and of the liars.", "",
             "| strategy | threat | liars | before | after | head kept | liars' statistics dropped | honest dropped | "
             "honest scores | liars' scores |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (lab, threat, f) in dict.fromkeys((r["label"], r["threat"], r["f"] if r["threat"] != "clean" else 0)
                                          for r in headed):
        got = [r for r in headed if (r["label"], r["threat"]) == (lab, threat) and (r["f"] == f or threat == "clean")]
        liar_drops = honest_drops = liar_total = honest_total = 0
        scores: dict[str, list[float]] = {"honest": [], "liar": []}
        for r in got:
            h = r["head"]
            liars_seen = {str(n) for n in h.get("liar-nodes", [])}
            seen = {n: v for n, v in (h.get("class-mean-scores") or {}).items() if v is not None}
            dropped = {n for n, v in seen.items() if v > CLASS_MEAN_THRESHOLD}   # the screen's rule
            liar_total += len(liars_seen & set(seen))
            honest_total += len(set(seen) - liars_seen)
            liar_drops += len(dropped & liars_seen)
            honest_drops += len(dropped - liars_seen)
            for node, v in seen.items():
                scores["liar" if node in liars_seen else "honest"].append(v)

        def span(vals: list[float]) -> str:
            return f"{min(vals):.2f} – {max(vals):.2f}" if vals else "—"
        kept = sum(1 for r in got if r["head"]["kept"] == "head")
        lines.append(f"| `{lab}` | {threat} | {f} | {format_mean_std([r['before-head'] for r in got], digits=3)} | "
                     f"{format_mean_std([r['final'] for r in got], digits=3)} | {kept} of {len(got)} | "
                     + (f"{liar_drops} of {liar_total}" if liar_total else "—") + " | "
                     + (f"{honest_drops} of {honest_total}" if honest_total else "—")
                     + f" | {span(scores['honest'])} | {span(scores['liar'])} |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    """One panel per number of liars: grouped bars (threat × strategy) of final accuracy, mean ± sample std."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simulations.bench.stats import mean_std

    labels = [lab for lab in dict.fromkeys(r["label"] for r in rows) if parse_strategy(lab)[0] not in SCORE_READERS]
    threats = [t for t in dict.fromkeys(r["threat"] for r in rows) if t not in SCORE_THREATS]
    fs = sorted({r["f"] for r in rows if r["threat"] != "clean"}) or [1]
    fig, axes = plt.subplots(len(fs), 1, figsize=(1.3 * len(threats) * len(labels) / 4 + 3, 3.2 * len(fs)),
                             squeeze=False)
    width = 0.8 / len(labels)
    for ax, f in zip(axes[:, 0], fs):
        for j, lab in enumerate(labels):
            stats = [mean_std([r["final"] for r in _cell(rows, lab, t, f)]) for t in threats]
            ax.bar([i + j * width for i in range(len(threats))], [100 * m if n else 0 for m, _, n in stats],
                   width, yerr=[100 * sd if n > 1 else 0 for _, sd, n in stats], label=lab, capsize=2)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(threats))], threats, fontsize=8)
        ax.set_ylabel("final test accuracy (%)")
        ax.set_title(f"{f} of {rows[0].get('clients', 10)} clients lying (clean: nobody lies)", fontsize=9)
        ax.legend(fontsize=6, ncol=len(labels), loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default=STRATEGIES)
    ap.add_argument("--threats", default=THREATS)
    ap.add_argument("--liars", default="1,3", help="numbers of lying clients (of --clients)")
    ap.add_argument("--clients", type=int, default=10, help="clients in the federation (10: the anchors' splits)")
    ap.add_argument("--splits", help="folder of anchor_splits output (mnist1d-c<K>-a<α>-s<seed>) for --clients != 10")
    ap.add_argument("--per-round", type=int, default=0, help="clients sampled per round (0: all)")
    ap.add_argument("--mode", default="multi-round", choices=("multi-round", "one-shot"))
    ap.add_argument("--local-epochs", type=int, help="local epochs (default: the anchor recipe's 1)")
    ap.add_argument("--lr", type=float, help="client lr (default: the anchor recipe's 0.2)")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--head-round", action="store_true", help="end every run with the head round (its statistics and "
                    "check face the query threats lie-head / lie-votes; the default is head-round=false)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--anchors", default=str(ANCHORS))
    ap.add_argument("--out", default="results/trust")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--summary", action="store_true", help="only rebuild table.md from runs.json")
    args = ap.parse_args(argv)
    if args.clients != 10 and not args.splits:
        ap.error("--clients other than 10 needs --splits (made by simulations.bench.anchor_splits)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summary:
        rows = json.loads((out / "runs.json").read_text())
    else:
        jobs = jobs_for(args)
        rows = []
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for row in pool.map(_run, jobs):
                rows.append(row)
                print(f"{row['label']:>22} {row['threat']:>14} f={row['f']} s{row['seed']}: final {row['final']:.3f}"
                      + (f" ASR {row['attack-success']:.2f}" if "attack-success" in row else ""), flush=True)
        previous = json.loads((out / "runs.json").read_text()) if (out / "runs.json").exists() else []
        done = {(r["label"], r["threat"], r["f"], r["seed"]) for r in rows}
        rows = [r for r in previous if (r["label"], r["threat"], r["f"], r["seed"]) not in done] + rows
        (out / "runs.json").write_text(json.dumps(rows, indent=1))
    text = table(rows)
    clients = rows[0].get("clients", 10) if rows else 10
    mode = ", one-shot" if rows and rows[0].get("one-shot") else ""
    (out / "table.md").write_text(f"# Lying clients on stock Flower's MNIST-1D splits (α = 0.5, {clients} clients{mode})\n\n"
                                  "Command: see the module docstring of `simulations/bench/trust.py`.\n\n" + text)
    plot(rows, out / "accuracy.png")
    print(text)


if __name__ == "__main__":
    main()
