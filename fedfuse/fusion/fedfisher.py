"""FedFisher: the global model that best explains every client's Laplace posterior, found by gradient descent.

Paper: Jhunjhunwala, Wang & Joshi, "FedFisher: Leveraging Fisher Information for One-Shot Federated Learning",
AISTATS 2024, arXiv 2403.12329. Written fresh from the paper; the server optimisation follows what the authors' public
code runs (``Divyansh03/FedFisher``, ``algs/fisher_avg.py``).

Each client ``k`` approximates its posterior by a Gaussian around its trained weights ``θ_k`` with its Fisher
information ``F_k`` as precision, and sends both (one upload). The server minimises the weighted sum of the clients'
quadratic losses (paper, Eq. 4; ``p_k`` = ``fuse``'s ``weights``, normalised: the clients' data fractions)

    L(θ) = ½ Σ_k p_k (θ − θ_k)ᵀ F_k (θ − θ_k),        ∇L(θ) = Σ_k p_k F_k (θ − θ_k),

starting from the weighted average ``Σ_k p_k θ_k`` and running ``steps`` updates of the authors' Adam variant
(``m ← β1 m + g``, ``v ← β2 v + g²``, ``θ ← θ − lr · m / (√v + eps)``: no ``(1 − β)`` factors, no bias correction;
their ``T = 2000``, ``η = 0.01``, ``β1 = 0.9``, ``β2 = 0.99``, ``eps = 0.01``). The Fisher ``F_k`` (``kind``):

- ``"diagonal"`` (FedFisher(Diag)): the diagonal of the exact Fisher, ``E_x E_{y ~ p_θk(y|x)} (∇_θ log p)²``
  (``fedfuse.fusion.fisher.fisher_statistics``); the minimiser is Fisher merging's per-coordinate average, which the
  finite, early-stopped optimisation approaches from the average.
- ``"kfac"`` (FedFisher(K-FAC)): for every ``Linear`` / ``Conv2d`` layer with weight and bias ``W̄ = [W | b]``
  (``[out, d + 1]``, a convolution's weight as its unfolded ``C_in·k_h·k_w`` patches), ``F ≈ A ⊗ G`` with
  ``A = E[ā āᵀ]`` over the layer's input rows (samples × positions, a 1 appended for the bias) and
  ``G = T · E[g gᵀ]`` over its output gradients (``T`` positions per sample; the expectation over ``y ~ p`` exact,
  one backward pass per class), so ``∇L = Σ_k p_k G_k (W̄ − W̄_k) A_k``. Every parameter must belong to such a
  layer (groups 1); ``IncompatibleModelsError`` otherwise (use ``"diagonal"``).

Deviations from the authors' code: it keeps the iterate that scores best on 500 **labelled** training images at the
server every 100 steps; a fedfuse server has no labels, so the last iterate is kept (``info['objective']``: the loss at
the start and the end). It quantises the weights and Fishers to 15 bits and compresses the K-FAC factors before
upload; not done here. Like every per-coordinate merge it assumes clients from one initialisation (the paper's
setting); ``align='weights'`` / ``'activations'`` permutes every model onto model 0's units first (Git Re-Basin,
``fedfuse.fusion.stat_align``), each client's Fisher moved with its units.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fedfuse.fusion.average import average_state_dicts
from fedfuse.fusion.fisher import check_fishers, fisher_statistics, move_fishers
from fedfuse.fusion.permute import Map, PermSpec, apply_maps
from fedfuse.fusion.permute.maps import load_plain
from fedfuse.fusion.registry import (IncompatibleModelsError, MissingInputError, NumericalFusionError, register,
                                     require, require_same_architecture)
from fedfuse.fusion.regmean import layer_rows, merge_statistics
from fedfuse.fusion.stat_align import Align, input_permutation

PAPER_FEDFISHER = ('FedFisher (Jhunjhunwala et al., "FedFisher: Leveraging Fisher Information for One-Shot Federated '
                   'Learning", AISTATS 2024, arXiv 2403.12329): the clients\' Fisher-weighted quadratic losses '
                   'minimised by gradient descent from the average.')
FedFisherKind = Literal["diagonal", "kfac"]


def kfac_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: Linear | Conv2d}`` whose weights and biases are all of ``model``'s parameters (K-FAC needs every
    parameter in such a layer); ``IncompatibleModelsError`` otherwise."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    for n, m in layers.items():
        if isinstance(m, nn.Conv2d) and m.groups != 1:
            raise IncompatibleModelsError(f"fedfisher: kind='kfac' takes convolutions of groups 1; {n!r} has "
                                          f"{m.groups} (use kind='diagonal')")
    covered = {f"{n}.{p}" if n else p for n, m in layers.items() for p, _ in m.named_parameters(recurse=False)}
    rest = [k for k, _ in model.named_parameters() if k not in covered]
    if rest:
        raise IncompatibleModelsError(f"fedfisher: kind='kfac' needs every parameter in a Linear / Conv2d layer; "
                                      f"{rest[0]!r} is not (use kind='diagonal')")
    return layers


def _kfac_statistics(model: nn.Module, inputs: torch.Tensor, *, device, batch_size: int) -> dict[str, torch.Tensor]:
    net = copy.deepcopy(model).to(device).eval()
    layers = kfac_layers(net)
    acts: dict[str, torch.Tensor] = {}
    outs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in layers.items():
        def fwd(mod, args, out, name=name):
            acts[name] = args[0].detach()
            outs[name] = out
        hooks.append(mod.register_forward_hook(fwd))
    a_sum = {n: 0.0 for n in layers}
    g_sum = {n: 0.0 for n in layers}
    rows_a = {n: 0 for n in layers}
    count = 0
    try:
        for i in range(0, len(inputs), batch_size):
            xb = inputs[i:i + batch_size].to(device=device, dtype=next(net.parameters()).dtype)
            n = len(xb)
            logp = net(xb).log_softmax(-1)
            probs = logp.detach().exp().double()
            for name, mod in layers.items():
                rows = layer_rows(mod, acts[name])[0].double()                 # [n·T, d]
                if mod.bias is not None:
                    rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)], 1)
                a_sum[name] = a_sum[name] + rows.T @ rows
                rows_a[name] += len(rows)
            for c in range(logp.shape[1]):
                grads = torch.autograd.grad(logp[:, c].sum(), [outs[k] for k in layers], retain_graph=True)
                for (name, mod), g in zip(layers.items(), grads):
                    g = g.double()
                    if g.dim() > 2:                                            # [n, out, *spatial] -> rows
                        t = g[0, 0].numel()
                        g = g.reshape(n, g.shape[1], -1).transpose(1, 2).reshape(-1, g.shape[1]) * t ** 0.5
                    w = probs[:, c].repeat_interleave(len(g) // n)
                    g_sum[name] = g_sum[name] + (g * w[:, None]).T @ g
            count += n
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name in layers:
        per_sample = rows_a[name] // max(1, count)                             # positions T
        out[f"{name}:A"] = (a_sum[name] / max(1, rows_a[name])).float().cpu()
        out[f"{name}:G"] = (g_sum[name] / max(1, count * per_sample)).float().cpu()
    return out


def fedfisher_statistics(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor | None = None, *,
                         device: str | torch.device = "cpu", kind: FedFisherKind = "diagonal", batch_size: int = 128,
                         max_samples: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """FedFisher's client statistic on the client's ``inputs`` (eval mode; ``labels`` not used: the expectation over
    the model's predicted classes is exact). ``kind="diagonal"``: ``{parameter name: diagonal Fisher}``
    (``fisher_statistics``, exact); ``"kfac"``: ``{"<layer>:A": [d+1, d+1], "<layer>:G": [out, out]}`` per Linear /
    Conv2d layer. ``model`` is not modified."""
    if kind not in ("diagonal", "kfac"):
        raise ValueError(f"fedfisher_statistics: kind must be 'diagonal' or 'kfac', got {kind!r}")
    x = inputs if max_samples is None else inputs[:max_samples]
    if kind == "diagonal":
        return fisher_statistics(model, x, device=device, kind="exact", batch_size=batch_size, seed=seed)
    return _kfac_statistics(model, x, device=torch.device(device), batch_size=batch_size)


def _output_permutation(key: str, model: nn.Module, spec_a: PermSpec, spec_b: PermSpec,
                        maps: dict[str, Map]) -> torch.Tensor:
    """Where each output unit of weight ``key`` comes from after the maps (rows of a tensor holding their indices)."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    w = state[key]
    state[key] = torch.arange(w.shape[0], dtype=torch.float64).view(-1, *([1] * (w.dim() - 1))).expand_as(w).clone()
    moved = apply_maps(state, spec_a, spec_b, maps, state)[key]
    return moved.reshape(w.shape[0], -1)[:, 0].round().long().cpu()


def move_kfac(stats: dict[str, torch.Tensor], model: nn.Module, spec_a: PermSpec, spec_b: PermSpec,
              maps: dict[str, Map]) -> dict[str, torch.Tensor]:
    """A model's K-FAC factors moved with its units onto model 0's: ``A`` by the layer's input permutation (the bias
    entry last, in place), ``G`` by its output permutation."""
    layers = kfac_layers(model)
    out = {}
    for name, mod in layers.items():
        key = f"{name}.weight" if name else "weight"
        a, g = stats[f"{name}:A"], stats[f"{name}:G"]
        idx = input_permutation(key, mod.weight, 1, spec_a, spec_b, maps)
        if idx is not None:
            full = torch.cat([idx, torch.arange(len(idx), a.shape[0])])
            a = a.index_select(0, full).index_select(1, full)
        o = _output_permutation(key, model, spec_a, spec_b, maps)
        out[f"{name}:A"], out[f"{name}:G"] = a, g.index_select(0, o).index_select(1, o)
    return out


def check_kfac(stats: list[dict[str, torch.Tensor]], model: nn.Module) -> None:
    """Every model's K-FAC factors name exactly its layers with ``[d(+1), d(+1)]`` / ``[out, out]`` shapes."""
    layers = kfac_layers(model)
    want = {}
    for name, mod in layers.items():
        d = mod.weight[0].numel() + (1 if mod.bias is not None else 0)
        want[f"{name}:A"], want[f"{name}:G"] = (d, d), (mod.weight.shape[0],) * 2
    for i, st in enumerate(stats):
        if set(st) != set(want):
            missing = sorted(set(want) - set(st)) or sorted(set(st) - set(want))
            raise MissingInputError(f"fedfisher: statistics[{i}] are not kind='kfac' factors of these models "
                                    f"({missing[0]!r}; compute them with client_statistics('fedfisher', model, x, "
                                    "kind='kfac'))")
        for k, shape in want.items():
            if tuple(st[k].shape) != shape:
                raise IncompatibleModelsError(f"fedfisher: statistics[{i}][{k!r}] has shape {tuple(st[k].shape)}, "
                                              f"expected {shape}")


@dataclass(frozen=True)
class FedFisherOptions:
    """Options of ``fedfisher`` (defaults: the authors' code).

    Attributes:
        kind: the Fisher approximation, ``"diagonal"`` or ``"kfac"`` (the clients' statistics must be of it).
        steps: server optimisation steps (``T``).
        lr: step size (``η``).
        beta1, beta2, eps: the authors' Adam variant's momentum, second-moment decay and denominator floor.
        align: ``"none"`` (the paper: clients from one initialisation), or Git Re-Basin's ``"weights"`` /
            ``"activations"`` matching onto model 0 first, the Fishers moved with their units.
        max_samples: fusion-set inputs the public-data variant reads (``None``: all).
    """

    kind: FedFisherKind = "diagonal"
    steps: int = 2000
    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 0.01
    align: Align = "none"
    max_samples: int | None = None

    def __post_init__(self) -> None:
        require(self.steps >= 0, "steps", ">= 0", self.steps)
        require(self.lr > 0, "lr", "> 0", self.lr)
        require(0 <= self.beta1 < 1, "beta1", "in [0, 1)", self.beta1)
        require(0 <= self.beta2 < 1, "beta2", "in [0, 1)", self.beta2)
        require(self.eps > 0, "eps", "> 0", self.eps)
        require(self.max_samples is None or self.max_samples >= 1, "max_samples", ">= 1 or None", self.max_samples)


def _gradient_fn(o: FedFisherOptions, models, statistics, weights, device):
    """``(θ0, grad(θ), loss(θ))`` over the floating-point parameters (``{name: tensor}`` float64 on ``device``)."""
    params = [{k: v.detach().to(device=device, dtype=torch.float64) for k, v in m.named_parameters()
               if v.is_floating_point()} for m in models]
    p = torch.tensor([float(w) for w in weights], dtype=torch.float64)
    p = p / p.sum()
    theta0 = {k: sum(float(pk) * th[k] for pk, th in zip(p, params)) for k in params[0]}
    if o.kind == "diagonal":
        fs = [{k: st[k].to(device=device, dtype=torch.float64) for k in params[0]} for st in statistics]
        fsum = {k: sum(float(pk) * f[k] for pk, f in zip(p, fs)) for k in params[0]}
        fth = {k: sum(float(pk) * f[k] * th[k] for pk, f, th in zip(p, fs, params)) for k in params[0]}

        def grad(theta):
            return {k: fsum[k] * theta[k] - fth[k] for k in theta}

        def loss(theta):
            return 0.5 * sum(float(pk) * float((f[k] * (theta[k] - th[k]) ** 2).sum())
                             for pk, f, th in zip(p, fs, params) for k in theta)
        return theta0, grad, loss
    layers = kfac_layers(models[0])

    def split(theta, name, mod):
        key = f"{name}.weight" if name else "weight"
        w = theta[key].reshape(theta[key].shape[0], -1)
        if mod.bias is not None:
            w = torch.cat([w, theta[f"{name}.bias" if name else "bias"][:, None]], 1)
        return w

    facs = [{n: (st[f"{n}:A"].to(device=device, dtype=torch.float64), st[f"{n}:G"].to(device=device,
                                                                                   dtype=torch.float64))
             for n in layers} for st in statistics]
    wk = [{n: split(th, n, mod) for n, mod in layers.items()} for th in params]

    def grad(theta):
        out = {}
        for name, mod in layers.items():
            w = split(theta, name, mod)
            g = sum(float(pk) * f[name][1] @ (w - wk_[name]) @ f[name][0] for pk, f, wk_ in zip(p, facs, wk))
            key = f"{name}.weight" if name else "weight"
            out[key] = g[:, :theta[key][0].numel()].reshape(theta[key].shape)
            if mod.bias is not None:
                out[f"{name}.bias" if name else "bias"] = g[:, -1]
        return out

    def loss(theta):
        tot = 0.0
        for name, mod in layers.items():
            w = split(theta, name, mod)
            for pk, f, wk_ in zip(p, facs, wk):
                d = w - wk_[name]
                tot += 0.5 * float(pk) * float((d * (f[name][1] @ d @ f[name][0])).sum())
        return tot
    return theta0, grad, loss


@register("fedfisher", paper=PAPER_FEDFISHER, options=FedFisherOptions, needs_data=True, any_module=True,
          statistics="fedfisher", client_statistics=fedfisher_statistics)
def fuse_fedfisher(models, *, fusion_inputs, scores, weights, device, seed, options: FedFisherOptions, info: dict,
                   statistics: list[dict[str, torch.Tensor]] | None) -> nn.Module:
    """FedFisher of same-architecture ``models``: ``steps`` updates of the authors' Adam variant on
    ``½ Σ_k p_k (θ − θ_k)ᵀ F_k (θ − θ_k)`` from the weighted average, every floating-point parameter; buffers (BatchNorm
    statistics) the weighted average. ``statistics``: one per model from ``fedfisher_statistics`` (``kind`` as the
    options') on that model's own data; ``None``: computed on ``fusion_inputs`` through each model, the public-data
    variant, with a ``UserWarning``. Fixed point: copies of one model come back unchanged (the gradient is 0 at their
    average). ``info``: ``statistics``, ``kind``, ``steps``, ``objective`` [start, end], ``align`` when aligned."""
    o = options
    ref = models[0]
    require_same_architecture(models, "fedfisher", "FedFisher optimises one set of parameters against every model's: "
                                                   "the same names and shapes are needed")
    if o.kind == "kfac":
        kfac_layers(ref)
        check, move = (lambda st: check_kfac(st, ref)), move_kfac
    else:
        check, move = (lambda st: check_fishers(st, ref)), move_fishers
    models, statistics = merge_statistics("fedfisher", "FedFisher (arXiv 2403.12329)", models, statistics,
                                          check=check, move=move, stat_fn=fedfisher_statistics, align=o.align,
                                          fusion_inputs=fusion_inputs, device=device, seed=seed, info=info,
                                          kind=o.kind, max_samples=o.max_samples)
    theta0, grad, loss = _gradient_fn(o, models, statistics, weights, device)
    theta = {k: v.clone() for k, v in theta0.items()}
    m = {k: torch.zeros_like(v) for k, v in theta.items()}
    v2 = {k: torch.zeros_like(v) for k, v in theta.items()}
    start = loss(theta)
    for _ in range(o.steps):
        g = grad(theta)
        for k in theta:
            m[k].mul_(o.beta1).add_(g[k])
            v2[k].mul_(o.beta2).add_(g[k] * g[k])
            theta[k].sub_(o.lr * m[k] / (v2[k].sqrt() + o.eps))
    end = loss(theta)
    if not all(torch.isfinite(t).all() for t in theta.values()):
        raise NumericalFusionError("fedfisher: the server optimisation diverged (non-finite parameters); lower lr")
    merged = average_state_dicts([mm.state_dict() for mm in models], weights)
    for k, t in theta.items():
        merged[k] = t.to(merged[k].dtype).cpu()
    fused = copy.deepcopy(ref).cpu()
    load_plain(fused, merged)
    info.update(kind=o.kind, steps=o.steps, objective=[start, end])
    return fused.eval()


__all__ = ["fuse_fedfisher", "FedFisherOptions", "fedfisher_statistics", "move_kfac", "check_kfac", "kfac_layers"]
