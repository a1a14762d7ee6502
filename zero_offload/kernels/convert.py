"""fp32 <-> bf16/fp16 conversion by bit manipulation, as numba device functions and one kernel.

numba has no 16-bit float type on the CPU, so bf16 and fp16 values travel as ``uint16`` bit
patterns; a *kind* code says how to read them (``FP32``, ``BF16``, ``FP16``). Every encoder
rounds to nearest even and is bit-exact with torch's ``Tensor.to(dtype)`` on the CPU,
including the NaN patterns torch writes (see Note [NaN bit patterns match torch]).

Bit work is done on ``int64`` values: numba promotes small unsigned integers to ``uint64`` and
mixes of ``uint64`` with ``int64`` to ``float64``, which would silently leave integer math.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from ._validate import BF16, FP16, FP32, as_kernel_array, check_range, chunking, run_with_threads

# Note [why no nnan/ninf fastmath]
# LLVM's nnan/ninf flags let it assume no value is NaN or inf: it may then fold
# `x != x` to false and drop the propagation of a non-finite gradient into the weights,
# which is exactly what overflow detection and torch parity need. 'arcp' and 'afn' would
# change the rounding of the divisions and square roots that torch.optim.AdamW performs
# exactly. Reductions allow 'reassoc' (several partial sums, so the loop vectorises; the
# float64 sums of squares are accurate either way) and 'contract' (harmless there: the
# square of an fp32 value is exact in float64, so a fused multiply-add rounds the same).
# Elementwise kernels allow nothing: Note [every specialisation rounds alike].
#
# Note [every specialisation rounds alike]
# numba compiles one specialisation of a kernel per argument dtype, and LLVM chooses per
# specialisation which multiplies and adds to fuse into an fma when 'contract' allows it:
# the Adam pass then rounded differently reading a bf16 gradient than reading the same
# values from an fp32 accumulator (1 ulp, in a third of the elements). Which buffer a
# bucket reads depends on bucket layout, early flushes and micro-batch count, so fast
# paths were not bitwise the plain one. Without any fast-math flag every operation is
# rounded as written, in every specialisation, so equal values give equal bits whatever
# buffers they come from. tests/test_kernels_vectorised.py checks the compiled IR of
# every specialisation for flags and fused multiply-adds; tests/test_kernels_bitwise.py
# checks the results.
FASTMATH_ELEMENTWISE: set[str] = set()
FASTMATH_REDUCTION = {"contract", "reassoc"}

# Note [error_model numpy]
# With numba's default error_model='python', every float division checks its divisor for
# zero so it can raise ZeroDivisionError; that branch alone stops LLVM from vectorising the
# loop (the Adam pass ran 3x slower). IEEE semantics (x/0 -> inf or NaN) are also what torch
# does, so every kernel uses error_model='numpy'.
KERNEL_OPTIONS = {"parallel": True, "cache": True, "nogil": True, "error_model": "numpy"}

# Note [numba cache and device functions]
# cache=True keys a kernel's cache entry on the file that defines the kernel only. A change
# to a device function here does not invalidate kernels cached from adam.py or stats.py:
# delete zero_offload/kernels/__pycache__/*.nbi and *.nbc after editing this file.


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE bits of a float32, zero-extended to int64."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


@intrinsic
def f32_from_bits(typingctx, b):
    """The float32 whose IEEE bits are the low 32 bits of an int64."""
    if not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(b), codegen


# Note [NaN bit patterns match torch]
# torch's vectorised CPU casts write every NaN as 0xFFFF in bf16, and in fp16 keep the sign
# and the top ten payload bits with the quiet bit set (the F16C instruction's rule). We copy
# both so a bit-level comparison with torch needs no special case.


@njit(cache=True, error_model="numpy")
def f32_to_bf16(x):
    """Round a float32 to bf16 bits (round to nearest even; NaN -> 0xFFFF as torch)."""
    u = f32_bits(x)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.int64(0xFFFF) if (u & 0x7FFFFFFF) > 0x7F800000 else rounded


@njit(cache=True, error_model="numpy")
def bf16_to_f32(h):
    """Widen bf16 bits (any integer type) to float32; exact."""
    return f32_from_bits(np.int64(h) << 16)


@njit(cache=True, error_model="numpy")
def f32_to_fp16(x):
    """Round a float32 to fp16 bits: nearest even, overflow to inf, subnormals exact."""
    u = f32_bits(x)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    # Normal result: rebias the exponent and round the 13 dropped bits to nearest even.
    # A carry out of the mantissa lands in the exponent, so 65520 rounds up to inf.
    normal = (a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13
    # Subnormal or zero result: shift the full mantissa right and round to nearest even.
    shift = min(max(126 - (a >> 23), 14), 31)
    mant = (a & 0x7FFFFF) | 0x800000
    q = mant >> shift
    rem = mant & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & (q & 1)))
    special = np.int64(0x7C00) if a <= 0x7F800000 else 0x7E00 | ((a >> 13) & 0x3FF)
    if a >= 0x47800000:
        res = special
    elif a >= 0x38800000:
        res = normal
    else:
        res = sub
    return res | sign


@njit(cache=True, error_model="numpy")
def fp16_to_f32(h):
    """Widen fp16 bits (any integer type) to float32; exact, subnormals included."""
    h = np.int64(h)
    sign = (h & 0x8000) << 16
    em = h & 0x7FFF
    exp = em >> 10
    if exp == 0:
        # mantissa * 2**-24: the integer's exact float32, its exponent lowered by 24 (still
        # normal); integer work only, so no fast-math flag of the caller can touch it
        mag = f32_bits(np.float32(em)) - (24 << 23) if em != 0 else np.int64(0)
    elif exp == 31:
        mag = (em << 13) + 0x70000000
    else:
        mag = (em << 13) + 0x38000000
    return f32_from_bits(sign | mag)


# Note [what is compile-time, what is a select]
# Whether an output or the AMSGrad buffer exists, and which 16-bit format ``out`` holds, is
# told by the array's dtype: uint8 (empty) = absent, uint16 = bf16 bits, int16 = fp16 bits.
# numba compiles one specialisation per dtype, so the inner loop contains no conditional
# store, which LLVM could not vectorise for 16-bit elements. The gradient's 16-bit format
# is a runtime select between two cheap decodes (both vectorise), which halves the number
# of specialisations to compile.


def load_f32(arr, i, kind):
    """``arr[i]`` as float32; a uint16 array is read as bf16 or fp16 bits by ``kind``."""


@overload(load_f32)
def _load_f32_impl(arr, i, kind):
    if arr.dtype == types.float32:
        return lambda arr, i, kind: arr[i]
    if arr.dtype == types.uint16:

        def load_half(arr, i, kind):
            h = arr[i]
            return bf16_to_f32(h) if kind == BF16 else fp16_to_f32(h)

        return load_half
    return None


def store_f32(arr, i, x):
    """``arr[i] = x`` rounded to the array's format; a no-op for a uint8 (absent) array."""


