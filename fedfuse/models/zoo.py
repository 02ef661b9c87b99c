"""Zoo models: any torchvision classification builder or timm model, by name, fitted to the dataset's inputs.

    build_model("torchvision:resnet18", num_classes=10, input_shape=(1, 28, 28))   # run config model='torchvision:...'
    build_model("timm:convnext_atto", num_classes=10, input_shape=(3, 32, 32))      # model='timm:...'

Always a random initialisation (torchvision ``weights=None``, timm ``pretrained=False``): nothing is downloaded.
The model's classifier has the dataset's ``num_classes``, and its input is fitted to the dataset's:

- **channels**: timm builds the model with ``in_chans=C``; for torchvision the first ``Conv2d`` (in module order:
  ``conv1``, ``features.0.0``, ``conv_proj``, ...) is replaced by one with ``C`` input channels and the same out
  channels, kernel, stride, padding, dilation and bias, its weights the builder's own initialisation of the first
  ``C`` input channels (cycled when ``C`` > 3).
- **size**: timm ViTs (``timm.models.vision_transformer`` / ``deit`` entry points) are built for the input itself:
  ``img_size=(H, W)`` and, for sides up to 64 pixels, ``patch_size=4`` (digits 8x8: 2x2 tokens, Fashion-MNIST
  28x28: 7x7). Every other model sees images smaller than 32 pixels per side upsampled to at least 32x32 by a
  parameter-free bilinear ``nn.Upsample`` in front of it (``Resized``): the size CIFAR nets take and that five
  stride-2 stages (VGG, ConvNeXt, EfficientNet, ...) reduce to 1x1 rather than 0. Models built for one image size
  get the size they see: torchvision ViTs ``image_size``, other timm models whose pretrained config says
  ``fixed_input_size`` (Swin, BEiT, MLP-Mixer, ...) ``img_size``. Images of 32 pixels or more go in unchanged.

``Resized`` is an ``nn.Module`` with two children, ``resize`` (``nn.Upsample``, no parameters or buffers) and
``net`` (the zoo model): its state dict is the zoo model's under the prefix ``net.``; its forward has no
data-dependent control flow (``torch.fx.symbolic_trace`` and Torch-Pruning's dependency graph trace it).

A model that cannot take the inputs even so (e.g. ``torchvision:inception_v3``, 75 pixels at least) fails the config
check's forward pass (``fedfuse.config.check_model``) with a one-line error naming the key ``model``.
"""

from __future__ import annotations

import difflib
from functools import lru_cache

from torch import nn

from fedfuse.choices import TIMM_PREFIX, TORCHVISION_PREFIX, ZOO_PREFIXES

#: images with a side below this are upsampled to it (every zoo model but timm ViTs)
MIN_SIDE = 32
#: timm ViTs on inputs with sides up to this take ``patch_size=PATCH``
SMALL_SIDE, PATCH = 64, 4
#: timm entry-point modules whose models are ``VisionTransformer``s taking ``img_size`` / ``patch_size``
TIMM_VIT_MODULES = ("timm.models.vision_transformer", "timm.models.deit")
#: torchvision builders' extra arguments: plain logits in training mode too (no auxiliary heads), the stated init
TORCHVISION_EXTRA = {"googlenet": {"aux_logits": False, "init_weights": True},
                     "inception_v3": {"aux_logits": False, "init_weights": True}}


class Resized(nn.Module):
    """``net`` on inputs upsampled (bilinear, parameter-free) to ``size``: ``[N, C, H, W] -> net([N, C, *size])``.

    The state dict is ``net``'s under the prefix ``net.`` (``resize`` holds no parameters or buffers)."""

    def __init__(self, net: nn.Module, size: tuple[int, int]) -> None:
        super().__init__()
        self.resize = nn.Upsample(size=tuple(int(s) for s in size), mode="bilinear", align_corners=False)
        self.net = net

    def forward(self, x):
        return self.net(self.resize(x))


def is_zoo_name(name: str) -> bool:
    """Whether ``name`` names a zoo model (``torchvision:<name>`` or ``timm:<name>``)."""
    return isinstance(name, str) and name.startswith(ZOO_PREFIXES)


def split_zoo_name(name: str) -> tuple[str, str]:
    """``'timm:resnet18'`` -> ``('timm:', 'resnet18')``; ``ValueError`` for a name without a zoo prefix."""
    for prefix in ZOO_PREFIXES:
        if name.startswith(prefix):
            return prefix, name[len(prefix):]
    raise ValueError(f"model: {name!r} is not a zoo model name ({' or '.join(p + '<name>' for p in ZOO_PREFIXES)})")


@lru_cache(maxsize=None)
def zoo_names(prefix: str) -> tuple[str, ...]:
    """The model names a zoo offers: torchvision's classification builders (``torchvision.models.list_models``
    of the ``torchvision.models`` module: no detection, segmentation, video or quantized ones), timm's
    architectures (``timm.list_models()``; a pretrained tag such as ``resnet18.a1_in1k`` is accepted too)."""
    if prefix == TORCHVISION_PREFIX:
        import torchvision.models  # deferred: torchvision, imported only when a zoo model is named

        return tuple(torchvision.models.list_models(module=torchvision.models))
    import timm  # deferred: timm, imported only when a zoo model is named

    return tuple(timm.list_models())


