"""Processes that die, fork or exit around an optimizer: a killed save's temporary goes at
the next save (Note [a dead writer's temporaries] in ``zero_offload/fileio.py``); a forked
child neither touches the parent's NVMe files nor hangs (Notes [a forked child has no worker
threads] in ``accelerator/forks.py`` and [a tier belongs to the process that opened it] in
``memory/storage.py``); an interpreter exit without ``close()`` under parameter offload with
NVMe homes is quiet (Note [weights on NVMe are not read back at exit] in
``params/windowed_views.py``).

Each scenario runs in a child interpreter (``sys.executable``), under a timeout, so a hang
fails the test instead of blocking the suite. Host accelerator only: forking after CUDA is
initialised is not supported by CUDA itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from zero_offload import fileio
from zero_offload.checkpoint_io import save_consolidated

from .helpers.models import batches, host_accelerator, make_pair, offload_opt, train

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60  # per child interpreter; each takes 3-6 s when nothing hangs

# Shared by the child scripts: the repository first on the path, one torch thread (a forked
# child must not meet an OpenMP pool it did not fork), and a wait for a forked child that
# gives up (and kills it) instead of hanging.
_PRELUDE = """
import os, sys, time
sys.path.insert(0, {repo!r})
import torch
torch.set_num_threads(1)
from tests.helpers.models import batches, make_pair, max_diff, torch_adamw, train
from zero_offload import OffloadAdamW, OffloadConfig

def wait_child(pid, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"
"""


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    code = _PRELUDE.format(repo=str(REPO)) + script
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _lines(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The child's ``key: value`` lines."""
    return dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)


def _expect_lines(script: str, *args: str, expected: dict[str, str]) -> None:
    """Run ``script``: it exits cleanly and prints exactly ``expected``'s lines."""
    result = _run(script, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _lines(result) == expected, result.stdout + result.stderr[-3000:]


# -- bug: a killed save's temporary stayed forever ----------------------------------------------

_KILLED_SAVE = """
import signal
from zero_offload import fileio
from zero_offload.checkpoint_io import save_consolidated
model, _ = make_pair()
opt = OffloadAdamW(model.parameters(), lr=1e-3)
train(model, opt, batches(1))
fileio._fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # every byte written, not renamed
save_consolidated(opt, sys.argv[1])
"""


def test_a_consolidated_save_killed_mid_write_leaves_nothing_after_the_next_save(
    tmp_path: Path,
) -> None:
    path = tmp_path / "opt.pt"
    killed = _run(_KILLED_SAVE, str(path))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".opt.pt.tmp-"), leftovers
    model, _ = make_pair()
    opt = offload_opt(model, accelerator=host_accelerator())
    train(model, opt, batches(1))
    save_consolidated(opt, path)  # the next save of that name
    opt.close()
    assert [p.name for p in tmp_path.iterdir()] == ["opt.pt"]


def test_only_dead_writers_temporaries_are_removed(tmp_path: Path) -> None:
    """Files and directories alike; a live writer's (another process, or this one) stays,
    and so does anything not named exactly like a temporary."""
    sleeper = subprocess.Popen(["sleep", "60"])
    dead = _dead_pid()
    try:
        path = tmp_path / "report.json"
        names = {
            "dead_file": f".report.json.tmp-{dead}-0123abcd",
            "dead_dir": f"report.json.tmp-{dead}-89abcdef",
            "live_file": f".report.json.tmp-{sleeper.pid}-0123abcd",
            "own_file": f".report.json.tmp-{os.getpid()}-0123abcd",
            "not_ours": f".report.json.tmp-{dead}-notatemp",
            "other_name": f".other.json.tmp-{dead}-0123abcd",
            "no_such_pid": ".report.json.tmp-99999999999999999999-0123abcd",  # kept, no error
        }
        for key, name in names.items():
            if key == "dead_dir":
                (tmp_path / name).mkdir()
                (tmp_path / name / "part").write_bytes(b"x" * 4096)
            else:
                (tmp_path / name).write_bytes(b"x" * 4096)
        fileio.write_text(path, "{}", what="test")
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {"report.json"} | {
            names[k] for k in ("live_file", "own_file", "not_ours", "other_name", "no_such_pid")
        }
    finally:
        sleeper.kill()
        sleeper.wait()


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# -- bug: a forked child deleted the parent's NVMe files and hung at exit -----------------------

