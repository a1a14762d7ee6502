"""The arrays every optimizer-step kernel but Adam's takes, checked in one place: the fp32
master, the gradient, the rule's state arrays, the optional training-dtype ``out`` and the
tile ``[start, stop)`` (``lion_step``, ``adagrad_step``). All are checked before anything
is written (``_validate.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ._validate import (
    BF16,
    FP16,
    FP32,
    as_kernel_array,
    check_range,
    check_same_length,
    check_take_written,
    chunking,
    run_with_threads,
)
from .convert import out_view, taken_tag

__all__ = ["StepArrays", "step_arrays"]


@dataclass(frozen=True)
class StepArrays:
    """One call's arrays, as the numba kernel takes them."""

    param: np.ndarray  # (n,) fp32, updated in place
    grad: np.ndarray  # (n,) fp32, or uint16 bits of kind grad_kind
    grad_kind: int
    state: tuple[np.ndarray, ...]  # (n,) each, fp32 or uint16 bf16 bits, in the call's order
    out: np.ndarray  # (n,) bf16/fp16 bits, or (0,) uint8 when absent (convert.out_view)
    start: int
    stop: int
    take: np.ndarray  # convert.TAKE_WRITTEN or KEEP_MASTER (Note [the update takes the
    # written weights] in convert.py)

    def launch(self, kernel: Callable[..., None], scalars: tuple, num_threads: int | None) -> None:
        """``kernel(param, grad, grad_kind, *state, out, take, start, stop, nchunks,
        *scalars)``
        on ``num_threads`` threads (the thread budget's share when None)."""

        def run(threads: int) -> None:
            nchunks = chunking(self.stop - self.start, threads)
            kernel(
                self.param, self.grad, self.grad_kind, *self.state, self.out, self.take,
                self.start, self.stop, nchunks, *scalars,
            )  # fmt: skip

        run_with_threads(num_threads, run)


def step_arrays(
    param: object, grad: object, state: Mapping[str, object], out: object, start: int,
    stop: int | None, take_written: bool = False,
) -> StepArrays:  # fmt: skip
    """Check and view the arrays of one step: ``param`` fp32, ``grad`` fp32/bf16/fp16,
    each of ``state`` (by its argument name) fp32 or bf16, ``out`` bf16/fp16 or None, all
    of ``param``'s length; ``[start, stop)`` a tile of it; ``take_written`` a bool, which
    needs ``out``."""
    param_a, _ = as_kernel_array(param, "param", (FP32,), writable=True)
    grad_a, grad_kind = as_kernel_array(grad, "grad", (FP32, BF16, FP16))
    arrays = {"grad": grad_a}
    for name, array in state.items():
        arrays[name], _ = as_kernel_array(array, name, (FP32, BF16), writable=True)
    if out is None:
        out_a = out_view(None, FP32)
    else:
        out_a, out_kind = as_kernel_array(out, "out", (BF16, FP16), writable=True)
        arrays["out"] = out_a
        out_a = out_view(out_a, out_kind)
    n = param_a.shape[0]
    check_same_length(n, arrays, "param")
    start, stop = check_range(start, stop, n)
    take = taken_tag(check_take_written(take_written, out))
    states = tuple(arrays[name] for name in state)
    return StepArrays(param_a, grad_a, grad_kind, states, out_a, start, stop, take)
