"""``zero-offload estimate``: its flags, the checks that name them, and the command."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from ..estimate import DEFAULT_BUCKET_BYTES, DEFAULT_MICRO_BATCH, DEFAULT_SEQ_LEN, KNOWN_MODELS
from .args import byte_size, param_count, positive_int

__all__ = ["add_estimate"]


def _estimate_model(args: argparse.Namespace) -> Any:
    """What ``estimate`` is of: ``--params``, ``--hf-config``, or a shape from the flags."""
    from ..estimate import ModelShape

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
    from ..estimate import estimate

    if args.north_star or args.zero_table:
        _check_fixed_question(args)
        from ..estimate.north_star import north_star, north_star_text
        from ..estimate.paper import table1

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


def add_estimate(commands: Any) -> None:
    from ..estimate import (  # torch-free
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
    model.add_argument("--params", type=param_count, default=None, help="e.g. 1.5e9, 350M, 7B")
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
    model.add_argument("--layers", type=positive_int, default=None)
    model.add_argument("--hidden", type=positive_int, default=None)
    model.add_argument("--heads", type=positive_int, default=None, help="attention heads")
    model.add_argument(
        "--kv-heads",
        type=positive_int,
        default=None,
        help="key/value heads (GQA); default --heads",
    )
    model.add_argument(
        "--ffn", type=positive_int, default=None, help="MLP width; default 4 x --hidden"
    )
    model.add_argument("--vocab", type=positive_int, default=None, help="default 50257")
    model.add_argument(
        "--tied", action="store_true", help="the head shares the token embedding's weight"
    )
    # Defaults are None, estimate()'s own applying, so that a flag given is a flag seen
    # (--north-star refuses those it would ignore).
    est.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help=f"tokens per sequence; default {DEFAULT_SEQ_LEN}",
    )
    est.add_argument(
        "--micro-batch",
        type=positive_int,
        default=None,
        help=f"sequences per micro-batch; default {DEFAULT_MICRO_BATCH}",
    )
    est.add_argument("--world-size", type=positive_int, default=None, help="ranks; default 1")
    est.add_argument(
        "--ranks-per-node",
        type=positive_int,
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
        type=byte_size("--device-memory", least=2**20),
        default=None,
        help="per rank, e.g. 80GiB; default this machine's GPU",
    )
    est.add_argument(
        "--host-memory",
        type=byte_size("--host-memory", least=2**20),
        default=None,
        help="per node, e.g. 256GiB; default this machine's RAM (a container's limit)",
    )
    est.add_argument(
        "--disk-memory",
        type=byte_size("--disk-memory", least=2**20),
        default=None,
        help="NVMe per node for nvme_dir, e.g. 2TB; default none",
    )
    est.add_argument(
        "--bucket-bytes",
        type=byte_size("--bucket-bytes", least=1024),
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