@overload(store_f32)
def _store_f32_impl(arr, i, x):
    if arr.dtype == types.float32:

        def store_float(arr, i, x):
            arr[i] = x

        return store_float
    if arr.dtype == types.uint16:

        def store_bf16(arr, i, x):
            arr[i] = np.uint16(f32_to_bf16(x))

        return store_bf16
    if arr.dtype == types.int16:

        def store_fp16(arr, i, x):
            arr[i] = np.int16(f32_to_fp16(x))

        return store_fp16
    if arr.dtype == types.uint8:
        return lambda arr, i, x: None
    return None


# Note [the update takes the written weights]
# Where the parameters are views of the home the update writes (parameter offload: the
# pinned home is the weights between uses), a write made since the last step (through the
# parameter or ``param.data``) is in ``out`` itself. So the update's own pass can do what
# the write check and ``StateStore.reconcile_master`` did before it: an element whose
# weight is not the training-dtype rounding of its master takes the weight, the others
# keep the master's extra bits (Note [weights written outside the optimizer] in
# views/param_views.py). ``taken_from_out`` is that rule for one element, the same
# comparison as ``store.take_written``'s (by value: -0 equals +0, a NaN never equals), on
# the master as loaded, before the step uses it. It reads ``out[i]``, which the pass then
# writes: the cache line is loaded for the store anyway, so the check costs no stream of
# its own where the cold hash of every weight and its reconcile cost one each
# (optim/update/reconcile.py decides where it is used).


