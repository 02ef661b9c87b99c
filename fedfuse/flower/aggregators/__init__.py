"""What a round aggregates with: a ``fedfuse.fusion`` method (``fusion_aggregator``: the method and its steps, an
object a protocol holds, and its server-side importance; ``fusion_strategy``: the protocol holding one), Flower's own
strategies (``baselines``), strategy ``auto``'s vote between candidates (``selection``, the clients' side
``candidates``) and a warm start's first round (``warm_start``).
"""
