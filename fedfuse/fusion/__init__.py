"""Model fusion methods behind one entry point.

    fused = fuse(method, models, fusion_inputs=X, scores=None, weights=None, device="cpu", seed=0, **options)
    small = fuse("kf-linear", models, fusion_inputs=X, target=build_model("mlp", ..., width_mult=0.5))
    result = fuse_result(method, models, ...)        # FusionResult(method, model, info, seconds)

Each module of this package registers its methods with ``@register("name", options=Options, ...)``
(``fedfuse.fusion.registry``); every submodule is imported when the package is, so ``METHODS`` /
``METHOD_SPECS`` always list all of them. ``fuse`` validates the inputs and the options the same way for
every method (unknown option or wrong type → ``FusionOptionError``, a ``ValueError`` naming it), then calls
``fn(models, *, fusion_inputs, scores, weights, device, seed, options, info)`` with ``weights`` normalised
to sum to 1, ``scores`` ``None`` or one ``{level name: [width] tensor}`` dict per model, ``device`` a
``torch.device``, ``options`` the parsed options dataclass and ``info`` a dict for diagnostics. Before the
call ``fuse`` checks the setup against the method's capabilities (``MethodSpec.check_setup`` with the
models' adapter family, whether all their levels are affine, the number of models and the fusion set);
after it, that the fused weights are finite (``NumericalFusionError`` naming the first bad entry) and, with a
fusion set, that its outputs there are finite and not collapsed to one class while the models' ensemble spreads its
predictions (``fedfuse.fusion.output_checks``: a ``RuntimeWarning`` and ``info["collapse-warning"]``).
Inputs are never modified; every failure a method reports is a ``FusionError``
(``fedfuse.fusion.registry``, all ``ValueError``s). Diagnostics come one way: ``fuse_result(...).info``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import pkgutil
import time
from typing import Any, Mapping

import torch
from torch import nn

from fedfuse.fusion.registry import (METHOD_SPECS, METHODS, same_architecture, FusionError, FusionOptionError, FusionResult,
                                     IncompatibleModelsError, MethodSpec, MissingInputError, NoOptions,
                                     NumericalFusionError, get_spec, methods_with, option_table, parse_options, register)
from fedfuse.fusion.output_checks import (OUTPUT_CHECK_SAMPLES, all_finite, check_teacher_outputs, collapse_warning,
                                          nonfinite_outputs, outputs_on, teacher_predictions)
from fedfuse.fusion.refine import DistillRefineOptions, parse_refine, refine_model
from fedfuse.models import levels, model_family
from fedfuse.models.adapters import set_example_input
from fedfuse.training import resolve_device


def normalise_weights(weights, n: int) -> list[float]:
    """Per-model weights → non-negative floats summing to 1 (uniform when ``None``)."""
    if weights is None:
        return [1.0 / n] * n
    w = [float(v) for v in weights]
    if len(w) != n:
        raise FusionOptionError(f"fuse: got {len(w)} weights for {n} models")
    if any(v < 0 or v != v for v in w) or sum(w) <= 0:
        raise FusionOptionError(f"fuse: weights must be non-negative with a positive sum, got {w}")
    total = sum(w)
    return [v / total for v in w]


def model_setup(models: list[nn.Module]) -> tuple[str | None, bool | None, str | None]:
    """``(family, affine_levels, problem)`` of ``models``: the adapter family of model 0, whether every
    fusion level of every model is affine, and why the models cannot be decomposed (``None`` if they
    can; family and affine_levels are then ``None`` where unknown)."""
    try:
        family = model_family(models[0])
    except ValueError as exc:  # UnsupportedModelError: no adapter describes this model type
        return None, None, f"model 0: {exc}"
    ref = models[0].state_dict()
    for i, m in enumerate(models[1:], 1):
        try:
            fam = model_family(m)
        except ValueError as exc:
            return family, None, f"model {i}: {exc}"
        if fam != family:
            return family, None, f"model {i} is a {fam!r} model and model 0 a {family!r} one"
        for k, v in m.state_dict().items():   # the same layer kinds where the models share a layer (e.g. no
            if k in ref and v.dim() != ref[k].dim():   # Linear where model 0 has a Conv)
                return family, None, (f"model {i}'s {k!r} is a {v.dim()}-d tensor and model 0's a {ref[k].dim()}-d "
                                      f"one: the models have different layer types")
    try:
        affine = all(lv.affine for m in models for lv in levels(m))
    except ValueError as exc:
        return family, None, str(exc)
    return family, affine, None


def fresh_copy(model: nn.Module, seed: int) -> nn.Module:
    """A copy of ``model``'s architecture with freshly initialised weights (seeded; its modules'
    ``reset_parameters``, bare parameters such as a ViT's ``pos_embed`` N(0, 0.02²)); the global RNG is
    left untouched. ``fuse(..., target=)`` ignores the target's weights this way."""
    out = copy.deepcopy(model).cpu()
    owned: set[int] = set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for mod in out.modules():
            if hasattr(mod, "reset_parameters") and any(True for _ in mod.parameters(recurse=False)):
                mod.reset_parameters()
                owned.update(id(p) for p in mod.parameters(recurse=False))
        with torch.no_grad():
            for p in out.parameters():
                if id(p) not in owned and p.is_floating_point():
                    p.normal_(0.0, 0.02)
    return out


