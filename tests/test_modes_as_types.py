"""Modes travel as types, not flags (issue 35): when an update's weight copies are issued is a
``Publish`` member, and the gradient staging a ``GradStaging`` member; the package's source
has no ``publish`` boolean and compares no ``grad_staging`` against a string."""

from __future__ import annotations

import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "zero_offload"

FLAGS = {
    "a publish boolean": re.compile(r"publish\w*\s*:\s*bool|publish\w*\s*=\s*(True|False|not\b)"),
    "grad_staging compared as a string": re.compile(
        r"grad_staging\s*(==|!=|\bis\b|\bin\b|\bnot in\b)\s*[\"'(]"
    ),
}


def test_no_mode_travels_as_a_flag() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {what}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for what, pattern in FLAGS.items()
        if pattern.search(line.split("#")[0])
    ]
    assert not found, "\n".join(found)
