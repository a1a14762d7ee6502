"""Offloading optimizers."""

from .clipping import clip_grad_norm_
from .framework_clipping import install as _install_framework_guards
from .offload_adafactor import OffloadAdafactor
from .offload_adagrad import OffloadAdagrad
from .offload_adamw import OffloadAdam, OffloadAdamW
from .offload_lion import OffloadLion
from .offload_muon import OffloadMuon
from .offload_optimizer import OffloadOptimizer
from .torch_clipping import install as _install_clipping_guard
from .torch_grad_scaler import install as _install_grad_scaler_guard
from .torch_hook_order import install as _install_hook_order_guard
from .torch_zero_grad import install as _install_zero_grad_guard
from .update.failures import StepFailed

__all__ = [
    "OffloadAdafactor",
    "OffloadAdagrad",
    "OffloadAdam",
    "OffloadAdamW",
    "OffloadLion",
    "OffloadMuon",
    "OffloadOptimizer",
    "StepFailed",
    "clip_grad_norm_",
]

# Note [torch's clipping cannot see our gradients] in torch_clipping.py
_install_clipping_guard()
# Note [clipping guarded at each framework's entry point] in framework_clipping.py
_install_framework_guards()
# Note [torch's GradScaler cannot see our gradients] in torch_grad_scaler.py
_install_grad_scaler_guard()
# Note [zero_grad from elsewhere reaches the window] in torch_zero_grad.py
_install_zero_grad_guard()
# Note [the optimizer's hook runs last] in torch_hook_order.py
_install_hook_order_guard()
