"""FjORD's ordered dropout in local training: a client of tier ``r`` trains, batch by batch, the nested
sub-model of a width ``p`` drawn uniformly from the federation's tiers ``p <= r``, so every tier's model is
trained by every client that can hold it, in its own context (Horváth et al., "FjORD: Fair and Accurate
Federated Learning under heterogeneous targets with Ordered Dropout", arXiv 2102.13460, §3 "Ordered
Dropout"). Without self-distillation.

The sub-model of width ``p`` is the tier model the server would send a ``p`` client: the same nested layout
(``fedfuse.hetero.submodel``, top-left inside the client's own model, which is itself the global model's
tier-``r`` slice). Its forward pass runs the width-``p`` architecture (``torch.func.functional_call``) on
parameters *gathered* from the client's model, so the gradients land on exactly the entries the
sub-model holds and the reply is the client's usual tier model (the server needs nothing new).
"""

from __future__ import annotations

from typing import Callable

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
        own_weight: the probability that a batch trains ``model`` itself (the client's own width), the rest split
            evenly over the narrower widths; ``None``: FjORD's uniform draw over all ``len(sub_models) + 1``
            widths. A larger weight keeps more of the wide clients' training on the full model (which the global
            model is), a smaller one trains the narrow tiers more.

    Calling it with a batch ``x [B, *input_shape]`` draws one of ``len(sub_models) + 1`` widths (``model`` itself
    included) and returns that width's logits ``[B, num_classes]``.
    """

    def __init__(self, model: nn.Module, sub_models: list[nn.Module], *, seed: int = 0,
                 own_weight: float | None = None) -> None:
        if own_weight is not None and not 0 < own_weight < 1:
            raise ValueError(f"ordered dropout: own_weight must be in (0, 1) or None (uniform), got {own_weight!r}")
        self.own_weight = own_weight
        self.model = model
        # flat positions of every sub-model entry inside the client's model (HeteroFL's top-left slice)
        self.subs = [(m, submodel(model, m, offset=0).positions) for m in sub_models]
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
        if self.own_weight is None:
            return int(torch.randint(len(self.subs) + 1, (1,), generator=self.gen))
        if float(torch.rand((), generator=self.gen)) < self.own_weight:
            return 0
        return 1 + int(torch.randint(len(self.subs), (1,), generator=self.gen))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = self.draw()
        self.draws[k] += 1
        if k == 0:
            return self.model(x)
        sub, positions = self.subs[k - 1]
        sub.to(x.device).train(self.model.training)
        return functional_call(sub, self._gathered(positions), (x,))


def ordered_dropout(model: nn.Module, widths: list[float], model_at: Callable[[float], nn.Module], *,
                    seed: int = 0, own_weight: float | None = None) -> OrderedDropout | None:
    """The ``OrderedDropout`` forward of a tier-``r`` client: ``widths`` are the federation's width
    multipliers ``<= r`` other than ``r`` (relative to the global model); ``model_at(p)`` builds the
    width-``p`` architecture (with the width scaler where the run uses it). ``None`` when ``widths`` is
    empty (the smallest tier trains its own model only). ``own_weight``: ``OrderedDropout``'s."""
    if not widths:
        return None
    return OrderedDropout(model, [model_at(p) for p in sorted(set(widths), reverse=True)], seed=seed,
                          own_weight=own_weight)


__all__ = ["OrderedDropout", "ordered_dropout"]
