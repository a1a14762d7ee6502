"""Rounding byte counts up to an alignment: the one ``aligned`` every planner uses."""

from __future__ import annotations

__all__ = ["aligned"]


def aligned(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment`` (bytes, > 0)."""
    return -(-nbytes // alignment) * alignment
