"""The generic structure reader: any PyTorch classifier's fusion structure read from its own graph.

Alignment fusion needs three things from a model (``../shared/specs/any-model.md``): which hidden units may be
permuted and which tensor axes move with each unit (the *permutation groups*), in which order the model is built
from levels that map one tensor to the next (the *fusion levels* that neuron interpolation walks), and where its
classifier and its features are. ``GraphAdapter`` reads them from one example forward pass, once per architecture:

- **permutation groups** from Torch-Pruning's ``DependencyGraph`` ("DepGraph: Towards Any Structural Pruning",
  Fang et al., CVPR 2023, arXiv 2301.12900): each of its pruning groups is exactly the set of (layer, channel)
  couplings that one hidden unit touches (linear / conv outputs, the norms after them, the next layers' inputs,
  through ``flatten`` / ``view`` with the spatial block each channel owns, residual additions across the whole
  stream, depthwise convolutions, squeeze-excitation gates, layer scale and other bare parameters). Each group's
  index mapping says which positions of which axis belong to which unit; this module turns them into the
  :class:`~fedfuse.models.adapters.permspec.PermSpec` every matching method reads. Activation matching reads a
  group's units at the output of every norm that writes them (a residual stream: its start and every block's
  branch), not at one of them, which can be all zeros (``_activation_sites``).
- **fusion levels** from ``torch.fx``: the traced graph is cut wherever exactly one input-dependent tensor is live;
  a cut right after a Linear / Conv (+ the BatchNorm on its output) ends an *affine* level (closed-form neuron
  interpolation), any other stretch of parameterised ops (a residual block, a norm) a *block* level, whose output
  is hooked at the module that returns it.
- **the classifier**: the last Linear, whose output reaches the model's output through parameter-free ops only.

What the reader cannot describe is refused with one :class:`UnsupportedModelError` naming the module or operation:
data-dependent control flow (fx cannot trace it: mark the module a leaf or give fedfuse a traceable model), a
grouped convolution's coupled channels, a channel concatenation, a parameterised module of an unknown kind.

The example input: fedfuse's ``fuse`` records the fusion set's sample shape for the models it is given
(:func:`set_example_input` does it by hand); otherwise the shape is read off the first layer (a Linear's
``in_features``; a convolution's channels at 32 × 32).
"""

from __future__ import annotations

import operator
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from fedfuse.models.adapters.base import AFFINE_LAYERS, Adapter, Level, ModelConfig, UnsupportedModelError
from fedfuse.models.adapters.depgraph import RunawayGroup, bounded_groups
from fedfuse.models.adapters.graph_tiers import narrowed
from fedfuse.models.adapters.permspec import Axis, Entry, Group, PermSpec

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
_PURE_BN = (nn.BatchNorm1d, nn.BatchNorm2d)
_LEAVES = (nn.Linear, nn.modules.conv._ConvNd, *_NORMS, nn.Embedding, nn.PReLU, nn.MultiheadAttention)
_EXAMPLES: "weakref.WeakKeyDictionary[nn.Module, tuple[int, ...]]" = weakref.WeakKeyDictionary()
_CACHE: dict[tuple, "Structure"] = {}
INPUT_SITE = ":input"   # a level output read as the input of the module that takes it (no module returns it)


def set_example_input(model: nn.Module, inputs: torch.Tensor | tuple[int, ...]) -> None:
    """Record the shape of one input sample of ``model`` (``inputs`` ``[N, *shape]`` or ``shape`` itself); the
    reader traces the model on it. ``fedfuse.fusion.fuse`` does this with the fusion set."""
    shape = tuple(inputs) if isinstance(inputs, (tuple, list, torch.Size)) else tuple(inputs.shape[1:])
    _EXAMPLES[model] = tuple(int(s) for s in shape)


def _guess_shape(model: nn.Module) -> tuple[int, ...]:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            return (m.in_features,)
        if isinstance(m, nn.Conv1d):
            return (m.in_channels, 64)
        if isinstance(m, nn.Conv2d):
            return (m.in_channels, 32, 32)
        if isinstance(m, nn.Conv3d):
            return (m.in_channels, 16, 16, 16)
    raise UnsupportedModelError(f"graph reader: {type(model).__name__} has no Linear/Conv layer to read the input "
                                "shape from; call fedfuse.models.set_example_input(model, x) first")


_LAST_SHAPE: dict[tuple, tuple[int, ...]] = {}   # architecture → the sample shape it was last read with


def _arch_key(model: nn.Module) -> tuple:
    return (type(model).__module__, type(model).__qualname__,
            tuple((k, tuple(v.shape)) for k, v in model.state_dict().items()))


def example_shape(model: nn.Module) -> tuple[int, ...]:
    """The sample shape the reader traces ``model`` with: recorded for it (``set_example_input``), else the one its
    architecture was last read with (copies of a recorded model), else read off the first layer."""
    shape = _EXAMPLES.get(model)
    if shape is None:
        shape = _LAST_SHAPE.get(_arch_key(model))
    return shape or _guess_shape(model)


