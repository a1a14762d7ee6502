"""The shape of a decoder-only transformer: every parameter's shape, and the activations one
layer keeps for backward. Pure arithmetic; no torch.

Note [activation bytes per layer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
After Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), section 4.1, generalised to grouped-query attention and gated MLPs. In 16-bit
training, per layer, with ``T = S b`` tokens (sequence ``S``, micro-batch ``b``), hidden
``h``, query width ``q = a d`` (``a`` heads of ``d``), key/value width ``k`` (``kv_heads d``),
MLP width ``f``, ``e`` experts per token:

- attention: the norm's output ``2Th``, Q ``2Tq``, K and V ``4Tk``, the softmax output
  ``2aS^2b``, its dropout mask ``aS^2b``, the output projection's input ``2Tq``, the residual
  dropout mask ``Th``. With ``q = k = h``: ``11Th + 5aS^2b``, the paper's terms;
- MLP, plain (GeLU): input ``2Th``, the activation's input and output ``4Tf``, dropout mask
  ``Th``; with ``f = 4h``: the paper's ``19Th``. Gated (SwiGLU): the gate's and the up
  projection's outputs, the activation's output and the product, ``8Tf``, instead of ``4Tf``;
  each token runs through ``e`` experts, and a shared expert (``f_s``) adds ``8Tf_s``; a
  router adds its fp32 logits, ``4TE``;
- the two norms' inputs: ``4Th``.

So the default GPT shape keeps ``Th (34 + 5aS/h)`` bytes, the paper's figure. Memory-efficient
attention does not keep the ``5aS^2b`` attention matrices, so this is an upper bound there.
Other dtypes scale it by ``itemsize / 2`` (the paper's masks are bytes; we scale them too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import cast

__all__ = ["ARCHITECTURES", "Architecture", "ModelShape"]

Shape = tuple[int, ...]
Unit = tuple[list[Shape], bool]  # a unit's parameter shapes, and whether it is tied


@dataclass(frozen=True)
class Architecture:
    """Which parameters a block registers, beyond the widths a ``ModelShape`` gives."""

    name: str
    gated_mlp: bool  # SwiGLU: gate, up, down (three matrices); else fc, proj (two)
    norm_bias: bool  # LayerNorm (weight and bias); else RMSNorm (weight only)
    learned_positions: bool  # a (positions, hidden) table; else rotary (no parameters)
    fused_qkv: bool  # one (q + 2k, h) projection; else q, k, v apart
    qkv_bias: bool
    out_bias: bool  # the attention output projection's bias
    mlp_bias: bool


#: ``gpt``: the demo's ``TinyGPT`` and GPT-2. ``llama``: Llama, Mistral, Mixtral.
#: ``qwen2``: Llama with biased Q, K, V projections (Qwen2, Qwen2-MoE).
ARCHITECTURES = {
    "gpt": Architecture("gpt", False, True, True, True, True, True, True),
    "llama": Architecture("llama", True, False, False, False, False, False, False),
    "qwen2": Architecture("qwen2", True, False, False, False, True, False, False),
}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: embeddings, ``layers`` identical blocks, a final norm and
    the head (tied to the token embedding with ``tied``).

    Widths left ``None`` take their usual value and are stored resolved: ``kv_heads`` =
    ``heads`` (no grouped-query attention), ``ffn`` = ``4 * hidden`` (per expert with
    experts), ``head_dim`` = ``hidden // heads``, ``positions`` (rows of a learned position
    table, ``gpt`` only) = ``seq_len``. ``experts > 1``: each block's MLP is a mixture of
    ``experts`` gated experts of width ``ffn`` with a router, ``experts_per_token`` of them
    per token, plus a gated shared expert of width ``shared_ffn`` (and its gate) when > 0.
    ``seq_len`` and ``micro_batch`` size the activations.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    micro_batch: int = 1
    kv_heads: int | None = None
    ffn: int | None = None
    tied: bool = False
    arch: str = "gpt"
    head_dim: int | None = None
    positions: int | None = None
    experts: int = 1
    experts_per_token: int = 1
    shared_ffn: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"ModelShape.arch must be one of {', '.join(ARCHITECTURES)}, got {self.arch!r}"
            )
        if not isinstance(self.tied, bool):
            raise TypeError(f"ModelShape.tied must be a bool, got {self.tied!r}")
        for name in ("layers", "hidden", "heads", "vocab", "seq_len", "micro_batch"):
            _check_int(name, getattr(self, name), low=1)
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"ModelShape.heads={self.heads} must divide hidden={self.hidden}, or give head_dim"
            )
        learned = ARCHITECTURES[self.arch].learned_positions
        defaults = {
            "kv_heads": self.heads,
            "ffn": 4 * self.hidden,
            "head_dim": self.hidden // self.heads,
            "positions": self.seq_len if learned else 0,
        }
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        for name in ("kv_heads", "ffn", "head_dim", "experts", "experts_per_token"):
            _check_int(name, getattr(self, name), low=1)
        for name in ("positions", "shared_ffn"):
            _check_int(name, getattr(self, name), low=0)
        if self.heads % cast(int, self.kv_heads):
            raise ValueError(
                f"ModelShape.kv_heads={self.kv_heads} must divide heads={self.heads} "
                "(each key/value head serves a whole group of query heads)"
            )
        if self.positions and not learned:
            raise ValueError(
                f"ModelShape.positions={self.positions} needs arch='gpt' (a learned position "
                f"table); arch={self.arch!r} uses rotary embeddings"
            )
        if self.experts_per_token > self.experts:
            raise ValueError(
                f"ModelShape.experts_per_token={self.experts_per_token} must be <= "
                f"experts={self.experts}"
            )
        if (self.experts > 1 or self.shared_ffn) and not ARCHITECTURES[self.arch].gated_mlp:
            raise ValueError(
                f"ModelShape: experts need a gated-MLP arch ('llama' or 'qwen2'), got "
                f"arch={self.arch!r}"
            )

    @property
    def architecture(self) -> Architecture:
        """What the blocks register (``ARCHITECTURES[arch]``)."""
        return ARCHITECTURES[self.arch]

    @property
    def params(self) -> int:
        """Trainable parameters (a tied head counted once)."""
        before, after = self.outer_units()
        outer = [shape for shapes, _ in before + after for shape in shapes]
        return shapes_numel(outer) + self.layers * shapes_numel(self.block_shapes())

    def with_layers(self, layers: int) -> ModelShape:
        """The same widths with ``layers`` blocks: the family the largest-model search grows."""
        return _replace(self, layers=layers)

    def block_shapes(self) -> list[Shape]:
        """One block's parameters, in registration order."""
        arch, h = self.architecture, self.hidden
        q = self.heads * cast(int, self.head_dim)
        k = cast(int, self.kv_heads) * cast(int, self.head_dim)
        f = cast(int, self.ffn)  # resolved in __post_init__
        norm: list[Shape] = [(h,), (h,)] if arch.norm_bias else [(h,)]
        if arch.fused_qkv:
            attention: list[Shape] = [(q + 2 * k, h), *([(q + 2 * k,)] if arch.qkv_bias else [])]
        else:
            attention = []
            for width in (q, k, k):
                attention += [(width, h), *([(width,)] if arch.qkv_bias else [])]
        attention += [(h, q), *([(h,)] if arch.out_bias else [])]
        mlp: list[Shape]
        if self.experts > 1:  # transformers 5 registers each block's experts as two tensors
            e = self.experts
            mlp = [(e, h), (e, 2 * f, h), (e, h, f)]
            if self.shared_ffn:
                s = self.shared_ffn
                mlp += [(s, h), (s, h), (h, s), (1, h)]
        elif arch.gated_mlp:
            mlp = [(f, h), (f, h), (h, f)]
            if arch.mlp_bias:
                mlp = [(f, h), (f,), (f, h), (f,), (h, f), (h,)]
        else:
            mlp = [(f, h), *([(f,)] if arch.mlp_bias else []), (h, f)]
            mlp += [(h,)] if arch.mlp_bias else []
        if arch.fused_qkv:  # TinyGPT / GPT-2 order: ln_1, attention, ln_2, MLP
            return [*norm, *attention, *norm, *mlp]
        return [*attention, *mlp, *norm, *norm]  # Llama order: attention, MLP, the two norms

    def outer_units(self) -> tuple[list[Unit], list[Unit]]:
        """The units before the blocks (the token embedding, tied: also the head; the
        position table) and after them (the final norm, the head), as ``parameter_units``."""
        h = self.hidden
        before: list[Unit] = [([(self.vocab, h)], self.tied)]
        if self.positions:
            before.append(([(self.positions, h)], False))
        after: list[Unit] = [([(h,), (h,)] if self.architecture.norm_bias else [(h,)], False)]
        if not self.tied:
            after.append(([(self.vocab, h)], False))
        return before, after

    def parameter_units(self) -> list[Unit]:
        """``(shapes, tied)`` per unit in forward order, as ``zero_offload.params`` cuts a
        model: the units before the blocks, each block, the units after."""
        before, after = self.outer_units()
        return [*before, *[(self.block_shapes(), False)] * self.layers, *after]

    def parameter_shapes(self) -> list[Shape]:
        """Every trainable parameter's shape, in registration order (a tied head once)."""
        return [shape for shapes, _ in self.parameter_units() for shape in shapes]

    def layer_activation_bytes(self, itemsize: int) -> int:
        """Bytes one layer keeps for backward without checkpointing; see Note [activation
        bytes per layer]."""
        s, b, h, a = self.seq_len, self.micro_batch, self.hidden, self.heads
        tokens = s * b
        q = a * cast(int, self.head_dim)
        k = cast(int, self.kv_heads) * cast(int, self.head_dim)
        f = cast(int, self.ffn)  # resolved in __post_init__
        attention = tokens * (2 * h + 2 * q + 4 * k + 2 * q + h) + 3 * a * s * s * b
        attention += 2 * a * s * s * b  # softmax output (2 bytes) and dropout mask: 5aS^2b
        if self.architecture.gated_mlp:
            mlp = tokens * (2 * h + 8 * f * self.experts_per_token + 8 * self.shared_ffn + h)
            if self.experts > 1:
                mlp += tokens * 4 * self.experts  # the router's fp32 logits
        else:
            mlp = tokens * (2 * h + 4 * f + h)
        norms = tokens * 4 * h
        return math.ceil((attention + mlp + norms) * itemsize / 2)

    def checkpoint_bytes(self, itemsize: int) -> int:
        """Bytes of one layer's input, what checkpointing keeps per layer."""
        return self.seq_len * self.micro_batch * self.hidden * itemsize

    def logits_bytes(self, itemsize: int) -> int:
        """Logits in the training dtype plus their fp32 copy for the loss."""
        return self.seq_len * self.micro_batch * self.vocab * (itemsize + 4)

    def describe(self) -> str:
        """One line: the widths that decide the bytes."""
        text = f"{self.arch}: {self.layers} layers x {self.hidden} hidden, {self.heads} heads"
        if self.kv_heads != self.heads:
            text += f" ({self.kv_heads} KV)"
        text += f", MLP {self.ffn}"
        if self.experts > 1:
            text += f" x {self.experts} experts ({self.experts_per_token} per token)"
            if self.shared_ffn:
                text += f" + shared {self.shared_ffn}"
        text += f", vocab {self.vocab}" + (" tied" if self.tied else "")
        return text + f", micro-batch {self.micro_batch} x {self.seq_len} tokens"


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"ModelShape.{name} must be an int >= {low}, got {value!r}")


def _replace(shape: ModelShape, **changes: int) -> ModelShape:
    fields = asdict(shape)
    fields.update(changes)
    return ModelShape(**fields)


def shapes_numel(shapes: Sequence[Shape]) -> int:
    """Elements of all ``shapes``."""
    return sum(math.prod(shape) for shape in shapes)
