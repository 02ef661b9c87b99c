"""What the server screens: ``ClientScreen``, the robust setting's check of a round's validated replies before they
are aggregated or fused, and the bounds and screens of the clients' answers to its queries (below).

A reply that passes the format checks (``fedfuse.flower.round.replies``) can still lie in its *content*: a scaled or
sign-flipped update, random weights, a model trained on flipped labels, the global model sent back untrained. Weight-
only defences (Flower's ``FedMedian``, ``Krum``, …) see the weights alone; a fedfuse server also holds an unlabeled
fusion set, and the screen uses it. Per round, in order:

1. **Free riders and outsized updates**: a reply whose update ``‖w_i − g‖`` is below ``stale`` × the round's median
   update norm did not train (it sent the global model back, perhaps with a little noise): dropped. Then, against the
   median of the remaining norms, a reply above ``max_norm`` × that median is dropped (a scaled update, random
   weights).
2. **Direction**: a reply whose update's cosine with the round's coordinate-wise median update is below
   ``cosine_ratio`` × the replies' median cosine is dropped: a sign-flipped update points against the median,
   random weights and a model trained on flipped labels across it, while honest clients, however non-IID, share part
   of the descent direction of the global model they all start from.
   With ``cluster`` on, FLAME's clustering step comes first (Nguyen et al., "FLAME: Taming Backdoors in Federated
   Learning", USENIX Security 2022): HDBSCAN (scikit-learn's ``sklearn.cluster.HDBSCAN``, ``min_cluster_size =
   n // 2 + 1``, ``min_samples = 1``, a single cluster allowed) on the pairwise cosine distances
   ``1 − cos(Δ_i, Δ_j)`` of the remaining updates. ``cluster="flame"`` drops every reply outside the majority
   cluster (FLAME); ``cluster="core"`` keeps the majority cluster and applies the direction check above to the
   others, with the majority cluster's coordinate-wise median update as the reference (liars cannot pull it) and the
   members' median cosine, each against the median update of the other members, as the scale of the threshold;
   ``cluster="core-positive"`` keeps the majority cluster and drops the others whose cosine with the majority
   cluster's median update is not positive (they point away from the trusted majority). If
   HDBSCAN finds no cluster of a majority, the direction check runs as without ``cluster`` (recorded).
3. **Disagreement on the fusion set** (off by default, ``agreement_mads=0``): every remaining model labels the fusion
   set; the consensus is the per-sample majority vote of the models (one vote each, whatever sample count they claim). A model whose agreement with the
   consensus lies more than ``agreement_mads`` scaled median absolute deviations *and* more than ``min_gap`` below
   the round's median agreement is dropped (label-flipped, sign-flipped, scaled and random models label the data
   differently from the honest majority).
4. **Norm bound**: each kept update is shrunk to at most ``norm_clip`` × the median update norm (norm bounding: Sun
   et al., "Can You Really Backdoor Federated Learning?", arXiv 1911.07963; the median as the bound's reference:
   Nguyen et al., "FLAME: Taming Backdoors in Federated Learning", USENIX Security 2022): what a kept liar can still
   move is bounded.

The thresholds and what they were measured against are in docs/trust.md.

With fewer than 3 replies nothing is screened (a median cannot tell one liar from the others). Each round records
``screened``: the dropped clients with the reason, the clipped ones with their norms, and every client's norm ratio and
cosine (and agreement, when that check is on); a drop is
logged as a WARNING. A majority of colluding clients defeats the screen, as it defeats every median-based defence.

**The clients' answers**: what the clients answer to the server's queries, beside their weights, bounded and screened.

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
from dataclasses import dataclass
from logging import WARNING
from typing import Any, Callable
import numpy as np
import torch
from flwr.common.logger import log
from torch import nn
from fedfuse.flower.round.replies import ClientUpdate
from fedfuse.progressive import HeadStatistics

CLUSTER_MODES = ("off", "flame", "core", "core-positive")


@dataclass(frozen=True)
class ClientScreen:
    """Options of the robust setting's reply screen (module docstring).

    Args:
        stale: drop replies whose update norm is below this fraction of the round's median (0 = off).
        max_norm: drop replies whose update norm is above this multiple of the free riders' median (0 = off).
        cosine_ratio: drop replies whose update's cosine with the round's median update is below this fraction of the
            replies' median cosine (0 = off; the rule is skipped in a round whose median cosine is not positive).
        cosine_mads: with > 0, the direction check's line is the lower of ``cosine_ratio`` × the median cosine and
            the median cosine − this many scaled MADs of the round's cosines (0 = the ratio alone).
        agreement_mads: drop replies whose fusion-set agreement with the majority vote is this many scaled MADs below
            the median (0 = off, the default; needs a fusion set). Off because it does not separate liars from
            honest non-IID clients: on stock Flower's MNIST-1D splits (α = 0.5, 1 local epoch) honest clients agree
            with the majority on 4–50 % of the fusion set, and at 3 MADs it dropped an honest client in 23 % of the
            rounds of a clean run.
        min_gap: ... and at least this far below the median agreement (honest non-IID clients differ a little).
        norm_clip: bound each update's norm to this multiple of the round's median (0 = off).
        cluster: ``"off"`` (the direction check against the round's median update), ``"flame"`` (FLAME's clustering of
            the updates' pairwise cosine distances replaces it: only the majority cluster is kept) or ``"core"`` (the
            majority cluster is kept, and every other reply must pass the direction check against the majority
            cluster's median update) or ``"core-positive"`` (the majority cluster kept, the others kept when their
            cosine with its median update is positive); module docstring.
        min_samples: HDBSCAN's ``min_samples`` in the clustering (FLAME's 1; 0 = the minimum cluster size
            ``n // 2 + 1``, scikit-learn's default: each update's density is measured at the majority's scale, so a
            small group of near-identical liars does not look denser than the honest majority).
        batch_size: fusion-set batch size of the models' forward passes.
    """

    stale: float = 0.1
    max_norm: float = 3.0
    cosine_ratio: float = 0.4
    cosine_mads: float = 0.0
    agreement_mads: float = 0.0
    min_gap: float = 0.1
    norm_clip: float = 2.0
    batch_size: int = 512
    cluster: str = "off"
    min_samples: int = 1

    def __post_init__(self) -> None:
        for name in ("stale", "max_norm", "cosine_ratio", "cosine_mads", "agreement_mads", "min_gap", "norm_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ClientScreen: {name} must be >= 0, got {getattr(self, name)}")
        if self.cluster not in CLUSTER_MODES:
            raise ValueError(f"ClientScreen: cluster must be one of {CLUSTER_MODES}, got {self.cluster!r}")
        if self.min_samples < 0:
            raise ValueError(f"ClientScreen: min_samples must be >= 0, got {self.min_samples}")
        if self.batch_size < 1:
            raise ValueError(f"ClientScreen: batch_size must be >= 1, got {self.batch_size}")

    def __call__(self, updates: list[ClientUpdate], global_state: dict[str, torch.Tensor],
                 build_model: Callable[[dict[str, torch.Tensor]], nn.Module], fusion_inputs: torch.Tensor | None,
                 record: dict[str, Any], device: str | torch.device = "cpu") -> list[ClientUpdate]:
        """The updates to aggregate (some dropped, some shrunk); ``record["screened"]`` says which and why."""
        if len(updates) < 3:
            return updates
        info: dict[str, Any] = {"dropped": [], "clipped": []}
        record["screened"] = info
        norms = np.array([update_norm(u.state, global_state) for u in updates])
        cosines = median_cosines(updates, global_state)
        median = float(np.median(norms))
        info["median-norm"] = median
        info["clients"] = {str(u.partition_id): {"norm": round(float(n / median), 4) if median > 0 else None,
                                                 "cosine": round(float(c), 4)}
                           for u, n, c in zip(updates, norms, cosines)}
        keep = list(range(len(updates)))
        median = self._norm_checks(updates, norms, keep, info)
        core = self._majority_cluster(updates, global_state, keep, info) if self.cluster != "off" else None
        if core is not None and self.cluster == "flame":
            self._outside_cluster(updates, keep, core, len(keep), info)
        elif core is not None and self.cosine_ratio > 0:   # "core*": the others against the majority's median update
            self._against_cluster(updates, global_state, keep, core, info)
        elif core is None and self.cosine_ratio > 0:
            self._against_median(updates, cosines, keep, info)
        if self.agreement_mads > 0 and fusion_inputs is not None and len(keep) >= 3:
            self._agreement_check(updates, build_model, fusion_inputs, device, keep, info)
        if not keep:   # nothing left to aggregate: a screen that drops every reply is no defence; say so, keep them
            info["dropped-all"] = True
            log(WARNING, "robust screen: every reply failed a check (%s); the round aggregates all of them",
                "; ".join(d["reason"] for d in info["dropped"][:3]))
            keep = list(range(len(updates)))
        return [self._clipped(updates[i], norms[i], median, global_state, info) for i in keep]

    def _norm_checks(self, updates: list[ClientUpdate], norms: np.ndarray, keep: list[int],
                     info: dict[str, Any]) -> float:
        """Free riders (``stale``), then outsized updates (``max_norm``) against the trained replies' median norm,
        which is returned (the clip's reference)."""
        median = info["median-norm"]
        if self.stale > 0 and median > 0:
            for i in list(keep):
                if norms[i] < self.stale * median:
                    keep.remove(i)
                    self._drop(info, updates[i], f"update norm {norms[i]:.3g} is below {self.stale:g} × the round's "
                                                 f"median {median:.3g}: it did not train (free rider)")
        if keep:   # the trained replies' median: free riders' zero norms must not make honest updates look outsized
            median = float(np.median(norms[keep]))
            info["median-norm"] = median
        if self.max_norm > 0 and median > 0:
            for i in list(keep):
                if norms[i] > self.max_norm * median:
                    keep.remove(i)
                    self._drop(info, updates[i], f"update norm {norms[i]:.3g} is above {self.max_norm:g} × the round's "
                                                 f"median {median:.3g} (a scaled update or random weights)")
        return median

    def _majority_cluster(self, updates: list[ClientUpdate], global_state: dict[str, torch.Tensor], keep: list[int],
                          info: dict[str, Any]) -> list[int] | None:
        """The indices of the majority cluster of the kept updates (HDBSCAN on pairwise cosine distances), or
        ``None`` when no cluster holds more than half of them."""
        if len(keep) < 3:
            return None
        labels = cluster_labels([updates[i] for i in keep], global_state, self.min_samples)
        for i, lab in zip(keep, labels):
            info["clients"][str(updates[i].partition_id)]["cluster"] = int(lab)
        ids, counts = np.unique(labels[labels >= 0], return_counts=True)
        if not len(ids) or counts.max() <= len(keep) // 2:
            info["no-majority-cluster"] = True
            return None
        major = int(ids[np.argmax(counts)])
        core = [i for i, lab in zip(keep, labels) if lab == major]
        info["majority-cluster"] = [updates[i].partition_id for i in core]
        return core

    def _outside_cluster(self, updates: list[ClientUpdate], keep: list[int], core: list[int], clustered: int,
                         info: dict[str, Any]) -> None:
        """``cluster="flame"``: only the majority cluster (of the ``clustered`` kept updates) is kept."""
        for i in [i for i in keep if i not in core]:
            keep.remove(i)
            lab = info["clients"][str(updates[i].partition_id)]["cluster"]
            self._drop(info, updates[i], "its update lies outside the majority cluster of the round's updates "
                                         f"(HDBSCAN on pairwise cosine distances: "
                                         f"{'noise' if lab < 0 else f'cluster {lab}'}; the majority holds "
                                         f"{len(core)} of {clustered})")

    def _against_cluster(self, updates: list[ClientUpdate], global_state: dict[str, torch.Tensor], keep: list[int],
                         core: list[int], info: dict[str, Any]) -> None:
        """``cluster="core"`` / ``"core-positive"``: a reply outside the majority cluster against the cluster's median
        update."""
        ref = median_cosines(updates, global_state, reference=[updates[i] for i in core])
        # what an honest cosine with a reference it did not shape looks like: each member against the median
        # update of the other members (a member's cosine with a median it is part of is biased upwards)
        loo = np.array([median_cosines([updates[j]], global_state,
                                       reference=[updates[i] for i in core if i != j])[0] for j in core])
        for u, c in zip(updates, ref):
            info["clients"][str(u.partition_id)]["core-cosine"] = round(float(c), 4)
        for j, c in zip(core, loo):
            info["clients"][str(updates[j].partition_id)]["core-cosine-others"] = round(float(c), 4)
        median_loo = float(np.median(loo))
        info["core-median-cosine"] = round(median_loo, 4)
        if self.cluster == "core-positive":   # outside the majority: must point at least partly along it
            for i in [i for i in keep if i not in core]:
                if ref[i] <= 0:
                    keep.remove(i)
                    self._drop(info, updates[i], f"it lies outside the majority cluster of the round's updates "
                                                 f"and its update's cosine with that cluster's median update is "
                                                 f"{ref[i]:.2f}, not positive")
        elif median_loo > 0:
            for i in [i for i in keep if i not in core]:
                if ref[i] < self.cosine_ratio * median_loo:
                    keep.remove(i)
                    self._drop(info, updates[i], f"it lies outside the majority cluster of the round's updates "
                                                 f"and its update's cosine with that cluster's median update is "
                                                 f"{ref[i]:.2f}, below {self.cosine_ratio:g} × the cluster "
                                                 f"members' median {median_loo:.2f} (each against the others)")

    def _against_median(self, updates: list[ClientUpdate], cosines: np.ndarray, keep: list[int],
                        info: dict[str, Any]) -> None:
        """The direction check: a reply whose cosine with the round's median update is far below the replies'
        median cosine (skipped when that median is not positive). With ``cosine_mads`` > 0 the line is the lower of
        ``cosine_ratio`` × the median cosine and the median cosine − ``cosine_mads`` scaled MADs of the cosines: it
        widens with the federation's spread of cosines."""
        median_cos = float(np.median(cosines))
        if median_cos <= 0:
            return
        line = self.cosine_ratio * median_cos
        rule = f"{self.cosine_ratio:g} × the replies' median {median_cos:.2f}"
        if self.cosine_mads > 0:
            mad_line = median_cos - self.cosine_mads * scaled_mad(cosines, median_cos)
            info["cosine-line"] = round(min(line, mad_line), 4)
            if mad_line < line:
                line, rule = mad_line, (f"the replies' median {median_cos:.2f} − {self.cosine_mads:g} scaled MADs "
                                        f"({mad_line:.2f})")
        for i in list(keep):
            if cosines[i] < line:
                keep.remove(i)
                self._drop(info, updates[i], f"its update's cosine with the round's median update is "
                                             f"{cosines[i]:.2f}, below {rule}")

    def _agreement_check(self, updates: list[ClientUpdate], build_model, fusion_inputs: torch.Tensor, device,
                         keep: list[int], info: dict[str, Any]) -> None:
        """A reply that agrees with the clients' majority vote on the fusion set far less than the others."""
        agree = agreements([build_model(updates[i].state) for i in keep], fusion_inputs, self.batch_size, device)
        for i, a in zip(keep, agree):
            info["clients"][str(updates[i].partition_id)]["agreement"] = round(float(a), 4)
        med = float(np.median(agree))
        spread = max(self.agreement_mads * scaled_mad(agree, med), self.min_gap)
        for i, a in zip(list(keep), agree):
            if a < med - spread:
                keep.remove(i)
                self._drop(info, updates[i], f"agrees with the clients' majority vote on {a:.0%} of the fusion set, "
                                             f"the round's median is {med:.0%} (limit {med - spread:.0%})")

    def _clipped(self, u: ClientUpdate, norm: float, median: float, global_state: dict[str, torch.Tensor],
                 info: dict[str, Any]) -> ClientUpdate:
        """``u`` with its update's norm bounded to ``norm_clip`` × the median (recorded when it was)."""
        limit = self.norm_clip * median
        if self.norm_clip > 0 and norm > limit > 0:
            u = dataclasses.replace(u, state=shrink(u.state, global_state, limit / norm))
            info["clipped"].append({"node-id": int(u.node_id), "partition-id": u.partition_id,
                                    "norm": round(float(norm), 4), "limit": round(limit, 4)})
        return u

    @staticmethod
    def _drop(info: dict[str, Any], u: ClientUpdate, reason: str) -> None:
        info["dropped"].append({"node-id": int(u.node_id), "partition-id": u.partition_id, "reason": reason})
        log(WARNING, "robust screen: node %d (partition %s) dropped: %s", u.node_id, u.partition_id, reason)


def scaled_mad(values: np.ndarray, median: float) -> float:
    """The median absolute deviation of ``values`` from their ``median``, scaled by 1.4826 (a normal sample's
    standard deviation): the spread both MAD rules of the screen measure against."""
    return 1.4826 * float(np.median(np.abs(np.asarray(values) - median)))


def update_norm(state: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor]) -> float:
    """``‖w − g‖₂`` over every floating-point entry of the state dicts."""
    total = 0.0
    for k, v in state.items():
        if v.is_floating_point():
            total += float((v.double() - global_state[k].double()).pow(2).sum())
    return total ** 0.5