_FORK_EXITS = """
root, variant = sys.argv[1], sys.argv[2]
model, reference = make_pair()
params = variant == "params"
config = OffloadConfig(
    nvme_dir=root, host_budget=0, offload_parameters=params, bucket_bytes=8192,
    tile_elements=1024,
)
extra = dict(model=model, layers=model.blocks) if params else {}
opt = OffloadAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                   config=config, **extra)
ref = torch_adamw(reference)
data = batches(4)
train(model, opt, data[:2]); train(reference, ref, data[:2])
rank = os.path.join(root, "rank0")
before = sorted(os.listdir(rank))
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked helper that ends normally: it runs the exit hooks it inherited
print("child:", wait_child(pid))
print("files kept:", os.path.isdir(rank) and sorted(os.listdir(rank)) == before)
lock = os.path.join(rank, "LOCK")
holder = open(lock).read().split()[1] if os.path.exists(lock) else None
print("lock holder:", holder == str(os.getpid()))
train(model, opt, data[2:]); train(reference, ref, data[2:])
print("parent trains:", max_diff(model, reference) < 1e-5)
opt.close()
print("closed:", not os.path.exists(rank))
"""


@pytest.mark.parametrize("variant", ["state", "params"])
def test_a_forked_child_that_exits_leaves_the_parents_nvme_state_alone(
    tmp_path: Path, variant: str
) -> None:
    """``params``: parameter offload with NVMe homes, whose write-backs may still be in
    flight at the fork (the child must not wait for them)."""
    _expect_lines(
        _FORK_EXITS,
        str(tmp_path / "nvme"),
        variant,
        expected={
            "child": "0",
            "files kept": "True",
            "lock holder": "True",
            "parent trains": "True",
            "closed": "True",
        },
    )


# -- bug: a forked child's optimizer joined the parent's locked NVMe directory ------------------

_FORK_BUILDS = """
root = sys.argv[1]
model, _ = make_pair()
config = OffloadConfig(nvme_dir=root, host_budget=0, bucket_bytes=8192, tile_elements=1024)
opt = OffloadAdamW(model.parameters(), lr=1e-3, config=config)
rank = os.path.join(root, "rank0")
before = sorted(os.listdir(rank))
pid = os.fork()
if pid == 0:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # listdir's own fd, closed since
    print("child holds the lock fd:", any(link.endswith("rank0/LOCK") for link in links))
    try:
        OffloadAdamW(make_pair()[0].parameters(), lr=1e-3, config=config)
        said = "built"
    except ValueError as exc:
        said = f"ValueError {f'live process {os.getppid()}' in str(exc)}"
    print("build in child:", said, flush=True)
    os._exit(0)
print("child:", wait_child(pid))
print("files kept:", sorted(os.listdir(rank)) == before)
opt.close()
print("closed:", not os.path.exists(rank))
"""


def test_an_optimizer_built_in_a_forked_child_on_the_parents_nvme_dir_is_refused(
    tmp_path: Path,
) -> None:
    """The child's tier used to count itself among the parent's users of ``rank0`` and write
    its files there, unlocked; it is refused as in use by the parent, and the child drops
    its copy of the parent's ``LOCK`` fd (Note [a tier belongs to the process that opened
    it] in ``memory/storage.py``)."""
    _expect_lines(
        _FORK_BUILDS,
        str(tmp_path / "nvme"),
        expected={
            "child holds the lock fd": "False",
            "build in child": "ValueError True",
            "child": "0",
            "files kept": "True",
            "closed": "True",
        },
    )


# -- bug: an NVMe read or write pending at a fork hung a child that waited for it ---------------

_FORK_IO_WAIT = """
from zero_offload.memory.io_engine import IOEvent
pending, done = IOEvent(1), IOEvent(1)
done.part_done()
pid = os.fork()
if pid == 0:
    done.synchronize()
    print("done before the fork:", "returns", flush=True)
    try:
        pending.synchronize()
        said = "returned"
    except RuntimeError as exc:
        said = f"{type(exc).__name__} {f'process {os.getppid()}' in str(exc)}"
    print("pending at the fork:", said, flush=True)
    os._exit(0)
print("child:", wait_child(pid, 10.0))
pending.part_done()
pending.synchronize()
print("parent:", "returns")
"""


