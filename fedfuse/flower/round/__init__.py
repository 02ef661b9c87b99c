"""The round: what every fedfuse strategy does with a round's messages, whatever it aggregates. ``protocol`` holds the
round protocol, the way a reply travels in one file (Flower FedAvg's sampling, the triage of the replies, the
divergence screen, the streamed average, the fallback policy, the round's record); beside it the reply contract
(``replies``, and ``client_replies`` for a ClientApp of your own), the divergence screen's rules (``divergence``), the
record helpers (``outcome``), the typed options (``options``), the steps after an aggregation (``steps``) and the
guard on what is broadcast (``broadcast_guard``).
"""
