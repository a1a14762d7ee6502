"""zero-offload: ZeRO-Offload for PyTorch. The public names, re-exported."""

from .accelerator import Accelerator, CudaAccelerator, HostAccelerator, get_accelerator
from .activations import (
    ActivationOffloadConfig,
    ActivationOffloader,
    checkpoint,
    offload_activations,
)
from .checkpoint_io import consolidated_state_dict, load_consolidated, save_consolidated
from .config import AcceleratorConfig, LossScalerConfig, OffloadConfig
from .errors import (
    CollectiveError,
    DeviceBudgetExceeded,
    PoolExhausted,
    StreamError,
    StreamRaceError,
)
from .estimate import MemoryEstimate, ModelShape, estimate
from .memory.manager import TieredMemoryManager
from .optim import OffloadAdam, OffloadAdamW, StepFailed
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
    "OffloadAdam",
    "OffloadAdamW",
    "OffloadConfig",
    "PoolExhausted",
    "StepFailed",
    "StreamError",
    "StreamRaceError",
    "TieredMemoryManager",
    "TrafficProfiler",
    "checkpoint",
    "consolidated_state_dict",
    "estimate",
    "get_accelerator",
    "load_consolidated",
    "offload_activations",
    "profile",
    "save_consolidated",
]

__version__ = "0.1.0"
