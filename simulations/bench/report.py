"""The one-shot report: summary of cell rows, ``table.md``, ``accuracy.png`` and ``results.json``.

Tables: test accuracy, gap recovery = (fused − best base) / (ensemble − best base), federated validation
accuracy, validation-selected options, the validation-selected choice across methods (the ``auto`` row),
an optional comparison to a reference method (accuracy difference and time ratio per seed), fusion wall
time as ratios to ``average`` and to one client's local training. Spread is the sample std (ddof = 1)
over seeds, stated in the table.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import Any

from simulations.bench.plots import accuracy_bars
from simulations.bench.stats import STD_PHRASE, format_mean_std, mean, std_note
from simulations.bench.tables import write_json

Key = tuple[str, str]  # (row label, setting)
AUTO = "auto"  # the row of the validation-selected candidate across all methods and variants


def setting_of(r: dict) -> str:
    return f"{r['dataset']}/{r['partition']}/{r['model']}"


def row_label(r: dict) -> str:
    """Table row of a result row: the method spec, plus the importance scores and where they came from."""
    if not r["importance"]:
        return r["method"]
    src = "" if r["score_source"] in ("client", "") else ", server"
    return f"{r['method']} ({r['importance'][:4]}{src})"


def auto_candidate(r: dict) -> bool:
    """A row ``auto`` may choose: a single fused model (every method and variant, refined or not) that ran
    and has a federated validation accuracy. Not the clients themselves, not the ensemble (several
    models), not ``fused_width`` variants (another model size)."""
    va = r.get("val_accuracy")
    return (r["status"] == "ok" and va is not None and va == va and r["method"] not in ("best-base", "ensemble", AUTO)
            and not r["method"].startswith("base-") and "fused_width" not in r["method"])


def auto_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``auto`` row per (setting, seed): the candidate (``auto_candidate``) with the highest federated
    validation accuracy of that seed (the first in run order on ties), never the test split; its test
    accuracy is the row's. ``fuse_seconds`` is the sum over all candidates (auto runs them all);
    ``auto_choice`` names the chosen row, ``auto_candidates`` counts them."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["method"] != AUTO:
            cells.setdefault((setting_of(r), r["seed"]), []).append(r)
    out = []
    for cell in cells.values():
        cands = [r for r in cell if auto_candidate(r)]
        if not cands:
            continue
        best = max(cands, key=lambda r: r["val_accuracy"])  # max keeps the first of equal values
        out.append({**best, "method": AUTO, "importance": "", "score_source": "", "fusion_info": {},
                    "fuse_seconds": sum(r["fuse_seconds"] for r in cands), "auto_choice": row_label(best),
                    "auto_candidates": len(cands)})
    return out


def with_auto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with their ``auto`` rows recomputed (earlier ones, e.g. from ``--merge``, dropped)."""
    plain = [r for r in rows if r["method"] != AUTO]
    return plain + auto_rows(plain)


