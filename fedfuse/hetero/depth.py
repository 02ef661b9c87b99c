"""Depth tiers: a global model with an exit classifier after the depths clients train, the sub-model a client of a
shallower tier holds, and the layer-wise aggregation of such sub-models.

DepthFL (Kim, Yu, Kim & Moon, "DepthFL: Depthwise Federated Learning for Heterogeneous Clients", ICLR 2023,
openreview pf8RIZTMU58) gives a client of depth ``k`` the first ``k`` blocks of the global model and one classifier
after each of them; the client trains every classifier it holds with cross-entropy plus mutual self-distillation
between them, and the server averages every layer over the clients that hold it.

A model's *depth units* are its repeated levels (``fedfuse.models.levels``): the hidden layers of an MLP or a plain
CNN, the residual blocks of a ResNet (its stem is always held), the blocks of a ViT (its embedding goes with block
0). A depth multiplier ``d`` in (0, 1] keeps ``ceil(d · U)`` of the ``U`` units (at least one), as width tiers keep
``ceil(r · C)`` units.

``MultiExit`` wraps the global (deepest) model with one ``ExitHead`` per shallower tier depth. Its ``active`` depth
says which classifier ``forward`` returns; ``forward_exits`` returns every classifier up to it (DepthFL's local
loss). Nothing beyond ``active`` runs. A depth tier's sub-model is the keys ``held_keys(model, k)``: the levels up
to unit ``k`` and the exits at or below ``k`` (the final classifier only at full depth); ``aggregate_held`` averages
every key over the clients that hold it and keeps the global value elsewhere.

InclusiveFL (Liu et al., "No One Left Behind: Inclusive Federated Learning over Heterogeneous Devices", KDD 2022,
arXiv 2202.08036) gives each client one classifier after its own depth (``held_keys(..., own_exit=True)``) and adds
momentum distillation: a shallower tier's top layer takes part of the next deeper tier's update of the layers from
it up (``unit_arrays``, ``layer_momentum``, ``momentum_distill``).
"""

from __future__ import annotations

import copy
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedfuse.fusion.permute import Map, apply_maps, build_spec, collect_activations
from fedfuse.fusion.rebasin import activation_matching
from fedfuse.fusion.refine import DistillRefineOptions, distill_ensemble
from fedfuse.hetero.submodel import SubModel, entry_mean, slice_state, submodel
from fedfuse.models import levels
from fedfuse.models.adapters import UnsupportedModelError, adapter_for
from fedfuse.progressive import HeadSite


def depth_units(model: nn.Module) -> list[int]:
    """Indices (in ``levels(model)``) of ``model``'s depth units: its residual blocks when the family has them,
    else every level but the classifier. ``ValueError`` for a model with fewer than 2 units (no shallower tier)."""
    lvls = levels(model)
    blocks = {id(b) for b in adapter_for(model).blocks(model)}
    units = [i for i, lv in enumerate(lvls[:-1]) if lv.module in blocks or id(lv.module) in blocks]
    if not blocks or not units:
        units = list(range(len(lvls) - 1))
    if len(units) < 2:
        raise ValueError(f"depth tiers: a {adapter_for(model).family} model with {len(units)} depth unit has no "
                         "shallower tier; give the model at least 2 blocks / hidden layers (model-depth)")
    return units


def units_at(depth_mult: float, num_units: int) -> int:
    """Units kept at depth multiplier ``depth_mult`` of ``num_units``: ``ceil(d · U)`` (at least 1)."""
    if not (isinstance(depth_mult, (int, float)) and math.isfinite(depth_mult) and 0 < depth_mult <= 1):
        raise ValueError(f"depth tiers: depth multiplier {depth_mult!r} must be in (0, 1]")
    return max(1, math.ceil(depth_mult * num_units - 1e-9))