def resolve_target(spec: MethodSpec, models: list[nn.Module], target: nn.Module | None, seed: int) -> nn.Module | None:
    """The module a method with ``any_target`` builds into: ``None`` when ``target`` is ``None`` or has model
    0's architecture (the default), else a fresh copy of ``target``. A method that cannot produce another
    architecture raises ``IncompatibleModelsError`` (a ``ValueError``) saying so."""
    if target is None:
        return None
    if not isinstance(target, nn.Module):
        raise IncompatibleModelsError(f"fuse: target must be an nn.Module (the architecture to produce), got "
                                      f"{type(target).__name__}")
    if same_architecture(target, models[0]):
        return None
    if not spec.any_target:
        able = methods_with("any_target")
        raise IncompatibleModelsError(f"fusion method {spec.name!r} cannot produce another architecture than model "
                                      f"0's (target= is a {type(target).__name__} with other shapes); methods that "
                                      f"can: {able}")
    try:
        same_family = model_family(target) == model_family(models[0])
    except ValueError:
        same_family = type(target) is type(models[0])
    if not same_family and not spec.any_module:
        raise IncompatibleModelsError(f"fusion method {spec.name!r}: target is a {type(target).__name__}, not the "
                                      f"models' family ({type(models[0]).__name__})")
    return fresh_copy(target, seed)


def resolve_reference(spec: MethodSpec, models: list[nn.Module], reference: nn.Module | None) -> nn.Module | None:
    """The model every model is aligned onto (``fuse(..., reference=)``), checked: ``None`` when not given; an
    ``nn.Module`` of model 0's architecture for a method with ``any_reference``; anything else raises
    ``IncompatibleModelsError`` (a ``ValueError``) saying why."""
    if reference is None:
        return None
    if not spec.any_reference:
        able = methods_with("any_reference")
        raise IncompatibleModelsError(f"fusion method {spec.name!r} does not align to a separate reference model "
                                      f"(reference=); methods that do: {able}")
    if not isinstance(reference, nn.Module) or not same_architecture(reference, models[0]):
        what = type(reference).__name__ if not isinstance(reference, nn.Module) else "a module of other shapes"
        raise IncompatibleModelsError(f"fuse: reference must be a model of model 0's architecture (the units to "
                                      f"align onto), got {what}")
    return reference


def check_finite(method: str, model: nn.Module) -> None:
    """Raise ``NumericalFusionError`` naming the first state entry with a NaN or an infinity."""
    for name, value in model.state_dict().items():
        if value.is_floating_point() and not all_finite(value):
            raise NumericalFusionError(f"fusion method {method!r} produced non-finite values in {name!r} "
                                       f"({int((~torch.isfinite(value)).sum())} of {value.numel()} entries)")


