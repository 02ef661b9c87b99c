"""Neuron Interpolation fusion: ``hf-linear``, ``kf-linear``, ``hf-gradient``, ``kf-gradient``.

Paper: "Model Fusion via Neuron Interpolation" (arXiv 2507.00037). Implemented:

- Algorithm 1: the fused model ``F`` starts as a copy of model 0 and is built level by level;
  targets come from the parents' own forward passes, inputs from ``F``'s already fused levels.
- grouping (``fedfuse.fusion.grouping``): HF = Hungarian matching of two equal-width
  models; KF = importance-weighted k-means over the neurons of any number of models and widths; the
  classifier level is grouped by identity (class ``c`` ↔ class ``c``).
- importance scores enter the grouping (k-means weights / HF cost) and the targets (weighted mean).
- linear variants: closed-form least squares per affine level on the fused model's own inputs,
  with the parents' outputs projected onto the span of the fused inputs before grouping; eval-mode
  BatchNorm is folded into the fit and written back as an identity BatchNorm, so the result is exact.
- gradient variants: each level (any differentiable block) fitted by Adam/AdamW/SGD on plain MSE
  to the targets, with validation early stopping; the classifier regresses the averaged raw logits.
- the paper's hyperparameters (``setting=1|2``, its Table 9), every one overridable, with one default
  that is not setting 1's: a level without a closed form (a ResNet or ViT block) starts from model 0's
  weights perturbed by ``eps=0.1`` towards a fresh initialisation (setting 2's perturbation), not
  re-initialised (setting 1's ``eps=1``). The paper's reference code never re-initialises a ViT block's
  attention or MLP (its reset touches direct children only) and its VGG scripts use ``eps=0``. Measured in
  ``docs/measurements-fusion.md``: above a fresh start in every four-client one-shot cell, below it with ten
  very skewed clients.

Options beyond the paper (defaults keep the paper's behaviour):

- ``head_target="probs"``: the classifier regresses ``τ·log`` of the weighted *probability* ensemble
  (floored at ``head_floor``, centred) instead of the averaged raw logits (``head_targets``). With
  class-disjoint clients a client's logit for a class it never saw is just "low", and averaging it in
  drags that class down; the probability ensemble is what the ensemble reference actually predicts.
  It helps on class-sharded splits and costs accuracy on others, so it is an option chosen per task on
  federated validation, not the default (measurements: ``docs/measurements-fusion.md``).
- ``match="identity"``: neuron ``j`` ↔ neuron ``j`` in every model (parents that share an
  initialisation, as in multi-round FL); with uniform scores and an overwhelming ``ridge`` the result
  is exactly the weighted average (FedAvg), the least-squares fit being a deviation from it.
- ``head_ridge``: the classifier level's relative ridge (default: ``ridge``).

Memory: only one level's outputs per model are held at a time; the Gram / normal-equation statistics
that the grouping and the least-squares fit need are accumulated in chunks of ``chunk_size`` samples,
so neither the full neuron matrix ``Z`` nor the full design matrix is ever materialised.

A known failure mode (a gradient fit on a skewed fusion set collapses to client 0) is
defended by ``init="auto"``: affine levels start from their closed-form (linear-variant) solution, whose
weights are importance-weighted averages of the parents' refitted weights and so carry every client's
classes, and a level's training only keeps an epoch that improves the validation MSE over that start.
``init="model0"`` gives the paper's/reference code's behaviour (copy of model 0 perturbed by ε).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.choices import OPTIMIZERS
from fedfuse.fusion.interpolation_graph import graph_interpolation
from fedfuse.fusion.registry import (FusionOptionError, IncompatibleModelsError, MissingInputError, register,
                                     require)
from fedfuse.fusion.grouping import (LeastSquares, assignment_matrix, balanced_kmeans, gram_coordinates,
                                     hungarian_match, kernel_least_squares, matching_labels, projected_coordinates,
                                     weighted_kmeans)
from fedfuse.fusion.design import _conv_geometry, design_matrix  # noqa: F401  (public here too)
from fedfuse.importance import neuron_importance
from fedfuse.models.levels import BATCHNORMS, Level, levels as model_levels, neurons_last, neurons_restore
from fedfuse.training import make_optimizer

# the paper's Table 9 (Setting 1: far from the initialisation; Setting 2: small steps from model 0)
SETTINGS: dict[int, dict[str, Any]] = {
    1: dict(optimizer="adamw", lr=1e-3, epochs=100, weight_decay=1e-4, eps=1.0,
            head_optimizer="adamw", head_lr=1e-3, head_epochs=100),
    2: dict(optimizer="sgd", lr=1e-4, epochs=50, weight_decay=1e-4, eps=0.1,
            head_optimizer="adam", head_lr=1e-3, head_epochs=100),
}


# ----------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------

@torch.no_grad()
def _chunked(fn, h: torch.Tensor, chunk: int) -> torch.Tensor:
    """Apply ``fn`` to ``h [B, ...]`` in chunks of ``chunk`` samples; concatenated output ``[B, ...]``."""
    return torch.cat([fn(h[i:i + chunk]) for i in range(0, h.shape[0], chunk)])


def folded_affine(lv: Level, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``[out, in, *k]`` and bias ``[out]`` of ``norm(layer(·))`` with eval-mode BN folded in (of the output
    neurons ``rows``: the same values as those rows of the whole)."""
    w = lv.layer.weight.detach()[rows].double()
    b = lv.layer.bias.detach()[rows].double() if lv.layer.bias is not None else torch.zeros(w.shape[0], dtype=w.dtype,
                                                                                           device=w.device)
    if lv.norm is not None:
        bn = lv.norm
        scale = (bn.weight.detach()[rows].double() if bn.weight is not None else torch.ones_like(b)) / \
            (bn.running_var[rows].double() + bn.eps).sqrt()
        shift = bn.bias.detach()[rows].double() if bn.bias is not None else torch.zeros_like(b)
        w = w * scale.reshape(-1, *([1] * (w.dim() - 1)))
        b = scale * (b - bn.running_mean[rows].double()) + shift
    return w, b


def aligned_parent_weights(lv: Level, prev_labels: torch.Tensor | None, k_prev: int, fused: Level,
                           bias: bool, rows: slice | None = None) -> torch.Tensor | None:
    """A parent's level weights re-expressed on the fused model's inputs: ``[cols, out]`` or ``None``.

    Input neuron ``i`` of the parent was grouped into fused neuron ``prev_labels[i]``, which
    approximates it, so the parent's weights on a group are summed (``prev_labels is None`` at the
    first level, where every model reads the same raw input). Used as the prior of the least-squares
    fit: directions the fusion set does not excite (dead pixels, neurons silent on client 0's data)
    keep the parents' interpolated weights instead of the min-norm zero.

    ``rows``: the columns of these output neurons only, ``[cols, len(rows)]`` (a wide level's prior built block by
    block, ``_prior_blocks``); their group sums are taken by ``index_add`` (the same sums, without the membership
    product's ``[out, in] × [in, k]`` matmul: 100 GFLOP on a VGG-11's first classifier Linear).
    """
    if not lv.affine or type(lv.layer) is not type(fused.layer):
        return None
    w, b = folded_affine(lv, slice(None) if rows is None else rows)
    if prev_labels is not None:
        c_in = prev_labels.shape[0]
        if isinstance(lv.layer, nn.Linear) and w.shape[1] % c_in:
            return None
        if rows is not None:
            grouped = w.reshape(w.shape[0], c_in, -1) if isinstance(lv.layer, nn.Linear) else w
            w = grouped.new_zeros(w.shape[0], k_prev, *grouped.shape[2:]).index_add_(
                1, prev_labels.to(w.device), grouped).reshape(w.shape[0], -1)
        else:
            memb = torch.zeros(c_in, k_prev, dtype=w.dtype, device=w.device)
            memb[torch.arange(c_in, device=w.device), prev_labels.to(w.device)] = 1.0
            if isinstance(lv.layer, nn.Linear):
                w = torch.einsum("ocs,ck->oks", w.reshape(w.shape[0], c_in, -1), memb).reshape(w.shape[0], -1)
            else:
                w = torch.einsum("oc...,ck->ok...", w, memb)
    w = w.reshape(w.shape[0], -1)
    if w.shape[1] != fused.layer.weight[0].numel():
        return None
    if bias:
        w = torch.cat([w, b[:, None]], 1)
    return w.T


