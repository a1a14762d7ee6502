"""Note [one thread budget] and Note [no spinning team beside another]: the cores found from
affinity and cgroup files, each phase's share, the host worker's phase, torch's count left
alone during an announced backward, the wait-policy warning (once), and ``info``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from zero_offload import CudaAccelerator, OffloadAdamW, OffloadConfig
from zero_offload import thread_budget as tb
from zero_offload.accelerator import get_accelerator
from zero_offload.cli import main
from zero_offload.kernels._validate import resolve_threads
from zero_offload.memory.host_worker import HostWorker


def _cgroup(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /sys/fs/cgroup tree with ``files`` (relative path -> text) and a fake
    /proc/self/cgroup holding ``proc_line``."""
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_line + "\n")
    return root, proc


@pytest.mark.parametrize(
    ("proc_line", "files", "limit"),
    [
        # v2, quota on the process's own cgroup: 1.5 cores
        ("0::/a/b", {"a/b/cpu.max": "150000 100000"}, 1.5),
        # v2, no quota here but 3 cores on the parent: a quota anywhere above holds
        ("0::/a/b", {"a/b/cpu.max": "max 100000", "a/cpu.max": "300000 100000"}, 3.0),
        # v2, the smallest of several quotas up the tree
        ("0::/a/b", {"a/b/cpu.max": "200000 100000", "cpu.max": "400000 100000"}, 2.0),
        # v2 unlimited everywhere
        ("0::/", {"cpu.max": "max 100000"}, None),
        # v1, cpu and cpuacct mounted together, the container's path below the mount
        (
            "4:cpu,cpuacct:/docker/x",
            {
                "cpu,cpuacct/docker/x/cpu.cfs_quota_us": "200000",
                "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000",
            },
            2.0,
        ),
        # v1 with -1: no quota
        (
            "1:cpu:/",
            {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
            None,
        ),
        # no cpu controller at all
        ("7:memory:/x", {}, None),
    ],
)
def test_cgroup_quota_from_fake_files(
    tmp_path: Path, proc_line: str, files: dict[str, str], limit: float | None
) -> None:
    root, proc = _cgroup(tmp_path, proc_line, files)
    found, where = tb.cgroup_cpu_limit(root, proc)
    assert found == limit
    assert ("cgroup" in where) if limit is not None else where == "no cgroup CPU quota"


@pytest.mark.parametrize(
    ("affinity", "quota", "cores"),
    [
        (4, None, 4),  # affinity only
        (16, "300000 100000", 3),  # the quota caps the affinity
        (16, "150000 100000", 2),  # a fractional quota rounds up
        (2, "800000 100000", 2),  # a quota above the affinity does not raise it
        (1, "10000 100000", 1),  # never below one
    ],
)
def test_usable_cores_is_affinity_capped_by_the_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, affinity: int, quota: str | None, cores: int
) -> None:
    files = {"cpu.max": quota} if quota else {}
    root, proc = _cgroup(tmp_path, "0::/", files)
    monkeypatch.setattr(tb, "_CGROUP_ROOT", root)
    monkeypatch.setattr(tb, "_PROC_CGROUP", proc)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(os, "cpu_count", lambda: 512)  # must not be read
    found, reason = tb.usable_cores({})
    assert found == cores
    assert f"affinity {affinity} CPUs" in reason


def test_the_cores_override_wins_and_bad_values_name_the_variable() -> None:
    assert tb.usable_cores({tb.CORES_ENV: "5"}) == (5, "ZERO_OFFLOAD_CORES=5")
    for bad in ("0", "-2", "two", ""):
        with pytest.raises(ValueError, match=r"ZERO_OFFLOAD_CORES=.* positive integer"):
            tb.usable_cores({tb.CORES_ENV: bad})


