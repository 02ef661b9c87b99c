"""Fusion-method registry: typed options, capabilities, one error family, one diagnostics record.

Every fusion method is registered once with ``@register(name, options=OptionsClass, ...)``:

- ``OptionsClass`` is a frozen dataclass whose fields (type hints + defaults) *are* the method's option
  schema, as a timm constructor's signature is its config. ``MethodSpec.parse_options`` validates a plain
  ``dict`` against it the same way for every method: an unknown key or a wrong type raises
  ``FusionOptionError`` (a ``ValueError``) naming the key, the valid keys and a close match.
- Capability flags say what a method can take (number of models, model families, different widths,
  another target architecture, data, scores), so the run config can be checked before any client trains
  (``MethodSpec.check_setup``) and the strategy knows what to ask clients for.
- A method function has the signature
  ``fn(models, *, fusion_inputs, scores, weights, device, seed, options, info) -> nn.Module`` where
  ``options`` is the parsed dataclass instance and ``info`` a dict the method fills with diagnostics
  (losses, timings, chosen settings). That dict is the only diagnostics channel: ``fuse_result`` returns
  it in a ``FusionResult``; nothing is kept on function attributes or printed.

Errors: every failure a fusion method can report is a ``FusionError`` (subclass of ``ValueError``, so
``except ValueError`` in users' code keeps working). The Flower strategy falls back (loudly) only on
this family; any other exception is a bug and fails the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from torch import nn


# ----------------------------------------------------------------------------------------------- errors
class FusionError(ValueError):
    """Base of every error a fusion method reports (the strategy's fallback catches only this family)."""


class FusionOptionError(FusionError):
    """An unknown option, a wrong type or a value outside the allowed set; the message names the key."""


class IncompatibleModelsError(FusionError):
    """The method cannot take these models (family, widths, depth, number of models, layer kinds)."""


def same_architecture(a, b) -> bool:
    """Same module type and the same state-dict names and shapes."""
    if type(a) is not type(b):
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(sa[k].shape == sb[k].shape for k in sa)


def require_same_architecture(models, method: str, why: str) -> None:
    """``IncompatibleModelsError`` naming the first model whose architecture is not model 0's (``why``: what the
    method does parameter by parameter that needs it)."""
    for i, m in enumerate(models[1:], 1):
        if not same_architecture(models[0], m):
            raise IncompatibleModelsError(f"{method}: model {i} has another architecture than model 0 ({why})")


class MissingInputError(FusionError):
    """The method needs an input that was not given (fusion set, importance scores, class counts)."""


class NumericalFusionError(FusionError):
    """The computation broke down (non-finite weights, singular system, diverged optimisation)."""


# ----------------------------------------------------------------------------------------- result record
@dataclass
class FusionResult:
    """What one fusion produced: the fused ``model`` (CPU, eval mode), the method's diagnostics ``info``
    (plain, JSON-friendly values) and the wall-clock ``seconds`` the call took."""

    method: str
    model: nn.Module
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class NoOptions:
    """Options of a method that has none."""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits type hint ``tp``; returns ``(ok, coerced value)`` (int → float, list → tuple)."""
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp)
    if origin is Literal:  # exact type too: True must not pass as the choice 1
        return any(type(value) is type(a) and value == a for a in typing.get_args(tp)), value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v = _matches(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin is tuple and isinstance(value, list):  # a TOML / JSON array for a tuple option
        value = tuple(value)
    if origin is not None:  # list[int], dict[str, Any], tuple[...]: container type only
        return isinstance(value, origin), value
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


def parse_options(method: str, cls: type, options: Mapping[str, Any] | None, *, what: str | None = None) -> Any:
    """Validate ``options`` against the frozen dataclass ``cls`` and return an instance.

    Keys may use ``-`` or ``_``. Raises ``FusionOptionError`` naming the key on an unknown key (with the
    valid keys and a close match) or a value of the wrong type / outside a ``Literal``'s choices.
    ``what`` replaces ``fusion method '<method>'`` at the start of messages (nested option tables). An instance
    of ``cls`` (options validated before) is returned as it is.
    """
    if isinstance(options, cls):   # already validated (a typed options object): trusted as it is
        return options
    what = what or f"fusion method {method!r}"
    if options is not None and not isinstance(options, Mapping):
        raise FusionOptionError(f"{what}: options must be a table of key = value, got {options!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    values: dict[str, Any] = {}
    for key, value in dict(options or {}).items():
        name = str(key).replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            valid = ", ".join(names) if names else "none"
            raise FusionOptionError(f"{what}: unknown option {key!r}{hint}; valid options: {valid}")
        ok, coerced = _matches(value, hints[name])
        if not ok:
            raise FusionOptionError(f"{what}: option {key!r} must be {_type_name(hints[name])}, got {value!r}")
        values[name] = coerced
    try:
        opts = cls(**values)
    except (TypeError, ValueError) as exc:  # __post_init__ range checks raise ValueError naming the option
        if isinstance(exc, FusionOptionError):
            raise
        raise FusionOptionError(f"{what}: {exc}") from None
    return opts


def require(ok: bool, option: str, requirement: str, value: Any) -> None:
    """Range check for an options dataclass's ``__post_init__``: ``ValueError`` naming ``option`` unless
    ``ok`` (``parse_options`` turns it into a ``FusionOptionError`` with the method's name)."""
    if not ok:
        raise ValueError(f"option {option!r} must be {requirement}, got {value!r}")


def option_table(cls: type) -> list[tuple[str, str, Any]]:
    """``[(name, type, default)]`` of an options dataclass (for docs and ``--help`` listings)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        out.append((f.name, _type_name(hints[f.name]), default))
    return out


# -------------------------------------------------------------------------------------------- registry
FusionFn = Callable[..., nn.Module]
FAMILIES = ("sequential", "resnet", "vit", "torchvision-resnet", "graph")


@dataclass(frozen=True)
class MethodSpec:
    """A registered fusion method: its function, option schema and capabilities.

    Attributes:
        name: registry name (``fuse(name, ...)``).
        fn: ``fn(models, *, fusion_inputs, scores, weights, device, seed, options, info) -> nn.Module``.
        options: frozen dataclass of the method's options (``NoOptions`` when it has none).
        needs_data: uses ``fusion_inputs`` (the server fusion set); ``fuse`` raises without one.
        uses_scores: uses per-model importance scores (clients are asked to send them).
        same_architecture: the result has the global architecture, so it can be a round's aggregation.
        min_models / max_models: how many models it takes (``None`` = no upper bound).
        families: model families it supports (``fedfuse.models`` adapters: sequential, resnet, vit).
        mixed_widths: can fuse models of different widths.
        any_target: can produce another architecture of the family (``fuse(..., target=...)``); its
            function then also takes ``target=`` (``None`` = model 0's architecture, else a freshly
            initialised module of the architecture to produce, owned by the method).
        affine_only: needs every fusion level to be affine (closed-form fits); ``False`` when it
            handles blocks (residual / transformer).
        any_module: also takes models outside ``families`` (any ``nn.Module`` mapping inputs to logits):
            the method never decomposes the models (averaging, ensembling, distillation).
        any_reference: aligns every model onto a reference model that is not itself fused
            (``fuse(..., reference=)``; its function then also takes ``reference=``, ``None`` = model 0 is the
            reference and is averaged in): in a federation, the previous global model.
        statistics: the kind of per-model statistics the method reads (``fuse(..., statistics=)``: one per model,
            computed by each client on its own data), e.g. ``"gram"`` (RegMean) or ``"fisher"`` (Fisher merging);
            ``None`` = none. Its function then also takes ``statistics=`` (``None`` when not given: the method
            computes them on the fusion set, its public-data variant), and given statistics stand in for the
            fusion set (``needs_data``).
        client_statistics: ``f(model, inputs, labels=None, *, device, **kw) -> dict[str, Tensor]``, the function a
            client calls on its own data to compute ``statistics`` (``fedfuse.fusion.client_statistics``).
    """

    name: str
    fn: FusionFn
    options: type = NoOptions
    needs_data: bool = True
    uses_scores: bool = False
    same_architecture: bool = True
    min_models: int = 1
    max_models: int | None = None
    families: tuple[str, ...] = FAMILIES
    mixed_widths: bool = False
    any_target: bool = False
    affine_only: bool = False
    any_module: bool = False
    any_reference: bool = False
    paper: str = ""
    statistics: str | None = None
    client_statistics: Callable | None = None

    def parse_options(self, options: Mapping[str, Any] | None) -> Any:
        """Validated options instance (raises ``FusionOptionError`` naming the key)."""
        return parse_options(self.name, self.options, options)

    def reads_client_scores(self, options: Mapping[str, Any] | None = None) -> bool:
        """Whether ``fuse`` reads the ``scores`` argument under ``options`` (so a federation should have its
        clients compute and send them): ``uses_scores``, narrowed by the options' own
        ``reads_client_scores()`` when they define one (e.g. OT only with ``marginals="importance"``)."""
        if not self.uses_scores:
            return False
        check = getattr(self.parse_options(options), "reads_client_scores", None)
        return bool(check()) if callable(check) else True

    def check_setup(self, *, num_models: int, family: str | None = None, has_fusion_set: bool = True,
                    affine_levels: bool | None = None) -> None:
        """Raise ``IncompatibleModelsError`` / ``MissingInputError`` if the method cannot run on this setup.

        Used by the run-config check (before any client trains) and by ``fuse`` itself.
        """
        if num_models < self.min_models:
            raise IncompatibleModelsError(f"fusion method {self.name!r} needs at least {self.min_models} models, "
                                          f"got {num_models}")
        if self.max_models is not None and num_models > self.max_models:
            raise IncompatibleModelsError(f"fusion method {self.name!r} takes at most {self.max_models} models, "
                                          f"got {num_models}")
        if family is not None and family not in self.families:
            why = (": it fits affine levels in closed form, and these models have block levels (residual/"
                   "transformer blocks); use a gradient variant") if self.affine_only else ""
            raise IncompatibleModelsError(f"fusion method {self.name!r} does not support {family!r} models "
                                          f"(supports {list(self.families)}){why}")
        if self.needs_data and not has_fusion_set:
            raise MissingInputError(f"fusion method {self.name!r} needs a fusion set (fusion_inputs)")
        if self.affine_only and affine_levels is False:
            raise IncompatibleModelsError(f"fusion method {self.name!r} fits affine levels in closed form and "
                                          "cannot fuse models with block levels (residual/transformer blocks); "
                                          "use a gradient variant")



METHOD_SPECS: dict[str, MethodSpec] = {}
METHODS: dict[str, FusionFn] = {}  # name -> function (public API: ``name in METHODS``)


def register(name: str, *, options: type = NoOptions, **capabilities: Any) -> Callable[[FusionFn], FusionFn]:
    """Decorator registering a fusion function under ``name`` with its options dataclass and capabilities
    (keyword arguments = ``MethodSpec`` fields). The function is called as
    ``fn(models, *, fusion_inputs, scores, weights, device, seed, options, info)``.
    """
    if not (dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"register({name!r}): options must be a frozen dataclass, got {options!r}")

    def deco(fn: FusionFn) -> FusionFn:
        if name in METHODS and METHODS[name] is not fn:
            raise RuntimeError(f"fusion method {name!r} registered twice")
        spec = MethodSpec(name=name, fn=fn, options=options, **capabilities)
        # read-only mirrors of the capabilities for code that inspects METHODS[name] directly
        fn.needs_data = spec.needs_data  # type: ignore[attr-defined]
        fn.uses_scores = spec.uses_scores  # type: ignore[attr-defined]
        fn.same_architecture = spec.same_architecture  # type: ignore[attr-defined]
        METHOD_SPECS[name] = spec
        METHODS[name] = fn
        return fn
    return deco


def get_spec(method: str) -> MethodSpec:
    """The ``MethodSpec`` of ``method``; ``FusionOptionError`` with a close match for an unknown name."""
    if method not in METHOD_SPECS:
        close = difflib.get_close_matches(method, list(METHOD_SPECS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise FusionOptionError(f"unknown fusion method {method!r}{hint}; choose one of {sorted(METHOD_SPECS)}")
    return METHOD_SPECS[method]


def methods_with(capability: str) -> list[str]:
    """The registered methods whose ``MethodSpec`` has ``capability`` (``any_reference``, ``statistics``, ...), sorted:
    the list an error names when a method lacks it."""
    return sorted(n for n, s in METHOD_SPECS.items() if getattr(s, capability))


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # .../fedfuse


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside the ``fedfuse`` package (the user's ``fuse(...)`` line, a
    strategy's call), however deep inside fedfuse it is raised: a fixed ``stacklevel`` points into fedfuse whenever a
    wrapper adds a frame (Python 3.12's ``skip_file_prefixes``, for 3.11)."""
    level, frame = 2, sys._getframe(1)   # stacklevel 2: the caller of warn_caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


__all__ = ["FusionError", "FusionOptionError", "IncompatibleModelsError", "MissingInputError",
           "NumericalFusionError", "FusionResult", "NoOptions", "MethodSpec", "METHOD_SPECS", "METHODS",
           "register", "get_spec", "methods_with", "parse_options", "option_table", "require", "FAMILIES", "warn_caller"]
