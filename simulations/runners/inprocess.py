"""The in-process engine: ``fedfuse.flower.runner.inprocess`` (part of the installed package).

This name stays for the experiments and tests that import it. It is the same module object (a
``sys.modules`` alias), so patching an attribute here patches the runner.
"""

import sys

from fedfuse.flower.runner import inprocess as _runner

sys.modules[__name__] = _runner
