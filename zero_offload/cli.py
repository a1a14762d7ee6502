"""The ``zero-offload`` command.

Errors from the command print one line and exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]


def _cmd_info(args: argparse.Namespace) -> int:
    from .sysinfo import collect_info, format_info

    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zero-offload",
        description="ZeRO-Offload for PyTorch: train models larger than GPU memory.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser("info", help="what this machine offers the library")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(run=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zero-offload`` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except (ValueError, TypeError, MemoryError, RuntimeError, OSError) as exc:
        if args.debug:
            raise
        print(f"zero-offload {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
