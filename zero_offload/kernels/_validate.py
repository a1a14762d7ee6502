"""Argument checking and zero-copy array views for the kernels.

Every public kernel validates all of its arguments here *before* any data is written, so a
call that raises leaves every array unchanged, and a user mistake never reaches numba's
typing machinery (whose tracebacks do not name the argument).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import TypeVar

import numba
import numpy as np
import torch

from ..thread_budget import numba_threads_now

# Element kinds. numba has no 16-bit float on the CPU, so bf16 and fp16 are uint16 bits.
FP32 = 0
BF16 = 1
FP16 = 2
KIND_NAMES = {FP32: "float32", BF16: "bfloat16", FP16: "float16"}

_TORCH_KINDS = {torch.float32: FP32, torch.bfloat16: BF16, torch.float16: FP16}
_NUMPY_KINDS = {np.dtype(np.float32): FP32, np.dtype(np.uint16): BF16, np.dtype(np.float16): FP16}

# Below this many elements per thread, the cost of waking a thread exceeds its share of work.
MIN_ELEMENTS_PER_THREAD = 1 << 15

T = TypeVar("T")
P = TypeVar("P")


def _allowed(kinds: Sequence[int]) -> str:
    return " or ".join(KIND_NAMES[k] for k in kinds)


def as_kernel_array(
    x: object, name: str, kinds: Sequence[int], *, writable: bool = False
) -> tuple[np.ndarray, int]:
    """Return a zero-copy 1-D numpy view of ``x`` that a kernel can take, and its kind.

    fp32 becomes a float32 view; bf16 and fp16 become uint16 views of their bits. A numpy
    float16 array is fp16; a numpy uint16 array is read as bf16 bit patterns.
    """
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(
                f"{name} is on device {x.device}; the CPU kernels need a CPU tensor "
                f"(the host copy, e.g. {name}.cpu() or a pinned host buffer)"
            )
        if x.layout != torch.strided or x.dim() != 1 or not x.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous 1-D tensor, got shape {tuple(x.shape)} with "
                f"strides {x.stride() if x.layout == torch.strided else x.layout}; "
                f"pass {name}.contiguous().view(-1)"
            )
        kind = _TORCH_KINDS.get(x.dtype)
        if kind not in kinds:
            raise TypeError(f"{name} has dtype {x.dtype}; expected {_allowed(kinds)}")
        t = x.detach()
        arr = t.numpy() if kind == FP32 else t.view(torch.int16).numpy().view(np.uint16)
        return arr, kind
    if isinstance(x, np.ndarray):
        if x.ndim != 1 or not x.flags.c_contiguous:
            raise ValueError(
                f"{name} must be a contiguous 1-D array, got shape {x.shape} with strides "
                f"{x.strides}; pass np.ascontiguousarray({name}).reshape(-1)"
            )
        kind = _NUMPY_KINDS.get(x.dtype)
        if kind not in kinds:
            raise TypeError(
                f"{name} has numpy dtype {x.dtype}; expected {_allowed(kinds)} "
                "(numpy float32, float16, or uint16 holding bf16 bit patterns)"
            )
        if writable and not x.flags.writeable:
            raise ValueError(f"{name} is a read-only numpy array; the kernel writes into it")
        return (x.view(np.uint16) if kind == FP16 else x), kind
    raise TypeError(f"{name} must be a CPU torch.Tensor or a numpy.ndarray, got {type(x).__name__}")


def check_same_length(n: int, arrays: dict[str, np.ndarray], reference: str) -> None:
    """Raise unless every array in ``arrays`` has ``n`` elements (the length of ``reference``)."""
    for name, arr in arrays.items():
        if arr.shape[0] != n:
            raise ValueError(
                f"{name} has {arr.shape[0]} elements but {reference} has {n}; "
                "every array of one call must have the same length"
            )


def check_take_written(take_written: object, out: object) -> bool:
    """``take_written`` as a bool, checked: it needs ``out``, the weights it compares
    (Note [the update takes the written weights] in convert.py)."""
    if not isinstance(take_written, bool):
        raise TypeError(f"take_written must be a bool, got {take_written!r}")
    if take_written and out is None:
        raise ValueError(
            "take_written=True needs out, the training-dtype weights to take written values "
            "from; pass out, or take_written=False"
        )
    return take_written


def check_range(start: object, stop: object, n: int) -> tuple[int, int]:
    """Validate the tile ``[start, stop)`` of an array of ``n`` elements; ``stop=None`` means n."""
    try:
        start_i = operator.index(start)
        stop_i = n if stop is None else operator.index(stop)
    except TypeError:
        raise TypeError(
            f"start and stop must be integers (stop may be None), got start={start!r}, "
            f"stop={stop!r}"
        ) from None
    if not 0 <= start_i <= stop_i <= n:
        raise ValueError(
            f"start={start_i}, stop={stop_i} is not a tile of an array of {n} elements; "
            f"need 0 <= start <= stop <= {n}"
        )
    return start_i, stop_i


def check_float(
    name: str,
    value: object,
    *,
    lo: float | None = None,
    hi: float | None = None,
    hi_open: bool = False,
    nan_ok: bool = False,
) -> float:
    """Return ``value`` as a finite Python float within ``[lo, hi]`` (``[lo, hi)`` if hi_open);
    ``nan_ok``: NaN passes too (a gradient multiplier from a NaN norm: NaN gradients, as
    torch's clipping makes them)."""
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number (a Python float), got {type(value).__name__} "
            f"{value!r}; for a tensor pass {name}.item()"
        )
    v = float(value)
    if nan_ok and math.isnan(v):
        return v
    bad = not math.isfinite(v) or (lo is not None and v < lo)
    bad = bad or (hi is not None and (v >= hi if hi_open else v > hi))
    if bad:
        upper = "" if hi is None else (f" and < {hi}" if hi_open else f" and <= {hi}")
        lower = "finite" if lo is None else f">= {lo}"
        raise ValueError(f"{name}={value!r} is out of range; it must be {lower}{upper}")
    return v


