"""`zero-offload --help` and the package import start without torch or numba (Note [the
package imports torch lazily] in zero_offload/__init__.py), and every public name still
resolves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import zero_offload

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numba", "transformers")


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, *args, "-c", code] if code else [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env=env,
    )


def _imported_after(code: str) -> set[str]:
    """Which of ``HEAVY`` are in ``sys.modules`` after running ``code`` in a fresh
    interpreter."""
    probe = f"{code}\nimport sys\nprint('IMPORTED', *(m for m in {HEAVY!r} if m in sys.modules))"
    result = _python(probe)
    assert result.returncode == 0, result.stderr
    last = result.stdout.splitlines()[-1].split()
    assert last[0] == "IMPORTED", result.stdout
    return set(last[1:])


def test_help_imports_neither_torch_nor_numba() -> None:
    run_help = (
        "import runpy, sys\n"
        "sys.argv = ['zero-offload', '--help']\n"
        "try:\n"
        "    runpy.run_module('zero_offload', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code"
    )
    assert _imported_after(run_help) == set()


@pytest.mark.parametrize("command", ["estimate", "info", "bench"])
def test_subcommand_help_imports_neither(command: str) -> None:
    run_help = f"from zero_offload.cli import main\nassert main([{command!r}, '--help']) == 0"
    assert _imported_after(run_help) == set()


def test_the_real_entry_point_imports_no_torch() -> None:
    # -X importtime lists every module the interpreter imported, on stderr.
    result = _python("", "-X", "importtime", "-m", "zero_offload", "--help")
    assert result.returncode == 0, result.stderr
    assert "estimate" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert not imported & set(HEAVY), imported & set(HEAVY)
    assert "zero_offload.cli" in imported  # the probe would see torch if it came


def test_package_and_estimator_import_no_torch() -> None:
    assert _imported_after("import zero_offload\nfrom zero_offload import estimate") == set()


def test_a_lazy_name_imports_its_module() -> None:
    assert "torch" in _imported_after("from zero_offload import OffloadAdamW")


def test_info_prints_the_machine_before_importing_torch() -> None:
    code = (
        "import sys\n"
        "from zero_offload.sysinfo import SECTIONS, collect_machine_info\n"
        "assert SECTIONS[0] is collect_machine_info\n"
        "info = collect_machine_info()\n"
        "assert info['host_ram_total'] > 0 and info['logical_cores'] >= 1, info"
    )
    assert _imported_after(code) == set()
    result = _python("", "-m", "zero_offload", "info")
    assert result.returncode == 0, result.stderr
    lines = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    assert (
        lines.index("host_ram_total") < lines.index("torch_version") < lines.index("numba_version")
    )


@pytest.mark.parametrize("name", zero_offload.__all__)
def test_every_public_name_resolves(name: str) -> None:
    value = getattr(zero_offload, name)
    assert value is not None
    namespace: dict[str, object] = {}
    exec(f"from zero_offload import {name}", namespace)
    assert namespace[name] is value
    assert name in dir(zero_offload)


def test_estimate_is_the_function_after_the_subpackage_is_imported() -> None:
    # Importing a submodule binds it on its parent (zero_offload.estimate), not on the package.
    import zero_offload.estimate.rows
    from zero_offload import estimate

    assert callable(estimate) and estimate.__name__ == "estimate"
    assert zero_offload.estimate is estimate


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'OffloadSGD'"):
        zero_offload.OffloadSGD  # noqa: B018