def median_cosines(updates: list[ClientUpdate], global_state: dict[str, torch.Tensor],
                   reference: list[ClientUpdate] | None = None) -> np.ndarray:
    """``[M]``: the cosine between each update ``w_i − g`` and the coordinate-wise median of the updates of
    ``reference`` (default: ``updates`` themselves; one tensor at a time, so memory stays at one tensor × the number
    of clients)."""
    reference = updates if reference is None else reference
    dots = np.zeros(len(updates))
    sq = np.zeros(len(updates))
    msq = 0.0
    for k, g in global_state.items():
        if not g.is_floating_point():
            continue
        d = torch.stack([u.state[k].double() - g.double() for u in updates]).reshape(len(updates), -1)   # [M, P_k]
        m = (d if reference is updates else
             torch.stack([u.state[k].double() - g.double() for u in reference]).reshape(len(reference), -1)
             ).median(0).values
        dots += (d @ m).numpy()
        sq += d.pow(2).sum(1).numpy()
        msq += float(m.pow(2).sum())
    denom = np.sqrt(sq) * np.sqrt(msq)
    return np.where(denom > 0, dots / np.where(denom > 0, denom, 1.0), 0.0)


def pairwise_cosines(updates: list[ClientUpdate], global_state: dict[str, torch.Tensor]) -> np.ndarray:
    """``[M, M]``: the cosines between the updates ``w_i − g`` (floating-point entries; a zero update has cosine 0
    with every other)."""
    gram = torch.zeros(len(updates), len(updates), dtype=torch.float64)
    for k, g in global_state.items():
        if not g.is_floating_point():
            continue
        d = torch.stack([u.state[k].double() - g.double() for u in updates]).reshape(len(updates), -1)   # [M, P_k]
        gram += d @ d.T
    norms = gram.diagonal().clamp_min(0).sqrt()
    denom = norms[:, None] * norms[None, :]
    return torch.where(denom > 0, gram / torch.where(denom > 0, denom, torch.ones_like(denom)),
                       torch.zeros_like(gram)).clamp(-1, 1).numpy()


