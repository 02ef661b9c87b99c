"""Adapter for torchvision's ``ResNet`` (``torchvision.models.resnet18`` … ``resnet152``, ``wide_resnet``):
``conv1 → bn1 → relu → maxpool → layer1..layer4 (BasicBlock | Bottleneck) → avgpool → fc``, as users have it.
A ResNet with grouped convolutions (``resnext``: ``groups`` > 1) is not this family's: a channel permutation must
keep a grouped convolution's groups, which these groups do not, so the generic graph reader takes it (it leaves the
groups a grouped convolution touches in place and says so in ``PermSpec.frozen``).

Levels: the stem (output of ``maxpool``), every residual block (``layer<i>.<j>``), the classifier ``fc``.
Permutation groups: a residual-stream group per run of blocks without a ``downsample`` (a ``downsample`` starts a new
one), and one hidden group per inner convolution of a block (``conv1``, and ``conv2`` in a Bottleneck). torchvision
applies one ``relu`` module several times inside a block, so the hidden groups' activations are read at the
BatchNorm before it (``bn1``/``bn2``: the pre-activation), and captum's DeepLIFT, which hooks each nonlinearity once
per forward, cannot score these models' units (use ``importance='uniform'`` or ``'conductance'`` on the clients, or
send no scores).

Capacity tiers and ``resize`` build fedfuse's own architectures and are not available here: for a ResNet-18-size
model that fedfuse can also resize, use ``fedfuse.models.resnet(width=64, depth=4, blocks_per_stage=2)``.
"""

from __future__ import annotations

import torch
from torch import nn

from fedfuse.models.adapters.base import Adapter, Level, ModelConfig, PruningSpec, UnsupportedModelError, compose
from fedfuse.models.adapters.graph import GraphAdapter
from fedfuse.models.adapters.permspec import Axis, Entry, Group, PermSpec, norm_entries

LAYERS = ("layer1", "layer2", "layer3", "layer4")


def _torchvision_resnet():
    try:
        from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet
    except ImportError:   # torchvision is optional for the library: without it no model can be one
        return None
    return ResNet, BasicBlock, Bottleneck


def _inner(block: nn.Module) -> list[tuple[str, str]]:
    """``(conv, norm)`` names of a block's convolutions, the last one writing the residual stream."""
    pairs = [("conv1", "bn1"), ("conv2", "bn2")]
    return pairs + [("conv3", "bn3")] if hasattr(block, "conv3") else pairs


