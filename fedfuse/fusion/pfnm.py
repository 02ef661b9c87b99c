"""PFNM: Bayesian nonparametric matching of the clients' hidden units into global units (Beta-Bernoulli process).

Paper: Yurochkin, Agarwal, Ghosh, Greenewald, Hoang & Khazaeni, "Bayesian Nonparametric Federated Learning of Neural
Networks", ICML 2019, arXiv 1905.12022. Written fresh from the paper; how it is applied to a CNN follows what the
public one-shot code does when it runs PFNM on LeNet (FedFisher's baseline, ``Divyansh03/FedFisher``
``algs/pfnm.py``, itself FedMA's ``IBM/FedMA`` layer-wise matching without the retraining between layers).

Model. Every client unit's weight vector ``w_jl`` (its incoming weights and bias) is a noisy copy of one global unit
``θ_i``: ``w_jl ~ N(θ_i, σ² I)``, ``θ_i ~ N(μ0, σ0² I)``, and which global units client ``j`` holds is a draw of the
Beta-Bernoulli process with mass ``γ``. The MAP assignment is found client by client: for client ``j`` the other
clients' matches are fixed and its units are assigned by the Hungarian algorithm on the posterior gain (paper, Eq. 9;
``x = w/σ²``, a global unit with ``m`` members has natural mean ``G = μ0/σ0² + Σ x`` and precision ``S = 1/σ0² + m/σ²``)

    existing unit i:  ½ (‖G_i + x_l‖² / (S_i + 1/σ²) − ‖G_i‖² / S_i) + log(m_i / (J − m_i))
    k-th new unit:    ½ (‖μ0/σ0² + x_l‖² / (1/σ0² + 1/σ²) − ‖μ0/σ0²‖² σ0²) + log(γ / J) − log k

(``m_i`` counted without client ``j``), starting from the client with the most units, then ``iterations`` sweeps
over the clients in a random order (seeded), each client's units taken out and matched again. A unit no existing
global unit explains opens a new one, so **the global model grows when matching says so** (at most the sum of the
clients' widths); the global unit is the posterior mean ``G_i / S_i`` (shrunk towards the prior: copies of one model
do not come back unchanged).

Deep models, layer by layer (the public code's practice, ``oneshot_matching``): the first hidden layer's units are
matched on ``[incoming weights, bias]``; each client's next layer then has its input columns moved onto the global
units (zeros for global units the client lacks: convolutions per input channel, the first linear layer after a
flatten per channel block of ``H·W`` features) and is matched the same way, up to the last hidden layer. Convolution
filters are matched as vectors of ``C_in·k_h·k_w`` weights and the bias (no other treatment of the spatial
structure). The class layer is not matched: each class's output row (weights and bias) is the clients' average
weighted by their counts of that class (``statistics``: ``client_statistics('pfnm', model, x, y)``, the client's class
counts; without them, ``fuse``'s ``weights`` for every class). BatchNorm (eval mode) is folded into the layer before
it; the fused model has none. Defaults are the public code's: ``σ² = σ0² = 1``, ``μ0 = 0`` (bias prior mean 0.1),
``γ = 7``, 5 sweeps.

Deviations: the gains above are the paper's (Eq. 9, up to a common factor); the public code doubles the quadratic
and the new-unit terms but not the popularity term ``log(m/(J − m))``, i.e. weights that one half as much, which makes
a match of a unit few clients share cheaper and the global model narrower (``popularity=0.5`` runs the public code's
weighting). The public code's cap of 700 global units per layer is not applied.
The paper's PFNM for one-hidden-layer networks also matches on the outgoing (class) weights; the layer-wise code, and
this, do not. Only ``nn.Sequential`` chains of ``Conv2d`` (groups 1) / ``Linear`` layers with parameter-free
modules between them (activations, pooling, flatten, dropout) and BatchNorm right after a layer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from fedfuse.fusion.registry import IncompatibleModelsError, MissingInputError, register, require

PAPER_PFNM = ('PFNM (Yurochkin et al., "Bayesian Nonparametric Federated Learning of Neural Networks", ICML 2019, '
              'arXiv 1905.12022): Beta-Bernoulli-process matching of hidden units, layer by layer.')
_PASS = (nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.GELU, nn.Tanh, nn.Sigmoid, nn.ELU, nn.SiLU, nn.MaxPool2d, nn.AvgPool2d,
         nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Dropout, nn.Identity)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d)


@dataclass(frozen=True)
class PFNMOptions:
    """Options of ``pfnm`` (defaults: the public code's, FedFisher's PFNM baseline).

    Attributes:
        sigma_sq: σ², the variance of a client unit around its global unit.
        sigma0_sq: σ0², the prior variance of a global unit.
        mu0: prior mean of the weights; mu0_bias: of the biases.
        gamma: the Beta-Bernoulli (Indian buffet) process mass γ: larger opens new global units more readily.
        iterations: sweeps over the clients after the first pass (each client's units matched again).
        popularity: weight of the popularity term ``log(m/(J − m))`` against the rest: 1 the paper's, 0.5 the public
            code's.
    """

    sigma_sq: float = 1.0
    sigma0_sq: float = 1.0
    mu0: float = 0.0
    mu0_bias: float = 0.1
    gamma: float = 7.0
    iterations: int = 5
    popularity: float = 1.0

    def __post_init__(self) -> None:
        require(self.sigma_sq > 0, "sigma_sq", "> 0", self.sigma_sq)
        require(self.sigma0_sq > 0, "sigma0_sq", "> 0", self.sigma0_sq)
        require(self.gamma > 0, "gamma", "> 0", self.gamma)
        require(self.iterations >= 0, "iterations", ">= 0", self.iterations)
        require(self.popularity >= 0, "popularity", ">= 0", self.popularity)


def pfnm_statistics(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor | None = None, *,
                    device: str | torch.device = "cpu", num_classes: int | None = None) -> dict[str, torch.Tensor]:
    """PFNM's client statistic: ``{"class_counts": float tensor [classes]}``, how many of the client's examples have
    each label (the class layer's weights). ``num_classes``: default the model's output width (one forward pass of
    one input). ``model`` is not modified."""
    if labels is None:
        raise MissingInputError("pfnm: the client statistics are the class counts; they need the labels")
    if num_classes is None:
        with torch.no_grad():
            num_classes = int(copy.deepcopy(model).cpu().eval()(inputs[:1].cpu()).shape[-1])
    y = torch.as_tensor(labels).long().cpu()
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise IncompatibleModelsError(f"pfnm: labels must be in [0, {num_classes}), got [{int(y.min())}, "
                                      f"{int(y.max())}]")
    return {"class_counts": torch.bincount(y, minlength=num_classes).double()}


def _chain(model: nn.Module) -> list[tuple[int, nn.Module, nn.Module | None]]:
    """``[(index, Conv2d | Linear, its BatchNorm or None)]`` of a supported ``nn.Sequential``."""
    if not isinstance(model, nn.Sequential):
        raise IncompatibleModelsError(f"pfnm: matches the layers of an nn.Sequential chain, got {type(model).__name__}")
    out: list = []
    mods = list(model.children())
    for i, m in enumerate(mods):
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            if isinstance(m, nn.Conv2d) and m.groups != 1:
                raise IncompatibleModelsError(f"pfnm: layer {i} is a grouped convolution (groups {m.groups})")
            out.append([i, m, None])
        elif isinstance(m, _BN):
            if not out or out[-1][0] != i - 1 or not m.track_running_stats:
                raise IncompatibleModelsError(f"pfnm: BatchNorm {i} must follow a Conv2d / Linear directly and keep "
                                              "running statistics (it is folded into that layer)")
            out[-1][2] = m
        elif not isinstance(m, _PASS):
            raise IncompatibleModelsError(f"pfnm: module {i} is a {type(m).__name__}; PFNM takes Conv2d / Linear "
                                          "layers with activations, pooling, flatten, dropout and BatchNorm between")
    if len(out) < 2 or not isinstance(out[-1][1], nn.Linear):
        raise IncompatibleModelsError("pfnm: needs at least one hidden layer and a Linear class layer last")
    return [tuple(x) for x in out]


def _folded(layer: nn.Module, bn: nn.Module | None) -> tuple[np.ndarray, np.ndarray]:
    """The layer's weight ``[out, in, *kernel]`` and bias ``[out]`` (float64), its BatchNorm folded in."""
    w = layer.weight.detach().double().cpu()
    b = layer.bias.detach().double().cpu() if layer.bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    if bn is not None:
        scale = (bn.running_var.double().cpu() + bn.eps).rsqrt()
        if bn.weight is not None:
            scale = scale * bn.weight.detach().double().cpu()
        shift = bn.bias.detach().double().cpu() if bn.bias is not None else 0.0
        w = w * scale.view(-1, *([1] * (w.dim() - 1)))
        b = (b - bn.running_mean.double().cpu()) * scale + shift
    return w.numpy(), b.numpy()


def _patch(w: np.ndarray, assign: list[int], width: int) -> np.ndarray:
    """``w``'s input columns moved onto ``width`` global units (``assign[u]``: the global unit of the client's input
    unit ``u``; zeros elsewhere): per channel for convolutions, per block of ``in / units`` features for a linear layer
    after a flatten."""
    out, units = w.shape[0], len(assign)
    if w.shape[1] % units:
        raise IncompatibleModelsError(f"pfnm: a layer with {w.shape[1]} inputs follows a layer of {units} units")
    blocks = w.reshape(out, units, -1)
    new = np.zeros((out, width, blocks.shape[2]))
    new[:, assign, :] = blocks
    return new.reshape(out, width * blocks.shape[2]) if w.ndim == 2 else new.reshape(out, width, *w.shape[2:])


def match_units(rows: list[np.ndarray], prior_mean: np.ndarray, o: PFNMOptions,
                rng: np.random.Generator) -> tuple[list[list[int]], np.ndarray]:
    """PFNM's MAP matching of the clients' units ``rows[j] [L_j, D]``: ``(assignment per client (its unit l → global
    unit), the global units' posterior means [L, D])``."""
    J = len(rows)
    s, p0 = 1.0 / o.sigma_sq, 1.0 / o.sigma0_sq
    xs = [r * s for r in rows]
    prior_nat = prior_mean * p0
    prior_term = float(prior_nat @ prior_nat) / p0
    nat: list[np.ndarray] = []       # per global unit: natural mean G (without the prior), precision count m
    counts: list[int] = []
    assign: list[list[int] | None] = [None] * J

    def add(j: int) -> None:
        nonlocal nat, counts
        x = xs[j]
        L, Lj = len(counts), len(x)
        cost = np.empty((Lj, L + Lj))
        if L:
            G = np.stack(nat) + prior_nat                        # [L, D]
            S = p0 + np.asarray(counts, dtype=np.float64) * s    # [L]
            gx = x @ G.T                                         # [Lj, L]
            g2 = (G * G).sum(1)
            x2 = (x * x).sum(1)
            m = np.asarray(counts, dtype=np.float64)
            with np.errstate(divide="ignore"):
                pop = o.popularity * (np.log(m) - np.log(J - m))
            cost[:, :L] = 0.5 * ((g2[None, :] + 2 * gx + x2[:, None]) / (S + s)[None, :] - (g2 / S)[None, :]) + pop
        new = x + prior_nat
        gain_new = 0.5 * ((new * new).sum(1) / (p0 + s) - prior_term)
        cost[:, L:] = gain_new[:, None] + np.log(o.gamma / J) - np.log(np.arange(1, Lj + 1))[None, :]
        cost = np.where(np.isfinite(cost), cost, -1e300)
        r, c = linear_sum_assignment(cost, maximize=True)
        out = [0] * Lj
        opened = 0
        for l, i in zip(r, c):
            if i < L:
                nat[i] = nat[i] + x[l]
                counts[i] += 1
                out[l] = int(i)
            else:
                nat.append(x[l].copy())
                counts.append(1)
                out[l] = L + opened
                opened += 1
        assign[j] = out

    def remove(j: int) -> None:
        nonlocal nat, counts
        for l, i in enumerate(assign[j]):
            nat[i] = nat[i] - xs[j][l]
            counts[i] -= 1
        keep = [i for i, c in enumerate(counts) if c > 0]
        renum = {old: new for new, old in enumerate(keep)}
        nat = [nat[i] for i in keep]
        counts = [counts[i] for i in keep]
        assign[j] = None
        for k in range(J):
            if assign[k] is not None:
                assign[k] = [renum[i] for i in assign[k]]

    order = sorted(range(J), key=lambda j: -len(rows[j]))
    for j in order:
        add(j)
    for _ in range(o.iterations):
        for j in rng.permutation(J):
            remove(int(j))
            add(int(j))
    G = np.stack(nat) + prior_nat
    S = p0 + np.asarray(counts, dtype=np.float64) * s
    return [list(a) for a in assign], G / S[:, None]


@register("pfnm", paper=PAPER_PFNM, options=PFNMOptions, needs_data=False, families=("sequential",),
          same_architecture=False, mixed_widths=True, statistics="class_counts", client_statistics=pfnm_statistics)
def fuse_pfnm(models, *, fusion_inputs, scores, weights, device, seed, options: PFNMOptions, info: dict,
              statistics: list[dict[str, torch.Tensor]] | None) -> nn.Module:
    """PFNM of ``nn.Sequential`` Conv2d / Linear chains (any hidden widths, the same depth, input and classes): model
    0's chain with every hidden layer as wide as its matched global units (``info["widths"]``). ``statistics``: the
    clients' class counts (``pfnm_statistics``) for the class layer; ``None``: ``weights`` for every class.
    ``IncompatibleModelsError`` for other modules or mismatched depths / inputs / classes."""
    o = options
    chains = [_chain(m) for m in models]
    depth = len(chains[0])
    for k, ch in enumerate(chains[1:], 1):
        if len(ch) != depth or any(type(a[1]) is not type(b[1]) for a, b in zip(ch, chains[0])):
            raise IncompatibleModelsError(f"pfnm: model {k} has another layer sequence than model 0")
        if ch[0][1].weight.shape[1:] != chains[0][0][1].weight.shape[1:]:
            raise IncompatibleModelsError(f"pfnm: model {k}'s first layer takes other inputs than model 0's")
        if ch[-1][1].out_features != chains[0][-1][1].out_features:
            raise IncompatibleModelsError(f"pfnm: model {k} has {ch[-1][1].out_features} classes, model 0 "
                                          f"{chains[0][-1][1].out_features}")
    classes = chains[0][-1][1].out_features
    if statistics is not None:
        for k, st in enumerate(statistics):
            if set(st) != {"class_counts"} or tuple(st["class_counts"].shape) != (classes,):
                raise IncompatibleModelsError(f"pfnm: statistics[{k}] must be {{'class_counts': [{classes}]}} (what "
                                              "client_statistics('pfnm', model, x, y) returns)")
            if bool((st["class_counts"] < 0).any()):
                raise IncompatibleModelsError(f"pfnm: statistics[{k}] has negative class counts")
    rng = np.random.default_rng(seed)
    folded = [[_folded(layer, bn) for _, layer, bn in ch] for ch in chains]
    assign: list[list[int]] | None = None
    width = 0
    fused_layers = []
    for li in range(depth - 1):
        rows, shape = [], None
        for j in range(len(models)):
            w, b = folded[j][li]
            if assign is not None:
                w = _patch(w, assign[j], width)
            shape = w.shape[1:]
            rows.append(np.hstack([w.reshape(w.shape[0], -1), b[:, None]]))
        prior = np.full(rows[0].shape[1], o.mu0)
        prior[-1] = o.mu0_bias
        assign, glob = match_units(rows, prior, o, rng)
        width = glob.shape[0]
        fused_layers.append((glob[:, :-1].reshape(width, *shape), glob[:, -1]))
    lasts = []
    for j in range(len(models)):
        w, b = folded[j][-1]
        lasts.append(np.hstack([_patch(w, assign[j], width), b[:, None]]))
    if statistics is not None:
        cnt = torch.stack([st["class_counts"].double() for st in statistics]).numpy()   # [J, C]
        info["last_layer"] = "class counts"
    else:
        cnt = np.repeat(np.asarray(weights, dtype=np.float64)[:, None], classes, axis=1)
        info["last_layer"] = "weights"
    tot = cnt.sum(0, keepdims=True)
    fallback = np.asarray(weights, dtype=np.float64)[:, None] / float(np.sum(weights))
    share = np.where(tot > 0, cnt / np.where(tot > 0, tot, 1.0), fallback)           # a class no client has
    last = sum(share[j][:, None] * lasts[j] for j in range(len(models)))
    fused_layers.append((last[:, :-1], last[:, -1]))
    fused = _build(models[0], chains[0], fused_layers)
    info["widths"] = [int(w.shape[0]) for w, _ in fused_layers[:-1]]
    info["statistics"] = "clients" if statistics is not None else "none"
    return fused.to(device).cpu().eval()


def _build(model: nn.Module, chain, layers) -> nn.Module:
    """Model 0's Sequential with each Conv2d / Linear replaced by one of the fused shapes and weights (a bias always:
    PFNM matches it; BatchNorm folded, so replaced by Identity)."""
    mods = list(copy.deepcopy(model).children())
    for (i, layer, bn), (w, b) in zip(chain, layers):
        if isinstance(layer, nn.Conv2d):
            new = nn.Conv2d(w.shape[1], w.shape[0], layer.kernel_size, stride=layer.stride, padding=layer.padding,
                            dilation=layer.dilation, bias=True, padding_mode=layer.padding_mode)
        else:
            new = nn.Linear(w.shape[1], w.shape[0], bias=True)
        dtype = layer.weight.dtype
        with torch.no_grad():
            new.weight.copy_(torch.from_numpy(np.ascontiguousarray(w)).to(dtype))
            new.bias.copy_(torch.from_numpy(np.ascontiguousarray(b)).to(dtype))
        mods[i] = new
        if bn is not None:
            mods[i + 1] = nn.Identity()
    return nn.Sequential(*mods)


__all__ = ["fuse_pfnm", "PFNMOptions", "pfnm_statistics", "match_units"]
