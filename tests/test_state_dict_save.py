"""Saving the state dict under parameter offload: each entry's storage is exactly its
parameter's bytes of the pinned home (Note [a state dict entry owns a storage of its bytes]
in params/windowed_views.py), so ``torch.save`` and pickling write the weights and not the host pool
(master, moments, staging) the homes are ranges of. The entries stay the live weights
(writes through them reach the model, and only the written unit is fetched again), keep
their memory after ``opt.close()``, and are host memory under strict mode.

CUDA form (``cuda_form``, docs/gpu.md): the model, its batches and the accelerator are the
running test's (tests/helpers/device.py), so under ``--accelerator=cuda`` the window is on
``cuda:0`` and the entries are views of pinned homes beside it: a parameter read is a device
tensor, an entry a host one, and each comparison moves the device side to the entry's. Simulator
only: strict mode (the host accelerator's)."""

from __future__ import annotations

import gc
import io
import pickle

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator.strict import host_memory_name, strict_device_checks
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.params import UnitState

from .helpers.device import run_accelerator, run_device
from .test_param_offload_user_code import ids, step

pytestmark = pytest.mark.cuda_form

#: Per saved tensor, the most zip and pickle bytes beyond its storage (a zip record of the
#: storage, 64-byte aligned, and the pickled rebuild call with its key and shape).
OVERHEAD = 4096


def gpt(dtype: torch.dtype = torch.float32) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=64, seq_len=16, layers=4, hidden=32, heads=4))
    return model.to(run_device(), dtype)


def make_opt(
    model: torch.nn.Module, *, offload: bool = True, prefetch: int = 1, strict: bool = False
) -> OffloadAdamW:
    strict_mode = {"strict": True} if strict else {}  # the host's (simulator_only)
    accelerator = run_accelerator(device_budget="64MiB" if offload else "1GiB", **strict_mode)
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        config=OffloadConfig(
            offload_parameters=offload,
            prefetch_layers=prefetch,
            bucket_bytes=16384,
            tile_elements=1024,
        ),
        accelerator=accelerator,
        model=model if offload else None,
    )


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def loaded(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=True)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def assert_saves_the_weights(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]):
    """``torch.save(state)`` writes the weights (each entry once) plus the per-entry zip and
    pickle overhead, and loads back as ``want``."""
    data = saved(state)
    assert len(data) <= sum(nbytes(v) for v in state.values()) + OVERHEAD * len(state)
    back = loaded(data)
    assert back.keys() == want.keys()
    for name, value in want.items():
        assert back[name].dtype == value.dtype, name
        assert torch.equal(back[name], value.to(back[name].device)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_state_dict_is_the_weights_and_loads_back_equal(dtype):
    model = gpt(dtype)
    opt = make_opt(model)
    step(model, opt, 1)
    state = model.state_dict()
    for name, entry in state.items():
        assert entry.untyped_storage().nbytes() == nbytes(entry), name
    want = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert all(value.dtype == dtype for value in want.values())
    assert_saves_the_weights(state, want)
    opt.close()


def test_one_saved_entry_is_its_parameter_only():
    model = gpt()
    opt = make_opt(model)
    step(model, opt, 1)
    state = model.state_dict()
    entry = state["blocks.2.attn.qkv.weight"]
    assert len(saved(entry)) <= nbytes(entry) + OVERHEAD  # its bytes, not its bucket's
    assert len(pickle.dumps(entry)) <= nbytes(entry) + OVERHEAD  # plain pickling too
    weight = model.blocks[2].attn.qkv.weight.detach()
    assert torch.equal(loaded(saved(entry)), weight.to(entry.device))
    opt.close()


def test_tied_entries_are_saved_once_and_load_tied():
    model = gpt()
    model.head.weight = model.tokens.weight
    opt = make_opt(model)
    step(model, opt, 1)
    state = model.state_dict()
    tied = state["tokens.weight"]
    assert state["head.weight"].untyped_storage().data_ptr() == tied.untyped_storage().data_ptr()
    data = saved(state)
    distinct = {id(p): nbytes(p) for p in model.parameters()}  # the tied weight once
    assert len(data) <= sum(distinct.values()) + OVERHEAD * len(state)
    back = loaded(data)
    assert back["head.weight"].data_ptr() == back["tokens.weight"].data_ptr()
    assert torch.equal(back["tokens.weight"], model.tokens.weight.detach().to(tied.device))
    opt.close()


def test_a_saved_and_loaded_state_dict_resumes_as_with_resident_weights():
    out = []
    for offload in (False, True):
        model = gpt()
        opt = make_opt(model, offload=offload)
        step(model, opt, 1)
        data = saved(model.state_dict())
        step(model, opt, 2)
        model.load_state_dict(loaded(data))  # back to the weights after the first step
        out.append([step(model, opt, s) for s in (3, 4)])
        opt.close()
    assert out[0] == out[1]


def test_a_write_through_an_entry_fetches_only_its_unit_again():
    """Every unit stays in the window (prefetch covers the model): an eval forward fetches
    nothing until an entry is written, and then only the unit holding it. The entries used
    to share the host pool's version counter, so one write made every unit stale."""
    model = gpt()
    opt = make_opt(model, prefetch=16)
    offloader = opt.param_offloader
    step(model, opt, 1)
    x = ids(2)
    with torch.no_grad():
        model(x)
        assert all(unit.state is UnitState.ON_DEVICE for unit in offloader.units)
        model(x)
    before = [unit.fetches for unit in offloader.units]
    state = model.state_dict()
    with torch.no_grad():
        assert [unit.fetches for unit in offloader.units] == before  # no fetch, no staleness
        state["blocks.1.mlp.0.weight"].mul_(0.5)
        got = model(x)
    written = next(i for i, u in enumerate(offloader.units) if u.spec.name == "blocks.1")
    after = [unit.fetches for unit in offloader.units]
    assert after == [n + (i == written) for i, n in enumerate(before)]
    entry = state["blocks.1.mlp.0.weight"]
    assert torch.equal(model.blocks[1].mlp[0].weight.detach().to(entry.device), entry)
    opt.close()
    with torch.no_grad():
        assert torch.equal(model(x), got)  # the forward used the written weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entries_kept_after_close_hold_the_final_weights(dtype):
    model = gpt(dtype)
    opt = make_opt(model)
    step(model, opt, 1)
    state = model.state_dict()
    step(model, opt, 2)  # the entries follow training until close
    opt.close()
    want = {name: p.detach().clone() for name, p in model.named_parameters()}
    del opt
    gc.collect()
    other = gpt(dtype)  # new pools may take freed memory: the entries' must not be freed
    other_opt = make_opt(other)
    step(other, other_opt, 3)
    for name, value in want.items():
        assert torch.equal(state[name], value.to(state[name].device)), name
    assert_saves_the_weights(state, want)
    other_opt.close()


@pytest.mark.simulator_only(reason="strict mode")
def test_entries_are_host_memory_under_strict_mode():
    model = gpt()
    opt = make_opt(model, strict=True)
    step(model, opt, 1)
    state = model.state_dict()
    assert all(host_memory_name(entry) is not None for entry in state.values())
    entry = state["blocks.0.mlp.0.weight"]
    assert host_memory_name(entry[1:]) is not None  # a view is what its base is
    with strict_device_checks():
        with torch.no_grad():
            model(ids(2))  # the last units stay on the device
        on_device = model.head.weight.detach()
        assert host_memory_name(on_device) is None
        with pytest.raises(RuntimeError, match="same device"):
            state["head.weight"] + on_device  # as on CUDA: host memory meets device memory
    opt.close()
