"""The ``zero-offload`` command: ``info``, ``demo``, ``estimate``, ``bench``.

``--help`` and the parser import neither torch nor numba (Note [the package imports torch
lazily] in ``__init__.py``): each command imports what it needs when it runs, and the demo's
flags, whose defaults come from a module that imports torch, are added only when the
command is ``demo``.

Errors (bad flag values, a budget too small, a missing benchmark) print one line and exit
with status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .estimate import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MICRO_BATCH,
    DEFAULT_SEQ_LEN,
    KNOWN_MODELS,
    parse_size,
)

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
_BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (subcommand parsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _byte_size(flag: str, *, least: int = 1) -> Callable[[str], int]:
    """An argparse type for ``flag``: a size with a unit (``24GiB``), never bare bytes."""

    def parse(text: str) -> int:
        try:
            return parse_size(text, name=flag, least=least, ints=False)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


def _param_count(text: str) -> int:
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


# -- commands ----------------------------------------------------------------------------


def _cmd_info(args: argparse.Namespace) -> int:
    from .sysinfo import SECTIONS, collect_info, format_info

    if args.json:  # one object: every section first
        print(json.dumps(collect_info(), indent=2))
        return 0
    for collect in SECTIONS:  # the machine's facts print before torch is imported
        print(format_info(collect(), width=len("numba_threading_layer_reason")), flush=True)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo.train import DemoConfig, run_demo

    names = {field.name for field in dataclasses.fields(DemoConfig)} - {"out"}
    flags = {name: value for name, value in vars(args).items() if name in names}
    config = DemoConfig(**flags, out=Path(args.out))
    run_demo(config, echo=lambda line: print(line, flush=True))
    return 0


def _estimate_model(args: argparse.Namespace) -> Any:
    """What ``estimate`` is of: ``--params``, ``--hf-config``, or a shape from the flags."""
    from .estimate import ModelShape

    shape_flags = {
        "--layers": args.layers,
        "--hidden": args.hidden,
        "--heads": args.heads,
        "--kv-heads": args.kv_heads,
        "--ffn": args.ffn,
        "--vocab": args.vocab,
        "--arch": args.arch,
        "--tied": True if args.tied else None,
    }
    given = [flag for flag, value in shape_flags.items() if value is not None]
    sources = [
        *(["--params"] if args.params is not None else []),
        *(["--hf-config"] if args.hf_config is not None else []),
        *([" ".join(given)] if given else []),
    ]
    if len(sources) > 1:
        raise ValueError(
            f"give one of --params, --hf-config or a model shape (--layers, --hidden, "
            f"--heads, ...), not both: got {' and '.join(sources)}"
        )
    if args.params is not None:
        return args.params
    if args.hf_config is not None:
        return args.hf_config
    if not given:
        raise ValueError(
            "nothing to estimate: give --params N (e.g. 7B), --hf-config (a config.json, its "
            f"folder, or one of {', '.join(KNOWN_MODELS)}), or a model shape with --layers, "
            "--hidden and --heads (plus --kv-heads, --ffn, --vocab, --tied, --arch)"
        )
    missing = [flag for flag in ("--layers", "--hidden", "--heads") if shape_flags[flag] is None]
    if missing:
        raise ValueError(
            f"a model shape needs {', '.join(missing)} too (Llama-3-8B: --arch llama "
            "--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256), "
            "or use --hf-config llama-3-8b"
        )
    if args.hidden % args.heads:
        raise ValueError(
            f"--heads {args.heads} must divide --hidden {args.hidden} (each head takes "
            f"hidden / heads of the width); give a --heads that divides it, e.g. "
            f"{_nearest_divisor(args.hidden, args.heads)}, or use --hf-config for a model "
            "whose head size is its own"
        )
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.heads % kv_heads:
        raise ValueError(
            f"--kv-heads {kv_heads} must divide --heads {args.heads} (each key/value head "
            f"serves a whole group of query heads); e.g. --kv-heads "
            f"{_nearest_divisor(args.heads, kv_heads)}"
        )
    return ModelShape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn=args.ffn,
        vocab=args.vocab if args.vocab is not None else 50257,
        tied=args.tied,
        arch=args.arch or "gpt",
        seq_len=DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len,
        micro_batch=DEFAULT_MICRO_BATCH if args.micro_batch is None else args.micro_batch,
    )


def _nearest_divisor(number: int, near: int) -> int:
    """A divisor of ``number`` near ``near`` (the smaller on a tie; a few thousand tried
    either side, else 1)."""
    for delta in range(min(near, 4096)):
        for candidate in (near - delta, near + delta):
            if 1 <= candidate <= number and number % candidate == 0:
                return candidate
    return 1


#: ``estimate``'s flags that say what to estimate and on what; ``--north-star`` and
#: ``--zero-table`` answer fixed questions of their own and would ignore every one.
_ESTIMATE_INPUTS = (
    "--params",
    "--hf-config",
    "--arch",
    "--layers",
    "--hidden",
    "--heads",
    "--kv-heads",
    "--ffn",
    "--vocab",
    "--tied",
    "--seq-len",
    "--micro-batch",
    "--world-size",
    "--ranks-per-node",
    "--dtype",
    "--optimizer",
    "--moments-dtype",
    "--device-memory",
    "--host-memory",
    "--disk-memory",
    "--bucket-bytes",
)


def _given(args: argparse.Namespace, flags: Sequence[str]) -> list[str]:
    """Which of ``flags`` the command line gave (each defaults to None, ``--tied`` to
    False)."""
    return [
        flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) not in (None, False)
    ]


def _check_fixed_question(args: argparse.Namespace) -> None:
    """``--north-star`` and ``--zero-table`` take no inputs: refuse the flags they would
    ignore, naming them."""
    mode = "--north-star" if args.north_star else "--zero-table"
    if args.north_star and args.zero_table:
        raise ValueError("give one of --north-star and --zero-table: each prints its own answer")
    ignored = _given(args, _ESTIMATE_INPUTS) + (["--json"] if args.zero_table and args.json else [])
    if ignored:
        what = (
            "estimates its own two models and machines (Llama-3-8B on 24GiB + 128GiB, "
            "Llama-3-70B on 24GiB + 256GiB + 2TB NVMe)"
            if args.north_star
            else "prints the ZeRO paper's Table 1, recomputed for its own models and ranks, as text"
        )
        raise ValueError(
            f"{mode} {what}, and would ignore {', '.join(ignored)}; drop "
            f"{'it' if len(ignored) == 1 else 'them'}, or leave out {mode} to estimate "
            "your own model"
        )


def _check_ranks(args: argparse.Namespace) -> None:
    """``--ranks-per-node`` against ``--world-size``: the nodes must be whole."""
    world = 1 if args.world_size is None else args.world_size
    per_node = args.ranks_per_node
    if per_node is None:
        return
    shown = f"--world-size {world}" + (" (the default)" if args.world_size is None else "")
    if per_node > world:
        raise ValueError(
            f"--ranks-per-node {per_node} is more than {shown}: a node's ranks are ranks "
            f"of the run; give a --world-size that is a multiple of {per_node} ({per_node} "
            "for one node), or a smaller --ranks-per-node"
        )
    if world % per_node:
        raise ValueError(
            f"{shown} is not a multiple of --ranks-per-node {per_node}: host and disk are "
            f"per node of {per_node} ranks, and the nodes must be full; give --world-size "
            f"{-(-world // per_node) * per_node} or a --ranks-per-node that divides {world}"
        )


def _cmd_estimate(args: argparse.Namespace) -> int:
    from .estimate import estimate

    if args.north_star or args.zero_table:
        _check_fixed_question(args)
        from .estimate.north_star import north_star, north_star_text
        from .estimate.paper import table1

        if args.json and args.north_star:
            answers = [
                {"model": a.star.title, "chosen": a.chosen and a.chosen.name}
                | {"estimate": a.estimate.to_dict()}
                for a in north_star()
            ]
            print(json.dumps(answers, indent=2))
        else:
            print(north_star_text() if args.north_star else table1())
        return 0
    _check_ranks(args)
    model = _estimate_model(args)
    options = {  # a flag left out is None: estimate()'s default
        "world_size": args.world_size,
        "ranks_per_node": args.ranks_per_node,
        "dtype": args.dtype,
        "device_memory": args.device_memory,
        "host_memory": args.host_memory,
        "disk_memory": args.disk_memory,
        "bucket_bytes": args.bucket_bytes,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "optimizer": args.optimizer,
        "moments_dtype": args.moments_dtype,
    }
    result = estimate(
        model, **{name: value for name, value in options.items() if value is not None}
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
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
    from .demo.train import DemoConfig as D  # the flags' defaults are the config's

    demo = commands.add_parser("demo", help=_DEMO_HELP)
    demo.add_argument("--steps", type=_positive_int, default=D.steps, help="optimizer steps")
    demo.add_argument("--layers", type=_positive_int, default=D.layers)
    demo.add_argument("--hidden", type=_positive_int, default=D.hidden)
    demo.add_argument("--heads", type=_positive_int, default=D.heads)
    demo.add_argument("--batch", type=_positive_int, default=D.batch, help="sequences per step")
    demo.add_argument("--seq-len", type=_positive_int, default=D.seq_len, help="characters each")
    demo.add_argument("--lr", type=float, default=D.lr, help="peak learning rate")
    demo.add_argument("--offload-fraction", type=_fraction, default=D.offload_fraction)
    demo.add_argument(
        "--activation-offload",
        action=argparse.BooleanOptionalAction,
        default=D.activation_offload,
        help="checkpoint each block with its input kept on the host",
    )
    demo.add_argument(
        "--device-budget", type=_byte_size("--device-budget"), default=None, help="e.g. 8MiB"
    )
    demo.add_argument(
        "--bucket-bytes", type=_byte_size("--bucket-bytes", least=1024), default=D.bucket_bytes
    )
    demo.add_argument(
        "--link-bandwidth",
        type=_byte_size("--link-bandwidth"),
        default=None,
        help="host accelerator only: simulate a link of this many bytes/s (e.g. 12GB)",
    )
    demo.add_argument("--out", default=str(D.out), help="folder for trace, plot, JSON")
    demo.add_argument("--seed", type=int, default=D.seed)
    demo.set_defaults(run=_cmd_demo)


def _add_estimate(commands: Any) -> None:
    from .estimate import (  # torch-free
        ARCHITECTURES,
        MOMENTS_DTYPES,
        OPTIMIZERS,
        SUPPORTED_MODEL_TYPES,
    )

    est = commands.add_parser(
        "estimate",
        help="memory per tier for each configuration",
        description="Memory per tier for each way of training a model, and what fits; "
        "docs/estimator.md explains the columns. Sizes need a unit: 80GiB, 24GB, 512MiB.",
    )
    model = est.add_argument_group("the model (one of --params, --hf-config, or a shape)")
    model.add_argument("--params", type=_param_count, default=None, help="e.g. 1.5e9, 350M, 7B")
    model.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH|NAME",
        help="a transformers config.json or its folder (model types: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}), or one of {', '.join(KNOWN_MODELS)}; "
        "read locally, nothing is downloaded",
    )
    model.add_argument(
        "--arch",
        choices=tuple(ARCHITECTURES),
        default=None,
        help="block layout: gpt (GPT-2, the demo: GeLU MLP, LayerNorm, learned positions), "
        "llama (Llama, Mistral: SwiGLU, RMSNorm, rotary), qwen2 (llama with Q/K/V biases); "
        "default gpt",
    )
    model.add_argument("--layers", type=_positive_int, default=None)
    model.add_argument("--hidden", type=_positive_int, default=None)
    model.add_argument("--heads", type=_positive_int, default=None, help="attention heads")
    model.add_argument(
        "--kv-heads",
        type=_positive_int,
        default=None,
        help="key/value heads (GQA); default --heads",
    )
    model.add_argument(
        "--ffn", type=_positive_int, default=None, help="MLP width; default 4 x --hidden"
    )
    model.add_argument("--vocab", type=_positive_int, default=None, help="default 50257")
    model.add_argument(
        "--tied", action="store_true", help="the head shares the token embedding's weight"
    )
    # Defaults are None, estimate()'s own applying, so that a flag given is a flag seen
    # (--north-star refuses those it would ignore).
    est.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        help=f"tokens per sequence; default {DEFAULT_SEQ_LEN}",
    )
    est.add_argument(
        "--micro-batch",
        type=_positive_int,
        default=None,
        help=f"sequences per micro-batch; default {DEFAULT_MICRO_BATCH}",
    )
    est.add_argument("--world-size", type=_positive_int, default=None, help="ranks; default 1")
    est.add_argument(
        "--ranks-per-node",
        type=_positive_int,
        default=None,
        help="ranks sharing a node's host memory and NVMe; must divide --world-size; "
        "default --world-size (one node)",
    )
    est.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="training dtype; default bfloat16",
    )
    est.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="the optimizer whose state the rows size (Adafactor and Muon: by each "
        "parameter's shape); rows it refuses are listed under the table; default adamw",
    )
    est.add_argument(
        "--moments-dtype",
        choices=MOMENTS_DTYPES,
        default=None,
        help="OffloadConfig.moments_dtype: the dtype of the optimizer's moments in host RAM "
        "and on NVMe (bfloat16: AdamW 8 bytes per parameter instead of 12, Lion and "
        "Adagrad 6 instead of 8); default float32",
    )
    est.add_argument(
        "--device-memory",
        type=_byte_size("--device-memory", least=2**20),
        default=None,
        help="per rank, e.g. 80GiB; default this machine's GPU",
    )
    est.add_argument(
        "--host-memory",
        type=_byte_size("--host-memory", least=2**20),
        default=None,
        help="per node, e.g. 256GiB; default this machine's RAM",
    )
    est.add_argument(
        "--disk-memory",
        type=_byte_size("--disk-memory", least=2**20),
        default=None,
        help="NVMe per node for nvme_dir, e.g. 2TB; default none",
    )
    est.add_argument(
        "--bucket-bytes",
        type=_byte_size("--bucket-bytes", least=1024),
        default=None,
        help=f"OffloadConfig.bucket_bytes; default {DEFAULT_BUCKET_BYTES // 2**20}MiB",
    )
    est.add_argument("--json", action="store_true", help="print JSON instead of a table")
    est.add_argument(
        "--north-star",
        action="store_true",
        help="the big-models issue's two targets (Llama-3-8B on 24GiB + 128GiB, Llama-3-70B "
        "on 24GiB + 256GiB + 2TB NVMe): the configuration chosen for each, or that none "
        "fits; takes no other flag but --json",
    )
    est.add_argument(
        "--zero-table",
        action="store_true",
        help="the ZeRO paper's Table 1 (model-state GB per device, stages 1-3), recomputed; "
        "takes no other flag",
    )
    est.set_defaults(run=_cmd_estimate)


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command's parser; the demo's flags only when ``command`` is ``demo``."""
    parser = _Parser(
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
    _add_estimate(commands)
    bench = commands.add_parser("bench", help="run the benchmarks' --quick mode")
    bench.add_argument("which", nargs="?", default="all", choices=[*BENCHMARKS, "all"])
    bench.set_defaults(run=_cmd_bench)
    return parser


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
        return run(args)
    except (ValueError, TypeError, MemoryError, RuntimeError, OSError, ImportError) as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"zero-offload {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
