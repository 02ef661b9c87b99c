"""Which arrays, and which entries of them, each tier of a depth-tier federation holds.

A tier is ``(width, units)``: the first ``units`` depth units of the global ``MultiExit`` with the exits at or below
them (``fedfuse.hetero.depth.held_keys``), and, for a width × depth tier (width ``< 1``), HeteroFL's top-left slice
of those arrays (``fedfuse.hetero.depth.exit_submodel``: the ``MultiExit`` at that width inside the global one).
``DepthLayout`` computes each once per architecture: the keys, the narrow skeletons, their shapes, the global
positions of a tier's entries and the slice of a global state a tier's node receives.
"""

from __future__ import annotations

from typing import Iterable

import torch

from fedfuse.hetero.depth import MultiExit, exit_submodel, held_keys
from fedfuse.hetero.submodel import SubModel, slice_state


class DepthLayout:
    """The tiers of ``skeleton`` (the run's global ``MultiExit``; its weights are not read).

    Args:
        skeleton: the global architecture.
        units: every depth (in units) a node may hold.
        input_shape: the model's input shape (a narrower CNN rebuilds its pooling from it).
        own_exit: a tier holds only the exit after its depth (InclusiveFL) instead of every exit up to it.
    """

    def __init__(self, skeleton: MultiExit, units: Iterable[int], input_shape: tuple[int, ...] | None = None,
                 own_exit: bool = False) -> None:
        self.skeleton = skeleton
        self.input_shape = input_shape
        self.full = skeleton.num_units
        self.held = {k: held_keys(skeleton, k, own_exit=own_exit) for k in {*units, self.full}}
        self.all = frozenset(skeleton.state_dict())
        self._narrow: dict[float, tuple[MultiExit, SubModel]] = {}
        self._shapes: dict[float, dict[str, tuple[int, ...]]] = {}

    def narrow(self, width: float) -> tuple[MultiExit, SubModel]:
        """``(skeleton, layout)`` of width ``width < 1``: the ``MultiExit`` at that width and its positions in the
        global one."""
        if width not in self._narrow:
            sk = self.skeleton.at_width_mult(width, input_shape=self.input_shape)
            self._narrow[width] = (sk, exit_submodel(self.skeleton, sk))
        return self._narrow[width]

    def shapes(self, width: float) -> dict[str, tuple[int, ...]]:
        """``{key: shape}`` of the ``MultiExit`` at ``width``."""
        if width not in self._shapes:
            sk = self.skeleton if width == 1 else self.narrow(width)[0]
            self._shapes[width] = {k: tuple(v.shape) for k, v in sk.state_dict().items()}
        return self._shapes[width]

    def units_of(self, keys: set[str]) -> int | None:
        """The depth (units) whose held keys are ``keys``, ``None`` if none."""
        if keys == self.all:
            return self.full
        return next((k for k, held in self.held.items() if keys == set(held)), None)

    def positions(self, width: float, k: int) -> dict[str, torch.Tensor] | None:
        """The global positions of the arrays a node of ``width`` and ``k`` units holds (``None``: whole arrays)."""
        if width == 1:
            return None
        layout = self.narrow(width)[1]
        return {key: layout.positions[key] for key in self.held[k]}

    def reference(self, full: dict, width: float, k: int) -> dict:
        """``{key: (shape, dtype)}`` a reply of the tier must have, from the global model's ``full`` reference."""
        if width == 1:
            return {key: full[key] for key in self.held[k]}
        layout = self.narrow(width)[1]
        return {key: (tuple(layout.positions[key].shape), full[key][1]) for key in self.held[k]}

    def state(self, full: dict[str, torch.Tensor], width: float, k: int) -> dict[str, torch.Tensor]:
        """The arrays of ``full`` (a global state) a node of ``width`` and ``k`` units holds."""
        if width == 1:
            return {key: full[key] for key in self.held[k]}
        layout = self.narrow(width)[1]
        return slice_state(full, SubModel({key: layout.positions[key] for key in self.held[k]}, layout.global_shapes))


__all__ = ["DepthLayout"]
