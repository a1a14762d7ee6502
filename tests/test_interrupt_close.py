"""A Ctrl-C (KeyboardInterrupt) that lands while a block goes back to its pool, in backward or
inside ``close()``: the optimizer still closes, and gives its device memory back at once
(Notes [a block an interrupt orphaned] and [a release cut short] in optim/lifetime.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from zero_offload.memory.block import Block
from zero_offload.memory.pool import BlockPool

from .helpers.models import (
    batches,
    host_accelerator,
    lm_loss,
    make_pair,
    max_diff,
    offload_opt,
    torch_adamw,
    train,
)


@pytest.fixture
def interrupt_a_free(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The n-th ``BlockPool.free`` from now raises KeyboardInterrupt before the pool takes
    the block back (n: the list's first item; 0 switches it off)."""
    real = BlockPool.free
    left = [0]

    def free(self: BlockPool, block: Block) -> None:
        if left[0] > 0:
            left[0] -= 1
            if left[0] == 0:
                raise KeyboardInterrupt(f"Ctrl-C as {self.name} frees {block.owner}")
        real(self, block)

    monkeypatch.setattr(BlockPool, "free", free)
    yield left


@pytest.mark.parametrize("nth", [1, 2])  # the frees of a backward and step here
def test_a_free_interrupted_in_backward_does_not_stop_close(
    interrupt_a_free: list[int], nth: int
) -> None:
    """close() refused for good ("cannot close pool ...: 1 blocks are still in use (owners:
    bucket2.grad); free them first") and the device pool stayed allocated."""
    data = batches(4)
    acc = host_accelerator()
    model, ref = make_pair()
    opt, ropt = offload_opt(model, accelerator=acc), torch_adamw(ref)
    train(model, opt, data[:1])
    train(ref, ropt, data[:1])
    interrupt_a_free[0] = nth
    with pytest.raises(KeyboardInterrupt):
        lm_loss(model, *data[1]).backward()
        opt.step()
    interrupt_a_free[0] = 0
    opt.zero_grad()  # the documented recovery: the interrupted step is redone
    train(model, opt, data[1:4])
    train(ref, ropt, data[1:4])
    assert max_diff(model, ref) < 1e-5
    opt.close()
    assert acc.memory_stats()["in_use"] == 0
    assert opt.manager.pool_stats() == {}


@pytest.mark.parametrize("nth", [1, 2, 5])
def test_close_again_after_a_ctrl_c_inside_close_gives_the_memory_back(
    interrupt_a_free: list[int], nth: int
) -> None:
    """The second close() returned at once and the device pool (weights and gradient
    buffers) stayed allocated while the optimizer was referenced (an LR scheduler holds it)."""
    acc = host_accelerator()
    model, _ = make_pair()
    opt = offload_opt(model, accelerator=acc)
    train(model, opt, batches(1))
    assert acc.memory_stats()["in_use"] > 0
    interrupt_a_free[0] = nth
    with pytest.raises(KeyboardInterrupt):
        opt.close()
    interrupt_a_free[0] = 0
    opt.close()
    assert opt.closed
    assert acc.memory_stats()["in_use"] == 0  # while `opt` is still referenced here
    assert opt.manager.pool_stats() == {}
    opt.close()  # nothing more to do
