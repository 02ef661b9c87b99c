"""TEST-ONLY shared cases of the trust tests (tests/test_answer_screen.py, tests/test_trust.py and the trust
benchmark's simulations/tests/test_attacks.py): head-round statistics of a made-up non-IID federation, and the tiny
in-process federation the lying-client runs use."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from fedfuse.progressive import HeadStatistics

C, D = 10, 16   # classes, feature width of the made-up federation

#: the tiny federation of the in-process lying-client runs (digits, a 32-wide MLP, 5 IID clients, 2 rounds)
TINY = {"dataset": "digits", "model": "mlp", "model-width": 32, "model-depth": 1, "num-clients": 5,
        "partitioning": "iid", "num-server-rounds": 2, "local-epochs": 2, "lr": 0.05, "fusion-set-size": 150,
        "min-train-nodes": 5, "head-round": False}


def head_stats(f: torch.Tensor, y: torch.Tensor) -> HeadStatistics:
    """The head round's statistics of features ``f`` ``[N, D]`` with labels ``y`` ``[N]`` (a bias column added)."""
    fa = torch.cat([f.double(), torch.ones(len(f), 1, dtype=torch.float64)], 1)
    return HeadStatistics(fa.T @ fa, fa.T @ torch.nn.functional.one_hot(y, C).double(), len(y))


def federation_stats(liars: int, seed: int = 0, clients: int = 10) -> list[HeadStatistics]:
    """Non-IID clients (Dirichlet 0.5 class mixes, 100-400 samples) of shared class-conditional features; the last
    ``liars`` send the statistics of reversed labels."""
    rng = np.random.default_rng(seed)
    centres = torch.as_tensor(rng.normal(0, 2.0, (C, D)))
    out = []
    for i in range(clients):
        n = int(rng.integers(100, 400))
        y = torch.as_tensor(rng.choice(C, size=n, p=rng.dirichlet([0.5] * C)))
        f = centres[y] + torch.as_tensor(rng.normal(0, 1.0, (n, D)))
        out.append(head_stats(f, C - 1 - y if i >= clients - liars else y))
    return out


def strategy_history(out: Path) -> list[dict]:
    """The strategy's per-round record of a finished run in ``out``."""
    return json.loads((Path(out) / "results.json").read_text())["strategy-history"]
