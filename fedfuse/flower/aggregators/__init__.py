"""What a round aggregates with: a ``fedfuse.fusion`` method (``fusion_strategy``: ``FusionAggregator``, the method and
its steps as an object a protocol holds, with its server-side importance, and ``FusionStrategy``, the protocol holding
one), Flower's own strategies (``baselines``), strategy ``auto``'s vote between candidates (``selection``, the clients'
side ``candidates``) and a warm start's first round (``warm_start``).
"""
