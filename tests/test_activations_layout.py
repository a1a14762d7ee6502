"""Offloaded activations come back laid out as saved (Note [saved layout comes back] in
``activations/offloader.py``): same shape, strides and pointer alignment, so backward
takes the same kernels and training with activation offload is bitwise training without.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import make_accelerator
from zero_offload.activations import (
    ActivationOffloadConfig,
    ActivationOffloader,
    offload_activations,
)
from zero_offload.activations.offloader import LAYOUT_ALIGN


def _offloader(**config: object) -> ActivationOffloader:
    config.setdefault("min_bytes", 0)
    config.setdefault("host_pool_bytes", 16 << 20)
    config.setdefault("device_pool_bytes", 8 << 20)
    acc = make_accelerator("host", device_budget="1GiB")
    return ActivationOffloader(accelerator=acc, config=ActivationOffloadConfig(**config))  # type: ignore[arg-type]


def _base() -> torch.Tensor:
    return torch.arange(4 * 6 * 8 * 5, dtype=torch.float32).reshape(4, 6, 8, 5)


VIEWS = {
    "contiguous": lambda: _base(),
    "transposed": lambda: _base().transpose(1, 2),  # a dense permutation, as SDPA saves
    "permuted": lambda: _base().permute(3, 0, 2, 1),
    "slice-with-gaps": lambda: _base()[:, 2:5, :, 1:4],  # storage offset, gaps between rows
    "offset-contiguous": lambda: _base().reshape(-1)[3:203],  # misaligned data pointer
    "expanded": lambda: torch.randn(1, 8, 1).expand(4, 8, 6),  # stride 0
    "strided-step": lambda: _base()[::2, :, ::3],
    "bf16-transposed": lambda: _base().bfloat16().transpose(0, 3)[1:],
}


@pytest.mark.parametrize("make", VIEWS.values(), ids=VIEWS.keys())
def test_a_saved_view_comes_back_with_its_strides_and_alignment(make) -> None:
    offloader = _offloader()
    saved = make()
    handle = offloader.pack(saved, group=offloader.new_group())
    back = offloader.unpack(handle)
    assert back.shape == saved.shape
    assert back.stride() == saved.stride()
    assert back.is_contiguous() == saved.is_contiguous()
    assert back.data_ptr() % LAYOUT_ALIGN == saved.data_ptr() % LAYOUT_ALIGN
    assert back.untyped_storage().data_ptr() != saved.untyped_storage().data_ptr()  # a copy
    assert torch.equal(back, saved)
    del handle, back
    offloader.close()


class Attention(nn.Module):
    """Fused qkv projection, split and transposed per head (strided views with gaps), SDPA
    (saves the transposed q/k/v, its output and logsumexp), and a batched matmul against a
    transposed activation (saves the transposed view)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(40, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mix = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.head = nn.Linear(dim, 40)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        y = torch.bmm(x.transpose(1, 2), x) / s  # (b, d, d): saves x and its transpose
        x = x + torch.tanh(x @ (y @ self.mix))
        return self.head(x)


def _train(model: nn.Module, offloader: ActivationOffloader | None, steps: int = 4):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 40, (3, 24), generator=gen)
        if offloader is None:
            logits = model(tokens)
        else:
            with offload_activations(offloader=offloader, min_bytes=0):
                logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 40), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("prefetch_depth", [0, 2])
def test_attention_training_with_activation_offload_is_bitwise_without(
    prefetch_depth: int,
) -> None:
    torch.manual_seed(0)
    plain = Attention()
    offloaded = copy.deepcopy(plain)
    offloader = _offloader(prefetch_depth=prefetch_depth)
    # On this CPU build the kernels below happen to round alike for any layout, so the
    # layouts are checked directly too: each tensor backward gets is laid out as saved.
    packed: dict[int, tuple] = {}
    unpacked: list[tuple] = []
    pack, unpack = offloader.pack, offloader.unpack

    def spy_pack(tensor: torch.Tensor, *, group: int):  # type: ignore[no-untyped-def]
        handle = pack(tensor, group=group)
        packed[id(handle)] = (tensor.shape, tensor.stride(), tensor.data_ptr() % LAYOUT_ALIGN)
        return handle

    def spy_unpack(handle):  # type: ignore[no-untyped-def]
        back = unpack(handle)
        layout = (back.shape, back.stride(), back.data_ptr() % LAYOUT_ALIGN)
        unpacked.append((packed[id(handle)], layout))
        return back

    offloader.pack, offloader.unpack = spy_pack, spy_unpack  # type: ignore[method-assign]
    expected = _train(plain, None)
    actual = _train(offloaded, offloader)
    transposed = [saved for saved, _ in unpacked if len(saved[1]) > 1 and saved[1][-1] != 1]
    assert transposed, "no transposed view was offloaded"
    for saved, back in unpacked:
        assert back == saved
    stats = offloader.stats()
    assert stats["offloaded_tensors"] > 0 and stats["reloads"] == stats["offloaded_tensors"]
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(a, e), f"loss of step {step} differs: {a.item()!r} vs {e.item()!r}"
    for (name, p), q in zip(offloaded.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs by {(p - q).abs().max().item()}"
    offloader.close()
