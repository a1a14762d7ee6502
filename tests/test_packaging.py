"""The package imports from a bare checkout and every subpackage ships in the wheel."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _subpackages() -> list[str]:
    pkg = ROOT / "zero_offload"
    return sorted(
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in pkg.rglob("__init__.py")
        if "__pycache__" not in p.parts
    )


def test_import_from_a_bare_checkout(tmp_path: pathlib.Path) -> None:
    """A copy of zero_offload/ on PYTHONPATH, nothing installed from it, imports whole:
    kernels live inside the package (no setuptools package-dir mapping to rely on)."""
    shutil.copytree(
        ROOT / "zero_offload",
        tmp_path / "zero_offload",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    code = (
        "import importlib, sys, zero_offload\n"
        f"assert zero_offload.__file__.startswith({str(tmp_path)!r}), zero_offload.__file__\n"
        f"for name in {_subpackages()!r}:\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_every_subpackage_is_in_the_distribution() -> None:
    """setuptools finds the packages itself; the list it finds is every package on disk
    (a hand-kept list once left zero_offload.params out of the wheel)."""
    setuptools = pytest.importorskip("setuptools")
    found = sorted(setuptools.find_packages(str(ROOT), include=["zero_offload*"]))
    assert found == _subpackages()
