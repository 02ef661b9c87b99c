"""Collect the split FS-Merge runs (issue #5) into the final tables.

    python -m simulations.fs_merge_collect

- one-shot runner: rows of results/one_shot/fs_merge_mlp_refs_* (average, ensemble, kd, kf-linear) and of
  results/one_shot/fs_merge_mlp_fsm_* (fs-merge, fs-merge-seq; their duplicate reference rows dropped) →
  results/one_shot/fs_merge_mlp/{results.json,table.md} plus fs-merge time / kd time per cell.
- low-data sweep: results/fs_merge/mlp_v2_*/rows.jsonl → results/fs_merge/mlp_v2/{rows.jsonl,summary.md}.
"""
from __future__ import annotations

import glob
import json
import statistics
from pathlib import Path

from simulations.fs_merge_benchmark import summarise
from simulations.oneshot_lib import load_rows, write_results


def main() -> None:
    rows = []
    for f in sorted(glob.glob("results/one_shot/fs_merge_mlp_refs_*/results.json")):
        rows += load_rows(Path(f))
    seen = set()
    for f in sorted(glob.glob("results/one_shot/fs_merge_mlp_fsm_*/results.json")):
        for r in load_rows(Path(f)):
            k = (r["dataset"], r["partition"], r["seed"], r["method"])
            if r["method"].startswith("fs-merge") and k not in seen:
                seen.add(k)
                rows.append(r)
    out = Path("results/one_shot/fs_merge_mlp")
    write_results(rows, out, {"title": "One-shot fusion, MLP: FS-Merge vs references (fusion set 300 from client 0)",
                              "argv": "merged by simulations.fs_merge_collect"})
    kd = {(r["dataset"], r["partition"], r["seed"]): r for r in rows if r["method"] == "kd"}
    lines = ["| setting | method | seeds | acc − kd (pp) | time / kd |", "|---|---|---|---|---|"]
    for st in sorted({(r["dataset"], r["partition"]) for r in rows}):
        for m in ("fs-merge", "fs-merge-seq", "kf-linear"):
            sel = [r for r in rows if (r["dataset"], r["partition"]) == st and r["method"] == m
                   and (r["dataset"], r["partition"], r["seed"]) in kd and r.get("status") == "ok"]
            if not sel:
                continue
            d = [100 * (r["accuracy"] - kd[(r["dataset"], r["partition"], r["seed"])]["accuracy"]) for r in sel]
            t = [r["fuse_seconds"] / kd[(r["dataset"], r["partition"], r["seed"])]["fuse_seconds"] for r in sel]
            sd = lambda v: f" ± {statistics.stdev(v):.1f}" if len(v) > 1 else ""  # noqa: E731
            lines.append(f"| {st[0]}/{st[1]} | {m} | {len(sel)} | {statistics.mean(d):+.1f}{sd(d)} | "
                         f"{statistics.mean(t):.1f}{sd(t)} |")
    (out / "vs_kd.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sw = []
    for f in sorted(glob.glob("results/fs_merge/mlp_v2_*/rows.jsonl")):
        sw += [json.loads(x) for x in Path(f).read_text().splitlines() if x.strip()]
    o2 = Path("results/fs_merge/mlp_v2")
    o2.mkdir(parents=True, exist_ok=True)
    (o2 / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sw))
    print(summarise(sw, o2))
    vit = Path("results/fs_merge/vit_v2/rows.jsonl")
    if vit.exists():
        print(summarise([json.loads(x) for x in vit.read_text().splitlines() if x.strip()], vit.parent))


if __name__ == "__main__":
    main()
