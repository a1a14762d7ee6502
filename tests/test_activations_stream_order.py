"""Reloaded activations are built on the stream that fills them (issue 36): Note [a reloaded
view is built on the stream that fills it] in ``activations/layout.py``.

On the H200, CUDA's sanitizer reported the copy back of every reloaded activation: the
``set_`` that builds the view was recorded as a write on the default stream, and the copy on
``h2d`` did not wait for it. These tests run the same path under the host race checker and
strict mode, which declare the ``set_`` as the sanitizer records it, and show that the
checker reports the old order (the view built on the compute stream) and passes the new one.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from torch import nn

from zero_offload.accelerator import HostAccelerator
from zero_offload.accelerator.strict import strict_device_checks
from zero_offload.activations import ActivationOffloadConfig, ActivationOffloader, checkpoint
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import StreamError, StreamRaceError
from zero_offload.memory.manager import Tier, TieredMemoryManager

pytestmark = pytest.mark.simulator_only  # the race checker and strict mode are the host's


def _offloader(*, strict: bool = True) -> ActivationOffloader:
    accelerator = HostAccelerator(
        AcceleratorConfig(check_races=True, strict=strict, device_budget="1GiB")
    )
    config = ActivationOffloadConfig(
        min_bytes=0, host_pool_bytes=1 << 20, device_pool_bytes=1 << 20, prefetch_depth=1
    )
    return ActivationOffloader(accelerator=accelerator, config=config)


def _blocks(width: int = 32, depth: int = 4) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))


def _loss(blocks: nn.ModuleList, offloader: ActivationOffloader | None) -> torch.Tensor:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for block in blocks:
        x = block(x) if offloader is None else checkpoint(block, x, offloader=offloader)
    return x.square().sum()


def test_checkpointed_training_is_race_free_and_strict_clean() -> None:
    """Every block input goes out and comes back under the race checker and strict mode;
    the gradients are those of a run without offload."""
    offloader = _offloader()
    blocks, plain = _blocks(), _blocks()
    with strict_device_checks():
        for _ in range(2):
            _loss(blocks, offloader).backward()
    for _ in range(2):
        _loss(plain, None).backward()
    stats = offloader.stats()
    assert stats["reloads"] >= 4 and stats["prefetch_hits"] > 0
    assert offloader.accelerator.race_checker.accesses_checked > 0
    for a, b in zip(blocks.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    offloader.close()


def test_a_view_built_on_the_compute_stream_is_the_sanitizers_race() -> None:
    """The order the H200's sanitizer reported: the view's ``set_`` on the compute stream,
    then the copy back on ``h2d`` with no wait between them. The host checker names both."""
    offloader = _offloader(strict=False)
    accelerator = offloader.accelerator
    # The old code: the view built with whatever stream is current (compute).
    accelerator.stream_context = lambda stream: contextlib.nullcontext()  # type: ignore[method-assign]
    with pytest.raises(StreamRaceError, match=r"set_ building a reloaded activation's view"):
        _loss(_blocks(), offloader).backward()
    with contextlib.suppress(StreamError, StreamRaceError):
        offloader.close()


def test_stream_context_makes_a_stream_current_on_this_thread_only() -> None:
    accelerator = HostAccelerator(AcceleratorConfig(check_races=True))
    manager = TieredMemoryManager(accelerator)
    compute = accelerator.current_stream()
    seen: list[object] = []
    with accelerator.stream_context(manager.h2d):
        assert accelerator.current_stream() is manager.h2d
        other = threading.Thread(target=lambda: seen.append(accelerator.current_stream()))
        other.start()
        other.join()
        with accelerator.stream_context(manager.d2h):
            assert accelerator.current_stream() is manager.d2h
        assert accelerator.current_stream() is manager.h2d
    assert accelerator.current_stream() is compute
    assert seen == [compute]
    manager.close()


def test_a_storage_slice_of_a_tracked_buffer_is_checked_as_that_buffer() -> None:
    """A tensor over its own storage inside a pool buffer (a reloaded activation) is an
    access to the pool buffer: an unordered write from another stream is reported."""
    accelerator = HostAccelerator(AcceleratorConfig(check_races=True))
    manager = TieredMemoryManager(accelerator)
    pool = manager.create_pool(Tier.DEVICE, 8192, name="activations.device")
    flat = pool.alloc(4096, owner="layer 0").view(torch.uint8)
    start = flat.storage_offset()
    over = torch.empty(0, dtype=torch.uint8).set_(
        flat.untyped_storage()[start : start + 4096], 0, (4096,)
    )
    accelerator.declare_access(over, stream=manager.h2d, write=True, what="the h2d write")
    with pytest.raises(StreamRaceError, match=r"the compute write.*the h2d write"):
        accelerator.declare_access(
            over[64:128], stream=accelerator.current_stream(), write=True, what="the compute write"
        )
    manager.close()
