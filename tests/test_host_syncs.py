"""Host synchronisations per step on the training loop's threads (issue 39), counted where
they are made: Note [host syncs are counted where they can block] in
accelerator/host_syncs.py. On a GPU each wait the caller or autograd makes stops the queuing
of kernels; on the host accelerator time cannot show it, so these count the calls. Before
the counts, every wait on an event a query had found done counted as a wait: 52 per step
during the backwards of 4 micro-batches, 13 more in step()."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from zero_offload.accelerator import HostAccelerator
from zero_offload.accelerator.host_syncs import (
    SyncKey,
    SyncKind,
    host_syncs,
    synchronize_completed,
    training_thread,
    wait_input,
)
from zero_offload.memory.host_worker import HostWorker

from .helpers.device import run_kind
from .helpers.models import batches, lm_loss, make_pair, offload_opt

MICRO = 4


def _fingerprint_reads() -> int:
    """Reads of the weight fingerprints per step() or announcement: on a GPU the check for
    weights written outside the optimizer compares on the device and reads the result
    once (Note [one fingerprint pass per bucket] in views/param_views.py); on the host
    accelerator it hashes host-addressable weights on the CPU, no read. In step() that read
    comes first: it waits for the backward's kernels, and the norms' read right after it
    finds the device idle."""
    return 1 if run_kind() == "cuda" else 0


def _reads(n: int) -> Counter[str]:
    return Counter({"read_to_host": n}) if n else Counter()


def _mine(window: Counter[SyncKey], kind: SyncKind) -> Counter[str]:
    """The training threads' syncs of ``kind`` in ``window``, by stream."""
    counts: Counter[str] = Counter()
    for key, n in window.items():
        if training_thread(key.thread) and key.kind is kind:
            counts[key.stream] += n
    return counts


def _windows(micro: int, *, step_mode: str = "plain", **config) -> tuple[Counter, Counter]:
    """The syncs of step 4's backwards (with an announced step, its whole step) and of its
    step() and zero_grad(), after three steps of warm-up."""
    model, _ = make_pair()
    opt = offload_opt(model, overlap_step=step_mode == "overlap", **config)
    data = batches(5 * micro)
    try:
        for step in range(5):
            start = host_syncs()
            for j in range(micro):
                announce = step_mode == "announced" and j == micro - 1
                opt.backward(lm_loss(model, *data[micro * step + j]), step=announce)
            mid = host_syncs()
            if step_mode != "announced":
                opt.step()
            opt.zero_grad()
            end = host_syncs()
    finally:
        opt.close()
    return mid - start, end - mid


# -- the counter ----------------------------------------------------------------------


def test_each_kind_of_wait_is_counted_once_where_it_is_made() -> None:
    acc = HostAccelerator()
    stream = acc.new_stream("probe")
    gate = threading.Event()
    stream.submit(gate.wait)
    pending = stream.record_event()
    before = host_syncs()
    gate.set()
    pending.synchronize()  # may block: a wait
    done = stream.record_event()
    done.synchronize()
    synchronize_completed(done)  # found done: free
    wait_input(stream.record_event())  # CPU compute's input
    acc.synchronize()  # the whole device: one, whatever it waits for inside
    acc.read_to_host(torch.ones(2))
    window = host_syncs() - before
    assert _mine(window, SyncKind.WAIT) == Counter({"probe": 2, "device": 1, "read_to_host": 1})
    assert _mine(window, SyncKind.COMPLETED) == Counter({"probe": 1})
    assert _mine(window, SyncKind.INPUT) == Counter({"probe": 1})
    # The stream's own worker waits are the library's, not the training loop's.
    assert all(training_thread(k.thread) for k in window)
    assert not training_thread("zero_offload:d2h")


def test_an_idle_host_worker_is_not_waited_for() -> None:
    acc = HostAccelerator()
    worker = HostWorker(acc)
    try:
        gate = threading.Event()
        worker.submit(gate.wait)
        before = host_syncs()
        gate.set()
        worker.synchronize()  # work was queued: a wait
        worker.synchronize()  # nothing since: done already
        worker.synchronize()
        window = host_syncs() - before
        assert _mine(window, SyncKind.WAIT) == Counter({"host_worker": 1})
        assert _mine(window, SyncKind.COMPLETED) == Counter({"host_worker": 2})
        worker.submit(lambda: None)  # queued again: a wait again, however quick
        before = host_syncs()
        worker.synchronize()
        assert _mine(host_syncs() - before, SyncKind.WAIT) == Counter({"host_worker": 1})
    finally:
        worker.close()


