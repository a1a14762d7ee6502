"""``overlap_step`` with one micro-batch a step keeps no fp32 gradient accumulator (issue 39;
Note [the delayed update reads one buffer, the next backward fills the other] in
``optim/grads/staging.py``): update k reads window k's gradient where it landed, in one of
the bucket's two staging buffers, while backward k+1 lands in the other. Before, every
window went through an fp32 host accumulator (4 B/param) and, where the budget had room,
an fp32 device accumulator (4 B/param more, on the device) that one micro-batch does not
need. Here: the pools against a formula, the bits against the accumulator's path, and the
interleaving (a slow CPU Adam, a slow link, the race checker) that the turn protects."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import zero_offload.optim.rule.adamw as adamw_rule
from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.errors import StreamRaceError
from zero_offload.memory.align import aligned
from zero_offload.optim.grads import staging as staging_mod

from .helpers.models import batches, lm_loss, make_pair, max_diff, offload_opt
from .helpers.rule_pools import BUCKET_BYTES, model

pytestmark = pytest.mark.simulator_only("pool bytes and timings of the host accelerator")


def _pools(dtype: torch.dtype, *, overlap: bool, shadow: str) -> tuple[dict[str, int], list]:
    """Pool bytes after three steps of one micro-batch (the delayed update flushed): host,
    device, the accumulators' and the spares'; and the offloaded buckets' layouts with the
    host pool's alignment."""
    net = model(dtype)
    acc = HostAccelerator(AcceleratorConfig(device_budget=2**30))
    config = OffloadConfig(bucket_bytes=BUCKET_BYTES, overlap_step=overlap, overlap_shadow=shadow)
    opt = OffloadAdamW(net.parameters(), lr=1e-3, config=config, accelerator=acc)
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            opt.backward(net(torch.randint(0, 50, (2, 16), generator=gen)).float().square().mean())
            opt.step()
            opt.zero_grad()
        opt.flush_pending_update()
        pools = [p for p in opt.manager.pools if not p.closed]

        def named(suffix: str) -> int:
            return sum(p.capacity for p in pools if p.name.endswith(suffix))

        host_pool = next(p for p in pools if p.kind != "device" and p.name.endswith(".host"))
        layouts = [(b.layout, host_pool.alignment) for b in opt.buckets]
        return {
            "host": sum(p.capacity for p in pools if p.kind != "device"),
            "device": sum(p.capacity for p in pools if p.kind == "device"),
            "accumulators": named(".grad_acc") + named(".grad_acc_dev"),
            "spares": named(".grad_staging_spare"),
            "shadows": named(".weight_shadow"),
        }, layouts
    finally:
        opt.close()


