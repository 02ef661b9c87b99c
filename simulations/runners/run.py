"""The default run (``fedfuse run``): ``fedfuse.flower.runner.run`` (part of the installed package).

This name stays for the experiments and tests that import it, and for ``python -m simulations.runners.run``. It is the
same module object (a ``sys.modules`` alias), so patching an attribute here patches the runner.
"""

import sys

from fedfuse.flower.runner import run as _runner

if __name__ == "__main__":
    sys.exit(_runner.main())
sys.modules[__name__] = _runner
