"""Sizing of hypothesis tests by the active profile (registered in conftest.py)."""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 25  # max_examples of the "ci" profile, see conftest.py


def scaled(ci_examples: int) -> int:
    """``ci_examples`` under the "ci" profile, proportionally more under a longer one."""
    return max(1, ci_examples * settings.default.max_examples // CI_EXAMPLES)
