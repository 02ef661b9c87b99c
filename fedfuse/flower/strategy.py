"""Former home of ``FusionStrategy`` (now ``fedfuse.flower.fusion_strategy``, on ``fedfuse.flower.protocol``); kept
so that existing imports work."""

from fedfuse.choices import FALLBACKS  # noqa: F401
from fedfuse.fusion import METHOD_SPECS  # noqa: F401
from fedfuse.flower.fusion_strategy import FusionStrategy  # noqa: F401
from fedfuse.flower.protocol import ClientsDivergedError, RoundProtocol, state_to_record  # noqa: F401

__all__ = ["FusionStrategy", "RoundProtocol", "ClientsDivergedError", "FALLBACKS", "state_to_record", "METHOD_SPECS"]
