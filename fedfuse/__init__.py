"""fedfuse: federated learning where the server fuses client models instead of averaging them.

The library half (this package) is pure PyTorch: models and their fusion levels, data and
partitioning, neuron importance, training loops and the fusion algorithms. The Flower half lives in
the top-level ``clients`` and ``server`` packages and only calls into this one.
"""

__version__ = "0.1.0"
