"""Heterogeneous federations: capacity tiers, sub-models, and the HeteroFL / FedRolex aggregations.

    from fedfuse.hetero import parse_tiers, tier_of, submodel, slice_state, aggregate_states
    tiers = parse_tiers("1,0.5,0.25")
    small = build_model("mlp", ..., width_mult=tier_of(pid, tiers))
    sub = submodel(global_model, small, offset=0)        # HeteroFL; offset=round → FedRolex
    small.load_state_dict(slice_state(global_model.state_dict(), sub))
    new_global = aggregate_states(global_state, [client states], [their SubModels], weights)

No Flower here (the Flower strategies are ``fedfuse.flower.tiers.tiered``).
"""

from fedfuse.hetero.scaler import attach_width_scaler
from fedfuse.hetero.static_bn import reestimate_batchnorm
from fedfuse.hetero.submodel import SubModel, aggregate_states, slice_state, submodel, window_indices
from fedfuse.hetero.tiers import parse_tier_value, parse_tiers, tier_name, tier_of

__all__ = ["SubModel", "submodel", "window_indices", "slice_state", "aggregate_states", "attach_width_scaler",
           "reestimate_batchnorm", "parse_tiers", "parse_tier_value", "tier_of", "tier_name"]
