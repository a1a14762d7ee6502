"""OffloadConfig(grad_staging="in_flight") in the loops users write (Note [gradient staging
for the buckets in flight] in optim/grads/staging_ring.py): the loops around a step that reuse, discard or
re-read a ring slot, each against per-bucket staging, bitwise, under the race checker.

The ring's optimizer announces each step (the step runs during backward); per-bucket staging
steps in step(). Activation checkpointing, an eval forward between backward and step, a
raising backward retried, two backwards of one graph, ``model.zero_grad()``, and a state dict
taken mid-window.

CUDA form (``cuda_form``, docs/gpu.md): the models, batches and accelerators come from
tests/helpers and test_staging_in_flight's ``_accelerator``, so under ``--accelerator=cuda``
every loop runs on ``cuda:0`` (the real link; the race checker and the slow link are the host
accelerator's), and each is still bitwise per-bucket staging."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from zero_offload import OffloadAdamW
from zero_offload.memory.manager import TieredMemoryManager
from zero_offload.memory.traffic import Category
from zero_offload.optim.grads.staging_ring import SlotState

from .helpers.device import on_device, run_device
from .helpers.models import batches, lm_loss, make_pair, offload_opt
from .test_param_offload import SEQ, VOCAB, assert_same, gpt
from .test_staging_in_flight import IN_FLIGHT, _accelerator, _po_opt, _ring

pytestmark = pytest.mark.cuda_form


def _ids(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))


def _checkpointed(reentrant: bool):
    def runner(block, x):
        return torch_checkpoint.checkpoint(block, x, use_reentrant=reentrant)

    return runner


def _po_both(make: Callable[[], torch.nn.Module]) -> tuple:
    """Two models from ``make`` under parameter offload: (ring model, per-bucket model,
    their optimizers)."""
    ring_model, plain_model = make(), make()
    return ring_model, plain_model, _po_opt(ring_model, **IN_FLIGHT), _po_opt(plain_model)


def _lm_both(buffers: int = 2) -> tuple:
    """The small LM twice, weights resident: (ring model, per-bucket model, optimizers)."""
    ring_model, plain_model = make_pair(torch.bfloat16)
    ring = offload_opt(
        ring_model,
        accelerator=_accelerator(),
        bucket_bytes=2048,
        **{**IN_FLIGHT, "grad_staging_buffers": buffers},
    )
    plain = offload_opt(plain_model, accelerator=_accelerator(), bucket_bytes=2048)
    return ring_model, plain_model, ring, plain


def _close_same(ring: OffloadAdamW, plain: OffloadAdamW, ring_model, plain_model) -> None:
    """Close both (parameter offload gives the weights back), then bitwise equal."""
    ring.close()
    plain.close()
    assert_same(ring_model, plain_model)


@pytest.mark.parametrize("reentrant", [False, True])
def test_parameter_offload_with_activation_checkpointing(reentrant: bool) -> None:
    """A recompute fetches a unit's home during backward: never one whose update ran."""
    make = functools.partial(gpt, torch.bfloat16, layers=4, runner=_checkpointed(reentrant))
    ring_model, plain_model, ring, plain = _po_both(make)
    for step in range(3):
        ids = _ids(step)
        ring.backward(ring_model(ids, ids), step=True)
        plain.backward(plain_model(ids, ids))
        for opt in (ring, plain):
            opt.step()
            opt.zero_grad()
    assert len(_ring(ring).slots) == 2
    _close_same(ring, plain, ring_model, plain_model)


