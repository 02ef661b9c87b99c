"""Adapter for timm ``VisionTransformer`` s (built by ``fedfuse.models.vit`` or not).

timm is imported only when a model is inspected (it is slow to import).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedfuse.models.adapters.base import (Adapter, Level, ModelConfig, PruningSpec, UnsupportedModelError,
                                          check_width_mult, is_identity)
from fedfuse.models.adapters.permspec import Axis, Entry, Group, PermSpec, norm_entries

_HEAD_PREFIXES = ("norm.", "fc_norm.", "head.", "attn_pool.")


class ViTAdapter(Adapter):
    """Levels: every transformer block (the first also owns the embedding), then the head. Permutation
    groups: the residual stream (one tied group or one per residual position), the Q/K/V dims of each
    attention block (heads as blocks) and the hidden units of each MLP."""

    family = "vit"
    pruning_criterion = "taylor"  # measured best on digits ViTs (results/pruning/criteria.md)

    def matches(self, model: nn.Module) -> bool:
        try:
            from timm.models.vision_transformer import VisionTransformer
        except ImportError:  # pragma: no cover - timm is a hard dependency
            return False
        return isinstance(model, VisionTransformer)

    # ------------------------------------------------------------------------------------------ levels
    def levels(self, model: nn.Module) -> list[Level]:
        from fedfuse.models.vit import vit_embed, vit_head

        blocks = list(model.blocks)
        if not blocks:
            raise UnsupportedModelError("levels: timm VisionTransformer with depth 0 has no levels")
        named = dict(model.named_parameters())
        embed_params = [n for n in named if not n.startswith(("blocks.", *_HEAD_PREFIXES))]
        out: list[Level] = []
        for i, block in enumerate(blocks):
            params = [n for n in named if n.startswith(f"blocks.{i}.")]
            if i == 0:
                run = (lambda x, b=block: b(vit_embed(model, x)))
                params = embed_params + params
            else:
                run = block
            out.append(Level(name=f"blocks.{i}", width=model.embed_dim, kind="block", layout="tokens", module=block,
                             run=run, param_names=params))
        head_params = [n for n in named if n.startswith(_HEAD_PREFIXES)]
        out.append(Level(name="head", width=model.num_classes, kind="classifier", layout="flat", module=model.head,
                         run=lambda h: vit_head(model, h), param_names=head_params))
        return out

    # ---------------------------------------------------------------------------------- permutation spec
    def perm_spec(self, model: nn.Module, residual: str = "tied") -> PermSpec:
        """``residual="tied"``: one stream group (exact symmetry); ``"untied"``: one per residual position
        (spec ``ot-transfusion-tofu.md`` §2.4: equivalent only with explicitly permuted skips)."""
        if residual not in ("tied", "untied"):
            raise UnsupportedModelError(f"permute: residual must be 'tied' or 'untied', got {residual!r}")
        if getattr(model, "attn_pool", None) is not None:
            raise UnsupportedModelError("permute: timm ViTs with attention pooling are not supported")
        if not is_identity(getattr(model.patch_embed, "norm", None)):
            raise UnsupportedModelError("permute: patch_embed.norm is not supported")
        D = model.embed_dim
        groups: dict[str, Group] = {}
        entries: dict[str, Entry] = {}
        positions: list[Group] = []

        def stream(pos_name: str) -> Group:
            if residual == "tied":
                if "stream" not in groups:
                    groups["stream"] = Group("stream", D, "stream", levels=[])
                    positions.append(groups["stream"])
                return groups["stream"]
            g = Group(f"stream.{pos_name}", D, "stream", position=len(positions))
            groups[g.name] = g
            positions.append(g)
            return g

        def vec(key: str, g: Group, axis: int = 0) -> None:
            entries[key] = Entry(key, None, (Axis(g.name, axis, "out"),))

        def lin(prefix: str, out_g: Group | None, in_g: Group | None, mod: nn.Linear, view=None, qkv=False) -> None:
            axes = []
            if out_g is not None:
                axes.append(Axis(out_g.name, 1 if view else 0, "out"))
            if in_g is not None:
                axes.append(Axis(in_g.name, 2 if view else 1, "in"))
            entries[f"{prefix}.weight"] = Entry(f"{prefix}.weight", view, tuple(axes), qkv=qkv)
            if mod.bias is not None and out_g is not None:
                entries[f"{prefix}.bias"] = Entry(f"{prefix}.bias", (3, out_g.size) if view else None,
                                                  (Axis(out_g.name, 1 if view else 0, "out"),), qkv=qkv)

        s = stream("embed")
        s.acts.append(("norm_pre", "out", "tokens"))
        lin("patch_embed.proj", s, None, model.patch_embed.proj)
        for key in ("cls_token", "reg_token", "pos_embed"):
            if getattr(model, key, None) is not None:
                vec(key, s, 2)
        if not is_identity(model.norm_pre):
            norm_entries("norm_pre", model.norm_pre, s, entries)
        for b, blk in enumerate(model.blocks):
            p = f"blocks.{b}"
            attn = blk.attn
            if not (is_identity(getattr(attn, "q_norm", None)) and is_identity(getattr(attn, "k_norm", None))
                    and is_identity(getattr(attn, "norm", None))):
                raise UnsupportedModelError(f"permute: {p}.attn has q/k norms or a scale norm (qk_norm); not supported")
            if not (hasattr(blk.mlp, "fc1") and hasattr(blk.mlp, "fc2")) or not is_identity(getattr(blk.mlp, "norm", None)):
                raise UnsupportedModelError(f"permute: {p}.mlp is not a plain fc1 → act → fc2 Mlp")
            if not hasattr(attn, "qkv"):
                raise UnsupportedModelError(f"permute: {p}.attn has no fused qkv projection")
            if residual == "tied":
                s.levels.append(p)
            norm_entries(f"{p}.norm1", blk.norm1, s, entries)
            a = Group(f"{p}.attn", D, "attn", blocks=attn.num_heads, acts=[(f"{p}.attn.qkv", "out", "qkv")])
            groups[a.name] = a
            lin(f"{p}.attn.qkv", a, s, attn.qkv, view=(3, D, D), qkv=True)
            s2 = stream(f"{b}.attn")
            s2.acts.append((f"{p}.norm2", "in", "tokens"))
            lin(f"{p}.attn.proj", s2, a, attn.proj)
            if not is_identity(blk.ls1):
                vec(f"{p}.ls1.gamma", s2)
            norm_entries(f"{p}.norm2", blk.norm2, s2, entries)
            hid = blk.mlp.fc1.out_features
            m = Group(f"{p}.mlp", hid, "mlp", acts=[(f"{p}.mlp.fc1", "out", "tokens")])
            groups[m.name] = m
            lin(f"{p}.mlp.fc1", m, s2, blk.mlp.fc1)
            s3 = stream(f"{b}.mlp")
            s3.acts.append((p, "out", "tokens"))
            if residual == "untied":
                s3.levels.append(p)
            lin(f"{p}.mlp.fc2", s3, m, blk.mlp.fc2)
            if not is_identity(blk.ls2):
                vec(f"{p}.ls2.gamma", s3)
            s = s3
        for key in ("norm", "fc_norm"):
            mod = getattr(model, key, None)
            if not is_identity(mod):
                norm_entries(key, mod, s, entries)
        if isinstance(model.head, nn.Linear):
            lin("head", None, s, model.head)
            classifier = tuple(k for k in ("head.weight", "head.bias") if k in model.state_dict())
        else:
            classifier = ()
        return PermSpec("vit", groups, entries, classifier)

    # ------------------------------------------------------------------------------------------- depth
    def block_paths(self, model: nn.Module) -> list[str]:
        return [f"blocks.{i}" for i in range(len(model.blocks))]

    def with_blocks(self, model: nn.Module, indices: list[int]) -> nn.Module:
        import copy
        from collections import OrderedDict

        n = len(model.blocks)
        if not indices or any(not 0 <= int(i) < n for i in indices):
            raise UnsupportedModelError(f"with_blocks: block indices {list(indices)} out of range for depth {n}")
        view = copy.copy(model)  # shallow: the same submodules, own module/parameter tables
        view._modules = OrderedDict(model._modules)
        view._parameters = OrderedDict(model._parameters)
        view._buffers = OrderedDict(model._buffers)
        view.blocks = nn.Sequential(*[model.blocks[int(i)] for i in indices])
        return view

    # ------------------------------------------------------------------------------------------ FS-Merge
    def fs_merge_structure(self, models: list[nn.Module]) -> "ViTMergeStructure":
        return ViTMergeStructure(models)

    def pre_logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model.forward_head(model.forward_features(x), pre_logits=True)

    def classifier(self, model: nn.Module) -> nn.Linear:
        if not isinstance(model.head, nn.Linear):
            raise UnsupportedModelError(f"ViT head is {type(model.head).__name__}, not a Linear classifier")
        return model.head

    def set_classifier(self, model: nn.Module, layer: nn.Linear) -> None:
        model.head = layer
        model.num_classes = layer.out_features

    # ----------------------------------------------------------------------------------- config / resize
    def config(self, model: nn.Module, input_shape: tuple[int, ...] | None = None) -> ModelConfig:
        """``width`` = embedding width, ``depth`` = blocks; ``num_heads``, ``mlp_ratio``, ``patch_size``,
        ``reg_tokens``, ``qkv_bias`` as ``fedfuse.models.vit`` takes them. ViTs that ``vit`` cannot build
        (other pooling, no class token, LayerScale, q/k norms, ...) raise ``UnsupportedModelError``."""
        from fedfuse.models.vit import VisionTransformer1d

        why = []
        if model.global_pool != "token" or getattr(model, "cls_token", None) is None:
            why.append(f"global_pool={model.global_pool!r} with class token {model.cls_token is not None}")
        if getattr(model, "attn_pool", None) is not None or not isinstance(model.head, nn.Linear):
            why.append("attention pooling or a non-Linear head")
        blocks = list(model.blocks)
        if not blocks:
            why.append("no blocks")
        for i, blk in enumerate(blocks):
            if not (is_identity(blk.ls1) and is_identity(blk.ls2) and is_identity(getattr(blk.attn, "q_norm", None))):
                why.append(f"block {i} has LayerScale or q/k norms")
                break
        shapes = {(blk.attn.num_heads, blk.attn.qkv.out_features, blk.mlp.fc1.out_features) for blk in blocks
                  if hasattr(blk.attn, "qkv") and hasattr(blk.mlp, "fc1")}
        if len(shapes) > 1 or any(qkv != 3 * model.embed_dim for _, qkv, _ in shapes):
            why.append("blocks of different widths or an attention width other than the embedding width "
                       "(e.g. after structured pruning)")
        if why:
            raise UnsupportedModelError(f"config: this VisionTransformer is not laid out like fedfuse's vit "
                                        f"({'; '.join(why)}), so it cannot be rebuilt at another width/depth")
        pe = model.patch_embed
        c = pe.proj.in_channels
        ph, pw = pe.patch_size
        h, w = pe.img_size
        if isinstance(model, VisionTransformer1d):
            shape, patch = (c, w), pw
        else:
            if ph != pw:
                raise UnsupportedModelError(f"config: non-square patches {pe.patch_size} are not supported")
            shape, patch = (c, h, w), ph
        if input_shape is not None and tuple(input_shape) != shape:
            raise UnsupportedModelError(f"config: this ViT's patch embedding takes inputs {shape}, not {tuple(input_shape)}")
        attn = blocks[0].attn
        options = {"num_heads": attn.num_heads, "mlp_ratio": blocks[0].mlp.fc1.out_features / model.embed_dim,
                   "patch_size": patch, "reg_tokens": model.num_reg_tokens, "qkv_bias": attn.qkv.bias is not None}
        return ModelConfig("vit", "vit", model.num_classes, shape, model.embed_dim, len(blocks), options)

    def scaled_width(self, config: ModelConfig, width_mult: float) -> int:
        """Heads scale, the head dim stays: ``ceil(width_mult · heads) · head_dim`` (at least one head)."""
        heads = config.options["num_heads"]
        head_dim = config.width // heads
        return max(1, math.ceil(check_width_mult(width_mult) * heads - 1e-9)) * head_dim

    def resized_config(self, config: ModelConfig, width: int | None, depth: int | None) -> ModelConfig:
        """Embedding width, heads and MLP width scale together; the head dim stays."""
        cfg = super().resized_config(config, width, depth)
        head_dim = config.width // config.options["num_heads"]
        if cfg.width % head_dim:
            raise ValueError(f"resize: ViT width {cfg.width} is not a multiple of the head dim {head_dim} "
                             f"(width {config.width} / {config.options['num_heads']} heads)")
        return cfg.replace(options={**config.options, "num_heads": cfg.width // head_dim})

    # ------------------------------------------------------------------------- structured pruning
    def pruning_spec(self, model: nn.Module) -> PruningSpec:
        """Heads are units of every block's fused ``attn.qkv`` (cut together with the matching ``attn.proj``
        input columns), the class/register tokens and the position embedding hold the embedding width in dim 2,
        the head's outputs (classes) stay, and block ``i``'s ``mlp.fc2`` outputs are level ``blocks.i``'s neurons."""
        spec = PruningSpec(ignored=[model.head])
        for key in ("cls_token", "reg_token", "pos_embed"):
            p = getattr(model, key, None)
            if isinstance(p, nn.Parameter):
                spec.unwrapped.append((p, p.dim() - 1))
        for i, blk in enumerate(model.blocks):
            attn = blk.attn
            if not hasattr(attn, "qkv") or getattr(attn, "gate", None) is not None or not (
                    is_identity(getattr(attn, "q_norm", None)) and is_identity(getattr(attn, "k_norm", None))
                    and is_identity(getattr(attn, "norm", None))):
                raise UnsupportedModelError(f"prune: blocks.{i}.attn is not a plain timm Attention with a fused qkv "
                                            "(q/k norms, scale norm or gates are not supported)")
            spec.num_heads[attn.qkv] = attn.num_heads
            spec.attention_out[attn.qkv] = attn.proj
            if hasattr(blk.mlp, "fc2"):
                spec.score_levels[blk.mlp.fc2] = f"blocks.{i}"
        return spec

    def finish_pruning(self, model: nn.Module, num_heads: dict[nn.Module, int]) -> None:
        """timm's ``Attention`` reshapes with its stored ``num_heads``/``head_dim``/``attn_dim``, and
        ``VisionTransformer`` keeps ``embed_dim``/``num_features``: set them from the pruned tensors. When the
        head dim shrank, the query rows are scaled by ``sqrt(new/old)`` so the attention logits keep the
        original ``1/sqrt(old head dim)`` scaling (``scaled_dot_product_attention`` uses the new one)."""
        for blk in model.blocks:
            attn = blk.attn
            heads = int(num_heads.get(attn.qkv, attn.num_heads))
            attn_dim = attn.proj.in_features
            if attn.qkv.out_features != 3 * attn_dim or attn_dim % heads:
                raise UnsupportedModelError(f"finish_pruning: qkv has {attn.qkv.out_features} outputs for "
                                            f"{heads} heads and a projection of {attn_dim} inputs")
            head_dim = attn_dim // heads
            if head_dim != attn.head_dim:
                with torch.no_grad():
                    c = math.sqrt(head_dim / attn.head_dim)
                    attn.qkv.weight[:attn_dim].mul_(c)
                    if attn.qkv.bias is not None:
                        attn.qkv.bias[:attn_dim].mul_(c)
            attn.num_heads, attn.head_dim, attn.attn_dim = heads, head_dim, attn_dim
            attn.scale = head_dim ** -0.5
        width = model.patch_embed.proj.out_channels
        model.embed_dim = model.num_features = width
        if hasattr(model, "head_hidden_size"):
            model.head_hidden_size = width
        _sync_feature_info(model)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The transformer blocks (``model.blocks``)."""
        return list(model.blocks)

    def removable_blocks(self, model: nn.Module) -> list[int]:
        """Every transformer block (pre-norm residual: skipping one maps tokens to themselves)."""
        return list(range(len(model.blocks)))

    def remove_blocks(self, model: nn.Module, indices: list[int]) -> None:
        drop = {int(i) for i in indices}
        if any(not 0 <= i < len(model.blocks) for i in drop) or len(drop) >= len(model.blocks):
            raise UnsupportedModelError(f"remove_blocks: cannot drop blocks {sorted(drop)} of {len(model.blocks)} "
                                        "(at least one must stay)")
        model.blocks = nn.Sequential(*[b for i, b in enumerate(model.blocks) if i not in drop])
        _sync_feature_info(model)


def _sync_feature_info(model: nn.Module) -> None:
    """timm's ``feature_info`` (one entry per block with its width) after pruning or dropping blocks."""
    info = getattr(model, "feature_info", None)
    if isinstance(info, list) and info and isinstance(info[0], dict):
        red = info[0].get("reduction")
        model.feature_info = [dict(module=f"blocks.{i}", num_chs=model.embed_dim, reduction=red)
                              for i in range(len(model.blocks))]