def test_an_nvme_wait_pending_at_a_fork_raises_in_the_child() -> None:
    """The engine's threads did not fork: the child raises ``ForkedStreamError`` naming the
    parent instead of waiting forever (Note [a forked child has no worker threads])."""
    _expect_lines(
        _FORK_IO_WAIT,
        expected={
            "done before the fork": "returns",
            "pending at the fork": "ForkedStreamError True",
            "child": "0",
            "parent": "returns",
        },
    )


# -- bug: state_dict() / close() in a forked child hung forever ---------------------------------

_FORK_CALLS = """
model, reference = make_pair()
opt = OffloadAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                   config=OffloadConfig(bucket_bytes=8192, tile_elements=1024))
ref = torch_adamw(reference)
data = batches(4)
train(model, opt, data[:2]); train(reference, ref, data[:2])
for what in ("state_dict", "close"):
    pid = os.fork()
    if pid == 0:
        try:
            getattr(opt, what)()
            said = "returned"
        except RuntimeError as exc:
            names = "forked from it" in str(exc) and f"process {os.getppid()}" in str(exc)
            said = f"{type(exc).__name__} {names}"
        print(f"{what} in child: {said}", flush=True)
        os._exit(0)
    print(f"{what} child: {wait_child(pid)}", flush=True)
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.arange(16)), batch_size=4, num_workers=2,
    multiprocessing_context="fork",
)
print("dataloader batches:", sum(1 for _ in loader))
train(model, opt, data[2:]); train(reference, ref, data[2:])
print("parent trains:", max_diff(model, reference) < 1e-5)
opt.close()
"""


def test_state_dict_and_close_in_a_forked_child_raise_instead_of_hanging() -> None:
    """They raise ``ForkedStreamError`` naming the parent; a DataLoader's forked workers (which
    never touch the optimizer) work, and the parent trains on after every fork."""
    _expect_lines(
        _FORK_CALLS,
        expected={
            "state_dict in child": "ForkedStreamError True",
            "state_dict child": "0",
            "close in child": "ForkedStreamError True",
            "close child": "0",
            "dataloader batches": "4",
            "parent trains": "True",
        },
    )


# -- bug: exit without close() under parameter offload with NVMe homes printed a traceback ------

_EXIT_WITHOUT_CLOSE = """
model, _ = make_pair()
config = OffloadConfig(
    nvme_dir=sys.argv[1], host_budget=0, offload_parameters=True, bucket_bytes=8192,
    tile_elements=1024,
)
opt = OffloadAdamW(model.parameters(), lr=1e-3, config=config, model=model, layers=model.blocks)
train(model, opt, batches(2))
print("end of script", flush=True)  # no close(): the finalizer releases at exit
"""


def test_exit_without_close_with_parameter_homes_on_nvme_is_quiet(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    result = _run(_EXIT_WITHOUT_CLOSE, str(root))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "end of script\n"
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr, result.stderr
    assert not (root / "rank0").exists()  # the files went at exit all the same


_CLOSE_AT_EXIT = """
import atexit
model, _ = make_pair()
config = OffloadConfig(
    nvme_dir=sys.argv[1], host_budget=0, offload_parameters=True, bucket_bytes=8192,
    tile_elements=1024,
)
opt = OffloadAdamW(model.parameters(), lr=1e-3, config=config, model=model, layers=model.blocks)
train(model, opt, batches(2))
atexit.register(lambda: (opt.close(), print("closed at exit", flush=True)))
print("end of script", flush=True)
"""


def test_close_in_an_atexit_hook_with_parameter_homes_on_nvme_is_quiet(tmp_path: Path) -> None:
    """A user's ``atexit.register(opt.close)`` runs after Python stopped its thread pools
    (threading's exit hooks run first): close() raised "cannot schedule new futures after
    shutdown" from the NVMe read of its unbind. The exit is marked among threading's hooks
    too (Note [a quiet exit after a failed stream] in memory/quiet_exit.py)."""
    root = tmp_path / "nvme"
    result = _run(_CLOSE_AT_EXIT, str(root))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "end of script\nclosed at exit\n", result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not (root / "rank0").exists()
