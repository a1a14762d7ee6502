"""The ``zero-offload`` parser, its entry point, and the commands ``info``, ``demo`` and
``bench`` (``estimate``'s are in ``estimate_command.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .args import Parser, byte_size, fraction, positive_int
from .estimate_command import add_estimate

__all__ = ["BENCHMARKS", "main"]

#: ``zero-offload bench`` names and the scripts under the repository's ``benchmarks/``.
BENCHMARKS = {
    "kernels": "bench_cpu_adam.py",
    "grad-passes": "bench_grad_passes.py",
    "pools": "bench_pool.py",
    "step": "bench_offload_step.py",
    "step-dist": "bench_offload_step_dist.py",
    "activations": "bench_activations.py",
    "profiler": "bench_profiler.py",
}
_BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


# -- commands ----------------------------------------------------------------------------


def _cmd_info(args: argparse.Namespace) -> int:
    from ..sysinfo import SECTIONS, collect_info, format_info

    if args.json:  # one object: every section first
        print(json.dumps(collect_info(), indent=2))
        return 0
    for collect in SECTIONS:  # the machine's facts print before torch is imported
        print(format_info(collect(), width=len("numba_threading_layer_reason")), flush=True)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..demo.train import DemoConfig, run_demo

    names = {field.name for field in dataclasses.fields(DemoConfig)} - {"out"}
    flags = {name: value for name, value in vars(args).items() if name in names}
    config = DemoConfig(**flags, out=Path(args.out))
    run_demo(config, echo=lambda line: print(line, flush=True))
    return 0


def _load_benchmark(name: str) -> Callable[[list[str]], Any]:
    path = _BENCH_DIR / BENCHMARKS[name]
    if not path.is_file():
        raise FileNotFoundError(
            f"benchmark {name!r} is not available: {path} does not exist (benchmarks ship "
            "with the source repository, not the installed package; run from a checkout)"
        )
    spec = importlib.util.spec_from_file_location(f"_zero_offload_bench_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import benchmark {name!r} from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # benchmarks import their shared helpers
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module.main


def _cmd_bench(args: argparse.Namespace) -> int:
    names = list(BENCHMARKS) if args.which == "all" else [args.which]
    missing = []
    for name in names:
        if args.which == "all" and not (_BENCH_DIR / BENCHMARKS[name]).is_file():
            missing.append(BENCHMARKS[name])
            continue
        print(f"== zero-offload bench {name} ({BENCHMARKS[name]} --quick) ==", flush=True)
        _load_benchmark(name)(["--quick"])
    if missing:
        print(f"not run (file missing under {_BENCH_DIR}): {', '.join(missing)}")
    return 0


# -- parser ------------------------------------------------------------------------------

_DEMO_HELP = "train a small GPT with offload, profiled"


def _add_demo(commands: Any) -> None:
    from ..demo.train import DemoConfig as D  # the flags' defaults are the config's

    demo = commands.add_parser("demo", help=_DEMO_HELP)
    demo.add_argument("--steps", type=positive_int, default=D.steps, help="optimizer steps")
    demo.add_argument("--layers", type=positive_int, default=D.layers)
    demo.add_argument("--hidden", type=positive_int, default=D.hidden)
    demo.add_argument("--heads", type=positive_int, default=D.heads)
    demo.add_argument("--batch", type=positive_int, default=D.batch, help="sequences per step")
    demo.add_argument("--seq-len", type=positive_int, default=D.seq_len, help="characters each")
    demo.add_argument("--lr", type=float, default=D.lr, help="peak learning rate")
    demo.add_argument("--offload-fraction", type=fraction, default=D.offload_fraction)
    demo.add_argument(
        "--activation-offload",
        action=argparse.BooleanOptionalAction,
        default=D.activation_offload,
        help="checkpoint each block with its input kept on the host",
    )
    demo.add_argument(
        "--device-budget", type=byte_size("--device-budget"), default=None, help="e.g. 8MiB"
    )
    demo.add_argument(
        "--bucket-bytes", type=byte_size("--bucket-bytes", least=1024), default=D.bucket_bytes
    )
    demo.add_argument(
        "--link-bandwidth",
        type=byte_size("--link-bandwidth"),
        default=None,
        help="host accelerator only: simulate a link of this many bytes/s (e.g. 12GB)",
    )
    demo.add_argument("--out", default=str(D.out), help="folder for trace, plot, JSON")
    demo.add_argument("--seed", type=int, default=D.seed)
    demo.set_defaults(run=_cmd_demo)


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command's parser; the demo's flags only when ``command`` is ``demo``."""
    parser = Parser(
        prog="zero-offload",
        description="ZeRO-Offload for PyTorch: train models larger than GPU memory.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = commands.add_parser(
        "info",
        help="what this machine offers the library",
        description="The machine's facts (CPU, RAM) first, at once; then torch's and the "
        "accelerator's, which import torch (seconds), then numba's.",
    )
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(run=_cmd_info)
    if command == "demo":
        _add_demo(commands)
    else:  # listed in --help; its flags need torch (see the module docstring)
        commands.add_parser("demo", help=_DEMO_HELP)
    add_estimate(commands)
    bench = commands.add_parser("bench", help="run the benchmarks' --quick mode")
    bench.add_argument("which", nargs="?", default="all", choices=[*BENCHMARKS, "all"])
    bench.set_defaults(run=_cmd_bench)
    return parser


# Note [a reader that went away]
# ``zero-offload estimate ... | head -3`` closes the pipe while the command still prints:
# the next write raises BrokenPipeError, which used to reach the generic handler and print
# "error: [Errno 32] Broken pipe", exiting 2, for output the user cut on purpose. Now the
# command stops quietly with 141 (128 + SIGPIPE), what a tool killed by SIGPIPE reports to
# the shell, as ``yes | head`` does, so ``set -o pipefail`` still sees the cut. Python would
# flush stdout again at exit and print the error itself, so stdout is pointed at devnull
# first (the recipe of Python's signal docs).

_SIGPIPE_STATUS = 141


def _quiet_stdout() -> None:
    """Point stdout at devnull, so the interpreter's last flush has nowhere to fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zero-offload`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word that is not a flag (the top level has only --debug).
    parser = _parser(next((word for word in argv if not word.startswith("-")), None))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed on one line
        return exc.code if isinstance(exc.code, int) else 2
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        status = run(args)
        sys.stdout.flush()  # a closed reader is met here, not at the interpreter's exit
        return status
    except BrokenPipeError:  # Note [a reader that went away]
        _quiet_stdout()
        return _SIGPIPE_STATUS
    except (ValueError, TypeError, MemoryError, RuntimeError, OSError, ImportError) as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"zero-offload {args.command}: error: {message}", file=sys.stderr)
        return 2
