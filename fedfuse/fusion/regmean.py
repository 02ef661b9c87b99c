"""RegMean: per-layer closed-form merging from each model's input Gram matrices.

Paper: Jin, Ren, Preotiuc-Pietro & Cheng, "Dataless Knowledge Fusion by Merging Weights of Language Models",
ICLR 2023, arXiv 2212.09849. Written fresh from the paper.

For every linear layer ``y = W x`` (``W [out, d]``) the merged weight minimises the models' summed regression
error on their own inputs, ``Σ_i ‖X_i Wᵀ − X_i W_iᵀ‖²``, whose solution is

    W*ᵀ = (Σ_i G_i)⁻¹ Σ_i G_i W_iᵀ,      G_i = X_iᵀ X_i  (the layer's input Gram matrix on model i's data, [d, d]).

Each model's ``G_i`` is computed by its owner on its own data (``regmean_statistics``: one forward pass; in a
federation the client sends it with its weights, one upload) and no data leaves it. Section 3.3 of the paper
shrinks the non-diagonal entries, ``G̃_i = α G_i + (1 − α) diag(G_i)`` (``alpha``; the paper tunes α ∈ [0, 1],
0.9 by default here), which regularises towards the plain average and keeps the system well-conditioned.
Convolutions are linear maps of their unfolded (im2col) input patches, ``[N·L, C/groups·kh·kw]`` rows, merged
the same way per group. Everything else (biases, norms, embeddings, buffers) is the weighted average, as in the
paper.

fedfuse's additions: each ``G_i`` is the *mean* over its rows (``X_iᵀX_i / rows``) and is weighted by ``fuse``'s
``weights`` (e.g. sample counts: then ``Σ w_i G_i`` is the pooled data's Gram matrix up to a constant, exactly the
paper's sum); a tiny ridge ``ridge · mean(diag Σ w_i G̃_i)`` pulls the solution towards the weighted average, so an
input feature no model ever activates (a dead unit, zero Gram row) takes the average instead of an undetermined
value (``ridge=0``: the paper's plain solve).

Independently initialised models (fedfuse's one-shot clients) do not share units, and RegMean of them is about as
poor as their plain average (near chance for LeNets trained apart). ``align='weights'`` / ``'activations'`` first
permutes every model onto model 0's units with Git Re-Basin (``fedfuse.fusion.stat_align``), moving each client's
Gram matrices with its units (``P G Pᵀ``), then merges.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.average import average_state_dicts
from fedfuse.fusion.permute import Map, PermSpec
from fedfuse.fusion.permute.maps import load_plain
from fedfuse.fusion.registry import (IncompatibleModelsError, MissingInputError, register, require,
                                     require_same_architecture, warn_caller)
from fedfuse.fusion.stat_align import Align, align_to_first, input_permutation

PAPER_REGMEAN = ('RegMean (Jin et al., "Dataless Knowledge Fusion by Merging Weights of Language Models", ICLR 2023, '
                 'arXiv 2212.09849): per-layer closed-form merge from the input Gram matrices.')
PUBLIC_DATA_WARNING = ("{method}: no client statistics given, so they are computed on the SERVER'S FUSION SET through "
                       "each model: this is the PUBLIC-DATA VARIANT of {paper}, not the paper's method (which reads "
                       "statistics each client computes on its own data: fuse(..., statistics=[client_statistics("
                       "'{method}', model_i, x_i, y_i) ...]))")
_UNSUPPORTED = (nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def merge_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{module name: module}`` of the layers RegMean merges: every ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d``
    with a weight. ``IncompatibleModelsError`` (a ``ValueError``) for layers whose input it cannot unfold
    (``Conv3d``, transposed convolutions) or a lazy layer without shapes yet."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, _UNSUPPORTED):
            raise IncompatibleModelsError(f"regmean: layer {name!r} is a {type(mod).__name__}; RegMean merges Linear, "
                                          "Conv1d and Conv2d layers (their unfolded inputs), not this one")
        if isinstance(mod, (nn.Linear, nn.Conv1d, nn.Conv2d)) and isinstance(mod.weight, nn.Parameter):
            if isinstance(mod.weight, nn.parameter.UninitializedParameter):
                raise IncompatibleModelsError(f"regmean: layer {name!r} is lazy and has no shape yet; run one forward "
                                              "pass first")
            out[name] = mod
    return out


def layer_rows(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows the layer multiplies by its weight: ``[groups, rows, d]`` (``d = in/groups · kernel``) from its input
    ``x`` (Linear ``[..., in]``: one row per position; Conv ``[N, C, *spatial]``: one im2col patch per output
    position, padded as the layer pads)."""
    if isinstance(mod, nn.Linear):
        return x.reshape(1, -1, x.shape[-1])
    mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
    x = F.pad(x, mod._reversed_padding_repeated_twice, mode=mode)
    if isinstance(mod, nn.Conv1d):   # a Conv1d is a Conv2d of height 1
        x, kernel, dil, stride = x.unsqueeze(2), (1, *mod.kernel_size), (1, *mod.dilation), (1, *mod.stride)
    else:
        kernel, dil, stride = mod.kernel_size, mod.dilation, mod.stride
    cols = F.unfold(x, kernel, dilation=dil, padding=0, stride=stride)          # [N, C·k, L]
    n, ck, length = cols.shape
    g = mod.groups
    return cols.reshape(n, g, ck // g, length).permute(1, 0, 3, 2).reshape(g, n * length, ck // g)


def weight_matrix(mod: nn.Module) -> torch.Tensor:
    """The layer's weight as ``[groups, out/groups, d]`` (float64), the rows ``layer_rows`` multiplies."""
    w = mod.weight.detach().double()
    g = getattr(mod, "groups", 1)
    return w.reshape(g, w.shape[0] // g, -1)


def regmean_statistics(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor | None = None, *,
                       device: str | torch.device = "cpu", batch_size: int = 256,
                       max_samples: int | None = None) -> dict[str, torch.Tensor]:
    """RegMean's client statistic: for every merged layer (``merge_layers``) the mean Gram matrix of its input rows
    on ``inputs [N, *input_shape]`` through ``model`` (eval mode, no gradients), ``X_ℓᵀ X_ℓ / rows``: ``[d, d]``, or
    ``[groups, d, d]`` for a grouped convolution, in the model's dtype (each batch's product in it, summed in
    float64). ``labels`` are not used (the
    Gram matrices need none). ``max_samples``: the first that many inputs only. A layer the forward pass never
    reaches has no entry. ``model`` is not modified (a copy runs on ``device``)."""
    device = torch.device(device)
    net = copy.deepcopy(model).to(device).eval()
    layers = merge_layers(net)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name):
        def fn(mod, args):
            rows = layer_rows(mod, args[0].detach())                 # the model's dtype; summed in float64
            gram = (rows.transpose(1, 2) @ rows).double()
            sums[name] = sums[name] + gram if name in sums else gram
            counts[name] = counts.get(name, 0) + rows.shape[1]
        return fn

    handles = [mod.register_forward_pre_hook(hook(name)) for name, mod in layers.items()]
    x = inputs if max_samples is None else inputs[:max_samples]
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.float32)
    try:
        with torch.no_grad():
            for i in range(0, len(x), batch_size):
                net(x[i:i + batch_size].to(device=device, dtype=dtype))
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, s in sums.items():
        g = s / max(1, counts[name])
        out[name] = (g[0] if g.shape[0] == 1 else g).to(dtype).cpu()
    return out


