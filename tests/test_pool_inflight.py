"""InFlight: a buffer handed out only after (host) or behind (stream) its pending copies;
Note [a buffer travels with its events]."""

from __future__ import annotations

import time

import pytest
import torch

from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import StreamRaceError
from zero_offload.memory.buffer_lifetime import InFlight

LATENCY = 0.3


def _pending_copy():
    acc = HostAccelerator(AcceleratorConfig(link_latency=LATENCY, check_races=True))
    d2h, h2d = acc.new_stream("d2h"), acc.new_stream("h2d")
    staging = acc.allocate_host(1024)
    acc.copy_(staging, acc.allocate_device(1024, what="grad").tensor, stream=d2h, label="out")
    return acc, h2d, InFlight(staging, [d2h.record_event()])


def test_wait_hands_the_buffer_out_after_its_copies():
    acc, _, held = _pending_copy()
    assert not held.done() and len(held.pending()) == 1
    began = time.perf_counter()
    staging = held.wait()
    assert time.perf_counter() - began >= LATENCY / 2 and held.done()
    acc.declare_access(staging, stream=None, write=True, what="CPU reuse")  # ordered: no race


def test_use_on_orders_a_stream_without_blocking_the_cpu():
    acc, h2d, held = _pending_copy()
    began = time.perf_counter()
    staging = held.use_on(h2d)
    assert time.perf_counter() - began < LATENCY / 4
    acc.declare_access(staging, stream=h2d, write=True, what="h2d reuse")  # ordered on h2d
    with pytest.raises(StreamRaceError, match="CPU reuse"):
        acc.declare_access(staging, stream=None, write=True, what="CPU reuse")  # not on the CPU
    h2d.synchronize()


def test_only_events_travel_with_a_buffer():
    with pytest.raises(TypeError, match="takes an accelerator Event"):
        InFlight(torch.empty(1), [object()])  # type: ignore[list-item]
