"""A small GPT-style decoder: token and position embeddings, pre-norm blocks, an LM head."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BlockRunner", "GPTConfig", "TinyGPT"]

#: How the model runs each block: ``runner(block, x) -> y``; plain call by default, or a
#: checkpointing / activation-offloading wrapper.
BlockRunner = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of ``TinyGPT``.

    Attributes:
        vocab_size: tokens in the vocabulary. >= 2.
        seq_len: longest sequence (positions embedded). >= 1.
        layers: transformer blocks. >= 1.
        hidden: model width. A multiple of ``heads``.
        heads: attention heads. >= 1.
    """

    vocab_size: int
    seq_len: int = 64
    layers: int = 4
    hidden: int = 128
    heads: int = 4

    def __post_init__(self) -> None:
        for name, low in (("vocab_size", 2), ("seq_len", 1), ("layers", 1), ("hidden", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"GPTConfig.{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.heads, int) or self.heads < 1 or self.hidden % self.heads:
            raise ValueError(
                f"GPTConfig.heads must divide hidden={self.hidden}, got heads={self.heads!r}"
            )


class _Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.out = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).split(hidden, dim=-1)
        shape = (batch, seq, self.heads, hidden // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, hidden))


class Block(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden)
        self.attn = _Attention(config)
        self.norm2 = nn.LayerNorm(config.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden, 4 * config.hidden),
            nn.GELU(),
            nn.Linear(4 * config.hidden, config.hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _plain(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


class TinyGPT(nn.Module):
    """A decoder-only transformer; ``forward(ids, targets)`` returns the mean cross-entropy."""

    def __init__(self, config: GPTConfig, *, runner: BlockRunner | None = None) -> None:
        super().__init__()
        self.config = config
        self.runner: BlockRunner = runner if runner is not None else _plain
        self.tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.positions = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """Logits ``(batch, seq, vocab)``, or the loss when ``targets`` is given."""
        seq = ids.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds seq_len={self.config.seq_len}")
        positions = torch.arange(seq, device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = self.runner(block, x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def parameter_count(self) -> int:
        """Trainable elements."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
