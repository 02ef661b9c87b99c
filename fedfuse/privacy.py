"""The private head round: the closed-form classifier's sufficient statistics released under client-level
differential privacy (Gaussian mechanism), so that a DP run's head round is covered by the same (ε, δ) account as
its training rounds.

The head round (``fedfuse.progressive``) sums every client's ``Σ f fᵀ`` and ``Σ f onehot(y)ᵀ`` and solves the
classifier from the sum. Released in the clear, one client's contribution is unbounded (more samples, larger
features) and carries its class counts. The private form bounds it and noises the sum — "sufficient statistics
perturbation" for linear regression (Vu and Slavković, "Differential Privacy for Clinical Trial Data", 2009; Wang,
"Revisiting differentially private linear regression: optimal and adaptive prediction & estimation in unbounded
domain", arXiv 1803.02596, whose AdaSSP also sets the ridge from the noise level, as done here):

- **client** (``private_head_statistics``): every sample's feature vector is clipped to norm ``clip`` and divided
  by it (``u = f · min(1, clip/‖f‖) / clip``, ``‖u‖ ≤ 1``), the constant 1 is appended, and the client sends the
  *means* over its samples, ``Ā = mean ũ ũᵀ`` and ``B̄ = mean ũ onehot(y)ᵀ``. Then ``‖Ā‖_F ≤ 2`` and
  ``‖B̄‖_F ≤ √2`` whatever the client's data and size: adding or removing one client moves the pair by at most
  ``HEAD_SENSITIVITY = √6`` (L2). Each client weighs as one, like the uniform average Flower's DP wrappers noise.
- **server** (``noisy_head_sum``): sums the clients' pairs and adds Gaussian noise of standard deviation
  ``noise_multiplier · √6`` to every number sent (the Gram matrix's upper triangle and the cross term), projects the
  Gram matrix onto the positive semi-definite cone (post-processing) and adds the noise's expected spectral norm
  to its diagonal as ridge (AdaSSP). The result is a ``HeadStatistics`` whose sample count is the number of
  clients; ``solve_classifier`` solves it as usual, and ``raw_feature_head`` turns the head on ``u`` back into one
  on the model's features.

One release is one Gaussian mechanism of noise multiplier ``noise_multiplier`` (sensitivity-normalised), to be
composed with the rounds' releases by the caller's accountant (``fedfuse.flower.trust.privacy``). The clip bound should
not come from the clients' data: the Flower integration takes the median feature norm of the global model on the
server's own inputs (``feature_clip_bound``). This module imports no Flower.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedfuse.progressive import HeadStatistics, features

HEAD_SENSITIVITY = math.sqrt(6.0)   # L2 bound of one client's (Ā, B̄): ‖Ā‖_F ≤ 2, ‖B̄‖_F ≤ √2


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"private head round: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def clip_rows(f: torch.Tensor, clip: float) -> torch.Tensor:
    """``[N, d]`` rows scaled to norm at most ``clip``, then divided by ``clip`` (every row's norm ≤ 1)."""
    clip = _check_positive("clip", clip)
    norms = f.norm(dim=1, keepdim=True)
    return f * torch.clamp(clip / norms.clamp_min(1e-300), max=1.0) / clip


def private_head_statistics(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, clip: float,
                            batch_size: int = 512, device: str | torch.device = "cpu", site: str = "",
                            projection: torch.Tensor | None = None) -> HeadStatistics:
    """One client's bounded head statistics (module docstring): the means over its samples of ``ũ ũᵀ`` and
    ``ũ onehot(y)ᵀ`` with ``ũ = [clipped g / clip, 1]``, ``g = f P`` (``projection`` ``P`` ``[d, k]``, the server's
    ``public_projection``) or ``g = f``; ``num_examples`` 1 (the client counts as one, and its sample count is not
    sent). ``ValueError`` for labels out of range, no samples or a projection that does not fit the features."""
    y = torch.as_tensor(y).long()
    if len(x) != len(y) or len(y) == 0:
        raise ValueError(f"private head statistics: need as many labels as inputs (> 0), got {len(x)} inputs, "
                         f"{len(y)} labels")
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ValueError(f"private head statistics: labels must be in [0, {num_classes}), got "
                         f"[{int(y.min())}, {int(y.max())}]")
    u = clip_rows(_project(features(model, x, batch_size, device, site), projection), clip)
    u = torch.cat([u, torch.ones(len(u), 1, dtype=u.dtype)], 1)
    n = float(len(y))
    gram = u.T @ u / n
    gram[-1, -1] = 1.0   # exactly: the constant's mean square (HeadStatistics checks it against num_examples)
    return HeadStatistics(gram, u.T @ nn.functional.one_hot(y, num_classes).double() / n, 1)


def check_bounded(stats: HeadStatistics, tol: float = 1e-6) -> None:
    """``ValueError`` unless ``stats`` is one client's bounded pair (``num_examples`` 1, ``‖Ā‖_F ≤ 2``,
    ``‖B̄‖_F ≤ √2``, non-negative cross terms on the constant row summing to 1): a reply that would break the
    mechanism's sensitivity is rejected, not noised."""
    if stats.num_examples != 1:
        raise ValueError(f"private head statistics must count the client as 1 sample, got {stats.num_examples}")
    g, c = stats.gram, stats.cross
    if float(g.norm()) > 2.0 + tol or float(c.norm()) > math.sqrt(2.0) + tol:
        raise ValueError(f"private head statistics exceed their bound: |gram|_F = {float(g.norm()):.4g} (<= 2), "
                         f"|cross|_F = {float(c.norm()):.4g} (<= 1.414)")
    if float(c[-1].min()) < -tol or abs(float(c[-1].sum()) - 1.0) > 1e-4:
        raise ValueError("private head statistics: the class frequencies (the constant's row of cross) must be "
                         ">= 0 and sum to 1")


def noise_std(noise_multiplier: float) -> float:
    """The Gaussian noise's standard deviation on every number of the summed statistics."""
    return _check_positive("noise_multiplier", noise_multiplier) * HEAD_SENSITIVITY


def bounded_sum(stats: list[HeadStatistics]) -> HeadStatistics:
    """The clients' bounded statistics (``private_head_statistics``; each checked by ``check_bounded``) summed, no
    noise: what a secure sum of them gives the server (``num_examples`` = the number of clients)."""
    if not stats:
        raise ValueError("private head round: no client statistics")
    for s in stats:
        check_bounded(s)
    shapes = {(tuple(s.gram.shape), tuple(s.cross.shape)) for s in stats}
    if len(shapes) != 1:
        raise ValueError(f"private head round: the clients' statistics have different shapes {sorted(shapes)}")
    return HeadStatistics(sum(s.gram for s in stats).clone(), sum(s.cross for s in stats).clone(), len(stats))


def noisy_head_sum(stats: list[HeadStatistics], noise_multiplier: float,
                   generator: torch.Generator | None = None) -> HeadStatistics:
    """The clients' bounded statistics (``private_head_statistics``) summed (``bounded_sum``) and noised
    (``add_noise``)."""
    return add_noise(bounded_sum(stats), noise_multiplier, generator)


def add_noise(total: HeadStatistics, noise_multiplier: float,
              generator: torch.Generator | None = None) -> HeadStatistics:
    """The sum of ``total.num_examples`` clients' bounded statistics with Gaussian noise of standard deviation
    ``noise_multiplier · HEAD_SENSITIVITY`` on each number a client sends (the Gram matrix's upper triangle, mirrored,
    and the cross term), then post-processed: the Gram matrix projected onto the PSD cone plus the noise matrix's
    expected spectral norm ``2 σ √(d+1)`` on the feature diagonal (AdaSSP's ridge), the constant's entry set to the
    number of clients (public: who answered)."""
    std = noise_std(noise_multiplier)
    gram, cross, clients = total.gram.clone(), total.cross.clone(), int(total.num_examples)
    d1 = gram.shape[0]
    i, j = torch.triu_indices(d1, d1)
    upper = torch.randn(len(i), dtype=torch.float64, generator=generator) * std
    noise = torch.zeros(d1, d1, dtype=torch.float64)
    noise[i, j] = upper
    noise[j, i] = upper
    gram = gram + noise
    cross = cross + torch.randn(cross.shape, dtype=torch.float64, generator=generator) * std
    evals, evecs = torch.linalg.eigh(0.5 * (gram + gram.T))
    gram = (evecs * evals.clamp_min(0.0)) @ evecs.T
    ridge = 2.0 * std * math.sqrt(d1)
    gram = gram + torch.diag(torch.cat([torch.full((d1 - 1,), ridge, dtype=torch.float64),
                                        torch.zeros(1, dtype=torch.float64)]))
    gram[-1, -1] = float(clients)
    gram = 0.5 * (gram + gram.T)
    return HeadStatistics(gram, cross, clients)


def _project(f: torch.Tensor, projection: torch.Tensor | None) -> torch.Tensor:
    if projection is None:
        return f
    if projection.dim() != 2 or projection.shape[0] != f.shape[1]:
        raise ValueError(f"private head round: the projection has shape {tuple(projection.shape)}, the features "
                         f"{f.shape[1]} columns")
    return f @ projection.to(f.dtype)


def public_projection(model: nn.Module, x: torch.Tensor, k: int, site: str = "",
                      device: str | torch.device = "cpu") -> torch.Tensor | None:
    """``[d, k]``: the top ``k`` principal directions of ``model``'s features on the server's own inputs ``x``
    (orthonormal columns; ``None`` when ``k`` is 0 or at least ``d``: no projection). The statistics of ``k``
    projected features carry ``(k+1)(k+2)/2 + (k+1)C`` noised numbers instead of ``(d+1)(d+2)/2 + (d+1)C``, with the
    same per-client bound, so at a given ε the signal of the directions the features actually vary in is kept and
    the noise of the rest is not paid; a subspace found on public data costs no privacy (the client data never
    enters it)."""
    if k < 0:
        raise ValueError(f"private head round: the projection's dimension must be >= 0, got {k}")
    f = features(model, x, device=device, site=site)
    if k == 0 or k >= f.shape[1]:
        return None
    centred = f - f.mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    return vh[:k].T.contiguous()


def raw_feature_head(head: nn.Linear, clip: float, projection: torch.Tensor | None = None) -> nn.Linear:
    """``head`` (solved on the scaled features ``f P / clip``, or ``f / clip`` without ``projection``) as a
    classifier of the model's features ``f``: weight ``W Pᵀ / clip``, the same bias (a new ``nn.Linear(d, C)``
    with a projection, else ``head`` changed in place). Features longer than ``clip`` are not clipped at
    inference: the head reads them as they are."""
    clip = _check_positive("clip", clip)
    if projection is None:
        with torch.no_grad():
            head.weight.div_(clip)
        return head
    out = nn.Linear(projection.shape[0], head.out_features)
    with torch.no_grad():
        out.weight.copy_((head.weight.double() @ projection.double().T / clip).float())
        out.bias.copy_(head.bias)
    return out


def feature_clip_bound(model: nn.Module, x: torch.Tensor, site: str = "", device: str | torch.device = "cpu",
                       projection: torch.Tensor | None = None) -> float:
    """The median norm of ``model``'s pre-logit features (projected by ``projection`` when given) on ``x`` (the
    server's own inputs, never the clients'): the clip bound of the private head round. ``ValueError`` when the
    features are all zero or not finite."""
    if x is None or len(x) == 0:
        raise ValueError("private head round: the clip bound needs server-side inputs (a fusion set or test inputs)")
    norms = _project(features(model, x, device=device, site=site), projection).norm(dim=1)
    bound = float(norms.median())
    if not math.isfinite(bound) or bound <= 0:
        raise ValueError(f"private head round: the model's features on the server's inputs have median norm "
                         f"{bound}: no clip bound")
    return bound


def gaussian_accuracy_noise(noise_multiplier: float, candidates: int) -> float:
    """Standard deviation of the noise on the sum of the clients' accuracy vectors in the private check: each
    client's vector of ``candidates`` accuracies in [0, 1] has L2 norm at most √candidates."""
    return _check_positive("noise_multiplier", noise_multiplier) * math.sqrt(int(candidates))


__all__ = ["HEAD_SENSITIVITY", "clip_rows", "private_head_statistics", "check_bounded", "noise_std",
           "bounded_sum", "noisy_head_sum", "add_noise", "public_projection", "raw_feature_head", "feature_clip_bound", "gaussian_accuracy_noise"]
