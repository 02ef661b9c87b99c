"""FS-Merge: Foldable SuperNets (Kinderman, Hubara, Maron, Soudry; paper seed 002, spec ``fs-merge.md``).

Registered methods (both ``needs_data=True``)::

    fuse("fs-merge", models, fusion_inputs=X, device="auto", **options)       # global FS-Merge, n models at once
    fuse("fs-merge-seq", models, fusion_inputs=X, device="auto", **options)   # sequential: ((m0+m1)+m2)+...

What is implemented (spec sections):

- §1.3 merge (M, ``[n·d, d]``) and unmerge (U, ``[d, n·d]``) matrices parameterised as stacked diagonals plus a
  low-rank term ``A @ B`` (``rank``; ``rank="full"`` gives a dense residual, as in the paper's MLP runs); the
  hidden-width (transformer MLP) matrices use rank ``rank·h/d``.
- §1.4 initialisations ``"first"`` (SuperNet == model 0 exactly), ``"average"`` (folds to the weight average),
  ``"random"``; low-rank factors start at ``A = 0`` so the first/average inits are exact.
- §1.1 global FS-Merge for MLPs (any ``nn.Sequential`` of Linear layers and element-wise activations) and
  §1.2 the transformer SuperNet for timm ``VisionTransformer`` s: patch embedding/CLS/position merged by
  ``M_in`` (no U, B.1.1), attention block with one shared U, three merges M^Q/M^K/M^V, output unmerge U^O and
  merge M^O with the residual at merged width (B.1.2), MLP block U¹/M¹/U²/M² with the activation at merged
  hidden width (B.1.3), learned merged LayerNorms (rule iii), final reconstruction ``U_final`` (B.2).
- §1.5 global feature-reconstruction MSE on each model's final pre-head features (no labels), per-model
  target scaling, a fixed set of augmented copies of the small fusion set, AdamW with a one-cycle
  (linear warm-up, cosine decay) schedule; the per-task loss when ``task_ids`` are given, else the
  all-models loss (§6 item 4).
- §1.6 folding ``W* = U·blockdiag(W¹..Wⁿ)·M``, ``b* = Σ_k b^k M_k``; the learned LNs are copied. Training
  uses the exact single-width reparameterisation (``route="folded"``, default: the folded model is rebuilt
  every step, activation memory of one model) or the paper's wide SuperNet (``route="wide"``); both are the
  same function (tested).
- §6 heads: ``heads="shared"`` (same-task FL, Option A) folds ``W = Σ_k w_k W_head^k U_final^(k)`` into one
  head of the original size; ``heads="multi"`` (the paper's different-task setting) returns one head of
  ``n·C`` outputs whose k-th block is head k folded with ``U_final^(k)`` (argmax over it = joint accuracy).
- §2 FS-Merge seq.: stage t merges the previous folded model with the next client (2-model SuperNet,
  initialised to the previous stage's solution, ``U_final`` grows one block per stage) against the targets of
  all clients seen so far.

Collapse defence (FINDINGS.md failure mode #1; not in the paper): a fusion set drawn from one client's
classes gives no signal about what the other clients compute on *their* classes, so a SuperNet started at
model 0 stays model 0 there. The default defence is the all-clients reconstruction loss (every fusion input is
scored against every client's centred, per-client-scaled features) plus augmented copies and dense M/U for MLPs
(tested on a class-sharded split). ``synth`` (opt-in, default 0) additionally adds, per client k, inputs synthesised by inverting model
k: starting from augmented fusion samples, gradient steps raise model k's logit for a class drawn from
model k's own (tempered) mean prediction on the fusion set — so each client contributes inputs from the
classes *it* knows — while a proximity penalty keeps them near the data. These inputs get every client's
features as targets like any other input.

Paper defaults for ViT-B-size models (E.2 / §6), for reference: ``rank=12`` (2 models), 24–32 (3–5 models),
16 for seq.; hidden rank 4r; AdamW lr 1e-4, weight decay 1e-3, batch 128, ~200 epochs over 16–100 originals
+ 800–1000 augmented copies per task; seq: 50 epochs per intermediate stage, 200 for the last. The defaults
below are for CPU-size models (width ≤ ~256, a few hundred fusion inputs) and were chosen on digits/MNIST-1D.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedfuse.fusion import register

INITS = ("first", "average", "random")
HEADS = ("shared", "multi")
ROUTES = ("folded", "wide")
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SiLU, nn.Dropout, nn.Identity,
                nn.Softplus)


# ----------------------------------------------------------------------------------------------------------
# §1.3 merge / unmerge matrices
# ----------------------------------------------------------------------------------------------------------
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
            # A = 0 keeps the init exact; B small random so A gets a gradient (spec §1.4, [reference code])
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
    """Fold one frozen linear slot (spec §1.6), PyTorch storage in and out.

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


