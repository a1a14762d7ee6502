"""The flags' value types (argparse ``type=`` functions) and the parser class every
command's parser shares."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from ..estimate import parse_size

__all__ = ["Parser", "byte_size", "fraction", "param_count", "positive_int"]


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


def param_count(text: str) -> int:
    """``--params``: a finite count >= 1, bare or with a suffix (``1.5e9``, ``350M``,
    ``7B``); ``inf``, ``nan`` and a float overflow (``1e400``) are usage errors too."""
    scales = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    cleaned = text.strip().lower()
    scale = scales.get(cleaned[-1:], 1)
    try:
        value = float(cleaned[:-1] if scale != 1 else cleaned) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a parameter count: {text!r}; use e.g. 1500000000, 1.5e9, 350M or 7B"
        ) from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"not a finite parameter count: {text!r}; use e.g. 1500000000, 1.5e9, 350M or 7B"
        )
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 parameter, got {text!r}")
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
