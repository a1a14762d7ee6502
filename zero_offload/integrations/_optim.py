"""What the integrations ask of ``OffloadAdamW``: find it behind a wrapper, read its norm,
make its model's state dict one the frameworks' savers write whole, and say where state
that may be on NVMe streams in a framework's checkpoint folder.

Note [frameworks clip through the optimizer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Trainer and accelerate clip with ``torch.nn.utils.clip_grad_norm_(model.parameters())``,
which reads ``param.grad``. With ``OffloadAdamW`` that is ``None`` after backward (the
gradients already sit in host memory), so torch's clip would see no gradient, clip nothing
and report a norm of 0. The integrations route every framework call that clips or reads
the norm to ``OffloadAdamW.clip_grad_norm_``, which takes the norm from the fused
statistics pass over the host gradients and folds the clip coefficient into the CPU Adam
gradient multiplier. The pass is cached until the gradients change, so reading the norm
before ``step()`` costs the step nothing.

Reading the norm without clipping (Trainer with ``max_grad_norm=0``, accelerate's
``clip_grad_norm_(..., inf)``) is ``OffloadOptimizer.grad_norm()``: the same cached pass,
and no clip recorded, so the step's clipping stays what it was (``OffloadConfig.
max_grad_norm``, or an earlier clip of the window) and a read in the middle of a window is no
clip there (Note [a clip in the middle of a window] in ``optim/update/window_clip.py``).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..collectives import all_gather_bytes
from ..optim import OffloadOptimizer

__all__ = [
    "STREAMING_NAME",
    "clip_norm",
    "each_rank",
    "find_offload_optimizer",
    "parameters_sharded",
    "pre_clip_norm",
    "saveable",
    "state_on_nvme",
    "streaming_name",
]

#: The folder, inside a framework's checkpoint folder, of a streaming optimizer checkpoint
#: (``opt.save_streaming``, one ``rank{r}/`` per rank): the state on NVMe, which a state
#: dict would have to hold in host RAM whole.
STREAMING_NAME = "zero_offload_optimizer"


def find_offload_optimizer(optimizer: object, *, where: str) -> OffloadOptimizer:
    """``optimizer`` itself, or the offload optimizer inside an accelerate wrapper."""
    inner = optimizer
    while not isinstance(inner, OffloadOptimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer  # AcceleratedOptimizer and its subclasses
    if not isinstance(inner, OffloadOptimizer):
        raise TypeError(
            f"{where} needs a zero_offload offload optimizer (OffloadAdamW, OffloadAdagrad, "
            f"OffloadLion, OffloadAdafactor, OffloadMuon), got {type(optimizer).__name__}; "
            "build one over the model's parameters"
        )
    return inner


def pre_clip_norm(opt: OffloadOptimizer) -> torch.Tensor:
    """The total gradient norm the next step will see, leaving its clipping unchanged.

    See Note [frameworks clip through the optimizer].
    """
    return opt.grad_norm()


def clip_norm(opt: OffloadOptimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` contract on ``opt``'s gradients: clip the next step to
    ``max_norm`` and return the pre-clip norm; ``max_norm=inf`` only reads the norm."""
    real = isinstance(max_norm, numbers.Real) and not isinstance(max_norm, bool)
    if real and math.isinf(max_norm) and max_norm > 0:  # numpy's inf too
        if norm_type != 2.0:
            raise ValueError(f"norm_type must be 2.0 (the L2 norm), got {norm_type!r}")
        return pre_clip_norm(opt)
    return opt.clip_grad_norm_(max_norm, norm_type)


def parameters_sharded(opt: OffloadOptimizer) -> bool:
    """Whether reading ``opt``'s released parameters is collective: parameter offload on
    several ranks (ZeRO-3; Note [a sharded unit] in ``params/sharded_fetch.py``)."""
    return opt.param_offloader is not None and opt.comm is not None


def each_rank(flag: bool, opt: OffloadOptimizer, what: str) -> list[bool]:
    """``flag`` of every rank of ``opt``'s process group, in rank order (this rank's alone
    with one rank). A collective with several ranks."""
    if opt.comm is None:
        return [flag]
    flags = all_gather_bytes(b"\x01" if flag else b"\x00", comm=opt.comm, what=what, length=1)
    return [f != b"\x00" for f in flags]


def state_on_nvme(opt: OffloadOptimizer) -> bool:
    """Whether ``opt`` may keep optimizer state on NVMe (``OffloadConfig.nvme_dir`` set):
    ``state_dict()`` and ``opt.state`` cannot hand such state out as tensors
    (``StateNotInHostRam``); a checkpoint of it streams (``opt.save_streaming``). Decided by
    the config, the same on every rank, not by where this rank's buckets landed:
    ``host_budget="auto"`` reads each rank's free RAM, so the placements can differ, and a
    save must run the same collectives on every rank."""
    return opt.config.nvme_dir is not None


def streaming_name(index: int = 0) -> str:
    """The ``STREAMING_NAME`` folder of the framework's optimizer number ``index``, numbered
    as accelerate numbers its files (``optimizer.bin``, ``optimizer_1.bin``, ...)."""
    return STREAMING_NAME if index == 0 else f"{STREAMING_NAME}_{index}"


# Note [state dicts the savers can write]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# accelerate's safetensors savers (``save_model``, ``save_state``) take entries that share a
# storage for one tied weight and keep one of them; transformers' ``save_pretrained`` keeps
# one name of each tied pair its model declares, and writes two tensors as two. Two things
# about an OffloadAdamW model break those rules:
# - without parameter offload each parameter is a view of its bucket's flat device buffer,
#   so every parameter of a bucket shares one storage: accelerate wrote one of them and
#   dropped the rest (with only a logged warning);
# - under ZeRO-3 each entry is a host copy of its gathered parameter, so the two names of a
#   tied parameter (GPT-2's ``wte`` and ``lm_head``) are two tensors, written twice.
# ``saveable`` gives the names of one parameter one tensor, and an entry that shares its
# storage with another parameter's a host copy of its own. Hidden cost: that copy is the
# whole model in host memory, on the process that writes (none under ZeRO-3, whose entries
# are copies already).


def saveable(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state_dict`` (of ``model``) as the savers can write it: see Note [state dicts the
    savers can write]. Changed in place, and returned."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in state_dict:
            state_dict[name] = state_dict[first.setdefault(id(param), name)]
    holders: dict[tuple[torch.device, int], set[int]] = {}
    for tensor in state_dict.values():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            key = (tensor.device, tensor.untyped_storage().data_ptr())
            holders.setdefault(key, set()).add(id(tensor))
    copies: dict[int, torch.Tensor] = {}  # one copy per tensor, so tied names stay one
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        if len(holders[(tensor.device, tensor.untyped_storage().data_ptr())]) > 1:
            if id(tensor) not in copies:
                copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
            state_dict[name] = copies[id(tensor)]
    return state_dict