def cluster_labels(updates: list[ClientUpdate], global_state: dict[str, torch.Tensor], min_samples: int = 1
                   ) -> np.ndarray:
    """``[M]``: FLAME's clustering of the updates (HDBSCAN on ``1 − cos``, ``min_cluster_size = M // 2 + 1``,
    ``min_samples`` (FLAME: 1; 0: ``min_cluster_size``, scikit-learn's default), a single cluster allowed); ``-1``
    marks noise."""
    from sklearn.cluster import HDBSCAN

    dist = 1.0 - pairwise_cosines(updates, global_state)
    np.fill_diagonal(dist, 0.0)
    dist = np.clip((dist + dist.T) / 2, 0.0, None)
    size = len(updates) // 2 + 1
    return HDBSCAN(min_cluster_size=size, min_samples=min_samples or size, metric="precomputed",
                   allow_single_cluster=True, copy=True).fit(dist).labels_


def shrink(state: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor], factor: float
           ) -> dict[str, torch.Tensor]:
    """``g + factor · (w − g)`` (floating-point entries; the others, e.g. BatchNorm's counter, as sent)."""
    return {k: (global_state[k] + factor * (v - global_state[k])).to(v.dtype) if v.is_floating_point() else v
            for k, v in state.items()}


@torch.no_grad()
def agreements(models: list[nn.Module], inputs: torch.Tensor, batch_size: int = 512,
               device: str | torch.device = "cpu") -> np.ndarray:
    """``[M]``: the share of ``inputs`` ``[B, *shape]`` on which each model's label is the models' majority vote."""
    labels = []
    for m in models:
        m = m.to(device).eval()
        labels.append(torch.cat([m(inputs[i:i + batch_size].to(device)).argmax(1).cpu()
                                 for i in range(0, len(inputs), batch_size)]))
    votes = torch.stack(labels)                                   # [M, B]
    num_classes = int(votes.max()) + 1
    counts = torch.nn.functional.one_hot(votes, num_classes).sum(0)   # [B, C]
    consensus = counts.argmax(1)                                  # ties: the lowest class
    return (votes == consensus).double().mean(1).numpy()


# ---------------------------------------------------------------- the clients' answers
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


__all__ = ["ClientScreen", "CLUSTER_MODES", "update_norm", "median_cosines", "pairwise_cosines", "cluster_labels",
           "shrink", "agreements", "CLASS_MEAN_THRESHOLD", "count_limit", "check_statistics", "scaled_statistics",
           "cap_statistics", "class_mean_scores", "class_mean_outliers", "paired_median"]