# ----------------------------------------------------------------------------------------------------------
# Architecture adapters: MLP (§1.1) and timm ViT (§1.2)
# ----------------------------------------------------------------------------------------------------------
class _Features(nn.Module):
    """Wraps a model so that ``forward`` returns its final pre-head features ``[N, d]`` (parameter names ``m.*``)."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.m, self.kind = model, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mlp":
            for mod in list(self.m)[:-1]:
                x = mod(x)
            return x
        return self.m.forward_head(self.m.forward_features(x), pre_logits=True)


def _head_linear(model: nn.Module, kind: str) -> nn.Linear:
    return model[-1] if kind == "mlp" else model.head


def _check_same_shapes(models: list[nn.Module]) -> None:
    ref = {k: tuple(v.shape) for k, v in models[0].state_dict().items()}
    for i, m in enumerate(models[1:], 1):
        sd = {k: tuple(v.shape) for k, v in m.state_dict().items()}
        if sd != ref:
            diff = sorted(set(ref.items()) ^ set(sd.items()))[:3]
            raise ValueError(f"fs-merge: model {i} does not have model 0's architecture/widths (e.g. {diff}); "
                             "FS-Merge merges same-size models")


def _is_vit(model: nn.Module) -> bool:
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, VisionTransformer)


class MLPArch:
    """Global FS-Merge for ``nn.Sequential`` MLPs: ``[Flatten] (Linear, elementwise*)+ Linear(head)`` (spec §1.1).

    Hidden linear layer l gets ``M_l [n·d_l, d_l]``; the unmerge after it is ``U_l [d_l, n·d_l]`` for inner
    layers and ``U_final`` (the reconstruction of each model's features) after the last one.
    """

    kind = "mlp"

    def __init__(self, models: list[nn.Module]):
        seq = models[0]
        lin = [i for i, m in enumerate(seq) if isinstance(m, nn.Linear)]
        if len(lin) < 2:
            raise ValueError("fs-merge: the MLP needs at least one hidden Linear layer before the head")
        if lin[-1] != len(seq) - 1:
            raise ValueError("fs-merge: the MLP must end with its Linear classifier")
        for i, m in enumerate(seq):
            if i in lin:
                continue
            if isinstance(m, nn.Flatten) and i < lin[0]:
                continue
            if isinstance(m, (nn.BatchNorm1d, nn.LayerNorm)):
                raise ValueError(f"fs-merge: MLP layer {i} ({type(m).__name__}) is not supported; fold BatchNorm "
                                 "into the Linear layers first")
            if not isinstance(m, _ELEMENTWISE) or (i < lin[0] and not isinstance(m, nn.Flatten)):
                raise ValueError(f"fs-merge: MLP layer {i} ({type(m).__name__}) is neither Linear nor an "
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


class ViTArch:
    """FS-Merge for timm ``VisionTransformer`` (pre-LN blocks, fused qkv, CLS or average pooling; spec §1.2)."""

    kind = "vit"

    def __init__(self, models: list[nn.Module]):
        v = models[0]
        if getattr(v, "attn_pool", None) is not None:
            raise ValueError("fs-merge: attention pooling is not supported")
        if v.global_pool not in ("token", "avg"):
            raise ValueError(f"fs-merge: global_pool {v.global_pool!r} not supported (token or avg)")
        if not isinstance(v.patch_embed.proj, nn.Conv2d) or not isinstance(v.patch_embed.norm, nn.Identity):
            raise ValueError("fs-merge: the patch embedding must be a Conv2d without a norm")
        if getattr(v, "dynamic_img_size", False):
            raise ValueError("fs-merge: dynamic image size is not supported")
        for norm_name in ("norm_pre", "norm", "fc_norm"):
            mod = getattr(v, norm_name)
            if not isinstance(mod, (nn.Identity, nn.LayerNorm)):
                raise ValueError(f"fs-merge: {norm_name} must be a LayerNorm or Identity, got {type(mod).__name__}")
        for i, blk in enumerate(v.blocks):
            a = blk.attn
            if not hasattr(a, "qkv") or getattr(a, "gate", None) is not None:
                raise ValueError(f"fs-merge: block {i} attention must be timm Attention with a fused qkv")
            for sub in ("q_norm", "k_norm", "norm"):
                if not isinstance(getattr(a, sub, nn.Identity()), nn.Identity):
                    raise ValueError(f"fs-merge: block {i} attention {sub} is not supported")
            for sub in ("ls1", "ls2", "drop_path1", "drop_path2"):
                if not isinstance(getattr(blk, sub), nn.Identity):
                    raise ValueError(f"fs-merge: block {i} {sub} ({type(getattr(blk, sub)).__name__}) is not "
                                     "supported (LayerScale / drop-path)")
            if not isinstance(blk.norm1, nn.LayerNorm) or not isinstance(blk.norm2, nn.LayerNorm):
                raise ValueError(f"fs-merge: block {i} must be pre-LN with LayerNorms")
            if not (hasattr(blk.mlp, "fc1") and hasattr(blk.mlp, "fc2")) or not isinstance(
                    getattr(blk.mlp, "norm", nn.Identity()), nn.Identity) or hasattr(blk.mlp, "fc1_g"):
                raise ValueError(f"fs-merge: block {i} MLP must be a plain fc1-act-fc2 Mlp")
        self.d = v.embed_dim
        self.h = v.blocks[0].mlp.fc1.out_features
        self.depth = len(v.blocks)
        self.heads = v.blocks[0].attn.num_heads
        self.ln_names = [nm for nm, mod in v.named_modules() if isinstance(mod, nn.LayerNorm)]
        self.ln_eps = {nm: mod.eps for nm, mod in v.named_modules() if isinstance(mod, nn.LayerNorm)}
        self.prefix = [p for p in ("cls_token", "reg_token") if getattr(v, p, None) is not None]

    def make(self, n: int, rank, init: str, gen: torch.Generator) -> tuple[nn.ModuleDict, nn.ParameterDict]:
        """All M/U matrices (hidden-width ones with rank ``rank·h/d``) and the learned merged LN parameters."""
        d, h = self.d, self.h
        r = "full" if rank == "full" else int(rank)
        rh = "full" if rank == "full" else int(round(int(rank) * h / d))
        mus = nn.ModuleDict({"M_in": MergeMatrix("M", n, d, r, init, generator=gen)})
        for i in range(self.depth):
            for nm in ("U_att", "U_o", "U_m1"):
                mus[f"{i}_{nm}"] = MergeMatrix("U", n, d, r, init, generator=gen)
            for nm in ("M_q", "M_k", "M_v", "M_o", "M_f2"):
                mus[f"{i}_{nm}"] = MergeMatrix("M", n, d, r, init, generator=gen)
            mus[f"{i}_M_f1"] = MergeMatrix("M", n, h, rh, init, generator=gen)
            mus[f"{i}_U_m2"] = MergeMatrix("U", n, h, rh, init, generator=gen)
        return mus, nn.ParameterDict()   # LN params are filled by SuperNet (need the models' values)

    @staticmethod
    def _split_qkv(t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.chunk(3, dim=0))

    def fold(self, ws: list[dict[str, torch.Tensor]], mus: nn.ModuleDict, lns: nn.ParameterDict) -> dict[str, torch.Tensor]:
        """Folded ViT parameters (template names ``m.*``), differentiable in M/U/LN (spec §1.2, §1.6)."""
        n = len(ws)
        out: dict[str, torch.Tensor] = {}
        m_in = split_blocks(mus["M_in"].dense(), "M", n)
        # B.1.1: patch conv weight [d, C, p, p], its bias, cls/reg tokens and pos_embed: all merged by M_in
        conv = [s["patch_embed.proj.weight"] for s in ws]
        wflat = sum(c.reshape(c.shape[0], -1).t() @ mk for c, mk in zip(conv, m_in))      # [C·p·p, d]
        out["m.patch_embed.proj.weight"] = wflat.t().reshape(conv[0].shape)
        for nm in ["patch_embed.proj.bias", "pos_embed", *self.prefix]:
            if ws[0].get(nm) is not None:
                out[f"m.{nm}"] = sum(s[nm] @ mk for s, mk in zip(ws, m_in))
        for i in range(self.depth):
            p = f"blocks.{i}."
            dm = {k: mus[f"{i}_{k}"].dense() for k in ("U_att", "U_o", "U_m1", "M_q", "M_k", "M_v", "M_o", "M_f1",
                                                       "M_f2", "U_m2")}
            u_att = split_blocks(dm["U_att"], "U", n)
            qkv_w = [self._split_qkv(s[p + "attn.qkv.weight"]) for s in ws]
            has_b = ws[0].get(p + "attn.qkv.bias") is not None
            qkv_b = [self._split_qkv(s[p + "attn.qkv.bias"]) if has_b else [None] * 3 for s in ws]
            wq, bq = [], []
            for j, mname in enumerate(("M_q", "M_k", "M_v")):
                w, b = fold_linear(u_att, [q[j] for q in qkv_w], [q[j] for q in qkv_b], split_blocks(dm[mname], "M", n))
                wq.append(w)
                bq.append(b)
            out[f"m.{p}attn.qkv.weight"] = torch.cat(wq, 0)
            if has_b:
                out[f"m.{p}attn.qkv.bias"] = torch.cat(bq, 0)
            for lin, uname, mname in (("attn.proj", "U_o", "M_o"), ("mlp.fc1", "U_m1", "M_f1"),
                                      ("mlp.fc2", "U_m2", "M_f2")):
                w, b = fold_linear(split_blocks(dm[uname], "U", n), [s[f"{p}{lin}.weight"] for s in ws],
                                   [s.get(f"{p}{lin}.bias") for s in ws], split_blocks(dm[mname], "M", n))
                out[f"m.{p}{lin}.weight"] = w
                if b is not None:
                    out[f"m.{p}{lin}.bias"] = b
        for nm in self.ln_names:
            for t in ("weight", "bias"):
                key = _ln_key(nm, t)
                if key in lns:
                    out[f"m.{nm}.{t}"] = lns[key]
        return out

    def _ln(self, lns: nn.ParameterDict, name: str, x: torch.Tensor) -> torch.Tensor:
        w, b = lns.get(_ln_key(name, "weight")), lns.get(_ln_key(name, "bias"))
        return F.layer_norm(x, (x.shape[-1],), w, b, self.ln_eps[name])

    def wide(self, ws: list[dict[str, torch.Tensor]], template: nn.Module, mus: nn.ModuleDict, lns: nn.ParameterDict,
             x: torch.Tensor) -> torch.Tensor:
        """The unfolded transformer SuperNet (Fig. 3): merged pre-head features ``[N, d]``."""
        n = len(ws)
        v = template.m
        if x.dim() == 3:
            x = x.unsqueeze(2)
        embeds = []
        for s in ws:   # Z^k = concat(CLS^k, patches W_in^k + b^k) + pos^k, each model with its own params
            params = {k: t for k, t in s.items() if k.startswith(("patch_embed.", "pos_embed", "cls_token", "reg_token"))}
            embeds.append(_vit_embed_with(v, params, x))
        z = torch.cat(embeds, -1) @ mus["M_in"].dense()                            # [N, T, d]
        if "norm_pre" in self.ln_names:
            z = self._ln(lns, "norm_pre", z)
        hd = self.d // self.heads
        for i in range(self.depth):
            p = f"blocks.{i}."
            hs = unmerge(self._ln(lns, p + "norm1", z), mus[f"{i}_U_att"].dense(), n)
            qkv_w = [self._split_qkv(s[p + "attn.qkv.weight"]) for s in ws]
            qkv_b = [self._split_qkv(s[p + "attn.qkv.bias"]) if s.get(p + "attn.qkv.bias") is not None
                     else [None] * 3 for s in ws]
            q, k_, val = (wide_linear(hs, [w[j] for w in qkv_w], [b[j] for b in qkv_b], mus[f"{i}_{mn}"].dense())
                          for j, mn in enumerate(("M_q", "M_k", "M_v")))
            bsz, t, _ = q.shape
            q, k_, val = (a.reshape(bsz, t, self.heads, hd).transpose(1, 2) for a in (q, k_, val))
            att = ((q * hd ** -0.5) @ k_.transpose(-2, -1)).softmax(-1)
            a = (att @ val).transpose(1, 2).reshape(bsz, t, self.d)
            hs = unmerge(a, mus[f"{i}_U_o"].dense(), n)
            y = z + wide_linear(hs, [s[p + "attn.proj.weight"] for s in ws], [s.get(p + "attn.proj.bias") for s in ws],
                                mus[f"{i}_M_o"].dense())
            hs = unmerge(self._ln(lns, p + "norm2", y), mus[f"{i}_U_m1"].dense(), n)
            g = wide_linear(hs, [s[p + "mlp.fc1.weight"] for s in ws], [s.get(p + "mlp.fc1.bias") for s in ws],
                            mus[f"{i}_M_f1"].dense())
            g = v.blocks[i].mlp.act(g)                                             # activation at merged width h
            hs = unmerge(g, mus[f"{i}_U_m2"].dense(), n)
            z = y + wide_linear(hs, [s[p + "mlp.fc2.weight"] for s in ws], [s.get(p + "mlp.fc2.bias") for s in ws],
                                mus[f"{i}_M_f2"].dense())
        if "norm" in self.ln_names:
            z = self._ln(lns, "norm", z)
        z = z[:, 0] if v.global_pool == "token" else z[:, v.num_prefix_tokens:].mean(1)
        if "fc_norm" in self.ln_names:
            z = self._ln(lns, "fc_norm", z)
        return z


def _ln_key(name: str, t: str) -> str:
    return f"{name.replace('.', '_')}__{t}"


def _vit_embed_with(v: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Tokens ``[N, T, d]`` (patch embedding + prefix tokens + positions, before ``norm_pre``) of ``v`` run with
    another model's embedding ``params`` (names as in the ViT's state dict)."""
    wrapper = _EmbedOnly(v)
    return functional_call(wrapper, {f"v.{k}": t for k, t in params.items()}, (x,), strict=False)


class _EmbedOnly(nn.Module):
    def __init__(self, v: nn.Module):
        super().__init__()
        self.v = v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v._pos_embed(self.v.patch_embed(x))


def _arch_for(models: list[nn.Module]):
    if all(isinstance(m, nn.Sequential) for m in models):
        return MLPArch(models)
    if all(_is_vit(m) for m in models):
        return ViTArch(models)
    raise ValueError("fs-merge: supports nn.Sequential MLPs and timm VisionTransformers (all models of one "
                     f"family); got {sorted({type(m).__name__ for m in models})}")


# ----------------------------------------------------------------------------------------------------------
# The SuperNet
# ----------------------------------------------------------------------------------------------------------
class SuperNet(nn.Module):
    """Foldable SuperNet around n frozen models (spec §1.1–1.2): trainable M/U, merged LNs and ``U_final``.

    ``features(x, route)`` → merged pre-head features ``[N, d]``; ``reconstruct(x)`` → ``[N, T, d]`` (one
    reconstruction per target model, T = number of ``U_final`` blocks); ``fold()`` → a standard model.
    """

    def __init__(self, models: list[nn.Module], *, rank=8, init: str = "first", num_targets: int | None = None,
                 final_base: torch.Tensor | None = None, device: torch.device = torch.device("cpu"), seed: int = 0):
        super().__init__()
        self.arch = _arch_for(models)
        self.n = len(models)
        gen = torch.Generator().manual_seed(seed)
        # frozen weight sets, detached copies (inputs are never modified)
        self.ws = [{k: t.detach().to(device=device, dtype=torch.float32) for k, t in m.state_dict().items()}
                   for m in models]
        tmpl = copy.deepcopy(models[0]).float().eval()
        for prm in tmpl.parameters():
            prm.requires_grad_(False)
        self.template = _Features(tmpl, self.arch.kind).to(device)
        self.mus, self.lns = self.arch.make(self.n, rank, init, gen)
        if isinstance(self.arch, ViTArch):
            for nm in self.arch.ln_names:
                for t in ("weight", "bias"):
                    key = f"{nm}.{t}"
                    if key not in self.ws[0]:
                        continue
                    vals = torch.stack([s[key] for s in self.ws])
                    self.lns[_ln_key(nm, t)] = nn.Parameter((vals[0] if init == "first" else vals.mean(0)).cpu().clone())
        d = self.arch.d
        t = num_targets or self.n
        if final_base is not None:
            self.final = MergeMatrix("U", t, d, _rank_for(rank, d), "first", base=final_base, generator=gen)
        else:
            self.final = MergeMatrix("U", t, d, _rank_for(rank, d), init if init != "average" else "first",
                                     generator=gen)
        self.num_targets = t
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
        """Per-target reconstructions ``[N, T, d]`` = features @ U_final."""
        f = self.features(x, route)
        return (f @ self.final.dense()).reshape(f.shape[0], self.num_targets, -1)

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


# ----------------------------------------------------------------------------------------------------------
# Heads (§6)
# ----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def fold_heads(body: nn.Module, kind: str, heads: list[tuple[torch.Tensor, torch.Tensor | None]],
               final: torch.Tensor, scales: list[float], weights: list[float], mode: str,
               means: torch.Tensor | None = None) -> nn.Module:
    """Attach the folded classifier to ``body``.

    ``heads[k] = (W_k [C, d], b_k [C])`` of the model whose features are reconstructed by block k of
    ``final`` ``[d, T·d]``; ``scales[k]`` and ``means[k]`` (``[T, d]`` or None) are the target scale and centre
    used in training (the reconstruction of model k is ``s_k (f_k − μ_k)``, so head k gets bias ``b_k + W_k μ_k``). ``mode="shared"``: ``W = Σ_k w_k W_k F_kᵀ / s_k`` (one head, Option A);
    ``mode="multi"``: ``[n·C, d]`` stacked heads (joint accuracy = argmax over all).
    """
    blocks = split_blocks(final, "U", len(heads))
    if means is not None:
        heads = [(w, (0 if b is None else b) + w @ mu.to(w)) for (w, b), mu in zip(heads, means.cpu())]
    folded = [(w @ (fk / s).t(), b) for (w, b), fk, s in zip(heads, blocks, scales)]
    has_bias = folded[0][1] is not None
    lin = _head_linear(body, kind)
    if mode == "shared":
        new = nn.Linear(lin.in_features, lin.out_features, bias=has_bias)
        new.weight.copy_(sum(wk * w for wk, (w, _) in zip(weights, folded)))
        if has_bias:
            new.bias.copy_(sum(wk * b for wk, (_, b) in zip(weights, folded)))
    else:
        c = lin.out_features
        new = nn.Linear(lin.in_features, c * len(heads), bias=has_bias)
        new.weight.copy_(torch.cat([w for w, _ in folded], 0))
        if has_bias:
            new.bias.copy_(torch.cat([b for _, b in folded], 0))
        if kind == "vit":
            body.num_classes = c * len(heads)
    new = new.to(lin.weight.device)
    if kind == "mlp":
        body[len(body) - 1] = new
    else:
        body.head = new
    return body


