"""Closed or dropped, an optimizer and an activation offloader give back their pools and
threads at once, by reference counting alone: nothing waits for ``gc.collect()`` (Note
[lifetimes without close] in ``optim/lifetime.py``, Note [an offloader released without
close] in ``activations/release.py``).

Every check is exact and runs with the cyclic garbage collector disabled: the library's
threads by name (``zero_offload:``), the device ledger's ``in_use`` bytes, whether a pool's
buffer is still referenced (a weakref to its ``UntypedStorage``, which dies with the last view
of the buffer), and the library objects that only the collector could free (none). RSS is
not measured: the allocator and the page cache make it noisy on a busy machine.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdamW, StreamError
from zero_offload.accelerator import Accelerator
from zero_offload.accelerator.host_syncs import LIBRARY_THREAD_PREFIX
from zero_offload.activations import ActivationOffloadConfig, ActivationOffloader, checkpoint
from zero_offload.errors import StorageError, raised_again
from zero_offload.memory.io_engine import IOEvent
from zero_offload.memory.pool import BlockPool

from .helpers.models import (
    TinyTransformer,
    batches,
    host_accelerator,
    lm_loss,
    offload_opt,
    train,
)

#: Placements of the optimizer state whose stores own host pool buffers: the fp32 master
#: as the weights' home, a bf16 model's staging beside it, and NVMe (the staging only).
PLACEMENTS = ("host_fp32", "host_bf16", "nvme")

#: Small activation pools: 1 MiB each (the defaults are 1 GiB and 256 MiB).
ACT_CONFIG = ActivationOffloadConfig(
    host_pool_bytes=1 << 20, device_pool_bytes=1 << 20, min_bytes=0
)

# torch imports torch._dynamo at the first add_param_group of the process, and an exception
# caught in that import keeps the frames below it, the optimizer's constructor included, in a
# cycle. Once, here, with the collector on, so no test measures torch's import.
torch.optim.AdamW([nn.Parameter(torch.zeros(1))])


@contextmanager
def collector_off() -> Iterator[None]:
    """The block runs with the cyclic garbage collector disabled (after a collection)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def new_library_threads(before: set[threading.Thread]) -> list[str]:
    """Names of the library threads alive now that were not alive in ``before``."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t not in before and t.name.startswith(LIBRARY_THREAD_PREFIX)
    )


def buffers_of(pools: Iterable[BlockPool]) -> dict[str, weakref.ref]:
    """A weakref to each pool's buffer storage, by pool name; dead once nothing views it."""
    return {pool.name: weakref.ref(pool._buffer.untyped_storage()) for pool in pools}


def still_referenced(buffers: dict[str, weakref.ref]) -> list[str]:
    return sorted(name for name, ref in buffers.items() if ref() is not None)


