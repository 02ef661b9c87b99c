"""Progressive few-round fusion: fuse the clients' feature levels, then fit what is above them on the clients' data.

One-shot fusion (``fuse``) has to build the whole fused model from the server's unlabeled fusion set; its last
level, the classifier, is fitted to the clients' (averaged) logits, which under label skew are each right only on
the client's own classes. FuseFL (Tang et al., "FuseFL: One-Shot Federated Learning through the Lens of Causality
with Progressive Model Fusion", arXiv 2410.20380) goes past the clients' ensemble by fusing the models block by
block over a few rounds: after each fused block is frozen and sent back, the clients train what lies above it on
their own data, so the upper levels learn to read the fused features instead of their own.

fedfuse's version (K rounds; K = 1 is plain one-shot fusion):

- **round 1**: the clients train independently; the server fuses their models (any ``fuse`` method);
- **rounds 2 … K−1** (level-wise, ``nn.Sequential`` MLPs): the fused levels up to cut k are frozen and sent back;
  each client lifts its own upper levels onto them (``lift_suffix``: its first upper layer refitted by ridge
  regression so that, on its data, it reproduces its own pre-activations from the fused features), trains the upper
  levels (the frozen prefix stays bit-identical) and replies; the server fuses the upper parts on the fusion set
  passed through the frozen prefix (``fuse_suffixes``) and freezes one more level;
- **round K** (the head round): every client sends the sufficient statistics of a ridge regression from the fused
  model's pre-logit features to its one-hot labels (``head_statistics``: the Gram matrix of the features and their
  class sums, O(d²) numbers, no model); the server adds them up and solves (``solve_head``). The sum of the clients'
  statistics is the statistics of the pooled data, so the classifier is the one centralised training of a ridge
  head on the frozen features would give, whatever the label skew (the closed-form federated linear head of
  Fed3R, Fanì et al., "Accelerating Heterogeneous Federated Learning with Closed-form Classifiers",
  arXiv 2406.01116).

What a client reveals in the head round: the Gram matrix of its features and the per-class feature sums, hence its
class counts (the bias column). That is label information of the kind ``class_counts`` already carries.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fedfuse.choices import HEAD_SOLVERS
from fedfuse.fusion import fuse
from fedfuse.models import adapter_for, set_example_input
from fedfuse.models.adapters.base import AFFINE_LAYERS

DEFAULT_HEAD_RIDGE = 1e-3
DEFAULT_LDA_SHRINKAGE = 1e-3


@dataclass(frozen=True)
class HeadStatistics:
    """One client's sufficient statistics of the ridge head (features ``f`` with a constant 1 appended).

    Attributes:
        gram: ``[d+1, d+1]`` float64, ``Σ f fᵀ`` over the client's samples.
        cross: ``[d+1, C]`` float64, ``Σ f onehot(y)ᵀ``.
        num_examples: the number of samples summed.
    """

    gram: torch.Tensor
    cross: torch.Tensor
    num_examples: int

    def __post_init__(self) -> None:
        g, c = self.gram, self.cross
        if not (torch.is_tensor(g) and torch.is_tensor(c) and g.dim() == 2 and c.dim() == 2
                and g.shape[0] == g.shape[1] == c.shape[0] and g.shape[0] >= 2 and c.shape[1] >= 2):
            raise ValueError("head statistics: gram must be [d+1, d+1] and cross [d+1, C] with d >= 1, C >= 2, got "
                             f"{tuple(getattr(g, 'shape', ()))} and {tuple(getattr(c, 'shape', ()))}")
        if int(self.num_examples) < 1:
            raise ValueError(f"head statistics: num_examples must be >= 1, got {self.num_examples}")
        if not (bool(torch.isfinite(g).all()) and bool(torch.isfinite(c).all())):
            raise ValueError("head statistics: non-finite values")
        if abs(float(g[-1, -1]) - int(self.num_examples)) > 1e-6 * max(1, int(self.num_examples)):
            raise ValueError(f"head statistics: gram[-1, -1] = {float(g[-1, -1]):g} must equal num_examples "
                             f"{self.num_examples} (the constant feature's sum of squares)")

    def pack(self) -> torch.Tensor:
        """The Gram matrix's upper triangle (it is symmetric: half the numbers on the wire), flattened."""
        i, j = torch.triu_indices(self.gram.shape[0], self.gram.shape[0])
        return self.gram[i, j]

    @staticmethod
    def unpack(upper: torch.Tensor, cross: torch.Tensor, num_examples: int) -> "HeadStatistics":
        """The inverse of ``pack`` (``ValueError`` when ``upper`` does not fit ``cross``'s row count)."""
        d1 = int(cross.shape[0]) if torch.is_tensor(cross) and cross.dim() == 2 else -1
        if d1 < 2 or not torch.is_tensor(upper) or upper.dim() != 1 or upper.numel() != d1 * (d1 + 1) // 2:
            raise ValueError(f"head statistics: a packed Gram matrix of {getattr(upper, 'shape', None)} numbers does "
                             f"not fit cross of shape {tuple(getattr(cross, 'shape', ()))}")
        i, j = torch.triu_indices(d1, d1)
        gram = torch.zeros(d1, d1, dtype=torch.float64)
        gram[i, j] = upper.double()
        gram[j, i] = upper.double()
        return HeadStatistics(gram, cross.double(), int(num_examples))

    @property
    def numbers_sent(self) -> int:
        """How many numbers a packed reply carries (the communication of the head round)."""
        d1 = self.gram.shape[0]
        return d1 * (d1 + 1) // 2 + self.cross.numel()


