"""The Foldable SuperNet around n frozen models (Foldable SuperNets, arXiv 2410.19251).

The family-specific layout (which slots get which M/U, the wide forward pass) is the FS-Merge structure that
``fedfuse.fusion.fs_merge.structure.structure_for`` picks by the models' adapter family
(``SequentialMergeStructure``, ``ViTMergeStructure``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call

from fedfuse.fusion.fs_merge.matrices import MergeMatrix
from fedfuse.fusion.fs_merge.structure import structure_for
from fedfuse.models.adapters import adapter_for


class Features(nn.Module):
    """Wraps a model so that ``forward`` returns its final pre-head features ``[N, d]`` (parameter names ``m.*``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model
        self.adapter = adapter_for(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter.pre_logits(self.m, x)


merge_structure = structure_for  # the former name


class SuperNet(nn.Module):
    """Foldable SuperNet around n frozen models: trainable M/U, merged LNs and ``U_final``.

    ``features(x, route)`` → merged pre-head features ``[N, d]``; ``reconstruct(x)`` → ``[N, T, d]`` (one
    reconstruction per target model, T = number of ``U_final`` blocks); ``fold_body()`` → a standard model.

    Reconstruction of target k, in the units of the training targets ``s_k (f_k − μ_k)`` (``target_scales``
    ``s [T]``, ``target_means`` ``μ [T, d]``, fixed)::

        r_k = f @ U_final^(k) + c_k

    with a fixed offset ``c [T, d]`` (buffer ``offset``, 0 unless set). Training starts, as in the paper's "first"
    init, from ``U_final^(k) = I``, ``c = 0``. ``exact_start_()`` sets the identity-initialised ("fresh") blocks to
    ``U^(k) = s_k I``, ``c_k = −s_k μ_k``: ``r_k = s_k (f − μ_k)``, an exact reconstruction of every model that
    agrees with the body (model 0 for "first", the average for "average"), i.e. objective 0 for copies of one
    model. ``train_supernet`` keeps that state as a candidate (the fixed point: copies of a model fuse back to it). Head k folds
    ``f_k ≈ r_k / s_k + μ_k`` (``method._fold``).
    """

    def __init__(self, models: list[nn.Module], *, rank=8, init: str = "first", num_targets: int | None = None,
                 final_base: torch.Tensor | None = None, device: torch.device = torch.device("cpu"), seed: int = 0,
                 target_scales: torch.Tensor | list[float] | None = None, target_means: torch.Tensor | None = None,
                 offset_init: torch.Tensor | None = None):
        super().__init__()
        self.arch = structure_for(models)
        self.n = len(models)
        gen = torch.Generator().manual_seed(seed)
        # frozen weight sets, detached copies (inputs are never modified)
        self.ws = [{k: t.detach().to(device=device, dtype=torch.float32) for k, t in m.state_dict().items()}
                   for m in models]
        tmpl = copy.deepcopy(models[0]).float().eval()
        for prm in tmpl.parameters():
            prm.requires_grad_(False)
        self.template = Features(tmpl).to(device)
        self.mus, self.lns = self.arch.make(self.n, rank, init, gen)
        self.arch.init_norms(self.lns, self.ws, init)     # learned merged norms (ViT LayerNorms)
        d = self.arch.d
        t = num_targets or self.n
        if final_base is not None:
            self.final = MergeMatrix("U", t, d, _rank_for(rank, d), "first", base=final_base, generator=gen)
            fresh = [False] * (t - 1) + [True]             # seq: earlier blocks continue the previous stage
        else:
            self.final = MergeMatrix("U", t, d, _rank_for(rank, d), init if init != "average" else "first",
                                     generator=gen)
            fresh = [init != "random"] * t
        self.num_targets = t
        scales = torch.ones(t) if target_scales is None else torch.as_tensor(target_scales, dtype=torch.float32)
        means = torch.zeros(t, d) if target_means is None else target_means.detach().float()
        offset = torch.zeros(t, d) if offset_init is None else offset_init.detach().float().clone()
        for name, v, shape in (("target_scales", scales, (t,)), ("target_means", means, (t, d)),
                               ("offset_init", offset, (t, d))):
            if tuple(v.shape) != shape:
                raise ValueError(f"fs-merge: {name} of shape {tuple(v.shape)}, expected {shape} "
                                 f"({t} targets of width {d})")
        self.register_buffer("target_scales", scales.cpu())
        self.register_buffer("target_means", means.cpu())
        self.register_buffer("offset", offset.cpu())
        self.fresh = fresh
        self.to(device)

    def folded_params(self) -> dict[str, torch.Tensor]:
        """Body parameters of the folded model (names ``m.*`` of the template), differentiable."""
        return self.arch.fold(self.ws, self.mus, self.lns)

    def features(self, x: torch.Tensor, route: str = "folded") -> torch.Tensor:
        """Merged pre-head features ``[N, d]``; ``route="folded"`` (single width) or ``"wide"`` (n·d wide)."""
        if route == "wide":
            return self.arch.wide(self.ws, self.template, self.mus, self.lns, x)
        return functional_call(self.template, self.folded_params(), (x,), strict=False)

    def reconstruct(self, x: torch.Tensor, route: str = "folded") -> torch.Tensor:
        """Per-target reconstructions ``[N, T, d]`` = ``features @ U_final^(k) + c_k``."""
        f = self.features(x, route)
        return (f @ self.final.dense()).reshape(f.shape[0], self.num_targets, -1) + self.offset

    @property
    def has_exact_start(self) -> bool:
        """Whether some ``U_final`` block is still at its identity init (``exact_start_`` applies)."""
        return any(self.fresh)

    @torch.no_grad()
    def exact_start_(self) -> None:
        """In place, for the identity-initialised blocks k: ``U^(k) = s_k I`` and ``c_k = −s_k μ_k``, so that
        ``r_k = s_k (f − μ_k)`` reconstructs target k exactly whenever model k computes the body's features.
        Call on a freshly built net only (the blocks must still be the identity)."""
        for k, is_fresh in enumerate(self.fresh):
            if is_fresh:
                s = self.target_scales[k].to(self.final.diag)
                self.final.diag[k] += s - 1.0
                self.offset[k] = -s * self.target_means[k].to(self.offset)

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of everything ``train_supernet`` may change: the trainable parameters and the offset."""
        return [p.detach().clone() for p in self.parameters() if p.requires_grad] + [self.offset.clone()]

    @torch.no_grad()
    def restore(self, snap: list[torch.Tensor]) -> None:
        """Load a ``snapshot``."""
        for p, v in zip([p for p in self.parameters() if p.requires_grad] + [self.offset], snap):
            p.copy_(v)

    @torch.no_grad()
    def fold_body(self) -> nn.Module:
        """A standard model (model 0's class and size) carrying the folded body; its head is model 0's."""
        body = copy.deepcopy(self.template.m)
        params = self.folded_params()
        sd = body.state_dict()
        for k, v in params.items():
            sd[k[2:]] = v.detach().clone()
        body.load_state_dict(sd)
        for prm in body.parameters():
            prm.requires_grad_(True)
        return body


def _rank_for(rank, d: int):
    return "full" if rank == "full" else min(int(rank), d)
