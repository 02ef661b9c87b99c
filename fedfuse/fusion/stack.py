"""Stacking: the clients' feature extractors side by side, one linear classifier over their concatenated features.

The model FuseFL's progressive fusion (Tang et al., "FuseFL: One-Shot Federated Learning through the Lens of
Causality with Progressive Model Fusion", NeurIPS 2024, arXiv 2410.20380) and FENS (Allouah et al., "Revisiting
Ensembling in One-Shot Federated Learning", NeurIPS 2024, arXiv 2411.07182) end with — every client's feature
extractor kept, a classifier learned on top of all of them — built in one step: stacked generalisation (Wolpert,
"Stacked Generalization", Neural Networks 5(2), 1992) with the clients' pre-logit features as the level-1 inputs.

Alone (one exchange) its classifier can only imitate the clients' ensemble on the fusion set. Its point is the head
round (``fedfuse.progressive``: each client's ridge statistics of the concatenated features, the pooled data's ridge
classifier solved once): the model's own ``head_sites()`` names the concatenation and the classifier, so
``head_statistics`` / ``solve_head`` / ``with_head`` take it as they take any model. Where FuseFL trains the
classifier over the concatenated features by further local epochs and FENS trains an aggregator over the clients'
logits for hundreds of rounds, the head round solves it in closed form from one exchange of statistics.

Cost: the result holds every model (``len(models)`` × the parameters, ``len(models)`` forward passes at inference),
like the ``ensemble`` reference; measured against both in docs/fashion-mnist.md.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fedfuse.fusion.registry import IncompatibleModelsError, MissingInputError, register, warn_caller
from fedfuse.models import ADAPTERS, adapter_for, set_example_input
from fedfuse.models.adapters import UnsupportedModelError

PAPER_STACK = "Wolpert, Stacked Generalization (1992); FuseFL arXiv 2410.20380; FENS arXiv 2411.07182"
FEATURES = ("pre-logits", "logits")
WIDE_FEATURES = 8192   # a wider concatenation is warned about (the head round's Gram matrix: (d + 1)² / 2 numbers)
HEADS = ("auto", "fit", "average")


class Stacked(nn.Module):
    """``members`` side by side: ``forward(x) = head(concat_k f_k(x))`` with ``f_k`` member ``k``'s pre-logit
    features (``features="pre-logits"``, ``[N, Σ d_k]``) or its logits (``"logits"``, ``[N, M·C]``).

    Input ``[N, *input]`` → ``[N, C]``. ``head_sites()`` gives the head round the concatenation and ``head``.
    """

    def __init__(self, members: list[nn.Module], head: nn.Linear, features: str = "pre-logits") -> None:
        super().__init__()
        if features not in FEATURES:
            raise ValueError(f"Stacked: features must be one of {list(FEATURES)}, got {features!r}")
        self.members = nn.ModuleList(members)
        self.head = head
        # in the state dict, so that a state says what it is (``stacked_from_state``: a client rebuilding it)
        self.register_buffer("feature_code", torch.tensor(FEATURES.index(features)))
        self._families: list[str] | None = None   # each member's adapter family, resolved at the first forward

    @property
    def feature_kind(self) -> str:
        """``"pre-logits"`` or ``"logits"``: what ``features`` concatenates."""
        return FEATURES[int(self.feature_code)]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, *input]`` → the concatenated member features ``[N, head.in_features]``."""
        if self.feature_kind == "logits":
            return torch.cat([m(x) for m in self.members], 1)
        if self._families is None:   # once: the head round's statistics call this batch by batch
            self._families = [adapter_for(m).family for m in self.members]
        out = []
        for m, family in zip(self.members, self._families):
            set_example_input(m, x)   # the generic reader traces a member on this input's shape (a rebuilt stack's too)
            out.append(ADAPTERS[family].pre_logits(m, x).flatten(1))
        return torch.cat(out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def head_sites(self) -> dict:
        from fedfuse.progressive import HeadSite   # deferred: fedfuse.progressive imports fedfuse.fusion

        return {"": HeadSite(self.features, self.head, self)}


@dataclass(frozen=True)
class StackOptions:
    """Options of ``stack``.

    Attributes:
        features: what is concatenated: ``"pre-logits"`` (each member's classifier inputs: FuseFL's kind of model)
            or ``"logits"`` (each member's outputs: FENS's aggregator inputs).
        head: the classifier before any head round. ``"average"``: the members' classifiers weighted by
            ``weights`` (logit averaging); ``"fit"``: from there, the cross-entropy of its softmax to the members'
            weighted mean softmax on the fusion set (the ensemble's predictions, imitated), plus ``penalty`` ×
            the squared distance to the averaged classifier, minimised by L-BFGS (a convex problem; copies of one
            model are at its minimum, so they give that model); ``"auto"``: ``"fit"`` when ``fusion_inputs`` are
            given, else ``"average"`` (``info["head"]`` says which).
        penalty: ``"fit"``'s pull towards the averaged classifier.
        max_iter: ``"fit"``'s L-BFGS iterations.
    """

    features: str = "pre-logits"
    head: str = "auto"
    penalty: float = 1e-2
    max_iter: int = 200

    def __post_init__(self) -> None:
        if self.features not in FEATURES:
            raise ValueError(f"stack: features must be one of {list(FEATURES)}, got {self.features!r}")
        if self.head not in HEADS:
            raise ValueError(f"stack: head must be one of {list(HEADS)}, got {self.head!r}")
        if not self.penalty >= 0:
            raise ValueError(f"stack: penalty must be >= 0, got {self.penalty!r}")
        if self.max_iter < 1:
            raise ValueError(f"stack: max_iter must be >= 1, got {self.max_iter!r}")


def _members(models: list[nn.Module], fusion_inputs: torch.Tensor | None) -> list[nn.Module]:
    members = [copy.deepcopy(m).cpu().eval() for m in models]
    if fusion_inputs is not None and len(fusion_inputs):
        for m in members:
            set_example_input(m, fusion_inputs[:2].cpu())
    return members


def _averaged_head(members: list[nn.Module], weights: list[float], features: str) -> nn.Linear:
    heads = [adapter_for(m).classifier(m) for m in members]
    classes = {h.out_features for h in heads}
    if len(classes) != 1:
        raise IncompatibleModelsError(f"stack: the models predict different numbers of classes {sorted(classes)}")
    c = classes.pop()
    if features == "logits":
        head = nn.Linear(c * len(members), c)
        with torch.no_grad():
            head.weight.copy_(torch.cat([w * torch.eye(c) for w in weights], 1))
            head.bias.zero_()
        return head
    head = nn.Linear(sum(h.in_features for h in heads), c)
    with torch.no_grad():
        head.weight.copy_(torch.cat([w * h.weight.float() for w, h in zip(weights, heads)], 1))
        head.bias.copy_(sum(w * h.bias.float() if h.bias is not None else 0.0 for w, h in zip(weights, heads)))
    return head


def _fitted_head(model: Stacked, weights: list[float], x: torch.Tensor, penalty: float, max_iter: int,
                device) -> dict:
    """``model.head`` (in place) ← the minimiser of ``CE(ensemble softmax, softmax(head(f)))`` on ``x``'s concatenated
    features ``f`` plus ``penalty · ‖W − W_avg‖²``, from the averaged classifier (``W_avg``); its loss before and
    after in the returned dict."""
    model.to(device).eval()
    with torch.no_grad():
        f, p = [], []
        for b in range(0, len(x), 512):
            xb = x[b:b + 512].to(device)
            f.append(model.features(xb))
            p.append(sum(w * m(xb).softmax(-1) for w, m in zip(weights, model.members)))
        f, p = torch.cat(f), torch.cat(p)
    w0 = model.head.weight.detach().clone()
    params = [model.head.weight, model.head.bias]
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        ce = -(p * torch.log_softmax(model.head(f), -1)).sum(-1).mean()
        return ce + penalty * (model.head.weight - w0).pow(2).sum()

    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        return value

    with torch.enable_grad():
        start = float(loss().detach())
        opt.step(closure)
        end = float(loss().detach())
    model.head.zero_grad(set_to_none=True)
    model.cpu()
    return {"fit-loss": [start, end]}


def is_stacked_state(state: dict[str, torch.Tensor]) -> bool:
    """Whether ``state`` is a ``Stacked`` model's state dict (its members, its head and its ``feature_code``)."""
    return "feature_code" in state and "head.weight" in state and any(k.startswith("members.0.") for k in state)


def stacked_from_state(member_fn: Callable[[], nn.Module], state: dict[str, torch.Tensor]) -> Stacked:
    """The ``Stacked`` model holding ``state``, its members built by ``member_fn()`` (the clients' architecture):
    how a client or a server that knows only that architecture rebuilds a stacked global model from its arrays.
    ``ValueError`` when ``state`` is not a stack of ``member_fn``'s models."""
    if not is_stacked_state(state):
        raise ValueError("stacked_from_state: the state is not a Stacked model's (members.<k>.*, head.*, feature_code)")
    count = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("members."))
    code = int(state["feature_code"])
    if not 0 <= code < len(FEATURES):
        raise ValueError(f"stacked_from_state: feature_code {code} is not one of 0..{len(FEATURES) - 1}")
    out_features, in_features = state["head.weight"].shape
    model = Stacked([member_fn() for _ in range(count)], nn.Linear(in_features, out_features), FEATURES[code])
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:   # names or shapes of another architecture
        raise ValueError(f"stacked_from_state: the state's {count} members are not this architecture's: "
                         f"{str(exc).splitlines()[0]}") from None
    return model