def _with_bias(f: torch.Tensor) -> torch.Tensor:
    """``[N, d]`` features with a constant 1 appended (``[N, d+1]``: the bias's column)."""
    return torch.cat([f, torch.ones(len(f), 1, dtype=f.dtype)], 1)


def _ridge_solve(gram: torch.Tensor, cross: torch.Tensor, penalty: float) -> torch.Tensor:
    """``argmin_W ‖F W − Y‖² + penalty · ‖W[:-1]‖²`` from ``gram = FᵀF`` and ``cross = FᵀY`` (the last row of ``W``,
    the bias, is not penalised); a tiny jitter keeps the system solvable when features are constant (dead ReLUs)
    and ``penalty`` is 0."""
    d1 = gram.shape[0]
    reg = torch.eye(d1, dtype=gram.dtype) * penalty
    reg[-1, -1] = 0.0
    jitter = 1e-10 * float(gram.diagonal().abs().max()) * torch.eye(d1, dtype=gram.dtype)
    return torch.linalg.solve(gram + reg + jitter, cross)


@dataclass(frozen=True)
class HeadSite:
    """One classifier a head round solves: ``features(x)`` ``[N, *input]`` → the ``[N, d]`` inputs of ``classifier``
    (an ``nn.Linear(d, C)``), and ``logits(x)`` → the ``[N, C]`` outputs of the model's path through it."""

    features: Callable[[torch.Tensor], torch.Tensor]
    classifier: nn.Linear
    logits: Callable[[torch.Tensor], torch.Tensor]


def head_sites(model: nn.Module) -> dict[str, HeadSite]:
    """The classifiers of ``model`` a head round solves: ``{"": its classifier on its pre-logit features}``, or what
    the model's own ``head_sites()`` gives (a depth-tier ``MultiExit``: its final classifier and every exit)."""
    own = getattr(model, "head_sites", None)
    if callable(own):
        return own()
    adapter = adapter_for(model)
    return {"": HeadSite(lambda x: adapter.pre_logits(model, x), adapter.classifier(model), model)}


def _site(model: nn.Module, site: str) -> HeadSite:
    sites = head_sites(model)
    if site not in sites:
        raise ValueError(f"head round: the model has no classifier {site!r}; it has {sorted(sites)}")
    return sites[site]


class SiteView(nn.Module):
    """The path of ``model`` through its classifier ``site`` (``head_sites``) as a module: ``forward(x)`` → that
    classifier's logits ``[N, C]`` (a depth tier's exit scored as the model of that depth). Holds ``model``."""

    def __init__(self, model: nn.Module, site: str) -> None:
        super().__init__()
        _site(model, site)   # ValueError naming the sites the model has
        self.model, self.site = model, site

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _site(self.model, self.site).logits(x)


def copy_head(source: nn.Module, target: nn.Module, site: str = "") -> nn.Module:
    """``target`` (in place, returned) with its classifier ``site`` set to ``source``'s (same architecture)."""
    with torch.no_grad():
        for t, s in zip(_site(target, site).classifier.parameters(), _site(source, site).classifier.parameters()):
            t.copy_(s)
    return target


