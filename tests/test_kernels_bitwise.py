"""Equal values give equal bits, whichever buffers hold them (Note [every specialisation
rounds alike] in convert.py; Note [sums do not depend on the threads] in _validate.py).

The optimizer reads a gradient from bf16/fp16 staging or from the fp32 accumulator
depending on bucket layout, early flushes and micro-batches, and runs its passes on
varying thread counts; the fast paths are promised bitwise equal to the plain one. So the
same gradient values, given in a 16-bit buffer and in an fp32 buffer, must produce
identical master weights, moments and output weights, and identical sums of squares, on
any number of threads.
"""

from __future__ import annotations

import numba
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_offload.kernels import accumulate_grad, adam_step, grad_stats

from .helpers.properties import scaled

POOL = numba.config.NUMBA_NUM_THREADS
SIZES = st.one_of(
    st.integers(1, 70),  # shorter than one vector, and the vector loop's remainders
    st.integers(71, 5000),
    st.sampled_from([32768, 32769, 65536 + 17, 3 * 32768 - 1]),  # several threads/blocks
)
SPECIALS = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3e38])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN payloads compare too)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _gradient(n: int, seed: int, dtype: torch.dtype, specials: bool) -> tuple[torch.Tensor, ...]:
    """A ``dtype`` (bf16 or fp16) gradient and the same values in fp32, widened by the
    accumulation kernel as the optimizer's accumulator is (torch widens fp16 NaN payloads
    differently on different code paths; the optimizer only ever uses ours)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n, generator=gen) * 4)  # magnitudes over many binades
    x = torch.randn(n, generator=gen) * scale
    if specials:
        where = torch.randint(0, n, (max(1, n // 8),), generator=gen)
        x[where] = SPECIALS[torch.randint(0, len(SPECIALS), where.shape, generator=gen)]
    half = x.to(dtype)
    wide = torch.empty(n)
    accumulate_grad(wide, half, overwrite=True)
    torch.testing.assert_close(wide, half.float(), rtol=0, atol=0, equal_nan=True)
    return half, wide


@st.composite
def adam_cases(draw: st.DrawFn) -> dict:
    n = draw(SIZES)
    start = draw(st.integers(0, n))
    return {
        "n": n,
        "start": start,
        "stop": draw(st.integers(start, n)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "grad_dtype": draw(st.sampled_from([torch.bfloat16, torch.float16])),
        "specials": draw(st.booleans()),
        "moments": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "amsgrad": draw(st.booleans()),
        "out": draw(st.sampled_from([None, torch.bfloat16, torch.float16])),
        "threads": draw(st.integers(1, POOL)),
        "hyper": {
            "step": draw(st.integers(1, 10_000)),
            "lr": draw(st.sampled_from([0.0, 1e-4, 1e-3, 0.1, 1.0])),
            # both sides of 0.5: the lerp takes a different form (Note [operation order])
            "beta1": draw(st.sampled_from([0.0, 0.3, 0.5, 0.9, 0.99])),
            "beta2": draw(st.sampled_from([0.0, 0.9, 0.999, 0.9999])),
            "eps": draw(st.sampled_from([0.0, 1e-8, 1e-6, 0.1])),
            "weight_decay": draw(st.sampled_from([0.0, 0.01, 0.1])),
            "decoupled_weight_decay": draw(st.booleans()),
            "maximize": draw(st.booleans()),
            "grad_scale": draw(
                st.one_of(
                    st.sampled_from([1.0, 0.5, 2.0**-16, 65536.0]),
                    st.floats(1e-6, 1e3, allow_nan=False),
                )
            ),
        },
    }


def _adam(case: dict, grad: torch.Tensor) -> list[torch.Tensor]:
    n = case["n"]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    param = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 1e-2).to(case["moments"])
    v = (torch.rand(n, generator=gen) * 1e-4).to(case["moments"])
    vmax = (v * 1.5).to(case["moments"]) if case["amsgrad"] else None
    out = None if case["out"] is None else torch.zeros(n, dtype=case["out"])
    adam_step(
        param, grad, m, v, max_exp_avg_sq=vmax, out=out, start=case["start"],
        stop=case["stop"], num_threads=case["threads"], **case["hyper"],
    )  # fmt: skip
    return [t for t in (param, m, v, vmax, out) if t is not None]


@settings(max_examples=scaled(60))
@given(case=adam_cases())
def test_adam_is_bitwise_the_same_from_a_16_bit_or_an_fp32_gradient(case: dict) -> None:
    half, wide = _gradient(case["n"], case["seed"], case["grad_dtype"], case["specials"])
    from_half = _adam(case, half)
    from_fp32 = _adam(case, wide)
    for a, b in zip(from_half, from_fp32, strict=True):
        assert torch.equal(_bits(a), _bits(b))


@settings(max_examples=scaled(40))
@given(
    n=SIZES,
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    specials=st.booleans(),
    data=st.data(),
)
def test_sums_of_squares_are_bitwise_the_same_from_any_buffer_on_any_threads(
    n: int, seed: int, dtype: torch.dtype, specials: bool, data: st.DataObject
) -> None:
    start = data.draw(st.integers(0, n), label="start")
    stop = data.draw(st.integers(start, n), label="stop")
    half, values = _gradient(n, seed, dtype, specials)
    sums = set()
    for threads in {1, POOL}:
        sums.add(grad_stats(half, start=start, stop=stop, num_threads=threads))
        sums.add(grad_stats(values, start=start, stop=stop, num_threads=threads))
        acc = torch.full((n,), 7.0)
        sums.add(accumulate_grad(acc, half, overwrite=True, start=start, stop=stop,
                                 num_threads=threads))  # fmt: skip
        assert torch.equal(_bits(acc[start:stop]), _bits(values[start:stop]))
    # NaN != NaN: compare the sums' bits through their repr
    assert len({(repr(total), flag) for total, flag in sums}) == 1, sums


@pytest.mark.parametrize("threads", sorted({1, POOL}))
def test_accumulated_sum_is_the_sum_of_the_accumulator(threads: int) -> None:
    # The accumulation pass's statistics are those a separate pass over the result gives.
    n = 3 * 32768 + 5
    acc = _gradient(n, 1, torch.bfloat16, False)[1]
    src = _gradient(n, 2, torch.bfloat16, False)[0]
    total, _ = accumulate_grad(acc, src, overwrite=False, num_threads=threads)
    assert total == grad_stats(acc, num_threads=1)[0] == grad_stats(acc, num_threads=POOL)[0]
