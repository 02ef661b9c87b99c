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
   each on the held-out part and keeps the best: by default (``criterion="agreement"``) the share of held-out
   inputs on which the candidate's top class is the ensemble's (ties: the earlier candidate), or with
   ``criterion="kl"`` the lowest ``KL(ensemble ‖ candidate)``;
4. fuses the chosen method again on the whole fusion set (``refit``): the held-out part chose it, and a fusion
   fitted on 70 % of the set is a worse model than the same method fitted on all of it.

Why top-1 agreement: the KL is what distillation (``kd``, ``feddf``) minimises on the fit part, so it ranks the
distilled candidates first whatever their accuracy (on the MNIST-1D one-shot cells the lowest KL picked ``kd`` or
``ot`` and lost 5–15 points to ``kf-linear``). Top-1 agreement ranks by what the ensemble predicts, not by how
closely a candidate copies its probabilities: with distillation among the candidates it keeps ``kf-linear`` on the
MNIST-1D cells, where neuron interpolation is the best one-shot method, and takes ``kd`` on the Fashion-MNIST LeNet
cells, where distillation is (docs/one-shot.md, "Which candidates the label-free auto tries"). Hence the default
candidates: ``kf-linear`` (neuron interpolation in closed form), ``feddf`` and ``kd`` (distillation into the average
and into model 0), the weighted average always tried first.