def library_cycles() -> list[str]:
    """The library types that only the cyclic collector would free now (collected here)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(0)
    found = sorted(
        {type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("zero_offload")}
    )
    gc.garbage.clear()
    return found


def build(placement: str, tmp_path: Path) -> tuple[nn.Module, OffloadAdamW, Accelerator]:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if placement == "host_bf16" else torch.float32
    model = TinyTransformer().to(dtype)
    accelerator = host_accelerator()
    nvme = {"nvme_dir": tmp_path, "host_budget": 1} if placement == "nvme" else {}
    return model, offload_opt(model, accelerator=accelerator, **nvme), accelerator


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_close_gives_pools_and_threads_back_while_the_optimizer_is_referenced(
    placement: str, tmp_path: Path
) -> None:
    """The probe's sweep kept closed optimizers (an LR scheduler holds one): each kept its
    host pools until a full collection and its ``d2h``/``h2d`` threads for good (41 threads
    after 20 runs)."""
    with collector_off():
        before = set(threading.enumerate())
        model, opt, accelerator = build(placement, tmp_path)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        train(model, opt, batches(2))
        scheduler.step()
        host = buffers_of(pool for pool in opt.manager.pools if pool.kind.startswith("host"))
        assert host and new_library_threads(before)

        opt.close()

        assert new_library_threads(before) == []  # stopped and joined
        assert still_referenced(host) == []
        assert accelerator.memory_stats()["in_use"] == 0
        assert library_cycles() == []
        with pytest.raises(RuntimeError, match=r"step\(\) after close\(\)"):
            opt.step()
        assert scheduler.optimizer is opt


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_dropped_optimizer_is_freed_by_reference_counting(placement: str, tmp_path: Path) -> None:
    """No close(): dropping the optimizer and its model returns every pool (device pools:
    to the budget), and stops its threads, at the ``del``."""
    with collector_off():
        before = set(threading.enumerate())
        model, opt, accelerator = build(placement, tmp_path)
        train(model, opt, batches(2))
        pools = buffers_of(opt.manager.pools)
        dropped = weakref.ref(opt)

        del opt, model  # the parameters view the device pool's buffer

        assert dropped() is None
        assert new_library_threads(before) == []
        assert still_referenced(pools) == []
        assert accelerator.memory_stats()["in_use"] == 0
        assert library_cycles() == []


def _frames(error: BaseException) -> int:
    tb, count = error.__traceback__, 0
    while tb is not None:
        tb, count = tb.tb_next, count + 1
    return count


@pytest.mark.parametrize("ends", ["dropped", "closed"])
def test_an_optimizer_whose_stream_failed_is_freed_by_reference_counting(
    ends: str, tmp_path: Path
) -> None:
    """The stream's one stored error used to be raised again at every call, each raise
    chaining that call's frames onto its traceback: the failed optimizer stayed alive
    through its own stream, with its pools, and a failed close() kept it in a cycle too
    (Note [a sticky error holds no frames] in accelerator/base.py)."""
    with collector_off():
        before = set(threading.enumerate())
        model, opt, _ = build("host_fp32", tmp_path)
        train(model, opt, batches(1))

        def fail() -> None:
            raise OSError("the copy failed")

        opt.manager.d2h.submit(fail)
        raised = []
        for tokens, targets in batches(3):
            with pytest.raises(StreamError, match="the copy failed") as info:
                lm_loss(model, tokens, targets).backward()
                opt.step()
            raised.append(_frames(info.value))
            opt.zero_grad()
        assert raised[1] == raised[2]  # no frames chained on from the calls before
        assert isinstance(info.value.__cause__, OSError)
        del info
        dropped = weakref.ref(opt)
        if ends == "closed":
            with pytest.raises(StreamError, match="the copy failed"):
                opt.close()

        del opt, model

        assert dropped() is None
        assert new_library_threads(before) == []
        assert library_cycles() == []


def test_a_failed_nvme_read_raised_again_gathers_no_frames() -> None:
    """An NVMe event's stored error was raised itself at every wait, chaining each wait's
    frames onto it (Note [a sticky error holds no frames] in accelerator/base.py)."""
    event = IOEvent(1)
    error = StorageError("read of 8 bytes at offset 0 of f failed")
    error.file = "f"  # type: ignore[attr-defined]
    event.part_done(error)
    depths = []
    for _ in range(3):
        with pytest.raises(StorageError, match="offset 0 of f") as info:
            event.synchronize()
        depths.append(_frames(info.value))
        assert info.value.file == "f"  # type: ignore[attr-defined]
    assert depths[0] == depths[1] == depths[2]


@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError(2, "No such file or directory", "/nvme/rank0/bucket3.state"),
        PermissionError(13, "Permission denied", "/nvme/a", None, "/nvme/b"),
        OSError(28, "No space left on device"),
    ],
    ids=["filename", "two-filenames", "no-filename"],
)
def test_an_os_error_raised_again_keeps_its_file(error: OSError) -> None:
    """A stored OSError raised afresh keeps its type, errno and file names, so its message
    still names the file (``errors.raised_again``; its file names are not in ``args``)."""
    error.add_note("while reading bucket 3")
    fresh = raised_again(error)
    assert fresh is not error and type(fresh) is type(error)
    assert (fresh.errno, fresh.strerror) == (error.errno, error.strerror)  # type: ignore[attr-defined]
    assert (fresh.filename, fresh.filename2) == (error.filename, error.filename2)  # type: ignore[attr-defined]
    assert str(fresh) == str(error)
    assert fresh.__notes__ == ["while reading bucket 3"]


class Interrupted(Exception):
    """Raised by a gradient hook halfway through backward."""


def checkpointed_loss(
    model: TinyTransformer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    offloader: ActivationOffloader,
    *,
    interrupt: bool = False,
) -> torch.Tensor:
    """The loss with each block checkpointed through ``offloader``; ``interrupt``: backward
    raises ``Interrupted`` after the last block, once the first block's input was prefetched."""
    x = model.embed(tokens)
    for i, block in enumerate(model.blocks):
        x = checkpoint(block, x, offloader=offloader)
        if interrupt and i == 0:
            x.register_hook(_interrupt)
    logits = model.head(model.norm(x))
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _interrupt(grad: torch.Tensor) -> None:
    raise Interrupted


