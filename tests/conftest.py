"""Shared fixtures: every accelerator that exists on this machine; hypothesis profiles.

``--accelerator={host,cuda}`` (or ``ZERO_OFFLOAD_TEST_ACCELERATOR``; default host) picks
the accelerator the suite proves (issue 36). Under ``cuda`` the tests with a CUDA form run on
``cuda:0`` only, and are marked ``cuda_form`` (``-m cuda_form`` selects them); without a GPU
they are skipped at run time ("needs a CUDA GPU"), so ``--collect-only`` works on any machine.
A test has a CUDA form in one of two ways:

- it picks the kind itself: the ``accel_kind`` fixture, or the ``cuda`` mark (which, in a
  host run too, skips without a GPU);
- it declares ``pytest.mark.cuda_form`` and builds its model, data, accelerator and optimizer
  through the shared helpers (``tests/helpers/device.py``, ``models.py``): in a host run it
  runs on the host accelerator as before; under ``cuda`` the autouse ``_run_device`` fixture
  makes the helpers build for ``cuda:0``, with TF32 off (Note [no TF32 in the CUDA forms]).

Tests marked ``simulator_only`` (the race checker, the simulated link, strict mode; the mark
may carry a ``reason``) are skipped under ``cuda``. The terminal summary counts the CUDA forms
by file and the simulator-only skips by reason.

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
from torch.nn.attention import SDPBackend, sdpa_kernel

from zero_offload.accelerator import Accelerator, CudaAccelerator, HostAccelerator
from zero_offload.accelerator.strict import strict_device_checks, strict_enabled_by_env
from zero_offload.config import AcceleratorConfig

from .helpers.device import running_on

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


def _picks_kind(item: pytest.Item) -> str | None:
    """The kind a test picks itself (``accel_kind``, or "cuda" for the ``cuda`` mark)."""
    params = getattr(item, "callspec", None)
    kind = params.params.get("accel_kind") if params is not None else None
    if kind is None and item.get_closest_marker("cuda") is not None:
        return "cuda"
    return kind


def _simulator_reason(item: pytest.Item) -> str:
    mark = item.get_closest_marker("simulator_only")
    reason = (mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")) if mark else ""
    return f"{SIMULATOR_ONLY} ({reason})" if reason else SIMULATOR_ONLY


#: Per run: CUDA forms by file, and the simulator_only skips by reason (``pytest_terminal_summary``).
_FORMS = pytest.StashKey[tuple[Counter, Counter]]()
#: On an item: the kind the helpers build for while it runs (``_run_device``).
_RUNS_ON = pytest.StashKey[str]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_run = selected_accelerator(config) == "cuda"
    if cuda_run:  # before CUDA starts; see Note [no TF32 in the CUDA forms]
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    have_gpu = torch.cuda.is_available()
    forms: Counter = Counter()
    simulator: Counter = Counter()
    for item in items:
        picked = _picks_kind(item)
        declared = picked is None and item.get_closest_marker("cuda_form") is not None
        if item.get_closest_marker("simulator_only") is not None and cuda_run:
            simulator[_simulator_reason(item)] += 1
            item.add_marker(pytest.mark.skip(reason=_simulator_reason(item)))
        elif picked == "cuda" or (declared and cuda_run):
            forms[item.nodeid.split("::")[0]] += 1
            item.add_marker(pytest.mark.cuda_form)
            if declared:
                item.stash[_RUNS_ON] = "cuda"
            if not have_gpu:  # skipped when it runs: collection works on any machine
                item.add_marker(pytest.mark.skip(reason=NEEDS_GPU))
    config.stash[_FORMS] = (forms, simulator)


#: Tests after which torch's intra-op thread count differed from before them: ``(nodeid,
#: before, after)``. A count left changed reaches every later test in the process (a parity
#: bound drawn from torch's own drift moved with it, and a test passed alone and failed in the
#: suite), so the summary names them.
_THREADS_CHANGED = pytest.StashKey[list[tuple[str, int, int]]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    if after != before:
        item.config.stash.setdefault(_THREADS_CHANGED, []).append((item.nodeid, before, after))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    """Tests that left torch's thread count changed; under ``--accelerator=cuda``: how many
    collected tests have a CUDA form, by file, and which are skipped as simulator-only, by
    reason."""
    changed = config.stash.get(_THREADS_CHANGED, [])
    if changed:
        terminalreporter.write_sep(
            "-", f"tests that left torch's thread count changed: {len(changed)}"
        )
        for nodeid, before, after in changed:
            terminalreporter.write_line(f"{before} -> {after}  {nodeid}")
    if selected_accelerator(config) != "cuda" or _FORMS not in config.stash:
        return
    forms, simulator = config.stash[_FORMS]
    terminalreporter.write_sep("-", f"CUDA forms: {sum(forms.values())} tests")
    for path, count in sorted(forms.items()):
        terminalreporter.write_line(f"{count:6d}  {path}")
    terminalreporter.write_sep("-", f"simulator_only (skipped on CUDA): {sum(simulator.values())}")
    for reason, count in sorted(simulator.items()):
        terminalreporter.write_line(f"{count:6d}  {reason}")
    if not torch.cuda.is_available():
        terminalreporter.write_line(f"every CUDA form skips here: {NEEDS_GPU}")


# Note [no TF32 in the CUDA forms]
# A test with a declared CUDA form holds the same tolerance on cuda:0 as on the host, so its
# matmuls must be fp32 there too: TF32 (on by default for cuDNN, and for matmul where torch's
# precision is "high") rounds inputs to 10 mantissa bits and would move a parity test's
# reference and ours apart by more than the stated bounds. The forward and backward of ours
# and of the reference run the same kernels on the same GPU, so what remains between them is
# the optimizer's own rounding, as on the host. Bitwise tests compare two runs of the same
# forward and backward, so those must be deterministic: attention runs on the math backend
# (the memory-efficient backward adds with atomics, in any order), and cuBLAS gets a fixed
# workspace (CUBLAS_WORKSPACE_CONFIG, set before CUDA starts). A test that needs another
# tolerance on CUDA says so itself.


@pytest.fixture(autouse=True)
def _run_device(request: pytest.FixtureRequest) -> Iterator[None]:
    """The helpers build for ``cuda:0`` during a declared CUDA form under ``--accelerator=cuda``
    (``tests/helpers/device.py``), for the host otherwise."""
    kind = request.node.stash.get(_RUNS_ON, "host")
    if kind == "host":
        with running_on("host"):
            yield
        return
    # see Note [no TF32 in the CUDA forms]
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with running_on(kind), sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(autouse=True)
def _strict_device_checks() -> Iterator[None]:
    """Under ``ZERO_OFFLOAD_STRICT=1``, run the test with host/device mixing checked."""
    if not strict_enabled_by_env():
        yield
        return
    with strict_device_checks():
        yield