def zoo_name_problem(name: str) -> str | None:
    """Why ``name`` names no zoo model (an empty name, a name its zoo does not have, the zoo not installed, with a
    close match when there is one), or ``None`` when it does."""
    prefix, arch = split_zoo_name(name)
    zoo = prefix[:-1]
    if not arch:
        example = "resnet18" if prefix == TORCHVISION_PREFIX else "convnext_atto"
        return f"{name!r} needs a {zoo} model name, e.g. '{prefix}{example}'"
    try:
        names = zoo_names(prefix)
        if prefix == TIMM_PREFIX:
            import timm  # deferred: timm (see zoo_names)

            known = timm.is_model(arch)
        else:
            known = arch in names
    except ImportError as exc:
        return f"{name!r} needs the {zoo} package, which cannot be imported: {exc}"
    if known:
        return None
    close = difflib.get_close_matches(arch, list(names), n=1, cutoff=0.6)
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
    what = "classification model builder" if prefix == TORCHVISION_PREFIX else "model"
    return f"{name!r}: {zoo} has no {what} {arch!r}{hint}"


def input_problem(name: str, input_shape: tuple[int, ...]) -> str | None:
    """Why zoo model ``name`` cannot take inputs of ``input_shape`` (zoo models are image models: ``(C, H, W)``),
    or ``None``."""
    if len(tuple(input_shape)) != 3:
        return (f"{name!r} is an image model and takes (channels, height, width) inputs, not "
                f"{tuple(input_shape)} (flat features or 1-D signals); use an image dataset or one of fedfuse's "
                "own models")
    return None


def _first_conv(model: nn.Module) -> tuple[str, nn.Conv2d] | None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return name, module
    return None


def _set_in_channels(model: nn.Module, channels: int, name: str) -> None:
    """Replace ``model``'s first ``Conv2d`` by one with ``channels`` input channels (see the module docstring)."""
    import torch

    found = _first_conv(model)
    if found is None:
        raise ValueError(f"model: {name!r} has no Conv2d to take {channels}-channel inputs")
    path, conv = found
    if conv.in_channels == channels:
        return
    if conv.groups != 1:
        raise ValueError(f"model: {name!r}'s first convolution {path!r} is grouped ({conv.groups} groups); cannot "
                         f"give it {channels} input channels")
    new = nn.Conv2d(channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
                    dilation=conv.dilation, bias=conv.bias is not None, padding_mode=conv.padding_mode,
                    device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():   # the builder's own initialisation, its first input channels (cycled past them)
        idx = torch.arange(channels, device=conv.weight.device) % conv.in_channels
        new.weight.copy_(conv.weight[:, idx])
        if conv.bias is not None:
            new.bias.copy_(conv.bias)
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _upsampled(h: int, w: int) -> tuple[int, int]:
    return max(h, MIN_SIDE), max(w, MIN_SIDE)


def _torchvision(arch: str, num_classes: int, input_shape: tuple[int, int, int]) -> nn.Module:
    import torchvision.models  # deferred: torchvision (see zoo_names)

    c, h, w = input_shape
    size = _upsampled(h, w)
    kw = dict(TORCHVISION_EXTRA.get(arch, {}))
    if arch.startswith("vit_"):   # torchvision's VisionTransformer is built for one image size
        if size[0] != size[1]:
            raise ValueError(f"model: 'torchvision:{arch}' takes square images, not {h}x{w}")
        kw["image_size"] = size[0]
    model = torchvision.models.get_model_builder(arch)(weights=None, num_classes=num_classes, **kw)
    _set_in_channels(model, c, f"torchvision:{arch}")
    return model if size == (h, w) else Resized(model, size)


def _timm(arch: str, num_classes: int, input_shape: tuple[int, int, int]) -> nn.Module:
    import timm  # deferred: timm (see zoo_names)
    from timm.models import get_arch_name, model_entrypoint

    c, h, w = input_shape
    kw: dict = {"pretrained": False, "num_classes": num_classes, "in_chans": c}
    if model_entrypoint(get_arch_name(arch)).__module__ in TIMM_VIT_MODULES:
        kw["img_size"] = (h, w)
        if max(h, w) <= SMALL_SIDE:
            kw["patch_size"] = PATCH
        return timm.create_model(arch, **kw)
    size = _upsampled(h, w)
    if _fixed_input_size(arch):   # built for one image size (Swin, BEiT, MLP-Mixer, ...): the size it will see
        kw["img_size"] = size
    model = timm.create_model(arch, **kw)
    return model if size == (h, w) else Resized(model, size)


def _fixed_input_size(arch: str) -> bool:
    """Whether timm's model ``arch`` is built for one input size (its pretrained config's ``fixed_input_size``:
    ViTs, Swin, BEiT, MLP-Mixer, ...), so that it takes ``img_size``."""
    from timm.models import get_pretrained_cfg  # deferred: timm (see zoo_names)

    try:
        cfg = get_pretrained_cfg(arch)
    except (RuntimeError, KeyError, ValueError):   # no pretrained config registered: a size-agnostic default
        return False
    return bool(getattr(cfg, "fixed_input_size", False))


def build_zoo(name: str, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """Zoo model ``name`` (``torchvision:<builder>`` | ``timm:<model>``), randomly initialised from the global torch
    RNG, with ``num_classes`` logits for inputs of ``input_shape`` ``(C, H, W)`` (see the module docstring).
    ``ValueError`` (starting ``model:``) for an unknown name or inputs it cannot take."""
    problem = zoo_name_problem(name) or input_problem(name, input_shape)
    if problem:
        raise ValueError(f"model: {problem}")
    prefix, arch = split_zoo_name(name)
    shape = tuple(int(s) for s in input_shape)
    if prefix == TORCHVISION_PREFIX:
        return _torchvision(arch, num_classes, shape)
    return _timm(arch, num_classes, shape)


__all__ = ["Resized", "build_zoo", "input_problem", "is_zoo_name", "split_zoo_name", "zoo_name_problem", "zoo_names",
           "MIN_SIDE", "SMALL_SIDE", "PATCH"]