@pytest.mark.parametrize("how", ["after_backward", "graph_dropped", "backward_failed"])
def test_a_dropped_offloader_is_freed_by_reference_counting(how: str) -> None:
    """The probe's offloader, dropped, kept its pools (1 GiB of host memory and 256 MiB of
    the budget by default) until a collection; the third of a sweep under a 700 MiB budget
    raised DeviceBudgetExceeded. Here the budget holds one device pool and a half: the next
    offloader fits only if the dropped one gave its pool back. ``backward_failed`` leaves a
    prefetched activation on the device, held by the offloader itself."""
    torch.manual_seed(0)
    model = TinyTransformer()
    with collector_off():
        before = set(threading.enumerate())
        accelerator = host_accelerator(device_budget=3 << 19)
        offloader = ActivationOffloader(accelerator=accelerator, config=ACT_CONFIG)
        for tokens, targets in batches(2):
            loss = checkpointed_loss(
                model, tokens, targets, offloader, interrupt=how == "backward_failed"
            )
            if how == "after_backward":
                loss.backward()
            elif how == "backward_failed":
                with pytest.raises(Interrupted):
                    loss.backward()
        stats = offloader.stats()
        assert stats["offloaded_tensors"] > 0
        assert stats["reloads"] > 0 or how == "graph_dropped"
        pools = buffers_of([offloader.host_pool, offloader.device_pool])
        dropped = weakref.ref(offloader)

        del offloader, loss  # a graph not backwarded holds the offloader, through its hooks

        assert dropped() is None
        assert new_library_threads(before) == []  # its own manager's threads
        assert still_referenced(pools) == []
        assert accelerator.memory_stats()["in_use"] == 0
        assert library_cycles() == []
        ActivationOffloader(accelerator=accelerator, config=ACT_CONFIG).close()


def test_closing_the_optimizer_closes_an_offloader_sharing_its_manager() -> None:
    """``ActivationOffloader(manager=opt.manager)``: ``opt.close()`` stops the streams the
    offloader copies on, so it gives the offloader's pools back too (Note [a manager's close
    ends its borrowers]); the offloader then refuses use, naming why."""
    with collector_off():
        before = set(threading.enumerate())
        model, opt, accelerator = build("host_fp32", Path("unused"))
        offloader = ActivationOffloader(manager=opt.manager, config=ACT_CONFIG)
        for tokens, targets in batches(2):
            checkpointed_loss(model, tokens, targets, offloader).backward()
            opt.step()
            opt.zero_grad()
        pools = buffers_of([offloader.host_pool, offloader.device_pool])

        opt.close()

        assert offloader.closed
        assert still_referenced(pools) == []
        assert accelerator.memory_stats()["in_use"] == 0
        assert new_library_threads(before) == []
        assert library_cycles() == []
        with pytest.raises(RuntimeError, match=r"synchronize\(\) after close.*optimizer"):
            offloader.synchronize()
        offloader.close()  # already closed: nothing to do
        with pytest.raises(ValueError, match=r"manager= is closed"):
            ActivationOffloader(manager=opt.manager, config=ACT_CONFIG)


def test_close_refuses_while_a_graph_holds_activations_then_releases() -> None:
    """``close()`` keeps its rule: it refuses, releasing nothing, while a graph still holds
    offloaded activations; once the graph is gone it releases everything at once."""
    torch.manual_seed(0)
    model = TinyTransformer()
    with collector_off():
        before = set(threading.enumerate())
        accelerator = host_accelerator()
        offloader = ActivationOffloader(accelerator=accelerator, config=ACT_CONFIG)
        tokens, targets = batches(1)[0]
        loss = checkpointed_loss(model, tokens, targets, offloader)
        with pytest.raises(RuntimeError, match=r"blocks are still in use"):
            offloader.close()
        assert not offloader.closed

        del loss
        offloader.close()

        assert offloader.closed
        assert new_library_threads(before) == []
        assert accelerator.memory_stats()["in_use"] == 0