# ------------------------------------------------------------------------------------------------------
# FS-Merge structure (Foldable SuperNets, arXiv 2410.19251, spec fs-merge.md §1.2, appendix B)
# ------------------------------------------------------------------------------------------------------
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
    """FS-Merge for timm ``VisionTransformer`` (pre-LN blocks, fused qkv, CLS or average pooling; spec §1.2)."""

    kind = "vit"

    def __init__(self, models: list[nn.Module]):
        v = models[0]
        if getattr(v, "attn_pool", None) is not None:
            raise UnsupportedModelError("fs-merge: attention pooling is not supported")
        if v.global_pool not in ("token", "avg"):
            raise UnsupportedModelError(f"fs-merge: global_pool {v.global_pool!r} not supported (token or avg)")
        if not isinstance(v.patch_embed.proj, nn.Conv2d) or not isinstance(v.patch_embed.norm, nn.Identity):
            raise UnsupportedModelError("fs-merge: the patch embedding must be a Conv2d without a norm")
        if getattr(v, "dynamic_img_size", False):
            raise UnsupportedModelError("fs-merge: dynamic image size is not supported")
        for norm_name in ("norm_pre", "norm", "fc_norm"):
            mod = getattr(v, norm_name)
            if not isinstance(mod, (nn.Identity, nn.LayerNorm)):
                raise UnsupportedModelError(f"fs-merge: {norm_name} must be a LayerNorm or Identity, got "
                                            f"{type(mod).__name__}")
        for i, blk in enumerate(v.blocks):
            a = blk.attn
            if not hasattr(a, "qkv") or getattr(a, "gate", None) is not None:
                raise UnsupportedModelError(f"fs-merge: block {i} attention must be timm Attention with a fused qkv")
            for sub in ("q_norm", "k_norm", "norm"):
                if not isinstance(getattr(a, sub, nn.Identity()), nn.Identity):
                    raise UnsupportedModelError(f"fs-merge: block {i} attention {sub} is not supported")
            for sub in ("ls1", "ls2", "drop_path1", "drop_path2"):
                if not isinstance(getattr(blk, sub), nn.Identity):
                    raise UnsupportedModelError(f"fs-merge: block {i} {sub} ({type(getattr(blk, sub)).__name__}) is "
                                                "not supported (LayerScale / drop-path)")
            if not isinstance(blk.norm1, nn.LayerNorm) or not isinstance(blk.norm2, nn.LayerNorm):
                raise UnsupportedModelError(f"fs-merge: block {i} must be pre-LN with LayerNorms")
            if not (hasattr(blk.mlp, "fc1") and hasattr(blk.mlp, "fc2")) or not isinstance(
                    getattr(blk.mlp, "norm", nn.Identity()), nn.Identity) or hasattr(blk.mlp, "fc1_g"):
                raise UnsupportedModelError(f"fs-merge: block {i} MLP must be a plain fc1-act-fc2 Mlp")
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
        from fedfuse.fusion.fs_merge.matrices import MergeMatrix

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
        """Folded ViT parameters (template names ``m.*``), differentiable in M/U/LN (spec §1.2, §1.6)."""
        from fedfuse.fusion.fs_merge.matrices import fold_linear, split_blocks

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
        from fedfuse.fusion.fs_merge.matrices import unmerge, wide_linear

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