def check_materialised(models: list[nn.Module], what: str = "model") -> None:
    """Every model's weights hold values: a tensor on the ``meta`` device (shapes only: a model built under
    ``torch.device('meta')``, or loaded lazily and never filled) has none to fuse; ``IncompatibleModelsError`` (a
    ``ValueError``) naming the model and the first such entry, rather than a torch error from deep inside a method."""
    for i, m in enumerate(models):
        bad = next((k for k, v in m.state_dict().items() if v.is_meta), None)
        if bad is not None:
            name = f"model {i}" if what == "model" else what
            raise IncompatibleModelsError(f"fuse: {name}'s {bad!r} is on the 'meta' device (a shape without values: "
                                          "a model built under torch.device('meta') or never loaded); give it its "
                                          "weights first, e.g. model.to_empty(device='cpu') then "
                                          "model.load_state_dict(state)")


def check_dtypes(models: list[nn.Module]) -> None:
    """Every model's floating-point weights in one dtype (``IncompatibleModelsError`` naming the odd model)."""
    def dtype(m: nn.Module):
        return next((t.dtype for t in m.state_dict().values() if t.is_floating_point()), None)

    d0 = dtype(models[0])
    for i, m in enumerate(models[1:], 1):
        if dtype(m) != d0:
            raise IncompatibleModelsError(f"fuse: model {i}'s weights are {dtype(m)} and model 0's {d0}; convert them "
                                          f"to one dtype first (e.g. model.float())")


_NEUTRAL_LAYERS = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def check_same_layers(models: list[nn.Module]) -> None:
    """A parameter-free layer of one name is of one kind in every model (``IncompatibleModelsError`` naming the first
    that is not: model 1's ``Tanh`` where model 0 has a ``ReLU``). The state dicts cannot tell such models apart, so a
    method that merges weights or reads the structure from model 0 would fuse model 1 as if it computed model 0's
    function, silently. Identity and dropout layers may stand for each other (a removed block, inference)."""
    def kinds(m: nn.Module) -> dict[str, type]:
        return {n: type(x) for n, x in m.named_modules()
                if n and next(x.children(), None) is None and next(x.parameters(recurse=False), None) is None
                and next(x.buffers(recurse=False), None) is None and not isinstance(x, _NEUTRAL_LAYERS)}

    k0 = kinds(models[0])
    for i, m in enumerate(models[1:], 1):
        for name, kind in kinds(m).items():
            if name in k0 and k0[name] is not kind:
                raise IncompatibleModelsError(
                    f"fuse: model {i} has a {kind.__name__} at {name!r} where model 0 has a {k0[name].__name__}: the "
                    "models compute different functions with the same weights' shapes; fuse models of one "
                    "architecture, or distil them (kd, ensemble), which reads only their outputs")


def check_fusion_inputs(model: nn.Module, fusion_inputs: torch.Tensor, reads_outputs: bool = False) -> None:
    """The fusion set must be a floating-point tensor that model 0 can take (a forward pass of two samples on a copy,
    so the model's BatchNorm statistics stay untouched); ``MissingInputError`` saying why otherwise. With
    ``reads_outputs`` (a method that reads the models' outputs) the output must be one logits tensor ``[B, classes]``
    (``IncompatibleModelsError`` naming what it is: a tuple of heads, a dict)."""
    if not isinstance(fusion_inputs, torch.Tensor) or not fusion_inputs.is_floating_point():
        what = fusion_inputs.dtype if isinstance(fusion_inputs, torch.Tensor) else type(fusion_inputs).__name__
        raise MissingInputError(f"fuse: fusion_inputs must be a floating-point tensor [B, *input_shape], got {what}")
    bad = int((~torch.isfinite(fusion_inputs)).sum())
    if bad:
        raise MissingInputError(f"fuse: fusion_inputs has NaN or infinite values ({bad} of {fusion_inputs.numel()} "
                                f"entries)")
    probe = copy.deepcopy(model).eval()
    first = next((t for t in probe.state_dict().values() if t.is_floating_point()), None)
    x = fusion_inputs[:2]
    if first is not None:
        x = x.to(device=first.device, dtype=first.dtype)
    try:
        with torch.no_grad():
            out = probe(x)
    except (RuntimeError, ValueError, IndexError) as exc:
        raise MissingInputError(f"fuse: model 0 cannot take fusion_inputs of shape {list(fusion_inputs.shape)} "
                                f"(samples of shape {list(fusion_inputs.shape[1:])}): {str(exc).splitlines()[0]}") from None
    if reads_outputs and not (isinstance(out, torch.Tensor) and out.dim() == 2):
        what = (f"a {out.dim()}-d tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor)
                else f"a {type(out).__name__}")
        raise IncompatibleModelsError(f"fuse: model 0 returns {what}, not one logits tensor [batch, classes]; this "
                                      "method reads the models' outputs: wrap the model so that its forward returns "
                                      "the classification logits")


