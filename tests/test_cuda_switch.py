"""``--accelerator=cuda`` moves what it counts (issue 36), checked on a machine without a GPU.

A test counts as a CUDA form only if, under ``--accelerator=cuda``, its model, data,
accelerator and optimizer go to ``cuda:0``. Three checks hold the declared forms
(the ``cuda_form`` mark, tests/helpers/device.py) to that:

- the helpers, run with the kind forced to "cuda" and ``cuda:0`` swapped for the ``meta``
  device (nothing allocated, nothing computed), put every model and batch on that device and
  build the accelerator as ``CudaAccelerator(index=0)``;
- a grep over the code the declared forms run (their bodies and the module's functions and
  classes they name): no accelerator built past the helpers, no tensor made on the CPU that
  is not moved (``on_device``, ``.to(...)``), unless the line says why (``# host:``). It does
  not follow modules built in a test (``nn.Linear(...)``): those are moved by hand, read in
  review;
- the switch itself, in a subprocess: collection counts the forms, and skips them without a
  GPU; a test without a form stays on the host in a cuda run.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tests.helpers.device as device
import tests.helpers.hf as hf
import tests.helpers.models as models

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: Builders of a tensor on the CPU unless told a device.
FACTORIES = {"randn", "rand", "randint", "zeros", "ones", "empty", "full", "tensor", "arange"}
#: Ways to build an accelerator that bypass ``device.run_accelerator``.
BYPASSES = {"HostAccelerator", "AcceleratorConfig", "make_accelerator", "strict"}


class _FakeCuda:
    """What ``device.run_accelerator`` builds under "cuda", recorded instead of started."""

    def __init__(self, config: object, *, index: int) -> None:
        self.config, self.index = config, index
        self.device = device.DEVICES["cuda"]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch):
    """The kind forced to "cuda", ``cuda:0`` stood in for by ``meta``, no CudaAccelerator."""
    monkeypatch.setitem(device.DEVICES, "cuda", torch.device("meta"))
    monkeypatch.setattr(device, "CudaAccelerator", _FakeCuda)
    with device.running_on("cuda"):
        yield


def test_the_default_kind_is_the_host() -> None:
    """Outside a declared form (this test has none), even in a cuda run: the host."""
    assert device.run_kind() == "host"
    assert device.run_device() == torch.device("cpu")
    assert type(device.run_accelerator()).__name__ == "HostAccelerator"


def test_under_cuda_the_helpers_ask_for_cuda_0() -> None:
    with device.running_on("cuda"):
        assert device.run_kind() == "cuda"
        assert device.run_device() == torch.device("cuda", 0)
    assert device.run_kind() == "host"
    with pytest.raises(ValueError, match="not an accelerator kind"), device.running_on("tpu"):
        pass


@pytest.mark.usefixtures("fake_cuda")
def test_models_data_and_accelerators_follow_the_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = torch.device("meta")
    model, ref = models.make_pair(torch.bfloat16, layers=1)
    assert {p.device for m in (model, ref) for p in m.parameters()} == {meta}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {t.device for pair in models.batches(2) for t in pair} == {meta}
    assert {p.device for p in models.mlp().parameters()} == {meta}
    assert {t.device for pair in models.mlp_batches(2) for t in pair} == {meta}
    assert device.on_device(torch.ones(2)).device == meta
    acc = models.host_accelerator(device_budget="1GiB")  # the old name: the same function
    assert isinstance(acc, _FakeCuda) and acc.index == 0
    assert acc.config.device_budget == 1 << 30
    built = {}
    monkeypatch.setattr(models, "OffloadAdamW", lambda params, **kw: built.update(kw))
    models.offload_opt(model)
    assert isinstance(built["accelerator"], _FakeCuda)


@pytest.mark.usefixtures("fake_cuda")
def test_the_framework_helpers_follow_the_kind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The integrations' helpers (tests/helpers/hf.py) under "cuda": the model on the
    device, the Trainer without ``use_cpu``, accelerate with ``cpu=False``, Lightning on
    ``accelerator="gpu"`` (cuda:0), OffloadAdamW on ``CudaAccelerator(index=0)``. The
    frameworks themselves are not started: on the stand-in they would pick the CPU."""
    meta = torch.device("meta")
    assert {p.device for p in hf.tiny_gpt2().parameters()} == {meta}
    assert hf.training_args(tmp_path).use_cpu is False
    assert hf.accelerate_device() == {"cpu": False}
    assert hf.lightning_device() == {"accelerator": "gpu", "devices": [0]}
    built = {}
    monkeypatch.setattr(hf, "OffloadTrainer", lambda **kw: built.update(kw))
    hf.offload_trainer(hf.tiny_gpt2(), hf.training_args(tmp_path))
    assert isinstance(built["offload_device"], _FakeCuda) and built["offload_device"].index == 0
    with device.running_on("host"):  # and on the host, as before the switch
        assert hf.training_args(tmp_path).use_cpu is True
        assert hf.accelerate_device() == {"cpu": True}
        assert hf.lightning_device() == {"accelerator": "cpu", "devices": 1}


# -- what the declared forms run --------------------------------------------------------------


def _marks(node: ast.AST) -> set[str]:
    """The ``pytest.mark.<name>`` names a decorator list or a ``pytestmark`` value holds."""
    return {
        sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute)
        if sub.value.attr == "mark"
    }


