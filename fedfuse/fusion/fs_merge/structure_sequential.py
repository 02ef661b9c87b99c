"""FS-Merge SuperNet layout of ``nn.Sequential`` MLPs (global FS-Merge for MLPs).

Paper: Kinderman, Hubara, Maron, Soudry, "Foldable SuperNets: Scalable Merging of Transformers with Different
Initializations and Tasks", arXiv 2410.19251 (the MLP SuperNet). Which layers get a merge (M) and an unmerge (U)
matrix, how the folded body's parameters are computed from them, and the wide (unfolded) forward pass.
"""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.fusion.fs_merge.matrices import MergeMatrix, fold_linear, split_blocks, unmerge, wide_linear
from fedfuse.fusion.registry import IncompatibleModelsError

# parameter-free, element-wise modules an FS-Merge MLP may have between its Linear layers
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SiLU, nn.Dropout, nn.Identity,
               nn.Softplus)


class SequentialMergeStructure:
    """Global FS-Merge for ``nn.Sequential`` MLPs: ``[Flatten] (Linear, elementwise*)+ Linear(head)``.

    Hidden linear layer l gets ``M_l [n·d_l, d_l]``; the unmerge after it is ``U_l [d_l, n·d_l]`` for inner
    layers and ``U_final`` (the reconstruction of each model's features) after the last one.
    """

    kind = "mlp"

    def __init__(self, models: list[nn.Module]):
        seq = models[0]
        lin = [i for i, m in enumerate(seq) if isinstance(m, nn.Linear)]
        if len(lin) < 2:
            raise IncompatibleModelsError("fs-merge: the MLP needs at least one hidden Linear layer before the head")
        if lin[-1] != len(seq) - 1:
            raise IncompatibleModelsError("fs-merge: the MLP must end with its Linear classifier")
        for i, m in enumerate(seq):
            if i in lin:
                continue
            if isinstance(m, nn.Flatten) and i < lin[0]:
                continue
            if isinstance(m, (nn.BatchNorm1d, nn.LayerNorm)):
                raise IncompatibleModelsError(f"fs-merge: MLP layer {i} ({type(m).__name__}) is not supported; fold "
                                            "BatchNorm into the Linear layers first")
            if not isinstance(m, ELEMENTWISE) or (i < lin[0] and not isinstance(m, nn.Flatten)):
                raise IncompatibleModelsError(f"fs-merge: MLP layer {i} ({type(m).__name__}) is neither Linear nor an "
                                            "element-wise activation")
        self.lin = lin
        self.widths = [seq[i].out_features for i in lin[:-1]]
        self.d = self.widths[-1]

    def make(self, n: int, rank, init: str, gen: torch.Generator) -> tuple[nn.ModuleDict, nn.ParameterDict]:
        """Merge matrices ``{M0, U0, M1, ...}`` (no U after the last hidden layer: that is U_final) and no LNs."""
        mus = nn.ModuleDict()
        for l, d in enumerate(self.widths):
            r = "full" if rank == "full" else min(int(rank), d)
            mus[f"M{l}"] = MergeMatrix("M", n, d, r, init, generator=gen)
            if l < len(self.widths) - 1:
                mus[f"U{l}"] = MergeMatrix("U", n, d, r, init, generator=gen)
        return mus, nn.ParameterDict()

    def init_norms(self, lns: nn.ParameterDict, ws: list[dict[str, torch.Tensor]], init: str) -> None:
        """MLPs have no normalisation layers to merge."""

    def fold(self, ws: list[dict[str, torch.Tensor]], mus: nn.ModuleDict, lns) -> dict[str, torch.Tensor]:
        """Folded parameters of the body (template names ``m.<i>.weight``); differentiable in M/U."""
        n = len(ws)
        out = {}
        u_blocks = None
        for l, i in enumerate(self.lin[:-1]):
            m_blocks = split_blocks(mus[f"M{l}"].dense(), "M", n)
            w, b = fold_linear(u_blocks, [s[f"{i}.weight"] for s in ws], [s.get(f"{i}.bias") for s in ws], m_blocks)
            out[f"m.{i}.weight"] = w
            if b is not None:
                out[f"m.{i}.bias"] = b
            if f"U{l}" in mus:
                u_blocks = split_blocks(mus[f"U{l}"].dense(), "U", n)
        return out

    def wide(self, ws: list[dict[str, torch.Tensor]], template: nn.Module, mus: nn.ModuleDict, lns,
             x: torch.Tensor) -> torch.Tensor:
        """The unfolded SuperNet: merged pre-head features ``[N, d]`` from input ``[N, *input_shape]``."""
        n = len(ws)
        seq = template.m
        h = x
        for mod in list(seq)[:self.lin[0]]:
            h = mod(h)
        hs = [h] * n                                                           # U_0 = (I .. I)
        bounds = self.lin[1:]
        z = h
        for l, i in enumerate(self.lin[:-1]):
            z = wide_linear(hs, [s[f"{i}.weight"] for s in ws], [s.get(f"{i}.bias") for s in ws], mus[f"M{l}"].dense())
            for mod in list(seq)[i + 1:bounds[l]]:                            # activations at merged width
                z = mod(z)
            if f"U{l}" in mus:
                hs = unmerge(z, mus[f"U{l}"].dense(), n)
        return z


