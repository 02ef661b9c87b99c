"""The runners of the fedfuse Flower app live in the package: ``fedfuse.flower.runner`` (``fedfuse run``,
``fedfuse compare``). The modules here are aliases of them (``simulations.runners.run`` is
``fedfuse.flower.runner.run``, and so on for ``cli``, ``compare``, ``console``, ``flwr_runner``,
``inprocess``, ``progress``, ``sweep``), kept for the benchmarks, the tests and ``python -m
simulations.runners.run``.

- ``deployment``: a real SuperLink + SuperNodes deployment on loopback (repository only: it uses ``deploy/``).
"""
