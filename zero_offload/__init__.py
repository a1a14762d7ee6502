"""zero-offload: ZeRO-Offload for PyTorch. The public names, re-exported.

Note [the package imports torch lazily]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``import zero_offload`` must not import torch or numba: ``zero-offload --help`` and ``info``
start in a fraction of a second, and importing torch takes seconds (15-22 s on a loaded
machine). So the names whose modules need torch are resolved on first use by the module's
``__getattr__`` (PEP 562): ``from zero_offload import OffloadAdamW`` and
``zero_offload.OffloadAdamW`` work as before, importing what they need then. The torch-free
names (configuration, errors, the estimator) are imported here; ``estimate`` must be, since
importing the subpackage ``zero_offload.estimate`` would otherwise bind the package
attribute ``estimate`` to the subpackage instead of the function.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import (
    AcceleratorConfig,
    GradAccumulation,
    GradStaging,
    LossScalerConfig,
    OffloadConfig,
    OverlapLanding,
    OverlapShadow,
)
from .errors import (
    CollectiveError,
    DeviceBudgetExceeded,
    ForkedStreamError,
    PoolExhausted,
    StreamError,
    StreamRaceError,
)
from .estimate import MemoryEstimate, ModelShape, estimate

if TYPE_CHECKING:
    from .accelerator import Accelerator, CudaAccelerator, HostAccelerator, get_accelerator
    from .activations import (
        ActivationOffloadConfig,
        ActivationOffloader,
        checkpoint,
        offload_activations,
    )
    from .checkpoint_io import consolidated_state_dict, load_consolidated, save_consolidated
    from .hf_export import save_pretrained
    from .memory.manager import TieredMemoryManager
    from .optim import (
        OffloadAdafactor,
        OffloadAdagrad,
        OffloadAdam,
        OffloadAdamW,
        OffloadLion,
        OffloadMuon,
        OffloadOptimizer,
        StepFailed,
        clip_grad_norm_,
    )
    from .profiling import TrafficProfiler, profile
    from .weights import load_pretrained

#: Public names whose modules import torch: name -> the module that defines it.
_LAZY = {
    "Accelerator": ".accelerator",
    "CudaAccelerator": ".accelerator",
    "HostAccelerator": ".accelerator",
    "get_accelerator": ".accelerator",
    "ActivationOffloadConfig": ".activations",
    "ActivationOffloader": ".activations",
    "checkpoint": ".activations",
    "offload_activations": ".activations",
    "consolidated_state_dict": ".checkpoint_io",
    "load_consolidated": ".checkpoint_io",
    "save_consolidated": ".checkpoint_io",
    "TieredMemoryManager": ".memory.manager",
    "OffloadAdafactor": ".optim",
    "OffloadAdagrad": ".optim",
    "OffloadAdam": ".optim",
    "OffloadAdamW": ".optim",
    "OffloadLion": ".optim",
    "OffloadMuon": ".optim",
    "OffloadOptimizer": ".optim",
    "StepFailed": ".optim",
    "clip_grad_norm_": ".optim",
    "TrafficProfiler": ".profiling",
    "load_pretrained": ".weights",
    "save_pretrained": ".hf_export",
    "profile": ".profiling",
}

__all__ = [
    "Accelerator",
    "AcceleratorConfig",
    "ActivationOffloadConfig",
    "ActivationOffloader",
    "CollectiveError",
    "CudaAccelerator",
    "DeviceBudgetExceeded",
    "ForkedStreamError",
    "GradAccumulation",
    "GradStaging",
    "HostAccelerator",
    "LossScalerConfig",
    "MemoryEstimate",
    "ModelShape",
    "OffloadAdafactor",
    "OffloadAdagrad",
    "OffloadAdam",
    "OffloadAdamW",
    "OffloadConfig",
    "OffloadLion",
    "OffloadMuon",
    "OffloadOptimizer",
    "OverlapLanding",
    "OverlapShadow",
    "PoolExhausted",
    "StepFailed",
    "StreamError",
    "StreamRaceError",
    "TieredMemoryManager",
    "TrafficProfiler",
    "checkpoint",
    "clip_grad_norm_",
    "consolidated_state_dict",
    "estimate",
    "get_accelerator",
    "load_consolidated",
    "load_pretrained",
    "offload_activations",
    "profile",
    "save_consolidated",
    "save_pretrained",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name whose module imports torch, imported on first use; see Note [the
    package imports torch lazily]."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