def move_grams(stats: dict[str, torch.Tensor], model: nn.Module, spec_a: PermSpec, spec_b: PermSpec,
               maps: dict[str, Map]) -> dict[str, torch.Tensor]:
    """A model's Gram matrices moved with its units onto model 0's: ``G[idx][:, idx]`` with ``idx`` the permutation
    of the layer's input features (``stat_align.input_permutation``)."""
    layers = merge_layers(model)
    out = {}
    for name, g in stats.items():
        mod = layers.get(name)
        idx = None if mod is None else input_permutation(f"{name}.weight" if name else "weight", mod.weight,
                                                         getattr(mod, "groups", 1), spec_a, spec_b, maps)
        out[name] = g if idx is None else g.index_select(-1, idx).index_select(-2, idx)
    return out


def check_grams(stats: list[dict[str, torch.Tensor]], layers: dict[str, nn.Module]) -> None:
    """Every model's statistics name exactly the merged layers, with ``[d, d]`` (``[groups, d, d]``) Gram matrices;
    ``MissingInputError`` / ``IncompatibleModelsError`` naming the model and the layer otherwise."""
    reached = {name for st in stats for name in st}
    for i, st in enumerate(stats):
        extra = sorted(set(st) - set(layers))
        if extra:
            raise IncompatibleModelsError(f"regmean: statistics[{i}] has {extra[0]!r}, which is not a merged layer of "
                                          f"the models (Linear / Conv layers: {sorted(layers)[:6]}...)")
        for name, mod in layers.items():
            if name not in reached:   # no model's forward pass reaches it: averaged
                continue
            if name not in st:
                raise MissingInputError(f"regmean: statistics[{i}] has no Gram matrix for layer {name!r} (compute "
                                        "them with client_statistics('regmean', model, inputs))")
            g, d = getattr(mod, "groups", 1), mod.weight[0].numel()
            want = (d, d) if g == 1 else (g, d, d)
            if tuple(st[name].shape) != want:
                raise IncompatibleModelsError(f"regmean: statistics[{i}][{name!r}] has shape "
                                              f"{tuple(st[name].shape)}, layer {name!r} needs {want}")


