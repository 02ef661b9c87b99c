"""Adapter for fedfuse's ``ResNet`` (``fedfuse.models.resnet``: stem → BasicBlocks → GAP → Linear)."""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.models.adapters.base import Adapter, Level, ModelConfig, PruningSpec, UnsupportedModelError, compose
from fedfuse.models.adapters.permspec import Axis, Entry, Group, PermSpec, norm_entries
from fedfuse.models.resnet import ResNet


class ResNetAdapter(Adapter):
    """Levels: the stem, every residual block, the classifier. Permutation groups: one residual-stream
    group per run of identity-shortcut blocks (a shortcut conv starts a new one) and one hidden group
    inside every block."""

    family = "resnet"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, ResNet)

    def levels(self, model: nn.Module) -> list[Level]:
        out = [Level(name="stem", width=model.stem[0].out_channels, kind="block", layout="channels",
                     module=model.stem, run=model.stem,
                     param_names=[f"stem.{p}" for p, _ in model.stem.named_parameters()])]
        for i, block in enumerate(model.blocks):
            out.append(Level(name=f"blocks.{i}", width=block.conv2.out_channels, kind="block", layout="channels",
                             module=block, run=block,
                             param_names=[f"blocks.{i}.{p}" for p, _ in block.named_parameters()]))
        pre = compose([model.pool, lambda h: torch.flatten(h, 1)])
        out.append(Level(name="fc", width=model.fc.out_features, kind="classifier", layout="flat", module=model.fc,
                         run=model.forward_head, param_names=[f"fc.{p}" for p, _ in model.fc.named_parameters()],
                         layer=model.fc, pre=pre))
        return out

    def perm_spec(self, model: nn.Module, residual: str = "tied") -> PermSpec:
        """Identity-shortcut blocks share the stream group of their input (``residual`` does not apply)."""
        groups: dict[str, Group] = {}
        entries: dict[str, Entry] = {}
        stem_conv, stem_norm = model.stem[0], model.stem[1]
        s = Group("stem", stem_conv.out_channels, "stream", acts=[("stem", "out", "channels")], levels=["stem"])
        groups[s.name] = s
        entries["stem.0.weight"] = Entry("stem.0.weight", None, (Axis(s.name, 0, "out"),))
        norm_entries("stem.1", stem_norm, s, entries)
        for i, blk in enumerate(model.blocks):
            p = f"blocks.{i}"
            h = Group(f"{p}.hidden", blk.conv1.out_channels, "hidden", acts=[(f"{p}.relu1", "out", "channels")])
            groups[h.name] = h
            entries[f"{p}.conv1.weight"] = Entry(f"{p}.conv1.weight", None,
                                                 (Axis(h.name, 0, "out"), Axis(s.name, 1, "in")))
            norm_entries(f"{p}.norm1", blk.norm1, h, entries)
            if isinstance(blk.shortcut, nn.Identity):
                out = s  # identity skip: the block's output permutation equals its input permutation
            else:
                out = Group(p, blk.conv2.out_channels, "stream")
                groups[out.name] = out
                entries[f"{p}.shortcut.0.weight"] = Entry(f"{p}.shortcut.0.weight", None,
                                                          (Axis(out.name, 0, "out"), Axis(s.name, 1, "in")))
                norm_entries(f"{p}.shortcut.1", blk.shortcut[1], out, entries)
            entries[f"{p}.conv2.weight"] = Entry(f"{p}.conv2.weight", None,
                                                 (Axis(out.name, 0, "out"), Axis(h.name, 1, "in")))
            norm_entries(f"{p}.norm2", blk.norm2, out, entries)
            out.acts.append((p, "out", "channels"))
            out.levels.append(p)
            s = out
        entries["fc.weight"] = Entry("fc.weight", None, (Axis(s.name, 1, "in"),))
        return PermSpec("resnet", groups, entries, ("fc.weight", "fc.bias"))

    def pre_logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(model.pool(model.blocks(model.stem(x))), 1)

    def classifier(self, model: nn.Module) -> nn.Linear:
        return model.fc

    def set_classifier(self, model: nn.Module, layer: nn.Linear) -> None:
        model.fc = layer

    def config(self, model: nn.Module, input_shape: tuple[int, ...] | None = None) -> ModelConfig:
        """``width`` = stem channels, ``depth`` = stages (channel doublings), ``blocks_per_stage``, ``norm``.

        The spatial input size does not change a ResNet's layers; without ``input_shape`` it is 8 per side."""
        conv = model.stem[0]
        one_d = isinstance(conv, nn.Conv1d)
        width = conv.out_channels
        chans = [b.conv2.out_channels for b in model.blocks]
        stages = sorted(set(chans))
        if not chans or stages != [width * 2 ** s for s in range(len(stages))] or chans != sorted(chans):
            raise UnsupportedModelError(f"config: ResNet block widths {chans} are not stages of width {width} "
                                        "doubling per stage")
        per_stage = {c: chans.count(c) for c in stages}
        if len(set(per_stage.values())) != 1:
            raise UnsupportedModelError(f"config: ResNet stages have different block counts {per_stage}")
        norm = "group" if isinstance(model.stem[1], nn.GroupNorm) else "batch"
        shape = tuple(input_shape) if input_shape is not None else (conv.in_channels, *((8,) if one_d else (8, 8)))
        return ModelConfig("resnet", "resnet", model.fc.out_features, shape, width,
                           len(stages), {"blocks_per_stage": per_stage[stages[0]], "norm": norm})

    # ------------------------------------------------------------------------- structured pruning
    def pruning_spec(self, model: nn.Module) -> PruningSpec:
        """The classifier's outputs stay; the stem conv's outputs are level ``stem``'s neurons and block ``i``'s
        ``conv2`` outputs level ``blocks.i``'s (the block output channels)."""
        spec = PruningSpec(ignored=[model.fc])
        spec.score_levels[model.stem[0]] = "stem"
        for i, blk in enumerate(model.blocks):
            spec.score_levels[blk.conv2] = f"blocks.{i}"
        return spec

    def finish_pruning(self, model: nn.Module, num_heads: dict[nn.Module, int]) -> None:
        """GroupNorm keeps a group count that divides its (pruned) channels (``min(8, C)`` for a narrow tier)."""
        import math

        for mod in model.modules():
            if isinstance(mod, nn.GroupNorm) and mod.num_channels % mod.num_groups:
                mod.num_groups = math.gcd(mod.num_channels, mod.num_groups)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The residual blocks (``model.blocks``)."""
        return list(model.blocks)

    def removable_blocks(self, model: nn.Module) -> list[int]:
        """Blocks with an identity shortcut (stride 1, same channels): ``relu(x + f(x))`` with ``x >= 0`` (a
        ReLU output) becomes ``x`` when skipped."""
        return [i for i, blk in enumerate(model.blocks) if isinstance(blk.shortcut, nn.Identity)]

    def remove_blocks(self, model: nn.Module, indices: list[int]) -> None:
        drop = {int(i) for i in indices}
        bad = drop - set(self.removable_blocks(model))
        if bad:
            raise UnsupportedModelError(f"remove_blocks: ResNet blocks {sorted(bad)} change the shape (shortcut "
                                        "convolution) and cannot be dropped")
        model.blocks = nn.Sequential(*[b for i, b in enumerate(model.blocks) if i not in drop])