def resolve_threads(num_threads: object) -> int:
    """Threads to use: ``num_threads`` if given, else the calling thread's share of the
    thread budget (Note [one thread budget] in ``thread_budget.py``: torch's count and the
    cores after backward, less beside torch), capped by numba's pool."""
    pool = numba.config.NUMBA_NUM_THREADS
    if num_threads is None:
        return numba_threads_now(torch.get_num_threads(), pool)
    try:
        n = operator.index(num_threads)
    except TypeError:
        raise TypeError(
            f"num_threads must be an integer or None, got {type(num_threads).__name__}"
        ) from None
    if not 1 <= n <= pool:
        raise ValueError(
            f"num_threads={n} is out of range; numba's pool has {pool} threads, so pass "
            f"1..{pool} (or None for the thread budget's share)"
        )
    return n


def chunking(span: int, threads: int) -> int:
    """Number of contiguous chunks (one per thread) to split ``span`` elements into."""
    return max(1, min(threads, span // MIN_ELEMENTS_PER_THREAD))


# Note [sums do not depend on the threads]
# A reduction (the sum of squares) splits [start, stop) into fixed blocks of
# REDUCTION_BLOCK elements counted from start, whatever the number of threads; each block
# is summed by one thread with one loop shape, and the block sums are added exactly
# (math.fsum). Splitting by thread instead made the last bits of the sum, hence of the
# clipping coefficient and every weight, depend on how many threads a pass ran on.
REDUCTION_BLOCK = MIN_ELEMENTS_PER_THREAD


def reduction_blocks(span: int) -> int:
    """Number of REDUCTION_BLOCK blocks covering ``span`` elements (at least one)."""
    return max(1, -(-span // REDUCTION_BLOCK))


def check_ranges(ranges: object, n: int, name: str = "ranges") -> np.ndarray:
    """``ranges`` (a sequence of ``(start, stop)``) as an ``(m, 2)`` int64 array, each row a
    tile of an array of ``n`` elements (``check_range``'s rule and message)."""
    try:
        bounds = np.asarray(ranges)
    except ValueError:  # ragged
        bounds = np.empty(0, dtype=object)
    if bounds.size == 0 and bounds.ndim == 1:
        return np.empty((0, 2), dtype=np.int64)
    if bounds.ndim != 2 or bounds.shape[1] != 2 or bounds.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be a sequence of (start, stop) integer pairs, got {_preview(ranges)}"
        )
    bounds = bounds.astype(np.int64, copy=False)
    starts, stops = bounds[:, 0], bounds[:, 1]
    bad = (starts < 0) | (starts > stops) | (stops > n)
    if bad.any():
        i = int(np.argmax(bad))
        try:
            check_range(int(starts[i]), int(stops[i]), n)  # raises, naming the range
        except ValueError as e:
            raise ValueError(f"{name}[{i}]: {e}") from None
    return bounds


def _preview(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def range_blocks(
    starts: np.ndarray, stops: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The blocks a one-range reduction kernel cuts each ``[starts[i], stops[i])`` into:
    REDUCTION_BLOCK elements counted from the range's start, an empty range one empty block
    (Note [sums do not depend on the threads]). Returns ``(block_lo, block_hi, counts,
    within)``: each block's bounds, range by range in order, the number of blocks of each
    range, and each block's index inside its range."""
    counts = np.maximum(1, -(-(stops - starts) // REDUCTION_BLOCK))
    first = np.repeat(np.cumsum(counts) - counts, counts)
    within = np.arange(first.shape[0]) - first
    block_lo = np.repeat(starts, counts) + within * REDUCTION_BLOCK
    block_hi = np.minimum(block_lo + REDUCTION_BLOCK, np.repeat(stops, counts))
    return block_lo, block_hi, counts, within


# Note [ranges planned once]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The launches over many ranges (``grad_stats_ranges``, ``accumulate_grad_ranges``) check
# their ranges and cut them into blocks in numpy before the kernel runs: for a tile of 600
# ranges about 1.3 ms a call against 0.2 ms of kernel, on the host worker, at every landed
# tile of every micro-batch. The host passes launch the same ranges over arrays of the same
# length at every step (Note [a tile's ranges are cut once] in optim/grads/host_passes.py),
# so they plan them once (``plan_stats_ranges``, ``plan_accumulate_ranges``: every check
# and every block, with the length they were checked against) and pass the plan; a plan is
# refused against an array of another length. Ranges given as a sequence are planned at the
# call, as before.


def planned(
    ranges: object, n: int, kind: type[P], plan: Callable[[object, int], P], name: str
) -> P:
    """``ranges`` as a plan of type ``kind`` for an array ``name`` of ``n`` elements: itself
    if it is one (checked to be for ``n`` elements), else ``plan(ranges, n)``; Note [ranges
    planned once]."""
    if isinstance(ranges, kind):
        if ranges.n != n:  # type: ignore[attr-defined]
            raise ValueError(
                f"ranges were planned for an array of {ranges.n} elements but {name} has "  # type: ignore[attr-defined]
                f"{n}; plan them for this array ({plan.__name__}(ranges, {n}))"
            )
        return ranges
    return plan(ranges, n)


def run_with_threads(num_threads: object, fn: Callable[[int], T]) -> T:
    """Call ``fn(n)`` with numba's thread count set to ``n`` for this calling thread only."""
    n = resolve_threads(num_threads)
    previous = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        return fn(n)
    finally:
        numba.set_num_threads(previous)
