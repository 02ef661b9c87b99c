"""Fisher merging: each parameter averaged with the models' diagonal Fisher information as weights.

Paper: Matena & Raffel, "Merging Models with Fisher-Weighted Averaging", NeurIPS 2022, arXiv 2111.09832. Written
fresh from the paper.

Each model's posterior is approximated by a Gaussian with the diagonal Fisher as precision; the merge maximises
their weighted joint likelihood, coordinate by coordinate (paper, Eq. 3):

    θ* = Σ_i λ_i F_i ⊙ θ_i / Σ_i λ_i F_i,      F_i = E_x E_{y ~ p_θi(y|x)} [(∇_θ log p_θi(y | x))²]   (diagonal, per
                                                                                                   parameter)

with ``λ_i`` fuse's ``weights`` and a small ``epsilon`` added to every ``F_i`` (the paper's floor: a coordinate
no model is sensitive to gets the weighted average). ``F_i`` is computed by the model's owner on its own data
(``fisher_statistics``: in a federation each client, sent with its weights, one upload). The expectation over
``y`` is exact (the classes weighted by the model's probabilities, the paper's choice for classification) by
default; ``kind='sampled'`` draws one label per input, ``kind='empirical'`` uses the true labels (the "empirical
Fisher", which the paper contrasts). Buffers (BatchNorm statistics) are the weighted average.

Like every per-coordinate merge it assumes models that share units (fine-tuned from one initialisation).
Independently initialised clients do not, and their Fisher merge is about as poor as their plain average;
``align='weights'`` / ``'activations'`` permutes every model onto model 0's units first (Git Re-Basin,
``fedfuse.fusion.stat_align``), the Fishers moved with the parameters they belong to.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fedfuse.fusion.average import average_state_dicts
from fedfuse.fusion.permute import Map, PermSpec, apply_maps
from fedfuse.fusion.permute.maps import load_plain
from fedfuse.fusion.registry import IncompatibleModelsError, MissingInputError, register, require, require_same_architecture
from fedfuse.fusion.regmean import layer_rows, merge_layers, merge_statistics
from fedfuse.fusion.stat_align import Align

PAPER_FISHER = ('Fisher merging (Matena & Raffel, "Merging Models with Fisher-Weighted Averaging", NeurIPS 2022, '
                'arXiv 2111.09832): parameters averaged with their diagonal Fisher information as weights.')
FisherKind = Literal["exact", "sampled", "empirical"]


class _PerSampleGrads:
    """Per-sample gradients of the weights and biases of a model's ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d``
    layers from one batched backward pass (each layer's input and output gradient, the per-sample weight gradient
    ``Σ_positions g ⊗ a`` formed per sample), so a Fisher needs no per-sample backward. Layers called more than once
    in a forward pass are left to the generic path (``covered`` says which parameters this one gives)."""

    def __init__(self, net: nn.Module):
        self.layers = merge_layers(net)
        self.inputs: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.rows: dict[str, torch.Tensor] = {}
        self.handles = []
        for name, mod in self.layers.items():
            self.handles.append(mod.register_forward_hook(self._keep(name)))

    def _keep(self, name):
        def fn(mod, args, out):
            self.calls[name] = self.calls.get(name, 0) + 1
            self.inputs[name] = args[0].detach()
            self.rows.pop(name, None)
            if out.requires_grad:
                out.register_hook(lambda g: self.grads.__setitem__(name, g.detach()))
        return fn

    def covered(self) -> dict[str, str]:
        """``{parameter name: layer name}`` of the parameters whose per-sample gradients this gives."""
        out = {}
        for name, mod in self.layers.items():
            if self.calls.get(name) == 1:
                prefix = f"{name}." if name else ""
                out[prefix + "weight"] = name
                if getattr(mod, "bias", None) is not None:
                    out[prefix + "bias"] = name
        return out

    def per_sample(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``([N, *weight shape], [N, out] | None)``: layer ``name``'s per-sample weight and bias gradients."""
        mod, x, g = self.layers[name], self.inputs[name], self.grads[name]
        n = x.shape[0]
        if isinstance(mod, nn.Linear):
            a, go = x.reshape(n, -1, x.shape[-1]), g.reshape(n, -1, g.shape[-1])
            w = torch.einsum("nto,ntd->nod", go, a)
            return w, (go.sum(1) if mod.bias is not None else None)
        if name not in self.rows:   # the unfolded input, once per forward pass (every class's backward reads it)
            rows = layer_rows(mod, x)                               # [groups, n·L, d]
            self.rows[name] = rows.reshape(rows.shape[0], n, -1, rows.shape[2])
        a = self.rows[name]                                         # [groups, n, L, d]
        groups = a.shape[0]
        go = g.reshape(n, groups, g.shape[1] // groups, -1)         # [n, groups, out/g, L]
        w = torch.einsum("ngol,gnld->ngod", go, a).reshape(n, *mod.weight.shape)
        return w, (g.reshape(n, g.shape[1], -1).sum(-1) if mod.bias is not None else None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _weighted_sq_sum(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``Σ_n w_n g_n²`` of per-sample gradients ``g [N, *shape]`` (squared in place: ``g`` is a temporary), float64."""
    sq = g.square_().reshape(g.shape[0], -1)
    return (w.to(sq.dtype) @ sq).double().reshape(g.shape[1:])


def _sq_grads(net: nn.Module, params: dict, x: torch.Tensor, kind: str, y: torch.Tensor | None,
              gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``Σ_n`` over the batch ``x`` of each parameter's squared per-sample gradient of ``log p(y | x_n)``, in
    expectation over ``y ~ p`` (``exact``: one backward pass per class, weighted by the probabilities), for one
    sampled ``y`` (``sampled``) or for the labels ``y`` (``empirical``). Linear / Conv layers' per-sample gradients
    come from one batched backward each (``_PerSampleGrads``); any other parameter's (norms, embeddings) from one
    backward per sample. The model is in eval mode, so the samples do not interact."""
    hooks = _PerSampleGrads(net)
    try:
        logp = net(x).log_softmax(-1)                                # [N, C]
        covered = hooks.covered()
        rest = [k for k in params if k not in covered]
        probs = logp.detach().exp().double()
        if kind == "exact":
            targets = [(torch.full((len(x),), c, dtype=torch.long, device=x.device), probs[:, c])
                       for c in range(logp.shape[1])]
        else:
            if kind == "sampled":
                y = torch.multinomial(probs.float().cpu(), 1, generator=gen).squeeze(1).to(x.device)
            targets = [(y, torch.ones(len(x), dtype=torch.float64, device=x.device))]
        out = {k: torch.zeros(v.shape, dtype=torch.float64, device=x.device) for k, v in params.items()}
        live = dict(net.named_parameters())
        for yc, wc in targets:
            chosen = logp.gather(1, yc[:, None]).squeeze(1)          # [N]
            hooks.grads.clear()
            if covered:
                torch.autograd.grad(chosen.sum(), [live[k] for k in covered], retain_graph=True, allow_unused=True)
            for name in set(covered.values()):
                w, b = hooks.per_sample(name)
                prefix = f"{name}." if name else ""
                out[prefix + "weight"] += _weighted_sq_sum(w, wc)
                if b is not None:
                    out[prefix + "bias"] += _weighted_sq_sum(b, wc)
            for n in range(len(x)) if rest else ():
                gs = torch.autograd.grad(chosen[n], [live[k] for k in rest], retain_graph=True, allow_unused=True)
                for k, gk in zip(rest, gs):
                    if gk is not None:
                        out[k] += wc[n] * gk.double() ** 2
        return out
    finally:
        hooks.close()


def fisher_statistics(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor | None = None, *,
                      device: str | torch.device = "cpu", kind: FisherKind = "exact", batch_size: int = 128,
                      max_samples: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fisher merging's client statistic: the diagonal Fisher of every floating-point parameter of ``model`` on
    ``inputs [N, *input_shape]`` (eval mode), the mean over the inputs of the squared per-sample gradient of
    ``log p(y | x)``: ``{parameter name: tensor of the parameter's shape and dtype}`` (accumulated in float64).
    ``kind``: ``exact`` (expectation over the model's predicted class distribution, the paper's), ``sampled`` (one
    ``y ~ p(y|x)`` per input) or ``empirical`` (the true ``labels [N]``). ``max_samples``: the first that many
    inputs only. ``model`` is not modified (a copy runs on ``device``)."""
    if kind not in ("exact", "sampled", "empirical"):
        raise ValueError(f"fisher_statistics: kind must be 'exact', 'sampled' or 'empirical', got {kind!r}")
    if kind == "empirical" and labels is None:
        raise MissingInputError("fisher_statistics: kind='empirical' needs the labels of the inputs")
    device = torch.device(device)
    net = copy.deepcopy(model).to(device).eval()
    params = {k: v for k, v in net.named_parameters() if v.is_floating_point()}
    if not params:
        raise IncompatibleModelsError("fisher: the model has no floating-point parameters")
    for p in net.parameters():
        p.requires_grad_(p.is_floating_point())
    x = inputs if max_samples is None else inputs[:max_samples]
    dtype = next(iter(params.values())).dtype
    gen = torch.Generator().manual_seed(seed)
    acc = {k: torch.zeros(v.shape, dtype=torch.float64, device=device) for k, v in params.items()}
    for i in range(0, len(x), batch_size):
        xb = x[i:i + batch_size].to(device=device, dtype=dtype)
        yb = labels[i:i + batch_size].to(device) if labels is not None and kind == "empirical" else None
        for k, v in _sq_grads(net, params, xb, kind, yb, gen).items():
            acc[k] += v
    return {k: (v / max(1, len(x))).to(params[k].dtype).cpu() for k, v in acc.items()}


def move_fishers(stats: dict[str, torch.Tensor], model: nn.Module, spec_a: PermSpec, spec_b: PermSpec,
                 maps: dict[str, Map]) -> dict[str, torch.Tensor]:
    """A model's Fishers moved with its parameters onto model 0's units (the same maps as the weights)."""
    state = {k: (stats[k] if k in stats else v.detach().cpu()) for k, v in model.state_dict().items()}
    moved = apply_maps(state, spec_a, spec_b, maps, state)
    return {k: moved[k].cpu() for k in stats}


@dataclass(frozen=True)
class FisherOptions:
    """Options of ``fisher``.

    Attributes:
        epsilon: added to every Fisher entry (the paper's floor): a coordinate no model is sensitive to gets the
            weighted average.
        kind: the Fisher computed on the fusion set when no statistics are given (the public-data variant):
            ``exact`` or ``sampled`` (``empirical`` needs labels, which the fusion set has not).
        align: ``"none"`` (the paper: models from one shared initialisation), or Git Re-Basin's ``"weights"`` /
            ``"activations"`` (the latter on the fusion set) matching of every model onto model 0 first, the
            Fishers moved with the parameters (independently initialised clients).
        max_samples: fusion-set inputs the public-data variant reads (``None``: all).
    """

    epsilon: float = 1e-8
    kind: Literal["exact", "sampled"] = "exact"
    align: Align = "none"
    max_samples: int | None = None

    def __post_init__(self) -> None:
        require(self.epsilon > 0.0, "epsilon", "> 0", self.epsilon)
        require(self.max_samples is None or self.max_samples >= 1, "max_samples", ">= 1 or None", self.max_samples)


def check_fishers(stats: list[dict[str, torch.Tensor]], model: nn.Module) -> None:
    """Every model's Fishers name exactly its floating-point parameters with their shapes, non-negative;
    ``MissingInputError`` / ``IncompatibleModelsError`` naming the model and the parameter otherwise."""
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters() if v.is_floating_point()}
    for i, st in enumerate(stats):
        extra = sorted(set(st) - set(shapes))
        if extra:
            raise IncompatibleModelsError(f"fisher: statistics[{i}] has {extra[0]!r}, which is not a parameter of the "
                                          "models")
        for k, shape in shapes.items():
            if k not in st:
                raise MissingInputError(f"fisher: statistics[{i}] has no Fisher for parameter {k!r} (compute them "
                                        "with client_statistics('fisher', model, inputs))")
            if tuple(st[k].shape) != shape:
                raise IncompatibleModelsError(f"fisher: statistics[{i}][{k!r}] has shape {tuple(st[k].shape)}, the "
                                              f"parameter {shape}")
            if bool((st[k] < 0).any()):
                raise IncompatibleModelsError(f"fisher: statistics[{i}][{k!r}] has negative entries (a Fisher is a "
                                              "mean of squares)")


@register("fisher", paper=PAPER_FISHER, options=FisherOptions, needs_data=True, any_module=True,
          statistics="fisher", client_statistics=fisher_statistics)
def fuse_fisher(models, *, fusion_inputs, scores, weights, device, seed, options: FisherOptions, info: dict,
                statistics: list[dict[str, torch.Tensor]] | None) -> nn.Module:
    """Fisher merging of same-architecture ``models`` (any ``nn.Module``): every floating-point parameter
    ``θ* = Σ w_i (F_i + ε) θ_i / Σ w_i (F_i + ε)``, buffers averaged with ``weights``.

    ``statistics``: one ``{parameter name: Fisher of its shape}`` per model from ``fisher_statistics`` on that model's
    own data (the paper's setting; in fedfuse, each client's). ``None``: computed on ``fusion_inputs [B, *input]``
    through each model (``kind``, no labels), the public-data variant, with a ``UserWarning`` saying so. Fixed points:
    copies of one model, and one model, come back unchanged; equal Fishers give the weighted average. ``info``:
    ``statistics``, ``align`` when aligned. Raises ``IncompatibleModelsError`` for models of other architectures."""
    o = options
    ref = models[0]
    require_same_architecture(models, "fisher", "Fisher merging averages parameter by parameter: the same names and shapes are needed")
    models, statistics = merge_statistics("fisher", "Fisher merging (arXiv 2111.09832)", models, statistics,
                                          check=lambda st: check_fishers(st, ref), move=move_fishers,
                                          stat_fn=fisher_statistics, align=o.align, fusion_inputs=fusion_inputs,
                                          device=device, seed=seed, info=info, kind=o.kind,
                                          max_samples=o.max_samples)
    merged = average_state_dicts([m.state_dict() for m in models], weights)
    states = [dict(m.named_parameters()) for m in models]
    for k in statistics[0]:
        num = torch.zeros(states[0][k].shape, dtype=torch.float64, device=device)
        den = torch.zeros_like(num)
        for st, s, w in zip(statistics, states, weights):
            f = st[k].to(device=device, dtype=torch.float64) + o.epsilon
            num += w * f * s[k].detach().to(device=device, dtype=torch.float64)
            den += w * f
        merged[k] = (num / den).to(merged[k].dtype).cpu()
    fused = copy.deepcopy(ref).cpu()
    load_plain(fused, merged)
    return fused.eval()


__all__ = ["fisher_statistics", "fuse_fisher", "FisherOptions", "move_fishers", "check_fishers"]