class ExitHead(nn.Module):
    """A classifier on a level output: ``flat [N, W]`` → ReLU → Linear; ``channels [N, W, *spatial]`` → ReLU →
    global average pool → Linear; ``tokens [N, T, W]`` → LayerNorm → class token → Linear (as a ViT's own head)."""

    def __init__(self, layout: str, width: int, num_classes: int) -> None:
        super().__init__()
        if layout not in ("flat", "channels", "tokens"):
            raise ValueError(f"exit head: unknown level layout {layout!r}")
        self.layout = layout
        self.norm = nn.LayerNorm(width) if layout == "tokens" else nn.Identity()
        self.fc = nn.Linear(width, num_classes)

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """The classifier's inputs ``[N, width]`` from the level output ``h``."""
        if self.layout == "tokens":
            return self.norm(h)[:, 0]
        h = F.relu(h)
        if self.layout == "channels":
            h = h.flatten(2).mean(-1)
        return h.reshape(h.shape[0], -1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(h))


class MultiExit(nn.Module):
    """The global model of a depth-tier federation: ``base`` (the deepest model) plus an exit classifier after each
    shallower depth in ``exit_units`` (unit counts ``< U``; the deepest classifier is ``base``'s own).

    ``forward(x)`` ``[N, *input]`` → logits ``[N, C]`` of the classifier at ``active`` units; ``forward_exits(x)``
    → the logits of every classifier at or below ``active``, shallowest first.
    """

    def __init__(self, base: nn.Module, exit_units: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.base = base
        lvls = levels(base)
        self._units = depth_units(base)
        n = len(self._units)
        exits = sorted({int(k) for k in exit_units if int(k) < n})
        if any(k < 1 for k in exits):
            raise ValueError(f"depth tiers: exit depths {list(exit_units)} must be >= 1 unit")
        self.exit_units = exits
        self.exits = nn.ModuleDict({str(k): ExitHead(lvls[self._units[k - 1]].layout, lvls[self._units[k - 1]].width,
                                                     num_classes) for k in exits})
        self.num_units = n
        self.active = n
        self._num_classes = int(num_classes)
        self._unit_of = {li: j + 1 for j, li in enumerate(self._units)}   # level index -> units up to it

    def _levels(self) -> list:
        """``levels(self.base)``, decomposed once per base module (a deep copy decomposes its own base again: the
        cached levels' ``run`` closures hold the modules they were built on)."""
        cache = self.__dict__.get("_level_cache")
        if cache is None or cache[0] is not self.base:
            cache = (self.base, levels(self.base))
            self.__dict__["_level_cache"] = cache
        return cache[1]

    def __deepcopy__(self, memo):
        cls = type(self)
        out = cls.__new__(cls)
        memo[id(self)] = out
        for key, value in self.__dict__.items():
            if key != "_level_cache":   # the copy builds its own
                out.__dict__[key] = copy.deepcopy(value, memo)
        return out

    def at_width_mult(self, width_mult: float, *, seed: int = 0,
                      input_shape: tuple[int, ...] | None = None) -> "MultiExit":
        """A freshly initialised ``MultiExit`` of this one's depth and exits at ``width_mult`` × its width (a width
        × depth tier's model: ``exit_submodel`` places it in this one). ``width_mult=1``: the same shapes."""
        base = adapter_for(self.base).at_width_mult(self.base, width_mult, seed=seed, input_shape=input_shape)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 7)
            out = MultiExit(base, self.exit_units, self._num_classes)
        return out.set_active(self.active)

    def set_active(self, k: int) -> "MultiExit":
        if k != self.num_units and k not in self.exit_units:
            raise ValueError(f"depth tiers: no classifier at {k} units (exits at {self.exit_units}, full depth "
                             f"{self.num_units})")
        self.active = int(k)
        return self

    def forward_exits(self, x: torch.Tensor) -> list[torch.Tensor]:
        lvls = self._levels()
        last = self._units[self.active - 1] if self.active < self.num_units else len(lvls) - 1
        out, h = [], x
        for i in range(last + 1):
            h = lvls[i].run(h)
            k = self._unit_of.get(i)
            if k is not None and k <= self.active and k in self.exit_units:
                out.append(self.exits[str(k)](h))
        if self.active == self.num_units:
            out.append(h)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.active == self.num_units:
            return self.base(x)
        return self.forward_exits(x)[-1]

    def _prefix(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """The output of the level at depth unit ``k`` (what exit ``k`` reads)."""
        lvls, h = self._levels(), x
        for i in range(self._units[k - 1] + 1):
            h = lvls[i].run(h)
        return h

    def head_sites(self) -> dict:
        """The classifiers a head round solves (``fedfuse.progressive.head_sites``): ``""`` the final one on the base
        model's pre-logit features, ``"<k>"`` exit ``k`` on the level output at unit ``k``. Each site's features run
        the model only up to its classifier."""
        adapter = adapter_for(self.base)
        sites = {"": HeadSite(lambda x: adapter.pre_logits(self.base, x), adapter.classifier(self.base), self.base)}
        for k in self.exit_units:
            head = self.exits[str(k)]
            sites[str(k)] = HeadSite(lambda x, k=k, head=head: head.features(self._prefix(x, k)), head.fc,
                                     lambda x, k=k, head=head: head(self._prefix(x, k)))
        return sites


class ExitsView(nn.Module):
    """``model.forward_exits`` as a module's ``forward`` (its state keys ``model.<key>``): what FjORD's ordered
    dropout (``fedfuse.hetero.OrderedDropout``, which calls ``forward`` through ``torch.func.functional_call``) runs
    for a width × depth tier, whose loss reads every exit."""

    def __init__(self, model: MultiExit) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.model.forward_exits(x)


def held_keys(model: MultiExit, k: int, own_exit: bool = False) -> list[str]:
    """The state-dict keys of ``model`` a client of ``k`` units holds: every level up to unit ``k`` (parameters and
    the buffers of their modules), the exits at or below ``k`` (``own_exit``: exit ``k`` only, none at full depth:
    InclusiveFL's one classifier per sub-model), and the final classifier only at full depth."""
    if k != model.num_units and k not in model.exit_units:
        raise ValueError(f"depth tiers: no classifier at {k} units (exits at {model.exit_units})")
    units, lvls = depth_units(model.base), model._levels()
    last = units[k - 1] if k < model.num_units else len(lvls) - 1
    dropped = {f"base.{p}" for lv in lvls[last + 1:] for p in lv.param_names}
    dropped_modules = {n.rsplit(".", 1)[0] for n in dropped if n.count(".") >= 2}
    keep = []
    for key in model.state_dict():
        if key.startswith("exits."):
            if int(key.split(".")[1]) == k or (not own_exit and int(key.split(".")[1]) < k):
                keep.append(key)
            continue
        if key in dropped or key.rsplit(".", 1)[0] in dropped_modules:
            continue
        keep.append(key)
    return keep


def exit_submodel(global_model: MultiExit, tier_model: MultiExit) -> SubModel:
    """Where a narrower ``MultiExit`` (``global_model.at_width_mult(r)``: a width × depth tier) sits in the global
    one: its base is HeteroFL's top-left sub-model of the global base (``fedfuse.hetero.submodel``), and every exit
    classifier keeps the first inputs of its level's units (the top-left slice of its ``[C, W]`` weight and ``[W]``
    norm). ``ValueError`` when the tier model is not such a sub-model (other exits, depth or family)."""
    if tier_model.exit_units != global_model.exit_units or tier_model.num_units != global_model.num_units:
        raise ValueError(f"exit_submodel: the tier model's exits {tier_model.exit_units} / {tier_model.num_units} "
                         f"units differ from the global model's {global_model.exit_units} / {global_model.num_units}")
    base = submodel(global_model.base, tier_model.base)
    positions = {f"base.{k}": v for k, v in base.positions.items()}
    gstate, tstate = global_model.state_dict(), tier_model.state_dict()
    for key, g in gstate.items():
        if key.startswith("exits."):
            t = tstate[key]
            if t.dim() != g.dim() or any(a > b for a, b in zip(t.shape, g.shape)):
                raise ValueError(f"exit_submodel: {key!r} is {tuple(t.shape)} in the tier model, "
                                 f"{tuple(g.shape)} in the global model")
            pos = torch.arange(g.numel()).reshape(g.shape)
            positions[key] = pos[tuple(slice(0, n) for n in t.shape)].clone()
    return SubModel(positions, {k: tuple(v.shape) for k, v in gstate.items()})


def narrow_copy(model: MultiExit, width_mult: float, input_shape: tuple[int, ...] | None = None) -> MultiExit:
    """``model`` as a width × depth tier of ``width_mult`` sees it: the ``MultiExit`` at that width holding ``model``'s
    top-left slice of every array (``exit_submodel``; what such a node receives). ``width_mult=1``: a copy."""
    if width_mult == 1:
        return copy.deepcopy(model)
    narrow = model.at_width_mult(width_mult, input_shape=input_shape)
    narrow.load_state_dict(slice_state(model.state_dict(), exit_submodel(model, narrow)))
    return narrow


def classifier_readers(model: MultiExit, tiers: Sequence[tuple[float, float]]) -> dict[str, list[float]]:
    """Which narrower widths read each classifier of ``model`` (``fedfuse.progressive.head_sites`` names: ``""`` the
    final one, ``"<k>"`` exit ``k``): ``tiers`` are ``(width, depth)`` multipliers (``client-tiers``); a tier of
    width ``< 1`` reads the top-left slice of every classifier it holds (the exits at or below its depth, the final
    one at full depth). A classifier no narrower tier holds is not listed."""
    out: dict[str, set[float]] = {}
    for w, d in tiers:
        if w >= 1:
            continue
        k = units_at(d, model.num_units)
        for site in [str(e) for e in model.exit_units if e <= k] + ([""] if k == model.num_units else []):
            out.setdefault(site, set()).add(float(w))
    return {site: sorted(ws) for site, ws in out.items()}


def aggregate_held(global_state: dict[str, torch.Tensor], states: list[dict[str, torch.Tensor]],
                   weights: list[float] | None = None,
                   positions: list[dict[str, torch.Tensor] | None] | None = None) -> dict[str, torch.Tensor]:
    """DepthFL's layer-wise average: every floating-point key becomes ``Σ_i w_i x_i / Σ_i w_i`` over the states
    that hold it; keys no state holds keep the global value; integer buffers keep the global value. A state key
    the global model lacks, or of another shape, raises ``ValueError`` naming it.

    ``positions`` (width × depth tiers): per state, ``None`` (whole tensors) or ``{key: int64 positions}`` (a
    ``SubModel``'s, ``exit_submodel``): state ``i``'s ``key`` holds the global entries at those flat positions, and
    every global entry becomes the weighted mean over the states that hold *it* (HeteroFL's count-weighted
    aggregation, within DepthFL's layers)."""
    w = [1.0] * len(states) if weights is None else [float(v) for v in weights]
    if len(w) != len(states) or any(not (v >= 0) for v in w):
        raise ValueError(f"aggregate: need one non-negative weight per state, got {weights}")
    pos = list(positions) if positions is not None else [None] * len(states)
    if len(pos) != len(states):
        raise ValueError(f"aggregate: {len(pos)} position maps for {len(states)} states")
    for s, p in zip(states, pos):
        for key, v in s.items():
            want = tuple(p[key].shape) if p is not None and key in p else tuple(global_state[key].shape) \
                if key in global_state else None
            if want is None or tuple(v.shape) != want:
                raise ValueError(f"aggregate: {key!r} is not a key of the global model's shape"
                                 + (" (or of its tier's sub-model)" if p is not None else ""))
    out = {}
    for key, g in global_state.items():
        holders = [(s[key], wi, p[key] if p is not None and key in p else None)
                   for s, wi, p in zip(states, w, pos) if key in s]
        total = sum(wi for _, wi, _ in holders)
        if not g.is_floating_point() or not holders or total <= 0:
            out[key] = g.clone()
            continue
        if all(p is None for _, _, p in holders):
            acc = torch.zeros(g.shape, dtype=torch.float64)
            for v, wi, _ in holders:
                acc.add_(v.detach().double(), alpha=wi / total)
            out[key] = acc.to(g.dtype)
            continue
        out[key] = entry_mean(g, [(v, p, wi) for v, wi, p in holders])
    return out


def unit_arrays(model: MultiExit, unit: int) -> tuple[dict[str, str], list[str]]:
    """The parameters of depth unit ``unit`` (1-based) of ``model`` named within the unit, so that the arrays of two
    units pair up: ``({name: state key}, [the level's other state keys])``. Names: ``layer.<p>`` / ``norm.<p>`` for
    an affine level's layer and BatchNorm (an MLP or plain-CNN hidden layer), the path under the block for a residual
    or transformer block (``conv1.weight``, ``attn.qkv.weight``). A level's parameters outside its block (a ViT's
    patch embedding, class token and position embedding, which go with block 0) are the second list."""
    if not 1 <= unit <= model.num_units:
        raise ValueError(f"depth tiers: no depth unit {unit} (the model has units 1..{model.num_units})")
    lv = model._levels()[depth_units(model.base)[unit - 1]]
    modules = dict(model.base.named_modules())
    named: dict[str, str] = {}
    other: list[str] = []
    for p in lv.param_names:
        owner, _, leaf = p.rpartition(".")
        mod = modules.get(owner) if owner else None
        if mod is not None and mod is lv.layer:
            named[f"layer.{leaf}"] = f"base.{p}"
        elif mod is not None and mod is lv.norm:
            named[f"norm.{leaf}"] = f"base.{p}"
        elif p.startswith(lv.name + "."):
            named[p[len(lv.name) + 1:]] = f"base.{p}"
        else:
            other.append(f"base.{p}")
    return named, other


def layer_momentum(update: dict[str, torch.Tensor],
                   layers: Sequence[dict[str, str]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """InclusiveFL's knowledge of the deeper layers for a shallower tier's top layer (Liu et al., "No One Left
    Behind: Inclusive Federated Learning over Heterogeneous Devices", KDD 2022, arXiv 2202.08036; the authors'
    ``HeteAgg_mom``): ``update`` is the next deeper tier's update ``{state key: Δ}`` (its clients' sample-weighted
    mean of state − global), ``layers`` the ``unit_arrays`` names of the layers from the shallow tier's top layer
    (``layers[0]``) up to the deeper tier's top layer, both included. For every array ``name`` of ``layers[0]`` (key
    ``key_0``, shape ``S``): ``m[key_0] = (1 / |J|) Σ_{j ∈ J} Δ[key_j]`` over the layers ``J`` that have an array
    ``name`` of shape ``S`` (``layers[0]`` itself always does). Returns ``(m, skipped)``: ``m`` keyed and shaped as
    the top layer's arrays, ``skipped`` one line per layer array left out of a mean and why. ``ValueError`` when
    ``update`` lacks an array of the top layer."""
    if not layers:
        raise ValueError("momentum distillation: no layers (the shallow tier's top layer comes first)")
    momentum: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for name, key in layers[0].items():
        if key not in update:
            raise ValueError(f"momentum distillation: the deeper tier's update holds no {key!r} (the shallow tier's "
                             "top layer, which every deeper tier holds)")
        ref = update[key]
        acc, n = torch.zeros(ref.shape, dtype=torch.float64), 0
        for j, layer in enumerate(layers):
            other = layer.get(name)
            if other is None or other not in update:
                skipped.append(f"{key}: layer +{j} of the range has no array {name!r}")
            elif tuple(update[other].shape) != tuple(ref.shape):
                skipped.append(f"{key}: {other} is {tuple(update[other].shape)}, not {tuple(ref.shape)}")
            else:
                acc.add_(update[other].detach().double())
                n += 1
        momentum[key] = (acc / n).to(ref.dtype)
    return momentum, skipped


def momentum_distill(global_state: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                     momentum: dict[str, torch.Tensor], beta: float) -> dict[str, torch.Tensor]:
    """A shallower tier's client ``state`` with InclusiveFL's momentum distillation on its top layer (arXiv
    2202.08036; the authors' ``Aggregator_mom.load_grad_mem``): every array of ``momentum`` (``layer_momentum``)
    becomes ``global + (1 − β) Δ + β m`` with ``Δ = state − global`` (the update mixed with the deeper layers'
    momentum, as their gradient ``β m + (1 − β) g``); the other arrays are the state's. β = 0 returns the state's
    arrays. ``ValueError`` for β outside [0, 1] or a momentum array that is not one of the state's, of its shape."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
        raise ValueError(f"momentum distillation: beta must be a number in [0, 1], got {beta!r}")
    out = dict(state)
    for key, m in momentum.items():
        if key not in state or key not in global_state or not (
                tuple(m.shape) == tuple(state[key].shape) == tuple(global_state[key].shape)):
            raise ValueError(f"momentum distillation: {key!r} is not an array of the client state's shape")
        if beta:
            g = global_state[key].double()
            out[key] = (g + (1 - beta) * (state[key].double() - g) + beta * m.double()).to(state[key].dtype)
    return out


def mutual_distillation_loss(logits: list[torch.Tensor], y: torch.Tensor, self_distill: bool = True,
                             temperature: float = 1.0) -> torch.Tensor:
    """DepthFL's local objective over a client's classifiers ``logits`` (``[N, C]`` each): the sum of their
    cross-entropies plus, with ``self_distill``, for every classifier the mean KL from each other classifier's
    (detached) softmax to its own (deep mutual learning between the exits; scaled by τ²)."""
    loss = sum(F.cross_entropy(z, y) for z in logits)
    if self_distill and len(logits) > 1:
        t = float(temperature)
        probs = [F.softmax(z.detach() / t, -1) for z in logits]
        for i, z in enumerate(logits):
            logp = F.log_softmax(z / t, -1)
            kl = sum(F.kl_div(logp, probs[j], reduction="batchmean") for j in range(len(logits)) if j != i)
            loss = loss + (t * t) * kl / (len(logits) - 1)
    return loss


def distill_exits(student: MultiExit, teachers: list[nn.Module], weights: list[float], fusion_inputs: torch.Tensor,
                  options=None, *, seed: int = 0, device: torch.device | str = "cpu") -> dict:
    """FedDF across depths: the ensemble of ``teachers`` (the round's client models, each at its own deepest exit)
    distilled into every classifier of ``student`` on the unlabeled ``fusion_inputs`` ``[B, *input]``, deepest
    first (``fedfuse.fusion.refine.distill_ensemble`` per exit: held-out early stopping, the start kept when
    distillation does not help). The shallow clients' knowledge reaches the deep classifiers, which only the deep
    clients train. Returns ``{"exit-distill": {units: distill_ensemble's info}}``; ``student.active`` is reset to
    full depth."""
    options = options if options is not None else DistillRefineOptions()
    info = {}
    for k in [student.num_units, *reversed(student.exit_units)]:
        student.set_active(k)
        info[str(k)] = distill_ensemble(student, teachers, weights, fusion_inputs, options, seed=seed + k,
                                        device=device)
    student.set_active(student.num_units)
    return {"exit-distill": info}


def align_depths(models: Sequence[MultiExit], units: Sequence[int], fusion_inputs: torch.Tensor, *,
                 max_rows: int = 4096, seed: int = 0, device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """One-shot fusion across depths: every client model's units permuted onto the deepest client's.

    Clients of a one-shot federation train from their own initialisations, so the hidden units of two models of one
    architecture are in unrelated orders and a layer-wise average (DepthFL's ``aggregate_held``) mixes unrelated
    units: its accuracy falls to chance (``results/depth-tiers-oneshot``). Here each client ``i`` (a ``MultiExit``
    holding ``units[i]`` depth units) has the units of every permutation group it holds matched to the *reference*
    (the first deepest client) by their activations on the unlabeled ``fusion_inputs [B, *input]``: the permutation
    maximising the correlation of standardised activations, group by group (activation matching, Ainsworth et al.,
    "Git Re-Basin", arXiv 2209.04836; OTFusion's exact-transport special case, Singh & Jaggi, arXiv 1910.05653). The
    permutation moves every array the group indexes (the level's output rows, the next layer's input columns) and
    the inputs of the exit classifiers on that level (their norm too), so every client computes the same function
    in the reference's units.

    Residual families work the same way: a residual stream is one group read at several points (a ResNet stage's
    blocks, every block of a ViT), and a truncated client is matched on the points it holds, against the reference's
    activations at the same points; attention groups keep their heads whole. Returns one full ``MultiExit`` state per
    client (the keys it does not hold are its unchanged values: pass only ``held_keys`` on to ``aggregate_held``).
    """
    if len(models) != len(units) or not models:
        raise ValueError(f"align_depths: {len(models)} models for {len(units)} depths")
    ref_i = max(range(len(models)), key=lambda i: (units[i], -i))
    ref = models[ref_i]
    spec = build_spec(ref.base)
    lvls, du = ref._levels(), depth_units(ref.base)
    base_ref = ref.base.state_dict()
    ref_acts: dict[int, dict[str, torch.Tensor]] = {}   # per client depth: the reference's activations there
    out = []
    for i, (m, k) in enumerate(zip(models, units)):
        state = {key: v.detach().clone() for key, v in m.state_dict().items()}
        if i == ref_i:
            out.append(state)
            continue
        held = _held_spec(spec, [lv.name for lv in lvls[du[k - 1] + 1:]] if k < m.num_units else [])
        if k not in ref_acts:   # the same subsampled rows as the client's: seeded per hook point
            ref_acts[k] = collect_activations(ref.base, held, fusion_inputs, max_rows=max_rows, seed=seed,
                                              device=device)
        acts = collect_activations(m.base, held, fusion_inputs, max_rows=max_rows, seed=seed, device=device)
        matched = activation_matching(acts, ref_acts[k], held, held)
        maps = {g: matched.get(g) or Map.identity(grp.size) for g, grp in spec.groups.items()}
        base = apply_maps(m.base.state_dict(), spec, spec, maps, base_ref)
        state.update({f"base.{key}": v for key, v in base.items()})
        for e in m.exit_units:
            level = lvls[du[e - 1]].name
            g = next((g for g, grp in spec.groups.items() if level in grp.levels), None)
            perm = maps[g].perm if g is not None else None
            if perm is None:
                continue
            for key, axis in ((f"exits.{e}.fc.weight", 1), (f"exits.{e}.norm.weight", 0), (f"exits.{e}.norm.bias", 0)):
                if key in state:
                    state[key] = state[key].index_select(axis, perm.to(state[key].device))
        out.append(state)
    return out


def _held_spec(spec, dropped_levels: list[str]):
    """``spec`` restricted to what a truncated client computes: every group's activation points outside the
    ``dropped_levels`` (module paths of the levels it does not hold), and only the groups left with a point."""
    import dataclasses

    def held(path: str) -> bool:
        return not any(path == n or path.startswith(n + ".") for n in dropped_levels)

    groups = {}
    for name, grp in spec.groups.items():
        acts = [pt for pt in grp.acts if held(pt[0])]
        if acts:
            groups[name] = dataclasses.replace(grp, acts=acts)
    return dataclasses.replace(spec, groups=groups)


def multi_exit(model: nn.Module, depth_mults: Sequence[float], num_classes: int) -> MultiExit:
    """``model`` wrapped with an exit classifier after every depth of ``depth_mults`` shallower than it."""
    try:
        n = len(depth_units(model))
    except UnsupportedModelError as exc:
        raise ValueError(f"depth tiers: {exc}") from None
    return MultiExit(model, [units_at(d, n) for d in depth_mults], num_classes)


__all__ = ["MultiExit", "ExitHead", "ExitsView", "depth_units", "units_at", "held_keys", "aggregate_held", "exit_submodel",
           "narrow_copy", "classifier_readers", "align_depths",
           "distill_exits",
           "mutual_distillation_loss", "multi_exit", "unit_arrays", "layer_momentum", "momentum_distill"]
