"""Parameter offload: a window of layers' weights on the device, prefetched ahead of forward
and backward (``OffloadConfig(offload_parameters=True)``; README, "Parameter offload"); with
several ranks each rank holds a shard of each unit and gathers it (ZeRO-3 with offload), or
keeps its shards on the device (``partition_parameters=True``, ZeRO-3)."""

from .device_shards import DeviceShardOffloader
from .offloader import ParamOffloader, Phase
from .sharded_fetch import ShardedParamOffloader
from .unit import ParamUnit, UnitState
from .units import UnitSpec, default_layers, find_units

__all__ = [
    "DeviceShardOffloader",
    "ParamOffloader",
    "ParamUnit",
    "Phase",
    "ShardedParamOffloader",
    "UnitSpec",
    "UnitState",
    "default_layers",
    "find_units",
]