@pytest.mark.parametrize(
    ("cores", "beside", "launcher", "host_pass"),
    [(1, 1, 1, 1), (2, 1, 1, 1), (3, 1, 2, 1), (8, 4, 7, 2), (16, 8, 15, 4)],
)
def test_each_phase_gets_its_share_of_the_cores(
    cores: int, beside: int, launcher: int, host_pass: int
) -> None:
    budget = tb.compute_budget(cores, "test", {})
    shares = (budget.numba_alone, budget.numba_beside, budget.numba_beside_launcher)
    assert (*shares, budget.host_pass) == (cores, beside, launcher, host_pass)


def test_the_beside_share_can_be_overridden_within_the_cores() -> None:
    budget = tb.compute_budget(8, "test", {tb.ADAM_BESIDE_ENV: "3"})
    assert budget.numba_beside == 3
    assert tb.ADAM_BESIDE_ENV in budget.split_reason
    with pytest.raises(ValueError, match=r"=9 exceeds the 8 cores .* set it to 1..8"):
        tb.compute_budget(8, "test", {tb.ADAM_BESIDE_ENV: "9"})
    with pytest.raises(ValueError, match="positive integer"):
        tb.compute_budget(8, "test", {tb.ADAM_BESIDE_ENV: "0"})


@pytest.fixture
def budget_of(monkeypatch: pytest.MonkeyPatch):
    """Replace the process's cached budget with one for ``cores`` (restored afterwards)."""

    def make(cores: int) -> tb.ThreadBudget:
        budget = tb.compute_budget(cores, "test", {})
        monkeypatch.setattr(tb, "_budget", budget)
        return budget

    return make


def test_a_launch_takes_the_share_of_its_phase(budget_of) -> None:
    budget_of(8)
    assert tb.launch_phase() is tb.LaunchPhase.ALONE
    assert tb.numba_threads_now(torch_threads=6, pool=16) == 6  # torch's count bounds it
    assert tb.numba_threads_now(torch_threads=32, pool=16) == 8  # the cores bound it
    assert tb.numba_threads_now(torch_threads=32, pool=3) == 3  # numba's pool bounds it
    beside: list[object] = []

    def on_a_worker() -> None:
        tb.mark_thread_beside()
        beside.append(tb.launch_phase())
        beside.append(tb.numba_threads_now(torch_threads=32, pool=16))  # k = 8 // 2
        beside.append(tb.numba_threads_now(torch_threads=2, pool=16))  # torch's 2 bound it

    worker = threading.Thread(target=on_a_worker)
    worker.start()
    worker.join()
    assert beside == [tb.LaunchPhase.BESIDE, 4, 2]
    assert tb.launch_phase() is tb.LaunchPhase.ALONE  # per thread


def test_the_kernels_default_follows_the_budget(budget_of) -> None:
    import numba

    budget_of(1)  # one core: every launch gets one thread, whatever torch says
    assert resolve_threads(None) == 1
    budget_of(64)
    pool = numba.config.NUMBA_NUM_THREADS
    assert resolve_threads(None) == min(torch.get_num_threads(), pool)
    assert resolve_threads(1) == 1  # an explicit count is kept


def _worker_phase(accelerator: object) -> tb.LaunchPhase:
    """The launch phase of a host worker built for ``accelerator``."""
    worker = HostWorker(accelerator, name="test_budget_worker")  # type: ignore[arg-type]
    seen: list[tb.LaunchPhase] = []
    try:
        worker.submit(lambda: seen.append(tb.launch_phase()))
        worker.synchronize()
    finally:
        worker.close()
    return seen[0]


def test_the_host_worker_launches_beside_torch() -> None:
    assert _worker_phase(get_accelerator()) is tb.LaunchPhase.BESIDE
    assert tb.launch_phase() is tb.LaunchPhase.ALONE  # the caller's thread is unchanged