Scores given to ``fuse`` are passed to the candidates that read them; ``auto`` does not itself depend on them (a
strategy running it does not ask the clients for scores). Clients of different widths have no average: the
candidates that take mixed widths are tried (into model 0's architecture).

``info`` says what was tried (``auto-scores``: held-out KL per candidate; ``auto-skipped``: why a candidate did not
run), the disagreement, the choice (``auto-choice``) and the refit's seconds (``auto-refit``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from fedfuse.choices import REFINES
from fedfuse.fusion.distillation import teacher_probs
from fedfuse.fusion.refine import kl_to
from fedfuse.fusion.registry import FusionError, FusionOptionError, get_spec, register, require, warn_caller

DEFAULT_CANDIDATES = ("average", "kf-linear", "feddf", "kd")
CRITERIA = ("agreement", "kl")


@dataclass(frozen=True)
class AutoOptions:
    """Options of ``auto``.

    Attributes:
        candidates: the fusion methods tried when the clients disagree, in order (each with its default options;
            methods that cannot take the models are skipped and reported).
        holdout: fraction of the fusion set held out to score the candidates (the rest fits them).
        agree_kl: disagreement ``KL(ensemble ‖ average)`` on the held-out part (nats) at or below which the average
            is taken without trying the other candidates.
        refines: the refinements each candidate is tried with (``fedfuse.fusion.refine``: ``"none"``,
            ``"calibrate"``, ``"distill"``, ``"calibrate+distill"``...): candidates × refines, named
            ``"<method>+<refine>"`` in ``info`` (plain ``<method>`` for ``"none"``). Default ``("none",)``: distillation
            minimises the very KL to the ensemble the label-free choice compares, so it is a fair candidate only under
            ``validation``.
        criterion: how the held-out part ranks the candidates: ``"agreement"`` (share of inputs whose top class is
            the ensemble's) or ``"kl"`` (``KL(ensemble ‖ candidate)``, lower is better).
        max_seconds: time budget for the candidates after the average (0 = none); candidates not started within it
            are skipped and reported.
        validation: optional labelled validation sets ``[(x_i [N_i, ...], y_i [N_i]), ...]`` (e.g. one per client:
            federated validation), or one set ``(x, y)`` (``validation_sets``). With them every candidate is tried (no
            agreement shortcut), fitted on the whole fusion set, and the one with the highest sample-weighted validation
            accuracy is kept (``auto-accuracy``).
        refit: without ``validation``, fuse the chosen candidate again on the whole fusion set and return that model
            (``auto-refit``: its seconds); ``False`` returns the candidate as fitted on the fit part (the model the
            held-out scores describe).
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    holdout: float = 0.3
    agree_kl: float = 0.02
    max_seconds: float = 0.0
    validation: Any = None
    criterion: str = "agreement"
    refines: tuple[str, ...] = ("none",)
    refit: bool = True

    def __post_init__(self) -> None:
        require(0 < self.holdout < 1, "holdout", "in (0, 1)", self.holdout)
        require(self.agree_kl >= 0, "agree_kl", ">= 0", self.agree_kl)
        require(self.max_seconds >= 0, "max_seconds", ">= 0", self.max_seconds)
        require(self.criterion in CRITERIA, "criterion", f"one of {CRITERIA}", self.criterion)
        require(isinstance(self.refines, (list, tuple)) and len(self.refines) > 0
                and all(r in REFINES and r != "auto" for r in self.refines), "refines",
                f"a non-empty list of {[r for r in REFINES if r != 'auto']}", self.refines)
        require(len(self.candidates) > 0, "candidates", "at least one method", self.candidates)
        require(isinstance(self.refit, bool), "refit", "True or False", self.refit)
        if self.validation is not None:
            object.__setattr__(self, "validation", validation_sets(self.validation))   # frozen: set once, here
            for i, (x, y) in enumerate(self.validation):
                if not x.is_floating_point() or not bool(torch.isfinite(x).all()):
                    what = "NaN or infinite values" if x.is_floating_point() else f"dtype {x.dtype}"
                    raise FusionOptionError(f"auto: option 'validation': set {i}'s inputs x have {what}; every "
                                            "candidate would score the same accuracy on them and 'average' would "
                                            "win silently (need finite floating-point inputs)")
                if y.dim() != 1 or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
                    raise FusionOptionError(f"auto: option 'validation': set {i}'s labels y must be a 1-D integer "
                                            f"tensor of class indices, got dtype {y.dtype} shape {tuple(y.shape)}")
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


def _what(value: Any) -> str:
    return f"a tensor of shape {list(value.shape)}" if torch.is_tensor(value) else f"a {type(value).__name__}"


def validation_sets(validation: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``validation`` as a list of ``(x [N, ...], y [N])`` tensor pairs; one pair ``(x, y)`` of tensors is one set.
    ``FusionOptionError`` saying what is wrong with which set otherwise (the shape of the list, a set that is not a
    pair of tensors, inputs and labels of different lengths, an empty set)."""
    if isinstance(validation, (list, tuple)) and len(validation) == 2 and all(torch.is_tensor(t) for t in validation):
        validation = [tuple(validation)]   # one (x, y) set
    if not isinstance(validation, (list, tuple)) or not validation:
        raise FusionOptionError(f"auto: option 'validation' must be a non-empty list of (x [N, ...], y [N]) tensor "
                                f"pairs, or one such pair; got {_what(validation)}"
                                + (" (empty)" if isinstance(validation, (list, tuple)) else ""))
    sets = []
    for i, pair in enumerate(validation):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(torch.is_tensor(t) for t in pair)):
            got = (f"{len(pair)} items" if isinstance(pair, (list, tuple)) and len(pair) != 2
                   else ", ".join(map(_what, pair)) if isinstance(pair, (list, tuple)) else _what(pair))
            raise FusionOptionError(f"auto: option 'validation': set {i} must be a pair (x [N, ...], y [N]) of "
                                    f"tensors, got {got}")
        x, y = pair
        if x.dim() == 0 or y.dim() != 1:
            raise FusionOptionError(f"auto: option 'validation': set {i} must be x [N, ...] and y [N] (one label per "
                                    f"input), got x of shape {list(x.shape)} and y of shape {list(y.shape)}")
        if x.shape[0] != y.shape[0]:
            raise FusionOptionError(f"auto: option 'validation': set {i} has {x.shape[0]} inputs (x) but "
                                    f"{y.shape[0]} labels (y); give one label per input")
        if x.shape[0] == 0:
            raise FusionOptionError(f"auto: option 'validation': set {i} is empty (0 inputs)")
        sets.append((x, y))
    return sets


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
    """The candidate that agrees best with the clients' ensemble on a held-out part of the fusion set, or with
    ``validation`` the most accurate one (see the module docstring). Fusing copies of one model returns it (their
    disagreement is 0: the average)."""
    x = torch.as_tensor(fusion_inputs).float()
    members = [m.cpu().eval() for m in models]
    if options.validation is not None:
        check_validation(members[0], options.validation)
    trial = _Trial(members, scores, weights, device, seed, options.max_seconds)
    if options.validation is not None:   # labels: every candidate fitted on the whole fusion set, most accurate kept
        for name in _variants(options):
            trial.run(name, x, lambda _, model: validation_accuracy(model, options.validation))
        info["auto-accuracy"] = trial.values
    else:   # label-free: agreement with the ensemble on the held-out part, the average first (and alone if agreeing)
        fit, held = split_fusion_set(x, options.holdout, seed)
        with torch.no_grad():
            target = teacher_probs(members, held, weights)

        kls: dict[str, float] = {}
        agreements: dict[str, float] = {}

        def held_out_score(name: str, model: nn.Module) -> float:
            with torch.no_grad():
                logits = model(held)
            if not bool(torch.isfinite(logits).all()):
                kls[name], agreements[name] = float("inf"), 0.0
                return float("-inf")
            kls[name] = kl_to(target, logits)
            agreements[name] = float((logits.argmax(-1) == target.argmax(-1)).float().mean())
            return -kls[name] if options.criterion == "kl" else agreements[name]

        trial.run("average", fit, held_out_score, timed=False)
        disagreement = kls.get("average", float("inf"))
        info["auto-disagreement"] = disagreement
        if disagreement > options.agree_kl:
            for name in _variants(options):
                if name != "average":
                    trial.run(name, fit, held_out_score)
        info["auto-scores"] = kls   # held-out KL (lower is better)
        info["auto-agreement"] = agreements   # held-out top-1 agreement with the ensemble (higher is better)
        info["auto-criterion"] = options.criterion
    if trial.best is None:
        raise FusionError(f"auto: no candidate could fuse these models ({trial.skipped})")
    info.update({"auto-choice": trial.best[1], "auto-seconds": trial.seconds})
    if trial.skipped:
        info["auto-skipped"] = trial.skipped
    if options.validation is None and options.refit and trial.best[1] != "average":
        return trial.refit(x, info)
    return trial.best[2]


