"""The round: what every fedfuse strategy does with a round's messages, whatever it aggregates. ``protocol`` holds the
round protocol, the way a reply travels in one file (Flower FedAvg's sampling, the triage of the replies, the
divergence screen, the streamed average, the fallback policy, the round's record); beside it the reply contract, both
sides (``replies``: validation, the helpers a ClientApp of your own replies with, and a round's replies taken together:
the run-stopping errors, the train metrics), divergence checked twice (``divergence``: the screen's rules on every
reply, the guard on what is broadcast), the typed options (``options``) and the steps after an aggregation (``steps``).
"""