class TorchvisionResNetAdapter(Adapter):
    """torchvision's ResNet family (see the module docstring)."""

    family = "torchvision-resnet"

    def matches(self, model: nn.Module) -> bool:
        tv = _torchvision_resnet()
        if tv is None or not isinstance(model, tv[0]):
            return False
        # ResNeXt: its grouped convolutions constrain the channel permutations (the graph reader's case)
        return not any(isinstance(m, nn.Conv2d) and m.groups > 1 for m in model.modules())

    def _named_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        tv = _torchvision_resnet()
        out = []
        for layer in LAYERS:
            for j, block in enumerate(getattr(model, layer)):
                if not isinstance(block, (tv[1], tv[2])):
                    raise UnsupportedModelError(f"torchvision ResNet: {layer}.{j} is a {type(block).__name__}, not "
                                                "torchvision's BasicBlock or Bottleneck")
                out.append((f"{layer}.{j}", block))
        return out

    def _stem(self, model: nn.Module):
        return compose([model.conv1, model.bn1, model.relu, model.maxpool])

    def levels(self, model: nn.Module) -> list[Level]:
        out = [Level(name="stem", width=model.conv1.out_channels, kind="block", layout="channels",
                     module=model.maxpool, run=self._stem(model),
                     param_names=[f"{m}.{p}" for m in ("conv1", "bn1")
                                  for p, _ in getattr(model, m).named_parameters()])]
        for name, block in self._named_blocks(model):
            last = _inner(block)[-1][0]
            out.append(Level(name=name, width=getattr(block, last).out_channels, kind="block", layout="channels",
                             module=block, run=block,
                             param_names=[f"{name}.{p}" for p, _ in block.named_parameters()]))
        pre = compose([model.avgpool, lambda h: torch.flatten(h, 1)])
        out.append(Level(name="fc", width=model.fc.out_features, kind="classifier", layout="flat", module=model.fc,
                         run=lambda h: model.fc(pre(h)), param_names=[f"fc.{p}" for p, _ in model.fc.named_parameters()],
                         layer=model.fc, pre=pre))
        return out

    def perm_spec(self, model: nn.Module, residual: str = "tied") -> PermSpec:
        """Blocks without ``downsample`` share the stream group of their input (``residual`` does not apply)."""
        groups: dict[str, Group] = {}
        entries: dict[str, Entry] = {}
        s = Group("stem", model.conv1.out_channels, "stream", acts=[("maxpool", "out", "channels")], levels=["stem"])
        groups[s.name] = s
        entries["conv1.weight"] = Entry("conv1.weight", None, (Axis(s.name, 0, "out"),))
        norm_entries("bn1", model.bn1, s, entries)
        for p, blk in self._named_blocks(model):
            pairs = _inner(blk)
            prev = s
            for conv, norm in pairs[:-1]:   # hidden groups, read at their BatchNorm (the ReLU module is shared)
                h = Group(f"{p}.{conv}", getattr(blk, conv).out_channels, "hidden",
                          acts=[(f"{p}.{norm}", "out", "channels")])
                groups[h.name] = h
                entries[f"{p}.{conv}.weight"] = Entry(f"{p}.{conv}.weight", None,
                                                      (Axis(h.name, 0, "out"), Axis(prev.name, 1, "in")))
                norm_entries(f"{p}.{norm}", getattr(blk, norm), h, entries)
                prev = h
            if blk.downsample is None:
                out = s
            else:
                out = Group(p, blk.downsample[0].out_channels, "stream")
                groups[out.name] = out
                entries[f"{p}.downsample.0.weight"] = Entry(f"{p}.downsample.0.weight", None,
                                                            (Axis(out.name, 0, "out"), Axis(s.name, 1, "in")))
                norm_entries(f"{p}.downsample.1", blk.downsample[1], out, entries)
            conv, norm = pairs[-1]
            entries[f"{p}.{conv}.weight"] = Entry(f"{p}.{conv}.weight", None,
                                                  (Axis(out.name, 0, "out"), Axis(prev.name, 1, "in")))
            norm_entries(f"{p}.{norm}", getattr(blk, norm), out, entries)
            out.acts.append((p, "out", "channels"))
            out.levels.append(p)
            s = out
        entries["fc.weight"] = Entry("fc.weight", None, (Axis(s.name, 1, "in"),))
        return PermSpec("torchvision-resnet", groups, entries, ("fc.weight", "fc.bias"))

    def pre_logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = self._stem(model)(x)
        for layer in LAYERS:
            h = getattr(model, layer)(h)
        return torch.flatten(model.avgpool(h), 1)

    def classifier(self, model: nn.Module) -> nn.Linear:
        return model.fc

    def set_classifier(self, model: nn.Module, layer: nn.Linear) -> None:
        model.fc = layer

    def config(self, model: nn.Module, input_shape: tuple[int, ...] | None = None) -> ModelConfig:
        raise UnsupportedModelError(
            "torchvision ResNet: fedfuse can fuse it but not rebuild it at another width or depth (resize, a fused "
            "target of another width); for that use fedfuse's own ResNet, e.g. fedfuse.models.resnet(width=64, "
            "depth=4, blocks_per_stage=2, input_shape=(3, 32, 32)) for ResNet-18 size; capacity tiers narrow a copy")

    def at_width_mult(self, model: nn.Module, width_mult: float, seed: int = 0,
                      input_shape: tuple[int, ...] | None = None) -> nn.Module:
        """Capacity tiers: a fresh copy narrowed along the generic reader's groups (the same channel groups as this
        adapter's, ``tests/test_any_model.py``), as for any model the reader describes."""
        return GraphAdapter().at_width_mult(model, width_mult, seed=seed, input_shape=input_shape)

    # ------------------------------------------------------------------------- structured pruning and blocks
    def pruning_spec(self, model: nn.Module) -> PruningSpec:
        """The classifier's outputs stay; ``conv1``'s outputs are level ``stem``'s neurons and each block's last
        convolution's outputs its level's."""
        spec = PruningSpec(ignored=[model.fc])
        spec.score_levels[model.conv1] = "stem"
        for name, blk in self._named_blocks(model):
            spec.score_levels[getattr(blk, _inner(blk)[-1][0])] = name
        return spec

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [b for _, b in self._named_blocks(model)]

    def removable_blocks(self, model: nn.Module) -> list[int]:
        """Blocks without ``downsample`` (stride 1, same channels): ``relu(x + f(x))`` with ``x >= 0`` is ``x``
        when skipped."""
        return [i for i, (_, b) in enumerate(self._named_blocks(model)) if b.downsample is None]

    def remove_blocks(self, model: nn.Module, indices: list[int]) -> None:
        drop = {int(i) for i in indices}
        bad = drop - set(self.removable_blocks(model))
        if bad:
            raise UnsupportedModelError(f"remove_blocks: torchvision ResNet blocks {sorted(bad)} have a downsample "
                                        "and cannot be dropped")
        k = 0
        for layer in LAYERS:
            kept = []
            for b in getattr(model, layer):
                if k not in drop:
                    kept.append(b)
                k += 1
            setattr(model, layer, nn.Sequential(*kept))
