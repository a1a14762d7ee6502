"""Note [torch keeps the user's thread count]: a process told to use one thread keeps one.

Each case is a fresh process, because numba's threading layer loads once per process and
the bug was in that load: it reset torch's count from 1 to the machine's cores (issue 38).
The count is 1, set by ``OMP_NUM_THREADS=1`` (as ``torchrun`` sets it) or by
``torch.set_num_threads(1)``, on every numba threading layer the library runs on.
``workqueue`` is not among them: the library refuses it before loading anything
(tests/test_kernels_threading.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = """
import json, sys
import torch

if {set_in_code}:
    torch.set_num_threads(1)
seen = {{"start": (torch.get_num_threads(), torch.get_num_interop_threads())}}

def mark(phase):
    seen[phase] = (torch.get_num_threads(), torch.get_num_interop_threads())

import zero_offload
mark("import")
sys.path.insert(0, {root!r})
from tests.helpers.models import mlp, mlp_batches, mlp_loss, mlp_opt

model = mlp()
opt = mlp_opt(model)
mark("construction")
for i, (x, y) in enumerate(mlp_batches(2)):
    mlp_loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    mark(f"step {{i + 1}}")
opt.close()
import numba
print(json.dumps({{"layer": numba.threading_layer(), "seen": seen}}))
"""


def _tbb_loads() -> bool:
    try:
        from numba.np.ufunc import tbbpool  # noqa: F401 (loads libtbb if installed)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("layer", [None, "omp", "tbb"], ids=["default", "omp", "tbb"])
@pytest.mark.parametrize("how", ["OMP_NUM_THREADS=1", "torch.set_num_threads(1)"])
def test_torch_keeps_a_count_of_one(how: str, layer: str | None) -> None:
    if layer == "tbb" and not _tbb_loads():
        pytest.skip("numba's tbb layer does not load here (pip install tbb)")
    env = {
        k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMBA_THREADING_LAYER")
    }
    if how == "OMP_NUM_THREADS=1":
        env["OMP_NUM_THREADS"] = "1"
    if layer is not None:
        env["NUMBA_THREADING_LAYER"] = layer
    script = _SCRIPT.format(set_in_code=how != "OMP_NUM_THREADS=1", root=str(_ROOT))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if layer is not None:
        assert report["layer"] == layer
    seen = {phase: tuple(counts) for phase, counts in report["seen"].items()}
    interop = seen["start"][1]
    expected = dict.fromkeys(seen, (1, interop))
    assert seen == expected, f"torch's (intra-op, interop) counts by phase on {report['layer']}"
