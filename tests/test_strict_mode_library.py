"""The library on the strict host accelerator (``accelerator/strict.py``): what strict mode
shows about code above ``accelerator/``. Each xfail is a CUDA bug strict mode found, named
with the file that will fix it (issue 22)."""

from __future__ import annotations

import pytest
import torch

from zero_offload import AcceleratorConfig, HostAccelerator, OffloadAdamW, OffloadConfig
from zero_offload.accelerator.strict import host_memory_name, strict_device_checks
from zero_offload.demo.model import GPTConfig, TinyGPT

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


@pytest.mark.xfail(
    strict=True,
    reason="issue 22: a released unit's parameters are views of their pinned home "
    "(param.data = home), so between steps user code sees them on the host: on CUDA "
    "next(model.parameters()).device, HF model.device and generate() say cpu; fix in "
    "params/views.py (keep the parameter on the device with its storage resized to 0, "
    "FSDP2's way, and make the home reachable only through the offloader)",
)
def test_parameters_user_code_sees_between_steps_are_on_the_device():
    model, opt = _train_with_parameter_offload(2)
    try:
        on_host = [name for name, p in model.named_parameters() if host_memory_name(p)]
        assert on_host == [], f"parameters user code sees in host memory: {on_host}"
    finally:
        opt.close()
