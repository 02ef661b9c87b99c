"""The round: what every fedfuse strategy does with a round's messages, whatever it aggregates: Flower FedAvg's
sampling and the reply contract (``replies``, and ``client_replies`` for a ClientApp of your own), the triage of the
replies (``triage``) and the divergence screen it applies (``divergence``: outsized or overflowing replies
rejected before any aggregation), the round's record and fallback (``outcome``), the protocol that holds them (``protocol``),
the typed options (``options``), the steps after an aggregation (``steps``), streamed averages (``streaming``) and
the guard on what is broadcast (``broadcast_guard``).
"""
