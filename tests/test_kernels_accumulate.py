"""accumulate_grad: bitwise torch's fp32 accumulation, statistics equal to grad_stats."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zero_offload.kernels import accumulate_grad, grad_stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 1000, 2**17 + 3])
def test_accumulation_is_torch_add_and_statistics_match(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    parts = [torch.randn(n, generator=gen).to(dtype) for _ in range(3)]
    acc = torch.empty(n)
    stats = accumulate_grad(acc, parts[0], overwrite=True)
    expected = parts[0].float()
    for part in parts[1:]:
        stats = accumulate_grad(acc, part, overwrite=False)
        expected.add_(part.float())
    assert torch.equal(acc, expected)
    ref_sumsq, ref_bad = grad_stats(expected)
    assert math.isclose(stats[0], ref_sumsq, rel_tol=1e-12) and stats[1] is ref_bad is False


def test_nonfinite_is_flagged_and_tiles_touch_only_their_range() -> None:
    acc = np.zeros(8, np.float32)
    src = np.arange(8, dtype=np.float32)
    src[6] = np.inf
    sumsq, bad = accumulate_grad(acc, src, overwrite=True, start=2, stop=5)
    assert sumsq == 4 + 9 + 16 and not bad
    assert acc.tolist() == [0, 0, 2, 3, 4, 0, 0, 0]
    assert accumulate_grad(acc, src, overwrite=False)[1] is True


def test_bad_input_names_the_argument_and_writes_nothing() -> None:
    acc = torch.zeros(4)
    with pytest.raises(ValueError, match="src has 3 elements"):
        accumulate_grad(acc, torch.ones(3), overwrite=True)
    with pytest.raises(TypeError, match="acc"):
        accumulate_grad(torch.zeros(4, dtype=torch.bfloat16), torch.ones(4), overwrite=True)
    with pytest.raises(TypeError, match="overwrite"):
        accumulate_grad(acc, torch.ones(4), overwrite=1)  # type: ignore[arg-type]
    assert torch.equal(acc, torch.zeros(4))
