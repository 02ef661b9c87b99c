"""A bound on Torch-Pruning's dependency search (``DependencyGraph.get_all_groups``), which on some models runs away
instead of failing; every caller in fedfuse (the graph reader, its narrow copies, structured pruning) searches under
it and turns ``RunawayGroup`` into a refusal that names the model."""

from __future__ import annotations

import contextlib

from torch import nn


class RunawayGroup(Exception):
    """A Torch-Pruning group that grows without end (see ``bounded_groups``)."""


@contextlib.contextmanager
def bounded_groups(model: nn.Module, DG):
    """Bound Torch-Pruning's group search, which can run away on some models instead of failing: through the
    reshapes of window or head-split attention (torchvision's Swin) each index mapping multiplies the unit indices,
    so the lists grow from thousands to tens of millions and the search never ends (its issues #86, #430, #456).
    A unit index list indexes one axis of a parameter (a flatten's indices are a Linear's inputs, a concatenation's
    the next layer's input channels), so it cannot be much longer than the longest axis of any parameter; and a group
    cannot hold many more items than the graph has dependencies: past either bound the search stops with
    ``RunawayGroup`` (before the lists take gigabytes). The bound is checked in ``Group.add_dep``, patched for the
    duration of the call."""
    from torch_pruning.dependency import group as tp_group

    longest = max((max(p.shape, default=1) for p in model.parameters()), default=1)
    max_units = 4 * longest + 1_024
    max_items = 20 * sum(len(n.dependencies) for n in DG.module2node.values()) + 10_000
    original = tp_group.Group.add_dep

    def add_dep(group, dep, idxs):
        if len(idxs) > max_units or len(group._group) > max_items:
            raise RunawayGroup(f"{len(idxs)} unit indices at {dep.target} (at most {max_units}), "
                               f"{len(group._group)} items (at most {max_items})")
        return original(group, dep, idxs)

    tp_group.Group.add_dep = add_dep
    try:
        yield
    finally:
        tp_group.Group.add_dep = original


__all__ = ["RunawayGroup", "bounded_groups"]
