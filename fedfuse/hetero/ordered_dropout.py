"""FjORD's ordered dropout in local training: a client of tier ``r`` trains, batch by batch, the nested
sub-model of a width ``p`` drawn uniformly from the federation's tiers ``p <= r``, so every tier's model is
trained by every client that can hold it, in its own context (Horváth et al., "FjORD: Fair and Accurate
Federated Learning under heterogeneous targets with Ordered Dropout", arXiv 2102.13460, §3 "Ordered
Dropout"). Without self-distillation.

``draw='sandwich'`` trains the client's own width in every batch and one narrower width besides (the two losses
summed): the sandwich rule of slimmable networks (Yu & Huang, "Universally Slimmable Networks and Improved Training
Techniques", arXiv 1903.05134, §3.2), here with the narrower width drawn uniformly. The own (for a full-width client:
the global) model gets every batch, at the cost of one narrower forward and backward pass per batch.

The sub-model of width ``p`` is the tier model the server would send a ``p`` client: the same nested layout
(``fedfuse.hetero.submodel``, top-left inside the client's own model, which is itself the global model's
tier-``r`` slice). Its forward pass runs the width-``p`` architecture (``torch.func.functional_call``) on
parameters *gathered* from the client's model, so the gradients land on exactly the entries the
sub-model holds and the reply is the client's usual tier model (the server needs nothing new).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from fedfuse.hetero.submodel import submodel


class OrderedDropout:
    """Per-batch forward of a randomly drawn nested sub-model of ``model``.

    Args:
        model: the client's model (width ``r``); it is trained in place.
        sub_models: architectures of the narrower widths to draw from (their weights are ignored), each a
            nested sub-model of ``model`` (same family and depth; ``ValueError`` otherwise).
        seed: seed of the draws (the run's client seed: the same run draws the same widths).
        weights: the draw probabilities of ``[model, *sub_models]`` (``draw_weights``); ``None``: FjORD's uniform
            draw over all ``len(sub_models) + 1`` widths. More weight on ``model`` keeps more of the wide clients'
            training on the full model (which the global model is), less trains the narrow tiers more.
        positions: per sub-model, the flat positions of its state entries in ``model`` (a ``SubModel``'s
            ``positions``); ``None``: HeteroFL's top-left layout (``fedfuse.hetero.submodel``). Given for models the
            family adapters do not take as such (a depth tier's exits: ``fedfuse.hetero.depth.exit_submodel``).

    Calling it with a batch ``x [B, *input_shape]`` draws one of ``len(sub_models) + 1`` widths (``model`` itself
    included) and returns that width's logits ``[B, num_classes]``.
    """

    def __init__(self, model: nn.Module, sub_models: list[nn.Module], *, seed: int = 0,
                 weights: Sequence[float] | None = None,
                 positions: Sequence[dict[str, torch.Tensor]] | None = None, sandwich: bool = False) -> None:
        if sandwich and (weights is not None or not sub_models):
            raise ValueError("ordered dropout: the sandwich rule draws the narrower width uniformly (no weights) and "
                             "needs at least one narrower sub-model")
        self.sandwich = bool(sandwich)
        if weights is not None:
            w = torch.as_tensor([float(v) for v in weights], dtype=torch.float64)
            if len(w) != len(sub_models) + 1 or bool((w < 0).any()) or not float(w.sum()) > 0:
                raise ValueError(f"ordered dropout: weights must be {len(sub_models) + 1} non-negative numbers (the "
                                 f"model and each sub-model) with a positive sum, got {list(weights)!r}")
            weights = (w / w.sum()).cumsum(0)
        self.cumulative = weights
        self.model = model
        # flat positions of every sub-model entry inside the client's model (HeteroFL's top-left slice)
        if positions is not None and len(positions) != len(sub_models):
            raise ValueError(f"ordered dropout: {len(positions)} position maps for {len(sub_models)} sub-models")
        self.subs = [(m, submodel(model, m, offset=0).positions if positions is None else dict(positions[i]))
                     for i, m in enumerate(sub_models)]
        self.gen = torch.Generator().manual_seed(int(seed))
        self.draws = [0] * (len(self.subs) + 1)   # how often each width ran (index 0: the full model)

    def _gathered(self, positions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors = dict(self.model.named_parameters())
        tensors.update(self.model.named_buffers())
        out = {}
        for key, pos in positions.items():
            t = tensors[key]
            # index_select keeps the autograd link: the gradient of a sub-model entry goes to its source entry
            out[key] = t.reshape(-1).index_select(0, pos.reshape(-1).to(t.device)).reshape(pos.shape)
        return out

    def draw(self) -> int:
        """The next width: 0 = the client's own model, ``i`` = ``sub_models[i - 1]``."""
        if self.cumulative is None:
            return int(torch.randint(len(self.subs) + 1, (1,), generator=self.gen))
        u = float(torch.rand((), dtype=torch.float64, generator=self.gen))
        return min(int((self.cumulative <= u).sum()), len(self.subs))

    def _logits(self, k: int, x: torch.Tensor) -> torch.Tensor:
        self.draws[k] += 1
        if k == 0:
            return self.model(x)
        sub, positions = self.subs[k - 1]
        sub.to(x.device).train(self.model.training)
        return functional_call(sub, self._gathered(positions), (x,))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._logits(self.draw(), x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The sandwich rule's batch loss (``sandwich=True``): the own width's cross-entropy plus that of one
        narrower width drawn uniformly (``training.train``'s ``loss_fn``)."""
        k = 1 + int(torch.randint(len(self.subs), (1,), generator=self.gen))
        return (torch.nn.functional.cross_entropy(self._logits(0, x), y)
                + torch.nn.functional.cross_entropy(self._logits(k, x), y))


def draw_weights(draw: str | float, own: float, widths: Sequence[float]) -> list[float] | None:
    """The draw probabilities of a width-``own`` client's ``[own, *widths]`` (``widths`` its narrower ones) for the
    run-config's ``ordered-dropout-draw``: ``"uniform"`` and ``"sandwich"`` → ``None`` (FjORD: every width alike;
    the sandwich rule's narrower width); ``"width"`` → each
    width in proportion to itself (a width-1 client with a 1/8 tier trains its own width 8/9 of its batches, the
    narrow one 1/9); a number ``w`` in (0, 1) → ``w`` for the own width, the rest split evenly. ``ValueError``
    otherwise."""
    if draw in ("uniform", "sandwich"):   # the sandwich rule draws its narrower width uniformly
        return None
    if draw == "width":
        return [float(own), *(float(p) for p in widths)]
    if isinstance(draw, bool) or not isinstance(draw, (int, float)) or not 0 < draw < 1:
        raise ValueError(f"ordered dropout: the draw must be 'uniform', 'width', 'sandwich' or a probability in (0, 1) "
                         f"for the own width, got {draw!r}")
    return [float(draw), *[(1 - float(draw)) / len(widths)] * len(widths)] if widths else None


def ordered_dropout(model: nn.Module, widths: list[float], model_at: Callable[[float], nn.Module], *,
                    seed: int = 0, own: float = 1.0, draw: str | float = "uniform") -> OrderedDropout | None:
    """The ``OrderedDropout`` forward of a tier-``r`` client: ``widths`` are the federation's width
    multipliers ``<= r`` other than ``r`` (relative to the global model); ``model_at(p)`` builds the
    width-``p`` architecture (with the width scaler where the run uses it). ``None`` when ``widths`` is
    empty (the smallest tier trains its own model only). ``own`` (the client's width multiplier) and ``draw``:
    ``draw_weights``'."""
    if not widths:
        return None
    narrower = sorted(set(widths), reverse=True)
    return OrderedDropout(model, [model_at(p) for p in narrower], seed=seed,
                          weights=draw_weights(draw, own, narrower), sandwich=draw == "sandwich")


__all__ = ["OrderedDropout", "ordered_dropout", "draw_weights"]
