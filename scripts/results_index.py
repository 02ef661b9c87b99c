"""Write results/INDEX.md: every tracked evidence folder under results/, what it holds and the pages citing it;
and store every tracked ``results/**/*.json`` compact (no indentation: the same JSON value, parsed back identical),
which keeps the tracked files under the 20 MB that ``tests/test_evidence.py`` checks.

    python scripts/results_index.py            # run it after `git add -f` / `git rm --cached` under results/
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAD = """# results/: the tracked evidence

Run and benchmark outputs are written under `results/` and ignored (`.gitignore`); what the documentation cites is
tracked here: tables (`*.md`), per-seed and per-run JSON (stored compact, one line: the same values), the plots a
page shows, and a few logs of GPU runs a page cites. Raw run folders (`rounds.csv`, `run.log`, models, checkpoints),
plots no page shows, and the raw sweeps of folders no page cites (their tables stay) are not tracked; all tracked
files together stay under 20 MB, and every `results/` path a page cites exists (`tests/test_evidence.py`). Each line:
a folder (or file), what it holds, and the pages citing it. This index is written by
`python scripts/results_index.py`; a new piece of evidence gets its folder re-included in `.gitignore` and a line here.

| evidence | files | cited by |
|---|---|---|
"""
# One-off studies whose scripts are archived (issue 58 item 6): the evidence stays, the script is read from the last
# commit that holds it (docs/benchmarks.md, "Archived one-off studies"). Evidence folder -> the study's module.
ARCHIVE_COMMIT = "042255d2519935280900c926e9d58dadc5adb28e"
ARCHIVED = {
    "results/one_shot/issue27-diag": "dirichlet4_diagnosis",
    "results/score-inflation": "score_inflation",
    "results/seed000": "seed000",
}
ARCHIVED_WITHOUT_EVIDENCE = ("multiround_inprocess",)   # printed its diagnosis, tracked nothing


def _key(path: str) -> str:
    """The evidence unit of a tracked file: ``results/one_shot/<name>`` (a bench writes new subfolders there),
    ``results/<folder>`` otherwise, or the file itself at the top of results/."""
    parts = path.split("/")
    if parts[1] == "one_shot" and len(parts) > 3:
        return "/".join(parts[:3])
    return "/".join(parts[:2]) if len(parts) > 2 else path


def _cites(key: str, texts: dict[str, str]) -> list[str]:
    """Pages naming ``key``'s path, or a glob / brace pattern over it (``results/anchor-head-e*/``)."""
    rel = key.split("/", 1)[1]
    out = []
    for page, text in texts.items():
        if key in text:
            out.append(page)
            continue
        for ref in re.findall(r"results/[A-Za-z0-9_.*{},/-]+", text):
            pat = "/".join(ref.split("/")[1:1 + rel.count("/") + 1])
            rx = "^" + re.escape(pat).replace(r"\*", ".*").replace(r"\{", "(").replace(r"\}", ")").replace(",", "|") + "$"
            try:
                if re.match(rx, rel):
                    out.append(page)
                    break
            except re.error:
                continue
    return sorted(set(out))


def compact_json(paths: list[str]) -> int:
    """Rewrite each JSON file without indentation (same value: keys in order, floats as Python wrote them);
    bytes saved. A file that does not parse is left as it is."""
    saved = 0
    for rel in paths:
        path = ROOT / rel
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        try:
            value = json.loads(text)
        except ValueError:
            continue
        compact = json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n"
        if compact != text:
            path.write_text(compact, encoding="utf-8")
            saved += len(text.encode()) - len(compact.encode())
    return saved


def main() -> None:
    tracked = subprocess.run(["git", "ls-files", "--cached"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    saved = compact_json([f for f in tracked if f.startswith("results/") and f.endswith(".json")])
    if saved:
        print(f"results_index: tracked results JSON stored compact, {saved} bytes fewer")
    pages = [f for f in tracked if f.endswith(".md") and not f.startswith(("results/", "tests/"))]
    texts = {p: (ROOT / p).read_text(encoding="utf-8") for p in pages}
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for f in tracked:
        if f.startswith("results/") and f != "results/INDEX.md":
            groups[_key(f)].append(f)
    rows = []
    for key in sorted(groups):
        kinds = collections.Counter(f.rsplit(".", 1)[-1] for f in groups[key])
        cited = _cites(key, texts)
        where = ", ".join(f"[{p}](../{p})" for p in cited) if cited else \
            f"cited by no page (measured history; `git log -- {key}`)"
        if key in ARCHIVED:
            where += f"; archived study: `git show {ARCHIVE_COMMIT[:12]}:simulations/bench/{ARCHIVED[key]}.py`"
        rows.append(f"| `{key}` | {len(groups[key])} ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}) | "
                    f"{where} |")
    (ROOT / "results" / "INDEX.md").write_text(HEAD + "\n".join(rows) + "\n" + archived_section())


def archived_section() -> str:
    """The archived one-off studies: each script at the commit that last holds it, and how to rerun it."""
    studies = sorted({*ARCHIVED.values(), *ARCHIVED_WITHOUT_EVIDENCE})
    lines = [f"\n## Archived one-off studies\n\nTheir scripts are not in the tree any more; each is read from commit "
             f"`{ARCHIVE_COMMIT}`, the last that holds it. To rerun one, put it back beside the harness and run it "
             f"as before (commands: [docs/benchmarks.md](../docs/benchmarks.md#archived-one-off-studies)):\n",
             "| study | evidence | rerun |", "|---|---|---|"]
    for name in studies:
        evidence = ", ".join(f"`{k}`" for k, v in sorted(ARCHIVED.items()) if v == name) or "none tracked"
        lines.append(f"| `simulations/bench/{name}.py` | {evidence} | `git show {ARCHIVE_COMMIT[:12]}:simulations/bench/"
                     f"{name}.py > simulations/bench/{name}.py && .venv/bin/python -m simulations.bench.{name} --help` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
