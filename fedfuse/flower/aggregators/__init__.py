"""What a round aggregates with: a ``fedfuse.fusion`` method (``fusion_strategy``, its server-side importance
``server_importance``), Flower's own strategies (``baselines``), strategy ``auto``'s vote between candidates
(``selection``, the clients' side ``candidates``) and a warm start's first round (``warm_start``).
"""