class _Tracer(fx.Tracer):
    """fx's tracer with norms kept whole (timm's ``BatchNormAct2d``, torchvision's ``LayerNorm2d`` are subclasses)
    and the module being traced remembered, so that a failure names it."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        # subclasses of torch's layers too (timm's Linear, BatchNormAct2d; torchvision's LayerNorm2d): one module
        # call each, so that its parameters stay the module's
        return isinstance(m, _LEAVES) or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.where.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.where.pop()


def _trace(model: nn.Module) -> fx.Graph:
    tracer = _Tracer()
    try:
        return tracer.trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, AttributeError ... for untraceable code
        where = tracer.where[-1] if tracer.where else "the model's own forward"
        raise UnsupportedModelError(
            f"graph reader: torch.fx cannot trace {type(model).__name__} (in {where!r}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}); data-dependent control flow is the usual cause: make that module "
            "a leaf (register it with torch.fx.wrap / keep the branch out of forward) or fuse with a method that "
            "does not read the structure (average, feddf, kd)") from None


# --------------------------------------------------------------------------------------------- the structure
@dataclass
class LevelPlan:
    """One fusion level, as node positions of the traced graph (bound to a model by :meth:`Structure.levels`)."""

    name: str
    kind: str
    layout: str
    width: int
    start: int            # first node index (after the previous level's output node)
    end: int              # index of the output node
    module: str           # path of the module whose output is the level output
    layer: str | None = None
    norm: str | None = None
    pre_end: int | None = None   # for affine levels: index of the layer node (pre = start .. pre_end - 1)
    modules: list[str] = field(default_factory=list)   # modules called in the level (their parameters)
    attrs: list[str] = field(default_factory=list)     # bare parameters read in the level


@dataclass
class Structure:
    """What the reader found in one architecture (shared by every model with its state-dict shapes)."""

    graph: fx.Graph
    nodes: list[fx.Node]
    spec: PermSpec
    plans: list[LevelPlan]
    classifier: str
    sites: dict[str, list[tuple[str, str]]]   # group → [(module path, layout)]: where its activations are read

    def levels(self, model: nn.Module) -> list[Level]:
        mods = dict(model.named_modules())
        out = []
        for p in self.plans:
            params = [f"{m}.{n}" if m else n for m in p.modules for n, _ in mods[m].named_parameters()] + list(p.attrs)
            last = len(self.nodes) - 2
            run = _segment(self.nodes, p.start, last if p.kind == "classifier" else p.end, model)
            # the layer's own input, not the last node before it: a traced forward may put calls that return
            # nothing there (timm's PatchEmbed asserts the input size between its input and its projection)
            pre = (_segment(self.nodes, p.start, p.pre_end - 1, model, out=_input_of(self.nodes[p.pre_end]))
                   if p.pre_end is not None else None)
            if pre is not None and p.pre_end == p.start:
                pre = _identity
            path, _, site = p.module.partition(":")
            out.append(Level(name=p.name, width=p.width, kind=p.kind, layout=p.layout, module=mods[path], run=run,
                             module_input=bool(site),
                             param_names=params, layer=mods[p.layer] if p.layer else None,
                             norm=mods[p.norm] if p.norm else None, pre=pre,
                             post=_segment(self.nodes, p.end + 1, last, model)
                             if p.kind == "classifier" and p.end < last else None))
        return out


def _identity(h: torch.Tensor) -> torch.Tensor:
    return h


def _fetch(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _input_of(node: fx.Node) -> Any:
    """The input argument of a layer's call node (its first positional argument, else ``input=``)."""
    return node.args[0] if node.args else node.kwargs.get("input")


