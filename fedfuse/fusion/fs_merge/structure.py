"""Which FS-Merge SuperNet layout fits a list of models: picked by the models' adapter family.

A layout ("structure") says which slots of the family's architecture get merge (M) and unmerge (U)
matrices, which normalisation layers are merged and learned, how the folded model's parameters follow from
them (``fold``) and how the wide, unfolded SuperNet runs (``wide``). The adapters in
``fedfuse.models.adapters`` only describe the models; the FS-Merge-specific layouts live here so that the
model package never depends on fusion code.
"""

from __future__ import annotations

from torch import nn

from fedfuse.fusion.fs_merge.structure_graph import GraphMergeStructure
from fedfuse.fusion.fs_merge.structure_sequential import SequentialMergeStructure
from fedfuse.fusion.fs_merge.structure_vit import ViTMergeStructure
from fedfuse.fusion.registry import IncompatibleModelsError
from fedfuse.models.adapters import UnsupportedModelError, adapter_for

# adapter family -> FS-Merge layout class (constructed with the models; raises IncompatibleModelsError naming
# the unsupported part); every other family (the generic reader's "graph", the hand-written ResNets) gets the
# layout read off its permutation spec
STRUCTURES: dict[str, type] = {"sequential": SequentialMergeStructure, "vit": ViTMergeStructure}


def structure_for(models: list[nn.Module]):
    """The FS-Merge structure of ``models`` (one family, model 0's layout), chosen by the adapter family;
    ``IncompatibleModelsError`` naming the unsupported part otherwise."""
    try:
        adapters = [adapter_for(m) for m in models]
    except UnsupportedModelError as exc:
        raise IncompatibleModelsError(f"fs-merge: {exc}") from None
    if len({a.family for a in adapters}) != 1:
        raise IncompatibleModelsError("fs-merge: merges models of one architecture; got the families "
                                      f"{sorted({a.family for a in adapters})} ({sorted({type(m).__name__ for m in models})})")
    family = adapters[0].family
    if family in STRUCTURES:
        try:
            return STRUCTURES[family](models)
        except IncompatibleModelsError:
            if family != "sequential":
                raise
            # not an MLP (a CNN chain, BatchNorm): the layout read off its permutation spec, below
    try:
        return GraphMergeStructure(models)
    except UnsupportedModelError as exc:
        raise IncompatibleModelsError(f"fs-merge: {exc}") from None


__all__ = ["STRUCTURES", "structure_for", "GraphMergeStructure", "SequentialMergeStructure", "ViTMergeStructure"]
