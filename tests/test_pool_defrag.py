"""Defragmentation: views re-pointed, the unregistered-pointer rule, overlap-safe moves, and a
randomized model check of alloc/free/record/defragment sequences.

See Note [views pin unregistered blocks] and Note [overlap-safe moves] in
zero_offload/memory/pool.py and moves.py.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from zero_offload.accelerator import Event, HostAccelerator
from zero_offload.errors import PoolExhausted
from zero_offload.memory.moves import move_chunked, move_within
from zero_offload.memory.pool import Block, BlockPool, BlockState

KiB = 1024


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """Position-dependent bytes, so a shifted or half-copied block shows."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + seed * 13) % 251).to(torch.uint8)


class Owner:
    """Keeps a view of its block and re-takes it in the on_move callback, as owners must."""

    def __init__(self, block: Block, seed: int) -> None:
        self.block = block
        self.moves = 0
        block.on_move(self.repoint)
        self.data = block.view(torch.uint8)
        self.data.copy_(pattern(block.nbytes, seed))

    def repoint(self, block: Block) -> None:
        self.moves += 1
        self.data = block.view(torch.uint8)


class ManualEvent(Event):
    """An event the test completes by hand; waiting on it completes it (the copy ran)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def completed_at(self) -> float | None:
        return 0.0 if self.done else None


@pytest.fixture
def acc() -> HostAccelerator:
    return HostAccelerator()


def test_defragment_repoints_registered_views_and_leaves_one_free_range(
    acc: HostAccelerator,
) -> None:
    pool = BlockPool.host(acc, 64 * KiB, name="d")
    owners = [Owner(pool.alloc(1000 + 300 * i), seed=i) for i in range(12)]
    for owner in owners[::3]:
        owner.block.free()
    kept = [o for i, o in enumerate(owners) if i % 3]
    moved = pool.defragment()
    assert moved == sum(o.block.nbytes for o in kept if o.moves)  # bytes_moved is exact
    assert all(o.moves == 1 for o in kept[1:])
    assert kept[0].block.offset == 0
    assert all(a.block.end == b.block.offset for a, b in pairwise(kept))  # packed, in order
    for i, owner in enumerate(owners):
        if owner in kept:
            assert torch.equal(owner.data, pattern(owner.block.nbytes, i))
    stats = pool.stats()
    assert stats["free_blocks"] == 1 and stats["fragmentation"] == 0.0
    assert stats["bytes_moved"] == moved and stats["defragmentations"] == 1


def test_view_without_callback_pins_the_block_in_place(acc: HostAccelerator) -> None:
    pool = BlockPool.host(acc, 16 * KiB, name="d")
    first = pool.alloc(2 * KiB)
    raw_owner = pool.alloc(1 * KiB, owner="raw")
    raw = raw_owner.view(torch.uint8)  # no callback: pinned in place for good
    raw.fill_(5)
    raw_owner.on_move(lambda b: None)  # too late: the earlier view may still be held
    mover = pool.alloc(1 * KiB, owner="never viewed")  # no view, no pointer to fix
    first.free()
    before = raw_owner.offset
    pool.defragment()
    assert raw_owner.pinned_in_place
    assert raw_owner.offset == before
    assert torch.all(raw == 5)  # the unregistered pointer still sees its data
    assert mover.offset == raw_owner.end  # slid down to the pinned block, no further
    assert not mover.pinned_in_place


def test_auto_defragment_when_request_fits_free_bytes_but_no_block(acc: HostAccelerator) -> None:
    pool = BlockPool.host(acc, 8 * KiB, name="d")
    owners = [Owner(pool.alloc(1 * KiB), seed=i) for i in range(8)]
    for owner in owners[::2]:
        owner.block.free()
    assert pool.stats()["largest_free_block"] == 1 * KiB
    big = pool.alloc(4 * KiB)  # fits 4 KiB free in total, not the 1 KiB holes
    assert big.offset == 4 * KiB
    assert pool.stats()["defragmentations"] == 1
    for i, owner in enumerate(owners):
        if i % 2:
            assert torch.equal(owner.data, pattern(1 * KiB, i))


def test_auto_defragment_can_be_turned_off(acc: HostAccelerator) -> None:
    pool = BlockPool.host(acc, 4 * KiB, name="d", auto_defragment=False)
    blocks = [pool.alloc(1 * KiB) for _ in range(4)]
    blocks[0].free()
    blocks[2].free()
    with pytest.raises(PoolExhausted, match="automatic defragmentation is off"):
        pool.alloc(2 * KiB)
    pool.defragment()
    assert pool.alloc(2 * KiB).offset == 2 * KiB


def test_defragment_waits_for_copies_into_live_blocks() -> None:
    from zero_offload.config import AcceleratorConfig

    acc = HostAccelerator(AcceleratorConfig(link_bandwidth=20e6))  # 256 KiB in ~13 ms
    stream = acc.new_stream("h2d")
    pool = BlockPool.host(acc, 1024 * KiB, name="d")
    hole = pool.alloc(256 * KiB)
    owner = Owner(pool.alloc(256 * KiB), seed=0)
    acc.copy_(owner.data, pattern(256 * KiB, 3), stream=stream)
    owner.block.record_event(stream.record_event())
    hole.free()
    pool.defragment()  # must wait for the copy, then move the block
    assert owner.block.offset == 0
    assert torch.equal(owner.data, pattern(256 * KiB, 3))
    assert pool.stats()["event_waits"] == 1


@settings(max_examples=150, deadline=None)
@given(
    nbytes=st.integers(1, 5000),
    distance=st.integers(1, 6000),
    staging=st.sampled_from([None, 1, 7, 64, 4096]),
)
def test_move_within_matches_memmove(nbytes: int, distance: int, staging: int | None) -> None:
    buffer = pattern(nbytes + distance, seed=1)
    expected = buffer.clone()
    expected[:nbytes] = buffer[distance:].clone()
    scratch = None if staging is None else torch.empty(staging, dtype=torch.uint8)
    chunked = buffer.clone()
    move_chunked(chunked, 0, distance, nbytes, staging=scratch)  # the path device pools take
    assert torch.equal(chunked, expected)
    move_within(buffer, 0, distance, nbytes, staging=None)  # a memmove on the CPU
    assert torch.equal(buffer, expected)


class PoolModel(RuleBasedStateMachine):
    """Random alloc/free/record/complete/defragment against a recount of the pool's state."""

    blocks = Bundle("blocks")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool.host(HostAccelerator(), 32 * KiB, name="model", alignment=256)
        self.owners: dict[Block, tuple[Owner | None, torch.Tensor | None, int]] = {}
        self.in_flight: dict[Block, list[ManualEvent]] = {}
        self.events: dict[Block, list[ManualEvent]] = {}
        self.seed = 0
        self.allocs = self.frees = 0

    @rule(
        target=blocks,
        nbytes=st.integers(1, 6000),
        align=st.sampled_from([None, None, 1024, 4096]),
        mode=st.sampled_from(["owner", "owner", "pinned", "none"]),
    )
    def alloc(self, nbytes: int, align: int | None, mode: str) -> Block | None:
        self.seed += 1
        try:
            block = self.pool.alloc(nbytes, align=align, owner=mode)
        except PoolExhausted:
            # Only after waiting and compacting: the free bytes truly hold no aligned slot.
            assert self.pool.stats()["largest_free_block"] < -(-nbytes // 256) * 256 + (
                align or 256
            )
            return None
        self.allocs += 1
        raw = None
        if mode == "pinned":
            raw = block.view(torch.uint8)
            raw.copy_(pattern(nbytes, self.seed))
        owner = Owner(block, self.seed) if mode == "owner" else None
        self.owners[block] = (owner, raw, self.seed)
        self.events[block] = []
        return block

    @rule(block=blocks)
    def record_pending_copy(self, block: Block | None) -> None:
        if block is not None and block.state is BlockState.IN_USE:
            event = ManualEvent()
            block.record_event(event)
            self.events[block].append(event)

    @rule(block=consumes(blocks))
    def free(self, block: Block | None) -> None:
        if block is None or block.state is not BlockState.IN_USE:
            return
        self.pool.free(block)
        self.frees += 1
        del self.owners[block]
        if block.state is BlockState.IN_FLIGHT:
            self.in_flight[block] = self.events[block]

    @rule()
    def complete_copies(self) -> None:
        for events in self.events.values():
            for event in events:
                event.done = True

    @rule()
    def defragment(self) -> None:
        pinned = {b: b.offset for b in self.owners if b.pinned_in_place}
        self.pool.defragment()
        assert all(b.offset == offset for b, offset in pinned.items())

    @invariant()
    def consistent(self) -> None:
        self.reclaimed_blocks_had_their_copies_done()
        self.blocks_are_disjoint_aligned_and_intact()
        self.stats_agree_with_a_recount()

    def reclaimed_blocks_had_their_copies_done(self) -> None:
        for block in list(self.in_flight):
            if block.state is BlockState.FREE:
                assert all(event.done for event in self.in_flight.pop(block))

    def blocks_are_disjoint_aligned_and_intact(self) -> None:
        occupied = sorted([*self.owners, *self.in_flight], key=lambda b: b.offset)
        for a, b in pairwise(occupied):
            assert a.end <= b.offset, f"{a} overlaps {b}"
        for block, (owner, raw, seed) in self.owners.items():
            assert block.offset % block.align == 0 and block.offset % 256 == 0
            data = owner.data if owner is not None else raw
            if data is not None:
                assert torch.equal(data, pattern(block.nbytes, seed)), block

    def stats_agree_with_a_recount(self) -> None:
        stats = self.pool.stats()  # reclaims blocks whose copies completed: they are free
        self.reclaimed_blocks_had_their_copies_done()
        occupied = sorted([*self.owners, *self.in_flight], key=lambda b: b.offset)
        gaps, cursor = [], 0
        for block in occupied:
            if block.offset > cursor:
                gaps.append(block.offset - cursor)
            cursor = block.end
        if cursor < stats["usable_bytes"]:
            gaps.append(stats["usable_bytes"] - cursor)
        free = sum(gaps)
        assert stats["bytes_in_use"] == sum(b.size for b in self.owners)
        assert stats["bytes_requested"] == sum(b.nbytes for b in self.owners)
        assert stats["bytes_in_flight"] == sum(b.size for b in self.in_flight)
        assert stats["bytes_free"] == free
        assert stats["free_blocks"] == len(gaps)
        assert stats["largest_free_block"] == max(gaps, default=0)
        assert stats["fragmentation"] == (0.0 if free == 0 else 1 - max(gaps) / free)
        assert (stats["live_blocks"], stats["in_flight_blocks"]) == (
            len(self.owners),
            len(self.in_flight),
        )
        assert (stats["allocations"], stats["frees"]) == (self.allocs, self.frees)
        assert stats["bytes_in_use"] <= stats["peak_bytes_in_use"]


TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)