def _segment(nodes: list[fx.Node], start: int, end: int, model: nn.Module,
             out: Any = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``h ↦`` the value of node ``end`` (of ``out``, a node of the segment or its input, when given) given ``h`` as
    the value of node ``start - 1`` (the previous cut; the placeholder for the first level). Nodes that do not depend
    on the input (parameters, constants) are evaluated when used."""
    inside = nodes[start:end + 1]
    given = nodes[start - 1]
    # an in-place op in the segment (an ``inplace=True`` activation after the previous cut, ``x.relu_()``) would
    # overwrite the caller's tensor: a level's input is run many times (gradient fits), so the segment gets a copy
    copies = any(getattr(model.get_submodule(n.target), "inplace", False) if n.op == "call_module" else
                 bool(n.kwargs.get("inplace")) if n.op == "call_function" else
                 n.op == "call_method" and str(n.target).endswith("_") for n in inside)

    def run(h: torch.Tensor) -> torch.Tensor:
        env: dict[fx.Node, Any] = {given: h.clone() if copies else h}

        def value(a):
            return fx.node.map_arg(a, lambda n: env[n] if n in env else _const(n))

        def _const(n: fx.Node):
            v = _eval(n, value, model)
            env[n] = v
            return v

        for n in inside:
            env[n] = _eval(n, value, model)
        return env[nodes[end]] if out is None else value(out)
    return run


def _eval(n: fx.Node, value, model: nn.Module):
    if n.op == "get_attr":
        return _fetch(model, n.target)
    args, kwargs = value(n.args), value(n.kwargs)
    if n.op == "call_module":
        return model.get_submodule(n.target)(*args, **kwargs)
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    if n.op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    raise UnsupportedModelError(f"graph reader: node {n.name} ({n.op}) cannot be evaluated inside a level")


def structure(model: nn.Module) -> Structure:
    """The :class:`Structure` of ``model``'s architecture (traced once per class, state-dict shapes and input
    shape; ``UnsupportedModelError`` naming the part it cannot read)."""
    shape = example_shape(model)
    arch = _arch_key(model)
    key = (arch, shape)
    _LAST_SHAPE[arch] = shape
    if key not in _CACHE:
        if len(_CACHE) > 64:
            _CACHE.clear()
        try:
            _CACHE[key] = _read(model, shape)
        except UnsupportedModelError:
            raise
        except MemoryError:
            raise
        except Exception as exc:   # the reader's own inconsistency on an architecture it misreads: one clear error
            if "can't allocate memory" in str(exc) or "out of memory" in str(exc):
                raise
            raise UnsupportedModelError(
                f"graph reader: could not read {type(model).__name__}'s structure ({type(exc).__name__}: "
                f"{str(exc)[:160]}); the dependency graph misreads one of its operations (e.g. a Linear applied "
                "across tokens after a transpose: token-mixing MLPs); fuse it with a method that reads no structure: "
                "average, feddf or kd") from None
    return _CACHE[key]


def _read(model: nn.Module, shape: tuple[int, ...]) -> Structure:
    graph = _trace(model)
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise UnsupportedModelError(f"graph reader: {type(model).__name__}.forward takes {len(placeholders)} inputs; "
                                    "the reader needs a model of one input tensor")
    first = next(model.parameters(), None)
    dev, dtype = (first.device, first.dtype) if first is not None else (torch.device("cpu"), torch.float32)
    x = torch.randn(2, *shape, generator=torch.Generator().manual_seed(0)).to(dev, dtype)
    values, calls = _probe(model, nodes, x)
    out_node = nodes[-1]
    if not isinstance(values.get(out_node.args[0]), torch.Tensor) or values[out_node.args[0]].dim() != 2:
        raise UnsupportedModelError(f"graph reader: {type(model).__name__} must return one logits tensor [N, classes]")
    classifier = _classifier(model, nodes)
    plans = _plan_levels(model, nodes, values, calls, classifier)
    spec, sites = _perm_spec(model, x, classifier, values, nodes, calls)
    del values   # every node's value on the example: not needed past here, and _verify wants the memory
    _verify(model, spec, x)
    by_layer = {p.layer: p.name for p in plans if p.layer} | {p.norm: p.name for p in plans if p.norm}
    for g in spec.groups.values():
        g.acts = [(path, "out", lay) for path, lay in sites[g.name]]
        g.levels = sorted({by_layer[m] for m in _out_modules(spec, g.name) if m in by_layer})
    return Structure(graph, nodes, spec, plans, classifier, sites)


@torch.no_grad()
def _probe(model: nn.Module, nodes: list[fx.Node], x: torch.Tensor):
    """Node values on one example (the fx graph run node by node) and how often each module is called."""
    was = model.training
    model.eval()
    calls: dict[str, int] = {}
    for n in nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    values: dict[fx.Node, Any] = {}
    try:
        for n in nodes:
            if n.op == "placeholder":
                values[n] = x
            elif n.op == "output":
                continue
            else:
                v = _eval(n, lambda a: fx.node.map_arg(a, lambda m: values[m]), model)
                # copies, so that an in-place op later in the graph leaves this node's value as it was computed
                values[n] = v.clone() if isinstance(v, torch.Tensor) and n.op != "get_attr" else v
    except Exception as exc:
        raise UnsupportedModelError(f"graph reader: running {type(model).__name__}'s traced graph on an input of shape "
                                    f"{tuple(x.shape[1:])} failed at node {n.name!r} ({type(exc).__name__}: "
                                    f"{str(exc)[:160]}); give the input shape with fusion_inputs= or "
                                    "fedfuse.models.set_example_input(model, x)") from None
    finally:
        model.train(was)
    return values, calls


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _param_node(model: nn.Module, n: fx.Node) -> bool:
    if n.op == "call_module":
        return _has_params(model.get_submodule(n.target))
    if n.op == "get_attr":
        return isinstance(_fetch(model, n.target), nn.Parameter)
    return False


def _classifier(model: nn.Module, nodes: list[fx.Node]) -> str:
    """The Linear whose output reaches the output through parameter-free, single-input ops."""
    n = nodes[-1].args[0]
    while isinstance(n, fx.Node):
        if n.op == "call_module":
            m = model.get_submodule(n.target)
            if isinstance(m, nn.Linear):
                return n.target
            if _has_params(m):
                break
        elif n.op == "get_attr":
            break
        ins = [a for a in n.all_input_nodes if a.op != "get_attr"]
        if len(ins) != 1:
            break
        n = ins[0]
    raise UnsupportedModelError(f"graph reader: {type(model).__name__}'s output is not a Linear classifier's (through "
                                "parameter-free ops); fusion needs the class layer to align the features before it")


# -------------------------------------------------------------------------------------------------- levels
def _plan_levels(model, nodes, values, calls, classifier) -> list[LevelPlan]:
    idx = {n: i for i, n in enumerate(nodes)}
    inp = nodes[0]
    dep = {inp}
    for n in nodes[1:]:
        if any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    last_use = {n: max((idx[u] for u in n.users), default=idx[n]) for n in nodes}
    cut = [False] * len(nodes)
    live: set[fx.Node] = {inp}
    for i, n in enumerate(nodes[:-1]):
        if n in dep:
            live.add(n)
        live = {m for m in live if last_use[m] > i}
        cut[i] = i > 0 and live == {n} and isinstance(values.get(n), torch.Tensor)
    param = [i for i, n in enumerate(nodes) if n in dep and _param_node(model, n)
             or (n.op == "call_function" and any(a.op == "get_attr" and _param_node(model, a) for a in n.all_input_nodes))]
    hooks = _module_outputs(model, nodes, values, calls)
    plans: list[LevelPlan] = []
    start, pi = 1, 0
    last_node = len(nodes) - 2   # the node before "output"
    while pi < len(param):
        p = param[pi]
        n = nodes[p]
        mod = model.get_submodule(n.target) if n.op == "call_module" else None
        end = None
        if _affine_start(model, nodes, p, cut):
            end, norm = p, None
            users = list(n.users)
            if len(users) == 1 and users[0].op == "call_module" and idx[users[0]] == p + 1 and cut[p + 1] \
                    and type(model.get_submodule(users[0].target)) in _PURE_BN:
                end, norm = p + 1, users[0].target
            if n.target == classifier:
                plans.append(_affine_plan(model, nodes, values, start, p, end, n.target, norm, calls, "classifier"))
                if any(q > end for q in param):
                    raise UnsupportedModelError(f"graph reader: parameterised ops follow the classifier {classifier!r}")
                return plans
            plans.append(_affine_plan(model, nodes, values, start, p, end, n.target, norm, calls, "affine"))
        else:
            # a block: up to the first cut whose value a module returns (one residual block, one norm) before
            # the next affine level's layer; where there is none, the block takes in that layer too
            after = p
            while end is None:
                nxt = next((q for q in param if q > after and _affine_start(model, nodes, q, cut)), None)
                limit = (nxt - 1) if nxt is not None else last_node
                end = next((c for c in range(p, limit + 1) if cut[c] and c in hooks), None)
                if end is None and nxt is None:
                    raise UnsupportedModelError(
                        f"graph reader: no module returns the output of the block that starts at node {n.name!r}; "
                        "levels need a module to hook")
                if nxt is not None and nodes[nxt].target == classifier and end is None:
                    raise UnsupportedModelError(
                        f"graph reader: the block before the classifier {classifier!r} (from node {n.name!r}) ends "
                        "at no module's output; levels need a module to hook")
                after = nxt if nxt is not None else after
            mods = sorted({nodes[i].target for i in range(start, end + 1) if nodes[i].op == "call_module"
                           and _has_params(model.get_submodule(nodes[i].target))})
            attrs = sorted({nodes[i].target for i in range(start, end + 1) if nodes[i].op == "get_attr"
                            and _param_node(model, nodes[i])})
            v = values[nodes[end]]
            last_mod = next((model.get_submodule(nodes[i].target) for i in range(end, start - 1, -1)
                             if nodes[i].op == "call_module"), None)
            layout = _layout(v, last_mod)
            plans.append(LevelPlan(name=hooks[end], kind="block", layout=layout, width=_width(v, layout),
                                   start=start, end=end, module=hooks[end], modules=mods, attrs=attrs))
        start = end + 1
        pi = next((k for k, q in enumerate(param) if q > end), len(param))
    raise UnsupportedModelError(f"graph reader: {type(model).__name__} ends without reaching its classifier")


def _affine_start(model, nodes, q, cut) -> bool:
    """Node ``q`` is a Linear / Conv with a closed form (``groups=1``, zero padding given in numbers) that ends a cut."""
    n = nodes[q]
    if n.op != "call_module" or not cut[q]:
        return False
    return closed_form(model.get_submodule(n.target))


def closed_form(m: nn.Module) -> bool:
    """A Linear, or a Conv1d/2d computing exactly its own ``F.conv`` (not overridden, e.g. timm's dynamic "same"
    padding), with ``groups=1`` and zero padding given in numbers: its output is a design matrix times its weights."""
    if isinstance(m, nn.Linear):
        return True
    if not isinstance(m, (nn.Conv1d, nn.Conv2d)) or type(m).forward is not (
            nn.Conv1d.forward if isinstance(m, nn.Conv1d) else nn.Conv2d.forward):
        return False
    return m.groups == 1 and not isinstance(m.padding, str) and m.padding_mode == "zeros"


def _affine_plan(model, nodes, values, start, p, end, layer, norm, calls, kind) -> LevelPlan:
    for i in range(start, p):
        if _param_node(model, nodes[i]):
            raise UnsupportedModelError(f"graph reader: parameterised op {nodes[i].name!r} before {layer!r}")
    m = model.get_submodule(layer)
    width = m.out_features if isinstance(m, nn.Linear) else m.out_channels
    v = values[nodes[end]]
    layout = "flat" if isinstance(m, nn.Linear) and v.dim() == 2 else ("tokens" if isinstance(m, nn.Linear) else "channels")
    mods = [layer] + ([norm] if norm else [])
    return LevelPlan(name=norm or layer, kind=kind, layout=layout, width=width, start=start, end=end,
                     module=norm or layer, layer=layer, norm=norm, pre_end=p, modules=mods)


def _layout(v: torch.Tensor, last: nn.Module | None) -> str:
    """Where a block level's units sit: ``[N, W]`` flat; ``[N, T, W]`` tokens unless a channels-first 1-d layer
    made it; ``[N, W, H, ...]`` channels unless a channels-last layer (Linear, LayerNorm) made it."""
    if v.dim() == 2:
        return "flat"
    channels_last = isinstance(last, nn.Linear) or type(last) is nn.LayerNorm
    if v.dim() == 3:
        return "channels" if isinstance(last, (nn.Conv1d, nn.BatchNorm1d, nn.MaxPool1d, nn.AvgPool1d)) else "tokens"
    return "tokens" if channels_last else "channels"


def _width(v: torch.Tensor, layout: str) -> int:
    return int(v.shape[1] if layout == "channels" else v.shape[-1])


def _module_outputs(model, nodes, values, calls) -> dict[int, str]:
    """Node index → path of a module called once whose forward returns that node's value (checked on the probe)."""
    out: dict[int, str] = {}
    outputs = None
    for i, n in enumerate(nodes):
        v = values.get(n)
        if not isinstance(v, torch.Tensor):
            continue
        if n.op == "call_module" and calls.get(n.target, 0) == 1:
            out[i] = n.target
            continue
        stack = list(n.meta.get("nn_module_stack", {}).keys())
        for path in reversed(stack):
            if not path or calls.get(path, 1) > 1:
                continue
            later = nodes[i + 1] if i + 1 < len(nodes) else None
            if later is not None and path in later.meta.get("nn_module_stack", {}):
                continue   # the module goes on after this node
            if outputs is None:
                outputs = _all_module_outputs(model, values[nodes[0]])
            got = outputs.get(path)
            if got is not None and got.shape == v.shape and torch.allclose(got, v, atol=1e-6, rtol=1e-5):
                out[i] = path
                break
        if i not in out:   # else a module called once that takes this value as its first input
            u = next((u for u in n.users if u.op == "call_module" and calls.get(u.target, 0) == 1
                      and u.args and u.args[0] is n), None)
            if u is not None:
                out[i] = f"{u.target}{INPUT_SITE}"
    return out