def test_a_forward_between_backward_and_step_with_parameter_offload_is_refused() -> None:
    """Per-bucket staging steps in step() under parameter offload, so a forward between
    backward and step() sees the weights before the step. The ring steps during backward:
    such a forward's fetches would read homes the host worker is writing (some units before
    the step, some after, some torn), so it is refused, and the training goes on exactly."""
    ring_model, plain_model, ring, plain = _po_both(
        functools.partial(gpt, torch.bfloat16, layers=4)
    )
    for i in range(3):
        ids = _ids(i)
        ring.backward(ring_model(ids, ids), step=True)
        plain.backward(plain_model(ids, ids))
        with torch.no_grad():
            plain_model(ids, ids)
            with pytest.raises(RuntimeError, match=r"a forward between a backward.*opt.step"):
                ring_model(ids, ids)
        for opt in (ring, plain):
            opt.step()
            opt.zero_grad()
        with torch.no_grad():  # after step(): the same weights on both
            assert torch.equal(ring_model(ids, ids), plain_model(ids, ids))
    _close_same(ring, plain, ring_model, plain_model)


def test_reading_the_weights_between_backward_and_step_with_parameter_offload() -> None:
    """model.state_dict() and a released parameter's read between the backward and step()
    show per-bucket staging the weights before the step; with the ring the homes are being
    written then (entries of some units stepped, some not), so both are refused; after
    step() both read the same weights."""
    make = functools.partial(gpt, torch.bfloat16, layers=4)
    ring_model, plain_model, ring, plain = _po_both(make)
    ids = _ids(0)
    ring.backward(ring_model(ids, ids), step=True)
    plain.backward(plain_model(ids, ids))
    plain_model.state_dict()
    plain_model.blocks[0].attn.qkv.weight.float().sum()
    with pytest.raises(RuntimeError, match=r"a state dict between a backward.*opt.step"):
        ring_model.state_dict()
    with pytest.raises(RuntimeError, match=r"reading a parameter between a backward"):
        ring_model.blocks[0].attn.qkv.weight.float().sum()
    for opt in (ring, plain):
        opt.step()
        opt.zero_grad()
    ring_state, plain_state = ring_model.state_dict(), plain_model.state_dict()
    for name, value in plain_state.items():
        assert torch.equal(ring_state[name], value), name
    weight = ring_model.blocks[0].attn.qkv.weight
    assert torch.equal(weight.float(), plain_model.blocks[0].attn.qkv.weight.float())
    _close_same(ring, plain, ring_model, plain_model)


def test_a_flush_whose_copy_fails_gives_its_slot_back(monkeypatch) -> None:
    """A flush takes its ring slot first; if its gradient copy then fails, zero_grad()
    leaves no slot HELD (none leaks, the ring does not grow later: the unannounced backward
    grew it, legitimately), and the training goes on exactly as per-bucket staging's."""
    ring_model, plain_model, ring, plain = _lm_both()
    data = batches(3)
    real = TieredMemoryManager.copy
    calls = []

    def failing(self, dst, src, *, category, **kwargs):
        if category is Category.GRADIENTS:
            calls.append(1)
            if len(calls) == 4:  # the fourth flush: the other slot holds a gradient
                raise RuntimeError("injected copy failure")
        return real(self, dst, src, category=category, **kwargs)

    monkeypatch.setattr(TieredMemoryManager, "copy", failing)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        ring.backward(lm_loss(ring_model, *data[0]))
    monkeypatch.undo()
    ring.zero_grad()
    assert all(s.state is not SlotState.HELD for s in _ring(ring).slots)
    slots = len(_ring(ring).slots)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no growth
        for i in (1, 2):
            for opt, model in ((ring, ring_model), (plain, plain_model)):
                opt.backward(lm_loss(model, *data[i]), step=opt is ring)
                opt.step()
                opt.zero_grad()
    assert len(_ring(ring).slots) == slots
    _close_same(ring, plain, ring_model, plain_model)


def test_a_raising_backward_retried_without_zero_grad() -> None:
    """An unannounced backward raises midway (some buckets flushed into ring slots); the
    retried backward and step() give per-bucket staging's result."""
    ring_model, plain_model, ring, plain = _lm_both()
    data = batches(2)

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    for opt, model in ((ring, ring_model), (plain, plain_model)):
        handle = model.embed.weight.register_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            opt.backward(lm_loss(model, *data[0]))
        handle.remove()
        opt.backward(lm_loss(model, *data[0]))
        opt.step()
        opt.zero_grad()
        opt.backward(lm_loss(model, *data[1]), step=opt is ring)
        opt.step()
        opt.zero_grad()
    assert all(s.state is not SlotState.HELD for s in _ring(ring).slots)
    _close_same(ring, plain, ring_model, plain_model)