def _folded_has_bias(lv: Level) -> bool:
    return lv.layer.bias is not None or lv.norm is not None


def write_affine(lv: Level, w: torch.Tensor) -> None:
    """Write fitted weights ``w [cols, K]`` (last row = bias when present) into ``lv.layer``; an
    eval-mode BatchNorm after it becomes the identity (γ=1, β=0, μ=0, σ²=1−eps) so
    ``lv.run`` computes exactly ``design @ w``. A bias-free layer followed by BN gets its bias in β."""
    layer, norm = lv.layer, lv.norm
    k = w.shape[1]
    has_bias = _folded_has_bias(lv)
    weight = w[:-1] if has_bias else w
    with torch.no_grad():
        layer.weight.copy_(weight.T.reshape(layer.weight.shape))   # copy_ casts: no float32 copy of w on the way
        b = w[-1] if has_bias else None
        if layer.bias is not None:
            layer.bias.copy_(b.to(layer.bias))
        if norm is not None:
            if norm.weight is not None:
                norm.weight.fill_(1.0)
            if norm.bias is not None:
                norm.bias.copy_(b.to(norm.bias) if layer.bias is None else torch.zeros(k))
            elif layer.bias is None:
                raise IncompatibleModelsError(f"linear neuron interpolation: level {lv.name!r} has no place for a bias")
            norm.running_mean.zero_()
            norm.running_var.fill_(1.0 - norm.eps)


def _resize_sequential(model: nn.Sequential, new_widths: dict[int, int]) -> nn.Sequential:
    """Copy of a Linear/Conv ``nn.Sequential`` where affine level ``i`` has ``new_widths[i]`` outputs
    (the next layer's inputs and any BatchNorm follow). Weights of resized layers are freshly
    initialised (they are refit anyway). ``new_widths`` maps level index → width."""
    children = list(model.children())
    out: list[nn.Module] = []
    level = -1
    in_scale: tuple[int, int] | None = None  # (old, new) channel count feeding the next affine layer
    for m in children:
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            level += 1
            old_out = m.out_features if isinstance(m, nn.Linear) else m.out_channels
            new_out = new_widths.get(level, old_out)
            if isinstance(m, nn.Linear):
                in_f = m.in_features
                if in_scale is not None:
                    if in_f % in_scale[0]:
                        raise IncompatibleModelsError("fused_width: cannot resize a Linear fed by a flattened conv "
                                                      f"map ({in_f} inputs from {in_scale[0]} channels)")
                    in_f = in_f // in_scale[0] * in_scale[1]
                new = nn.Linear(in_f, new_out, bias=m.bias is not None)
            else:
                in_c = in_scale[1] if in_scale is not None else m.in_channels
                new = type(m)(in_c, new_out, m.kernel_size, stride=m.stride, padding=m.padding,
                              dilation=m.dilation, groups=m.groups, bias=m.bias is not None,
                              padding_mode=m.padding_mode)
            if new.weight.shape == m.weight.shape:
                new.load_state_dict(m.state_dict())
            out.append(new)
            in_scale = (old_out, new_out)
        elif isinstance(m, BATCHNORMS):
            bn = type(m)(in_scale[1], eps=m.eps, momentum=m.momentum, affine=m.affine,
                         track_running_stats=m.track_running_stats)
            if in_scale[0] == in_scale[1]:
                bn.load_state_dict(m.state_dict())
            out.append(bn)
        else:
            out.append(copy.deepcopy(m))
    return nn.Sequential(*out)


