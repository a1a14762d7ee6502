"""Stable steps (issue 27): the no-clipping fast path's step times are not bimodal.

Without clipping, step() does not wait for the gradient statistics and CPU Adam follows the
gradient in (Note [a step that needs no statistics]); announced, it runs during backward
(Note [stepping during backward]). There numba's team and torch's ran beside each other and
whichever spun lost: 263-2033 ms on one model on 2 cores. With the thread budget (Note [one
thread budget]) and passive waits (Note [no spinning team beside another]) the spread of 30
steps after warm-up, p90 / p10, stays under the issue's generous 2x.

Robust on a loaded machine, by two choices:

- The run is a child process launched as the docs tell users to (``OMP_WAIT_POLICY=
  PASSIVE``: torch reads it once, at import, so this process's torch cannot be changed).
- The machine's own noise is measured beside ours: each of our steps is followed by a step
  of the same model with torch's fused AdamW and no offload, so both see the same load.
  Other processes alone spread that reference 2-7x on 2 cores shared by ~10 busy threads
  (measured while writing this test), and no bound on wall time alone could hold there. So
  the bound is 2x, or 1.5x the reference's own spread when the machine is that noisy:
  bimodality of our own making shows as a spread well past the machine's, which a quiet
  machine holds to 2x. Steps are 40-100 ms, long beside a scheduler's time slice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = r"""
import json, statistics, sys, time
import torch
from torch import nn
from zero_offload import OffloadAdamW, get_accelerator

announced = sys.argv[1] == "announced"
accel = get_accelerator()


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16384, 512), nn.Linear(512, 512)).to(accel.device)


ours_model, ref_model = make(), make()
ours = OffloadAdamW(ours_model.parameters(), lr=1e-4)  # no clipping: the fast path
ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-4, fused=True)
ids = torch.randint(0, 16384, (4, 64)).to(accel.device)
targets = torch.randint(0, 512, (4, 64)).to(accel.device)


def loss_of(model):
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def ours_step():
    ours.backward(loss_of(ours_model), step=announced)
    ours.step()
    ours.zero_grad()
    accel.synchronize()  # the step's copies belong to its interval


def ref_step():
    loss_of(ref_model).backward()
    ref.step()
    ref.zero_grad()


times = {"ours": [], "reference": []}
for i in range(5 + 30):  # 5 warm-up steps (kernels compiled, pools pinned), 30 timed
    for name, step in (("ours", ours_step), ("reference", ref_step)):
        t0 = time.perf_counter()
        step()
        if i >= 5:
            times[name].append(time.perf_counter() - t0)
ours.close()
out = {}
for name, samples in times.items():
    deciles = statistics.quantiles(samples, n=10)
    out[name] = {"p10": deciles[0], "median": statistics.median(samples), "p90": deciles[-1]}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("path", ["plain", "announced"])
def test_step_times_are_not_bimodal(path: str) -> None:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    # Up to three measurements: a bimodal step fails every one, while one scheduler hiccup
    # on a shared machine (a p90 of 30 samples is its 3rd-slowest step) does not repeat.
    for _attempt in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, path],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        ours, reference = result["ours"], result["reference"]
        spread = ours["p90"] / ours["p10"]
        machine = reference["p90"] / reference["p10"]
        if spread < max(2.0, 1.5 * machine):
            break
    assert spread < max(2.0, 1.5 * machine), result
