"""The library on the strict host accelerator (``accelerator/strict.py``): what strict mode
shows about code above ``accelerator/``. A CUDA bug strict mode finds is kept here as an
xfail naming the file that will fix it (issue 22), until it is fixed."""

from __future__ import annotations

import pytest
import torch

from zero_offload import AcceleratorConfig, HostAccelerator, OffloadAdamW, OffloadConfig
from zero_offload.accelerator.strict import host_memory_name, strict_device_checks
from zero_offload.demo.model import GPTConfig, TinyGPT

pytestmark = pytest.mark.simulator_only  # strict mode is the host accelerator's

VOCAB, SEQ = 64, 16


def _tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=4, hidden=32, heads=4))


def _train_with_parameter_offload(steps: int) -> tuple[TinyGPT, OffloadAdamW]:
    model = _tiny_gpt()
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        config=OffloadConfig(
            offload_parameters=True, prefetch_layers=1, bucket_bytes=16384, tile_elements=1024
        ),
        accelerator=HostAccelerator(AcceleratorConfig(strict=True, check_races=True)),
        model=model,
    )
    gen = torch.Generator().manual_seed(1)
    with strict_device_checks():
        for _ in range(steps):
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
            model(ids, ids).backward()
            opt.step()
            opt.zero_grad()
    return model, opt


def test_parameters_user_code_sees_between_steps_are_on_the_device():
    """Released parameters are zero-byte device tensors (Note [a released parameter] in
    params/released.py), never views of their pinned home; reading one fetches its unit."""
    model, opt = _train_with_parameter_offload(2)
    try:
        on_host = [name for name, p in model.named_parameters() if host_memory_name(p)]
        assert on_host == [], f"parameters user code sees in host memory: {on_host}"
    finally:
        opt.close()


def test_a_host_sync_leaves_no_block_in_flight_in_the_pool_stats():
    """A block freed with a compute event that a host sync completed is free in the stats
    (it counted as in flight, and its bytes as fragmentation, until a later alloc polled it:
    with compute events pending, as on CUDA, the activation pool reported fragmentation
    after every backward)."""
    from zero_offload.memory.pool import BlockPool

    acc = HostAccelerator(AcceleratorConfig(strict=True))
    pool = BlockPool.device(acc, 8192, name="activations")
    block = pool.alloc(4096, owner="layer 0 input")
    block.record_event(acc.current_stream().record_event())  # backward read it
    block.free()
    acc.synchronize()  # the backward is done: the block is free on every machine
    try:
        stats = pool.stats()
        assert (stats["bytes_in_flight"], stats["fragmentation"]) == (0, 0.0)
    finally:
        pool.close()