def _fresh_values(model: nn.Module, names: list[str], gen_seed: int) -> dict[str, torch.Tensor]:
    """Freshly initialised values for parameters ``names`` of ``model`` (the ``reset_parameters`` of a copy of
    each module that owns one of them; bare parameters such as a ViT's ``pos_embed`` get N(0, 0.02²)). Only the
    owning modules are copied and reset, not the model: a level's start costs its own size, not the model's."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    reset: dict[str, nn.Module] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(gen_seed)
        for n in names:
            owner, _, leaf = n.rpartition(".")
            mod = modules[owner]
            if hasattr(mod, "reset_parameters"):
                if owner not in reset:
                    reset[owner] = copy.deepcopy(mod)
                    reset[owner].reset_parameters()
                out[n] = getattr(reset[owner], leaf).detach().clone()
            else:
                out[n] = torch.randn_like(getattr(mod, leaf).detach()) * 0.02
    return out


# ----------------------------------------------------------------------------------------------------
# options and scores
# ----------------------------------------------------------------------------------------------------

Optimizer = Literal[OPTIMIZERS]


@dataclass(frozen=True)
class InterpolationOptions:
    """Options of the linear variants ``hf-linear`` / ``kf-linear`` (and the base of the gradient ones).

    Attributes:
        fused_width: hidden widths of the fused model: ``None`` = model 0's, an int for every hidden
            level, a list (one per hidden level) or a table ``{level name or index: width}``; other
            widths than model 0's need an ``nn.Sequential`` model and KF grouping.
        importance: ``"client"`` (the ``scores`` given to ``fuse``), ``"uniform"``, or a method computed
            here on the fusion set (``"conductance"`` | ``"deeplift"``; needs ``fusion_labels``).
        fusion_labels: data, not a setting: ``[B]`` labels of the fusion set for server-side importance.
        normalize_scores: sum-normalise each model's scores per level.
        ridge: relative Tikhonov ridge of the least-squares fits (× mean diagonal of XᵀX). 1e-3 keeps
            multi-round fusion stable (the min-norm pseudo-inverse lets hidden weights grow round after
            round) at a negligible one-shot cost (``docs/measurements-fusion.md``).
        rcond: eigenvalue cut-off of the pseudo-inverse when ``ridge == 0``.
        prior: ``"parents"`` (min-norm deviation from the parents' interpolated weights) | ``"zero"``.
        kmeans_init: KF seeding ``"farthest"`` | ``"kmeans++"`` | ``"model0"`` (model 0's neurons).
        kmeans_restarts: seeded k-means runs per level (the lowest cost is kept).
        hf_cost: HF matching cost ``"exact"`` (two-member grouping cost) | ``"distance"``.
        head_weights: weight each model's class-``c`` logit by its share of class ``c``'s training
            samples (needs ``class_counts``).
        class_counts: data, not a setting: ``[n models][classes]`` training-sample counts per class
            (the Flower strategy fills it from the clients' metrics).
        head_target: classifier target ``"logits"`` (averaged raw logits, the paper) | ``"probs"``
            (τ·log of the probability ensemble, floored and centred; see ``head_targets``).
        match: KF grouping ``"auto"`` (k-means) | ``"balanced"`` (one neuron of every model per
            cluster) | ``"identity"`` (neuron j ↔ j: parents sharing an initialisation).
        head_ridge: the classifier level's relative ridge (``None`` = ``ridge``).
        head_scores: linear variants: the classifier's target for class ``c`` is the mean of the parents'
            class-``c`` logits weighted by their output neurons' importance scores (the paper's Theorem 1;
            default); ``False`` weights them by the models' ``weights`` only (importance still groups and weights
            the hidden levels). Scores of independently trained clients are on different scales (DeepLIFT on each
            client's own validation split), and on MNIST-1D Dirichlet-4 weighting the head by them costs 3.4
            points (``docs/one-shot.md``, "Below the best client").
        head_temperature: τ of ``head_target="probs"``.
        head_floor: probability floor of ``head_target="probs"``, in (0, 1).
        chunk_size: fusion samples per chunk of the accumulated statistics (memory bound).
        importance_batch_size: batch size of server-side importance.
    """

    fused_width: int | list | dict | None = None
    importance: Literal["client", "uniform", "conductance", "deeplift"] = "client"
    fusion_labels: Any = None
    normalize_scores: bool = False
    ridge: float = 1e-3
    rcond: float = 1e-7
    prior: Literal["parents", "zero"] = "parents"
    kmeans_init: Literal["farthest", "kmeans++", "model0"] = "farthest"
    kmeans_restarts: int = 3
    hf_cost: Literal["exact", "distance"] = "exact"
    head_weights: bool = False
    class_counts: Any = None
    head_target: Literal["logits", "probs"] = "logits"
    match: Literal["auto", "balanced", "identity"] = "auto"
    head_ridge: float | None = None
    head_scores: bool = True
    head_temperature: float = 1.0
    head_floor: float = 1e-4
    chunk_size: int = 1024
    importance_batch_size: int = 64

    def __post_init__(self) -> None:
        fw = self.fused_width
        ok = fw is None or (isinstance(fw, int) and not isinstance(fw, bool) and fw >= 1) or (
            isinstance(fw, (list, dict)) and all(isinstance(w, int) and not isinstance(w, bool) and w >= 1
                                                 for w in (fw.values() if isinstance(fw, dict) else fw)))
        require(ok, "fused_width", "None, a width >= 1, a list of widths or a table of widths", fw)
        require(self.ridge >= 0, "ridge", ">= 0", self.ridge)
        require(self.rcond > 0, "rcond", "> 0", self.rcond)
        require(self.kmeans_restarts >= 1, "kmeans_restarts", ">= 1", self.kmeans_restarts)
        require(self.head_ridge is None or self.head_ridge >= 0, "head_ridge", ">= 0 or None", self.head_ridge)
        require(self.head_temperature > 0, "head_temperature", "> 0", self.head_temperature)
        require(0 < self.head_floor < 1, "head_floor", "in (0, 1)", self.head_floor)
        require(self.chunk_size >= 1, "chunk_size", ">= 1", self.chunk_size)
        require(self.importance_batch_size >= 1, "importance_batch_size", ">= 1", self.importance_batch_size)

    def reads_client_scores(self) -> bool:
        """``importance="client"`` reads the given scores; the others compute or ignore them
        (``MethodSpec.reads_client_scores``)."""
        return self.importance == "client"


@dataclass(frozen=True)
class GradientInterpolationOptions(InterpolationOptions):
    """Options of ``hf-gradient`` / ``kf-gradient``: the linear variants' options plus the level fits.

    Attributes:
        setting: hyperparameter setting of the paper's Table 9 (1: AdamW, far from the initialisation;
            2: SGD, small steps from model 0); fills every optimiser option left ``None``.
        optimizer, lr, epochs, weight_decay: hidden levels' fit (``None`` = the setting's).
        eps: a level without a closed form (and every level with ``init="model0"``) starts from
            ``(1 − eps)·model 0 + eps·fresh init``; default 0.1 (``None`` = the setting's: 1.0 / 0.1).
        head_eps: the same for the classifier level when it has no closed form (a ViT's LayerNorm + Linear head;
            the reference code re-initialises it: ``1.0``); ``None`` = ``eps``.
        head_optimizer, head_lr, head_epochs, head_weight_decay: the classifier level's fit
            (``None`` = the setting's; ``head_weight_decay`` = the setting's ``weight_decay``).
        batch_size, val_fraction, patience: minibatches, validation split and early stopping.
        align_residual: reorder ViT residual-stream targets to the closest input dimensions.
        init: ``"auto"`` / ``"closed-form"`` (affine levels start from their closed-form fit: defence
            against collapsing to client 0 on a skewed fusion set) | ``"model0"`` (the paper: model 0 perturbed by ``eps``).
        prox: weight of an L2 pull towards each level's starting point.
        kmeans_init: as for the linear variants, default ``"model0"`` (keeps model 0's neuron order).
    """

    kmeans_init: Literal["farthest", "kmeans++", "model0"] = "model0"
    setting: Literal[1, 2] = 1
    optimizer: Optimizer | None = None
    lr: float | None = None
    epochs: int | None = None
    weight_decay: float | None = None
    eps: float | None = 0.1
    head_eps: float | None = None
    head_optimizer: Optimizer | None = None
    head_lr: float | None = None
    head_epochs: int | None = None
    head_weight_decay: float | None = None
    batch_size: int = 32
    val_fraction: float = 0.1
    patience: int = 15
    align_residual: bool = False
    init: Literal["auto", "closed-form", "model0"] = "auto"
    prox: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.setting in SETTINGS, "setting", f"one of {sorted(SETTINGS)}", self.setting)
        defaults = {**SETTINGS[self.setting], "head_weight_decay": SETTINGS[self.setting]["weight_decay"]}
        for key, value in defaults.items():  # None = the setting's value (frozen: set once, here)
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        for key in ("lr", "head_lr"):
            require(getattr(self, key) > 0, key, "> 0", getattr(self, key))
        for key in ("epochs", "head_epochs", "weight_decay", "head_weight_decay", "prox"):
            require(getattr(self, key) >= 0, key, ">= 0", getattr(self, key))
        require(0 <= self.eps <= 1, "eps", "in [0, 1]", self.eps)
        if self.head_eps is None:
            object.__setattr__(self, "head_eps", self.eps)
        require(0 <= self.head_eps <= 1, "head_eps", "in [0, 1]", self.head_eps)
        require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)
        require(0 <= self.val_fraction < 1, "val_fraction", "in [0, 1)", self.val_fraction)
        require(self.patience >= 0, "patience", ">= 0", self.patience)


def _resolve_scores(models: list[nn.Module], parents_levels: list[list[Level]], scores, weights: list[float],
                    opts: InterpolationOptions, fusion_inputs: torch.Tensor, device: torch.device) -> list[list[torch.Tensor]]:
    """Per model, per level: a ``[width]`` float64 score vector on ``device`` (uniform = ones).

    Scores from the clients (``importance="client"``) or computed here on the fusion set
    (``importance`` = a method name; needs ``fusion_labels`` except for "uniform"). Each model's
    scores are multiplied by ``n · weights[m]`` (no-op for equal weights) and optionally sum-normalised.
    """
    n = len(models)
    if opts.importance == "client":
        dicts = scores
    elif opts.importance == "uniform":
        dicts = None
    elif opts.importance in ("conductance", "deeplift"):
        if opts.fusion_labels is None:
            raise MissingInputError(f"neuron interpolation: importance={opts.importance!r} computed on the server "
                                    "needs fusion_labels")
        y = torch.as_tensor(opts.fusion_labels).long()
        dicts = [neuron_importance(copy.deepcopy(m), fusion_inputs, y, method=opts.importance,
                                   batch_size=opts.importance_batch_size, device=device) for m in models]
    else:  # unreachable: the options' Literal type admits only the four above
        raise AssertionError(opts.importance)
    out = []
    for m in range(n):
        per_level = []
        for lv in parents_levels[m]:
            s = None if dicts is None or dicts[m] is None else dicts[m].get(lv.name)
            s = torch.ones(lv.width) if s is None else torch.as_tensor(s).detach().flatten()
            if s.numel() != lv.width:
                raise MissingInputError(f"neuron interpolation: model {m} level {lv.name!r} has {lv.width} neurons but "
                                 f"{s.numel()} scores")
            s = s.double().clamp_min(0) + 1e-12  # no exactly-zero weight: every neuron keeps a say
            if opts.normalize_scores:
                s = s / s.sum()
            per_level.append((s * (n * weights[m])).to(device))
        out.append(per_level)
    return out


def _head_assignment(opts: InterpolationOptions, widths: list[int], s: torch.Tensor, weights: list[float], fit: str,
                     device: torch.device) -> torch.Tensor:
    """``A [n·C, C]`` of the classifier level: class ``c`` ↔ class ``c`` in every model (identity grouping).

    Default: linear = importance-weighted mean of the parents' class-``c`` outputs (Theorem 1 with the
    head's scores; ``head_scores=False``: weighted by ``weights`` only); gradient = the ``weights``-weighted average of the raw logits.
    ``head_weights=True``: model ``m``'s class-``c`` output is weighted by
    the fraction of all training samples of class ``c`` that model ``m`` held (``class_counts``), so a
    class's target logit comes from the clients that trained on it (a class nobody held falls back to
    the default weights).
    """
    n, k = len(widths), widths[0]
    if fit == "linear":
        if not opts.head_scores:   # the models' weights alone (as _resolve_scores scales uniform scores)
            s = torch.cat([torch.full((w,), n * weights[m], dtype=torch.float64, device=device)
                           for m, w in enumerate(widths)])
        base = assignment_matrix(torch.cat([torch.arange(w, device=device) for w in widths]), s, k)
    else:
        base = torch.cat([torch.eye(k, dtype=torch.float64, device=device) * weights[m] for m in range(n)])
    if not opts.head_weights:
        return base
    if opts.class_counts is None:
        raise MissingInputError("neuron interpolation: head_weights=True needs class_counts (per model, its "
                                "training sample count per class)")
    cc = torch.as_tensor(opts.class_counts, dtype=torch.float64, device=device)
    if cc.shape != (n, k):
        raise MissingInputError(f"neuron interpolation: class_counts must be [{n} models, {k} classes], got "
                                f"{tuple(cc.shape)}")
    frac = cc / cc.sum(0, keepdim=True).clamp_min(1e-300)              # [n, C], columns sum to 1
    default = base.reshape(n, k, k).diagonal(dim1=1, dim2=2)             # [n, C] default per-class weights
    default = default / default.sum(0, keepdim=True).clamp_min(1e-300)
    w = torch.where(cc.sum(0, keepdim=True) > 0, frac, default)
    return torch.cat([torch.diag(w[m]) for m in range(n)])


def head_targets(z: torch.Tensor, a: torch.Tensor, n: int, mode: str = "logits", temperature: float = 1.0,
                 floor: float = 1e-4) -> torch.Tensor:
    """Classifier-level targets ``[rows, C]`` from the parents' concatenated logits ``z [rows, n·C]``.

    ``a [n·C, C]`` is the head assignment (``_head_assignment``: class ``c`` of model ``m`` has weight
    ``a[m·C + c, c]``, each column summing to 1). ``"logits"``: ``z @ a``, the weighted mean of raw logits.
    ``"probs"``: ``τ · log(max(Σ_m a_mc · softmax(z_m / τ)_c, floor))``, centred per row — the weighted
    probability ensemble. Unlike averaged logits it does not inherit the clients' ever-growing logit
    scale (multi-round FL: clients trained from a confident global model become more confident each
    round), and a class one client never saw is not pushed down by that client's logit.
    """
    if mode == "logits":
        return z @ a
    c = a.shape[1]
    w = a.reshape(n, c, c).diagonal(dim1=1, dim2=2)                    # [n, C] per-model class weights
    p = torch.softmax(z.reshape(z.shape[0], n, c) / temperature, dim=-1)  # [rows, n, C]
    mix = (p * w.to(p)[None]).sum(1)                                   # [rows, C]
    t = temperature * torch.log(mix.clamp_min(floor))
    return t - t.mean(1, keepdim=True)


def _fused_widths(opts: InterpolationOptions, ref_levels: list[Level]) -> dict[int, int]:
    """Level index → fused width for the hidden levels (the classifier keeps ``num_classes``)."""
    fw = opts.fused_width
    hidden = range(len(ref_levels) - 1)
    if fw is None:
        return {i: ref_levels[i].width for i in hidden}
    if isinstance(fw, int):
        return {i: int(fw) for i in hidden}
    if isinstance(fw, dict):
        return {i: int(fw.get(ref_levels[i].name, fw.get(i, ref_levels[i].width))) for i in hidden}
    fw = list(fw)
    if len(fw) != len(ref_levels) - 1:
        raise FusionOptionError(f"option 'fused_width': need one width per hidden level ({len(ref_levels) - 1}), "
                                f"got {len(fw)}")
    return {i: int(w) for i, w in zip(hidden, fw)}


# ----------------------------------------------------------------------------------------------------
# grouping of one level
# ----------------------------------------------------------------------------------------------------

def _group(method: str, coords: torch.Tensor, s: torch.Tensor, widths: list[int], k: int, opts: InterpolationOptions,
           seed: int, level_name: str, diag: dict) -> torch.Tensor:
    """Cluster labels ``[d^M]`` for the concatenated neurons (coordinates ``coords [d^M, r]``); k-means
    cost and iterations go into ``diag``."""
    if method == "hf":
        w0 = widths[0]
        perm = hungarian_match(coords[:w0], coords[w0:], s[:w0], s[w0:], cost=opts.hf_cost)
        return matching_labels(perm).to(coords.device)
    if opts.match != "auto" and any(w != k for w in widths):
        raise IncompatibleModelsError(f"neuron interpolation: match={opts.match!r} needs every model's level "
                                      f"{level_name!r} to have the fused width {k}, got {widths}")
    if opts.match == "identity":
        return torch.cat([torch.arange(w, device=coords.device) for w in widths])
    if opts.match == "balanced":
        return balanced_kmeans(coords, s, widths)
    init: str | torch.Tensor = opts.kmeans_init
    if init == "model0":
        # centres seeded with model 0's neurons keep model 0's neuron order
        init = torch.arange(k) if widths[0] == k else "farthest"
    res = weighted_kmeans(coords, s, k, init=init, restarts=opts.kmeans_restarts, seed=seed)
    diag.update(kmeans_cost=res.cost, kmeans_iterations=res.iterations)
    return res.labels


# ----------------------------------------------------------------------------------------------------
# gradient fit of one level
# ----------------------------------------------------------------------------------------------------

def _fit_level(fused: nn.Module, lv: Level, x_in: torch.Tensor, target: torch.Tensor, *, optimizer: str, lr: float,
               epochs: int, weight_decay: float, opts: InterpolationOptions, seed: int, device: torch.device,
               unperturbed: list[torch.Tensor] | None = None) -> dict[str, float]:
    """Train ``lv``'s parameters in place so that ``lv.run(x_in) ≈ target`` (plain MSE).

    ``x_in [B, ...]`` level input, ``target [B, ...]`` level-shaped targets. Eval mode (no dropout;
    BatchNorm keeps its running statistics, its affine parameters train). Early stopping on the
    validation MSE with ``patience``; the best state, *including the starting one*, is kept.
    ``unperturbed``: the level's weights before its start was set (the closed form written or ``eps``
    perturbation applied: model 0's, or the target's); compared after training (the training itself is unchanged)
    and kept when its validation MSE is no higher than every state training reached (ties within float32
    round-off included). Parents that agree on a level
    (copies of one model) then keep it exactly: the fixed point ``fuse(method, [m, m]) = m`` that a perturbed or
    refitted start alone misses (by up to its ``eps``, or the ridge fit's held-out error when the level has fewer
    fusion samples than inputs).
    """
    named = dict(fused.named_parameters())
    params = [named[n] for n in lv.param_names]
    if not params or epochs <= 0:
        return {"epochs": 0}
    b = x_in.shape[0]
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(b, generator=gen)
    n_val = int(round(opts.val_fraction * b)) if b >= 10 else 0
    val_idx, tr_idx = perm[:n_val], perm[n_val:]
    start = [p.detach().clone() for p in params]
    opt = make_optimizer(params, optimizer, lr, weight_decay)
    fused.eval()
    for p in fused.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)

    def val_loss() -> float:
        idx = val_idx if n_val else tr_idx
        with torch.no_grad():
            tot = 0.0
            for i in range(0, len(idx), 512):
                j = idx[i:i + 512]
                tot += F.mse_loss(lv.run(x_in[j].to(device)), target[j].to(device), reduction="sum").item()
            return tot / max(1, len(idx)) / max(1, target[0].numel())

    best, best_state, bad, ep = val_loss(), [p.detach().clone() for p in params], 0, 0
    first = best
    try:
        for ep in range(1, epochs + 1):
            order = tr_idx[torch.randperm(len(tr_idx), generator=gen)]
            for i in range(0, len(order), opts.batch_size):
                j = order[i:i + opts.batch_size]
                out = lv.run(x_in[j].to(device))
                loss = F.mse_loss(out, target[j].to(device))
                if opts.prox > 0:  # pull toward the starting point (closed-form or model 0)
                    loss = loss + opts.prox * sum(((p - p0) ** 2).sum() for p, p0 in zip(params, start))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            v = val_loss()
            if v < best - 1e-12:
                best, best_state, bad = v, [p.detach().clone() for p in params], 0
            else:
                bad += 1
                if bad >= opts.patience:
                    break
    finally:
        with torch.no_grad():
            for p, q in zip(params, best_state):
                p.copy_(q)
        for p in fused.parameters():
            p.requires_grad_(True)
    kept_unperturbed = False
    if unperturbed is not None:
        with torch.no_grad():
            for p, q in zip(params, unperturbed):
                p.copy_(q)
            v = val_loss()
            # ties within float32 round-off (1e-10 of the targets' mean square) go to the unperturbed weights
            if v <= best + 1e-10 * float(target.float().pow(2).mean()):
                best, kept_unperturbed = v, True
            else:
                for p, q in zip(params, best_state):
                    p.copy_(q)
    return {"epochs": ep, "val_mse_start": first, "val_mse": best, "kept_unperturbed": kept_unperturbed}


# ----------------------------------------------------------------------------------------------------
# the algorithm
# ----------------------------------------------------------------------------------------------------

def _check_parents(name: str, grouping: str, fit: str, plv: list[list[Level]], opts: InterpolationOptions,
                   target: nn.Module | None) -> dict[int, int]:
    """Check that the parents (levels ``plv``) and ``target`` can be fused by this variant; returns the
    fused width of every hidden level (``fused_width``, the target's widths or model 0's)."""
    n, n_levels = len(plv), len(plv[0])
    for m, lv in enumerate(plv):
        if len(lv) != n_levels:
            raise IncompatibleModelsError(f"{name}: model {m} has {len(lv)} levels but model 0 has {n_levels}")
        if lv[-1].width != plv[0][-1].width:
            raise IncompatibleModelsError(f"{name}: model {m} has {lv[-1].width} classes but model 0 has "
                                          f"{plv[0][-1].width}")
    if grouping == "hf":
        if n != 2:
            raise IncompatibleModelsError(f"{name} fuses exactly two models (Hungarian matching), got {n}; "
                                          f"use kf-{fit}")
        for a, b in zip(plv[0][:-1], plv[1][:-1]):
            if a.width != b.width:
                raise IncompatibleModelsError(f"{name} needs equal widths; level {a.name!r} has {a.width} vs "
                                              f"{b.width}")
    tlv = None
    if target is not None:
        if grouping != "kf":
            raise IncompatibleModelsError(f"{name} cannot build into another architecture (target=); use kf-{fit}")
        if opts.fused_width is not None:
            raise FusionOptionError(f"{name}: give either target= or option 'fused_width', not both")
        tlv = model_levels(target)
        if len(tlv) != n_levels or tlv[-1].width != plv[0][-1].width:
            raise IncompatibleModelsError(f"{name}: target has {len(tlv)} levels and {tlv[-1].width} classes, the "
                                          f"models {n_levels} levels and {plv[0][-1].width} classes; a target may "
                                          "change widths only")
    widths_f = _fused_widths(opts, plv[0]) if tlv is None else {i: tlv[i].width for i in range(n_levels - 1)}
    if grouping == "hf" and any(widths_f[i] != plv[0][i].width for i in widths_f):
        raise FusionOptionError(f"{name}: option 'fused_width' must equal the parents' width for Hungarian "
                                "matching")
    return widths_f


def _parent(model: nn.Module, device: torch.device) -> nn.Module:
    """A parent as the fit reads it (level forwards in eval mode, its weights; nothing is written to it): the model
    itself when it is already in eval mode on ``device``, else an eval-mode copy there. A copy of a 132 M-parameter
    VGG-11 is 0.5 GB per parent."""
    tensors = list(model.state_dict().values())
    if not any(m.training for m in model.modules()) and all(t.device == device for t in tensors):
        return model
    return copy.deepcopy(model).to(device).eval()


def _fused_start(name: str, models: list[nn.Module], plv: list[list[Level]], widths_f: dict[int, int],
                 target: nn.Module | None, device: torch.device) -> nn.Module:
    """The model that becomes the fused one: ``target``, or a copy of model 0 (resized to ``widths_f`` when
    they differ from model 0's widths)."""
    if target is not None:
        return target.to(device).eval()
    if any(widths_f[i] != plv[0][i].width for i in widths_f):
        if not isinstance(models[0], nn.Sequential):
            raise IncompatibleModelsError(f"{name}: fused_width different from model 0's width is supported for "
                                          f"nn.Sequential models only, not {type(models[0]).__name__}")
        return _resize_sequential(copy.deepcopy(models[0]), widths_f).to(device).eval()
    return copy.deepcopy(models[0]).to(device).eval()


@dataclass
class _LevelStep:
    """One level ``index`` of Algorithm 1: the parents' outputs at this level and the fused model's input."""

    index: int
    last: bool                    # the classifier level
    parents: list[Level]          # the parents' level ``index``
    fused: Level                  # the fused model's level ``index``
    widths: list[int]             # the parents' widths
    k: int                        # the fused width
    s: torch.Tensor               # importance of every parent neuron, concatenated [Σ widths]
    h_par: list[torch.Tensor]     # each parent's level outputs on the fusion set
    h_fus: torch.Tensor           # the fused model's level input on the fusion set
    head_a: torch.Tensor | None   # classifier: the class assignment (_head_assignment)
    chunk: int

    @property
    def layout(self) -> str:
        return self.parents[0].layout

    @property
    def rows(self) -> int:
        return self.h_fus.shape[0]

    def zcat(self, i: int, j: int) -> torch.Tensor:
        """``[rows, Σ widths]``: the parents' neurons of samples ``i:j`` side by side."""
        return torch.cat([neurons_last(h[i:j], self.layout) for h in self.h_par], 1).double()


#: a level's least-squares fit takes the dual (kernel) form when its design matrix has fewer rows (fusion samples ×
#: output positions) than ``DUAL_ROW_RATIO`` × its columns (``_dual_least_squares``); 0 keeps every fit primal
DUAL_ROW_RATIO = 1.0


def _parents_prior(step: _LevelStep, prev_labels: list[torch.Tensor | None], k_prev: int, bias: bool, d: int,
                   device: torch.device) -> torch.Tensor:
    """``[d, Σ widths]``: every parent's weights on the fused inputs (``aligned_parent_weights``; zeros where a
    parent has none), written block by block into one matrix (no second copy of it)."""
    prior = torch.zeros(d, sum(step.widths), dtype=torch.float64, device=device)
    off = 0
    for m, w in enumerate(step.widths):
        p = aligned_parent_weights(step.parents[m], prev_labels[m], k_prev, step.fused, bias)
        if p is not None:
            prior[:, off:off + w].copy_(p)
        del p
        off += w
    return prior


def _least_squares(step: _LevelStep, opts: InterpolationOptions, prev_labels: list[torch.Tensor | None],
                   k_prev: int, device: torch.device):
    """Closed-form fit of an affine level: the least-squares coefficients of every parent
    neuron on the fused level's inputs, as a deviation from the parents' own (grouped) weights with
    ``prior="parents"``; returns ``(ls, head_coef)`` — ``ls.coef`` ``[d, Σ widths]`` and ``ls.coords`` (the
    projected outputs), and for a non-linear head target the head's coefficients ``[d, k]`` (else ``None``).
    The normal equations (``XᵀX [d, d]``) are accumulated chunk by chunk; a design matrix with fewer rows than
    columns is solved in the dual form instead (``_dual_least_squares``: the same fit, to round-off, returned as a
    ``_DualFit``; both answer ``weights(a)`` = ``coef @ a``)."""
    lvf, widths, k, n = step.fused, step.widths, step.k, len(step.widths)
    nonlinear_head = step.last and opts.head_target != "logits"
    bias = _folded_has_bias(lvf)
    d = lvf.layer.weight[0].numel() + int(bias)
    with torch.no_grad():
        per_sample = design_matrix(lvf.layer, lvf.pre(step.h_fus[:1]), bias).shape[0]   # output positions
    if step.rows * per_sample < DUAL_ROW_RATIO * d:
        return _dual_least_squares(step, opts, prev_labels, k_prev, device, bias, d)
    xtx = torch.zeros(d, d, dtype=torch.float64, device=device)
    xtz = torch.zeros(d, sum(widths), dtype=torch.float64, device=device)
    # a non-linear head target (head_target="probs") is not Z @ A: accumulate Xᵀ T directly
    xtt = torch.zeros(d, k, dtype=torch.float64, device=device) if nonlinear_head else None
    with torch.no_grad():
        for i in range(0, step.rows, step.chunk):
            dm = design_matrix(lvf.layer, lvf.pre(step.h_fus[i:i + step.chunk]), bias).double()
            z = step.zcat(i, i + step.chunk)
            xtx += dm.T @ dm
            xtz += dm.T @ z
            if nonlinear_head:
                xtt += dm.T @ head_targets(z, step.head_a, n, opts.head_target, opts.head_temperature,
                                           opts.head_floor)
    rel = opts.head_ridge if (step.last and opts.head_ridge is not None) else opts.ridge
    ridge = rel * float(torch.diagonal(xtx).mean()) if rel > 0 else 0.0
    ls = projected_coordinates(xtx, xtz, ridge=ridge, rcond=opts.rcond)
    if opts.prior == "parents":
        prior = _parents_prior(step, prev_labels, k_prev, bias, d, device)
        # min-norm *deviation from the prior*: same projected outputs, prior kept off the data span
        dev = projected_coordinates(xtx, xtz - xtx @ prior, ridge=ridge, rcond=opts.rcond)
        ls = type(ls)(coef=prior + dev.coef, coords=ls.coords)
    else:  # prior == "zero": the min-norm fit itself
        prior = None
    head_coef = None
    if nonlinear_head:  # same least squares, as a deviation from the a-averaged parents' head
        base = prior @ step.head_a if prior is not None else torch.zeros_like(xtt)
        head_coef = base + projected_coordinates(xtx, xtt - xtx @ base, ridge=ridge, rcond=opts.rcond).coef
    return ls, head_coef


def _prior_blocks(step: _LevelStep, prev_labels: list[torch.Tensor | None], k_prev: int, bias: bool, d: int,
                  block: int = 1 << 22):
    """``_parents_prior`` in column blocks of about ``block`` elements: ``(first column, [d, columns])`` pairs, the
    parents' weights on the fused inputs built a few output neurons at a time (``aligned_parent_weights(rows=)``);
    a parent without such weights has no block (its columns are zero)."""
    step_rows = max(1, block // d)
    off = 0
    for m, width in enumerate(step.widths):
        for r0 in range(0, width, step_rows):
            p = aligned_parent_weights(step.parents[m], prev_labels[m], k_prev, step.fused, bias,
                                       rows=slice(r0, min(width, r0 + step_rows)))
            if p is None:
                break
            yield off + r0, p
        off += width


@dataclass
class _DualFit:
    """A level's least-squares fit in the dual form (``_dual_least_squares``). Its coefficients ``[d, Σ widths]``
    (1.6 GB for a VGG-11's first classifier Linear of two parents) are never formed: ``weights(a)`` is ``coef @ a``
    computed as ``prior @ a + Xᵀ (B @ a)``, the prior rebuilt block by block from the parents' weights."""

    coords: torch.Tensor       # [Σ widths, r] projected outputs' coordinates (grouping)
    x: torch.Tensor            # [rows, d] the design matrix
    dual: torch.Tensor         # [rows, Σ widths] dual weights B of the deviation from the prior
    blocks: Any                # () -> iterator of _prior_blocks, or None (prior="zero")

    def weights(self, a: torch.Tensor) -> torch.Tensor:
        """``coef @ a`` ``[d, k]`` for ``a [Σ widths, k]``."""
        a = a.to(self.dual)
        return _add_prior(self.x.T @ (self.dual @ a), self.blocks, a)


def _add_prior(out: torch.Tensor, blocks, a: torch.Tensor) -> torch.Tensor:
    """``out += prior @ a`` in place, block by block (``_prior_blocks``; nothing when ``blocks`` is ``None``)."""
    if blocks is not None:
        for off, p in blocks():
            out.addmm_(p, a[off:off + p.shape[1]])
    return out


def _dual_least_squares(step: _LevelStep, opts: InterpolationOptions, prev_labels: list[torch.Tensor | None],
                        k_prev: int, device: torch.device, bias: bool, d: int):
    """``_least_squares`` for a design matrix ``X [rows, d]`` with fewer rows than columns, in the dual form
    (``kernel_least_squares``): ``X`` itself and the kernel ``X Xᵀ [rows, rows]`` instead of ``XᵀX [d, d]`` (5 GB in
    float64 for the 25,088 inputs of a VGG's first classifier Linear) and ``XᵀZ``. The relative ridge is the
    primal's, ``λ = ridge × mean diagonal of XᵀX = ridge × trace(X Xᵀ) / d``, so the weights
    ``prior + Xᵀ B`` and the projected outputs' coordinates are the primal ones to round-off. Returns
    ``(_DualFit, head_coef)``; nothing of size ``d × Σ widths`` is held (the prior's ``X prior`` is accumulated
    block by block)."""
    lvf, n = step.fused, len(step.widths)
    nonlinear_head = step.last and opts.head_target != "logits"
    spans = range(0, step.rows, step.chunk)
    with torch.no_grad():
        x = torch.cat([design_matrix(lvf.layer, lvf.pre(step.h_fus[i:i + step.chunk]), bias).double() for i in spans])
        z = torch.cat([step.zcat(i, i + step.chunk) for i in spans])          # [rows, Σ widths]
        t = head_targets(z, step.head_a, n, opts.head_target, opts.head_temperature, opts.head_floor) \
            if nonlinear_head else None   # row by row, as the primal's chunks
    kern = x @ x.T
    rel = opts.head_ridge if (step.last and opts.head_ridge is not None) else opts.ridge
    ridge = rel * float(torch.diagonal(kern).sum()) / d if rel > 0 else 0.0
    kls = kernel_least_squares(kern, ridge=ridge, rcond=opts.rcond)
    del kern
    blocks = None
    xp = torch.zeros_like(z)   # X prior
    if opts.prior == "parents":
        def blocks():
            return _prior_blocks(step, prev_labels, k_prev, bias, d)

        for off, p in blocks():
            xp[:, off:off + p.shape[1]] = x @ p
    fit = _DualFit(coords=kls.coords(z), x=x, dual=kls.dual(z - xp), blocks=blocks)
    head_coef = None
    if nonlinear_head:  # as the primal: a deviation from the a-averaged parents' head
        a = step.head_a.to(xp)
        head_coef = _add_prior(x.T @ kls.dual(t - xp @ a), blocks, a)
    return fit, head_coef


def output_coordinates(step: _LevelStep) -> torch.Tensor:
    """Coordinates ``[Σ widths, r]`` of the parents' neurons whose distances are those of their outputs on the fusion
    set (KF/HF grouping for the gradient fit). While the outputs' rows (samples × positions) are no more than the
    neurons, the outputs themselves are the coordinates (``Z^T``: no larger than the Gram matrix, and no
    factorisation: a ResNet-18's last stages at 32 px); past that, the Gram matrix accumulated chunk by chunk and
    ``gram_coordinates``."""
    m = sum(step.widths)
    zs: list[torch.Tensor] = []
    gram, rows = None, 0
    for i in range(0, step.rows, step.chunk):
        z = step.zcat(i, i + step.chunk)
        rows += z.shape[0]
        if gram is None and rows <= m:
            zs.append(z)
            continue
        if gram is None:
            gram = torch.zeros(m, m, dtype=torch.float64, device=z.device)
            for q in zs:
                gram += q.T @ q
            zs = []
        gram += z.T @ z
    return torch.cat(zs).T.contiguous() if gram is None else gram_coordinates(gram)


def _group_level(step: _LevelStep, name: str, grouping: str, fit: str, ls, opts: InterpolationOptions, seed: int,
                 level_info: dict, device: torch.device) -> torch.Tensor:
    """Group label ``[Σ widths]`` of every parent neuron: identity for the classifier (class ``c`` ↔ class
    ``c``), else HF/KF grouping of the neurons' coordinates (projected outputs for the linear fit, the Gram
    matrix of the outputs for the gradient fit)."""
    widths, k = step.widths, step.k
    if step.last:
        return torch.cat([torch.arange(w, device=device) for w in widths])
    if fit == "linear":
        coords = ls.coords  # projected outputs P z_j
    else:
        coords = output_coordinates(step)
    lv_name = step.parents[0].name
    if k > sum(widths):
        raise FusionOptionError(f"{name}: option 'fused_width' asks for {k} neurons at level "
                                f"{lv_name!r} but the models have {sum(widths)} in all")
    return _group(grouping, coords, step.s, widths, k, opts, seed + step.index, lv_name,
                  level_info.setdefault(lv_name, {}))


def _gradient_targets(step: _LevelStep, a: torch.Tensor, opts: InterpolationOptions) -> torch.Tensor:
    """The gradient fit's targets on the fusion set: the head regresses the averaged raw logits
    or ``head_target``; hidden levels the importance-weighted centroids ``Z @ a``."""
    n = len(step.widths)
    return torch.cat([neurons_restore(
        (head_targets(step.zcat(i, i + step.chunk), a, n, opts.head_target, opts.head_temperature, opts.head_floor)
         if step.last else step.zcat(i, i + step.chunk) @ a).to(step.h_fus.dtype), step.layout,
        step.h_par[0][i:i + step.chunk])
        for i in range(0, step.rows, step.chunk)])


def _fit_gradient_level(fused: nn.Module, step: _LevelStep, a: torch.Tensor, closed_form: torch.Tensor | None,
                        opts: GradientInterpolationOptions, seed: int, device: torch.device) -> dict:
    """Gradient fit of one level to ``_gradient_targets``, starting from the closed-form weights
    ``closed_form`` (``init="auto"`` on an affine level) or from the current weights perturbed by ``eps``
    towards a fresh initialisation; returns the fit's diagnostics."""
    lvf = step.fused
    target = _gradient_targets(step, a, opts)
    if opts.align_residual and not step.last and step.layout == "tokens" and lvf.kind == "block":
        target = _align_residual(step.h_fus, target, a, step.s, step.layout)
    named = dict(fused.named_parameters())
    # the level's weights as copied from model 0 (or the target), before the start replaces them: a candidate
    # kept after training when it fits better than every state training reached (copies of one model: exactly)
    unperturbed = [named[pn].detach().clone() for pn in lvf.param_names]
    if closed_form is not None:
        # closed-form start: defence against collapse
        write_affine(lvf, closed_form)
    elif (eps := opts.head_eps if step.last else opts.eps) > 0:
        fresh = _fresh_values(fused, lvf.param_names, seed * 1000 + step.index)
        with torch.no_grad():
            for pn, v in fresh.items():
                named[pn].mul_(1 - eps).add_(eps * v.to(named[pn]))
    hp = (opts.head_optimizer, opts.head_lr, opts.head_epochs, opts.head_weight_decay) if step.last else \
         (opts.optimizer, opts.lr, opts.epochs, opts.weight_decay)
    return _fit_level(fused, lvf, step.h_fus, target, optimizer=hp[0], lr=hp[1], epochs=hp[2],
                      weight_decay=hp[3], opts=opts, seed=seed * 7919 + step.index, device=device,
                      unperturbed=unperturbed)


def neuron_interpolation(models: list[nn.Module], *, grouping: str, fit: str, fusion_inputs: torch.Tensor,
                         scores=None, weights: list[float] | None = None, device: torch.device = torch.device("cpu"),
                         seed: int = 0, options: InterpolationOptions | None = None,
                         info: dict | None = None, target: nn.Module | None = None) -> nn.Module:
    """Algorithm 1 of the paper with HF/KF grouping and linear/gradient fitting.

    Args:
        models: parents (model 0 = reference architecture and initialisation); not modified.
        grouping: ``"hf"`` | ``"kf"``.
        fit: ``"linear"`` | ``"gradient"``.
        fusion_inputs: ``[B, *input_shape]`` unlabeled fusion set.
        scores: ``None`` or one ``{level name: [width]}`` dict per model (client-side importance).
        weights: per-model weights summing to 1 (scale each model's importance by ``n·w``).
        device: where everything runs (k-means, least squares and the level fits included).
        options: ``InterpolationOptions`` (linear fit) or ``GradientInterpolationOptions`` (gradient fit);
            ``None`` = the defaults.
        info: optional dict that receives per-level diagnostics ``{"levels": {name: {...}}}`` (k-means
            cost and iterations; gradient fits: epochs, validation MSE at the start and the end).
        target: optional module (same family and level count, any widths) that becomes the fused model:
            its levels are fitted in place (KF only; its weights are only the gradient fits' start).
    Returns:
        The fused model (model 0's architecture, possibly with other hidden widths, or ``target``), eval mode.
    """
    name = f"{grouping}-{fit}"
    if fusion_inputs is None or len(fusion_inputs) == 0:
        raise MissingInputError(f"{name} needs fusion_inputs (a non-empty unlabeled fusion set)")
    options_cls = GradientInterpolationOptions if fit == "gradient" else InterpolationOptions
    opts = options if options is not None else options_cls()
    if not isinstance(opts, options_cls):
        raise TypeError(f"{name}: options must be {options_cls.__name__}, got {type(opts).__name__}")
    n = len(models)
    weights = weights or [1.0 / n] * n
    level_info: dict[str, dict] = {}
    if info is not None:
        info["levels"] = level_info
    if fit == "linear" and not all(lv.affine for m in models for lv in model_levels(m)):
        # residual streams, concatenations, gates: grouping per permutation group, closed form per affine layer
        return graph_interpolation(models, grouping=grouping, fusion_inputs=fusion_inputs, scores=scores,
                                   weights=weights, device=device, seed=seed, opts=opts, info=info, target=target)
    # in the models' floating dtype (float32 unless they are float64: a float64 check of exactness)
    first = next(models[0].parameters(), None)
    x = torch.as_tensor(fusion_inputs).to(device, first.dtype if first is not None and first.is_floating_point()
                                          else torch.float32)
    parents = [_parent(m, device) for m in models]
    plv = [model_levels(p) for p in parents]
    n_levels = len(plv[0])
    widths_f = _check_parents(name, grouping, fit, plv, opts, target)
    fused = _fused_start(name, models, plv, widths_f, target, device)
    flv = model_levels(fused)

    if fit == "linear":
        for lv in flv:
            if not lv.affine:
                raise IncompatibleModelsError(f"{name} needs affine levels; level {lv.name!r} is a {lv.kind} "
                                 f"({type(lv.module).__name__}); use the gradient variant")

    s_all = _resolve_scores(models, plv, scores, weights, opts, x, device)
    chunk = opts.chunk_size
    h_par = [x for _ in range(n)]   # each parent's current level input (one level per model)
    h_fus = x                       # the fused model's current level input
    prev_labels: list[torch.Tensor | None] = [None] * n   # each parent's previous-level grouping
    k_prev = 0
    for l in range(n_levels):
        last = l == n_levels - 1
        widths = [plv[m][l].width for m in range(n)]
        s = torch.cat([s_all[m][l] for m in range(n)])
        # parents' level-l outputs on the raw fusion set (their own forward passes)
        h_par = [_chunked(plv[m][l].run, h_par[m], chunk) for m in range(n)]
        # classifier: class c ↔ class c in every model, weighted by _head_assignment
        head_a = _head_assignment(opts, widths, s, weights, fit, device) if last else None
        step = _LevelStep(index=l, last=last, parents=[plv[m][l] for m in range(n)], fused=flv[l], widths=widths,
                          k=plv[0][l].width if last else widths_f[l], s=s, h_par=h_par, h_fus=h_fus, head_a=head_a,
                          chunk=chunk)
        ls, head_coef = (_least_squares(step, opts, prev_labels, k_prev, device)
                         if fit == "linear" or (opts.init != "model0" and step.fused.affine) else (None, None))
        labels = _group_level(step, name, grouping, fit, ls, opts, seed, level_info, device)
        # importance-weighted targets (Theorem 1); the head optionally by class counts
        a = head_a if last else assignment_matrix(labels, s, step.k)
        closed_form = None if ls is None else (head_coef if head_coef is not None else ls.weights(a))
        if fit == "linear":  # w_k = Σ s_j a_j / Σ s_j  (= X^+ T_k)
            write_affine(step.fused, closed_form)
        else:
            fit_info = _fit_gradient_level(fused, step, a, closed_form, opts, seed, device)
            level_info.setdefault(plv[0][l].name, {}).update(fit_info)
        del ls, head_coef, closed_form, a   # written into the fused model: not held through the next level's fit
        if not last:
            h_fus = _chunked(step.fused.run, h_fus, chunk)
            offs = [sum(widths[:m]) for m in range(n)]
            prev_labels = [labels[offs[m]:offs[m] + widths[m]] for m in range(n)]
            k_prev = step.k
    for p in fused.parameters():
        p.requires_grad_(True)
    return fused.eval()


def _align_residual(h_in: torch.Tensor, target: torch.Tensor, a: torch.Tensor, s: torch.Tensor,
                    layout: str) -> torch.Tensor:
    """Reorder the target columns so column ``i`` is the cluster closest to input dimension ``i``
    (ViT residual stream), Hungarian on ``importance(cluster) · ‖x_i − T_k‖²``.
    ``h_in [B, T, D]``, ``target [B, T, D]``; returns the permuted target."""
    xi = neurons_last(h_in, layout).double()
    tk = neurons_last(target, layout).double()
    if xi.shape[1] != tk.shape[1]:
        return target
    g_xx = (xi * xi).sum(0)[:, None]
    g_tt = (tk * tk).sum(0)[None, :]
    dist = (g_xx - 2 * xi.T @ tk + g_tt).clamp_min(0)
    mass = (a > 0).double().T @ s.double()  # total importance per cluster [K]
    from scipy.optimize import linear_sum_assignment
    rows, cols = linear_sum_assignment((dist * mass[None, :]).cpu().numpy())
    order = torch.as_tensor(cols[rows.argsort()], device=target.device)
    return neurons_restore(tk[:, order].float(), layout, target)


def _make(grouping: str, fit: str, any_target: bool = False):
    if any_target:
        def fn(models, *, fusion_inputs, scores, weights, device, seed, options, info, target=None) -> nn.Module:
            return neuron_interpolation(models, grouping=grouping, fit=fit, fusion_inputs=fusion_inputs,
                                        scores=scores, weights=weights, device=device, seed=seed, options=options,
                                        info=info, target=target)
    else:
        def fn(models, *, fusion_inputs, scores, weights, device, seed, options, info) -> nn.Module:
            return neuron_interpolation(models, grouping=grouping, fit=fit, fusion_inputs=fusion_inputs,
                                        scores=scores, weights=weights, device=device, seed=seed, options=options,
                                        info=info)
    fn.__name__ = f"fuse_{grouping}_{fit}"
    fn.__doc__ = (f"Neuron Interpolation, {grouping.upper()} grouping with {fit} fitting. "
                  "See ``neuron_interpolation``; options: "
                  f"``{'GradientInterpolationOptions' if fit == 'gradient' else 'InterpolationOptions'}``.")
    return fn


# HF = Hungarian matching of two equal-width models; KF = k-means over any number of models and widths.
# Linear fits are closed-form per affine level on chains of levels; on any other graph (residual streams,
# concatenations) per permutation group and affine layer (fedfuse.fusion.interpolation_graph); gradient fits train
# any differentiable level (ResNet and ViT blocks too).
_LINEAR = dict(options=InterpolationOptions, uses_scores=True)
_GRADIENT = dict(options=GradientInterpolationOptions, uses_scores=True)
PAPER_HF_LINEAR = ('Neuron interpolation, HF grouping, closed-form linear level fits ("Model Fusion via Neuron '
                   'Interpolation", arXiv 2507.00037).')
fuse_hf_linear = register("hf-linear", paper=PAPER_HF_LINEAR, **_LINEAR, min_models=2, max_models=2)(_make("hf", "linear"))
# KF clusters the neurons of all models into any number of fused neurons: it builds into any width (target=)
PAPER_KF_LINEAR = ('Neuron interpolation, KF (k-means) grouping, closed-form linear level fits ("Model Fusion via '
                   'Neuron Interpolation", arXiv 2507.00037).')
fuse_kf_linear = register("kf-linear", paper=PAPER_KF_LINEAR, **_LINEAR, mixed_widths=True, any_target=True)(_make("kf", "linear", True))
PAPER_HF_GRADIENT = ("Neuron interpolation, HF grouping, gradient-based level fits (arXiv 2507.00037).")
fuse_hf_gradient = register("hf-gradient", paper=PAPER_HF_GRADIENT, **_GRADIENT, min_models=2, max_models=2)(_make("hf", "gradient"))
PAPER_KF_GRADIENT = ("Neuron interpolation, KF grouping, gradient-based level fits (arXiv 2507.00037).")
fuse_kf_gradient = register("kf-gradient", paper=PAPER_KF_GRADIENT, **_GRADIENT, mixed_widths=True, any_target=True)(
    _make("kf", "gradient", True))

__all__ = ["neuron_interpolation", "design_matrix", "write_affine", "SETTINGS", "InterpolationOptions",
           "GradientInterpolationOptions", "fuse_hf_linear", "fuse_kf_linear", "fuse_hf_gradient",
           "fuse_kf_gradient"]