# ----------------------------------------------------------------------------------------------------------
# Data: augmentation (§1.5) and the collapse defence
# ----------------------------------------------------------------------------------------------------------
def augment_inputs(x: torch.Tensor, copies: int, gen: torch.Generator, mixup: float = 0.5,
                   noise: float = 0.05) -> torch.Tensor:
    """A fixed set of ``copies`` augmented versions of every input: ``[B, *s]`` → ``[B·copies, *s]``.

    Per copy: a random shift (images ``(C,H,W)``: up to 1/8 of the side, reflect padding; signals ``(C,L)``:
    up to L/16), Gaussian noise (``noise`` × the data std) and, with probability 1/2, MixUp with another
    input (weight λ ~ U[1 − mixup, 1] on the original). Flat inputs skip the shift.
    """
    if copies <= 0 or len(x) == 0:
        return x[:0]
    out = []
    std = x.std().clamp_min(1e-6)
    for _ in range(copies):
        a = x.clone()
        if a.dim() == 4:
            h, w = a.shape[-2:]
            ph, pw = max(1, h // 8), max(1, w // 8)
            pad = F.pad(a, (pw, pw, ph, ph), mode="reflect" if min(h, w) > max(ph, pw) else "replicate")
            dy = torch.randint(0, 2 * ph + 1, (len(a),), generator=gen)
            dx = torch.randint(0, 2 * pw + 1, (len(a),), generator=gen)
            a = torch.stack([pad[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(len(a))])
        elif a.dim() == 3:
            length = a.shape[-1]
            p = max(1, length // 16)
            pad = F.pad(a, (p, p), mode="replicate")
            dx = torch.randint(0, 2 * p + 1, (len(a),), generator=gen)
            a = torch.stack([pad[i, :, dx[i]:dx[i] + length] for i in range(len(a))])
        if mixup > 0 and len(a) > 1:
            lam = 1.0 - mixup * torch.rand(len(a), generator=gen)           # λ ~ U[1 − mixup, 1]
            use = torch.rand(len(a), generator=gen) < 0.5
            lam = torch.where(use, lam, torch.ones_like(lam)).reshape(-1, *[1] * (a.dim() - 1))
            other = a[torch.randperm(len(a), generator=gen)]
            a = lam * a + (1 - lam) * other
        a = a + noise * std * torch.randn(a.shape, generator=gen)
        out.append(a)
    return torch.cat(out)


def synthesize_inputs(model: nn.Module, pool: torch.Tensor, count: int, gen: torch.Generator, *, steps: int = 40,
                      lr: float = 0.05, proximity: float = 0.05, temperature: float = 0.5,
                      batch_size: int = 256) -> torch.Tensor:
    """Collapse defence: ``count`` inputs ``[count, *s]`` on which ``model`` predicts the classes *it* knows.

    Target classes are drawn from ``p_c ∝ (mean_x softmax(model(x))_c)^temperature`` over ``pool`` (so a client
    trained on other classes than the pool's still gets its own classes); starting points are pool samples;
    Adam on the inputs minimises ``CE(model(x), c) + proximity·‖x − x₀‖²/σ²`` (σ = pool std), with inputs kept
    inside the pool's value range.
    """
    if count <= 0:
        return pool[:0]
    dev = next(model.parameters()).device
    with torch.no_grad():
        probs = torch.cat([model(pool[i:i + batch_size].to(dev)).float().softmax(-1).cpu()
                           for i in range(0, len(pool), batch_size)]).mean(0)
    p = probs.clamp_min(1e-12) ** temperature
    cls = torch.multinomial(p / p.sum(), count, replacement=True, generator=gen)
    start = pool[torch.randint(0, len(pool), (count,), generator=gen)]
    sigma = pool.std().clamp_min(1e-6)
    lo, hi = pool.min(), pool.max()
    out = []
    for i in range(0, count, batch_size):
        x0 = start[i:i + batch_size].to(dev)
        c = cls[i:i + batch_size].to(dev)
        x = x0.clone().requires_grad_(True)
        opt = torch.optim.Adam([x], lr=lr * float(sigma))
        for _ in range(steps):
            loss = F.cross_entropy(model(x), c) + proximity * ((x - x0) ** 2).mean() / sigma ** 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                x.clamp_(lo, hi)
        out.append(x.detach().cpu())
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------------------
# Training (§1.5)
# ----------------------------------------------------------------------------------------------------------
@dataclass
class FSMergeConfig:
    """Options shared by ``fs-merge`` and ``fs-merge-seq`` (see ``fuse_fs_merge``)."""

    rank: int | str | None = None      # None → "full" for MLPs (paper E.1), 8 for ViTs
    init: str = "first"
    steps: int = 600
    epochs: int | None = None
    lr: float | None = None            # None → 1e-3 for MLPs (1e-2 killed ReLUs with 4 clients), 1e-2 for ViTs
    weight_decay: float = 1e-3
    batch_size: int = 128
    augment: int = 4
    heads: str = "shared"
    route: str = "folded"
    synth: int = 0
    synth_steps: int = 40
    task_ids: torch.Tensor | None = None
    warmup: float = 0.05
    stage_steps: int | None = None
    history: list = field(default_factory=list)


def _parse_options(options: dict, n_models: int) -> FSMergeConfig:
    cfg = FSMergeConfig()
    known = set(FSMergeConfig.__dataclass_fields__) - {"history"}
    for key, val in options.items():
        k = key.replace("-", "_")
        if k not in known:
            raise ValueError(f"fs-merge: unknown option {key!r}; valid options: {sorted(known)}")
        setattr(cfg, k, val)
    if cfg.init not in INITS:
        raise ValueError(f"fs-merge: init must be one of {INITS}, got {cfg.init!r}")
    if cfg.heads not in HEADS:
        raise ValueError(f"fs-merge: heads must be one of {HEADS}, got {cfg.heads!r}")
    if cfg.route not in ROUTES:
        raise ValueError(f"fs-merge: route must be one of {ROUTES}, got {cfg.route!r}")
    if cfg.rank is not None and cfg.rank != "full" and (isinstance(cfg.rank, bool) or not isinstance(cfg.rank, int) or cfg.rank < 0):
        raise ValueError(f"fs-merge: rank must be an int >= 0 or 'full', got {cfg.rank!r}")
    for nm in ("steps", "batch_size"):
        if not isinstance(getattr(cfg, nm), int) or getattr(cfg, nm) < 1:
            raise ValueError(f"fs-merge: {nm} must be a positive int, got {getattr(cfg, nm)!r}")
    if cfg.epochs is not None and (not isinstance(cfg.epochs, int) or cfg.epochs < 1):
        raise ValueError(f"fs-merge: epochs must be a positive int, got {cfg.epochs!r}")
    if cfg.lr is not None and not (isinstance(cfg.lr, (int, float)) and cfg.lr > 0):
        raise ValueError(f"fs-merge: lr must be > 0, got {cfg.lr!r}")
    if not isinstance(cfg.augment, int) or cfg.augment < 0:
        raise ValueError(f"fs-merge: augment (augmented copies per input) must be an int >= 0, got {cfg.augment!r}")
    if not isinstance(cfg.synth, int) or cfg.synth < 0:
        raise ValueError(f"fs-merge: synth (synthesised inputs per client) must be an int >= 0, got {cfg.synth!r}")
    return cfg


def _arch_defaults(cfg: FSMergeConfig, kind: str) -> FSMergeConfig:
    """Fill ``rank`` / ``lr`` left at None with the CPU-size defaults of the model family."""
    if cfg.rank is None:
        cfg.rank = "full" if kind == "mlp" else 8
    if cfg.lr is None:
        cfg.lr = 1e-3 if kind == "mlp" else 1e-2
    return cfg


def _check_inputs(models: list[nn.Module], x) -> None:
    if len(models) < 2:
        raise ValueError(f"fs-merge: needs at least 2 models, got {len(models)}")
    if x is None:
        raise ValueError("fs-merge: needs fusion_inputs (an unlabeled [B, *input_shape] tensor)")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("fs-merge: fusion_inputs must be a floating-point tensor [B, *input_shape]")
    if len(x) < 2:
        raise ValueError(f"fs-merge: fusion_inputs needs at least 2 samples, got {len(x)}")
    if not torch.isfinite(x).all():
        raise ValueError("fs-merge: fusion_inputs contains NaN or inf")
    _check_same_shapes(models)
    m0 = models[0]
    was_training = m0.training
    try:
        with torch.no_grad():
            m0.eval()(x[:2].to(next(m0.parameters()).device, next(m0.parameters()).dtype))
    except Exception as exc:  # noqa: BLE001 - report the shape problem as a ValueError
        raise ValueError(f"fs-merge: model 0 cannot run on fusion_inputs of shape {tuple(x.shape)}: {exc}") from exc
    finally:
        m0.train(was_training)


@torch.no_grad()
def target_features(models: list[nn.Module], kind: str, x: torch.Tensor, device: torch.device,
                    batch_size: int = 512) -> torch.Tensor:
    """Pre-head features of every model on ``x``: ``[N, n, d]`` (on ``device``)."""
    outs = []
    for m in models:
        f = _Features(copy.deepcopy(m), kind).float().to(device).eval()
        outs.append(torch.cat([f(x[i:i + batch_size].to(device)).float() for i in range(0, len(x), batch_size)]))
    return torch.stack(outs, 1)


def _schedule(step: int, total: int, warmup: float) -> float:
    """One cycle: linear warm-up over ``warmup·total`` steps, then cosine decay to 0."""
    w = max(1, int(warmup * total))
    if step < w:
        return (step + 1) / w
    return 0.5 * (1 + math.cos(math.pi * (step - w) / max(1, total - w)))


def train_supernet(net: SuperNet, pool: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
                   target_weights: torch.Tensor, cfg: FSMergeConfig, steps: int, gen: torch.Generator,
                   device: torch.device) -> list[float]:
    """AdamW on M/U/LN/U_final minimising the weighted reconstruction MSE.

    ``pool`` ``[N, *s]`` inputs, ``targets`` ``[N, T, d]`` (already scaled), ``mask`` ``[N, T]`` (1 = this
    sample is scored against target t; None = all), ``target_weights`` ``[T]``. Returns the per-epoch mean
    losses (an "epoch" is ``ceil(N / batch)`` steps).
    """
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, steps, cfg.warmup))
    n = len(pool)
    bs = min(cfg.batch_size, n)
    per_epoch = math.ceil(n / bs)
    losses, running, count = [], 0.0, 0
    perm, pos = torch.randperm(n, generator=gen), 0
    tw = target_weights.to(device)
    for step in range(steps):
        if pos >= n:
            perm, pos = torch.randperm(n, generator=gen), 0
        idx = perm[pos:pos + bs]
        pos += bs
        xb = pool[idx].to(device)
        rec = net.reconstruct(xb, cfg.route)                                      # [B, T, d]
        err = ((rec - targets[idx]) ** 2).mean(-1)                                 # [B, T]
        if mask is not None:
            m = mask[idx].to(device)
            loss = ((err * m * tw).sum(1) / (m * tw).sum(1).clamp_min(1e-12)).mean()
        else:
            loss = (err * tw).sum(1).mean() / tw.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running += float(loss.detach())
        count += 1
        if count == per_epoch or step == steps - 1:
            losses.append(running / count)
            running, count = 0.0, 0
    return losses


@torch.no_grad()
def reconstruction_loss(net: SuperNet, pool: torch.Tensor, targets: torch.Tensor, route: str = "folded",
                        batch_size: int = 512) -> float:
    """Mean squared reconstruction error of ``net`` over ``pool`` against ``targets`` ``[N, T, d]``."""
    tot = 0.0
    for i in range(0, len(pool), batch_size):
        rec = net.reconstruct(pool[i:i + batch_size].to(targets.device), route)
        tot += float(((rec - targets[i:i + batch_size]) ** 2).mean(-1).sum())
    return tot / (len(pool) * targets.shape[1])


@dataclass
class _Prepared:
    pool: torch.Tensor            # [N, *s] inputs (originals, augmented copies, synthesised)
    targets: torch.Tensor         # [N, n, d] scaled targets, on device
    mask: torch.Tensor | None     # [N, n] per-task mask or None
    scales: list[float]           # per-model target scale s_k
    kind: str
    means: torch.Tensor | None = None   # [n, d] per-model feature means μ_k (targets are centred)


def prepare_data(models: list[nn.Module], x: torch.Tensor, cfg: FSMergeConfig, device: torch.device,
                 gen: torch.Generator) -> _Prepared:
    """Fusion pool = originals + ``augment`` fixed copies (+ ``synth`` inverted inputs per client), targets and
    centred, per-model scaled targets ``s_k (f_k − μ_k)`` with ``s_k = 1 / std(f_k)``, so every model's features count
    equally (spec §1.5, MLP setting) and the loss measures the feature *variation* (uncentred post-ReLU features
    let a constant output score a low loss; the centre is folded back into the head bias)."""
    kind = _arch_for(models).kind
    x = x.detach().float().cpu()
    tid = None
    if cfg.task_ids is not None:
        tid = torch.as_tensor(cfg.task_ids).long().cpu()
        if tid.shape != (len(x),) or tid.min() < 0 or tid.max() >= len(models):
            raise ValueError(f"fs-merge: task_ids must be [{len(x)}] ints in [0, {len(models)})")
    aug = augment_inputs(x, cfg.augment, gen)
    pool = torch.cat([x, aug])
    tids = None if tid is None else torch.cat([tid, tid.repeat(cfg.augment)])
    synth = cfg.synth
    if synth > 0:
        extra, extra_t = [], []
        for k, m in enumerate(models):
            mk = copy.deepcopy(m).float().to(device).eval()
            for prm in mk.parameters():
                prm.requires_grad_(False)
            extra.append(synthesize_inputs(mk, pool, synth, gen, steps=cfg.synth_steps))
            extra_t.append(torch.full((synth,), k))
        pool = torch.cat([pool, *extra])
        if tids is not None:
            tids = torch.cat([tids, *extra_t])
    targets = target_features(models, kind, pool, device)
    mu = targets.mean(0)                                                   # [n, d]
    rms = (targets - mu).pow(2).mean(dim=(0, 2)).sqrt().clamp_min(1e-8)    # [n]
    scales = (1.0 / rms).tolist()
    targets = (targets - mu) / rms[None, :, None]
    mask = None if tids is None else F.one_hot(tids, len(models)).float()
    return _Prepared(pool, targets, mask, scales, kind, mu)


def _steps(cfg: FSMergeConfig, n_pool: int) -> int:
    if cfg.epochs is not None:
        return cfg.epochs * math.ceil(n_pool / min(cfg.batch_size, n_pool))
    return cfg.steps


def _heads_of(models, kind):
    out = []
    for m in models:
        lin = _head_linear(m, kind)
        out.append((lin.weight.detach().float().cpu(), None if lin.bias is None else lin.bias.detach().float().cpu()))
    return out


# ----------------------------------------------------------------------------------------------------------
# Registered methods
# ----------------------------------------------------------------------------------------------------------
@register("fs-merge", needs_data=True)
def fuse_fs_merge(models, *, fusion_inputs, weights, device, seed=0, scores=None, **options) -> nn.Module:
    """Global FS-Merge of all ``models`` at once; returns one model of model 0's size.

    Options (defaults for CPU-size models; paper ViT-B defaults in the module docstring):
    ``rank`` ("full" for MLPs, 8 for ViTs; int or "full"), ``init`` ("first" | "average" | "random"), ``steps`` (600) or ``epochs``
    (over the augmented pool; overrides steps), ``lr`` (1e-3 MLP, 1e-2 ViT), ``weight_decay`` (1e-3), ``batch_size`` (128),
    ``augment`` (4 fixed augmented copies per input), ``heads`` ("shared" | "multi"), ``route``
    ("folded" | "wide"), ``synth`` (opt-in collapse defence: synthesised inputs per
    client; default 0 = off), ``synth_steps`` (40), ``task_ids`` ([B] client id per fusion input → per-task
    loss), ``warmup`` (0.05). After the call ``fuse_fs_merge.last_info`` holds losses and timings.
    """
    cfg = _parse_options(options, len(models))
    _check_inputs(models, fusion_inputs)
    cfg = _arch_defaults(cfg, _arch_for(models).kind)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    data = prepare_data(models, fusion_inputs, cfg, device, gen)
    net = SuperNet(models, rank=cfg.rank, init=cfg.init, device=device, seed=seed)
    steps = _steps(cfg, len(data.pool))
    before = reconstruction_loss(net, data.pool, data.targets, cfg.route)
    hist = train_supernet(net, data.pool, data.targets, data.mask, torch.tensor(weights, dtype=torch.float32),
                          cfg, steps, gen, device)
    after = reconstruction_loss(net, data.pool, data.targets, cfg.route)
    body = net.fold_body().cpu()
    fused = fold_heads(body, data.kind, _heads_of(models, data.kind), net.final.dense().detach().cpu(),
                       data.scales, weights, cfg.heads, data.means)
    fuse_fs_merge.last_info = {"loss_before": before, "loss_after": after, "epoch_losses": hist, "steps": steps,
                               "pool": len(data.pool), "seconds": time.perf_counter() - t0,
                               "trainable": sum(p.numel() for p in net.parameters() if p.requires_grad)}
    return fused


@register("fs-merge-seq", needs_data=True)
def fuse_fs_merge_seq(models, *, fusion_inputs, weights, device, seed=0, scores=None, **options) -> nn.Module:
    """FS-Merge seq. (spec §2): merge models 0 and 1, then the result with model 2, ...

    Stage t is a 2-model SuperNet ``(merged_{t-1}, model_{t+1})`` with "first" init (it starts exactly at the
    previous stage's model) and a ``U_final`` of t+2 blocks whose first t+1 start at the previous stage's,
    trained against all original models seen so far. Same options as ``fs-merge``; ``stage_steps`` (default
    ``steps // 4``, the paper's 50-of-200 ratio) for intermediate stages, ``steps`` for the last.

    Default schedule (600 + 150 per intermediate stage, lr 1e-3 for MLPs) works out of the box with 3-4 clients:
    the earlier collapse to chance was the old MLP lr 1e-2 (dead ReLUs), not the stage length. Chosen on a held-out
    quarter of the fusion set (300 samples from client 0, results/fs_merge/tune/seq.jsonl): longer intermediate
    stages (300 or 600) were not better on validation (digits Dirichlet-4: val acc 0.933 default vs 0.920 / 0.920;
    digits shards-4: 0.507 vs 0.467) and cost 1.5-2x the time.
    """
    cfg = _parse_options(options, len(models))
    if cfg.init != "first":
        raise ValueError("fs-merge-seq: stages are initialised from the previous merge; only init='first' applies")
    _check_inputs(models, fusion_inputs)
    cfg = _arch_defaults(cfg, _arch_for(models).kind)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    data = prepare_data(models, fusion_inputs, cfg, device, gen)
    n = len(models)
    merged, final, hist = models[0], None, []
    tw_all = torch.tensor(weights, dtype=torch.float32)
    net = None
    for stage in range(1, n):
        last = stage == n - 1
        t = stage + 1                                           # targets: models 0..stage
        if final is None:
            base = None
        else:                                                   # previous U_final blocks + identity for the new one
            d = final.shape[0]
            base = torch.cat([final, torch.eye(d)], dim=1)
        net = SuperNet([merged, models[stage]], rank=cfg.rank, init="first", num_targets=t,
                       final_base=None if base is None else base.to(device), device=device, seed=seed + stage)
        pool_steps = _steps(cfg, len(data.pool))
        steps = pool_steps if last else (cfg.stage_steps or max(1, pool_steps // 4))
        mask = None if data.mask is None else data.mask[:, :t]
        if mask is not None:   # samples of clients not merged yet carry no target at this stage
            keep = mask.sum(1) > 0
            pool, targets, mask = data.pool[keep], data.targets[keep.to(data.targets.device)][:, :t], mask[keep]
        else:
            pool, targets = data.pool, data.targets[:, :t]
        hist.append(train_supernet(net, pool, targets, mask, tw_all[:t], cfg, steps, gen, device))
        merged = net.fold_body().cpu()
        final = net.final.dense().detach().cpu()
    fused = fold_heads(merged, data.kind, _heads_of(models, data.kind), final, data.scales, weights, cfg.heads,
                       data.means)
    fuse_fs_merge_seq.last_info = {"stage_losses": hist, "seconds": time.perf_counter() - t0,
                                   "pool": len(data.pool)}
    return fused
