"""FS-Merge SuperNet layout of any model the structure reader describes (the permutation groups of its spec).

Paper: Kinderman, Hubara, Maron, Soudry, "Foldable SuperNets: Scalable Merging of Transformers with Different
Initializations and Tasks", arXiv 2410.01483. The paper builds its SuperNet by hand for MLPs and ViTs; its design
rules carry over to any graph whose hidden units the structure reader groups (``fedfuse.models.adapters``):

- (i) every merge ``M`` / unmerge ``U`` sits next to a frozen *linear* layer so it folds: each permutation group
  ``g`` of width ``d`` gets ``M_g [n·d, d]`` on the output axes of the Linear / Conv (``groups=1``) / Embedding
  tensors that produce its units and ``U_g [d, n·d]`` on the input axes of the ones that consume them. A tensor
  ``W_k`` of model k with output group ``a`` and input group ``b`` folds to ``W* = Σ_k M_a^(k)ᵀ W_k U_b^(k)ᵀ``
  (blocks of M / U, row-vector convention), exactly ``M·blockdiag(W_1..W_n)·U`` of the paper; an input axis no
  group holds (the raw input) has the paper's ``U_0 = (I … I)``. A group's shared ``M_g`` / ``U_g`` keep
  residual additions and concatenations consistent: every producer of a stream folds with the same merge.
- (ii) everything between the linear layers runs at the merged width d: activations, pooling, residual additions.
- (iii) every other parameter that touches a unit (BatchNorm / LayerNorm / GroupNorm, depthwise and grouped
  convolutions, layer scale, tokens and bare parameters) is a parameter of the merged model learned directly at
  width d, as the paper learns its merged LayerNorms: initialised from model 0 (``init="first"``) or the models'
  mean (``"average"``); buffers (BatchNorm statistics) are model 0's or the mean and are not trained.

The classifier is not merged: its input (the pre-logits features) is reconstructed per model by ``U_final`` and
the heads folded with it (``fedfuse.fusion.fs_merge.heads``), as for MLPs and ViTs. With ``init="first"`` the
SuperNet starts as model 0 exactly (``M = (I; 0; …)``, ``U = (I … I)``), so copies of one model fuse back to it.
There is no wide route: the folded parameters are the SuperNet's function (rule (i)).
"""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.fusion.fs_merge.matrices import MergeMatrix, split_blocks
from fedfuse.fusion.permute.maps import join_state, split_state
from fedfuse.fusion.permute.spec import build_spec
from fedfuse.fusion.registry import FusionOptionError
from fedfuse.models.adapters import adapter_for

# layers whose output is linear in the weight and mixes every input channel: merge matrices fold into them
_FOLDABLE = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)


def _foldable(module: nn.Module | None) -> bool:
    if module is None or not isinstance(module, _FOLDABLE):
        return False
    return getattr(module, "groups", 1) == 1


def _pkey(key: str) -> str:
    """A state-dict key as a ``ParameterDict`` key (no dots)."""
    return key.replace(".", "__")