def features(model: nn.Module, x: torch.Tensor, batch_size: int = 512,
             device: str | torch.device = "cpu", site: str = "") -> torch.Tensor:
    """The inputs ``[N, d]`` of the classifier ``site`` (``""``: the model's pre-logit features, its family adapter's
    ``pre_logits``), in eval mode, on CPU."""
    if len(x):
        set_example_input(model, x)   # the generic reader traces a user's model on these inputs' shape
    was_training = model.training
    model.eval().to(device)
    fn = _site(model, site).features
    out = []
    with torch.no_grad():
        for b in range(0, len(x), batch_size):
            out.append(fn(x[b:b + batch_size].to(device)).flatten(1).double().cpu())
    model.train(was_training)
    return torch.cat(out)


def head_statistics(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                    batch_size: int = 512, device: str | torch.device = "cpu", site: str = "") -> HeadStatistics:
    """A client's statistics for the federated ridge head on ``model``'s frozen pre-logit features.

    Args:
        model: the fused model the server sent (not modified).
        x: the client's inputs ``[N, *input_shape]``; y: its labels ``[N]`` in ``[0, num_classes)``.
        site: which classifier (``head_sites``; ``""``: the model's own).
    """
    y = torch.as_tensor(y).long()
    if len(x) != len(y) or len(y) == 0:
        raise ValueError(f"head statistics: need as many labels as inputs (> 0), got {len(x)} inputs, {len(y)} labels")
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ValueError(f"head statistics: labels must be in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]")
    f = _with_bias(features(model, x, batch_size, device, site))
    return HeadStatistics(f.T @ f, f.T @ nn.functional.one_hot(y, num_classes).double(), len(y))


