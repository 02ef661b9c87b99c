"""FS-Merge SuperNet layout of timm ``VisionTransformer`` s (the transformer SuperNet).

Paper: Kinderman, Hubara, Maron, Soudry, "Foldable SuperNets: Scalable Merging of Transformers with Different
Initializations and Tasks", arXiv 2410.19251 (the transformer SuperNet and its appendix B). Pre-LN blocks with a
fused qkv, CLS or average pooling: which slots get merge (M) / unmerge (U) matrices, the learned merged
LayerNorms, the folded parameters and the wide (unfolded) forward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedfuse.fusion.fs_merge.matrices import MergeMatrix, fold_linear, split_blocks, unmerge, wide_linear
from fedfuse.fusion.registry import IncompatibleModelsError


def _ln_key(name: str, t: str) -> str:
    return f"{name.replace('.', '_')}__{t}"


class _EmbedOnly(nn.Module):
    def __init__(self, v: nn.Module):
        super().__init__()
        self.v = v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v._pos_embed(self.v.patch_embed(x))


def _vit_embed_with(v: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Tokens ``[N, T, d]`` (patch embedding + prefix tokens + positions, before ``norm_pre``) of ``v`` run with
    another model's embedding ``params`` (names as in the ViT's state dict)."""
    wrapper = _EmbedOnly(v)
    return functional_call(wrapper, {f"v.{k}": t for k, t in params.items()}, (x,), strict=False)


class ViTMergeStructure:
    """FS-Merge for timm ``VisionTransformer`` (pre-LN blocks, fused qkv, CLS or average pooling)."""

    kind = "vit"

    def __init__(self, models: list[nn.Module]):
        v = models[0]
        if getattr(v, "attn_pool", None) is not None:
            raise IncompatibleModelsError("fs-merge: attention pooling is not supported")
        if v.global_pool not in ("token", "avg"):
            raise IncompatibleModelsError(f"fs-merge: global_pool {v.global_pool!r} not supported (token or avg)")
        if not isinstance(v.patch_embed.proj, nn.Conv2d) or not isinstance(v.patch_embed.norm, nn.Identity):
            raise IncompatibleModelsError("fs-merge: the patch embedding must be a Conv2d without a norm")
        if getattr(v, "dynamic_img_size", False):
            raise IncompatibleModelsError("fs-merge: dynamic image size is not supported")
        for norm_name in ("norm_pre", "norm", "fc_norm"):
            mod = getattr(v, norm_name)
            if not isinstance(mod, (nn.Identity, nn.LayerNorm)):
                raise IncompatibleModelsError(f"fs-merge: {norm_name} must be a LayerNorm or Identity, got "
                                            f"{type(mod).__name__}")
        for i, blk in enumerate(v.blocks):
            a = blk.attn
            if not hasattr(a, "qkv") or getattr(a, "gate", None) is not None:
                raise IncompatibleModelsError(f"fs-merge: block {i} attention must be timm Attention with a fused qkv")
            for sub in ("q_norm", "k_norm", "norm"):
                if not isinstance(getattr(a, sub, nn.Identity()), nn.Identity):
                    raise IncompatibleModelsError(f"fs-merge: block {i} attention {sub} is not supported")
            for sub in ("ls1", "ls2", "drop_path1", "drop_path2"):
                if not isinstance(getattr(blk, sub), nn.Identity):
                    raise IncompatibleModelsError(f"fs-merge: block {i} {sub} ({type(getattr(blk, sub)).__name__}) is "
                                                "not supported (LayerScale / drop-path)")
            if not isinstance(blk.norm1, nn.LayerNorm) or not isinstance(blk.norm2, nn.LayerNorm):
                raise IncompatibleModelsError(f"fs-merge: block {i} must be pre-LN with LayerNorms")
            if not (hasattr(blk.mlp, "fc1") and hasattr(blk.mlp, "fc2")) or not isinstance(
                    getattr(blk.mlp, "norm", nn.Identity()), nn.Identity) or hasattr(blk.mlp, "fc1_g"):
                raise IncompatibleModelsError(f"fs-merge: block {i} MLP must be a plain fc1-act-fc2 Mlp")
        self.d = v.embed_dim
        self.h = v.blocks[0].mlp.fc1.out_features
        self.depth = len(v.blocks)
        self.heads = v.blocks[0].attn.num_heads
        self.ln_names = [nm for nm, mod in v.named_modules() if isinstance(mod, nn.LayerNorm)]
        self.ln_eps = {nm: mod.eps for nm, mod in v.named_modules() if isinstance(mod, nn.LayerNorm)}
        self.prefix = [p for p in ("cls_token", "reg_token") if getattr(v, p, None) is not None]

    def make(self, n: int, rank, init: str, gen: torch.Generator) -> tuple[nn.ModuleDict, nn.ParameterDict]:
        """All M/U matrices (hidden-width ones with rank ``rank·h/d``) and an empty dict for the merged LNs
        (``init_norms`` fills it from the models' values)."""
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
        return mus, nn.ParameterDict()

    def init_norms(self, lns: nn.ParameterDict, ws: list[dict[str, torch.Tensor]], init: str) -> None:
        """Learned merged LayerNorms (rule iii): model 0's (``init="first"``) or the mean of the models'."""
        for nm in self.ln_names:
            for t in ("weight", "bias"):
                key = f"{nm}.{t}"
                if key not in ws[0]:
                    continue
                vals = torch.stack([s[key] for s in ws])
                lns[_ln_key(nm, t)] = nn.Parameter((vals[0] if init == "first" else vals.mean(0)).cpu().clone())

    @staticmethod
    def _split_qkv(t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.chunk(3, dim=0))

    def fold(self, ws: list[dict[str, torch.Tensor]], mus: nn.ModuleDict, lns: nn.ParameterDict) -> dict[str, torch.Tensor]:
        """Folded ViT parameters (template names ``m.*``), differentiable in M/U/LN."""
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
