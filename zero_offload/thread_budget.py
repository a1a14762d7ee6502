"""How many threads the library's host work may use: one budget for numba, torch and the
host worker, and the OpenMP wait policy that keeps idle teams off the cores.

Note [one thread budget]
~~~~~~~~~~~~~~~~~~~~~~~~
Three thread teams compute on the host: torch's intra-op pool (the model's forward and
backward on the host accelerator, large copies), numba's team (CPU Adam, ``kernels``) and the
host worker's passes over a gradient (statistics, accumulation: numba launches from the
worker thread). Each, left alone, takes every core it sees. When two run at once (the
announced step's CPU Adam during backward, Note [stepping during backward] in
``optim/update/eager.py``; the delayed update of ``overlap_step``), 2N threads share N cores
and each team's barrier waits for its slowest thread, which is the one the scheduler put
aside: step time becomes a lottery (263-2033 ms on one model on 2 cores, issue 27). So one
budget divides the cores, and every numba launch asks it:

- ``cores``: the CPUs in this process's affinity mask (``os.sched_getaffinity``), capped by
  the cgroup CPU quota (v2 ``cpu.max``; v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``) rounded
  up, at least 1. Never ``os.cpu_count()``: in a container it counts the host's CPUs.
  ``ZERO_OFFLOAD_CORES`` overrides it (to leave cores to a data loader, say).
- ALONE (CPU Adam in ``step()`` on the caller's thread, after backward): numba takes the
  cores.
- BESIDE (CPU Adam on the host worker while the caller's thread may run torch on the host's
  cores: the announced step, the delayed update, on the host accelerator): numba takes
  ``k = max(1, cores // 2)`` (``ZERO_OFFLOAD_ADAM_THREADS_BESIDE`` overrides it).
- BESIDE_LAUNCHER (the same work on CUDA): the caller's forward and backward run on the GPU,
  its thread (or autograd's) only launching kernels (``Accelerator.computes_on_host`` is
  False), so the host worker's CPU Adam takes every core but one: ``max(1, cores - 1)``.
  Half the cores left the H200 host idle (issue 39: the delayed update ran on 8 of 16);
  every core would leave the thread that feeds the GPU waiting for a core, and a GPU fed
  late idles whatever the host computes. One core is that thread's: the forward's and the
  backward's launches never run at once.
- either way, at most ``torch.get_num_threads()``: a process told to use fewer threads (a
  rank sharing a host with others) keeps to it, as before the budget.
- a host-worker pass over a gradient beside CPU Adam: ``max(1, cores // 4)`` (Note [the
  Adam pass gets the cores] in ``optim/grads/buffers.py``).

torch keeps its own count throughout (Note [torch keeps the user's thread count]), so while
the teams overlap they hold ``cores + k`` threads, not ``cores``: torch's thread count
decides how its reductions are split, hence the last bits of backward's gradients, and
"every fast path is bitwise equal to the plain one" (the announced step against ``step()``
after backward, tests/test_step_during_backward.py) rules out cutting torch during the
announced backward only. Cutting it for the whole run would slow every op of the user's
model. The excess is ``k`` threads whose idle waits sleep (Note [no spinning team beside
another]), not a second full team spinning.

On 2 cores that is numba 1 beside torch's 2, numba 2 after backward. Half the cores is a
guess that cannot be badly wrong (neither team is starved); the best share depends on the
model's backward and the state's size, and was not measured per phase here.

Note [no spinning team beside another]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An OpenMP team whose region ended keeps its threads spinning for a while (libgomp's default,
``OMP_WAIT_POLICY`` unset, spins ~300k iterations), so a team that just finished still holds
the cores the other one needs: torch's ops ran ~10x slower on 2 cores after numba kernels
(issue 27). A libgomp reads ``OMP_WAIT_POLICY`` once, when it is loaded. torch's is loaded by
``import torch``, before we can act, so the user must set it at launch
(``OMP_WAIT_POLICY=PASSIVE python train.py``); ``warn_if_torch_spins`` warns once when it is
not set. numba's ``omp`` layer links its own libgomp, but where torch's is already in the
global symbol scope (torch's pip wheels) the dynamic linker binds numba's OpenMP calls to
torch's copy: numba's regions then run in torch's runtime, under torch's policy, and the
policy at launch is the only fix. Where numba's runtime is its own, it is ours: at ``import
zero_offload.kernels`` numba's layer is loaded with ``OMP_WAIT_POLICY=PASSIVE`` unless the
user set a policy, and the environment is restored right after
(``load_numba_layer_passive``), so nothing leaks to child processes. numba's ``workqueue``
layer never spins but aborts on concurrent launches (Note [a thread-safe threading layer]);
``tbb`` does not spin either and is preferred by ``threadsafe`` when installed.

Note [torch keeps the user's thread count]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.set_num_threads(1)`` or ``OMP_NUM_THREADS=1`` (as ``torchrun`` sets it) stays 1
through import, construction and every step: ranks sharing a host would oversubscribe it,
and torch's reductions would round differently in a process's first run than in later ones
(issue 38). The one thing that changed it was loading numba's ``omp`` layer: its loader
calls ``omp_set_num_threads(NUMBA_NUM_THREADS)`` (all cores) on the loading thread, and that
call binds to torch's libgomp (Note [no spinning team beside another]), where the calling
thread's count is torch's count. So ``load_numba_layer_passive`` loads the layer inside
``torch_threads_kept``: it reads torch's count before and puts it back after, on the loading
thread, the only one whose count OpenMP's call changes. The guard holds on every layer
because it does not depend on what the loader does: ``omp`` resets the count and the guard
undoes it; ``tbb`` and ``workqueue`` start threads of their own without calling OpenMP, and
the guard finds the count unchanged and sets nothing. The layer loads once per process, at
``import zero_offload.kernels`` (before any kernel, so never lazily at a launch); after that
numba's launches size their team from numba's own per-thread count
(``numba.set_num_threads``), not OpenMP's. Numba code that loads the layer before
``zero_offload.kernels`` is imported changes the count itself; we cannot know the value it
replaced. torch's interop count is not touched by any layer. tests/test_thread_count_kept.py
checks each phase in a fresh process.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .caller_warning import warn_caller

__all__ = [
    "ADAM_BESIDE_ENV",
    "CORES_ENV",
    "LaunchPhase",
    "ThreadBudget",
    "WaitPolicy",
    "cgroup_cpu_limit",
    "compute_budget",
    "launch_phase",
    "load_numba_layer_passive",
    "mark_thread_beside",
    "numba_layer_choice",
    "numba_threads_now",
    "thread_budget",
    "torch_threads_kept",
    "torch_uses_openmp",
    "usable_cores",
    "wait_policy_report",
    "warn_if_torch_spins",
]

CORES_ENV = "ZERO_OFFLOAD_CORES"
ADAM_BESIDE_ENV = "ZERO_OFFLOAD_ADAM_THREADS_BESIDE"
WAIT_ENV = "OMP_WAIT_POLICY"

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


class LaunchPhase(enum.Enum):
    """What a numba launch runs beside; see Note [one thread budget]."""

    #: Nothing else computes: CPU Adam in step() after backward. numba takes the cores.
    ALONE = "alone"
    #: torch computes on another thread at the same time: numba takes its share ``k``.
    BESIDE = "beside"
    #: another thread launches device kernels at the same time (CUDA): numba takes every
    #: core but that thread's.
    BESIDE_LAUNCHER = "beside_launcher"


@dataclass(frozen=True)
class ThreadBudget:
    """The cores and each team's share of them (threads); Note [one thread budget]."""

    #: CPUs this process may run on at once (affinity, cgroup quota, or the override).
    cores: int
    #: how ``cores`` was found, for ``zero-offload info``.
    cores_reason: str
    #: numba's threads for CPU Adam with the cores to itself (further capped by torch's).
    numba_alone: int
    #: numba's threads for CPU Adam beside torch's work (torch keeps its own count).
    numba_beside: int
    #: numba's threads for CPU Adam beside a thread launching device kernels.
    numba_beside_launcher: int
    #: numba's threads for one host-worker pass over a gradient.
    host_pass: int
    #: how the shares were chosen.
    split_reason: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota_v2(text: str) -> float | None:
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _quota_v1(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) <= 0 or int(period) <= 0:
        return None
    return int(quota) / int(period)


