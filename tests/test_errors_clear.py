"""Errors that say what happened and what to do (issue 29 "Nothing lost"): ``StepFailed``
names the recovery that fits where the state lives and, with several ranks, the rank that
died; a ``prefetch_layers`` larger than the model plans the model's window.

CUDA form (``cuda_form``): the tests that train build their model, data and accelerator
through tests/helpers, so under ``--accelerator=cuda`` they run on ``cuda:0``; the planner and
the error-message tests have no device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig, StepFailed
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.errors import CollectiveError, StreamError
from zero_offload.optim.ranks import SingleRank
from zero_offload.optim.update.modes import failed
from zero_offload.params.window import plan_slots

from .helpers.device import on_device, run_accelerator, run_device
from .helpers.models import batches, lm_loss, make_pair, offload_opt


def _break(store: object, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(store, "update", broken)


@pytest.mark.cuda_form
def test_step_failed_in_host_ram_says_zero_grad_then_load_state_dict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    _break(opt.buckets[1].store, monkeypatch)
    lm_loss(model, *batches(1)[0]).backward()
    with pytest.raises(StepFailed) as caught:
        opt.step()
    message = str(caught.value)
    assert "buckets [0] were stepped; bucket 1 was partly stepped" in message
    assert "call opt.zero_grad(), then reload it with opt.load_state_dict(state)" in message
    assert "load_streaming" not in message
    monkeypatch.undo()
    opt.close()


@pytest.mark.cuda_form
def test_step_failed_with_state_on_nvme_says_load_streaming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = make_pair()
    opt = offload_opt(model, nvme_dir=tmp_path, host_budget=1)
    nvme = [b for b in opt.buckets if b.store.on_storage_tier]
    assert nvme, "the test needs a bucket on NVMe"
    _break(nvme[0].store, monkeypatch)
    lm_loss(model, *batches(1)[0]).backward()
    with pytest.raises(StepFailed) as caught:
        opt.step()
    message = str(caught.value)
    assert f"bucket {nvme[0].layout.index} was partly stepped" in message
    assert "call opt.zero_grad(), then reload it with opt.load_streaming(path)" in message
    monkeypatch.undo()
    opt.close()


def test_step_failed_names_the_absent_rank_in_its_first_line() -> None:
    collective = CollectiveError(
        "rank 0/2: all-gather of bucket 1 weights did not complete within 5 s "
        "(OffloadConfig.collective_timeout). Rank(s) 1 did not report within 2 s: they "
        "died, or failed or hang before this collective; see their log."
    )
    wrapped = StreamError("work on stream 'comm' failed")
    wrapped.__cause__ = collective
    error = failed("rank 0/2: step() failed in bucket 1", [0], 1, ranks=SingleRank(), cause=wrapped)
    first = str(error).splitlines()[0]
    assert first.startswith("rank 0/2: step() failed in bucket 1 (rank(s) 1 died or hung")
    assert "opt.zero_grad()" in first


# -- prefetch_layers past the model ---------------------------------------------------


@pytest.mark.parametrize("prefetch", [10**12, np.int64(10**12), 3])
def test_a_ring_never_has_more_slots_than_untied_units(prefetch: object) -> None:
    # 5 units, the third tied: 4 ring slots (one per untied unit) and its own slot.
    slot_of, slot_bytes = plan_slots(
        [512, 1024, 256, 512, 512], [False, False, True, False, False], prefetch_layers=prefetch
    )
    assert slot_of == [0, 1, 4, 2, 3]
    assert slot_bytes == [512, 1024, 512, 512, 256]


def _gpt_steps(prefetch: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=64, seq_len=16, layers=3, hidden=32, heads=4))
    model = model.to(run_device())
    opt = OffloadAdamW(
        model.parameters(),
        config=OffloadConfig(offload_parameters=True, prefetch_layers=prefetch, bucket_bytes=16384),
        accelerator=run_accelerator(device_budget="64MiB"),
        model=model,
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = on_device(torch.randint(0, 64, (2, 16), generator=gen))
        model(ids, ids).backward()
        opt.step()
        opt.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return weights


@pytest.mark.cuda_form
def test_prefetch_layers_past_the_model_trains_as_prefetching_every_unit() -> None:
    huge = _gpt_steps(10**12)
    every = _gpt_steps(8)  # 3 blocks plus the embedding and head units: all of them
    assert all(torch.equal(a, b) for a, b in zip(huge, every, strict=True))


# -- parameters replaced in their module --------------------------------------------------


@pytest.mark.cuda_form
def test_load_state_dict_assign_true_is_refused_at_the_next_step_naming_the_parameter() -> None:
    model, _ = make_pair()
    opt = OffloadAdamW(
        model.named_parameters(),
        config=OffloadConfig(bucket_bytes=8192),
        accelerator=run_accelerator(),
    )
    data = batches(2)
    lm_loss(model, *data[0]).backward()
    opt.step()
    opt.zero_grad()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(saved, assign=True)  # new Parameter objects in the modules
    lm_loss(model, *data[1]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    replaced = r"parameter \d+ \('[\w.]+', shape .*\) was replaced in its module \(\w+\.\w+ is a"
    with pytest.raises(ValueError, match=replaced + r".*assign=True"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.close()


@pytest.mark.cuda_form
def test_a_plain_load_state_dict_keeps_training() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    lm_loss(model, *batches(1)[0]).backward()
    opt.step()  # nothing was replaced: no refusal
    opt.close()


def test_a_roll_call_ignores_an_earlier_roll_calls_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 answered a roll call at an earlier failure (its key stays in the store for the
    job's life); at a later one, where it does not answer, the error named no rank and said
    every rank was waiting (Note [naming the absent rank] in collectives.py)."""
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from zero_offload import collectives

    store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    comm = SimpleNamespace(world_size=2, rank=0, group=None)
    earlier = time.time() - 3600  # an hour ago
    store.set("zero_offload/roll_call/1", f"{earlier:.3f} all-gather of bucket 0")
    said = collectives.roll_call(comm, "reduce-scatter of bucket 2", grace=0.2)  # type: ignore[arg-type]
    assert said.startswith("Rank(s) 1 did not report within 0.2 s"), said
    store.set("zero_offload/roll_call/1", f"{time.time():.3f} reduce-scatter of bucket 3")
    said = collectives.roll_call(comm, "reduce-scatter of bucket 2", grace=0.2)  # type: ignore[arg-type]
    assert said.startswith("Every rank reported"), said