@torch.no_grad()
def _all_module_outputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every module's output on ``x`` (one forward pass, the model's own), for modules called once."""
    box: dict[str, list] = {}
    hs = [m.register_forward_hook(lambda _m, _i, o, p=p: box.setdefault(p, []).append(
        o.detach().clone() if isinstance(o, torch.Tensor) else o))   # copies: in-place activations follow
          for p, m in model.named_modules() if p]
    was = model.training
    model.eval()
    try:
        model(x)
    finally:
        for h in hs:
            h.remove()
        model.train(was)
    return {p: v[0] for p, v in box.items() if len(v) == 1 and isinstance(v[0], torch.Tensor)}


# --------------------------------------------------------------------------------------- permutation groups
def _out_modules(spec: PermSpec, group: str) -> list[str]:
    return [e.name.rsplit(".", 1)[0] for e, ax in spec.entries_of(group) if ax.role == "out"]


def _param_axes(mod: nn.Module, out: bool) -> list[tuple[str, int]]:
    """``(parameter or buffer name, axis)`` pairs that a module's out / in channels index."""
    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return [("weight", 0), ("bias", 0)] if out else [("weight", 1)]
    if isinstance(mod, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return [("weight", 1), ("bias", 0)] if out else [("weight", 0)]
    if isinstance(mod, nn.Linear):
        return [("weight", 0), ("bias", 0)] if out else [("weight", 1)]
    if isinstance(mod, _NORMS):
        return [(k, 0) for k in ("weight", "bias", "running_mean", "running_var")]
    if isinstance(mod, nn.PReLU):
        return [("weight", 0)] if mod.num_parameters > 1 else []
    if isinstance(mod, nn.Embedding):
        return [("weight", 1)]
    if not _has_params(mod):
        return []
    raise UnsupportedModelError(f"graph reader: {type(mod).__name__} layers are not known to the reader (which of "
                                "their axes a unit indexes); fuse with average, feddf or kd, or make it a Linear/Conv")


def _dependency_groups(model: nn.Module, x: torch.Tensor, cls: nn.Module):
    """Torch-Pruning's ``DependencyGraph`` of ``model`` on ``x`` and its pruning groups (the classifier's outputs
    ignored); ``UnsupportedModelError`` when the graph cannot be built or its group search runs away."""
    import torch_pruning as tp

    was = model.training
    model.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            DG = tp.DependencyGraph().build_dependency(model, example_inputs=x)
            with bounded_groups(model, DG):
                return DG, list(DG.get_all_groups(ignored_layers=[cls]))
    except RunawayGroup as exc:
        raise UnsupportedModelError(
            f"graph reader: Torch-Pruning's dependency search runs away on {type(model).__name__} ({exc}): its index "
            "mappings through this model's reshapes (window or head-split attention) multiply the units without end; "
            "fuse it with average, feddf or kd, which need no alignment") from None
    except Exception as exc:
        raise UnsupportedModelError(f"graph reader: Torch-Pruning's dependency graph failed on {type(model).__name__} "
                                    f"({type(exc).__name__}: {str(exc)[:200]})") from None
    finally:
        model.train(was)


def _read_group(grp, DG, names, pnames, unwrapped, state, values, nodes, calls, call_at, size: int):
    """One pruning group's tensor axes ``[(tensor, axis, role, idxs, roots)]`` and activation sites, or the reason it
    cannot be permuted (``(touched, sites, bad)``; ``bad`` is ``None`` for a describable group)."""
    touched: list[tuple[str, int, str, list[int], list[int]]] = []
    norm_sites: list[tuple[str, str]] = []
    affine_sites: list[tuple[str, str]] = []
    for it in grp.items:
        target = it.dep.target.module
        handler = it.dep.handler
        is_out = DG.is_out_channel_pruning_fn(handler)
        if not is_out and not DG.is_in_channel_pruning_fn(handler):
            continue
        idxs, roots = list(it.idxs), list(getattr(it, "root_idxs", it.idxs))
        if any(r is None for r in roots):
            return touched, [], f"{names.get(target, '?')} (an index mapping without root units)"
        if isinstance(target, nn.Parameter):
            pname = pnames.get(id(target))
            if pname is None or id(target) not in unwrapped:
                return touched, [], "a bare parameter the reader cannot name"
            touched.append((pname, unwrapped[id(target)], "out", idxs, roots))
            continue
        if not isinstance(target, nn.Module) or target not in names:
            continue
        mname = names[target]
        if isinstance(target, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and target.groups > 1:
            if not target.groups == target.in_channels == target.out_channels:
                return touched, [], f"grouped convolution {mname!r} (groups={target.groups})"
            if not is_out:
                continue   # a depthwise conv's inputs are its outputs (the out handler moves them)
        if isinstance(target, nn.MultiheadAttention):
            return touched, [], f"nn.MultiheadAttention {mname!r}"
        for pn, ax in _param_axes(target, is_out):
            full = f"{mname}.{pn}" if mname else pn
            if full in state and state[full] is not None and state[full].dim() > ax:
                touched.append((full, ax, "out" if is_out else "in", idxs, roots))
        if is_out and calls.get(mname, 0) == 1 and isinstance(target, (*AFFINE_LAYERS, *_NORMS)):
            v = values.get(next((n for n in nodes if n.op == "call_module" and n.target == mname), None))
            if isinstance(v, torch.Tensor):
                lay = _site_layout(target, v, size)
                if lay is not None:
                    (norm_sites if isinstance(target, _NORMS) else affine_sites).append((mname, lay))
    for full, ax, _, idxs, _ in touched:   # an index map past a tensor's axis: an operation the graph misread
        n_ax = state[full].shape[ax] if full in state else 0
        if idxs and max(idxs) >= n_ax:
            return touched, [], (f"{full} (its axis {ax} has {n_ax} positions, the dependency graph maps "
                                 f"{max(idxs) + 1}: an operation it misreads, e.g. a Linear across tokens)")
    site = _activation_sites(norm_sites, affine_sites, call_at)
    return touched, site, None if site else "no module output to read its units' activations at"


def _split_tensors(axes: dict, state: dict) -> tuple[dict, dict]:
    """Every grouped tensor as ``(shape, axes)`` and the concatenations: one raw axis holding the units of several
    groups, each in its own slice, is split there into parts (``name@start:stop``), each part a tensor of its own
    (``split_state`` / ``join_state``); returns ``(tensors, splits)``."""
    tensors: dict[str, tuple[tuple[int, ...], list]] = {}
    splits: dict[str, tuple[int, list[tuple[str, int, int]]]] = {}
    for tname, lst in axes.items():
        shape = tuple(state[tname].shape)
        parted = _split_axis(shape, lst)
        if parted is None:
            tensors[tname] = (shape, lst)
            continue
        axis, parts = parted
        splits[tname] = (axis, [(f"{tname}@{lo}:{hi}", lo, hi) for lo, hi, _ in parts])
        for lo, hi, members in parts:
            pshape = shape[:axis] + (hi - lo,) + shape[axis + 1:]
            others = [t for t in lst if t[0] != axis]
            mine = [(axis, g, role, [i - lo for i in idxs], roots) for g, role, idxs, roots in members]
            tensors[f"{tname}@{lo}:{hi}"] = (pshape, others + mine)
    return tensors, splits


def _describe(tensors: dict, spec_groups: dict[str, Group], frozen: list[str]) -> dict[str, Entry]:
    """The entries of ``tensors``; a group that cannot be described loses its axes everywhere (it stays in place,
    recorded in ``frozen``; ``spec_groups`` loses it), and a group no entry produces is dropped."""
    entries: dict[str, Entry] = {}
    dropped = True
    while dropped:
        dropped = False
        entries = {}
        for tname, (shape, lst) in tensors.items():
            live = [t for t in lst if t[1] in spec_groups]
            if not live:
                continue
            e = _entry(tname, shape, live, spec_groups)
            if e is None:
                for _, g, _, _, _ in live:
                    frozen.append(f"{g}: {tname.split('@')[0]} (an index map the reader cannot describe)")
                    spec_groups.pop(g, None)
                dropped = True
                break
            entries[tname] = e
    for g in list(spec_groups):
        if not any(ax.group == g for e in entries.values() for ax in e.axes if ax.role == "out"):
            spec_groups.pop(g)
    return entries


def _perm_spec(model: nn.Module, x: torch.Tensor, classifier: str, values, nodes, calls):
    names = {m: n for n, m in model.named_modules()}
    pnames = {id(p): n for n, p in model.named_parameters()}
    DG, groups = _dependency_groups(model, x, model.get_submodule(classifier))
    unwrapped = {id(u.parameters): u.pruning_dim for u in getattr(DG, "unwrapped_parameters", []) or []}
    state = model.state_dict()
    spec_groups: dict[str, Group] = {}
    axes: dict[str, list[tuple[int, str, str, list[int], list[int]]]] = {}   # tensor → [(axis, group, role, idx, root)]
    sites: dict[str, list[tuple[str, str]]] = {}
    call_at = {n.target: i for i, n in enumerate(nodes) if n.op == "call_module"}
    frozen: list[str] = []
    for grp in groups:
        gname = names.get(grp.items[0].dep.target.module, f"group{len(spec_groups)}")
        size = len(grp.items[0].idxs)
        touched, site, bad = _read_group(grp, DG, names, pnames, unwrapped, state, values, nodes, calls, call_at,
                                         size)
        if bad is not None:
            frozen.append(f"{gname}: {bad}")
            continue
        spec_groups[gname] = Group(gname, size, "hidden")
        sites[gname] = site
        for t in touched:
            axes.setdefault(t[0], []).append((t[1], gname, t[2], t[3], t[4]))
    tensors, splits = _split_tensors(axes, state)
    entries = _describe(tensors, spec_groups, frozen)
    cls_keys = tuple(k for k in (f"{classifier}.weight", f"{classifier}.bias") if k in state)
    spec = PermSpec("graph", spec_groups, entries, cls_keys, splits=splits)
    spec.frozen = sorted(set(frozen))   # type: ignore[attr-defined]
    return spec, sites


def _activation_sites(norm_sites: list[tuple[str, str]], affine_sites: list[tuple[str, str]],
                      call_at: dict[str, int]) -> list[tuple[str, str]]:
    """Where a group's unit activations are read (``Group.acts``): the output of every norm that writes the group's
    units, in forward order; without one, the first Linear / Conv that does.

    Every site, not one: a residual stream is written at its start (the stem's or a downsample's norm) and by each
    block's last norm before the addition, and a single one of those can carry no information about the units. timm's
    ResNets zero-initialise that last norm (``zero_init_last``), so on such a model the residual branches' outputs
    are identically 0 and matching read there sees a constant cost and keeps the identity: ``rebasin`` / ``ot`` did
    not find a permuted copy's permutation back. The rows of all sites together (``collect_activations``
    concatenates them) distinguish the units wherever any one site does; the choice depends on the architecture
    only, not on the weights of the model read first (a structure is cached per architecture)."""
    seen: dict[str, str] = {}
    for path, lay in norm_sites:
        seen.setdefault(path, lay)
    if seen:
        return sorted(seen.items(), key=lambda s: call_at.get(s[0], -1))
    return affine_sites[:1]


def _site_layout(mod: nn.Module, v: torch.Tensor, size: int) -> str | None:
    if v.dim() == 2 and v.shape[1] == size:
        return "flat"
    channels_last = type(mod) is nn.LayerNorm or isinstance(mod, nn.Linear)
    if channels_last and v.shape[-1] == size:
        return "tokens"
    if v.dim() >= 3 and v.shape[1] == size:
        return "channels"
    if v.shape[-1] == size:
        return "tokens"
    return None


def _split_axis(shape: tuple[int, ...], lst):
    """``(axis, [(start, stop, [(group, role, idxs, roots)])])`` when one axis of a tensor is shared by several
    groups in contiguous slices (a concatenation; positions no group holds become parts of their own), else
    ``None``."""
    by_axis: dict[int, list] = {}
    for raw_axis, g, role, idxs, roots in lst:
        by_axis.setdefault(raw_axis, []).append((g, role, idxs, roots))
    shared = [a for a, members in by_axis.items()
              if len(members) > 1 or len(members[0][2]) != shape[a]]
    if len(shared) != 1:
        return None
    axis = shared[0]
    spans = []
    for g, role, idxs, roots in by_axis[axis]:
        lo, hi = min(idxs), max(idxs) + 1
        if hi - lo != len(idxs):
            return None
        spans.append((lo, hi, [(g, role, idxs, roots)]))
    spans.sort()
    parts, at = [], 0
    for lo, hi, members in spans:
        if lo < at:
            return None   # overlapping slices
        if lo > at:
            parts.append((at, lo, []))
        parts.append((lo, hi, members))
        at = hi
    if at < shape[axis]:
        parts.append((at, shape[axis], []))
    return axis, parts


def _entry(tname: str, shape: tuple[int, ...], lst, groups: dict[str, Group]) -> Entry | None:
    """The ``Entry`` of one tensor: every grouped axis must be one unit-major block structure over the whole axis
    (``k`` consecutive positions per unit: 1, or a flattened channel's spatial block); ``None`` otherwise."""
    view = list(shape)
    axes: list[Axis] = []
    offset = 0   # view axes inserted before the current raw axis
    seen: set[int] = set()
    for raw_axis, gname, role, idxs, roots in sorted(lst, key=lambda t: t[0]):
        if gname not in groups:
            continue
        if raw_axis in seen:
            return None
        seen.add(raw_axis)
        n = groups[gname].size
        length = shape[raw_axis]
        if len(idxs) != length or length % n:
            return None
        k = length // n
        order = sorted(range(len(idxs)), key=lambda j: idxs[j])
        if [idxs[j] for j in order] != list(range(length)):
            return None
        unit_of = [roots[j] for j in order]
        if unit_of != [p // k for p in range(length)]:
            return None
        a = raw_axis + offset
        if k > 1:
            view[a:a + 1] = [n, k]
            offset += 1
        axes.append(Axis(gname, a, role))
    if not axes:
        return None
    return Entry(tname, tuple(view) if offset else None, tuple(axes))


def _permute_in_place(model: nn.Module, spec: PermSpec, perms: dict[str, torch.Tensor]) -> None:
    """Re-index, in ``model``'s own tensors, the units of the groups in ``perms`` (splits and views as the spec
    says). One tensor (one part of a split tensor) is permuted at a time, slice by slice (``_select_in_place``), so
    the extra memory is a few MB, not a second state dict; applying the inverse permutations restores the tensors
    exactly (a permutation moves values, it does not round them)."""
    state = model.state_dict(keep_vars=True)
    parts: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    for k, v in state.items():
        if v is None:
            continue
        v = v.data
        pieces = [(name, v.narrow(spec.splits[k][0], lo, hi - lo)) for name, lo, hi in spec.splits[k][1]] \
            if k in spec.splits else [(k, v)]
        for name, t in pieces:
            if name not in spec.entries:
                continue
            # a tensor reached under several names (tied weights) is permuted once, under its last name (the one
            # whose value ``load_state_dict`` would have left there)
            ident = (t.data_ptr(), tuple(t.shape), t.stride())
            if ident in seen:
                parts.pop(seen[ident], None)
            seen[ident] = name
            parts[name] = t
    for name, t in parts.items():
        e = spec.entries[name]
        axes = [ax for ax in e.axes if ax.group in perms]
        if not axes:
            continue
        copied = False
        try:
            y = t.view(e.view) if e.view is not None else t   # shares t's storage
        except RuntimeError:   # a part of a split tensor that no view describes: permute a copy, write it back
            y, copied = t.reshape(e.view).clone(), True
        for ax in axes:
            _select_in_place(y, ax.axis, perms[ax.group])
        if copied:
            t.copy_(y.reshape(t.shape))


def _select_in_place(y: torch.Tensor, axis: int, perm: torch.Tensor, block: int = 1 << 22) -> None:
    """``y.copy_(y.index_select(axis, perm))`` in slices of about ``block`` elements along another axis (each slice
    is permuted within itself), so a large tensor needs no full-size temporary."""
    others = [a for a in range(y.dim()) if a != axis]
    if not others or y.numel() <= block:
        y.copy_(y.index_select(axis, perm))
        return
    c = max(others, key=lambda a: y.shape[a])
    step = max(1, block * y.shape[c] // y.numel())
    for i in range(0, y.shape[c], step):
        s = y.narrow(c, i, min(step, y.shape[c] - i))
        s.copy_(s.index_select(axis, perm))


@torch.no_grad()
def _verify(model: nn.Module, spec: PermSpec, x: torch.Tensor, tol: float = 1e-6) -> None:
    """Check, in float64 on the example input, that permuting each group's units keeps the model's function; a
    group that breaks it (an index map the dependency graph got wrong: a reshape into attention heads, say) is
    dropped from the spec and recorded in ``spec.frozen``, so no method aligns it.

    Memory: one float64 copy of the model, whose tensors are permuted in place one at a time for a trial and put
    back by the inverse permutations after it (a permuted state dict, and a fresh copy of the model to load it
    into, per trial took several GB on a 132 M-parameter VGG-11 and ran out of memory under 8 GiB)."""
    import copy

    # the copy's floating tensors made float64 directly (no float32 copy of the model on the way)
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point() and id(t) not in memo:
            memo[id(t)] = nn.Parameter(t.detach().double(), t.requires_grad) if isinstance(t, nn.Parameter) \
                else t.detach().double()
    ref = copy.deepcopy(model, memo).double().eval()
    del memo
    xd = x.double()
    want = ref(xd)
    gen = torch.Generator().manual_seed(0)

    def breaks(groups: list[str]) -> bool:
        perms = {g: torch.randperm(spec.groups[g].size, generator=gen) for g in groups}
        _permute_in_place(ref, spec, perms)
        try:
            got = ref(xd)
            return not float((got - want).norm()) <= tol * float(want.norm().clamp_min(1e-12))
        finally:
            _permute_in_place(ref, spec, {g: torch.argsort(p) for g, p in perms.items()})

    if not spec.groups or not breaks(list(spec.groups)):
        return
    bad = [g for g in spec.groups if breaks([g])]
    frozen = list(getattr(spec, "frozen", []))
    for g in bad:
        frozen.append(f"{g}: permuting its units changes the model's function (an index map the reader cannot "
                      "describe)")
        del spec.groups[g]
    for name in list(spec.entries):
        e = spec.entries[name]
        axes = tuple(ax for ax in e.axes if ax.group in spec.groups)
        if not axes:
            del spec.entries[name]
        elif len(axes) != len(e.axes):
            spec.entries[name] = Entry(e.name, e.view, axes, e.qkv)
    spec.frozen = sorted(set(frozen))   # type: ignore[attr-defined]
    if spec.groups and breaks(list(spec.groups)):
        raise UnsupportedModelError("graph reader: the permutation groups read off this model do not keep its "
                                    f"function even without {bad}; fuse it with average, feddf or kd")


# --------------------------------------------------------------------------------------------------- adapter
class GraphAdapter(Adapter):
    """Any ``nn.Module`` classifier: structure read from its graph (see the module docstring). Registered last, so
    the hand-written adapters keep their families."""

    family = "graph"
    fallback = True   # ``adapter_for`` tries it after every other family, whenever that was registered

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, nn.Module)

    def levels(self, model: nn.Module) -> list[Level]:
        return structure(model).levels(model)

    def perm_spec(self, model: nn.Module, residual: str = "tied") -> PermSpec:
        return structure(model).spec

    def classifier(self, model: nn.Module) -> nn.Linear:
        return model.get_submodule(structure(model).classifier)

    def set_classifier(self, model: nn.Module, layer: nn.Linear) -> None:
        path = structure(model).classifier
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, layer)

    def pre_logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        box: list[torch.Tensor] = []
        h = self.classifier(model).register_forward_pre_hook(lambda _m, i: box.append(i[0]))
        try:
            model(x)
        finally:
            h.remove()
        feats = box[0]
        if feats.dim() != 2:
            raise UnsupportedModelError(f"graph reader: the classifier's input has shape {tuple(feats.shape)}; "
                                        "features before the class layer must be [N, d]")
        return feats

    def config(self, model: nn.Module, input_shape: tuple[int, ...] | None = None) -> ModelConfig:
        raise UnsupportedModelError(
            f"graph reader: fedfuse can fuse {type(model).__name__} but not rebuild it at another width or depth "
            "(resize, a fused target of another width); capacity tiers narrow a copy (at_width_mult)")

    def at_width_mult(self, model: nn.Module, width_mult: float, seed: int = 0,
                      input_shape: tuple[int, ...] | None = None) -> nn.Module:
        """A freshly initialised copy of ``model`` with every permutation group at ``⌈width_mult · width⌉`` units
        (the first ones: HeteroFL's nested slices), cut by Torch-Pruning along the reader's groups
        (``graph_tiers.narrowed``); ``UnsupportedModelError`` when the narrow copy does not run."""
        s = structure(model)
        shape = tuple(input_shape) if input_shape is not None else example_shape(model)
        narrow = narrowed(model, width_mult, {g: grp.size for g, grp in s.spec.groups.items()}, s.classifier,
                          torch.zeros(2, *shape), seed=seed)
        set_example_input(narrow, shape)
        return narrow


__all__ = ["GraphAdapter", "Structure", "structure", "set_example_input", "example_shape"]
