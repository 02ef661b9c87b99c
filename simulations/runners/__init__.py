"""Repository-only runners. The runners of the fedfuse Flower app live in the package: ``fedfuse.flower.runner``
(``fedfuse run``, ``fedfuse compare``; ``python -m fedfuse.flower.runner.run`` / ``.sweep``).

- ``deployment``: a real SuperLink + SuperNodes deployment on loopback (repository only: it uses ``deploy/``).
"""