@pytest.mark.parametrize("shadow", ["off", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_micro_batch_pins_a_spare_staging_and_no_accumulator(dtype, shadow) -> None:
    plain, layouts = _pools(dtype, overlap=False, shadow="off")
    overlap, _ = _pools(dtype, overlap=True, shadow=shadow)
    k = dtype.itemsize  # bytes of a training-dtype element
    n = sum(p.numel() for p in model(dtype).parameters())  # the model's parameters
    # Each bucket's spare staging: its shard of s elements in the training dtype, a(k s),
    # in a pinned pool of its own (Note [two staging buffers for accumulation]).
    spares = sum(aligned(k * layout.shard_numel, align) for layout, align in layouts)
    # Each bucket's weight shadow, where the (roomy) budget gives it: a(k s) device bytes.
    shadows = spares if shadow == "auto" else 0
    assert overlap["accumulators"] == 0  # no fp32 accumulator, host or device
    assert overlap["spares"] == spares
    assert overlap["shadows"] == shadows
    # host: the plain step's pools (master, moments, staging), and the spares.
    assert overlap["host"] == plain["host"] + spares
    # device: the plain step's pools (weights, gradient buffers), and the shadows.
    assert overlap["device"] == plain["device"] + shadows
    # Per parameter, beyond the plain step: k host bytes (bf16 2, fp32 4; 8 KiB buckets
    # in 4 KiB pages pad a few percent), where an fp32 accumulator on each side took 4 + 4.
    assert k <= (overlap["host"] - plain["host"]) / n < k * 1.1
    assert overlap["device"] - plain["device"] == shadows


def _slow_host_adam(monkeypatch: pytest.MonkeyPatch, seconds: float = 0.02) -> None:
    """CPU Adam off the caller's thread (the delayed update) takes ``seconds`` a launch:
    update k outlasts backward k+1, as it does on a GPU at scale."""
    tile_step = adamw_rule.adam_step

    def slow(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(seconds)
        return tile_step(*args, **kwargs)

    monkeypatch.setattr(adamw_rule, "adam_step", slow)


def _run(
    pattern: list[int],
    *,
    accumulator: bool,
    dtype: torch.dtype = torch.bfloat16,
    accumulation: str = "host",
    **config,
):
    """``overlap_step`` over windows of ``pattern`` micro-batches on a slow link with the
    race checker on; ``accumulator``: every window forced through the fp32 host accumulator
    (the path ``overlap_step`` took before). The model, the staging waits, the sources
    each window's step read, and the last norm."""
    net, _ = make_pair(dtype)
    acc = HostAccelerator(AcceleratorConfig(link_bandwidth=2e8, check_races=True))
    opt = offload_opt(
        net, overlap_step=True, grad_accumulation=accumulation, accelerator=acc, **config
    )
    for bucket in opt.buckets:
        bucket.gradients.always_accumulate = accumulator
    data = batches(sum(pattern))
    sources = []
    at = 0
    try:
        for micro in pattern:
            for tokens, targets in data[at : at + micro]:
                opt.backward(lm_loss(net, tokens, targets))
            at += micro
            sources.append({b.gradients.window_source().value for b in opt.buckets})
            opt.step()
            opt.zero_grad()
        opt.flush_pending_update()
        waits = sum(b.gradients.staging_waits for b in opt.buckets)
        return net, waits, sources, opt.last_grad_norm
    finally:
        opt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_windows_take_turns_and_match_the_accumulator(monkeypatch, dtype) -> None:
    _slow_host_adam(monkeypatch)
    pattern = [1] * 5
    net, waits, sources, norm = _run(pattern, accumulator=False, dtype=dtype, max_grad_norm=0.5)
    ref, _, ref_sources, ref_norm = _run(pattern, accumulator=True, dtype=dtype, max_grad_norm=0.5)
    # Clipped: a lone window's norm is taken on the device (Note [a lone window's statistics
    # are taken on the device] in optim/grads/lone_stats.py), the host cells' to about
    # 1e-16, so the weights agree to one ulp (unclipped, bitwise:
    # tests/test_overlap_lone_stats.py).
    assert norm == pytest.approx(ref_norm, rel=1e-14)
    for x, y in zip(net.parameters(), ref.parameters(), strict=True):
        ulp = torch.finfo(x.dtype).eps * y.detach().float().abs()
        assert bool(((x.detach().float() - y.detach().float()).abs() <= ulp).all())
    assert ref_sources == [{"grad_acc"}] * 5
    # Update k reads one buffer while backward k+1 lands in the other: the turns.
    assert sources == [{"grad_staging"}, {"grad_staging_spare"}] * 2 + [{"grad_staging"}]
    # Backward k+1 never waits for update k: its buffer's last reader was update k-1.
    assert waits == 0


def test_a_window_that_grows_waits_for_the_update_reading_its_second_buffer(monkeypatch) -> None:
    # One micro-batch, then three: the second flush lands in the buffer update k reads, so
    # it waits for it (the event recorded when step() queued it); then the windows sum as
    # always. Bitwise the accumulator's path, under the race checker.
    _slow_host_adam(monkeypatch)
    pattern = [1, 1, 3, 1, 2, 1, 1]
    net, waits, sources, norm = _run(pattern, accumulator=False)
    ref, _, _, ref_norm = _run(pattern, accumulator=True)
    assert max_diff(net, ref) == 0.0 and norm == ref_norm
    assert sources[2] == {"grad_acc"} and sources[4] == {"grad_acc"}
    assert waits > 0


def _one_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every window lands in the bucket's own staging buffer: no turns."""
    init = staging_mod.OwnStaging.__init__

    def one_buffer(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "alternate": False})

    monkeypatch.setattr(staging_mod.OwnStaging, "__init__", one_buffer)


def test_without_the_turn_the_flush_waits_for_the_delayed_update(monkeypatch) -> None:
    # What the turn saves: with one staging buffer, backward k+1's flush would land where
    # update k reads; the event recorded at step() makes it wait (the caller's thread, a
    # host sync per bucket) instead of overwriting the gradient, so the bits hold.
    _slow_host_adam(monkeypatch)
    ref, _, _, _ = _run([1] * 4, accumulator=True)
    _one_buffer(monkeypatch)
    net, waits, sources, _ = _run([1] * 4, accumulator=False)
    assert max_diff(net, ref) == 0.0
    assert sources == [{"grad_staging"}] * 4
    # Strict mode completes compute events late, so a flush may be issued only once update k
    # has read its buffer: then there is nothing to wait for (no wait in about half the
    # runs there, before this session too). The bits above hold either way, under the race
    # checker; the wait itself is shown without strict mode.
    if not os.environ.get("ZERO_OFFLOAD_STRICT"):
        assert waits > 0


def test_without_the_turn_or_the_wait_the_next_backward_races_the_update(monkeypatch) -> None:
    # The race both prevent: backward k+1's copy writes the staging update k is reading
    # on the host worker. The race checker names it.
    _slow_host_adam(monkeypatch)
    _one_buffer(monkeypatch)
    monkeypatch.setattr(staging_mod.OwnStaging, "read_by", lambda self, event: None)
    with pytest.raises(StreamRaceError, match=r"grad_staging.*d2h copy.*CPU Adam reads"):
        _run([1] * 4, accumulator=False)


def test_the_first_device_landing_waits_for_the_update_reading_the_host_sum(monkeypatch) -> None:
    # Several micro-batches: the first window is summed on the host (the device accumulator
    # is taken at the second), and update 1 reads that host accumulator while window 2's
    # device sum lands in it, so the landing waits for update 1 (DeviceWindow.acc_free,
    # recorded at every window's end once the host accumulator exists, not only once the
    # device sum does). Bitwise the host accumulator's path (no clipping: the device
    # norms differ in the last bit, Note [micro-batches add up on the device]).
    _slow_host_adam(monkeypatch)
    pattern = [4, 4, 4]
    net, _, sources, _ = _run(pattern, accumulator=False, accumulation="auto")
    ref, _, _, _ = _run(pattern, accumulator=True)
    assert max_diff(net, ref) == 0.0
    # Window 1 on the host; the later ones on the device, landed in step() while update
    # k still reads the host accumulator ("grad_acc_dev" until then), else during backward.
    assert sources[0] == {"grad_acc"}
    assert all(s <= {"grad_acc", "grad_acc_dev"} for s in sources[1:])
