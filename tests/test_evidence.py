"""The evidence the documentation cites is in the repository, and the repository stays small.

Every ``results/...`` path that README.md, docs/*.md or the experiments' README.md cite in their prose (links, images,
inline paths; brace lists ``{a,b}`` and globs ``*`` expanded against the tracked files) is tracked. Paths in code
blocks and after a command-line option (``--out results/x``: where a rerun writes) are outputs, not citations;
``results/cache/`` is the local client cache, never tracked. The tracked files together stay under 20 MB
(``scripts/results_index.py`` stores the tracked JSON compact; raw run folders are ignored)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.layout import EXPERIMENTS

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *(f"{e}/README.md" for e in EXPERIMENTS), "docs/*.md"]
MAX_TRACKED_BYTES = 20 * 1000 * 1000

needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                               reason="needs a git checkout")


def _tracked() -> list[str]:
    res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in res.stdout.split("\0") if f]


def _pages() -> list[Path]:
    return sorted({p for pattern in PAGES for p in ROOT.glob(pattern)})


def _braces(path: str) -> list[str]:
    """``a/{x,y}/b`` -> ``a/x/b``, ``a/y/b`` (nested lists too)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _braces(path[:m.start()] + alt + path[m.end():])]


def cited_paths(text: str) -> set[str]:
    """The ``results/...`` paths a page cites in its prose (see the module docstring for what is left out)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found = set()
    for m in re.finditer(r"(?<![\w.-])(?:\.\./|\./)?(results/[A-Za-z0-9_.*{},/<>+-]+)", prose):
        if m.group(0).startswith("./") or (m.start() > 0 and prose[m.start() - 1] == "/"):
            continue  # ./results/<run-name> (a run's own folder) or some other tree's results/
        if re.search(r"--[\w-]+[ =]$", prose[max(0, m.start() - 40):m.start()]):
            continue  # --out results/x: where a command writes
        path = m.group(1).rstrip(".,;:)")
        if path.startswith("results/cache/") or "<" in path:
            continue
        found.add(path)
    return found


def missing_citations(pages: list[Path], tracked: list[str]) -> list[tuple[str, str]]:
    tracked_set = set(tracked)
    missing = []
    for page in pages:
        for cited in sorted(cited_paths(page.read_text(encoding="utf-8"))):
            for path in _braces(cited):
                path = path.rstrip("/")
                if "*" in path:
                    ok = any(fnmatch.fnmatch(f, path) or fnmatch.fnmatch(f, path + "/*") for f in tracked)
                else:
                    ok = path in tracked_set or any(f.startswith(path + "/") for f in tracked)
                if not ok:
                    missing.append((str(page.relative_to(ROOT)), path))
    return missing


def test_citation_parser_keeps_citations_and_skips_outputs():
    text = ("table `results/anchor/table.md`, ![plot](../results/anchor-regime.png), cells "
            "`results/depth-tiers-c20-lr{0.05,0.1}/`, `results/anchor-e*/`; a run writes `./results/<run-name>/`,\n"
            "`--out results/mine`, clients under `results/cache/seed000`\n```\npython x.py --out results/other\n"
            "cat results/in-a-code-block/table.md\n```\n")
    assert cited_paths(text) == {"results/anchor/table.md", "results/anchor-regime.png",
                                 "results/depth-tiers-c20-lr{0.05,0.1}/", "results/anchor-e*/"}
    assert _braces("results/a{1,2}/{x,y}.json") == ["results/a1/x.json", "results/a1/y.json",
                                                    "results/a2/x.json", "results/a2/y.json"]
    tracked = ["results/anchor/table.md", "results/anchor-e5/table.md"]
    page = ROOT / "README.md"
    assert missing_citations([], tracked) == []
    assert ("README.md", "results/anchor-e*") not in missing_citations([page], tracked + ["results/anchor-e1/x"])


@needs_git
def test_every_results_path_the_docs_cite_is_tracked():
    pages = _pages()
    assert EXPERIMENTS and {"README.md", *(f"{e}/README.md" for e in EXPERIMENTS), "docs/results.md"} <= {
        str(p.relative_to(ROOT)) for p in pages}
    assert sum(len(cited_paths(p.read_text(encoding="utf-8"))) for p in pages) > 100  # the parser sees the citations
    assert missing_citations(pages, _tracked()) == []


@needs_git
def test_tracked_files_stay_under_20_mb():
    sizes = {f: (ROOT / f).stat().st_size for f in _tracked() if (ROOT / f).is_file() and not (ROOT / f).is_symlink()}
    total = sum(sizes.values())
    biggest = sorted(sizes, key=sizes.get)[-5:]
    assert total <= MAX_TRACKED_BYTES, f"{total} bytes tracked; biggest: {[(f, sizes[f]) for f in biggest]}"