def _ancestors(root: Path, cgroup_path: str) -> list[Path]:
    """``root/<cgroup_path>`` and each parent up to ``root`` (a quota anywhere above holds)."""
    parts = [p for p in cgroup_path.split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_limit(
    root: Path | None = None, proc_cgroup: Path | None = None
) -> tuple[float | None, str]:
    """The cgroup CPU quota in cores (None: no quota) and where it was read.

    cgroup v2: ``cpu.max`` ("max 100000" or "<quota> <period>") of this process's cgroup and
    its ancestors; v1: ``cpu.cfs_quota_us / cpu.cfs_period_us`` (-1: none) under the ``cpu``
    controller's mount. The smallest quota found wins."""
    root = _CGROUP_ROOT if root is None else root
    lines = (_read(_PROC_CGROUP if proc_cgroup is None else proc_cgroup) or "").splitlines()
    found: list[tuple[float, str]] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            for directory in _ancestors(root, path):
                text = _read(directory / "cpu.max")
                limit = None if text is None else _quota_v2(text)
                if limit is not None:
                    found.append((limit, f"cgroup v2 {directory / 'cpu.max'}"))
        elif "cpu" in controllers.split(","):  # cgroup v1
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                if not mount.is_dir():
                    continue
                for directory in _ancestors(mount, path):
                    limit = _quota_v1(directory)
                    if limit is not None:
                        found.append((limit, f"cgroup v1 {directory}/cpu.cfs_quota_us"))
                break
    if not found:
        return None, "no cgroup CPU quota"
    limit, where = min(found)
    return limit, f"{where} = {limit:g} cores"


def usable_cores(env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The cores this process may use and why: ``ZERO_OFFLOAD_CORES`` if set, else the
    affinity mask capped by the cgroup quota (rounded up); never ``os.cpu_count()``."""
    env = os.environ if env is None else env
    named = env.get(CORES_ENV)
    if named is not None:
        return _positive_int(CORES_ENV, named), f"{CORES_ENV}={named}"
    try:
        affinity = len(os.sched_getaffinity(0))
        reason = f"affinity {affinity} CPUs"
    except (AttributeError, OSError):  # not on Linux: no affinity call
        affinity = os.cpu_count() or 1
        reason = f"{affinity} CPUs (no affinity mask on this platform)"
    limit, where = cgroup_cpu_limit()
    if limit is not None and math.ceil(limit) < affinity:
        return max(1, math.ceil(limit)), f"{reason}, capped by {where}"
    return max(1, affinity), f"{reason}; {where}"


def _positive_int(name: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"{name}={value!r} is not a thread count; set it to a positive integer "
            f"(e.g. {name}=2) or unset it to let zero-offload choose"
        )
    return n


def compute_budget(cores: int, cores_reason: str, env: Mapping[str, str]) -> ThreadBudget:
    """The shares of ``cores`` (see Note [one thread budget]); ``env`` may override k."""
    named = env.get(ADAM_BESIDE_ENV)
    if named is not None:
        k = _positive_int(ADAM_BESIDE_ENV, named)
        if k > cores:
            raise ValueError(
                f"{ADAM_BESIDE_ENV}={named} exceeds the {cores} cores this process may use "
                f"({cores_reason}); set it to 1..{cores}"
            )
        why = f"CPU Adam beside torch: {k} ({ADAM_BESIDE_ENV})"
    else:
        k = max(1, cores // 2)
        why = f"CPU Adam beside torch: half the cores ({k})"
    return ThreadBudget(
        cores=cores,
        cores_reason=cores_reason,
        numba_alone=cores,
        numba_beside=k,
        numba_beside_launcher=max(1, cores - 1),
        host_pass=max(1, cores // 4),
        split_reason=why + ", torch keeps its count (bitwise results); after backward CPU "
        "Adam takes all; beside a GPU's kernel launches all but one",
    )


_budget: ThreadBudget | None = None
_budget_lock = threading.Lock()


def thread_budget() -> ThreadBudget:
    """This process's budget, found once (the affinity and quota do not change under us)."""
    global _budget
    with _budget_lock:
        if _budget is None:
            cores, reason = usable_cores()
            _budget = compute_budget(cores, reason, os.environ)
        return _budget


# --- which phase a launch runs in -------------------------------------------------------

_local = threading.local()


def launch_phase() -> LaunchPhase:
    """The calling thread's phase: BESIDE on the host worker, ALONE elsewhere."""
    return getattr(_local, "phase", LaunchPhase.ALONE)


def mark_thread_beside(*, launcher: bool = False) -> None:
    """Make every launch from the calling thread BESIDE, or BESIDE_LAUNCHER with
    ``launcher`` (the host worker calls this once at start: its CPU Adam always runs while
    the caller's thread may be running torch on the host, or launching a GPU's kernels)."""
    _local.phase = LaunchPhase.BESIDE_LAUNCHER if launcher else LaunchPhase.BESIDE


def numba_threads_now(torch_threads: int, pool: int) -> int:
    """numba's threads for a launch from the calling thread: its phase's share, at most
    torch's count (a process told to use fewer threads, a rank sharing a host, keeps to it)
    and numba's ``pool``."""
    budget = thread_budget()
    share = {
        LaunchPhase.ALONE: budget.numba_alone,
        LaunchPhase.BESIDE: budget.numba_beside,
        LaunchPhase.BESIDE_LAUNCHER: budget.numba_beside_launcher,
    }[launch_phase()]
    return max(1, min(share, torch_threads, pool))


# --- the wait policy (Note [no spinning team beside another]) ---------------------------


@contextlib.contextmanager
def torch_threads_kept() -> Iterator[None]:
    """Give the calling thread back torch's intra-op thread count after the body, whatever
    the body did to the OpenMP runtime torch shares; Note [torch keeps the user's thread
    count]."""
    import torch

    count = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)


def load_numba_layer_passive() -> None:
    """Load numba's threading layer now, with ``OMP_WAIT_POLICY=PASSIVE`` unless the user set
    a policy, then restore the environment and torch's thread count (Note [torch keeps the
    user's thread count]). A no-op once numba's layer is loaded."""
    import numba

    try:
        numba.threading_layer()
        return  # loaded already, by us or by numba code that ran before us
    except ValueError:  # "Threading layer is not initialized."
        pass
    user_set = WAIT_ENV in os.environ
    if not user_set:
        os.environ[WAIT_ENV] = "PASSIVE"  # read once by numba's libgomp as it loads
    try:
        with torch_threads_kept():
            numba.get_num_threads()  # loads the layer (numba's _launch_threads)
    finally:
        if not user_set:
            os.environ.pop(WAIT_ENV, None)


@dataclass(frozen=True)
class WaitPolicy:
    """What ``info`` shows about spinning teams."""

    #: torch's OpenMP wait policy as far as the environment says ("unset" if not).
    torch_policy: str
    #: numba's threading layer (None: not loaded yet).
    numba_layer: str | None
    #: True when torch's OpenMP team may spin beside numba's team.
    spins: bool
    reason: str


def wait_policy_report(
    env: Mapping[str, str] | None = None,
    *,
    numba_layer: str | None,
    torch_openmp: bool,
    cores: int,
) -> WaitPolicy:
    """Whether torch's OpenMP team may spin beside numba's, and why."""
    env = os.environ if env is None else env
    policy = env.get(WAIT_ENV, "unset").strip() or "unset"
    fix = f"set {WAIT_ENV}=PASSIVE in the environment before Python starts"
    if policy.upper() == "PASSIVE":
        return WaitPolicy(policy, numba_layer, False, f"{WAIT_ENV}=PASSIVE: idle teams sleep")
    if not torch_openmp:
        why = "torch's parallel backend is not OpenMP"
        return WaitPolicy(policy, numba_layer, False, why)
    if numba_layer not in (None, "omp"):
        why = f"numba's layer {numba_layer} does not spin; torch's team alone may"
        return WaitPolicy(policy, numba_layer, False, why)
    if cores < 2:
        return WaitPolicy(policy, numba_layer, False, "one core: no team runs beside another")
    said = f"{WAIT_ENV} is unset" if policy == "unset" else f"{WAIT_ENV}={policy}"
    why = (
        f"{said}: torch's OpenMP threads spin after each op and take the cores "
        f"numba's CPU Adam needs (with torch's pip wheels numba's omp team runs in torch's "
        f"OpenMP runtime, so the policy is both teams'); {fix}"
    )
    return WaitPolicy(policy, numba_layer, True, why)


def numba_layer_choice() -> tuple[str, str]:
    """numba's threading layer as the library runs it, and why (imports numba). Before the
    kernels are imported, the layer ``threadsafe`` will pick (Note [a thread-safe threading
    layer] in ``kernels/threading_layer.py``)."""
    import numba

    try:
        return numba.threading_layer(), "loaded"
    except ValueError:  # not loaded yet in this process
        pass
    configured = str(numba.config.THREADING_LAYER).lower()
    if configured not in ("default", "threadsafe", "safe"):
        return configured, f"NUMBA_THREADING_LAYER={configured}"
    try:
        from numba.np.ufunc import tbbpool  # noqa: F401 (loads libtbb if installed)

        return "tbb", "threadsafe: tbb is installed (its idle threads sleep)"
    except ImportError as exc:
        why = f"threadsafe: tbb is not installed ({exc}), so omp; workqueue is not thread-safe"
        return "omp", why


_warned = False


def torch_uses_openmp() -> bool:
    """Whether torch's intra-op pool is an OpenMP team (imports torch)."""
    import torch

    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def warn_if_torch_spins(numba_layer: str | None) -> bool:
    """Warn once per process when torch's team may spin beside numba's; returns whether
    this call warned. See Note [no spinning team beside another]."""
    global _warned
    if _warned:
        return False
    report = wait_policy_report(
        numba_layer=numba_layer, torch_openmp=torch_uses_openmp(), cores=thread_budget().cores
    )
    if not report.spins:
        return False
    _warned = True
    warn_caller(
        f"zero-offload: {report.reason} (e.g. `OMP_WAIT_POLICY=PASSIVE python train.py`); "
        "without it step times on a few cores can vary several-fold. See docs/threads.md",
        RuntimeWarning,
    )
    return True
