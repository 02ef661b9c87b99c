"""Markdown tables and JSON rows: how every benchmark writes what it measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table (``|``-separated), one line per row, ending with a newline."""
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"markdown_table: row has {len(cells)} cells for {len(header)} columns: {cells}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def jsonable(v: Any) -> Any:
    """NaN → ``None``; tensors → lists; tuples → lists; other objects → ``str`` (JSON-safe rows)."""
    if isinstance(v, float):
        return None if v != v else v
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if hasattr(v, "tolist"):  # torch / numpy values
        return jsonable(v.tolist())
    return str(v)


def write_json(obj: Any, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(obj), indent=1))


NUMERIC_KEYS = ("accuracy", "loss", "fuse_seconds", "val_accuracy")


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``results.json`` written by ``report.write_results`` (``None`` back to NaN)."""
    rows = json.loads(Path(path).read_text())["rows"]
    for r in rows:
        for k in NUMERIC_KEYS:
            if k in r and r[k] is None:
                r[k] = float("nan")
    return rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def append_jsonl(row: dict[str, Any], path: Path) -> None:
    with Path(path).open("a") as f:
        f.write(json.dumps(jsonable(row)) + "\n")