def test_a_failed_task_still_raises_at_an_idle_workers_synchronize() -> None:
    worker = HostWorker(HostAccelerator())
    worker.synchronize()

    def boom() -> None:
        raise ValueError("boom")

    worker.submit(boom)
    with pytest.raises(Exception, match="boom"):
        worker.synchronize()
    with pytest.raises(Exception, match="boom"):  # sticky, though nothing was queued since
        worker.synchronize()


# -- per step ----------------------------------------------------------------------------


@pytest.mark.cuda_form
def test_backwards_summed_on_the_device_make_no_host_wait() -> None:
    backward, step = _windows(MICRO)
    # Every flush's wait for the previous landing, and every early landing's wait for
    # the host worker, found its event done: no wait of the autograd thread.
    assert _mine(backward, SyncKind.WAIT) == Counter()
    assert _mine(backward, SyncKind.INPUT) == Counter()
    # step(): one read, of every bucket's norms at once; CPU Adam's inputs had landed
    # during the last backward (a GPU might still be copying: then INPUT waits, one per
    # launch at most); no wait for the host worker (nothing of a device sum is on it).
    assert _mine(step, SyncKind.WAIT) == _reads(1 + _fingerprint_reads())


@pytest.mark.cuda_form
def test_a_clipped_step_of_one_micro_batch_waits_once() -> None:
    backward, step = _windows(1, max_grad_norm=0.5)
    assert _mine(backward, SyncKind.WAIT) == Counter()
    # The host worker's statistics pass over the staged gradient, once.
    want = Counter({"host_worker": 1}) + _reads(_fingerprint_reads())
    assert _mine(step, SyncKind.WAIT) == want


@pytest.mark.cuda_form
def test_overlap_step_waits_only_for_the_update_it_delays() -> None:
    backward, step = _windows(MICRO, step_mode="overlap")
    assert _mine(backward, SyncKind.WAIT) == Counter()
    # The delayed update k-1 (the one wait the delay brings), then the norms. Not the
    # window's landing: before, step() drained the host worker behind it.
    want = Counter({"host_worker": 1}) + _reads(1 + _fingerprint_reads())
    assert _mine(step, SyncKind.WAIT) == want


@pytest.mark.cuda_form
def test_an_announced_step_waits_for_its_update_and_the_norms() -> None:
    during, after = _windows(MICRO, step_mode="announced")
    # On a GPU the announcement reads the fingerprints before the backward is queued.
    assert _mine(during, SyncKind.WAIT) == _reads(_fingerprint_reads())
    # zero_grad() lands the step: the host worker's last bucket, then the norms.
    assert _mine(after, SyncKind.WAIT) == Counter({"host_worker": 1, "read_to_host": 1})


@pytest.mark.cuda_form
def test_the_profiler_reports_the_training_threads_syncs_per_step() -> None:
    from zero_offload import TrafficProfiler

    model, _ = make_pair()
    opt = offload_opt(model)
    data = batches(3 * MICRO)
    try:
        for j in range(MICRO):  # warm-up
            opt.backward(lm_loss(model, *data[j]))
        opt.step()
        opt.zero_grad()
        with TrafficProfiler([opt], link_bandwidth=1e9) as prof:
            for step in range(1, 3):
                for j in range(MICRO):
                    opt.backward(lm_loss(model, *data[MICRO * step + j]))
                opt.step()
                opt.zero_grad()
                prof.step()
        syncs = prof.to_dict()["host_syncs"]
        reads = 1 + _fingerprint_reads()
        assert syncs["per_step"]["wait"] == reads
        assert syncs["per_step"]["waits_by_stream"] == {"read_to_host": reads}
        line = f"host syncs (training threads) per step: {reads} waits (read_to_host {reads})"
        assert line in prof.report()
    finally:
        opt.close()
