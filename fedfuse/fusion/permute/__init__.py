"""Neuron permutations and transport maps applied to the weights of each model family.

Shared machinery of ``ot`` (OTFusion, Singh & Jaggi, NeurIPS 2020, arXiv 1910.05653, and its
transformer extension, Imfeld et al., "Transformer Fusion with Optimal Transport", ICLR 2024, arXiv
2310.05719), ``rebasin`` (Git Re-Basin, Ainsworth et al., ICLR 2023, arXiv 2209.04836) and ``transfusion``
(Rinaldi et al., "Update Your Transformer to the Latest Release: Re-Basin of Task Vectors", ICML 2025,
arXiv 2505.22697). Written from the papers, not from any reference repository.

A model's symmetries are a ``PermSpec`` built by its family's adapter (``fedfuse.models.adapters``):
groups of interchangeable units and, per state-dict tensor, which axes they index in which role
(``"out"`` produces the units, ``"in"`` consumes them). Class outputs and the model input are never
grouped. Residual constraints: ResNet blocks with an identity shortcut share the stream group of their
input; a shortcut conv starts a new stream group. timm ViTs have one stream group (``residual="tied"``,
exact) or one per residual position (``residual="untied"``: the permuted model is then only
equivalent with explicit permuted skips, used for task-vector transport and OT residual policies).

Modules:
    spec         ``build_spec`` (via the adapter), ``check_compatible``
    maps         ``Map`` (transport plan), applying maps to tensors / state dicts, ``permute_model``
    activations  unit activations per group on the fusion set
    sinkhorn     batched entropic OT iterations
    solvers      assignment, exact / entropic OT plans, head-preserving per-group solve
    features     weight features, standardisation, ground costs, OT marginals from importance scores
    averaging    (importance-weighted) averaging of aligned states
    batchnorm    BatchNorm statistics re-estimation
"""

from fedfuse.fusion.permute.activations import collect_activations
from fedfuse.fusion.permute.averaging import AlignedAverage, average_aligned
from fedfuse.fusion.permute.batchnorm import has_batchnorm, reset_bn_stats
from fedfuse.fusion.permute.features import (activation_cost, marginal_from_scores, score_cost, standardize,
                                             weight_cost, weight_features, weight_score)
from fedfuse.fusion.permute.maps import (Map, apply_maps, entry_view, map_axis, map_entry, permute_model,
                                         random_perms, state_on, load_state, split_state, join_state)
from fedfuse.fusion.permute.sinkhorn import sinkhorn_batch, sinkhorn_log_batch
from fedfuse.fusion.permute.solvers import (assignment, blocked_plan, exact_block_costs, ot_plan, ot_plans,
                                            solve_group)
from fedfuse.fusion.permute.spec import Axis, Entry, Group, PermSpec, block_paths, build_spec, check_compatible

__all__ = ["Axis", "Entry", "Group", "PermSpec", "block_paths", "build_spec", "check_compatible", "Map", "apply_maps", "entry_view",
           "map_axis", "map_entry", "permute_model", "random_perms", "state_on", "load_state", "split_state", "join_state", "collect_activations", "sinkhorn_batch",
           "sinkhorn_log_batch", "assignment", "blocked_plan", "exact_block_costs", "ot_plan", "ot_plans",
           "solve_group", "activation_cost", "weight_cost", "marginal_from_scores", "score_cost", "standardize", "weight_features", "weight_score", "AlignedAverage", "average_aligned",
           "has_batchnorm", "reset_bn_stats"]