#: ``taken_from_out``'s tags: an empty array whose dtype says, at compile time, whether the
#: update takes written weights (a runtime flag, or ``out`` passed again as a second array,
#: kept LLVM from vectorising the pass: 4.5x slower).
TAKE_WRITTEN = np.empty(0, dtype=np.int8)
KEEP_MASTER = np.empty(0, dtype=np.uint8)


def taken_tag(take: bool) -> np.ndarray:
    """``TAKE_WRITTEN`` or ``KEEP_MASTER``."""
    return TAKE_WRITTEN if take else KEEP_MASTER


def taken_from_out(tag, out, i, p):
    """``p``, or ``out[i]`` widened where ``out[i]`` is not ``p`` rounded to its format and
    ``tag`` is ``TAKE_WRITTEN`` (Note [the update takes the written weights])."""


@overload(taken_from_out)
def _taken_from_out_impl(tag, out, i, p):
    if tag.dtype == types.uint8 or out.dtype == types.uint8:
        return lambda tag, out, i, p: p
    if out.dtype == types.uint16:

        def take_bf16(tag, out, i, p):
            w = bf16_to_f32(out[i])
            return w if w != bf16_to_f32(f32_to_bf16(p)) else p

        return take_bf16
    if out.dtype == types.int16:

        def take_fp16(tag, out, i, p):
            # compared as bits, one decode (two kept LLVM from vectorising the pass): the
            # same as comparing values, as fp16 decodes one to one but for +-0 (equal
            # values) and NaN (never equal)
            r = f32_to_fp16(p)
            b = np.int64(np.uint16(out[i]))
            nan = (b & 0x7FFF) > 0x7C00 or (r & 0x7FFF) > 0x7C00
            differ = nan or (b != r and ((b | r) & 0x7FFF) != 0)
            return fp16_to_f32(b) if differ else p

        return take_fp16
    return None


def out_view(arr: np.ndarray | None, kind: int) -> np.ndarray:
    """The array ``store_f32`` writes ``kind`` into: int16 for fp16, uint8 (empty) if absent.

    See Note [what is compile-time, what is a select].
    """
    if arr is None:
        return np.empty(0, dtype=np.uint8)
    return arr.view(np.int16) if kind == FP16 else arr


@njit(fastmath=FASTMATH_ELEMENTWISE, **KERNEL_OPTIONS)
def _cast_kernel(src, dst, start, stop, nchunks):
    span = stop - start
    for c in prange(nchunks):
        # slices, see Note [one contiguous slice per thread] in adam.py
        lo = start + span * c // nchunks
        hi = start + span * (c + 1) // nchunks
        src_t, dst_t = src[lo:hi], dst[lo:hi]
        for i in range(hi - lo):
            store_f32(dst_t, i, src_t[i])


def cast_fp32(
    src, out, *, start: int = 0, stop: int | None = None, num_threads: int | None = None
) -> None:
    """Write ``src[start:stop]`` (fp32) into ``out[start:stop]`` as bf16 or fp16.

    Bit-exact with ``src.to(out.dtype)`` in torch (round to nearest even, fp16 overflow to
    inf, subnormals exact). ``src`` is a 1-D contiguous CPU fp32 tensor or numpy array;
    ``out`` a bf16/fp16 tensor, a float16 array, or a uint16 array holding bf16 bits.
    """
    src_a, _ = as_kernel_array(src, "src", (FP32,))
    out_a, out_kind = as_kernel_array(out, "out", (BF16, FP16), writable=True)
    if out_a.shape[0] != src_a.shape[0]:
        raise ValueError(
            f"out has {out_a.shape[0]} elements but src has {src_a.shape[0]}; "
            "pass arrays of the same length"
        )
    start, stop = check_range(start, stop, src_a.shape[0])
    dst = out_view(out_a, out_kind)
    run_with_threads(
        num_threads, lambda n: _cast_kernel(src_a, dst, start, stop, chunking(stop - start, n))
    )