def check_scores(models: list[nn.Module], scores: list[dict[str, torch.Tensor] | None]) -> None:
    """Importance scores must name the models' fusion levels (``fedfuse.models.levels``) with one finite, non-negative
    value per unit; a level a dict leaves out is scored uniformly by the method. ``FusionOptionError`` naming the model, the
    key and the valid levels otherwise (silently ignoring a misspelled key would fuse with uniform scores)."""
    for i, (m, sc) in enumerate(zip(models, scores)):
        if sc is None:
            continue
        if not isinstance(sc, dict):
            raise FusionOptionError(f"fuse: scores[{i}] must be a dict level name -> [width] tensor, got "
                                    f"{type(sc).__name__}")
        widths = {lv.name: lv.width for lv in levels(m)}
        for key, v in sc.items():
            if key not in widths:
                raise FusionOptionError(f"fuse: scores[{i}] has level {key!r}, which model {i} does not have; its "
                                        f"levels are {list(widths)}")
            t = torch.as_tensor(v)
            if t.numel() != widths[key]:
                raise FusionOptionError(f"fuse: scores[{i}][{key!r}] has {t.numel()} values for the level's "
                                        f"{widths[key]} units")
            if not bool(torch.isfinite(t).all()):
                raise FusionOptionError(f"fuse: scores[{i}][{key!r}] has NaN or infinite values")
            if bool((t < 0).any()):   # the reply path rejects them too (fedfuse.flower.round.replies)
                raise FusionOptionError(f"fuse: scores[{i}][{key!r}] has {int((t < 0).sum())} negative value(s) "
                                        f"(min {float(t.min()):.3g}); importance scores are non-negative (an "
                                        f"attribution's magnitude, e.g. neuron_importance's output)")


def normalise_scores(scores: list[dict[str, torch.Tensor] | None] | None
                     ) -> list[dict[str, torch.Tensor] | None] | None:
    """Each model's importance scores divided, level by level, by their mean (zero levels stay zero).

    What a model's scores say is which of *its* units matter; how much the model itself matters is its ``weights``
    entry (its sample count in a federation). Dividing by the mean keeps uniform scores at 1 (so every method's
    uniform-score result is unchanged) and makes every method invariant to a client multiplying its scores by any
    factor: a client that inflates its scores can only move its own say among its own units, never take more of it
    (``docs/trust.md``)."""
    if scores is None:
        return None
    out: list[dict[str, torch.Tensor] | None] = []
    for sc in scores:
        if sc is None:
            out.append(None)
            continue
        normed = {}
        for key, v in sc.items():
            t = torch.as_tensor(v).detach()
            t = t.float() if not t.is_floating_point() else t
            scale = t.clamp_min(0).mean()
            normed[key] = t / scale if bool(scale > 0) else t
        out.append(normed)
    return out