@pytest.mark.parametrize("buffers", [1, 2])
def test_two_backwards_of_one_graph_then_an_announced_one(buffers: int) -> None:
    """retain_graph: two backwards of one loss, then a third announced one, one step (a
    ring of one buffer too: every fold frees the slot the next flush takes)."""
    ring_model, plain_model, ring, plain = _lm_both(buffers)
    data = batches(4)
    for i in range(2):
        for opt, model in ((ring, ring_model), (plain, plain_model)):
            loss = lm_loss(model, *data[2 * i])
            opt.backward(loss, retain_graph=True)
            opt.backward(loss)
            opt.backward(lm_loss(model, *data[2 * i + 1]), step=opt is ring)
            opt.step()
            model.zero_grad()  # what the loop calls to clear: the model's, not the optimizer's
    _close_same(ring, plain, ring_model, plain_model)


def test_a_state_dict_between_backward_and_step() -> None:
    """state_dict() mid-window (after the announced backward, before step()) drains
    nothing it must not, and the training goes on exactly."""
    ring_model, plain_model, ring, plain = _lm_both()
    data = batches(3)
    for i in range(3):
        for opt, model, announce in ((ring, ring_model, True), (plain, plain_model, False)):
            opt.backward(lm_loss(model, *data[i]), step=announce)
            opt.state_dict()
            model.state_dict()
            opt.step()
            opt.zero_grad()
    assert len(_ring(ring).slots) == 2
    _close_same(ring, plain, ring_model, plain_model)


class _WithUnused(torch.nn.Module):
    """bf16 layers, each beside a parameter no forward uses: every bucket is incomplete
    until the backward ends, and then they are all flushed at once."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            block.linear = torch.nn.Linear(16, 16)
            block.unused = torch.nn.Parameter(torch.zeros(8))  # host: moved with the module
            self.layers.append(block.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.bfloat16()
        for block in self.layers:
            x = torch.tanh(block.linear(x))
        return x.float().square().mean()


def _train_with_unused(layers: int) -> int:
    """Three steps of ``_WithUnused(layers)`` on both (announced on the ring), bitwise
    equal; returns the ring's slots."""
    torch.manual_seed(0)
    ring_model = _WithUnused(layers).to(run_device())
    plain_model = _WithUnused(layers).to(run_device())
    plain_model.load_state_dict(ring_model.state_dict())
    ring = offload_opt(ring_model, accelerator=_accelerator(), bucket_bytes=1024, **IN_FLIGHT)
    plain = offload_opt(plain_model, accelerator=_accelerator(), bucket_bytes=1024)
    assert len(ring.buckets) > 2
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = on_device(torch.randn(4, 16, generator=gen))
        for opt, model in ((ring, ring_model), (plain, plain_model)):
            opt.backward(model(x), step=opt is ring)
            opt.step()
            opt.zero_grad()
    slots = len(_ring(ring).slots)
    _close_same(ring, plain, ring_model, plain_model)
    return slots


def test_buckets_left_incomplete_by_the_backward_do_not_grow_the_ring() -> None:
    """The buckets that the backward's end flushes (some parameter got no gradient), and
    those flushed early before it, are each stepped before the next flush, as complete
    ones are: more of them than the ring's buffers must not grow it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no growth
        assert _train_with_unused(4) == 2


def test_more_buckets_flushed_early_than_buffers_grow_the_ring_exactly() -> None:
    """Half-filled buckets flushed early during backward (the device gradient buffers ran
    out) hold their slots until they complete or the backward ends: more of them than the
    ring's buffers grow it, warned with that reason, and the result stays exact."""
    with pytest.warns(UserWarning, match=r"flushed early, half-filled"):
        assert _train_with_unused(8) > 2
