"""The kernels' inner loops vectorise (Note [one contiguous slice per thread], adam.py).

A loop that indexes the whole array with ``lo + i`` makes numba wrap negative indices, and
that check alone keeps LLVM from vectorising it: the statistics pass then ran 7x slower than
the memory allows, with every result still right. (LLVM did vectorise the arithmetic, but
fetched each lane with a gather, one address per element.) So this is checked on the
compiled code, not on the results: each tile loop is compiled afresh (no cache) for the
argument types the optimizer passes, and its LLVM IR must load whole vectors from
contiguous memory and gather nothing.
"""

from __future__ import annotations

import re

import pytest
from numba import njit, types

from zero_offload.kernels import accumulate, adafactor, adafactor_stats, adam, convert, stats

F32 = types.Array(types.float32, 1, "C")
U16 = types.Array(types.uint16, 1, "C")  # bf16 bits
I16 = types.Array(types.int16, 1, "C")  # fp16 bits (the kernels' out view)
NONE = types.Array(types.uint8, 1, "C")  # an absent array
TAKE = types.Array(types.int8, 1, "C")  # convert.TAKE_WRITTEN's type (KEEP_MASTER's: NONE)
VECTOR_LOAD = re.compile(r"= load <\d+ x (?:float|i16)>")


def _vectorised(fn, fastmath: set[str], signature: tuple) -> bool:
    dispatcher = njit(fastmath=fastmath, error_model="numpy")(fn.py_func)
    dispatcher.compile(signature)
    ir = dispatcher.inspect_llvm(signature)
    return VECTOR_LOAD.search(ir) is not None and "masked.gather" not in ir


@pytest.mark.parametrize("grad", [F32, U16], ids=["fp32", "bf16"])
def test_statistics_loop_vectorises(grad) -> None:
    signature = (grad, types.int64)
    assert _vectorised(stats._sumsq_tile, convert.FASTMATH_REDUCTION, signature)


@pytest.mark.parametrize("src", [F32, U16], ids=["fp32", "bf16"])
def test_accumulation_loop_vectorises(src) -> None:
    signature = (F32, src, types.int64, types.boolean)
    assert _vectorised(accumulate._accumulate_tile, convert.FASTMATH_REDUCTION, signature)


@pytest.mark.parametrize(
    ("grad", "out", "take"),
    [(F32, NONE, NONE), (U16, U16, NONE), (U16, U16, TAKE), (U16, I16, TAKE)],
    ids=["fp32", "bf16-in-bf16-out", "bf16-out-taking-written", "fp16-out-taking-written"],
)
def test_adam_loop_vectorises(grad, out, take) -> None:
    # taking written weights (Note [the update takes the written weights]) is a select
    # on values the loop loads anyway: it must not cost the loop its vectors
    f32 = types.float32
    signature = (F32, grad, types.int64, F32, F32, NONE, out, take, f32, f32, f32,
                 types.boolean, f32, f32, f32, f32, f32, f32, f32)  # fmt: skip
    assert _vectorised(adam._adam_tile, convert.FASTMATH_ELEMENTWISE, signature)


# Note [every specialisation rounds alike] (convert.py): no fast-math flag, no fused
# multiply-add, in any specialisation of the Adam loop, so each rounds every operation as
# written and equal values give equal bits whatever buffers hold them.
FAST_MATH_FLAG = re.compile(r"\b(?:fast|reassoc|contract|nnan|ninf|nsz|arcp|afn)\b")
FUSED = re.compile(r"llvm\.(?:fma|fmuladd)\.")
FMA_INSTRUCTION = re.compile(r"\bvf(?:n?m(?:add|sub)|maddsub|msubadd)\d", re.IGNORECASE)


