"""``auto``: a fusion that chooses its own method, label-free, by agreement with the clients' ensemble.

The server has no labels, but it has the clients' ensemble: on unlabeled inputs the ensemble's averaged softmax is
what every fusion tries to reproduce in one model (FedDF, Lin et al., "Ensemble Distillation for Robust Model
Fusion in Federated Learning", arXiv 2006.07242, distils it; neuron interpolation, arXiv 2507.00037, and OT fusion,
arXiv 1910.05653, align to it implicitly). ``auto`` therefore:

1. splits the fusion set (seeded) into a fit part and a held-out part (``holdout``);
2. takes the weighted average and measures the clients' disagreement ``KL(ensemble ‖ average)`` on the held-out
   part. When it is at most ``agree_kl`` (clients that stayed in one basin: multi-round FL from a shared model)
   the average is the answer at the cost of the average;
3. otherwise fuses with every applicable ``candidates`` method on the fit part (within ``max_seconds``), scores
   each on the held-out part by ``KL(ensemble ‖ candidate)`` and keeps the lowest.

Scores given to ``fuse`` are passed to the candidates that read them; ``auto`` does not itself depend on them (a
strategy running it does not ask the clients for scores). Clients of different widths have no average: the
candidates that take mixed widths are tried (into model 0's architecture).

``info`` says what was tried (``auto-scores``: held-out KL per candidate; ``auto-skipped``: why a candidate did not
run), the disagreement and the choice (``auto-choice``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedfuse.fusion.average import average_state_dicts
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.fusion.refine import kl_to
from fedfuse.fusion.registry import FusionError, FusionOptionError, get_spec, register, require

DEFAULT_CANDIDATES = ("average", "kf-linear", "kf-gradient", "ot", "kd")


@dataclass(frozen=True)
class AutoOptions:
    """Options of ``auto``.

    Attributes:
        candidates: the fusion methods tried when the clients disagree, in order (each with its default options;
            methods that cannot take the models are skipped and reported).
        holdout: fraction of the fusion set held out to score the candidates (the rest fits them).
        agree_kl: disagreement ``KL(ensemble ‖ average)`` on the held-out part (nats) at or below which the average
            is taken without trying the other candidates.
        max_seconds: time budget for the candidates after the average (0 = none); candidates not started within it
            are skipped and reported.
        validation: optional labelled validation sets ``[(x_i [N_i, ...], y_i [N_i]), ...]`` (e.g. one per client:
            federated validation). With them every candidate is tried (no agreement shortcut), fitted on the whole
            fusion set, and the one with the highest sample-weighted validation accuracy is kept (``auto-accuracy``).
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    holdout: float = 0.3
    agree_kl: float = 0.02
    max_seconds: float = 0.0
    validation: Any = None

    def __post_init__(self) -> None:
        require(0 < self.holdout < 1, "holdout", "in (0, 1)", self.holdout)
        require(self.agree_kl >= 0, "agree_kl", ">= 0", self.agree_kl)
        require(self.max_seconds >= 0, "max_seconds", ">= 0", self.max_seconds)
        require(len(self.candidates) > 0, "candidates", "at least one method", self.candidates)
        if self.validation is not None:
            ok = isinstance(self.validation, (list, tuple)) and len(self.validation) > 0 and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and torch.is_tensor(p[0]) and torch.is_tensor(p[1])
                and p[0].shape[0] == p[1].shape[0] > 0 for p in self.validation)
            require(ok, "validation", "a non-empty list of (x [N, ...], y [N]) tensor pairs", type(self.validation))
        for name in self.candidates:
            if name == "auto":
                raise FusionOptionError("auto: option 'candidates' cannot contain 'auto'")
            try:
                spec = get_spec(name)
            except FusionError as exc:
                raise FusionOptionError(f"auto: option 'candidates': {exc}") from None
            if not spec.same_architecture:
                raise FusionOptionError(f"auto: option 'candidates': {name!r} does not return one model of the "
                                        "global architecture")


