"""What construction says when memory runs short: a pool the OS refuses under an
address-space limit names the pool, its bytes, the limit and what would fit (Note [an
allocation the OS refused] in ``memory/manager.py``); the device-budget refusal offers only
the settings that would help (``optim/state/placement.py``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from zero_offload import DeviceBudgetExceeded, OffloadConfig, OffloadLion

from .helpers.models import host_accelerator, make_pair, offload_opt

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120

# -- a pool refused under RLIMIT_AS -------------------------------------------------------------

# The limit leaves 160 MiB beside what the interpreter maps once torch is imported: room for
# the optimizer's threads and bookkeeping (about 25 MiB here), not for its 192 MiB device
# pool (a 64 MiB layer's weights and two gradient buffers; device memory is host memory on
# the host accelerator).
_UNDER_A_LIMIT = """
import resource, sys
sys.path.insert(0, {repo!r})
import torch
torch.set_num_threads(1)
from torch import nn
from zero_offload import OffloadAdamW, PoolExhausted
model = nn.Linear(4096, 4096, bias=False)
with open("/proc/self/status") as f:
    mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
limit = mapped + (160 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
print("limit:", limit, flush=True)
try:
    OffloadAdamW(model.parameters(), lr=1e-3)
except PoolExhausted as exc:
    print("PoolExhausted:", str(exc).replace(chr(10), " "), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_a_pool_refused_under_rlimit_as_names_the_pool_the_limit_and_the_fix() -> None:
    """Construction failed with torch's "DefaultCPUAllocator: can't allocate memory: you
    tried to allocate 201326592 bytes", naming neither the pool nor the limit."""
    result = subprocess.run(
        [sys.executable, "-c", _UNDER_A_LIMIT.format(repo=str(REPO))],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert "PoolExhausted" in lines, result.stdout + result.stderr[-3000:]
    message, limit = lines["PoolExhausted"], lines["limit"]
    assert re.search(r"cannot create pool '\w+\.0\.device' \(device tier\)", message), message
    assert "192.00 MiB (201326592 bytes)" in message  # what was asked for
    assert "RLIMIT_AS, ulimit -v) is " in message and f"({limit} bytes)" in message
    assert "are mapped already" in message
    for fix in ("bucket_bytes", "nvme_dir", "raise the limit"):
        assert fix in message, message


# -- the device-budget refusal ------------------------------------------------------------------


def _refusal(**config: object) -> str:
    model, _ = make_pair()
    acc = host_accelerator(device_budget=20_000)
    with pytest.raises(DeviceBudgetExceeded) as info:
        offload_opt(model, accelerator=acc, **config)
    assert acc.memory_stats()["in_use"] == 0
    return str(info.value)


def test_the_budget_refusal_at_full_offload_does_not_offer_raising_offload_fraction() -> None:
    """At offload_fraction=1.0 (the default) it said "... or raise offload_fraction", which
    cannot go higher and keeps no state on the device already."""
    message = _refusal()
    assert "offload_fraction=1.0" in message  # the value, in the breakdown
    assert "raise OffloadConfig.offload_fraction" not in message
    assert "raise offload_fraction" not in message
    assert "device_budget" in message and "bucket_bytes" in message
    assert "offload_parameters=True" in message  # the weights are what the budget holds


def test_the_budget_refusal_with_state_on_the_device_offers_raising_offload_fraction() -> None:
    message = _refusal(offload_fraction=0.5)
    assert "raise OffloadConfig.offload_fraction (now 0.5; 1.0 keeps no optimizer state" in (
        message
    )


def test_the_budget_refusal_names_the_optimizer_that_needs_the_bytes() -> None:
    """It said "OffloadAdamW needs ..." for every rule."""
    model, _ = make_pair()
    acc = host_accelerator(device_budget=20_000)
    with pytest.raises(DeviceBudgetExceeded, match=r"^OffloadLion needs ") as info:
        OffloadLion(model.parameters(), config=OffloadConfig(bucket_bytes=8192), accelerator=acc)
    assert "OffloadAdamW" not in str(info.value)
    assert acc.memory_stats()["in_use"] == 0
