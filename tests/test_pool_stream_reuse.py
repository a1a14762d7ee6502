"""Stream-ordered block reuse and pool lifetimes: Note [block reuse waits on events] and Note
[a pool outlives its copies]. A simulated slow link keeps each copy pending long enough to
see who waits for it; the race checker shows the reuse is ordered on the stream."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import StreamRaceError
from zero_offload.memory.pool import BlockPool

pytestmark = pytest.mark.simulator_only  # a simulated slow link and the race checker

LATENCY = 0.4  # seconds each simulated copy takes
BLOCK = 4096


def _accelerator() -> HostAccelerator:
    return HostAccelerator(AcceleratorConfig(link_latency=LATENCY, check_races=True))


def _pending_read(acc: HostAccelerator, pool: BlockPool, stream, nbytes: int):
    """A block of ``pool`` with a slow copy out of it still running, freed (IN_FLIGHT)."""
    block = pool.alloc(nbytes, owner="gradient")
    out = acc.allocate_host(nbytes)
    acc.copy_(out, block.view(torch.uint8), stream=stream, label="grad out")
    end = stream.record_event()
    block.record_event(end)
    block.free()
    return end


def test_reuse_on_a_stream_waits_there_not_on_the_cpu():
    acc = _accelerator()
    d2h, h2d = acc.new_stream("d2h"), acc.new_stream("h2d")
    pool = BlockPool.device(acc, BLOCK, name="grads")
    end = _pending_read(acc, pool, d2h, BLOCK)
    began = time.perf_counter()
    block = pool.alloc(BLOCK, owner="next gradient", stream=h2d)
    assert time.perf_counter() - began < LATENCY / 4  # the CPU did not wait for the copy
    assert not end.query()
    stats = pool.stats()
    assert (stats["event_waits"], stats["stream_reuses"], stats["bytes_in_flight"]) == (0, 1, 0)
    # h2d waits on the old copy's event, so writing the reused bytes there is ordered.
    acc.copy_(block.view(torch.uint8), acc.allocate_host(BLOCK), stream=h2d, label="in")
    h2d.synchronize()
    assert end.query()
    block.free()
    pool.close()


def test_without_a_stream_the_cpu_waits():
    acc = _accelerator()
    d2h = acc.new_stream("d2h")
    pool = BlockPool.device(acc, BLOCK, name="grads")
    _pending_read(acc, pool, d2h, BLOCK)
    began = time.perf_counter()
    pool.alloc(BLOCK, owner="next gradient").free()
    assert time.perf_counter() - began >= LATENCY / 2
    assert pool.stats()["event_waits"] == 1
    pool.close()


def test_reused_bytes_touched_on_another_stream_are_a_race():
    acc = _accelerator()
    d2h, h2d = acc.new_stream("d2h"), acc.new_stream("h2d")
    pool = BlockPool.device(acc, BLOCK, name="grads")
    _pending_read(acc, pool, d2h, BLOCK)
    block = pool.alloc(BLOCK, owner="next gradient", stream=h2d)
    compute = acc.current_stream()
    with pytest.raises(StreamRaceError, match=r"pool 'grads'.*block next gradient.*'d2h'"):
        # Promised h2d, used on compute: compute never waited for the old copy.
        acc.declare_access(block.view(torch.uint8), stream=compute, write=True, what="backward")
    d2h.synchronize()
    block.free()
    pool.close()


def test_the_unused_tail_of_a_reused_block_stays_in_flight():
    acc = _accelerator()
    d2h, h2d = acc.new_stream("d2h"), acc.new_stream("h2d")
    pool = BlockPool.device(acc, 2 * BLOCK, name="grads")
    end = _pending_read(acc, pool, d2h, 2 * BLOCK)
    head = pool.alloc(BLOCK, owner="head", stream=h2d)
    assert head.offset == 0 and pool.stats()["bytes_in_flight"] == BLOCK
    tail = pool.alloc(BLOCK, owner="tail", stream=h2d)  # the tail, reused on h2d too
    assert tail.offset == BLOCK and pool.stats()["stream_reuses"] == 2
    head.free()
    tail.free()  # both inherited the pending event: IN_FLIGHT again
    assert pool.stats()["in_flight_blocks"] == 2
    end.synchronize()
    pool.close()


def test_a_dropped_pool_releases_its_buffer_only_after_its_copies():
    acc = _accelerator()
    d2h = acc.new_stream("d2h")
    pool = BlockPool.device(acc, BLOCK, name="dropped")
    end = _pending_read(acc, pool, d2h, BLOCK)
    assert acc.memory_stats()["in_use"] == BLOCK
    del pool  # no close(): an optimizer a Trainer let go of
    gc.collect()
    assert end.query()  # the finalizer waited for the copy before releasing
    assert acc.memory_stats()["in_use"] == 0


def test_defragmentation_of_a_block_whose_copy_was_not_recorded_is_a_race():
    # The owner forgot block.record_event(end): the pool thinks the block idle and moves it
    # while the d2h copy may still read it. The checker names the pair before a byte moves.
    acc = _accelerator()
    d2h = acc.new_stream("d2h")
    pool = BlockPool.device(acc, 3 * BLOCK, name="acts")
    first = pool.alloc(BLOCK, owner="first")
    second = pool.alloc(BLOCK, owner="second")
    second.on_move(lambda block: None)  # movable: its views are re-taken on a move
    out = acc.allocate_host(BLOCK)
    acc.copy_(out, second.view(torch.uint8), stream=d2h, label="activation out")
    first.free()
    with pytest.raises(StreamRaceError, match=r"defragmentation moving second.*'d2h'"):
        pool.defragment()
    assert second.offset == BLOCK  # nothing moved
    d2h.synchronize()
    pool.defragment()  # ordered now: the host synchronised the copy
    assert second.offset == 0
    second.free()
    pool.close()