def auto_report(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """Markdown: per setting, the ``auto`` row's test accuracy and gap recovery and its choice per seed."""
    autos = [r for r in rows if r["method"] == AUTO]
    if not autos:
        return ""
    out = ["\n## Validation-selected across methods (`auto`): per seed, the fused candidate (every method × "
           "importance × refine variant; not the clients, not the ensemble) with the highest federated "
           "validation accuracy; test accuracy %; gap recovery as mean of per-seed ratios / ratio of the means\n",
           "| setting | test acc | gap recovery | candidates | chosen per seed (test acc %) |\n|---|---|---|---|---|\n"]
    for st in summary["settings"]:
        sel = sorted((r for r in autos if setting_of(r) == st), key=lambda r: r["seed"])
        if not sel:
            continue
        accs = summary["acc"][(AUTO, st)]
        ens, best = summary["acc"].get(("ensemble", st)), summary["acc"].get(("best-base", st))
        ratio = ((mean(accs) - mean(best)) / (mean(ens) - mean(best))
                 if ens and best and mean(ens) - mean(best) > 1e-9 else float("nan"))
        gaps = summary["gap"][(AUTO, st)]
        chosen = "; ".join(f"s{r['seed']}: {r['auto_choice']} ({100 * r['accuracy']:.1f})" for r in sel)
        out.append(f"| {st} | {format_mean_std(accs, 100.0)} | {format_mean_std(gaps, 100.0, 0)} / {100 * ratio:.0f} "
                   f"| {max(r['auto_candidates'] for r in sel)} | {chosen} |\n")
    return "".join(out)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (row label, setting): accuracy, validation accuracy, gap recovery and time ratios (one value
    per seed), plus the first non-ok status."""
    settings = sorted({setting_of(r) for r in rows})
    order: list[str] = []
    for r in rows:
        lab = row_label(r)
        if lab not in order and not r["method"].startswith("base-"):
            order.append(lab)
    acc: dict[Key, list[float]] = {}
    vacc: dict[Key, list[float]] = {}
    gap: dict[Key, list[float]] = {}
    t_avg: dict[Key, list[float]] = {}
    t_cli: dict[Key, list[float]] = {}
    status: dict[Key, str] = {}
    by_cell: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_cell.setdefault((setting_of(r), r["seed"]), {})[row_label(r)] = r
    nan = float("nan")
    for (st, _seed), cell in by_cell.items():
        best = cell.get("best-base", {}).get("accuracy", nan)
        ens = cell.get("ensemble", {}).get("accuracy", nan)
        avg_t = cell.get("average", {}).get("fuse_seconds", nan)
        for lab, r in cell.items():
            if lab.startswith("base-"):
                continue
            a = r["accuracy"]
            acc.setdefault((lab, st), []).append(a)
            if lab != "best-base":
                vacc.setdefault((lab, st), []).append(r.get("val_accuracy", nan))
            gap.setdefault((lab, st), []).append((a - best) / (ens - best) if ens - best > 1e-9 else nan)
            t_avg.setdefault((lab, st), []).append(r["fuse_seconds"] / avg_t if avg_t and avg_t > 0 else nan)
            t_cli.setdefault((lab, st), []).append(r["fuse_seconds"] / r["client_train_seconds"]
                                                   if r["client_train_seconds"] > 0 else nan)
            if r["status"] != "ok":
                status[(lab, st)] = r["status"]
    if "best-base" in order:  # best base by federated validation accuracy: the max over the bases
        for (st, _seed), cell in by_cell.items():
            vb = [r.get("val_accuracy", nan) for lab, r in cell.items() if lab.startswith("base-")]
            if "best-base" in cell:
                vacc.setdefault(("best-base", st), []).append(max(vb) if vb and all(v == v for v in vb) else nan)
    return dict(settings=settings, order=order, acc=acc, vacc=vacc, gap=gap, t_avg=t_avg, t_cli=t_cli, status=status)


def validation_selected(summary: dict[str, Any]) -> dict[Key, str]:
    """``{(family, setting): row label}``: per method family (name without options, plus the score
    marker) the variant with the highest mean federated validation accuracy; families with a single
    variant and variants with ``fused_width`` (another model size) are skipped."""
    fams: dict[Key, list[str]] = {}
    for lab in summary["order"]:
        if lab in ("best-base", "ensemble") or "fused_width" in lab:
            continue
        fam = re.sub(r"\[.*\]", "", lab)
        for st in summary["settings"]:
            if (lab, st) in summary["vacc"]:
                fams.setdefault((fam, st), []).append(lab)
    out = {}
    for key, labs in fams.items():
        scored = [(mean(summary["vacc"][(lab, key[1])]), lab) for lab in labs
                  if any(v == v for v in summary["vacc"][(lab, key[1])])]
        if len(scored) > 1:
            out[key] = max(scored)[1]
    return out


def compare_to(rows: list[dict[str, Any]], reference: str) -> str:
    """Markdown: per setting and method, accuracy − ``reference`` (points) and fusion time / reference,
    both per seed, then mean ± sample std over the seeds where both ran."""
    key = lambda r: (setting_of(r), r["seed"])  # noqa: E731
    ref = {key(r): r for r in rows if row_label(r) == reference and r["status"] == "ok"}
    lines = [f"\n## Compared with `{reference}` (per seed, then {STD_PHRASE} over the seeds where both ran)\n",
             f"| setting | method | seeds | accuracy − {reference} (points) | fusion time / {reference} |\n",
             "|---|---|---|---|---|\n"]
    labels = list(dict.fromkeys(row_label(r) for r in rows if not r["method"].startswith(("base-", "best-base"))))
    if not ref:
        lines.append(f"| (no row `{reference}` with status ok: the reference must be one of the row labels "
                     f"{labels}) | | | | |\n")
        print(f"WARNING: --compare-to {reference!r}: no ok rows with that label; row labels: {labels}", flush=True)
    for st in sorted({setting_of(r) for r in rows}):
        for lab in labels:
            if lab in (reference, "ensemble"):
                continue
            sel = [r for r in rows if setting_of(r) == st and row_label(r) == lab and r["status"] == "ok"
                   and key(r) in ref]
            if not sel:
                continue
            d = [r["accuracy"] - ref[key(r)]["accuracy"] for r in sel]
            t = [r["fuse_seconds"] / ref[key(r)]["fuse_seconds"] for r in sel if ref[key(r)]["fuse_seconds"] > 0]
            lines.append(f"| {st} | {lab} | {len(sel)} | {format_mean_std(d, 100.0, 1)} | "
                         f"{format_mean_std(t, 1.0, 2)} |\n")
    return "".join(lines)


def markdown_report(rows: list[dict[str, Any]], title: str = "One-shot fusion", reference: str = "") -> str:
    """The one-shot ``table.md`` (``auto`` rows are (re)computed here)."""
    rows = with_auto(rows)
    s = summarise(rows)
    settings, order = s["settings"], s["order"]
    seeds = sorted({r["seed"] for r in rows})
    head = "| method | " + " | ".join(settings) + " |\n|---|" + "---|" * len(settings) + "\n"
    out = [f"# {title}\n", f"Test accuracy (%), {std_note(len(seeds))} {seeds}. Scores: client-side "
           "(each client on its own validation split) unless marked `server` (the server on its fusion set). "
           "n/a = the method raised ValueError (reason below).\n", "## Accuracy\n", head]

    def cell(d, lab, st, scale=100.0, digits=1):
        if (lab, st) not in d:
            return ""
        if all(v != v for v in d[(lab, st)]):
            return "n/a"
        return format_mean_std(d[(lab, st)], scale, digits)

    for lab in order:
        out.append(f"| {lab} | " + " | ".join(cell(s["acc"], lab, st) for st in settings) + " |\n")
    out += ["\n## Gap recovery = (fused − best base) / (ensemble − best base), %\n", head]
    for lab in order:
        if lab in ("best-base", "ensemble"):
            continue
        out.append(f"| {lab} | " + " | ".join(cell(s["gap"], lab, st, 100.0, 0) for st in settings) + " |\n")
    if any(v == v for vals in s["vacc"].values() for v in vals):
        out += ["\n## Federated validation accuracy (%, the union of the clients' validation splits; "
                "the selection criterion for method options)\n", head]
        for lab in order:
            out.append(f"| {lab} | " + " | ".join(cell(s["vacc"], lab, st) for st in settings) + " |\n")
    sel = validation_selected(s)
    if sel:
        out += ["\n## Validation-selected options (per method family and setting: the variant with the highest mean "
                "federated validation accuracy; variants with another `fused_width` are a different model size "
                "and are not candidates). Test accuracy %; gap recovery as mean of per-seed ratios / ratio of "
                "the means\n", "| method family | setting | chosen variant | test acc | gap recovery |\n"
                "|---|---|---|---|---|\n"]
        for (fam, st), lab in sorted(sel.items()):
            accs, ens = s["acc"][(lab, st)], s["acc"].get(("ensemble", st))
            best = s["acc"].get(("best-base", st))
            ratio = ((mean(accs) - mean(best)) / (mean(ens) - mean(best))
                     if ens and best and mean(ens) - mean(best) > 1e-9 else float("nan"))
            out.append(f"| {fam} | {st} | {lab} | {format_mean_std(accs, 100.0)} | "
                       f"{cell(s['gap'], lab, st, 100.0, 0)} / {100 * ratio:.0f} |\n")
    out.append(auto_report(rows, s))
    if reference:
        out.append(compare_to(rows, reference))
    out += ["\n## Fusion wall time: × `average` / × one client's local training (means over seeds)\n", head]
    for lab in order:
        if lab == "best-base":
            continue
        vals = []
        for st in settings:
            a, c = s["t_avg"].get((lab, st)), s["t_cli"].get((lab, st))
            if a is None:
                vals.append("")
                continue
            ma = mean(a)
            vals.append("n/a" if ma != ma else f"{ma:.3g}× / {mean(c):.3g}×")
        out.append(f"| {lab} | " + " | ".join(vals) + " |\n")
    tr: dict[str, list[float]] = {}
    avg_secs: dict[str, list[float]] = {}
    for r in rows:
        if r["method"] == "best-base":
            tr.setdefault(setting_of(r), []).append(r["client_train_seconds"])
        if r["method"] == "average":
            avg_secs.setdefault(setting_of(r), []).append(r["fuse_seconds"])
    out.append("\nOne client's local training (s, mean over clients and seeds): "
               + ", ".join(f"{st} {mean(v):.2f}" for st, v in sorted(tr.items())) + "\n")
    out.append("\n`average` wall time (s): " + ", ".join(f"{st} {mean(v):.4f}" for st, v in sorted(avg_secs.items()))
               + "\n")
    if s["status"]:
        out.append("\n## n/a and errors\n")
        seen = set()
        for (lab, st), msg in sorted(s["status"].items()):
            if (lab, msg) not in seen:
                seen.add((lab, msg))
                out.append(f"- {lab} @ {st}: {msg}\n")
    return "".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    s = summarise(with_auto(rows))
    accuracy_bars(s["acc"], s["settings"], s["order"], path)


def write_results(rows: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    """``results.json`` (every raw row + the invocation), ``table.md``, ``accuracy.png``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json({"meta": meta, "rows": rows, "auto": auto_rows(rows)}, out / "results.json")
    (out / "table.md").write_text(markdown_report(rows, title=meta.get("title", "One-shot fusion"),
                                                  reference=meta.get("reference", "")))
    try:
        plot(rows, out / "accuracy.png")
    except Exception:  # noqa: BLE001 - a plotting problem must not lose the numbers; the traceback is printed
        traceback.print_exc()
