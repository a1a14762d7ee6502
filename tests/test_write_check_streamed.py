"""Note [one cold hash per step] (``views/fingerprints.py``): the fingerprints ``remember()``
takes from the tiles streamed as they are published equal a fresh hash of the weights,
whatever the tile and slot boundaries, in every update mode; streamed fingerprints are not
used where the copies did not come from fed tiles; and a write through ``param.data`` after
a streamed step is still seen (Note [weights written outside the optimizer])."""

from __future__ import annotations

import pytest
import torch

from zero_offload.views import fingerprints

from .helpers.models import batches, lm_loss, make_pair, max_diff, offload_opt, torch_adamw


def _count_streamed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the slots whose fingerprint ``remember()`` took from a stream: [used]."""
    used = [0]
    digest = fingerprints.StreamedHashes.digest

    def counting(self: fingerprints.StreamedHashes, i: int) -> int | None:
        out = digest(self, i)
        used[0] += out is not None
        return out

    monkeypatch.setattr(fingerprints.StreamedHashes, "digest", counting)
    return used


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["plain", "announced", "overlap_step"])
def test_streamed_fingerprints_equal_a_fresh_hash(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, mode: str
) -> None:
    used = _count_streamed(monkeypatch)
    model, _ = make_pair(dtype)
    # 1031-element tiles: not a multiple of any slot, so tiles start and end inside slots
    opt = offload_opt(model, tile_elements=1031, overlap_step=mode == "overlap_step")
    for tokens, targets in batches(3):
        opt.backward(lm_loss(model, tokens, targets), step=mode == "announced")
        opt.step()
        opt.zero_grad()
        for bucket in opt.buckets:
            views = bucket.views
            assert views._stamp is not None
            assert views._stamp[1] == views._fingerprint(views.bound_to())
    opt.close()
    if mode == "overlap_step":
        # a delayed update publishes from the home later, from tiles never fed
        assert used[0] == 0
    else:
        assert used[0] > 0  # the stream was used, so the equality above tested it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_write_through_data_after_a_streamed_step_is_seen(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    used = _count_streamed(monkeypatch)
    model, reference = make_pair(dtype)
    opt, ref = offload_opt(model, tile_elements=1031, weight_decay=0.0), torch_adamw(reference)
    for group in ref.param_groups:
        group["weight_decay"] = 0.0
    data = batches(3)
    for i, (tokens, targets) in enumerate(data):
        for m, o in ((model, opt), (reference, ref)):
            lm_loss(m, tokens, targets).backward()
            o.step()
            o.zero_grad()
        if i == 0:
            assert used[0] > 0
            with torch.no_grad():
                for m in (model, reference):
                    weight = next(m.parameters()).data.view(-1)
                    weight[[1, 5]] = weight[[5, 1]].clone()  # a swap: same bytes, moved
                    weight[7] = 0.25
            written = [p for b in opt.buckets for p in b.views.changed_params()]
            assert written == [next(model.parameters())]
    opt.close()
    # the written weights were stepped from, as torch steps from them
    assert max_diff(model, reference) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_a_partly_fed_slot_is_hashed_afresh() -> None:
    """A slot whose tiles were fed out of order, or not all, takes no streamed value."""
    flat = torch.randn(50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    model, _ = make_pair()
    opt = offload_opt(model)
    slots = opt.buckets[0].views.layout.slots
    opt.close()
    stream = fingerprints.StreamedHashes(slots)
    first = slots[0]
    values = flat[: min(first.numel, 50)]
    stream.feed(first.offset, first.offset + values.numel(), values)
    if values.numel() < first.numel:
        assert stream.digest(0) is None  # not every byte fed
    gap = first.offset + values.numel() + 1
    stream.feed(gap, gap + 1, flat[:1])
    assert stream.digest(0) is None  # out of order: broken for good
