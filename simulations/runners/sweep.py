"""The sweep (``fedfuse compare``): ``fedfuse.flower.runner.sweep`` (part of the installed package).

This name stays for the experiments and tests that import it, and for ``python -m simulations.runners.sweep``. It is the
same module object (a ``sys.modules`` alias), so patching an attribute here patches the runner.
"""

import sys

from fedfuse.flower.runner import sweep as _runner

if __name__ == "__main__":
    sys.exit(_runner.main())
sys.modules[__name__] = _runner
