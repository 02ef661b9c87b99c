"""FS-Merge merge / unmerge matrices and folding of one linear slot (Foldable SuperNets,
arXiv 2410.19251)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

INITS = ("first", "average", "random")


class MergeMatrix(nn.Module):
    """A learned merge ``M`` (``kind="M"``, dense ``[n·d, d]``) or unmerge ``U`` (``kind="U"``, ``[d, n·d]``).

    ``dense() = base + blocks-of-diagonals(diag [n, d]) + A @ B`` (row-vector convention: ``y = x @ dense()``).
    ``rank=0`` → diagonal only; ``rank="full"`` → a dense residual instead of ``A @ B``. ``base`` (optional,
    a fixed buffer of the dense shape) lets seq. stages start from a previous stage's matrix.
    """

    def __init__(self, kind: str, n: int, d: int, rank: int | str = 0, init: str = "first",
                 base: torch.Tensor | None = None, generator: torch.Generator | None = None):
        super().__init__()
        if kind not in ("M", "U"):
            raise ValueError(f"fs-merge: matrix kind must be 'M' or 'U', got {kind!r}")
        self.kind, self.n, self.d = kind, n, d
        rows, cols = (n * d, d) if kind == "M" else (d, n * d)
        diag = torch.zeros(n, d)
        if base is None:
            if init == "first":
                diag[0 if kind == "M" else slice(None)] = 1.0          # M = (I; 0; ..), U = (I .. I)
            elif init == "average":
                diag[:] = 1.0 / n if kind == "M" else 1.0              # M = (I/n; ..), U = (I .. I)
            elif init == "random":                                     # He-style: fan-in n (M) or 1 (U)
                std = math.sqrt(2.0 / n) if kind == "M" else 1.0
                diag = torch.randn(n, d, generator=generator) * std
            else:
                raise ValueError(f"fs-merge: init must be one of {INITS}, got {init!r}")
            self.register_buffer("base", None)
        else:
            if tuple(base.shape) != (rows, cols):
                raise ValueError(f"fs-merge: base of shape {tuple(base.shape)} for a {kind} of shape {(rows, cols)}")
            self.register_buffer("base", base.detach().clone())
        self.diag = nn.Parameter(diag)
        self.full = rank == "full"
        if self.full:
            self.delta = nn.Parameter(torch.zeros(rows, cols))
            self.rank = min(rows, cols)
        else:
            r = int(rank)
            if r < 0:
                raise ValueError(f"fs-merge: rank must be >= 0 or 'full', got {rank!r}")
            self.rank = r
            # A = 0 keeps the init exact; B small random so A gets a gradient
            self.A = nn.Parameter(torch.zeros(rows, r))
            self.B = nn.Parameter(0.1 * d ** -0.5 * torch.randn(r, cols, generator=generator) / max(r, 1))
            if init == "random" and base is None and r > 0:
                with torch.no_grad():
                    self.A.normal_(0.0, (1.0 / max(rows, 1)) ** 0.5, generator=generator)

    def dense(self) -> torch.Tensor:
        """Materialised matrix ``[n·d, d]`` (M) or ``[d, n·d]`` (U)."""
        eye = torch.eye(self.d, device=self.diag.device, dtype=self.diag.dtype)
        blocks = self.diag[:, None, :] * eye                                  # [n, d, d] diagonal blocks
        mat = blocks.reshape(self.n * self.d, self.d) if self.kind == "M" else torch.cat(list(blocks), dim=1)
        mat = mat + (self.delta if self.full else self.A @ self.B)
        return mat if self.base is None else mat + self.base


def split_blocks(mat: torch.Tensor, kind: str, n: int) -> list[torch.Tensor]:
    """``M [n·d, d]`` → n row blocks ``[d, d]``; ``U [d, n·d]`` → n column blocks ``[d, d]``."""
    return list(mat.chunk(n, dim=0 if kind == "M" else 1))


def fold_linear(u_blocks: list[torch.Tensor] | None, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                m_blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fold one frozen linear slot, PyTorch storage in and out.

    ``weights[k]``: ``[d_out, d_in]`` (``nn.Linear.weight``); ``u_blocks[k]``: ``[d_in', d_in]`` (None = identity,
    the raw-input ``U_0``); ``m_blocks[k]``: ``[d_out, d_out']``. Returns ``(W* [d_out', d_in'], b* [d_out'] | None)``
    with ``W*ᵀ = Σ_k U_k W_kᵀ M_k`` and ``b* = Σ_k b_k M_k``.
    """
    w = 0
    b = None if biases[0] is None else 0
    for k, (wk, mk) in enumerate(zip(weights, m_blocks)):
        r = wk.t() @ mk if u_blocks is None else u_blocks[k] @ wk.t() @ mk
        w = w + r
        if b is not None:
            b = b + biases[k] @ mk
    return w.t(), b


def wide_linear(hs: list[torch.Tensor], weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                m: torch.Tensor) -> torch.Tensor:
    """The paper's wide route for one slot: ``concat_k(h_k W_kᵀ + b_k) @ M``; ``hs[k]`` ``[..., d_in]`` → ``[..., d_out']``."""
    outs = [F.linear(h, w, b) for h, w, b in zip(hs, weights, biases)]
    return torch.cat(outs, dim=-1) @ m


def unmerge(h: torch.Tensor, u: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``h [..., d] @ U [d, n·d']`` split into n tensors ``[..., d']``."""
    return list((h @ u).chunk(n, dim=-1))
