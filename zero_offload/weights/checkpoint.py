"""An HF-style safetensors checkpoint read tensor by tensor: one ``model.safetensors``, or a
sharded one (``model.safetensors.index.json`` naming each tensor's shard).

Opening reads the index and each shard's header only (names, shapes, dtypes): nothing of the
weights. ``read_into`` reads one tensor and copies it into its destination, so the host
holds one tensor of the checkpoint at a time, never a shard or the model.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "INDEX_NAME",
    "SINGLE_NAME",
    "SafetensorsCheckpoint",
    "TensorInfo",
    "checkpoint_name",
    "nbytes_of",
    "original_module",
]

# Note [a compiled model is its original module]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.compile(model) wraps the model in an OptimizedModule whose parameters and state
# dict are the original's under the prefix ``_orig_mod.``. A checkpoint written with those
# names is not the model's: transformers' from_pretrained reported them missing and
# unexpected, and silently loaded a randomly initialised model. So save_pretrained and
# load_pretrained work on the original module, as transformers' own save_pretrained and
# accelerate's unwrap_model do; a wrapper of a wrapper is unwrapped too. A model whose
# blocks are compiled one by one (``model.layers[i] = torch.compile(layer)``, the usual
# recipe for large models) has the segment inside its names (``layers.0._orig_mod.w``):
# every name is written and matched without it (``checkpoint_name``), as the uncompiled
# model names it.


def original_module(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without ``torch.compile``'s wrappers (Note [a compiled model is its
    original module])."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def checkpoint_name(name: str) -> str:
    """``name`` (a state-dict key) without the ``_orig_mod`` segments compiled submodules
    put in it (Note [a compiled model is its original module])."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


#: The file names ``transformers``' ``save_pretrained`` writes.
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

#: safetensors' dtype names, both ways.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


class TensorInfo:
    """One tensor of the checkpoint: its key, shard file, shape and dtype (from the header)."""

    __slots__ = ("dtype", "file", "key", "shape")

    def __init__(self, key: str, file: Path, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key = key
        self.file = file
        self.shape = shape
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor as stored."""
        return nbytes_of(self.shape, self.dtype)


def _read_header(file: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (its first ``8 + n`` bytes only)."""
    with open(file, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than its header size)")
        size = int.from_bytes(raw, "little")
        if size > os.path.getsize(file):
            raise ValueError(f"{file} is not a safetensors file (header size {size} > file)")
        header: dict[str, Any] = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return header


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint at ``path`` (a directory holding
    ``model.safetensors`` or ``model.safetensors.index.json``, or one ``.safetensors``
    file), by key.

    Fields:
        path: what was given; ``files``: the shard files, in the index's order.
        tensors: key -> ``TensorInfo``, from the headers.
        _open: ``(file, safe_open handle)`` of the shard read last, or None: a read of the
            next tensor in the same shard reuses it (one open shard at a time).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        self.path = Path(path)
        self.files = self._shard_files(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        for file in self.files:
            for key, entry in _read_header(file).items():
                dtype = DTYPES.get(entry.get("dtype", ""))
                if dtype is None:
                    raise ValueError(
                        f"{file}: tensor {key!r} has dtype {entry.get('dtype')!r}, which this "
                        f"reader does not know (known: {', '.join(DTYPES)})"
                    )
                self.tensors[key] = TensorInfo(key, file, tuple(entry["shape"]), dtype)
        self._open: tuple[Path, Any] | None = None

    @staticmethod
    def _shard_files(path: Path) -> list[Path]:
        if path.is_file():
            if path.name.endswith(".json"):
                return SafetensorsCheckpoint._indexed(path)
            return [path]
        if not path.is_dir():
            raise ValueError(
                f"path={str(path)!r} does not exist; pass the directory save_pretrained wrote "
                f"(holding {SINGLE_NAME} or {INDEX_NAME}) or a .safetensors file"
            )
        if (path / INDEX_NAME).is_file():
            return SafetensorsCheckpoint._indexed(path / INDEX_NAME)
        if (path / SINGLE_NAME).is_file():
            return [path / SINGLE_NAME]
        raise ValueError(
            f"path={str(path)!r} holds neither {SINGLE_NAME} nor {INDEX_NAME}; save the model "
            "with save_pretrained(..., safe_serialization=True) (the default), or pass the "
            ".safetensors file itself"
        )

    @staticmethod
    def _indexed(index: Path) -> list[Path]:
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object; is it a safetensors index?")
        files = list(dict.fromkeys(weight_map.values()))
        missing = [name for name in files if not (index.parent / name).is_file()]
        if missing:
            raise ValueError(f"{index} names shard(s) {missing} that are not in {index.parent}")
        return [index.parent / name for name in files]

    def read_into(self, key: str, out: torch.Tensor) -> int:
        """Read tensor ``key`` and copy it into ``out`` (any device, converting the dtype);
        returns the bytes the read held on the host (one tensor)."""
        from safetensors import safe_open  # only where a checkpoint is read

        info = self.tensors[key]
        if self._open is None or self._open[0] != info.file:
            self.close()
            # Hidden cost: parsing the shard's header and mapping the file, once per shard
            # switch (buckets run in backward order, so a few switches per construction).
            try:
                handle = safe_open(str(info.file), framework="pt", device="cpu")
            except Exception as exc:
                raise ValueError(f"cannot open checkpoint shard {info.file}: {exc}") from exc
            self._open = (info.file, handle)
        try:
            tensor = self._open[1].get_tensor(key)
        except Exception as exc:  # safetensors' own errors carry no file name
            raise ValueError(f"cannot read tensor {key!r} from {info.file}: {exc}") from exc
        with torch.no_grad():
            out.copy_(tensor.reshape(out.shape))
        return tensor.numel() * tensor.element_size()

    def close(self) -> None:
        """Drop the open shard handle (the next read opens its shard again)."""
        self._open = None