class _Trial:
    """The candidates tried so far: each one's value (higher is better), seconds and why one was skipped, and the
    best (value, name, model)."""

    def __init__(self, members, scores, weights, device, seed, max_seconds: float) -> None:
        self.members, self.scores, self.weights, self.device, self.seed = members, scores, weights, device, seed
        self.max_seconds = max_seconds
        self.t_start = time.perf_counter()
        self.values: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.skipped: dict[str, str] = {}
        self.best: tuple[float, str, nn.Module] | None = None

    def _fuse(self, name: str, inputs: torch.Tensor):
        """``fuse_result`` of candidate ``name`` (``"<method>"`` or ``"<method>+<refine>"``) on ``inputs``: the
        package entry point, with its checks, seeding and finite check."""
        from fedfuse.fusion import fuse_result  # deferred: cycle (the package imports this module to register it)

        method, _, refine = name.partition("+")
        return fuse_result(method, self.members, fusion_inputs=inputs, scores=self.scores, weights=self.weights,
                           device=self.device, seed=self.seed, refine=refine or None)

    def refit(self, inputs: torch.Tensor, info: dict) -> nn.Module:
        """The chosen candidate fused again on ``inputs`` (the whole fusion set); if that fusion fails, the model
        fitted on the fit part, with the reason in ``info["auto-refit"]`` and a warning."""
        name = self.best[1]
        try:
            res = self._fuse(name, inputs)
        except FusionError as exc:
            info["auto-refit"] = f"failed, the fit-part model kept: {type(exc).__name__}: {exc}"
            warn_caller(f"auto: refitting {name!r} on the whole fusion set failed ({exc}); the model fitted on "
                        "the fit part is returned", RuntimeWarning)
            return self.best[2]
        info["auto-refit"] = res.seconds
        return res.model

    def run(self, name: str, inputs: torch.Tensor, value: Callable[[str, nn.Module], float],
            timed: bool = True) -> None:
        """Fuse with ``name`` on ``inputs`` (the package entry point: its checks, seeding and finite check) and
        score the result; a method that cannot take the models, or the spent time budget, skips it."""
        if timed and self.max_seconds and time.perf_counter() - self.t_start > self.max_seconds:
            self.skipped[name] = f"time budget of {self.max_seconds:g} s spent"
            return
        try:
            res = self._fuse(name, inputs)
        except FusionError as exc:
            self.skipped[name] = f"{type(exc).__name__}: {exc}"
            return
        if timed:
            self.seconds[name] = res.seconds
        v = value(name, res.model)
        self.values[name] = v
        if self.best is None or v > self.best[0]:
            self.best = (v, name, res.model)


def _variants(options: AutoOptions) -> list[str]:
    """The candidates × refines, as ``"<method>"`` or ``"<method>+<refine>"``."""
    return [m if r == "none" else f"{m}+{r}" for m in options.candidates for r in options.refines]


def check_validation(model: nn.Module, validation) -> None:
    """Every ``(x, y)`` validation set fits ``model`` (model 0): its inputs map to logits, and its labels are class
    indices of those logits; ``FusionOptionError`` (a ``FusionError``) saying why otherwise. Labels out of range
    scored every candidate 0 on them, so ``average`` (the first) won silently; a wrong x shape was a raw
    ``RuntimeError``."""
    for i, (x, y) in enumerate(validation):
        x = torch.as_tensor(x).float()
        try:
            with torch.no_grad():
                out = model(x[:2])
        except (RuntimeError, ValueError, IndexError) as exc:
            raise FusionOptionError(f"auto: option 'validation': model 0 cannot take set {i}'s inputs of shape "
                                    f"{list(x.shape)} (samples of shape {list(x.shape[1:])}): "
                                    f"{str(exc).splitlines()[0]}") from None
        classes = int(out.shape[-1])
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= classes:
            raise FusionOptionError(f"auto: option 'validation': set {i}'s labels span [{lo}, {hi}], but the models "
                                    f"have {classes} classes (0..{classes - 1})")


def validation_accuracy(model: nn.Module, validation) -> float:
    """Sample-weighted accuracy of ``model`` over the ``(x, y)`` validation sets."""
    correct = total = 0
    with torch.no_grad():
        for x, y in validation:
            pred = model(torch.as_tensor(x).float()).argmax(-1)
            correct += int((pred == torch.as_tensor(y)).sum())
            total += int(len(y))
    return correct / total


__all__ = ["AutoOptions", "fuse_auto", "split_fusion_set", "validation_sets", "check_validation", "validation_accuracy", "DEFAULT_CANDIDATES", "CRITERIA"]
