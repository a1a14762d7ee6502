"""How numbers are spelled and checked in the configs: byte counts with units (parsed and
printed) and the checks every config field shares, each raising with the field's name."""

from __future__ import annotations

import math
import operator
import re
from typing import NoReturn

__all__ = [
    "as_int",
    "check_int",
    "check_positive_finite",
    "format_bytes",
    "parse_bytes",
    "parse_bytes_with_unit",
    "size_spelling",
]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str = "value") -> int:
    """Parse a byte count: an int, or a string such as ``"8GiB"``, ``"512MB"``, ``"1e9"``.

    Binary units (KiB, MiB, GiB, TiB, and the bare K/M/G/T) are powers of 1024; decimal
    units (KB, MB, GB, TB) are powers of 1000. Raises ``ValueError`` naming ``name``.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count (int or a string like '8GiB'), got a bool")
    if not isinstance(value, (int, str)) and hasattr(value, "__index__"):
        value = as_int(name, value)  # a numpy or torch integer
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a byte count (int or a string like '8GiB'), "
            f"got {type(value).__name__} {value!r}"
        )
    match = _BYTES_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{name}={value!r} is not a byte count; use an integer or a number with a unit "
            f"such as '8GiB', '512MiB', '2GB' (units: {', '.join(sorted(k for k in _UNITS if k))})"
        )
    number = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(number):
        raise ValueError(
            f"{name}={value!r} is not a finite byte count; use an integer or a number with a "
            "unit such as '8GiB'"
        )
    return int(number)


def parse_bytes_with_unit(value: int | str, *, name: str, ints: bool = True) -> int:
    """A byte count whose string spelling has a unit (``"48GiB"``, ``"48GB"``, ``"48B"``):
    ``parse_bytes``, except that a string without one (``"48"``) is refused, never read as
    48 bytes, since "48" meant as 48 GiB would silently be a thousand-millionth of it.

    ``ints``: whether ``name`` takes an int of bytes too, which the messages then offer (a
    command-line flag, always a string, does not). Raises ``ValueError``/``TypeError``
    naming ``name``, the value and a spelling that works.
    """
    bytes_hint = "; an int is bytes" if ints else ""
    if isinstance(value, str):
        match = _BYTES_RE.match(value)
        if match is not None and not match.group(2):
            return _refuse_bare_number(value, name=name, ints=ints)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a byte count; use a number with a unit such as "
                f"'8GiB', '512MiB' or '2GB' (units: "
                f"{', '.join(sorted(k for k in _UNITS if k))}){bytes_hint}"
            )
    return parse_bytes(value, name=name)


def _refuse_bare_number(value: str, *, name: str, ints: bool) -> NoReturn:
    """The error for a number without a unit: that number with units, or, from 1024 up
    (likelier bytes than a KiB-scaled amount), that many bytes spelled with a unit."""
    number = value.strip()
    as_bytes = float(number)
    if not math.isfinite(as_bytes):
        raise ValueError(
            f"{name}={value!r} is not a finite byte count; use a number with a unit such as '8GiB'"
        )
    bytes_form = f"the int {number}" if ints and number.isdigit() else f"'{number}B'"
    if as_bytes >= 1024:
        raise ValueError(
            f"{name}={value!r} has no unit (a bare number is not read as bytes); for "
            f"{number} bytes give {size_spelling(int(as_bytes))!r} or {bytes_form}"
        )
    raise ValueError(
        f"{name}={value!r} has no unit; give one, e.g. '{number}GiB' (binary) or "
        f"'{number}GB' (decimal), or {bytes_form} for bytes"
    )


def size_spelling(nbytes: int) -> str:
    """``nbytes`` with the largest unit that spells it exactly (``25769803776`` as
    ``'24GiB'``, ``25 * 10**9`` as ``'25GB'``), else in binary units to two decimals, which
    ``parse_bytes_with_unit`` reads back to within 0.5%."""
    binary = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
    decimal = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
    exact = [
        (nbytes // scale, unit)
        for unit, scale in binary + decimal
        if nbytes >= scale and nbytes % scale == 0
    ]
    if exact:
        number, unit = min(exact)  # the shortest: 2 * 10**9 is '2GB', not '1953125KiB'
        return f"{number}{unit}"
    for unit, scale in binary:
        if nbytes >= scale:
            return f"{nbytes / scale:.2f}{unit}"
    return f"{nbytes}B"


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise RuntimeError("unreachable: format_bytes loop always returns (bug)")


def check_positive_finite(name: str, value: float, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    low_ok = value >= 0 if allow_zero else value > 0
    if not (math.isfinite(value) and low_ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def as_int(name: str, value: object) -> int:
    """``value`` as an int: Python, numpy and 0-d torch integers are (``__index__``);
    bools, floats and the rest raise ``TypeError`` naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got a bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be an int (Python, numpy or torch integer), got "
            f"{type(value).__name__} {value!r}"
        ) from None


def check_int(name: str, value: object, *, low: int) -> int:
    number = as_int(name, value)
    if number < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return number