@pytest.mark.parametrize("grad", [F32, U16], ids=["grad-fp32", "grad-16bit"])
@pytest.mark.parametrize("moments", [F32, U16], ids=["moments-fp32", "moments-bf16"])
@pytest.mark.parametrize("vmax", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize(
    ("out", "take"),
    [(NONE, NONE), (U16, NONE), (I16, NONE), (U16, TAKE), (I16, TAKE)],
    ids=["no-out", "bf16-out", "fp16-out", "bf16-out-taking", "fp16-out-taking"],
)
def test_adam_loop_fuses_nothing_in_any_specialisation(grad, moments, vmax, out, take) -> None:
    f32 = types.float32
    signature = (F32, grad, types.int64, moments, moments, moments if vmax else NONE, out,
                 take, f32, f32, f32, types.boolean, f32, f32, f32, f32, f32, f32, f32)  # fmt: skip
    dispatcher = njit(fastmath=convert.FASTMATH_ELEMENTWISE, error_model="numpy")(
        adam._adam_tile.py_func
    )
    dispatcher.compile(signature)
    ir = dispatcher.inspect_llvm(signature)
    assert "fdiv" in ir and "fmul" in ir  # the arithmetic is there to be checked
    assert FAST_MATH_FLAG.search(ir) is None
    assert FUSED.search(ir) is None
    assert FMA_INSTRUCTION.search(dispatcher.inspect_asm(signature)) is None


@pytest.mark.parametrize("grad", [F32, U16], ids=["fp32", "bf16"])
def test_adafactor_column_squares_vectorise_and_fuse_nothing(grad) -> None:
    """Pass 1's four-row loop into fp32 column sums (Note [pass 1 four rows at a time] in
    adafactor_stats.py)."""
    f32 = types.float32
    signature = (grad, grad, grad, grad, types.int64, f32, f32, f32, f32, f32, F32, F32)
    fn = adafactor_stats._squares_4rows
    assert _vectorised(fn, convert.FASTMATH_ELEMENTWISE, signature)
    dispatcher = njit(fastmath=convert.FASTMATH_ELEMENTWISE, error_model="numpy")(fn.py_func)
    dispatcher.compile(signature)
    ir = dispatcher.inspect_llvm(signature)
    assert FAST_MATH_FLAG.search(ir) is None
    assert FUSED.search(ir) is None
    assert FMA_INSTRUCTION.search(dispatcher.inspect_asm(signature)) is None


@pytest.mark.parametrize("grad", [F32, U16], ids=["fp32", "bf16"])
def test_adafactor_update_loop_vectorises_and_fuses_nothing(grad) -> None:
    """U over a row chunk from the row's and the columns' factors: two multiplies and a
    select, no division (Note [the update from the factors] in adafactor.py)."""
    f32 = types.float32
    signature = (grad, types.int64, f32, F32, f32, f32, F32)
    fn = adafactor._u_row
    assert _vectorised(fn, convert.FASTMATH_ELEMENTWISE, signature)
    dispatcher = njit(fastmath=convert.FASTMATH_ELEMENTWISE, error_model="numpy")(fn.py_func)
    dispatcher.compile(signature)
    ir = dispatcher.inspect_llvm(signature)
    assert "fmul" in ir and "fdiv" not in ir and "sqrt" not in ir
    assert FAST_MATH_FLAG.search(ir) is None
    assert FUSED.search(ir) is None
    assert FMA_INSTRUCTION.search(dispatcher.inspect_asm(signature)) is None


@pytest.mark.parametrize("grad", [F32, U16], ids=["fp32", "bf16"])
def test_muon_passes_vectorise_and_fuse_only_the_written_fmas(grad) -> None:
    """Muon's two host passes (Note [Muon's host passes] in muon.py): torch's lerp and add
    with alpha are fused multiply-adds, written as such (llvm.fma, vectorised), and nothing
    else is fused or flagged."""
    from zero_offload.kernels import muon

    f32 = types.float32
    passes = [
        (muon._momentum_tile, (grad, types.int64, F32, U16, types.boolean, f32, f32,
                               types.boolean, f32, types.boolean, types.boolean)),
        (muon._apply_tile, (F32, U16, U16, f32, f32)),
    ]  # fmt: skip
    for fn, signature in passes:
        assert _vectorised(fn, convert.FASTMATH_ELEMENTWISE, signature)
        dispatcher = njit(fastmath=convert.FASTMATH_ELEMENTWISE, error_model="numpy")(fn.py_func)
        dispatcher.compile(signature)
        ir = dispatcher.inspect_llvm(signature)
        assert re.search(r"llvm\.fma\.v\d+f32", ir)  # the written fmas, vectorised
        assert "fmuladd" not in ir  # and none of LLVM's own
        assert FAST_MATH_FLAG.search(ir) is None