def solve_layer(grams: list[torch.Tensor], ws: list[torch.Tensor], weights: list[float], alpha: float,
                ridge: float) -> torch.Tensor:
    """RegMean's merge of one layer: ``grams`` ``[g, d, d]``, weights ``ws`` ``[g, out, d]`` (float64) →
    ``[g, out, d]``: ``(Σ w_i G̃_i + λ I)⁻¹ (Σ w_i G̃_i W_iᵀ + λ W̄ᵀ)`` with ``G̃ = α G + (1 − α) diag(G)``,
    ``W̄ = Σ w_i W_i`` and ``λ = ridge · mean(diag Σ w_i G̃_i)``."""
    a = torch.zeros_like(grams[0])
    b = torch.zeros_like(ws[0].transpose(1, 2))
    avg = torch.zeros_like(ws[0])
    for g, w, c in zip(grams, ws, weights):
        diag = torch.diag_embed(torch.diagonal(g, dim1=-2, dim2=-1))
        gt = alpha * g + (1 - alpha) * diag
        a += c * gt
        b += c * gt @ w.transpose(1, 2)
        avg += c * w
    scale = torch.diagonal(a, dim1=-2, dim2=-1).mean(-1)                       # [g]
    lam = (ridge * scale).clamp_min(0)[:, None, None]
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    dead = scale <= 0                    # no input reaches the layer in any model: the average
    lam = torch.where(dead[:, None, None], torch.ones_like(lam), lam)
    sol = torch.linalg.solve(a + lam * eye, b + lam * avg.transpose(1, 2))
    return sol.transpose(1, 2)


@dataclass(frozen=True)
class RegMeanOptions:
    """Options of ``regmean``.

    Attributes:
        alpha: the scaling of the Gram matrices' non-diagonal entries (the paper's α, Section 3.3): 1 = the plain
            regression solution, 0 = a diagonal-weighted average; in [0, 1].
        ridge: the pull towards the weighted average, relative to the mean diagonal of the summed Gram matrix
            (``0`` = the paper's plain solve, which fails when an input feature is never active in any model).
        align: ``"none"`` (the paper: models from one shared initialisation), or Git Re-Basin's ``"weights"`` /
            ``"activations"`` (the latter on the fusion set) matching of every model onto model 0 first, the
            statistics moved with the units (independently initialised clients).
        batch_size: inputs per forward pass when the statistics are computed on the fusion set.
    """

    alpha: float = 0.9
    ridge: float = 1e-6
    align: Align = "none"
    batch_size: int = 256

    def __post_init__(self) -> None:
        require(0.0 <= self.alpha <= 1.0, "alpha", "in [0, 1]", self.alpha)
        require(self.ridge >= 0.0, "ridge", ">= 0", self.ridge)
        require(self.batch_size >= 1, "batch_size", ">= 1", self.batch_size)


def public_statistics(method: str, paper: str, models, fusion_inputs, stat_fn, info: dict, **kw) -> list[dict]:
    """The public-data variant's statistics: ``stat_fn(model, fusion_inputs, **kw)`` per model, with a loud warning
    and ``info['statistics'] = 'fusion set (public-data variant)'``; ``MissingInputError`` without a fusion set."""
    if fusion_inputs is None:
        raise MissingInputError(f"{method}: needs the clients' statistics (statistics=) or a fusion set "
                                "(fusion_inputs) to compute them on")
    warn_caller(PUBLIC_DATA_WARNING.format(method=method, paper=paper), UserWarning)
    info["statistics"] = "fusion set (public-data variant)"
    return [stat_fn(m, fusion_inputs, **kw) for m in models]


