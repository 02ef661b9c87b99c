"""Adapter for plain ``nn.Sequential`` stacks of Linear/Conv(+BatchNorm) layers and parameter-free ops
(fedfuse's ``mlp`` and ``cnn`` are such stacks; so are many outside MLPs/CNNs)."""

from __future__ import annotations

import math

import torch
from torch import nn

from fedfuse.models.adapters.base import (AFFINE_LAYERS, BATCHNORMS, Adapter, Level, ModelConfig,
                                          UnsupportedModelError, compose, has_params)
from fedfuse.models.adapters.permspec import Axis, Entry, Group, PermSpec, norm_entries

def _layout_of(layer: nn.Module) -> str:
    return "flat" if isinstance(layer, nn.Linear) else "channels"


class SequentialAdapter(Adapter):
    """``nn.Sequential`` MLPs and CNNs: every Linear/Conv (with the BatchNorm right after it) is a level."""

    family = "sequential"

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, nn.Sequential)

    # ------------------------------------------------------------------------------------------ levels
    def levels(self, model: nn.Sequential, prefix: str = "") -> list[Level]:
        """Split a flat ``nn.Sequential`` at every Linear/Conv layer (BatchNorm joins its layer)."""
        children = list(model.named_children())
        out: list[Level] = []
        pending: list[nn.Module] = []  # parameter-free ops waiting for the next affine layer
        i = 0
        while i < len(children):
            name, m = children[i]
            if isinstance(m, AFFINE_LAYERS):
                layer, layer_name = m, name
                norm, out_name, out_mod = None, name, m
                if i + 1 < len(children) and isinstance(children[i + 1][1], BATCHNORMS):
                    out_name, norm = children[i + 1]
                    out_mod = norm
                    i += 1
                params = [f"{prefix}{layer_name}.{p}" for p, _ in layer.named_parameters()]
                if norm is not None:
                    params += [f"{prefix}{out_name}.{p}" for p, _ in norm.named_parameters()]
                pre = compose(list(pending))
                fns = [pre, layer] + ([norm] if norm is not None else [])
                width = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
                out.append(Level(name=f"{prefix}{out_name}", width=width, kind="affine", layout=_layout_of(layer),
                                 module=out_mod, run=compose(fns), param_names=params, layer=layer, norm=norm,
                                 pre=pre))
                pending = []
            elif has_params(m):
                raise UnsupportedModelError(
                    f"levels: unsupported parameterised module {prefix}{name} ({type(m).__name__}) in "
                    "nn.Sequential; only Linear/Conv1d/Conv2d (+BatchNorm) carry parameters")
            else:
                pending.append(m)
            i += 1
        if not out:
            raise UnsupportedModelError("levels: nn.Sequential has no Linear/Conv layer")
        last = out[-1]
        last.kind = "classifier"
        if pending:  # trailing parameter-free ops (e.g. a final Softmax) stay part of the classifier level
            post = compose(list(pending))
            inner = last.run
            last.post = post
            last.run = lambda h, inner=inner, post=post: post(inner(h))
        return out

    # ---------------------------------------------------------------------------------- permutation spec
    def perm_spec(self, model: nn.Sequential, residual: str = "tied") -> PermSpec:
        """One ``hidden`` group per Linear/Conv except the class layer; ``residual`` does not apply."""
        children = list(model.named_children())
        affine = [i for i, (_, m) in enumerate(children) if isinstance(m, AFFINE_LAYERS)]
        if not affine:
            raise UnsupportedModelError("permute: nn.Sequential has no Linear/Conv layer")
        groups: dict[str, Group] = {}
        entries: dict[str, Entry] = {}
        prev: Group | None = None
        classifier: tuple[str, ...] = ()
        for i, (name, m) in enumerate(children):
            if isinstance(m, BATCHNORMS):
                if i == 0 or not isinstance(children[i - 1][1], AFFINE_LAYERS):
                    raise UnsupportedModelError(f"permute: BatchNorm {name} must directly follow a Linear/Conv layer")
                continue
            if not isinstance(m, AFFINE_LAYERS):
                if any(True for _ in m.parameters()):
                    raise UnsupportedModelError(
                        f"permute: unsupported parameterised module {name} ({type(m).__name__}) in "
                        "nn.Sequential; only Linear/Conv1d/Conv2d (+BatchNorm) carry parameters")
                continue
            if isinstance(m, (nn.Conv1d, nn.Conv2d)) and m.groups != 1:
                raise UnsupportedModelError(f"permute: grouped convolution {name} (groups={m.groups}) is not supported")
            w = m.weight
            in_axes: list[Axis] = []
            view = None
            if prev is not None:
                n_in = w.shape[1]
                if n_in == prev.size:
                    in_axes = [Axis(prev.name, 1, "in")]
                elif isinstance(m, nn.Linear) and n_in % prev.size == 0:
                    # Conv → Flatten → Linear: inputs are channel-major blocks of n_in / C features
                    view = (w.shape[0], prev.size, n_in // prev.size)
                    in_axes = [Axis(prev.name, 1, "in")]
                else:
                    raise UnsupportedModelError(f"permute: layer {name} takes {n_in} inputs, not a multiple of the "
                                                f"previous layer's {prev.size} units")
            has_bn = i + 1 < len(children) and isinstance(children[i + 1][1], BATCHNORMS)
            last = i == affine[-1]
            if last:  # class layer: inputs aligned, outputs (classes) never permuted
                entries[f"{name}.weight"] = Entry(f"{name}.weight", view, tuple(in_axes))
                classifier = tuple(k for k in (f"{name}.weight", f"{name}.bias")
                                   if getattr(m, k.split(".")[-1]) is not None)
                prev = None
                continue
            out_name = children[i + 1][0] if has_bn else name
            layout = _layout_of(m)
            g = Group(name=name, size=w.shape[0], kind="hidden", acts=[(out_name, "out", layout)], levels=[out_name])
            groups[g.name] = g
            entries[f"{name}.weight"] = Entry(f"{name}.weight", view, (Axis(g.name, 0, "out"), *in_axes))
            if m.bias is not None:
                entries[f"{name}.bias"] = Entry(f"{name}.bias", None, (Axis(g.name, 0, "out"),))
            if has_bn:
                norm_entries(children[i + 1][0], children[i + 1][1], g, entries)
            prev = g
        return PermSpec("sequential", groups, entries, classifier)

    def pre_logits(self, model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for mod in list(model)[:-1]:
            x = mod(x)
        return x

    def classifier(self, model: nn.Sequential) -> nn.Linear:
        last = model[len(model) - 1]
        if not isinstance(last, nn.Linear):
            raise UnsupportedModelError(f"nn.Sequential must end with its Linear classifier, ends with "
                                        f"{type(last).__name__}")
        return last

    def set_classifier(self, model: nn.Sequential, layer: nn.Linear) -> None:
        model[len(model) - 1] = layer

    # ----------------------------------------------------------------------------------- config / resize
    def config(self, model: nn.Sequential, input_shape: tuple[int, ...] | None = None) -> ModelConfig:
        """Config of a fedfuse ``mlp`` (``Flatten → [Linear → (BN) → ReLU]×depth → Linear``) or ``cnn``
        (``[Conv → (BN) → ReLU → (MaxPool)]×depth → GAP → Flatten → Linear``, channels doubling per stage).

        A CNN's input size is not stored in its layers: without ``input_shape`` it is the smallest size that
        gives the same pooling layers. Other ``nn.Sequential`` stacks raise ``UnsupportedModelError``.
        """
        children = list(model)
        cfg = _mlp_config(children) if children and isinstance(children[0], nn.Flatten) else _cnn_config(children)
        if cfg is None:
            kinds = " → ".join(type(m).__name__ for m in children)
            raise UnsupportedModelError(f"config: this nn.Sequential ({kinds}) is not laid out like fedfuse's mlp or "
                                        "cnn, so it cannot be rebuilt at another width/depth")
        if input_shape is not None:
            if cfg.name == "mlp" and math.prod(input_shape) != cfg.input_shape[0]:
                raise UnsupportedModelError(f"config: this mlp takes {cfg.input_shape[0]} input features, not "
                                            f"input_shape {tuple(input_shape)}")
            cfg = cfg.replace(input_shape=tuple(input_shape))
        return cfg

    def resize(self, model: nn.Sequential, width: int | None = None, depth: int | None = None, seed: int = 0,
               input_shape: tuple[int, ...] | None = None) -> nn.Module:
        """See ``Adapter.resize``. A deeper CNN that pooled in every stage needs ``input_shape``: whether the
        new stages pool depends on the input size, which its layers do not fix."""
        if input_shape is None and depth is not None:
            cfg = self.config(model)
            pools = sum(isinstance(m, (nn.MaxPool1d, nn.MaxPool2d)) for m in model)
            if cfg.name == "cnn" and depth > cfg.depth and pools == cfg.depth:
                raise UnsupportedModelError(f"resize: a cnn deeper than {cfg.depth} stages pools depending on the "
                                            "input size, which its layers do not fix; pass input_shape=")
        return super().resize(model, width=width, depth=depth, seed=seed, input_shape=input_shape)


def _mlp_config(c: list[nn.Module]) -> ModelConfig | None:
    i, widths, bns, biases = 1, [], [], []
    while i < len(c) - 1:
        lin = c[i]
        if not isinstance(lin, nn.Linear):
            return None
        bn = i + 1 < len(c) and isinstance(c[i + 1], nn.BatchNorm1d)
        j = i + 1 + bn
        if j >= len(c) - 1 or not isinstance(c[j], nn.ReLU):
            return None
        widths.append(lin.out_features)
        bns.append(bn)
        biases.append(lin.bias is not None)
        i = j + 1
    head = c[-1]
    if not widths or not isinstance(head, nn.Linear) or len(set(widths)) != 1 or len(set(bns)) != 1:
        return None
    biases.append(head.bias is not None)
    if len(set(biases)) != 1:
        return None
    first = c[1]
    return ModelConfig("sequential", "mlp", head.out_features, (first.in_features,), widths[0], len(widths),
                       {"bias": biases[0], "batchnorm": bns[0]})


def _cnn_config(c: list[nn.Module]) -> ModelConfig | None:
    i, widths, bns, biases, pools = 0, [], [], [], []
    conv_t = type(c[0]) if c and isinstance(c[0], (nn.Conv1d, nn.Conv2d)) else None
    if conv_t is None:
        return None
    while i < len(c) and isinstance(c[i], conv_t):
        conv = c[i]
        if conv.kernel_size != (3,) * len(conv.kernel_size) or conv.padding != (1,) * len(conv.padding) \
                or conv.stride != (1,) * len(conv.stride) or conv.groups != 1:
            return None
        bn = i + 1 < len(c) and isinstance(c[i + 1], BATCHNORMS)
        j = i + 1 + bn
        if j >= len(c) or not isinstance(c[j], nn.ReLU):
            return None
        pool = j + 1 < len(c) and isinstance(c[j + 1], (nn.MaxPool1d, nn.MaxPool2d))
        widths.append(conv.out_channels)
        bns.append(bn)
        biases.append(conv.bias is not None)
        pools.append(pool)
        i = j + 1 + pool
    tail = c[i:]
    if len(tail) != 3 or not isinstance(tail[0], (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)) \
            or not isinstance(tail[1], nn.Flatten) or not isinstance(tail[2], nn.Linear):
        return None
    head = tail[2]
    biases.append(head.bias is not None)
    k = sum(pools)
    if widths != [widths[0] * 2 ** s for s in range(len(widths))] or len(set(bns)) != 1 or len(set(biases)) != 1 \
            or pools != [True] * k + [False] * (len(pools) - k):
        return None
    size = 2 ** (k + 1)  # pooled k times while the side was >= 4, then 2 < 4 stopped the pooling
    spatial = (size,) if conv_t is nn.Conv1d else (size, size)
    return ModelConfig("sequential", "cnn", head.out_features, (c[0].in_channels, *spatial), widths[0], len(widths),
                       {"bias": biases[0], "batchnorm": bns[0]})
