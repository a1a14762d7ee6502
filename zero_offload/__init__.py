"""zero-offload: ZeRO-Offload for PyTorch. The public names, re-exported."""

from .accelerator import Accelerator, CudaAccelerator, HostAccelerator, get_accelerator
from .activations import (
    ActivationOffloadConfig,
    ActivationOffloader,
    checkpoint,
    offload_activations,
)
from .config import AcceleratorConfig, LossScalerConfig, OffloadConfig
from .errors import CollectiveError, DeviceBudgetExceeded, PoolExhausted, StreamError
from .estimate import MemoryEstimate, ModelShape, estimate
from .memory.manager import TieredMemoryManager
from .optim import OffloadAdamW
from .profiling import TrafficProfiler, profile

__all__ = [
    "Accelerator",
    "AcceleratorConfig",
    "ActivationOffloadConfig",
    "ActivationOffloader",
    "CollectiveError",
    "CudaAccelerator",
    "DeviceBudgetExceeded",
    "HostAccelerator",
    "LossScalerConfig",
    "MemoryEstimate",
    "ModelShape",
    "OffloadAdamW",
    "OffloadConfig",
    "PoolExhausted",
    "StreamError",
    "TieredMemoryManager",
    "TrafficProfiler",
    "checkpoint",
    "estimate",
    "get_accelerator",
    "offload_activations",
    "profile",
]

__version__ = "0.1.0"
