"""A Flower app of your own that aggregates with a fedfuse strategy (``examples/own-flower-app``)."""
