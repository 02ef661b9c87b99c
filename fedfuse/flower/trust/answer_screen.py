"""What the clients answer to the server's queries, beside their weights, bounded and screened (issue 45).

Two queries read client answers that the update screen (``fedfuse.flower.trust.screen``) never sees: the head round's
ridge statistics (``Σ f fᵀ``, ``Σ f onehot(y)ᵀ``, ``fedfuse.flower.head.head_round``) and the candidate scores of
``auto``'s vote and of the head round's check (``fedfuse.flower.aggregators.candidates``). A lying node can claim any sample
count, send the statistics of flipped labels, or vote for the worst candidate.

Always (bounds, as the train replies' ``weight_cap``):

- **Consistent statistics** (``check_statistics``): an honest reply's numbers obey identities whatever its data: the
  last row of ``cross`` is its class counts (non-negative, summing to its sample count), the columns of ``cross`` sum
  to the last column of the Gram matrix (both are ``Σ f``), the Gram matrix's diagonal is non-negative. A reply that
  breaks one is rejected with the reason.
- **Claimed counts** (``count_limit``): a node's sample count, in a statistics reply and in a score reply, weighs at
  most ``cap`` × the median of the query's replies (the statistics scaled down with it).

With the robust setting (``robust=true``):

- **One node, one vote** (``paired_median``): the candidates' scores are pooled as the median over nodes of each
  candidate's accuracy minus the first candidate's (the model before, or the plain average), added to the first's
  pooled accuracy: fewer than half of the nodes cannot move the median past the honest ones, whatever they report
  and whatever count they claim. Paired differences cancel what makes non-IID nodes differ (their own data's
  difficulty), so the honest differences agree far more than the accuracies do.
- **Class means** (``class_mean_outliers``): for every class held by at least three nodes, each node's mean feature of
  the class (``cross[:-1, c] / cross[-1, c]``) is compared with the coordinate-wise median of the nodes' means; a node
  whose distance, in units of the class's median distance and weighted by its class counts, is above ``threshold``
  is dropped. The features are the global model's, the same for every node, so an honest node's class means differ
  from the others' only by sampling and by what its data holds of the class; statistics of flipped labels put one
  class's features under another's label. Non-IID splits leave each class's mean close across the nodes that hold
  it (measured: docs/trust.md, "The head round and the vote under lying clients").

Robust statistics of this kind: Yin et al., "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
Rates", arXiv 1803.01498 (coordinate-wise median); the vote as a median of paired differences is the same rule on
the clients' reported accuracies.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from fedfuse.progressive import HeadStatistics

CLASS_MEAN_THRESHOLD = 1.5   # × the class's median distance (class_mean_outliers; chosen on one cell: docs/trust.md)


def count_limit(counts: list[float], cap: float) -> float | None:
    """The largest sample count a reply may weigh with: ``cap`` × the median of ``counts`` (``None``: no cap, with
    ``cap`` 0 or fewer than 3 counts, where a median cannot tell one liar from the others)."""
    if cap <= 0 or len(counts) < 3:
        return None
    return cap * float(np.median(np.asarray(counts, dtype=float)))


def check_statistics(s: HeadStatistics, tol: float = 1e-4) -> None:
    """``ValueError`` saying which identity of honest ridge statistics ``s`` breaks (see the module docstring)."""
    counts, n = s.cross[-1], int(s.num_examples)
    if bool((counts < -tol).any()) or abs(float(counts.sum()) - n) > tol * max(1, n):
        raise ValueError(f"head statistics: the class counts (cross's last row) must be >= 0 and sum to num_examples "
                         f"{n}, got {counts.tolist()}")
    feature_sum, by_class = s.gram[:-1, -1], s.cross[:-1].sum(1)
    scale = float(s.gram.diagonal().abs().max()) ** 0.5 * max(1, n) ** 0.5 + 1.0   # Cauchy-Schwarz: |Σ f| ≤ this
    if float((feature_sum - by_class).abs().max()) > tol * scale:
        raise ValueError("head statistics: cross's columns must sum to the Gram matrix's last column (both are the "
                         "features' sum)")
    if bool((s.gram.diagonal() < -tol * scale).any()):
        raise ValueError("head statistics: the Gram matrix has a negative diagonal entry (a sum of squares)")


def scaled_statistics(s: HeadStatistics, used: int) -> HeadStatistics:
    """``s`` weighed as ``used`` samples: every sum scaled by ``used / num_examples``."""
    f = used / int(s.num_examples)
    return dataclasses.replace(s, gram=s.gram * f, cross=s.cross * f, num_examples=int(used))


def cap_statistics(stats: list[dict[str, HeadStatistics]], nodes: list[int], cap: float, record: dict[str, Any]
                   ) -> list[dict[str, HeadStatistics]]:
    """Each node's statistics (``{site: statistics}``) weighed as at most ``count_limit`` samples; a capped node is
    listed in ``record["capped"]`` (node, claimed, used)."""
    claimed = [int(next(iter(s.values())).num_examples) for s in stats]
    limit = count_limit(claimed, cap)
    if limit is None:
        return stats
    out = []
    for s, node, n in zip(stats, nodes, claimed):
        if n > limit:
            used = max(1, int(limit))
            record.setdefault("capped", []).append({"node": node, "claimed": n, "used": used})
            s = {site: scaled_statistics(v, used) for site, v in s.items()}
        out.append(s)
    return out


def class_mean_scores(stats: list[HeadStatistics]) -> list[float | None]:
    """Each reply's distance from the others' class means (see the module docstring): the count-weighted mean, over
    the classes held by at least 3 replies, of its class mean's distance from the coordinate-wise median of the
    replies' class means, in units of the class's median distance (``None``: no class screened; fewer than 3
    replies: all ``None``)."""
    if len(stats) < 3:
        return [None] * len(stats)
    counts = torch.stack([s.cross[-1] for s in stats]).double()   # [M, C]
    means = torch.stack([s.cross[:-1].double() for s in stats]) / counts.clamp_min(1.0)[:, None, :]   # [M, d, C]
    weighted, weights = torch.zeros(len(stats), dtype=torch.float64), torch.zeros(len(stats), dtype=torch.float64)
    for c in range(counts.shape[1]):
        holders = (counts[:, c] >= 1).nonzero().flatten()
        if len(holders) < 3:
            continue
        mu = means[holders, :, c]
        dist = (mu - mu.median(0).values).norm(dim=1)
        unit = float(dist.median())
        if unit <= 0:
            continue
        weighted[holders] += counts[holders, c] * dist / unit
        weights[holders] += counts[holders, c]
    score = weighted / weights.clamp_min(1e-12)
    return [float(score[i]) if weights[i] > 0 else None for i in range(len(stats))]


def class_mean_outliers(stats: list[HeadStatistics], threshold: float = CLASS_MEAN_THRESHOLD) -> dict[int, float]:
    """``{index: score}`` of the replies whose ``class_mean_scores`` are above ``threshold``."""
    return {i: v for i, v in enumerate(class_mean_scores(stats)) if v is not None and v > threshold}


def paired_median(accuracies: list[list[float]]) -> list[float]:
    """Robust pooling of ``accuracies`` (one row of candidate accuracies, or losses, per node): the median over nodes
    of candidate 0's, and for every other candidate that plus the median over nodes of its value minus candidate
    0's (one node, one vote: the claimed sample counts play no part)."""
    a = np.asarray(accuracies, dtype=float)
    base = float(np.median(a[:, 0]))
    return [base] + [base + float(np.median(a[:, j] - a[:, 0])) for j in range(1, a.shape[1])]


__all__ = ["CLASS_MEAN_THRESHOLD", "count_limit", "check_statistics", "scaled_statistics", "cap_statistics",
           "class_mean_scores", "class_mean_outliers", "paired_median"]
