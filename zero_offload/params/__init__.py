"""Parameter offload: a window of layers' weights on the device, prefetched ahead of forward
and backward (``OffloadConfig(offload_parameters=True)``; README, "Parameter offload")."""

from .offloader import ParamOffloader, Phase
from .unit import ParamUnit, UnitState
from .units import UnitSpec, default_layers, find_units

__all__ = [
    "ParamOffloader",
    "ParamUnit",
    "Phase",
    "UnitSpec",
    "UnitState",
    "default_layers",
    "find_units",
]