def model_for_state(member_fn: Callable[[], nn.Module], state: dict[str, torch.Tensor]) -> nn.Module:
    """A model holding ``state``: ``member_fn()``'s architecture, or a ``Stacked`` of it when ``state`` is a stack's
    (a one-shot run's ``strategy='stack'`` global model)."""
    if is_stacked_state(state):
        return stacked_from_state(member_fn, state)
    model = member_fn()
    model.load_state_dict(state)
    return model


# any_module: every model is read on its own, through its own adapter (no model's structure is assumed in another)
@register("stack", paper=PAPER_STACK, options=StackOptions, needs_data=False, same_architecture=False,
          mixed_widths=True, any_module=True)
def fuse_stack(models, *, fusion_inputs, scores, weights, device, seed, options: StackOptions,
               info: dict) -> nn.Module:
    """A ``Stacked`` model of copies of ``models`` (any architectures the adapters read, the same classes) with one
    classifier over their concatenated features (``StackOptions``); meant to be followed by the head round.

    Fixed point: with ``head="average"``, stacking copies of one model gives that model's logits.
    """
    o = options
    if o.head == "fit" and fusion_inputs is None:
        raise MissingInputError("stack: head='fit' needs a fusion set (fusion_inputs)")
    members = _members(models, fusion_inputs)
    try:
        head = _averaged_head(members, list(weights), o.features)
    except UnsupportedModelError as e:
        raise IncompatibleModelsError(f"stack: cannot read a model's features: {e}") from e
    model = Stacked(members, head, o.features)
    kind = "fit" if o.head == "fit" or (o.head == "auto" and fusion_inputs is not None) else "average"
    if kind == "fit":
        info.update(_fitted_head(model, list(weights), fusion_inputs.float(), o.penalty, o.max_iter, device))
    info.update({"head": kind, "features": o.features, "feature-width": head.in_features,
                 "parameters": sum(p.numel() for p in model.parameters())})
    if head.in_features > WIDE_FEATURES:   # the head round's statistics grow with the square of the width
        mb = (head.in_features + 1) ** 2 * 8 / 2 / 2 ** 20
        info["wide-warning"] = (f"stack: {len(models)} models' concatenated features are {head.in_features} wide: a "
                                f"head round's statistics are about {mb:.0f} MB a client and its solve a "
                                f"{head.in_features}-square system; features='logits' concatenates "
                                f"{len(models)} x classes instead")
        warn_caller(info["wide-warning"], RuntimeWarning)
    return model


__all__ = ["Stacked", "StackOptions", "fuse_stack", "is_stacked_state", "stacked_from_state", "model_for_state"]