def test_the_host_worker_has_all_cores_but_the_launchers_when_the_gpu_computes(
    budget_of,
) -> None:
    # On CUDA the caller's forward and backward run on the GPU: the host worker's CPU Adam
    # (a delayed or announced update) takes every core but one, which the thread launching
    # the GPU's kernels keeps (issue 39). The accelerator says so.
    class GpuComputes(type(get_accelerator())):  # type: ignore[misc]
        computes_on_host = False

    assert _worker_phase(GpuComputes()) is tb.LaunchPhase.BESIDE_LAUNCHER
    assert CudaAccelerator.computes_on_host is False
    budget_of(16)
    seen: list[int] = []

    def on_a_worker() -> None:
        tb.mark_thread_beside(launcher=True)
        seen.append(tb.numba_threads_now(torch_threads=32, pool=64))

    worker = threading.Thread(target=on_a_worker)
    worker.start()
    worker.join()
    assert seen == [15]


def test_an_announced_backward_keeps_torch_at_its_count(budget_of) -> None:
    """torch's count decides its reductions' rounding, so the announced backward runs it
    unchanged (the step is bitwise the plain one); only numba's share is cut."""
    budget_of(4)
    torch.manual_seed(0)
    # Two layers in two buckets (1 KiB each): the last layer's bucket is handed over to the
    # host worker before the first layer's backward runs.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = OffloadAdamW(model.parameters(), lr=1e-3, config=OffloadConfig(bucket_bytes=1024))
    seen: list[int] = []
    model[0].register_full_backward_pre_hook(
        lambda module, grad: seen.append(torch.get_num_threads())
    )
    x = torch.randn(8, 64, device=get_accelerator().device, requires_grad=True)
    opt.backward(model(x).square().mean(), step=True)
    opt.step()
    opt.zero_grad()
    opt.close()
    assert seen == [torch.get_num_threads()]


# --- the wait policy --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "layer", "openmp", "cores", "spins"),
    [
        ({}, "omp", True, 2, True),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "omp", True, 2, False),
        ({"OMP_WAIT_POLICY": "passive"}, None, True, 8, False),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "omp", True, 2, True),
        ({}, "tbb", True, 2, False),  # numba's team does not spin
        ({}, "omp", False, 2, False),  # torch's team is not OpenMP
        ({}, "omp", True, 1, False),  # nothing beside anything
    ],
)
def test_the_wait_policy_report(
    env: dict[str, str], layer: str | None, openmp: bool, cores: int, spins: bool
) -> None:
    report = tb.wait_policy_report(env, numba_layer=layer, torch_openmp=openmp, cores=cores)
    assert report.spins is spins
    if spins:
        assert "OMP_WAIT_POLICY=PASSIVE in the environment before Python starts" in report.reason


def test_a_spinning_torch_team_is_warned_about_once(
    monkeypatch: pytest.MonkeyPatch, budget_of
) -> None:
    budget_of(2)
    monkeypatch.setattr(tb, "_warned", False)
    monkeypatch.setattr(tb, "torch_uses_openmp", lambda: True)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.warns(RuntimeWarning, match=r"OMP_WAIT_POLICY=PASSIVE python train.py"):
        assert tb.warn_if_torch_spins("omp") is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tb.warn_if_torch_spins("omp") is False
    assert caught == []


def test_no_warning_when_the_policy_is_passive(monkeypatch: pytest.MonkeyPatch, budget_of) -> None:
    budget_of(2)
    monkeypatch.setattr(tb, "_warned", False)
    monkeypatch.setattr(tb, "torch_uses_openmp", lambda: True)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tb.warn_if_torch_spins("omp") is False
    assert caught == []


_IMPORT_KERNELS = """
import os, torch
import zero_offload.kernels
import numba
print("layer", numba.threading_layer())
print("env", os.environ.get("OMP_WAIT_POLICY"))
"""


