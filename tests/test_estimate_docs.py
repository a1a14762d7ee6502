"""docs/estimator.md holds exactly what benchmarks/estimate_table.py prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "estimate_table.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_estimate_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_table_is_the_scripts_output() -> None:
    script = _script()
    block = script.docs_block(script.DOCS.read_text())
    assert block == script.render(), "regenerate: python benchmarks/estimate_table.py --write"


def test_every_example_command_is_in_the_docs() -> None:
    script = _script()
    text = script.DOCS.read_text()
    for _, command in script.EXAMPLES:
        assert f"$ zero-offload estimate {command}\n" in text


def test_a_page_without_the_block_is_refused(tmp_path: Path) -> None:
    script = _script()
    with pytest.raises(ValueError, match="no block"):
        script.docs_block("# a page\n")
