"""Clients of different capacities: width tiers (``tiered``: fusion into the global width, HeteroFL, FedRolex;
``tier_models``: which client holds which sub-model and how it is derived), their ClientApp
side (``client_tiers``) and depth tiers (``depth_tiers``, with the baselines DepthFL and InclusiveFL).
"""