def _import_kernels(**env: str) -> subprocess.CompletedProcess[str]:
    base = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "NUMBA_THREADING_LAYER")
    }
    return subprocess.run(
        [sys.executable, "-c", _IMPORT_KERNELS],
        capture_output=True,
        text=True,
        env={**base, "ZERO_OFFLOAD_CORES": "2", **env},
        timeout=300,
        check=False,
    )


def test_importing_the_kernels_loads_numba_passive_and_warns_once() -> None:
    # OMP_DISPLAY_ENV=VERBOSE makes each libgomp print its settings as it loads: torch's at
    # `import torch`, numba's at `import zero_offload.kernels`. libgomp shows an unset policy
    # as PASSIVE too; the spin count tells them apart (300000 unset, 0 when PASSIVE).
    done = _import_kernels(OMP_DISPLAY_ENV="VERBOSE")
    assert done.returncode == 0, done.stderr[-3000:]
    displays = done.stderr.split("OPENMP DISPLAY ENVIRONMENT BEGIN")[1:]
    if "layer omp" in done.stdout:
        assert len(displays) == 2, done.stderr[-3000:]
        assert "GOMP_SPINCOUNT = '0'" not in displays[0]  # torch's: spins
        assert "GOMP_SPINCOUNT = '0'" in displays[1]  # numba's: sleeps
        assert done.stderr.count("RuntimeWarning") == 1
        assert "OMP_WAIT_POLICY is unset" in done.stderr
    assert "env None" in done.stdout  # the environment was restored: nothing leaks


def test_a_passive_launch_is_not_warned_about() -> None:
    done = _import_kernels(OMP_WAIT_POLICY="PASSIVE")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RuntimeWarning" not in done.stderr
    assert "env PASSIVE" in done.stdout


# --- info -------------------------------------------------------------------------------


def test_info_shows_the_budget_and_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tb.CORES_ENV, "6")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(tb, "_budget", None)  # found again, from the environment above
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    lines = dict(line.split(None, 1) for line in out.splitlines() if line.strip())
    assert lines["thread_cores"] == "6"
    assert lines["thread_cores_reason"] == "ZERO_OFFLOAD_CORES=6"
    assert lines["thread_numba_alone"] == "6"
    assert lines["thread_numba_beside_torch"] == "3"
    assert lines["thread_host_pass"] == "1"
    assert "half the cores" in lines["thread_split_reason"]
    assert lines["omp_wait_policy"] == "PASSIVE"
    assert lines["omp_wait_spins"] == "False"
    assert lines["numba_threading_layer"] in ("omp", "tbb")
    assert lines["numba_threading_layer_reason"]


def test_info_refuses_a_bad_core_count(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tb.CORES_ENV, "none")
    monkeypatch.setattr(tb, "_budget", None)
    assert main(["info"]) == 2
    assert "ZERO_OFFLOAD_CORES='none' is not a thread count" in capsys.readouterr().err


def test_cpu_adam_in_step_runs_on_the_threads_a_bare_call_gets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The in-step rate is measured against one bare adam_step call at the same thread count
    # (benchmarks/bench_step_host.py): step()'s launches, on the caller's thread after
    # backward (ALONE), run on the threads a bare call from that thread defaults to.
    import numba

    import zero_offload.kernels.adam as adam_kernels

    seen: list[int] = []
    kernel = adam_kernels._adam_kernel

    def counting(*args: object) -> None:
        seen.append(numba.get_num_threads())
        kernel(*args)

    monkeypatch.setattr(adam_kernels, "_adam_kernel", counting)
    torch.manual_seed(0)
    model = nn.Linear(512, 512).to(torch.bfloat16)  # 262,656 elements: several per thread
    opt = OffloadAdamW(model.parameters(), accelerator=get_accelerator())
    for _ in range(2):
        seen.clear()
        model(torch.randn(4, 512, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
        assert seen and set(seen) == {resolve_threads(None)}, seen
    assert tb.launch_phase() is tb.LaunchPhase.ALONE
    opt.close()
