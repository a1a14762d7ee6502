"""zero-offload: ZeRO-Offload for PyTorch. The public names, re-exported."""

from .accelerator import Accelerator, CudaAccelerator, HostAccelerator, get_accelerator
from .activations import (
    ActivationOffloadConfig,
    ActivationOffloader,
    checkpoint,
    offload_activations,
)
from .config import AcceleratorConfig, LossScalerConfig, OffloadConfig
from .errors import DeviceBudgetExceeded, PoolExhausted, StreamError
from .memory.manager import TieredMemoryManager
from .optim import OffloadAdamW

__all__ = [
    "Accelerator",
    "AcceleratorConfig",
    "ActivationOffloadConfig",
    "ActivationOffloader",
    "CudaAccelerator",
    "DeviceBudgetExceeded",
    "HostAccelerator",
    "LossScalerConfig",
    "OffloadAdamW",
    "OffloadConfig",
    "PoolExhausted",
    "StreamError",
    "TieredMemoryManager",
    "checkpoint",
    "get_accelerator",
    "offload_activations",
]

__version__ = "0.1.0"
