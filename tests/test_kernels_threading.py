"""Note [a thread-safe threading layer]: kernels launched from several threads at once."""

from __future__ import annotations

import subprocess
import sys
import threading

import numba
import torch

from zero_offload.kernels import adam_step, grad_stats
from zero_offload.kernels.threading_layer import THREADSAFE_LAYERS


def test_concurrent_launches_from_two_threads_run_on_a_threadsafe_layer() -> None:
    n = 1 << 18  # large enough that the kernels go parallel
    errors: list[BaseException] = []

    def launch(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        param, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m, v = torch.zeros(n), torch.zeros(n)
        try:
            for step in range(1, 30):
                adam_step(
                    param,
                    grad,
                    m,
                    v,
                    step=step,
                    lr=1e-3,
                    beta1=0.9,
                    beta2=0.999,
                    eps=1e-8,
                    weight_decay=0.0,
                )
                grad_stats(grad)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=launch, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert numba.threading_layer() in THREADSAFE_LAYERS


def test_a_named_workqueue_layer_is_refused_at_import() -> None:
    code = "import zero_offload.kernels"
    env = {"NUMBA_THREADING_LAYER": "workqueue", "PATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode != 0
    assert "NUMBA_THREADING_LAYER='workqueue' is not thread-safe" in result.stderr


def test_import_narrows_the_default_choice_to_threadsafe() -> None:
    code = "import numba, zero_offload.kernels; print(numba.config.THREADING_LAYER)"
    env = {"PATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "threadsafe"
