"""Adapter for timm ``VisionTransformer`` s (built by ``fedfuse.models.vit`` or not).

timm is imported only when a model is inspected (it is slow to import), and never to tell that a model is not a ViT.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from fedfuse.models.adapters.base import (Adapter, Level, ModelConfig, PruningSpec, UnsupportedModelError,
                                          check_width_mult, is_identity)
from fedfuse.models.adapters.permspec import Axis, Entry, Group, PermSpec, norm_entries

_HEAD_PREFIXES = ("norm.", "fc_norm.", "head.", "attn_pool.")


class ViTAdapter(Adapter):
    """Levels: every transformer block (the first also owns the embedding), then the head. Permutation
    groups: the residual stream (one tied group or one per residual position), the Q/K/V dims of each
    attention block (heads as blocks) and the hidden units of each MLP."""

    family = "vit"
    pruning_criterion = "taylor"  # the best measured criterion for ViTs (docs/measurements-fusion.md)

    def matches(self, model: nn.Module) -> bool:
        # a VisionTransformer instance exists only once its module was imported: asking sys.modules spares every
        # non-ViT model the import of timm (0.9 s, paid by the first fusion of a torchvision ResNet otherwise)
        module = sys.modules.get("timm.models.vision_transformer")
        return module is not None and isinstance(model, module.VisionTransformer)

    # ------------------------------------------------------------------------------------------ levels
    def levels(self, model: nn.Module) -> list[Level]:
        from fedfuse.models.vit import vit_embed, vit_head  # deferred: timm (see above)

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
        (equivalent only with explicitly permuted skips, as TransFusion transports task vectors)."""
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
        from fedfuse.models.vit import VisionTransformer1d  # deferred: timm (see above)

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
