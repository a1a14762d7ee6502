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


def _tile_ranges(rng: np.random.Generator, n: int) -> list[tuple[int, int, tuple[int, int] | None]]:
    """Pieces as a tile's host pass gives them, and harder: in order, gaps between them,
    odd offsets, empty pieces, pieces of several blocks, each counted whole, not at all,
    or by a cell begun before it (up to the previous piece's end) or reaching past it."""
    from zero_offload.kernels._validate import REDUCTION_BLOCK

    ranges: list[tuple[int, int, tuple[int, int] | None]] = []
    pos = prev_stop = 0
    while True:
        start = pos + int(rng.choice([0, 0, 1, int(rng.integers(1, 3000))]))
        length = int(rng.choice([0, 1, 7, REDUCTION_BLOCK, int(rng.integers(1, 90_000))]))
        stop = start + length
        if stop > n - 5000:
            break
        kind = int(rng.integers(0, 4))
        if kind == 0:
            counted = None
        elif kind == 1:
            counted = (start, stop)
        elif kind == 2:  # a cell's last piece: the cell begun before it
            counted = (int(rng.integers(prev_stop, start + 1)), stop)
        else:  # a range read after this piece, up to where the next piece may start
            counted = (int(rng.integers(prev_stop, start + 1)), stop + int(rng.integers(0, 50)))
            stop_next = counted[1]
            ranges.append((start, stop, counted))
            pos = prev_stop = stop_next
            continue
        ranges.append((start, stop, counted))
        pos = prev_stop = stop
    return ranges


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_many_ranges_in_one_launch_are_bitwise_the_calls_one_by_one(
    dtype: torch.dtype, overwrite: bool, threads: int
) -> None:
    # Note [one accumulation launch for many ranges]: the same accumulator bytes and the
    # same partials, in the same order, as one accumulate_grad call per range and a
    # grad_stats call after it for a range counted by a cell.
    from zero_offload.kernels import accumulate_grad_ranges, plan_accumulate_ranges

    n = 400_000
    rng = np.random.default_rng(7)
    src = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 3).to(dtype)
    start_acc = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    for seed in range(3):
        ranges = _tile_ranges(np.random.default_rng(seed), n)
        assert any(c is not None and c != (a, b) for a, b, c in ranges)
        one_by_one: list[float] = []
        acc_ref = start_acc.clone()
        for start, stop, counted in ranges:
            whole = counted == (start, stop)
            accumulate_grad(acc_ref, src, overwrite=overwrite, start=start, stop=stop,
                            num_threads=1, partials=one_by_one if whole else None)  # fmt: skip
            if counted is not None and not whole:
                grad_stats(acc_ref, start=counted[0], stop=counted[1], partials=one_by_one)
        together: list[float] = []
        acc = start_acc.clone()
        total, nonfinite = accumulate_grad_ranges(
            acc, src, ranges, overwrite=overwrite, num_threads=threads, partials=together
        )
        assert acc.view(torch.int32).equal(acc_ref.view(torch.int32))  # bitwise
        assert together == one_by_one  # bitwise, in order
        assert total == math.fsum(one_by_one) and not nonfinite
        # Planned once (Note [ranges planned once]): the same bytes and partials.
        planned: list[float] = []
        acc_planned = start_acc.clone()
        plan = plan_accumulate_ranges(ranges, n)
        accumulate_grad_ranges(
            acc_planned, src, plan, overwrite=overwrite, num_threads=threads, partials=planned
        )
        assert acc_planned.view(torch.int32).equal(acc_ref.view(torch.int32))
        assert planned == one_by_one
    assert accumulate_grad_ranges(acc, src, [], overwrite=overwrite, partials=together) == (
        0.0,
        False,
    )


def test_a_plan_is_refused_for_arrays_of_another_length_and_checked_when_made() -> None:
    from zero_offload.kernels import accumulate_grad_ranges, plan_accumulate_ranges

    plan = plan_accumulate_ranges([(1, 3, (1, 3)), (3, 4, None)], 12)
    acc, src = np.zeros(11, np.float32), np.ones(11, np.float32)
    with pytest.raises(ValueError, match=r"planned for an array of 12 elements but acc has 11"):
        accumulate_grad_ranges(acc, src, plan, overwrite=True)
    assert acc.tolist() == [0.0] * 11  # nothing written
    with pytest.raises(ValueError, match=r"ranges\[1\] starts at 2, before ranges\[0\] ends at 3"):
        plan_accumulate_ranges([(1, 3, None), (2, 4, None)], 12)
    assert plan_accumulate_ranges([], 12).empty


def test_many_ranges_flag_a_non_finite_and_touch_only_their_ranges() -> None:
    from zero_offload.kernels import accumulate_grad_ranges

    acc = np.zeros(12, np.float32)
    src = np.arange(12, dtype=np.float32)
    src[10] = np.inf
    partials: list[float] = []
    total, bad = accumulate_grad_ranges(
        acc, src, [(1, 3, (1, 3)), (3, 4, None), (5, 5, (5, 5)), (6, 8, (4, 8))],
        overwrite=True, partials=partials,
    )  # fmt: skip
    assert acc.tolist() == [0, 1, 2, 3, 0, 0, 6, 7, 0, 0, 0, 0]
    assert partials == [1 + 4, 0.0, 36 + 49] and (total, bad) == (90.0, False)
    assert accumulate_grad_ranges(acc, src, [(9, 11, (9, 11))], overwrite=False)[1] is True


def test_many_ranges_bad_input_names_the_argument_and_writes_nothing() -> None:
    from zero_offload.kernels import accumulate_grad_ranges

    acc = torch.zeros(10)
    src = torch.ones(10)
    cases = [
        (ValueError, r"src has 3 elements", dict(src=torch.ones(3))),
        (TypeError, r"acc has dtype torch.bfloat16", dict(acc=torch.zeros(10, dtype=torch.bfloat16))),
        (TypeError, r"overwrite must be a bool, got 1", dict(overwrite=1)),
        (TypeError, r"ranges must be a sequence of \(start, stop, counted\)", dict(ranges=[(0, 2)])),
        (TypeError, r"ranges must be a sequence of \(start, stop\) integer", dict(ranges=[(0.5, 2, None)])),
        (ValueError, r"ranges\[1\]: start=4, stop=11 is not a tile", dict(ranges=[(0, 2, None), (4, 11, None)])),
        (ValueError, r"ranges\[1\] starts at 1, before ranges\[0\] ends at 2", dict(ranges=[(0, 2, None), (1, 3, None)])),
        (TypeError, r"counted ranges must be a sequence of \(start, stop\)", dict(ranges=[(0, 2, (0, 1, 2))])),
        (ValueError, r"counted ranges\[0\]: start=3, stop=2", dict(ranges=[(0, 2, (3, 2))])),
        (ValueError, r"ranges\[0\] counts \(0, 5\), which reaches past the start 4 of ranges\[1\]",
         dict(ranges=[(0, 2, (0, 5)), (4, 6, None)])),
    ]  # fmt: skip
    for error, message, change in cases:
        args = {"acc": acc, "src": src, "ranges": [(0, 2, (0, 2))], "overwrite": True} | change
        with pytest.raises(error, match=message):
            accumulate_grad_ranges(args.pop("acc"), args.pop("src"), args.pop("ranges"), **args)
    assert torch.equal(acc, torch.zeros(10))