def _pooled(stats: list[HeadStatistics], who: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(Σ gram, Σ cross, Σ num_examples)`` of the clients' statistics: the pooled data's (``ValueError`` naming
    ``who`` when there are none or their shapes differ)."""
    if not stats:
        raise ValueError(f"{who}: no client statistics")
    shapes = {(tuple(s.gram.shape), tuple(s.cross.shape)) for s in stats}
    if len(shapes) != 1:
        raise ValueError(f"{who}: the clients' statistics have different shapes {sorted(shapes)}")
    return sum(s.gram for s in stats), sum(s.cross for s in stats), sum(s.num_examples for s in stats)


def solve_head(stats: list[HeadStatistics], ridge: float = DEFAULT_HEAD_RIDGE) -> nn.Linear:
    """The ridge classifier of the pooled statistics: ``argmin_W Σ_i ‖F_i W − Y_i‖² + ridge · N · ‖W_features‖²``
    (the bias is not penalised), as an ``nn.Linear(d, C)``.

    ``ridge`` is per sample (scaled by the total sample count ``N``), so it means the same for any federation size.
    """
    if not (isinstance(ridge, (int, float)) and math.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"solve_head: ridge must be a number >= 0, got {ridge!r}")
    gram, cross, n = _pooled(stats, "solve_head")
    wb = _ridge_solve(gram, cross, ridge * n)
    head = nn.Linear(gram.shape[0] - 1, cross.shape[1])
    with torch.no_grad():
        head.weight.copy_(wb[:-1].T.float())
        head.bias.copy_(wb[-1].float())
    return head


def solve_lda_head(stats: list[HeadStatistics], shrinkage: float = DEFAULT_LDA_SHRINKAGE) -> nn.Linear:
    """Linear discriminant analysis from the same pooled statistics as ``solve_head`` (no more communication): the
    Gaussian classifier with one covariance shared by the classes, as an ``nn.Linear(d, C)``.

    From ``Σ f fᵀ`` and the per-class sums (the constant feature's column gives the class counts ``n_c``): class
    means ``μ_c``, the pooled within-class covariance ``Σ_w = (Σ f fᵀ − Σ_c n_c μ_c μ_cᵀ) / N`` shrunk towards
    ``(tr Σ_w / d) I`` by ``shrinkage`` (a feature that never varies, a dead ReLU, keeps it invertible), then
    ``W_c = Σ_w⁻¹ μ_c`` and ``b_c = −½ μ_cᵀ Σ_w⁻¹ μ_c + log π_c`` with ``π`` the pooled class frequencies (a class no
    client holds gets ``π_c = 1e-12``). Where the ridge head regresses one-hot targets (which, with many classes,
    can mask a class between two others), LDA models each class's features; which of the two classifies a model's
    features better is measured, not known (the head round's ``head-solver='best'`` lets the clients choose;
    docs/tiers.md). Hastie, Tibshirani and Friedman, "The Elements of Statistical Learning", §4.2 (masking), §4.3
    (LDA) and §4.3.1 (regularised LDA)."""
    if not (isinstance(shrinkage, (int, float)) and math.isfinite(shrinkage) and 0 <= shrinkage <= 1):
        raise ValueError(f"solve_lda_head: shrinkage must be a number in [0, 1], got {shrinkage!r}")
    gram, cross, _ = _pooled(stats, "solve_lda_head")
    d = gram.shape[0] - 1
    counts = cross[-1]                                   # [C]: the constant feature's class sums
    n = float(counts.sum())
    mu = (cross[:-1] / counts.clamp_min(1.0)).T          # [C, d]
    within = (gram[:-1, :-1] - (mu.T * counts) @ mu) / n
    within = 0.5 * (within + within.T)
    scale = max(float(within.diagonal().mean()), 1e-12)
    within = (1 - shrinkage) * within + shrinkage * scale * torch.eye(d, dtype=within.dtype)
    within = within + 1e-10 * scale * torch.eye(d, dtype=within.dtype)
    w = torch.linalg.solve(within, mu.T).T               # [C, d]
    prior = (counts / n).clamp_min(1e-12)
    b = -0.5 * (w * mu).sum(1) + prior.log()
    head = nn.Linear(d, cross.shape[1])
    with torch.no_grad():
        head.weight.copy_(w.float())
        head.bias.copy_(b.float())
    return head




def solve_classifier(stats: list[HeadStatistics], solver: str = "ridge", ridge: float = DEFAULT_HEAD_RIDGE) -> nn.Linear:
    """The head of ``solver`` (``HEAD_SOLVERS``: ``"ridge"``, ``solve_head`` with ``ridge``; ``"lda"``,
    ``solve_lda_head``) from the clients' statistics."""
    if solver == "ridge":
        return solve_head(stats, ridge)
    if solver == "lda":
        return solve_lda_head(stats)
    raise ValueError(f"head solver {solver!r} is not one of {list(HEAD_SOLVERS)}")


def with_head(model: nn.Module, head: nn.Linear, site: str = "") -> nn.Module:
    """``model`` with its classifier ``site`` replaced by ``head`` (in place; returned for chaining); ``ValueError``
    when the head does not take that classifier's feature width."""
    old = _site(model, site).classifier
    if old.in_features != head.in_features:
        raise ValueError(f"with_head: the head takes {head.in_features} features, the model's classifier "
                         f"{old.in_features}")
    if site == "" and not callable(getattr(model, "head_sites", None)):
        adapter_for(model).set_classifier(model, head.to(old.weight.device))
    else:   # a classifier inside a larger model (a depth tier's exit): its parameters, in place
        with torch.no_grad():
            old.weight.copy_(head.weight)
            old.bias.copy_(head.bias)
    return model


def fit_temperature(model: nn.Module, x: torch.Tensor, target_probs: torch.Tensor,
                    grid: tuple[float, ...] = tuple(2.0 ** (k / 2) for k in range(-2, 15)), site: str = "") -> float:
    """Scale ``model``'s classifier (weight and bias, in place) by the temperature of ``grid`` whose softmax is closest
    (``KL(target ‖ model)``) to ``target_probs [N, C]`` on the unlabeled inputs ``x``; returns it.

    A ridge head regresses one-hot labels, so its outputs live on a probability scale (about 0 to 1) and their softmax
    is nearly uniform: the right classes, a poor loss. Matching the clients' ensemble's confidence on the fusion set
    sets the scale without labels; the arg-max, hence the accuracy, does not change."""
    found = _site(model, site)
    head = found.classifier
    with torch.no_grad():
        model.eval()
        z = (found.logits(x) - head.bias).double()   # logits without the bias, so that scaling both is exact
        b = head.bias.double()
        t = target_probs.double().clamp_min(1e-12)
        kls = [float((t * (t.log() - torch.log_softmax(tau * (z + b), -1))).sum(-1).mean()) for tau in grid]
        tau = grid[min(range(len(grid)), key=kls.__getitem__)]
        head.weight.mul_(tau)
        head.bias.mul_(tau)
    return float(tau)


# ------------------------------------------------------------------------------------------- level-wise rounds
def cut_points(model: nn.Module) -> list[int]:
    """The positions in an MLP ``nn.Sequential`` where a fused prefix can end: the index of every ``nn.Linear`` but
    the first (the prefix ``model[:c]`` holds whole hidden levels with their activations). ``ValueError`` for other
    models (level-wise rounds need a chain whose upper part starts with a Linear layer)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"level-wise progressive fusion takes nn.Sequential MLPs, got {type(model).__name__}; "
                         "the head round (K = 2) takes any model family")
    affine = [i for i, m in enumerate(model) if isinstance(m, AFFINE_LAYERS)]
    if any(not isinstance(model[i], nn.Linear) for i in affine):
        raise ValueError("level-wise progressive fusion takes MLPs (Linear layers only); the head round (K = 2) "
                         "takes any model family")
    return affine[1:]


def split(model: nn.Sequential, cut: int) -> tuple[nn.Sequential, nn.Sequential]:
    """``(model[:cut], model[cut:])``, sharing the modules."""
    return model[:cut], model[cut:]


def freeze(module: nn.Module) -> nn.Module:
    """``module`` with ``requires_grad=False`` on every parameter (in place)."""
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def lift_suffix(prefix: nn.Module, own_prefix: nn.Module, suffix: nn.Sequential, x: torch.Tensor,
                ridge: float = DEFAULT_HEAD_RIDGE) -> nn.Sequential:
    """A client's upper levels moved onto the fused ``prefix``: a copy of ``suffix`` whose first Linear layer is
    refitted (ridge regression on the client's inputs ``x``) to map ``prefix(x)`` to what it computed from
    ``own_prefix(x)``, the client's own lower levels. Without it the client's upper levels would read the fused
    features as if they were its own neurons."""
    first = suffix[0]
    if not isinstance(first, nn.Linear):
        raise ValueError(f"lift_suffix: the upper part must start with nn.Linear, starts with {type(first).__name__}")
    with torch.no_grad():
        f = prefix(x).flatten(1).double()
        target = first(own_prefix(x)).double()
    if f.shape[1] != first.in_features:
        raise ValueError(f"lift_suffix: the fused prefix gives {f.shape[1]} features, the upper part takes "
                         f"{first.in_features}")
    f1 = _with_bias(f)
    wb = _ridge_solve(f1.T @ f1, f1.T @ target, ridge * len(f))
    lifted = copy.deepcopy(suffix)
    with torch.no_grad():
        lifted[0].weight.copy_(wb[:-1].T.float())
        lifted[0].bias.copy_(wb[-1].float())
    return lifted


def fuse_suffixes(method: str, prefix: nn.Module, suffixes: list[nn.Module], fusion_inputs: torch.Tensor,
                  weights=None, seed: int = 0, device: str | torch.device = "cpu", **options) -> nn.Sequential:
    """The fused model ``prefix → fuse(method, suffixes)``: the clients' upper parts (all trained on the same frozen
    ``prefix``) fused on the fusion set passed through the prefix. The prefix is shared, not copied."""
    with torch.no_grad():
        inner = prefix.eval()(fusion_inputs)
    upper = fuse(method, suffixes, fusion_inputs=inner, weights=weights, seed=seed, device=device, **options)
    return nn.Sequential(*prefix, *upper)


def model_equivalents(numbers: int, model: nn.Module) -> float:
    """``numbers`` as a fraction of ``model``'s parameter count (communication in model-equivalents)."""
    return numbers / sum(p.numel() for p in model.parameters())


__all__ = ["HeadStatistics", "HeadSite", "SiteView", "head_sites", "head_statistics", "solve_head", "solve_lda_head",
           "solve_classifier", "HEAD_SOLVERS", "with_head",
           "copy_head", "features", "fit_temperature", "cut_points", "split",
           "freeze", "lift_suffix", "fuse_suffixes", "model_equivalents", "DEFAULT_HEAD_RIDGE"]
