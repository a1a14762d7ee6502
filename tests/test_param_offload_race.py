"""A prefetched (FETCHING) unit's parameters read by code between the window's hooks wait for
its copies (Note [a fetching unit's parameters stay released] in zero_offload/params/unit.py).

The host's simulated link writes a copy's bytes first and then sleeps, so a read that skips
the wait still sees the bytes; here each copy lands at the *end* of its link time, as on a
GPU the bytes are there only by the end event, which makes the missing wait deterministic.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator import AcceleratorConfig, HostAccelerator

from .test_param_offload_reads import HYPER, TiedAutoencoder, batch, train_step

pytestmark = pytest.mark.simulator_only  # the simulated link is the host's


class LateLandingHost(HostAccelerator):
    """Every copy's bytes land when its link time is over, not when it starts."""

    def copy_(self, dst, src, *, stream, label="", held=False):  # type: ignore[no-untyped-def]
        self._check_copy(dst, src, stream=stream, label=label)
        delay = self.link_seconds(src.nbytes)

        def run() -> None:
            time.sleep(delay)
            dst.copy_(src)

        stream.submit(run)


def test_decoder_reading_a_prefetched_units_bias_waits_for_its_copy() -> None:
    """The first forward prefetches ``dec_bias`` (its own unit, never run by a forward) while
    the encoder runs; the decoder reads it directly. It used to read the slot before the
    H2D copy wrote it: loss 1.06937 against torch's 1.07197."""
    torch.manual_seed(0)
    model = TiedAutoencoder()
    ref = copy.deepcopy(model)
    opt = OffloadAdamW(
        model.parameters(),
        **HYPER,
        config=OffloadConfig(
            offload_parameters=True, bucket_bytes=2048, tile_elements=1024, prefetch_layers=1
        ),
        accelerator=LateLandingHost(AcceleratorConfig(device_budget="256MiB", link_latency=0.02)),
        model=model,
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    try:
        for seed in range(2):
            x, _ = batch(seed)
            ours = train_step(model, opt, x, x)
            theirs = train_step(ref, ref_opt, x, x)
            assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (seed, ours, theirs)
    finally:
        opt.close()
