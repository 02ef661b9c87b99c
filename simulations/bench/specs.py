"""The command-line spec syntaxes shared by every benchmark.

- partition: ``<method><number of clients>`` with method ``shards`` (class-disjoint), ``dirichlet``
  (α from ``--alpha``), ``iid`` or ``full``: ``shards2``, ``dirichlet4``, ``iid10``.
- method: a fusion method name with optional TOML-valued options in brackets:
  ``kf-gradient[setting=2,eps=0.5]``, ``kd[augmentation="mixup"]``.
- lists: comma-separated; commas inside ``[...]`` do not split.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from typing import Any

from fedfuse.flower.runner.run import split_list  # noqa: F401  (the runners' comma lists too)

PARTITION_METHODS = ("shards", "dirichlet", "iid", "full")


@dataclass(frozen=True)
class PartitionSpec:
    """A parsed partition spec: ``method`` (a ``fedfuse.data`` partitioning) and ``num_clients``."""

    method: str
    num_clients: int

    @property
    def name(self) -> str:
        return f"{self.method}{self.num_clients}"


def parse_partition(text: str) -> PartitionSpec:
    """``"shards2"`` → ``PartitionSpec("shards", 2)``; raises ``ValueError`` naming the spec otherwise."""
    m = re.fullmatch(r"(" + "|".join(PARTITION_METHODS) + r")(\d+)", text.strip())
    if not m or int(m.group(2)) < 1:
        raise ValueError(f"partition spec {text!r}: expected <method><clients> with method one of "
                         f"{', '.join(PARTITION_METHODS)}, e.g. shards2, dirichlet4, iid4")
    return PartitionSpec(m.group(1), int(m.group(2)))


def parse_options_text(text: str, where: str) -> dict[str, Any]:
    """``"a=1,b=\\"x\\""`` → ``{"a": 1, "b": "x"}`` (TOML values; ``-`` in keys becomes ``_``)."""
    opts: dict[str, Any] = {}
    for item in split_list(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{where}: expected key=value, got {item!r}")
        try:
            opts[key.strip().replace("-", "_")] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{where}: option {key.strip()!r} has no valid TOML value ({value.strip()!r}): "
                             f"{exc}") from None
    return opts


@dataclass(frozen=True)
class MethodSpec:
    """``label`` (the text as given, used as the table row), fusion method ``name`` and ``options``."""

    label: str
    name: str
    options: dict


def parse_method(text: str) -> MethodSpec:
    """``"kf-gradient[setting=2,eps=0.5]"`` → ``MethodSpec(label, "kf-gradient", {"setting": 2, "eps": 0.5})``."""
    m = re.fullmatch(r"([\w\-]+)(?:\[(.*)\])?", text.strip())
    if not m:
        raise ValueError(f"method spec {text!r}: expected name or name[key=value,...]")
    opts = parse_options_text(m.group(2), f"method spec {text!r}") if m.group(2) else {}
    return MethodSpec(text.strip(), m.group(1), opts)


def parse_ints(text: str) -> list[int]:
    try:
        return [int(v) for v in split_list(text)]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
