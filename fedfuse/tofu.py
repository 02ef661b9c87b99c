"""Token Fusion (ToFu) for timm ``VisionTransformer``s: prune early, MLERP-merge late.

Paper: "Token Fusion: Bridging the Gap between Token Pruning and Token Merging" (Kim, Gao, Hsu, Shen,
Jin; WACV 2024, arXiv 2312.01026). Written from the paper's Algorithm 1;
no code is taken from the authors' or ToMe's repositories.

What it does, per transformer block ``l``::

    y, k̄ = attention(norm1(x), log_size)      # keys averaged over heads = similarity metric
    x = x + ls1(drop_path(y))
    x, size = reduce(x, size, k̄, r_l, PRUNE if l < d else MERGE)    # N → N − r_l tokens
    x = x + ls2(drop_path(mlp(norm2(x))))

``reduce`` is bipartite soft matching (BSM): the non-protected tokens are split alternately into A
(even) and B (odd); every A token finds its most cosine-similar B token; the ``r`` best-matched A
tokens are *sources* and disappear. PRUNE drops them; AVERAGE scatter-means them into their B partner
(ToMe); MLERP averages and then rescales the result to the largest norm in the merged set,
``x̄/‖x̄‖ · max_k ‖x_k‖`` (norm preserving, paper Eq. 9–10). Protected tokens (CLS and register
tokens, i.e. timm's ``num_prefix_tokens`` leading tokens) never take part and stay in front.

Open choices of the paper, settled as recommended for fusion and switchable:
- means are size-weighted (a token standing for ``s`` patches counts ``s`` times), ``size_weighted``;
- pruned sources hand their size to their partner, ``prune_passes_size``;
- proportional attention adds ``log(size)`` to the attention logits, ``proportional_attention``
  (ToMe advises turning it off when *training* with token reduction).

Usage::

    apply(model, r=8)                   # in place; prune in blocks < depth//2, MLERP after
    with suspended(model): ...          # ToFu off (activation collection for fusion/importance)
    remove(model)                       # exact original classes back
    with tofu(model, r=8): ...          # apply + remove

Token counts depend on the input and the model once ToFu is on, so every code path that collects
per-token activations across models (OT / neuron-interpolation fusion, captum importance, FS-Merge)
must run under ``suspended(model)``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

MERGE_MODES = ("mlerp", "average", "prune")
_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------
# State shared by the patched model and its blocks
# ----------------------------------------------------------------------------------------------------

@dataclass
class ToFuState:
    """Configuration and per-forward scratch state of a patched model (not an ``nn.Module``).

    Attributes:
        r: tokens removed per block, one entry per block (already clipped at run time to
            ``(N - protect) // 2``).
        modes: reduction per block, ``"prune" | "average" | "mlerp"``.
        protect: number of leading tokens (CLS + registers) that are never reduced.
        proportional_attention: add ``log(size)`` to the attention logits.
        size_weighted: size-weighted means when merging (else the paper's plain mean).
        prune_passes_size: pruned sources add their size to their partner.
        enabled: False inside ``suspended`` → original forward everywhere.
        size: ``[B, N, 1]`` token sizes of the current forward (``None`` = all ones).
        source: ``[B, N]`` original index of every current token (only when ``track_sources``).
        counts: token count after each block of the last forward (``counts[0]`` = input tokens).
    """

    r: list[int]
    modes: list[str]
    protect: int
    proportional_attention: bool = True
    size_weighted: bool = True
    prune_passes_size: bool = True
    enabled: bool = True
    track_sources: bool = False
    size: torch.Tensor | None = None
    source: torch.Tensor | None = None
    counts: list[int] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------
# The reduction operator (pure functions, unit-testable)
# ----------------------------------------------------------------------------------------------------

def bipartite_soft_matching(metric: torch.Tensor, r: int, protect: int = 0
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BSM on the non-protected tokens of ``metric`` ``[B, N, C]``.

    Set A = non-protected tokens at even offsets, B = at odd offsets (offsets counted after the
    ``protect`` prefix). Returns indices *into A / B*:
        unm_idx ``[B, |A| - r]`` A tokens kept unchanged (ascending, so spatial order survives),
        src_idx ``[B, r]`` A tokens removed (pruned or merged),
        dst_idx ``[B, r]`` their B partners (may repeat).
    """
    m = metric[:, protect:]
    m = m / m.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    a, b = m[:, ::2], m[:, 1::2]
    scores = a @ b.transpose(-1, -2)  # [B, |A|, |B|] cosine similarities
    best, best_idx = scores.max(dim=-1)  # each A token's best partner in B
    order = best.argsort(dim=-1, descending=True)
    src_idx = order[:, :r]
    unm_idx = order[:, r:].sort(dim=-1).values
    dst_idx = best_idx.gather(1, src_idx)
    return unm_idx, src_idx, dst_idx


def _gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, N, C]``, ``idx`` ``[B, K]`` → ``[B, K, C]``."""
    return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def merge_tokens(x: torch.Tensor, size: torch.Tensor, unm_idx: torch.Tensor, src_idx: torch.Tensor,
                 dst_idx: torch.Tensor, protect: int, mode: str, size_weighted: bool = True,
                 prune_passes_size: bool = True, source: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Apply one BSM reduction to tokens ``x`` ``[B, N, C]`` with sizes ``size`` ``[B, N, 1]``.

    Output order: ``[protected prefix, unchanged A tokens, B tokens (merged destinations)]``,
    ``N - r`` tokens. ``source`` ``[B, N]`` (optional) is carried along the same way.
    Returns ``(x [B, N-r, C], size [B, N-r, 1], source [B, N-r] | None)``.
    """
    if mode not in MERGE_MODES:
        raise ValueError(f"tofu: unknown merge mode {mode!r}; choose one of {list(MERGE_MODES)}")
    x_p, x_a, x_b = x[:, :protect], x[:, protect::2], x[:, protect + 1::2]
    s_p, s_a, s_b = size[:, :protect], size[:, protect::2], size[:, protect + 1::2]
    unm, s_unm = _gather_tokens(x_a, unm_idx), _gather_tokens(s_a, unm_idx)
    s_src = _gather_tokens(s_a, src_idx)
    d_idx = dst_idx.unsqueeze(-1)
    if mode == "prune":
        dst = x_b  # sources are simply dropped (paper: no gather/scatter of features)
        s_dst = s_b.scatter_add(1, d_idx, s_src) if prune_passes_size else s_b
    else:
        src = _gather_tokens(x_a, src_idx)
        w_src, w_b = (s_src, s_b) if size_weighted else (torch.ones_like(s_src), torch.ones_like(s_b))
        # scatter-mean *including* the destination itself (paper Eq. 6), optionally size-weighted
        num = (x_b * w_b).scatter_add(1, d_idx.expand(-1, -1, x.shape[-1]), src * w_src)
        den = w_b.scatter_add(1, d_idx, w_src)
        dst = num / den
        s_dst = s_b.scatter_add(1, d_idx, s_src)
        if mode == "mlerp":
            # MLERP (Eq. 10): direction of the mean, length = max norm in the merged set (incl. dst)
            n_max = x_b.norm(dim=-1, keepdim=True).scatter_reduce(
                1, d_idx, src.norm(dim=-1, keepdim=True), reduce="amax", include_self=True)
            dst = dst / dst.norm(dim=-1, keepdim=True).clamp_min(_EPS) * n_max
    out = torch.cat([x_p, unm, dst], dim=1)
    out_size = torch.cat([s_p, s_unm, s_dst], dim=1)
    out_source = None
    if source is not None:
        src_p, src_a, src_b = source[:, :protect], source[:, protect::2], source[:, protect + 1::2]
        out_source = torch.cat([src_p, src_a.gather(1, unm_idx), src_b], dim=1)
    return out, out_size, out_source


def mlerp(x: torch.Tensor) -> torch.Tensor:
    """MLERP of one set ``x`` ``[K, C]`` → ``[C]``: ``mean/‖mean‖ · max_k ‖x_k‖`` (paper Eq. 9–10)."""
    mean = x.mean(0)
    return mean / mean.norm().clamp_min(_EPS) * x.norm(dim=-1).max()


# ----------------------------------------------------------------------------------------------------
# Attention that also returns the keys (timm's fused SDPA hides them)
# ----------------------------------------------------------------------------------------------------

def attention_with_keys(attn: nn.Module, x: torch.Tensor, size: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-implementation of ``timm.layers.Attention.forward`` that also returns the head-mean keys.

    Args:
        attn: a timm ``Attention`` (qkv, optional q/k norm, scale norm, gate, proj).
        x: ``[B, N, C]`` normalised tokens.
        size: ``[B, N, 1]`` token sizes for proportional attention (``None`` = off).
    Returns:
        ``(out [B, N, C_out], k_mean [B, N, head_dim])``.
    """
    b, n, _ = x.shape
    gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
    qkv = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # [B, H, N, hd]
    q, k = attn.q_norm(q), attn.k_norm(k)
    bias = None
    if size is not None:
        bias = size.log().transpose(1, 2).unsqueeze(1).to(q.dtype)  # [B, 1, 1, N] over keys
    if attn.fused_attn:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                             dropout_p=attn.attn_drop.p if attn.training else 0.0)
    else:
        logits = (q * attn.scale) @ k.transpose(-2, -1)
        if bias is not None:
            logits = logits + bias
        out = attn.attn_drop(logits.softmax(dim=-1)) @ v
    out = out.transpose(1, 2).reshape(b, n, attn.attn_dim)
    out = attn.norm(out)
    if gate is not None:
        out = out * gate
    out = attn.proj_drop(attn.proj(out))
    return out, k.mean(dim=1)


# ----------------------------------------------------------------------------------------------------
# Patched classes (created per original class, swapped in with ``__class__``)
# ----------------------------------------------------------------------------------------------------

_BLOCK_CLASSES: dict[type, type] = {}
_MODEL_CLASSES: dict[type, type] = {}


def _tofu_block_class(base: type) -> type:
    if base in _BLOCK_CLASSES:
        return _BLOCK_CLASSES[base]

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        st: ToFuState = self._tofu_state
        i: int = self._tofu_index
        if not st.enabled:
            return base.forward(self, x, attn_mask=attn_mask, is_causal=is_causal)
        if attn_mask is not None or is_causal:
            raise ValueError("tofu: attention masks / causal attention cannot follow reduced tokens; "
                             "run under tofu.suspended(model)")
        bsz, n, _ = x.shape
        if i == 0 or st.size is None or st.size.shape[:2] != (bsz, n):
            # block 0 always sees fresh tokens (also when blocks are called one by one, as in levels)
            st.size, st.counts = None, [n]
            st.source = (torch.arange(n, device=x.device).expand(bsz, n) if st.track_sources else None)
        r = min(st.r[i], max(n - st.protect, 0) // 2)
        size = st.size
        if r == 0 and (size is None or not st.proportional_attention):
            # nothing to reduce and no size bias: the exact original computation
            out = base.forward(self, x)
            st.counts.append(n)
            return out
        y, k_mean = attention_with_keys(self.attn, self.norm1(x),
                                        size if st.proportional_attention else None)
        x = x + self.drop_path1(self.ls1(y))
        if r > 0:
            if size is None:
                size = x.new_ones(bsz, n, 1)
            with torch.no_grad():  # matching is discrete: no gradient through the indices
                unm_idx, src_idx, dst_idx = bipartite_soft_matching(k_mean, r, st.protect)
            x, size, st.source = merge_tokens(x, size, unm_idx, src_idx, dst_idx, st.protect, st.modes[i],
                                              st.size_weighted, st.prune_passes_size, st.source)
            st.size = size
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        st.counts.append(x.shape[1])
        return x

    cls = type(f"ToFu{base.__name__}", (base,), {"forward": forward, "_tofu_base": base,
                                                   "__module__": __name__})
    _BLOCK_CLASSES[base] = cls
    return cls


def _tofu_model_class(base: type) -> type:
    if base in _MODEL_CLASSES:
        return _MODEL_CLASSES[base]

    def forward_features(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        st: ToFuState = self._tofu_state
        if st.enabled and self.grad_checkpointing and self.training:
            raise ValueError("tofu: gradient checkpointing re-runs blocks with stale token sizes; "
                             "disable one of the two")
        st.size, st.source, st.counts = None, None, []
        return base.forward_features(self, x, *args, **kwargs)

    def pool(self, x: torch.Tensor, pool_type: str | None = None) -> torch.Tensor:
        st: ToFuState = self._tofu_state
        pool_type = self.global_pool if pool_type is None else pool_type
        if (st.enabled and pool_type == "avg" and self.attn_pool is None and st.size is not None
                and st.size.shape[:2] == x.shape[:2]):
            # a merged token stands for `size` patches: size-weighted mean keeps the average unbiased
            start = 0 if self.pool_include_prefix else self.num_prefix_tokens
            s = st.size[:, start:]
            return (x[:, start:] * s).sum(1) / s.sum(1)
        return base.pool(self, x, pool_type)

    cls = type(f"ToFu{base.__name__}", (base,), {"forward_features": forward_features, "pool": pool,
                                                   "_tofu_base": base, "__module__": __name__})
    _MODEL_CLASSES[base] = cls
    return cls


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------

def _check_model(model: nn.Module) -> None:
    from timm.layers import Attention
    from timm.models.vision_transformer import Block, VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise ValueError(f"tofu: expected a timm VisionTransformer, got {type(model).__name__}")
    for i, blk in enumerate(model.blocks):
        if not isinstance(blk, Block) or type(blk).forward is not Block.forward and not hasattr(blk, "_tofu_base"):
            raise ValueError(f"tofu: block {i} ({type(blk).__name__}) is not a plain timm Block")
        if type(blk.attn) is not Attention:
            raise ValueError(f"tofu: block {i} attention ({type(blk.attn).__name__}) is not timm Attention")


def default_prune_until(depth: int) -> int:
    """The paper's setting, d = 6 for 12 blocks, i.e. the first half of the blocks prune."""
    return depth // 2


def is_applied(model: nn.Module) -> bool:
    """True when ``model`` is currently patched by ``apply``."""
    return hasattr(model, "_tofu_state") and hasattr(type(model), "_tofu_base")


def apply(model: nn.Module, r: int | Sequence[int] = 8, prune_until: int | None = None, merge: str = "mlerp",
          proportional_attention: bool = True, protect: int | None = None, size_weighted: bool = True,
          prune_passes_size: bool = True) -> nn.Module:
    """Patch a timm ``VisionTransformer`` in place with Token Fusion and return it.

    Args:
        model: timm ``VisionTransformer`` (incl. fedfuse's ``VisionTransformer1d``) of plain ``Block``s.
        r: tokens removed per block (int) or one value per block. ``0`` keeps outputs identical.
            At run time each block removes at most ``(N - protect) // 2``.
        prune_until: blocks ``l < prune_until`` prune, the rest use ``merge``. Default
            ``depth // 2`` (the paper's d = 6 of 12). ``0`` gives pure merging (ToMe when
            ``merge="average"``). Ignored when ``merge="prune"``.
        merge: ``"mlerp"`` (ToFu), ``"average"`` (ToFu-AVG / ToMe) or ``"prune"`` (pure pruning).
        proportional_attention: add ``log(token size)`` to attention logits.
        protect: leading tokens never reduced; default ``model.num_prefix_tokens`` (CLS + registers).
        size_weighted: size-weighted merge means (recommended) vs the paper's plain mean.
        prune_passes_size: pruned tokens' sizes accumulate in their partner.
    Re-applying replaces the previous configuration.
    """
    if merge not in MERGE_MODES:
        raise ValueError(f"tofu: unknown merge {merge!r}; choose one of {list(MERGE_MODES)}")
    if is_applied(model):
        remove(model)
    _check_model(model)
    depth = len(model.blocks)
    rs = [int(r)] * depth if isinstance(r, (int, float)) else [int(v) for v in r]
    if len(rs) != depth or any(v < 0 for v in rs):
        raise ValueError(f"tofu: r must be a non-negative int or {depth} non-negative ints, got {r!r}")
    d = default_prune_until(depth) if prune_until is None else int(prune_until)
    modes = ["prune" if (merge == "prune" or l < d) else merge for l in range(depth)]
    p = model.num_prefix_tokens if protect is None else int(protect)
    st = ToFuState(r=rs, modes=modes, protect=p, proportional_attention=proportional_attention,
                   size_weighted=size_weighted, prune_passes_size=prune_passes_size)
    for i, blk in enumerate(model.blocks):
        blk.__class__ = _tofu_block_class(type(blk))
        blk._tofu_state, blk._tofu_index = st, i
    model.__class__ = _tofu_model_class(type(model))
    model._tofu_state = st
    return model


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply``: original classes (hence the exact original forward) and no extra attributes."""
    if not is_applied(model):
        return model
    for blk in model.blocks:
        if hasattr(type(blk), "_tofu_base"):
            blk.__class__ = type(blk)._tofu_base
        for name in ("_tofu_state", "_tofu_index"):
            blk.__dict__.pop(name, None)
    model.__class__ = type(model)._tofu_base
    model.__dict__.pop("_tofu_state", None)
    return model


def state(model: nn.Module) -> ToFuState | None:
    """The ``ToFuState`` of a patched model (``None`` when not patched)."""
    return model._tofu_state if is_applied(model) else None


@contextlib.contextmanager
def tofu(model: nn.Module, r: int | Sequence[int] = 8, **options) -> Iterator[nn.Module]:
    """``with tofu(model, r=8): ...`` applies ToFu for the block and removes it afterwards.

    If ``model`` was already patched, its previous configuration is restored on exit.
    """
    prev = state(model)
    apply(model, r=r, **options)
    try:
        yield model
    finally:
        remove(model)
        if prev is not None:
            _reapply(model, prev)


def _reapply(model: nn.Module, st: ToFuState) -> None:
    for i, blk in enumerate(model.blocks):
        blk.__class__ = _tofu_block_class(type(blk))
        blk._tofu_state, blk._tofu_index = st, i
    model.__class__ = _tofu_model_class(type(model))
    model._tofu_state = st


@contextlib.contextmanager
def suspended(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily switch ToFu off (no-op for unpatched models); re-entrant.

    Inside, every block runs its original forward, so token counts equal the unpatched model's.
    Used wherever activations are collected across models (fusion, importance).
    """
    st = state(model)
    if st is None:
        yield model
        return
    prev = st.enabled
    st.enabled = False
    try:
        yield model
    finally:
        st.enabled = prev


@torch.no_grad()
def token_counts(model: nn.Module, x: torch.Tensor) -> list[int]:
    """Token count entering block 0 followed by the count after every block, for input ``x``.

    Works for patched and unpatched models (eval mode is used and restored).
    """
    counts: list[int] = []
    hooks = [model.blocks[0].register_forward_pre_hook(lambda m, a: counts.append(a[0].shape[1]))]
    hooks += [blk.register_forward_hook(lambda m, a, o: counts.append(o.shape[1])) for blk in model.blocks]
    was_training = model.training
    model.eval()
    try:
        model(x)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return counts


@torch.no_grad()
def token_trace(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Run a patched model and return ``(source [B, N_out], size [B, N_out, 1] | None, logits)``.

    ``source[b, j]`` is the original token index (0 = CLS, then registers, then patches) that output
    token ``j`` descends from (the kept or destination token); used to check protected tokens survive.
    """
    st = state(model)
    if st is None:
        raise ValueError("tofu: token_trace needs a patched model")
    st.track_sources = True
    was_training = model.training
    model.eval()
    try:
        logits = model(x)
        source, size = st.source, st.size
    finally:
        st.track_sources = False
        model.train(was_training)
    return source, size, logits


def flops_ratio(n_tokens: int, r: int | Sequence[int], depth: int, dim: int, mlp_ratio: float = 4.0,
                protect: int = 1) -> float:
    """Rough block-FLOPs ratio ToFu/off for the token schedule (attention ∝ N², linears ∝ N)."""
    rs = [r] * depth if isinstance(r, int) else list(r)

    def block(n_attn: int, n_mlp: int) -> float:
        return n_attn * dim * dim * 4 + 2 * n_attn * n_attn * dim + n_mlp * dim * dim * 2 * mlp_ratio

    n, full, red = n_tokens, 0.0, 0.0
    for rl in rs:
        full += block(n_tokens, n_tokens)
        rl = min(rl, max(n - protect, 0) // 2)
        red += block(n, n - rl)
        n -= rl
    return red / full if full else math.nan


__all__ = ["apply", "remove", "is_applied", "tofu", "suspended", "token_counts", "token_trace", "state",
           "bipartite_soft_matching", "merge_tokens", "mlerp", "attention_with_keys", "default_prune_until",
           "flops_ratio", "ToFuState", "MERGE_MODES"]
