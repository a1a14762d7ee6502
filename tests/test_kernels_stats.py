"""grad_stats: float64-accurate sum of squares and the non-finite flag in one pass."""

import math

import numpy as np
import pytest
import torch

from zero_offload.kernels import grad_stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [0, 1, 7, 100_003])
def test_sum_of_squares_matches_float64(dtype, n) -> None:
    g = (torch.randn(n) * 3).to(dtype)
    total, nonfinite = grad_stats(g)
    expected = float((g.double() ** 2).sum())
    assert not nonfinite
    assert math.isclose(total, expected, rel_tol=1e-12, abs_tol=1e-300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_is_flagged(dtype, bad) -> None:
    g = torch.randn(70_001).to(dtype)
    g[54_321] = bad
    _, nonfinite = grad_stats(g)
    assert nonfinite
    assert not grad_stats(g, stop=54_321)[1]


def test_large_finite_values_do_not_overflow() -> None:
    g = torch.full((1000,), 3.0e38)
    total, nonfinite = grad_stats(g)
    assert not nonfinite and math.isclose(total, 1000 * 3.0e38**2, rel_tol=1e-6)


def test_tiles_sum_to_whole() -> None:
    g = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    whole, _ = grad_stats(g)
    parts = sum(
        grad_stats(g, start=a, stop=b)[0] for a, b in [(0, 5), (5, 150_000), (150_000, 300_000)]
    )
    assert math.isclose(whole, parts, rel_tol=1e-13)


def test_bad_range_names_argument() -> None:
    with pytest.raises(ValueError, match=r"start=5, stop=3"):
        grad_stats(torch.ones(4), start=5, stop=3)
    with pytest.raises(TypeError, match=r"grad has dtype torch.int64"):
        grad_stats(torch.ones(4, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_many_ranges_in_one_launch_are_bitwise_each_range_alone(dtype) -> None:
    # Note [one launch for many ranges]: the same block sums, in the same order, as one
    # grad_stats call per range (empty, short, exactly a block, several blocks, overlaps).
    from zero_offload.kernels import grad_stats_ranges
    from zero_offload.kernels._validate import REDUCTION_BLOCK

    rng = np.random.default_rng(3)
    g = torch.from_numpy(rng.standard_normal(300_000).astype(np.float32) * 5).to(dtype)
    ranges = [(0, 0), (5, 17), (17, 17 + REDUCTION_BLOCK), (40_000, 250_001), (7, 9)]
    ranges += [(int(a), int(a + b)) for a, b in zip(rng.integers(0, 200_000, 40),
                                                    rng.integers(0, 90_000, 40), strict=True)]  # fmt: skip
    one_by_one: list[float] = []
    for start, stop in ranges:
        grad_stats(g, start=start, stop=stop, partials=one_by_one)
    together: list[float] = []
    total, nonfinite = grad_stats_ranges(g, ranges, num_threads=2, partials=together)
    assert together == one_by_one  # bitwise, in order
    assert total == math.fsum(one_by_one) and not nonfinite
    assert grad_stats_ranges(g, [], partials=together) == (0.0, False)
    with pytest.raises(ValueError, match="start=10, stop=5"):
        grad_stats_ranges(g, [(0, 3), (10, 5)])
    g[123] = float("nan")
    assert grad_stats_ranges(g, [(0, 3), (100, 200)])[1]


def test_ranges_planned_once_launch_the_same_sums() -> None:
    # Note [ranges planned once]: a plan gives the partials of the same ranges as a
    # sequence, bitwise; it is refused for an array of another length, naming both; a bad
    # range is refused when it is planned.
    from zero_offload.kernels import grad_stats_ranges, plan_stats_ranges

    rng = np.random.default_rng(5)
    g = torch.from_numpy(rng.standard_normal(50_000).astype(np.float32))
    ranges = [(0, 0), (3, 9000), (9000, 9001), (20_000, 49_999)]
    plan = plan_stats_ranges(ranges, g.numel())
    direct: list[float] = []
    by_plan: list[float] = []
    assert grad_stats_ranges(g, ranges, partials=direct) == grad_stats_ranges(
        g, plan, partials=by_plan
    )
    assert by_plan == direct
    with pytest.raises(
        ValueError, match=r"planned for an array of 50000 elements but grad has 49999"
    ):
        grad_stats_ranges(g[:-1], plan)
    with pytest.raises(ValueError, match="start=10, stop=5"):
        plan_stats_ranges([(0, 3), (10, 5)], 100)