def _declared_forms(tree: ast.Module) -> tuple[list[ast.FunctionDef], dict[str, ast.AST]]:
    """The module's test functions with a declared CUDA form (not simulator_only), and every
    module-level function or class by name."""
    module_marks: set[str] = set()
    defs: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            module_marks |= _marks(node.value)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            defs[node.name] = node
    forms = []
    for name, node in defs.items():
        if not name.startswith("test") or not isinstance(node, ast.FunctionDef):
            continue
        marks = module_marks | set().union(*(_marks(d) for d in node.decorator_list))
        if "cuda_form" in marks and "simulator_only" not in marks:
            forms.append(node)
    return forms, defs


def _reached(forms: list[ast.FunctionDef], defs: dict[str, ast.AST]) -> list[ast.AST]:
    """The forms and the module's functions and classes they name, transitively."""
    seen: dict[str, ast.AST] = {f.name: f for f in forms}
    todo = list(forms)
    while todo:
        for sub in ast.walk(todo.pop()):
            if isinstance(sub, ast.Name) and sub.id in defs and sub.id not in seen:
                seen[sub.id] = defs[sub.id]
                todo.append(defs[sub.id])
    return list(seen.values())


def _names_a_device(arg: ast.AST) -> bool:
    """Whether an argument of ``.to(...)`` can be a device: not ``torch.<dtype>`` nor an
    ``x.dtype``."""
    if isinstance(arg, ast.Attribute):
        return not (arg.attr == "dtype" or getattr(arg.value, "id", None) == "torch")
    return not isinstance(arg, ast.Constant) or isinstance(arg.value, str)


def _moved(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> bool:
    """``on_device(call)``, or ``call.to(...)`` with something that can be a device."""
    parent = parents.get(call)
    if isinstance(parent, ast.Attribute) and parent.attr == "to":
        to = parents.get(parent)
        if isinstance(to, ast.Call):
            if any(k.arg == "device" for k in to.keywords):
                return True
            return any(_names_a_device(arg) for arg in to.args)
    return isinstance(parent, ast.Call) and getattr(parent.func, "id", None) == "on_device"


def _findings(path: Path) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    forms, defs = _declared_forms(tree)
    out = []
    for node in _reached(forms, defs):
        parents = {
            child: parent for parent in ast.walk(node) for child in ast.iter_child_nodes(parent)
        }
        for sub in ast.walk(node):
            if not isinstance(sub, ast.Call) or "# host:" in lines[sub.lineno - 1]:
                continue
            func = sub.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            where = f"{path.name}:{sub.lineno}"
            if name in BYPASSES and not (name == "strict" and isinstance(func, ast.Attribute)):
                out.append(f"{where}: {name}(...) builds an accelerator past the helpers")
            elif (
                name in FACTORIES
                and isinstance(func, ast.Attribute)
                and getattr(func.value, "id", None) == "torch"
                and not any(k.arg == "device" for k in sub.keywords)
                and not _moved(sub, parents)
            ):
                out.append(f"{where}: torch.{name}(...) makes a CPU tensor that is not moved")
    return out


def test_declared_forms_build_nothing_past_the_helpers() -> None:
    files = [p for p in sorted(TESTS.glob("test_*.py")) if "cuda_form" in p.read_text()]
    assert len(files) >= 5, files
    findings = [line for path in files for line in _findings(path)]
    assert not findings, "\n".join(findings)


def test_the_grep_sees_a_form_that_builds_on_the_host(tmp_path: Path) -> None:
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import pytest, torch\n"
        "pytestmark = pytest.mark." + "cuda_form\n"  # split: not a form of this file
        "def _acc():\n    return HostAccelerator(None)\n"
        "def test_x():\n    _acc()\n    torch.randn(3)\n    torch.randn(3).to('cuda')\n"
        "    torch.randn(3).to(torch.bfloat16)\n    torch.randn(3).to(x.device, x.dtype)\n"
        "@pytest.mark.simulator_only\ndef test_y():\n    HostAccelerator(None)\n"
    )
    found = _findings(bad)
    assert len(found) == 3, found  # the accelerator, the CPU tensor, the one cast only
    assert any("HostAccelerator" in f for f in found) and any("torch.randn" in f for f in found)


# -- the switch, end to end -------------------------------------------------------------------


def test_a_cuda_collection_counts_the_declared_forms() -> None:
    """``--accelerator=cuda --collect-only`` on two files: the declared forms counted; in a
    host run the same file has none (it runs on the host, as before)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ZERO_OFFLOAD_TEST_ACCELERATOR", None)
    files = ["tests/test_offload_adamw_parity.py", "tests/test_cuda_switch.py"]
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    cuda = subprocess.run(
        [*argv, "--accelerator=cuda", *files], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert cuda.returncode == 0, cuda.stdout + cuda.stderr
    assert "CUDA forms: 11 tests" in cuda.stdout, cuda.stdout
    assert "11  tests/test_offload_adamw_parity.py" in cuda.stdout
    if not torch.cuda.is_available():
        assert "every CUDA form skips here: needs a CUDA GPU" in cuda.stdout
    host = subprocess.run([*argv, *files], cwd=ROOT, env=env, capture_output=True, text=True)
    assert host.returncode == 0 and "CUDA forms" not in host.stdout