def merge_statistics(method: str, paper: str, models, statistics, *, check, move, stat_fn, align, fusion_inputs,
                     device, seed, info: dict, **stat_kw) -> tuple[list[nn.Module], list[dict]]:
    """``(models, statistics)`` a statistics-merging method (RegMean, Fisher merging) merges: the clients' statistics,
    checked (``check``; ``info['statistics'] = 'clients'``), else the public-data variant's (``public_statistics``,
    ``stat_fn(model, fusion_inputs, device=, **stat_kw)``), the models aligned onto model 0 first when ``align`` says
    so, the statistics moved with their units (``move``; ``fedfuse.fusion.stat_align.align_to_first``)."""
    if statistics is not None:
        check(statistics)
        info["statistics"] = "clients"
    models, statistics = align_to_first(list(models), statistics, align, fusion_inputs=fusion_inputs, device=device,
                                        seed=seed, info=info, move=move)
    if statistics is None:
        statistics = public_statistics(method, paper, models, fusion_inputs, stat_fn, info, device=device, **stat_kw)
        check(statistics)
    return models, statistics


@register("regmean", paper=PAPER_REGMEAN, options=RegMeanOptions, needs_data=True, any_module=True,
          statistics="gram", client_statistics=regmean_statistics)
def fuse_regmean(models, *, fusion_inputs, scores, weights, device, seed, options: RegMeanOptions, info: dict,
                 statistics: list[dict[str, torch.Tensor]] | None) -> nn.Module:
    """RegMean of same-architecture ``models`` (any ``nn.Module``; its Linear / Conv1d / Conv2d layers merged in
    closed form, everything else averaged with ``weights``).

    ``statistics``: one ``{layer name: Gram [d, d] / [groups, d, d]}`` per model from ``regmean_statistics`` on that
    model's own data (the paper's setting; in fedfuse, each client's). ``None``: computed on ``fusion_inputs
    [B, *input]`` through each model, the public-data variant, with a ``UserWarning`` saying so. Fixed points: copies
    of one model, and one model, come back unchanged. ``info``: ``statistics`` (``clients`` or the public-data
    variant), ``layers`` (merged), ``align`` when aligned. Raises ``IncompatibleModelsError`` for models of other
    architectures or layers it cannot unfold (``Conv3d``, transposed convolutions)."""
    o = options
    ref = models[0]
    require_same_architecture(models, "regmean", "RegMean merges layer by layer: the same layers and shapes are needed")
    layers = merge_layers(ref)
    models, statistics = merge_statistics("regmean", "RegMean (arXiv 2212.09849)", models, statistics,
                                          check=lambda st: check_grams(st, layers), move=move_grams,
                                          stat_fn=regmean_statistics, align=o.align, fusion_inputs=fusion_inputs,
                                          device=device, seed=seed, info=info, batch_size=o.batch_size)
    unreached = sorted(k for k in layers if k not in statistics[0])
    if unreached:
        info["averaged-layers"] = unreached   # no forward pass reached them: no Gram matrix, the weighted average
    layers = {k: v for k, v in layers.items() if k in statistics[0]}
    merged = average_state_dicts([m.state_dict() for m in models], weights)
    mods = [dict(m.named_modules()) for m in models]
    for name, mod in layers.items():
        grams = [st[name].to(device=device, dtype=torch.float64).reshape(getattr(mod, "groups", 1), *st[name].shape[-2:])
                 for st in statistics]
        ws = [weight_matrix(md[name]).to(device) for md in mods]
        w = solve_layer(grams, ws, weights, o.alpha, o.ridge)
        key = f"{name}.weight" if name else "weight"
        merged[key] = w.reshape(mod.weight.shape).to(dtype=merged[key].dtype).cpu()
    fused = copy.deepcopy(ref).cpu()
    load_plain(fused, merged)
    info["layers"] = len(layers)
    return fused.eval()


__all__ = ["regmean_statistics", "fuse_regmean", "RegMeanOptions", "merge_layers", "layer_rows", "solve_layer",
           "move_grams", "public_statistics", "merge_statistics", "PUBLIC_DATA_WARNING"]
