"""fp32 -> bf16/fp16 conversion is bit-exact with torch's ``Tensor.to(dtype)``."""

import numpy as np
import pytest
import torch

from zero_offload.kernels import cast_fp32

SPECIAL = [
    0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
    3.4028234663852886e38, -3.4028234663852886e38,  # fp32 max: bf16 rounds to inf
    65504.0, 65519.99, 65520.0, 65536.0, 1e6, -1e6,  # fp16 max, last to round down, overflow
    6.103515625e-05, 6.0e-05, 5.960464477539063e-08, 2.98023223876953125e-08,  # fp16 subnormals
    2.9802326e-08, 1.0e-08, 1.401298464324817e-45, 1.1754942e-38,  # below half of the smallest
    1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,  # exact ties
    1.0 + 2.0**-8 + 2.0**-20, 1.0 + 2.0**-11 + 2.0**-20,  # just above ties
]  # fmt: skip
NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFF800001, 0x7FC12345, 0x7FFFFFFF]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _check(src: torch.Tensor, dtype: torch.dtype) -> None:
    out = torch.empty(src.numel(), dtype=dtype)
    cast_fp32(src, out)
    expected = src.to(dtype)
    mismatch = np.flatnonzero(_bits(out) != _bits(expected))
    assert mismatch.size == 0, (
        f"{mismatch.size} mismatches, first input bits "
        f"{src.view(torch.int32)[mismatch[0]].item() & 0xFFFFFFFF:#010x}: "
        f"got {_bits(out)[mismatch[0]]:#06x}, torch {_bits(expected)[mismatch[0]]:#06x}"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_special_values_bit_exact(dtype: torch.dtype) -> None:
    values = torch.tensor(SPECIAL, dtype=torch.float32)
    nans = torch.from_numpy(np.array(NAN_BITS, dtype=np.uint32).view(np.float32))
    src = torch.cat([values, -values, nans])
    _check(src, dtype)
    # also inside a long array, where torch's and our vectorised loops both run
    _check(src.repeat(37), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_random_bit_patterns_bit_exact(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    _check(torch.from_numpy(bits.view(np.float32)), dtype)
    # values in and around fp16's range, where rounding is the interesting part
    near = rng.standard_normal(1 << 18).astype(np.float32) * np.float32(2.0) ** rng.integers(
        -30, 18, size=1 << 18
    ).astype(np.float32)
    _check(torch.from_numpy(near), dtype)


def test_tile_writes_only_its_range() -> None:
    src = torch.randn(1000)
    out = torch.zeros(1000, dtype=torch.bfloat16)
    cast_fp32(src, out, start=100, stop=300)
    assert torch.equal(out[100:300], src[100:300].bfloat16())
    assert not out[:100].any() and not out[300:].any()


def test_numpy_arrays_uint16_means_bf16() -> None:
    src = np.linspace(-3, 3, 101, dtype=np.float32)
    out16 = np.empty(101, dtype=np.float16)
    cast_fp32(src, out16)
    assert np.array_equal(out16.view(np.uint16), src.astype(np.float16).view(np.uint16))
    outbf = np.empty(101, dtype=np.uint16)
    cast_fp32(src, outbf)
    assert np.array_equal(outbf, _bits(torch.from_numpy(src).bfloat16()))


def test_bad_out_dtype_names_argument() -> None:
    with pytest.raises(TypeError, match=r"out has dtype torch.float32"):
        cast_fp32(torch.zeros(4), torch.zeros(4))
