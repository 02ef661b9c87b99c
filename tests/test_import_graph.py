"""The product's import graph (issue 46): no cycle among fedfuse modules, counting the imports made inside functions
too, and a function-level import of a fedfuse module only where it defers something heavy or optional, with its
reason written beside it (``deferred: ...`` in its comment)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fedfuse"
MAX_FUNCTION_LEVEL = 15


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _resolve(target: str, mods: dict[str, Path]) -> str | None:
    while target and target not in mods:
        target = target.rsplit(".", 1)[0] if "." in target else ""
    return target or None


def _imports(mods: dict[str, Path]):
    """``(module, line, imported fedfuse module, inside a function, the line's text)`` for every import of a fedfuse
    module (``TYPE_CHECKING`` blocks left out: they never run)."""
    for name, path in mods.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedfuse"):
                targets = [_resolve(f"{node.module}.{a.name}", mods) for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [_resolve(a.name, mods) for a in node.names if a.name.startswith("fedfuse")]
            else:
                continue
            chain, up = [], node
            while up in parents:
                up = parents[up]
                chain.append(up)
            if any(isinstance(c, ast.If) and "TYPE_CHECKING" in ast.unparse(c.test) for c in chain):
                continue
            inner = any(isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)) for c in chain)
            for target in {t for t in targets if t and t != name}:
                yield name, node.lineno, target, inner, lines[node.lineno - 1]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_fedfuse_modules_counting_function_level_imports():
    mods = _modules()
    edges: dict[str, set[str]] = {}
    for name, _, target, _, _ in _imports(mods):
        edges.setdefault(name, set()).add(target)
    assert _cycles(edges) == []


def test_function_level_imports_are_few_and_say_why():
    inner = [(name, line, text.strip()) for name, line, _, is_inner, text in _imports(_modules()) if is_inner]
    assert len({(n, ln) for n, ln, _ in inner}) <= MAX_FUNCTION_LEVEL, inner
    assert [i for i in inner if "deferred:" not in i[2]] == []


def test_the_scan_sees_a_hidden_cycle(tmp_path):
    """The scan is not blind: a cycle closed by an import inside a function is found, and that import is inner."""
    (tmp_path / "a.py").write_text("from fedfuse.b import g\n")
    (tmp_path / "b.py").write_text("def g():\n    from fedfuse.a import f  # deferred: test\n")
    mods = {"fedfuse.a": tmp_path / "a.py", "fedfuse.b": tmp_path / "b.py"}
    found = list(_imports(mods))
    assert sorted((n, t, inner) for n, _, t, inner, _ in found) == [("fedfuse.a", "fedfuse.b", False),
                                                                     ("fedfuse.b", "fedfuse.a", True)]
    assert _cycles({n: {t} for n, _, t, _, _ in found}) == [["fedfuse.a", "fedfuse.b"]]