class GraphMergeStructure:
    """Global FS-Merge for any model fedfuse reads a permutation spec from (the generic reader's ``graph`` family
    and the hand-written ``resnet`` / ``torchvision-resnet`` ones): merge matrices per permutation group."""

    kind = "graph"

    def __init__(self, models: list[nn.Module]):
        m0 = models[0]
        self.spec = spec = build_spec(m0)
        adapter = adapter_for(m0)
        self.d = adapter.classifier(m0).in_features
        modules = dict(m0.named_modules())
        state = m0.state_dict()
        classifier = set(spec.classifier)
        params = {k for k, _ in m0.named_parameters()}
        self.folded: dict[str, list[str]] = {}      # tensor key -> its entries (the split parts, or itself)
        self.free: list[str] = []                   # parameters learned at merged width (rule iii)
        self.buffers: list[str] = []                # floating buffers: model 0's or the mean, not trained
        for key, t in state.items():
            if key in classifier:
                continue
            if key not in params:
                if t.is_floating_point():
                    self.buffers.append(key)
                continue
            mod_name, _, pname = key.rpartition(".")
            names = [p for p, _, _ in spec.splits[key][1]] if key in spec.splits else [key]
            entries = [spec.entries.get(nm) for nm in names]
            if (_foldable(modules.get(mod_name)) and pname in ("weight", "bias") and all(entries)
                    and all(any(ax.role == "out" for ax in e.axes) for e in entries)):
                self.folded[key] = names
            else:
                self.free.append(key)
        self.out_groups = sorted({ax.group for nm in self.folded for e in self._entries(nm) for ax in e.axes
                                  if ax.role == "out"}, key=list(spec.groups).index)
        self.in_groups = sorted({ax.group for nm in self.folded for e in self._entries(nm) for ax in e.axes
                                 if ax.role == "in"}, key=list(spec.groups).index)
        self.sizes = {g: spec.groups[g].size for g in spec.groups}
        self.fixed: dict[str, torch.Tensor] = {}    # buffers given to the folded model (init="average": the mean)

    def _entries(self, key: str):
        return [self.spec.entries[nm] for nm in self.folded[key]]

    def make(self, n: int, rank, init: str, gen: torch.Generator) -> tuple[nn.ModuleDict, nn.ParameterDict]:
        """``M`` per group some foldable layer produces, ``U`` per group some foldable layer consumes; an empty dict
        for the merged-width parameters (``init_norms`` fills it)."""
        mus = nn.ModuleDict()
        for kind, groups in (("M", self.out_groups), ("U", self.in_groups)):
            for g in groups:
                d = self.sizes[g]
                r = "full" if rank == "full" else min(int(rank), d)
                mus[f"{kind}_{_pkey(g)}"] = MergeMatrix(kind, n, d, r, init, generator=gen)
        return mus, nn.ParameterDict()

    def init_norms(self, lns: nn.ParameterDict, ws: list[dict[str, torch.Tensor]], init: str) -> None:
        """Merged-width parameters (rule iii): model 0's (``init="first"``) or the mean of the models'; the floating
        buffers likewise (kept as fixed tensors)."""
        for key in self.free:
            vals = torch.stack([s[key] for s in ws])
            lns[_pkey(key)] = nn.Parameter((vals[0] if init == "first" else vals.mean(0)).clone())
        self.fixed = {} if init == "first" else {
            key: torch.stack([s[key].float() for s in ws]).mean(0) for key in self.buffers}

    def fold(self, ws: list[dict[str, torch.Tensor]], mus: nn.ModuleDict, lns: nn.ParameterDict) -> dict[str, torch.Tensor]:
        """Folded parameters of the body (template names ``m.<key>``); differentiable in M, U and the merged-width
        parameters."""
        n = len(ws)
        blocks = {name: split_blocks(mat.dense(), name[0], n) for name, mat in mus.items()}
        split = [split_state(s, self.spec) if self.spec.splits else s for s in ws]
        parts: dict[str, torch.Tensor] = {}
        for key, names in self.folded.items():
            for nm in names:
                e = self.spec.entries[nm]
                total = 0
                for k in range(n):
                    t = split[k][nm]
                    shape = t.shape
                    t = t if e.view is None else t.reshape(e.view)
                    for ax in e.axes:
                        if ax.role == "out":       # merged unit j = Σ_a unit_a · M^(k)[a, j]
                            mk = blocks[f"M_{_pkey(ax.group)}"][k]
                            t = torch.tensordot(t, mk, dims=([ax.axis], [0])).movedim(-1, ax.axis)
                        else:                      # consumer of merged unit j: Σ_a W[.., a] · U^(k)[j, a]
                            uk = blocks[f"U_{_pkey(ax.group)}"][k]
                            t = torch.tensordot(t, uk, dims=([ax.axis], [1])).movedim(-1, ax.axis)
                    total = total + t.reshape(shape)
                parts[nm] = total.contiguous()   # a strided weight would give strided outputs (a user's .view fails)
        out = {f"m.{k}": v for k, v in join_state(parts, self.spec).items()} if self.spec.splits else \
            {f"m.{k}": v for k, v in parts.items()}
        for key in self.free:
            out[f"m.{key}"] = lns[_pkey(key)]
        for key, v in self.fixed.items():
            out[f"m.{key}"] = v.to(ws[0][key].device)
        return out

    def wide(self, ws, template, mus, lns, x):
        """Not built for graph models: the folded route is the SuperNet's function (rule (i))."""
        raise FusionOptionError("fs-merge: route='wide' is built for MLPs and ViTs; other models run the folded "
                                "route (route='folded', the same function)")