def split_fusion_set(x: torch.Tensor, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fit part, held-out part)`` of the fusion set ``x [B, ...]``, a seeded permutation (each part ≥ 1)."""
    n = int(x.shape[0])
    if n < 2:
        raise FusionOptionError(f"auto: the fusion set has {n} sample(s); it needs at least 2 (fit + held-out)")
    k = min(n - 1, max(1, round(n * holdout)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return x[perm[k:]], x[perm[:k]]


@register("auto", options=AutoOptions, mixed_widths=True)
def fuse_auto(models, *, fusion_inputs, scores, weights, device, seed, options: AutoOptions,
              info: dict) -> nn.Module:
    """The candidate that agrees best with the clients' ensemble on a held-out part of the fusion set (see the
    module docstring). Fusing copies of one model returns it (their disagreement is 0: the average)."""
    # the package entry point runs each candidate (its checks, seeding, finite check); imported here because the
    # package imports this module while it registers the methods
    from fedfuse.fusion import fuse_result

    x = torch.as_tensor(fusion_inputs).float()
    if options.validation is not None:
        return _by_validation(models, x, scores, weights, device, seed, options, info)
    fit, held = split_fusion_set(x, options.holdout, seed)
    members = [m.cpu().eval() for m in models]
    with torch.no_grad():
        target = teacher_probs(members, held, weights)
    scores_kl: dict[str, float] = {}
    skipped: dict[str, str] = {}
    seconds: dict[str, float] = {}
    best: tuple[float, str, nn.Module] | None = None
    t_start = time.perf_counter()
    try:
        average = _average(members, weights)
        with torch.no_grad():
            disagreement = kl_to(target, average(held))
        scores_kl["average"] = disagreement
        best = (disagreement, "average", average)
    except FusionError as exc:   # e.g. clients of different widths: no average to measure against
        disagreement = float("inf")
        skipped["average"] = str(exc)
    info["auto-disagreement"] = disagreement
    if disagreement > options.agree_kl:
        for name in options.candidates:
            if name == "average" or name in skipped:
                continue
            if options.max_seconds and time.perf_counter() - t_start > options.max_seconds:
                skipped[name] = f"time budget of {options.max_seconds:g} s spent"
                continue
            try:
                res = fuse_result(name, members, fusion_inputs=fit, scores=scores, weights=weights, device=device,
                                  seed=seed)
            except FusionError as exc:
                skipped[name] = f"{type(exc).__name__}: {exc}"
                continue
            seconds[name] = res.seconds
            with torch.no_grad():
                logits = res.model(held)
            kl = kl_to(target, logits) if bool(torch.isfinite(logits).all()) else float("inf")
            scores_kl[name] = kl
            if best is None or kl < best[0]:
                best = (kl, name, res.model)
    if best is None:
        raise FusionError(f"auto: no candidate could fuse these models ({skipped})")
    info.update({"auto-choice": best[1], "auto-scores": scores_kl, "auto-seconds": seconds})
    if skipped:
        info["auto-skipped"] = skipped
    return best[2]


def validation_accuracy(model: nn.Module, validation) -> float:
    """Sample-weighted accuracy of ``model`` over the ``(x, y)`` validation sets."""
    correct = total = 0
    with torch.no_grad():
        for x, y in validation:
            pred = model(torch.as_tensor(x).float()).argmax(-1)
            correct += int((pred == torch.as_tensor(y)).sum())
            total += int(len(y))
    return correct / total


def _by_validation(models, x, scores, weights, device, seed, options: AutoOptions, info: dict) -> nn.Module:
    """Every candidate fitted on the whole fusion set, kept by validation accuracy (labels: no ensemble proxy)."""
    from fedfuse.fusion import fuse_result

    members = [m.cpu().eval() for m in models]
    accuracy: dict[str, float] = {}
    skipped: dict[str, str] = {}
    seconds: dict[str, float] = {}
    best: tuple[float, str, nn.Module] | None = None
    t_start = time.perf_counter()
    for name in options.candidates:
        if options.max_seconds and time.perf_counter() - t_start > options.max_seconds:
            skipped[name] = f"time budget of {options.max_seconds:g} s spent"
            continue
        try:
            res = fuse_result(name, members, fusion_inputs=x, scores=scores, weights=weights, device=device, seed=seed)
        except FusionError as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        seconds[name] = res.seconds
        acc = validation_accuracy(res.model, options.validation)
        accuracy[name] = acc
        if best is None or acc > best[0]:
            best = (acc, name, res.model)
    if best is None:
        raise FusionError(f"auto: no candidate could fuse these models ({skipped})")
    info.update({"auto-choice": best[1], "auto-accuracy": accuracy, "auto-seconds": seconds})
    if skipped:
        info["auto-skipped"] = skipped
    return best[2]


def _average(models: list[nn.Module], weights: list[float]) -> nn.Module:
    out = copy.deepcopy(models[0])
    out.load_state_dict(average_state_dicts([m.state_dict() for m in models], weights))
    return out.eval()


__all__ = ["AutoOptions", "fuse_auto", "split_fusion_set", "DEFAULT_CANDIDATES"]
