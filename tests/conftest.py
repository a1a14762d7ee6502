"""Shared fixtures: every accelerator that exists on this machine; hypothesis profiles.

``--accelerator={host,cuda}`` (or ``ZERO_OFFLOAD_TEST_ACCELERATOR``; default host) picks
the accelerator the suite proves (issue 36). Under ``cuda`` the tests with a CUDA form (the
``accel_kind`` fixture, or the ``cuda`` mark) run on ``cuda:0`` only, and are marked
``cuda_form`` (``-m cuda_form`` selects them); without a GPU they are skipped at run time
("needs a CUDA GPU"), so ``--collect-only`` works on any machine. Tests marked
``simulator_only`` (the race checker, the simulated link, strict mode) are skipped under
``cuda``. The terminal summary counts the CUDA forms by file.

``ZERO_OFFLOAD_STRICT=1`` makes every host accelerator strict (read by ``HostAccelerator``,
as ``ZERO_OFFLOAD_CHECK_RACES`` is) and, here, checks every op of every test for host
memory mixed with device memory (``strict_device_checks``; see ``accelerator/strict.py``).
"""

from __future__ import annotations

import os

# The suite runs as docs/threads.md tells users to launch training: with OMP_WAIT_POLICY=PASSIVE,
# which torch's OpenMP runtime reads once, when torch is loaded (below, unless a plugin already
# did: then zero_offload.kernels warns, as it would for a user). Without it torch's idle threads
# spin beside numba's on a 2-core machine and the suite runs slower, and every run printed the
# warning meant for users. tests/test_thread_budget.py checks the warning itself in
# subprocesses and under monkeypatch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from zero_offload.accelerator import Accelerator, CudaAccelerator, HostAccelerator
from zero_offload.accelerator.strict import strict_device_checks, strict_enabled_by_env
from zero_offload.config import AcceleratorConfig

# Hypothesis profiles, chosen with HYPOTHESIS_PROFILE (default "ci"). "ci": derandomized (the
# same examples on every run, so a failure is reproducible and CI is not flaky) and bounded;
# tests that set no max_examples get 25, and tests/helpers/properties.py's scaled() sizes the
# expensive ones from this budget. "long": fresh random examples, 10x as many, for nightly
# runs (HYPOTHESIS_PROFILE=long pytest tests/test_properties.py tests/test_kernels_bitwise.py).
_RELAXED = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=25, derandomize=True, deadline=None, suppress_health_check=_RELAXED
)
settings.register_profile(
    "long", max_examples=250, deadline=None, suppress_health_check=_RELAXED, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: The environment variable behind ``--accelerator`` ("host" or "cuda").
TEST_ACCELERATOR_ENV = "ZERO_OFFLOAD_TEST_ACCELERATOR"
TEST_ACCELERATOR_KINDS = ("host", "cuda")
NEEDS_GPU = "needs a CUDA GPU"
SIMULATOR_ONLY = "simulator only: proves the host accelerator's simulation, not CUDA"

_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda])
#: The ``accel_kind`` values under each ``--accelerator``: the host run keeps its CUDA cases
#: (skipped without a GPU), as before the switch; the cuda run has only those.
ACCELERATOR_KINDS = {"host": ["host", _CUDA], "cuda": [_CUDA]}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--accelerator",
        choices=TEST_ACCELERATOR_KINDS,
        default=None,
        help=f"the accelerator the suite proves (default: ${TEST_ACCELERATOR_ENV} or host)",
    )


def selected_accelerator(config: pytest.Config) -> str:
    """The ``--accelerator`` of this run: the option, else the environment, else "host"."""
    kind = config.getoption("--accelerator") or os.environ.get(TEST_ACCELERATOR_ENV) or "host"
    if kind not in TEST_ACCELERATOR_KINDS:
        raise pytest.UsageError(
            f"{TEST_ACCELERATOR_ENV}={kind!r} is not an accelerator; use one of "
            f"{', '.join(TEST_ACCELERATOR_KINDS)}"
        )
    return kind


def make_accelerator(kind: str, **config: object) -> Accelerator:
    """A fresh accelerator of ``kind`` ("host" or "cuda") with the given config fields."""
    cfg = AcceleratorConfig(**config)  # type: ignore[arg-type]
    return HostAccelerator(cfg) if kind == "host" else CudaAccelerator(cfg)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``accel_kind``: each accelerator kind this run proves (``ACCELERATOR_KINDS``)."""
    if "accel_kind" in metafunc.fixturenames:
        kinds = ACCELERATOR_KINDS[selected_accelerator(metafunc.config)]
        metafunc.parametrize("accel_kind", kinds)


def _has_cuda_form(item: pytest.Item) -> bool:
    params = getattr(item, "callspec", None)
    kind = params.params.get("accel_kind") if params is not None else None
    return kind == "cuda" or (kind is None and item.get_closest_marker("cuda") is not None)


#: Per run: CUDA forms by file, and the simulator_only tests (``pytest_terminal_summary``).
_FORMS = pytest.StashKey[tuple[Counter, int]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_run = selected_accelerator(config) == "cuda"
    have_gpu = torch.cuda.is_available()
    forms: Counter = Counter()
    simulator = 0
    for item in items:
        if item.get_closest_marker("simulator_only") is not None and cuda_run:
            simulator += 1
            item.add_marker(pytest.mark.skip(reason=SIMULATOR_ONLY))
        elif _has_cuda_form(item):
            forms[item.nodeid.split("::")[0]] += 1
            item.add_marker(pytest.mark.cuda_form)
            if not have_gpu:  # skipped when it runs: collection works on any machine
                item.add_marker(pytest.mark.skip(reason=NEEDS_GPU))
    config.stash[_FORMS] = (forms, simulator)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    """Under ``--accelerator=cuda``: how many collected tests have a CUDA form, by file."""
    if selected_accelerator(config) != "cuda" or _FORMS not in config.stash:
        return
    forms, skipped = config.stash[_FORMS]
    terminalreporter.write_sep("-", f"CUDA forms: {sum(forms.values())} tests")
    for path, count in sorted(forms.items()):
        terminalreporter.write_line(f"{count:6d}  {path}")
    terminalreporter.write_line(f"simulator_only (skipped on CUDA): {skipped} tests")


@pytest.fixture(autouse=True)
def _strict_device_checks() -> Iterator[None]:
    """Under ``ZERO_OFFLOAD_STRICT=1``, run the test with host/device mixing checked."""
    if not strict_enabled_by_env():
        yield
        return
    with strict_device_checks():
        yield