@contextlib.contextmanager
def _inputs_kept(models: list[nn.Module]):
    """Restore every input model's device, train/eval flags (of each submodule) and ``requires_grad`` flags after the
    method ran: fusion methods put models in eval mode and move them to the fusion device to read their activations,
    methods that train copy them (so the copies of frozen parameters are made trainable here), and ``fuse`` must
    leave its inputs as it got them."""
    flags = [[(mod, mod.training) for mod in m.modules()] for m in models]
    devices = [next((t.device for t in m.state_dict().values()), None) for m in models]
    # frozen parameters (``requires_grad_(False)``) would make the copies a method trains frozen too
    grads = [[(q, q.requires_grad) for q in m.parameters() if not q.is_inference()] for m in models]
    for gr in grads:
        for q, _ in gr:
            q.requires_grad_(True)
    try:
        yield
    finally:
        for m, fl, dev, gr in zip(models, flags, devices, grads):
            for mod, training in fl:
                mod.training = training
            for q, wanted in gr:
                q.requires_grad_(wanted)
            if dev is not None and any(t.device != dev for t in m.state_dict().values()):
                m.to(dev)


def unwrapped(model: Any) -> Any:
    """The module a wrapper runs: ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``), ``nn.DataParallel`` and
    ``DistributedDataParallel`` (``module``), however nested; anything else as it is. ``fuse`` fuses the modules
    themselves (the wrappers prefix every parameter name and hide the structure) and returns a plain module."""
    while True:
        if isinstance(model, nn.Module) and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


def _trainable(model: Any) -> Any:
    """``model``, or a copy of it when its weights are inference tensors (a model built or loaded under
    ``torch.inference_mode()``): those cannot take part in a computation that is differentiated, which the methods
    that train around frozen models (FS-Merge) do; the copy made outside inference mode holds ordinary tensors."""
    if isinstance(model, nn.Module) and any(t.is_inference() for t in model.state_dict().values()):
        return copy.deepcopy(model)
    return model


