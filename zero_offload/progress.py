"""Progress bars for the library's long waits: kernel compilation, NVMe preallocation,
streaming checkpoints.

Note [waits say what they wait for]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A first run compiles the numba kernels (about a minute cold), an NVMe tier preallocates its
files, a streaming checkpoint writes every bucket: each is silent work a user cannot tell
from a hang. Each goes through ``progress``, a tqdm bar on stderr that appears only once the
wait has lasted ``delay`` seconds (2 by default, so short waits print nothing) and only when
stderr is a terminal (logs and CI output stay clean). ``ZERO_OFFLOAD_PROGRESS=0`` turns the
bars off, ``=1`` forces them on (for a terminal that is not detected as one).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress", "progress_enabled"]

T = TypeVar("T")


def progress_enabled() -> bool:
    """Whether bars are shown: ``ZERO_OFFLOAD_PROGRESS`` if set, else stderr is a TTY."""
    forced = os.environ.get("ZERO_OFFLOAD_PROGRESS", "").strip()
    if forced in {"0", "1"}:
        return forced == "1"
    stream = sys.stderr
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def progress(
    items: Iterable[T],
    *,
    desc: str,
    total: int | None = None,
    unit: str = "it",
    delay: float = 2.0,
) -> Iterator[T]:
    """``items``, with a tqdm bar named ``desc`` once the wait passes ``delay`` seconds
    (see Note [waits say what they wait for]); plain ``items`` when bars are off."""
    if not progress_enabled():
        yield from items
        return
    from tqdm.auto import tqdm  # imported only when a bar may show

    yield from tqdm(items, desc=f"zero-offload: {desc}", total=total, unit=unit, delay=delay)
