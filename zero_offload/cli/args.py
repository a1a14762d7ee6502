"""The flags' value types (argparse ``type=`` functions) and the parser class every
command's parser shares."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import NoReturn

from ..estimate import parse_size

__all__ = ["MAX_PARAMS", "Parser", "byte_size", "fraction", "param_count", "positive_int"]


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (subcommand parsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def byte_size(flag: str, *, least: int = 1) -> Callable[[str], int]:
    """An argparse type for ``flag``: a size with a unit (``24GiB``), never bare bytes."""

    def parse(text: str) -> int:
        try:
            return parse_size(text, name=flag, least=least, ints=False)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


#: The most ``--params`` takes: past it no row fits anything (the search for the largest
#: model stops near it, ``rows._SEARCH_CAP``), so a larger count is a typo.
MAX_PARAMS = 10**15


def param_count(text: str) -> int:
    """``--params``: a whole count in [1, ``MAX_PARAMS``], bare or with a suffix
    (``1500000000``, ``1.5e9``, ``350M``, ``7B``), read exactly (no float rounding). A
    fraction of a parameter (``1.5``), ``inf``, ``nan`` or a count past ``MAX_PARAMS``
    (``1e30``) is a usage error naming the flag, the value and a spelling that works."""
    scales = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    cleaned = text.strip().lower()
    scale = scales.get(cleaned[-1:], 1)
    example = "e.g. 1500000000, 1.5e9, 350M or 7B"
    try:
        value = Decimal(cleaned[:-1] if scale != 1 else cleaned) * scale
    except InvalidOperation:
        raise argparse.ArgumentTypeError(
            f"--params={text!r} is not a parameter count; use {example}"
        ) from None
    if not value.is_finite():
        raise argparse.ArgumentTypeError(
            f"--params={text!r} is not a finite parameter count; use {example}"
        )
    if value != value.to_integral_value():
        whole = max(1, int(value.to_integral_value(rounding=ROUND_CEILING)))
        raise argparse.ArgumentTypeError(
            f"--params={text!r} is not a whole number of parameters; give one, e.g. "
            f"--params {whole}"
        )
    if not 1 <= value <= MAX_PARAMS:
        raise argparse.ArgumentTypeError(
            f"--params={text!r} is outside [1, 1e15] parameters; use {example}"
        )
    return int(value)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value