def _with_gradients(fn):
    """Run ``fn`` with gradients on whatever the caller's mode (``torch.no_grad()``, ``torch.inference_mode()``): the
    methods that train (distillation, the gradient variants, FS-Merge, ``refine``) need them."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            return fn(*args, **kwargs)
    return run


@_with_gradients
def fuse_result(method: str, models: list[nn.Module], fusion_inputs: torch.Tensor | None = None,
                scores: list[dict[str, torch.Tensor]] | None = None, weights=None,
                device: str | torch.device = "cpu", seed: int = 0, *, refine: str | None = None,
                prior: torch.Tensor | None = None, target: nn.Module | None = None,
                reference: nn.Module | None = None, statistics: list[dict[str, torch.Tensor]] | None = None,
                refine_options: DistillRefineOptions | Mapping[str, Any] | None = None,
                **options) -> FusionResult:
    """Like ``fuse`` but returns a ``FusionResult`` (model + the method's diagnostics ``info`` + seconds). Runs with
    gradients on, whatever the caller's mode (``_with_gradients``); wrapped models are fused as the modules they wrap
    (``unwrapped``)."""
    if isinstance(fusion_inputs, torch.Tensor) and fusion_inputs.is_inference():
        fusion_inputs = fusion_inputs.clone()   # an inference tensor cannot be saved for backward
    models = [_trainable(unwrapped(m)) for m in models]
    target, reference = unwrapped(target), unwrapped(reference)
    try:
        steps = parse_refine(refine)
    except ValueError as exc:
        raise FusionOptionError(f"fuse: {exc}") from None
    distill_options = refine_distill_options(refine_options, steps)
    if steps and (fusion_inputs is None or len(fusion_inputs) == 0):
        raise MissingInputError(f"fuse: refine={refine!r} needs fusion_inputs (the unlabeled fusion set)")
    spec = get_spec(method)
    models = list(models)
    if not models:
        raise IncompatibleModelsError("fuse: no models given")
    for i, m in enumerate(models):
        if not isinstance(m, nn.Module):
            raise IncompatibleModelsError(f"fuse: model {i} is a {type(m).__name__}, not an nn.Module")
    if scores is not None and len(scores) != len(models):
        raise FusionOptionError(f"fuse: got {len(scores)} score dicts for {len(models)} models")
    statistics = check_statistics(spec, statistics, len(models))
    if fusion_inputs is not None and len(fusion_inputs) == 0:
        fusion_inputs = None  # an empty fusion set is no fusion set
    opts = spec.parse_options(options)
    check_materialised(models)
    if isinstance(reference, nn.Module):
        check_materialised([reference], "reference")
    check_dtypes(models)
    if not (spec.any_module and spec.mixed_widths):   # kd, ensemble and stack read each model on its own
        check_same_layers(models)
    for i, m in enumerate(models):   # a NaN teacher would otherwise be distilled for every epoch, silently
        bad = next((k for k, v in m.state_dict().items()
                    if v.is_floating_point() and not all_finite(v)), None)
        if bad is not None:
            raise NumericalFusionError(f"fuse: model {i} has non-finite values in {bad!r}; fusing it cannot give a "
                                       f"finite model (method {method!r})")
    if fusion_inputs is not None and isinstance(fusion_inputs, torch.Tensor):
        for m in models + [t for t in (target, reference) if isinstance(t, nn.Module)]:
            set_example_input(m, fusion_inputs)   # the generic structure reader traces the models on it
    family, affine, problem = model_setup(models)
    if problem is not None and not spec.any_module:
        raise IncompatibleModelsError(f"fusion method {method!r} decomposes the models into fusion levels "
                                      f"({list(spec.families)} families) and cannot take these: {problem}")
    spec.check_setup(num_models=len(models), family=family,
                     has_fusion_set=fusion_inputs is not None or not spec.needs_data or statistics is not None,
                     affine_levels=affine)
    ensemble = None   # the models' ensemble's class per checked fusion-set sample, for the collapse check
    if fusion_inputs is not None:
        check_fusion_inputs(models[0], fusion_inputs, reads_outputs=spec.needs_data or "distill" in steps)
        if spec.needs_data or "distill" in steps:   # methods that read the models' outputs on the fusion set
            ensemble = teacher_predictions(method, models, fusion_inputs, normalise_weights(weights, len(models)))
    if scores is not None and spec.uses_scores and problem is None:
        check_scores(models, scores)
        scores = normalise_scores(scores)
    skeleton = resolve_target(spec, models, target, seed)
    extra = {"target": skeleton} if spec.any_target else {}
    anchor = resolve_reference(spec, models, reference)
    if anchor is not None:
        extra["reference"] = anchor
    if spec.statistics:
        extra["statistics"] = statistics
    dev = resolve_device(device)
    info: dict = {}
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), \
            _inputs_kept(models + ([anchor] if anchor is not None else [])):
        torch.manual_seed(seed)
        try:
            fused = spec.fn(models, fusion_inputs=fusion_inputs, scores=scores,
                            weights=normalise_weights(weights, len(models)), device=dev, seed=seed, options=opts,
                            info=info, **extra)
        except torch.linalg.LinAlgError as exc:
            # ill-conditioned inputs (e.g. near-identical neurons in an eigen/least-squares step) are a numerical
            # failure of this fusion, not a bug: the caller (a strategy) falls back and says so
            raise NumericalFusionError(f"fuse: method {method!r}: linear algebra failed: {exc}") from exc
    fused = fused.cpu().eval()
    check_finite(method, fused)
    if steps:
        info["refine"] = "+".join(steps)
        # copies: distillation moves its teachers to the device, and the inputs stay untouched
        teachers = [copy.deepcopy(m).to(dev) for m in models] if "distill" in steps else None
        info.update(refine_model(fused.to(dev), steps, teachers=teachers, weights=normalise_weights(weights, len(models)),
                                 fusion_inputs=fusion_inputs, prior=prior, distill_options=distill_options, seed=seed,
                                 device=dev))
        fused = fused.cpu().eval()
        check_finite(f"{method} (refined)", fused)
    if fusion_inputs is not None:
        bad, probs = outputs_on(fused, fusion_inputs)
        if bad:
            raise NumericalFusionError(f"fusion method {method!r} produced a model with finite weights that maps {bad} "
                                       f"of {min(len(fusion_inputs), OUTPUT_CHECK_SAMPLES)} fusion-set samples to "
                                       "non-finite logits")
        collapse_warning(method, probs, ensemble, info)   # finite but one class for (almost) every input: loud
    return FusionResult(method=method, model=fused, info=info, seconds=time.perf_counter() - t0)


def fuse(method: str, models: list[nn.Module], fusion_inputs: torch.Tensor | None = None,
         scores: list[dict[str, torch.Tensor]] | None = None, weights=None, device: str | torch.device = "cpu",
         seed: int = 0, *, refine: str | None = None, prior: torch.Tensor | None = None,
         target: nn.Module | None = None, reference: nn.Module | None = None,
         statistics: list[dict[str, torch.Tensor]] | None = None,
         refine_options: DistillRefineOptions | Mapping[str, Any] | None = None, **options) -> nn.Module:
    """Fuse ``models`` (first = reference) into one model mapping ``[N, *input_shape]`` to logits.

    Args:
        method: a name in ``METHODS``.
        models: trained models of one family; not modified.
        fusion_inputs: unlabeled server fusion set ``[B, *input_shape]`` (ignored by data-free methods).
        scores: optional per-model importance dicts (``fedfuse.importance.neuron_importance`` output); each level's
            vector is divided by its mean first (``normalise_scores``), so only their relative sizes within a
            model count and scaling one model's scores changes nothing.
        weights: optional per-model weights (e.g. sample counts), normalised here.
        device: where the fusion computation runs (``"auto"`` picks CUDA when present).
        seed: seeds every random choice of the method.
        refine: optional post-fusion refinement on ``fusion_inputs`` (``fedfuse.fusion.refine``):
            ``"calibrate"`` (classifier bias moved to the class ``prior``), ``"distill"`` (FedDF's
            ensemble distillation of ``models`` into the fused model, early-stopped, never worse on the
            held-out KL than the fused model), or both joined by ``"+"``, applied in order; ``None``/``"none"``.
        prior: ``[classes]`` target class distribution of ``"calibrate"`` (default uniform).
        refine_options: the ``"distill"`` step's options (``DistillRefineOptions`` or a dict of its fields: epochs,
            lr, temperature, patience, augmentation, ...); ``None`` = its defaults. Given without ``"distill"`` in
            ``refine``, ``FusionOptionError``.
        target: the architecture of the fused model (its weights are ignored), e.g. a narrower or wider
            capacity tier of the models' family (``build_model(..., width_mult=r)``); ``None`` or a module
            of model 0's architecture = model 0's. Methods with the ``any_target`` capability
            (``kf-linear``, ``kf-gradient``, ``kd``) build into it; any other method raises
            ``IncompatibleModelsError`` (a ``ValueError``) saying that it cannot.
        reference: a model of model 0's architecture that every model is aligned onto and that is not itself
            averaged in (methods with ``any_reference``: ``rebasin``, ``ot``); ``None`` = model 0. In a
            federation this is the previous global model: after long local training the clients' units drift
            apart, and the global model is the one coordinate system they all started from.
        statistics: for methods that read per-model statistics (``METHOD_SPECS[method].statistics``: ``regmean``'s
            input Gram matrices, ``fisher``'s diagonal Fisher), one dict per model, each computed by its client on
            its own data with ``client_statistics(method, model, inputs, labels)``; they stand in for the fusion
            set. ``None``: such a method computes them on the fusion set through each model (its public-data
            variant, with a warning). Any other method raises ``FusionOptionError`` when given statistics.
        **options: the method's options (``METHOD_SPECS[method].options``); unknown or ill-typed options
            raise ``FusionOptionError`` (a ``ValueError``) naming the key.
    Returns:
        A new ``nn.Module`` on CPU in eval mode.
    Raises:
        FusionError (a ``ValueError``) when the method cannot fuse these models or inputs.
    """
    return fuse_result(method, models, fusion_inputs=fusion_inputs, scores=scores, weights=weights, device=device,
                       seed=seed, refine=refine, prior=prior, target=target, reference=reference,
                       statistics=statistics, refine_options=refine_options, **options).model


def refine_distill_options(options: DistillRefineOptions | Mapping[str, Any] | None,
                           steps: tuple[str, ...]) -> DistillRefineOptions:
    """``fuse``'s ``refine_options`` checked: a ``DistillRefineOptions``, or a dict of its fields parsed into one
    (unknown or ill-typed keys raise ``FusionOptionError`` naming the key); only with ``"distill"`` in ``steps``."""
    if options is None:
        return DistillRefineOptions()
    if "distill" not in steps:
        raise FusionOptionError(f"fuse: refine_options are the 'distill' step's, but refine is "
                                f"{'+'.join(steps) or 'none'!r}")
    return parse_options("distill", DistillRefineOptions, options, what="fuse: refine_options")


def check_statistics(spec: MethodSpec, statistics, num_models: int) -> list[dict[str, torch.Tensor]] | None:
    """``statistics`` checked against the method: ``None``, or one ``{name: tensor}`` dict per model for a method that
    reads them (``spec.statistics``); ``FusionOptionError`` (a ``ValueError``) saying why otherwise. The method itself
    checks the names and shapes against its models."""
    if statistics is None:
        return None
    if not spec.statistics:
        able = methods_with("statistics")
        raise FusionOptionError(f"fusion method {spec.name!r} reads no per-model statistics (statistics=); methods "
                                f"that do: {able}")
    statistics = list(statistics)
    if len(statistics) != num_models:
        raise FusionOptionError(f"fuse: got {len(statistics)} statistics dicts for {num_models} models")
    for i, st in enumerate(statistics):
        if not isinstance(st, dict) or not all(isinstance(v, torch.Tensor) for v in st.values()):
            raise FusionOptionError(f"fuse: statistics[{i}] must be a dict name -> tensor (what "
                                    f"client_statistics({spec.name!r}, ...) returns), got {type(st).__name__}")
        bad = next((k for k, v in st.items() if not v.is_floating_point() or not all_finite(v)), None)
        if bad is not None:
            raise FusionOptionError(f"fuse: statistics[{i}][{bad!r}] is not a finite floating-point tensor")
    return statistics


def client_statistics(method: str, model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor | None = None, *,
                      device: str | torch.device = "cpu", **kwargs) -> dict[str, torch.Tensor]:
    """The statistics a client computes on its own data ``inputs [N, *input_shape]`` (``labels [N]`` where the
    method's statistic can use them) for a fusion method that reads them (``METHOD_SPECS[method].statistics``): e.g.
    ``regmean``'s per-layer input Gram matrices, ``fisher``'s diagonal Fisher. The client sends them with its weights
    (one upload); the server passes one per model to ``fuse(method, models, statistics=[...])``. ``model`` is not
    modified. ``FusionOptionError`` (a ``ValueError``) for a method that reads none."""
    spec = get_spec(method)
    if spec.client_statistics is None:
        able = methods_with("client_statistics")
        raise FusionOptionError(f"fusion method {method!r} reads no client statistics; methods that do: {able}")
    return spec.client_statistics(model, inputs, labels, device=resolve_device(device), **kwargs)


def _import_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name != "registry":
            importlib.import_module(f"{__name__}.{info.name}")


_import_all()

__all__ = ["fuse", "fuse_result", "client_statistics", "check_statistics", "model_setup", "check_finite", "same_architecture", "fresh_copy", "resolve_target", "resolve_reference", "METHODS", "METHOD_SPECS", "MethodSpec", "register", "get_spec", "methods_with", "option_table",
           "normalise_weights", "normalise_scores", "check_materialised", "check_dtypes", "check_fusion_inputs", "check_scores", "check_teacher_outputs", "nonfinite_outputs", "NoOptions", "FusionResult", "FusionError", "FusionOptionError",
           "IncompatibleModelsError", "MissingInputError", "NumericalFusionError"]
