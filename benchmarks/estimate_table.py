"""The example tables of ``docs/estimator.md``: ``zero-offload estimate`` run on fixed inputs.

Every size is given (nothing depends on this machine), so the output is the same anywhere;
``tests/test_estimate_docs.py`` checks that the docs hold exactly this output.

Usage: ``python benchmarks/estimate_table.py`` prints the docs block;
``python benchmarks/estimate_table.py --write`` replaces it in ``docs/estimator.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Sequence
from pathlib import Path

from zero_offload.cli import main as cli_main

DOCS = Path(__file__).resolve().parent.parent / "docs" / "estimator.md"
BEGIN = "<!-- estimate_table.py: begin (generated; run benchmarks/estimate_table.py --write) -->"
END = "<!-- estimate_table.py: end -->"

#: The examples: a title, then the command's arguments (split on spaces).
EXAMPLES: list[tuple[str, str]] = [
    (
        "Llama-3-8B on one 24 GiB GPU and 128 GiB of RAM, 4096-token sequences",
        "--hf-config llama-3-8b --seq-len 4096 --device-memory 24GiB --host-memory 128GiB",
    ),
    (
        "Llama-3-70B on one 24 GiB GPU, 256 GiB of RAM and 2 TB of NVMe (the north star)",
        "--hf-config llama-3-70b --seq-len 4096 --device-memory 24GiB --host-memory 256GiB "
        "--disk-memory 2TB",
    ),
    (
        "The same model from flags, on an 80 GiB GPU and 512 GiB of RAM",
        "--arch llama --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 "
        "--vocab 128256 --seq-len 4096 --device-memory 80GiB --host-memory 512GiB",
    ),
    (
        "A 1.6B GPT (GPT-2 XL's widths), micro-batch 4, on 24 GiB and 256 GiB",
        "--layers 48 --hidden 1600 --heads 25 --seq-len 1024 --micro-batch 4 "
        "--device-memory 24GiB --host-memory 256GiB",
    ),
    (
        "Mixtral-8x7B on 8 GPUs of 80 GiB and a 1 TiB node: its weights alone exceed a GPU, "
        "so only the ZeRO-3 rows (shards on the device, or parameter offload) with "
        "checkpointing or activation offload fit; the library runs them, except the rows "
        "with in-flight staging, estimates of what it does not run yet on several ranks",
        "--hf-config mixtral-8x7b --seq-len 4096 --world-size 8 --device-memory 80GiB "
        "--host-memory 1TiB",
    ),
    (
        "Llama-3-8B trained with Muon on 2 GPUs of 24 GiB and a 256 GiB node: the rows size "
        "Muon's state (the master and, for matrices, the momentum; AdamW's moments for the "
        "rest), each parameter in one rank's shard with its padding, and list the rows the "
        "library refuses for Muon",
        "--hf-config llama-3-8b --seq-len 4096 --world-size 2 --optimizer muon "
        "--device-memory 24GiB --host-memory 256GiB",
    ),
]


def _run(argv: Sequence[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli_main(["estimate", *argv])
    if status != 0:
        raise RuntimeError(f"zero-offload estimate {' '.join(argv)} exited with {status}")
    return out.getvalue().rstrip("\n")


def render() -> str:
    """The docs block: each example's command and its output, between the markers."""
    parts = [BEGIN]
    for title, command in EXAMPLES:
        parts += [
            "",
            f"{title}:",
            "",
            "```",
            f"$ zero-offload estimate {command}",
            _run(command.split()),
            "```",
        ]
    return "\n".join([*parts, "", END])


def docs_block(text: str) -> str:
    """The generated block of ``text`` (the docs page), markers included."""
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"{DOCS} has no block between {BEGIN!r} and {END!r}")
    return text[start : stop + len(END)]


def main(argv: Sequence[str] | None = None) -> None:
    """Print the block, or write it into the docs with ``--write``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the block in {DOCS}")
    args = parser.parse_args(argv)
    block = render()
    if not args.write:
        print(block)
        return
    text = DOCS.read_text()
    DOCS.write_text(text.replace(docs_block(text), block))
    print(f"wrote {DOCS}")


if __name__ == "__main__":
    main()
