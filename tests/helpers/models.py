"""Small models and training loops shared by the optimizer tests.

Models, data and accelerators are built for the running test's accelerator kind
(``tests/helpers/device.py``): the host accelerator and the CPU by default, ``cuda:0`` for a
test with a CUDA form under ``--accelerator=cuda``. Data is drawn on the CPU from a seeded
generator and then moved, so both kinds train on the same numbers.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch
from torch import nn

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator import Accelerator

from .device import run_accelerator, run_device


class TinyTransformer(nn.Module):
    """Embedding, a few pre-norm transformer blocks, and a tied-free output head."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim,
                nhead=4,
                dim_feedforward=2 * dim,
                dropout=dropout,
                batch_first=True,
                norm_first=True,
                # No attention biases: the key bias's gradient is exactly zero in exact
                # arithmetic, so its float noise (~1e-9) would be amplified by Adam into
                # lr-sized, rounding-dependent updates and no two implementations could agree.
                bias=False,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batches(n: int, *, vocab: int = 64, batch: int = 4, seq: int = 8, seed: int = 0):
    """``n`` deterministic (tokens, targets) pairs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
        targets = (tokens * 7 + 3) % vocab  # learnable: the loss can fall
        out.append((tokens.to(run_device()), targets.to(run_device())))
    return out


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_pair(
    dtype: torch.dtype = torch.float32, seed: int = 0, **model_kwargs: object
) -> tuple[nn.Module, nn.Module]:
    """Two identical models on the test's device: one for zero-offload, one for the torch
    reference. Built on the CPU from ``seed`` and then moved, so every kind starts from the
    same weights."""
    torch.manual_seed(seed)
    model = TinyTransformer(**model_kwargs).to(run_device(), dtype)  # type: ignore[arg-type]
    return model, copy.deepcopy(model)


#: The running test's accelerator (``device.run_accelerator``); the old name, which tests still
#: use, is kept: it is the host accelerator unless the test has a CUDA form under
#: ``--accelerator=cuda``.
host_accelerator = run_accelerator


def offload_opt(
    model: nn.Module,
    *,
    accelerator: Accelerator | None = None,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    **config: object,
) -> OffloadAdamW:
    """OffloadAdamW with small buckets and tiles, so every test crosses several of each."""
    config.setdefault("bucket_bytes", 8192)
    config.setdefault("tile_elements", 1024)
    return OffloadAdamW(
        model.parameters(),
        lr=lr,
        betas=(0.9, 0.95),
        weight_decay=weight_decay,
        config=OffloadConfig(**config),  # type: ignore[arg-type]
        accelerator=accelerator or run_accelerator(),
    )


def torch_adamw(model: nn.Module, lr: float = 1e-3) -> torch.optim.AdamW:
    """The reference: torch's AdamW with ``offload_opt``'s default hyper-parameters."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    backward: Callable[[torch.Tensor], None] | None = None,
    micro_steps: int = 1,
    clip: float | None = None,
) -> list[float]:
    """Plain training loop; returns the losses. ``clip``: torch's ``clip_grad_norm_`` to that
    norm before each step (a torch reference's clipping; ours is configured)."""
    losses = []
    for i in range(0, len(data), micro_steps):
        for tokens, targets in data[i : i + micro_steps]:
            loss = lm_loss(model, tokens, targets)
            (backward or (lambda value: value.backward()))(loss)
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (x.detach().float() - y.detach().float()).abs().max().item()
        for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


# A small MLP and its regression loop, for tests that want buckets of a layer or two.


def mlp(
    seed: int = 0, dims: tuple[int, ...] = (16, 32, 32, 8), dtype: torch.dtype = torch.float32
) -> nn.Sequential:
    """Linear layers of widths ``dims`` with Tanh between them, on the test's device."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(run_device(), dtype)


def mlp_batches(
    n: int, seed: int = 1, d_in: int = 16, d_out: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` deterministic (inputs, targets) pairs of 4 rows for ``mlp``, on the test's device."""
    g = torch.Generator().manual_seed(seed)
    pairs = [
        (torch.randn(4, d_in, generator=g), torch.randn(4, d_out, generator=g)) for _ in range(n)
    ]
    return [(x.to(run_device()), y.to(run_device())) for x, y in pairs]


def mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error, computed in fp32 whatever the model's dtype."""
    return ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean()


def mlp_opt(model: nn.Module, **config: object) -> OffloadAdamW:
    """``offload_opt`` at ``mlp_torch_adamw``'s lr, with buckets of 2 KiB: several per ``mlp``."""
    config.setdefault("bucket_bytes", 2048)
    return offload_opt(model, lr=1e-2, **config)


def mlp_torch_adamw(model: nn.Module) -> torch.optim.AdamW:
    """The reference for ``mlp_opt``: torch's AdamW with its hyper-parameters."""
    return torch_adamw(model, lr=1e-2)


def mlp_train_both(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ref: nn.Module,
    ropt: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """One step per batch on ours and on the torch reference."""
    for x, y in batches:
        for m, o in ((model, opt), (ref, ropt)):
            mlp_loss(m, x, y).backward()
            o.step()
            o.zero_grad()
