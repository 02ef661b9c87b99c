"""Former name of ``fedfuse.flower.client_tiers`` (kept so that existing imports work)."""

from fedfuse.flower.client_tiers import *  # noqa: F401,F403
from fedfuse.flower.client_tiers import OD_KEY, QUERY_KIND, SCALER_KEY, TIER_KEY, TIERS_KEY  # noqa: F401
from fedfuse.flower.client_tiers import node_tier, query, tier_forward, tier_model  # noqa: F401
