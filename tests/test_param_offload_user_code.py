"""Parameter offload as user code meets it: saving parameters and whole models with torch,
copies of the model (``copy.deepcopy``, ``AveragedModel``), and loading optimizer state while
a unit is on the device. Each test compares with the same loop with the weights resident.

CUDA form (``cuda_form``, docs/gpu.md): the model, its batches and the accelerator are the
running test's (tests/helpers/device.py), so under ``--accelerator=cuda`` the window, the
fetches and the copies of the model are on ``cuda:0`` (a released parameter pickles and
deep-copies as a device copy; the state dict entries are views of the pinned homes, host
memory on either kind). Host only: the Trainer resume (tests/helpers/hf.py builds on the
host)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.params import UnitState

from .helpers.device import on_device, run_accelerator, run_device

VOCAB, SEQ = 64, 16


def gpt() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=4, hidden=32, heads=4))
    return model.to(run_device())


def make_opt(model: torch.nn.Module, *, offload: bool) -> OffloadAdamW:
    accelerator = run_accelerator(device_budget="64MiB" if offload else "1GiB")
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        config=OffloadConfig(
            offload_parameters=offload, prefetch_layers=1, bucket_bytes=16384, tile_elements=1024
        ),
        accelerator=accelerator,
        model=model if offload else None,
    )


def ids(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))


def step(model: torch.nn.Module, opt: OffloadAdamW, seed: int) -> float:
    x = ids(seed)
    loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def saved_and_loaded(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.cuda_form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_load_state_dict_while_a_unit_is_on_the_device(dtype):
    """Trainer's resume loads the model (fetching units) then the optimizer: the load used to
    raise 'weights read off-home (bug)' on the resident unit."""
    out = []
    for offload in (False, True):
        model = gpt().to(dtype)
        opt = make_opt(model, offload=offload)
        step(model, opt, 1)
        weights = {name: entry.clone() for name, entry in model.state_dict().items()}
        saved = opt.state_dict()
        step(model, opt, 2)
        with torch.no_grad():
            model(ids(3))  # the last units stay on the device
        model.load_state_dict(weights)  # as Trainer resumes: the model, then the optimizer
        model.blocks[0].mlp[0].weight.sum()  # one brought back for user code
        if offload:
            assert any(u.state is UnitState.ON_DEVICE for u in opt.param_offloader.units)
        opt.load_state_dict(saved)
        out.append([step(model, opt, s) for s in (4, 5)])
        opt.close()
    assert out[0] == out[1]


@pytest.mark.cuda_form
def test_torch_save_of_parameters_saves_their_values():
    """torch.save writes a tensor's storage after pickling everything; a released parameter
    brought back into a slot another unit then took was saved with that unit's bytes."""
    model = gpt()
    opt = make_opt(model, offload=True)
    step(model, opt, 1)
    params = list(model.parameters())
    fetches = opt.param_offloader.fetches
    loaded = saved_and_loaded(params)
    assert opt.param_offloader.fetches == fetches  # read from the homes
    want = [p.detach().clone() for p in params]
    opt.close()
    for i, (got, value) in enumerate(zip(loaded, want, strict=True)):
        assert type(got) is torch.nn.Parameter, i
        assert torch.equal(got.detach(), value), i
        assert got.untyped_storage().nbytes() == value.numel() * value.element_size(), i


@pytest.mark.cuda_form
def test_a_copy_of_the_model_is_not_under_the_optimizer():
    """copy.deepcopy (AveragedModel, an EMA teacher) copied the offloader's hooks: each
    forward of the copy pulled the trained model's units through the link; torch.save(model)
    failed on the hooks' weak references."""
    model = gpt()
    opt = make_opt(model, offload=True)
    offloader = opt.param_offloader
    step(model, opt, 1)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    pickled = saved_and_loaded(model)
    fetches = offloader.fetches
    with torch.no_grad():
        want = model(ids(2))
        fetches = offloader.fetches - fetches
        before = offloader.fetches
        assert torch.equal(ema(ids(2)), want)
        assert torch.equal(pickled(ids(2)), want)
    assert offloader.fetches == before  # the copies computed on their own weights
    assert fetches > 0
    x = ids(3)
    ema.module(x, x).backward()  # training the copy leaves the window alone
    assert offloader.fetches == before
    step(model, opt, 4)
    ema.update_parameters(model)
    opt.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_save_of_the_state_dict_writes_the_weights_only(dtype):
    model = gpt().to(dtype)
    opt = make_opt(model, offload=True)
    step(model, opt, 1)
    state = model.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    weights = sum(v.numel() * v.element_size() for v in state.values())
    opt.close()
    # The weights, plus 4 KiB of zip and pickle overhead per entry at most.
    assert len(buffer.getvalue()) <= weights + 4096 * len(state)


@pytest.mark.cuda_form
def test_deepcopy_values_are_the_live_weights():
    model = gpt()
    opt = make_opt(model, offload=True)
    step(model, opt, 1)
    twin = copy.deepcopy(model)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert type(q) is torch.nn.Parameter, name
        assert torch.equal(p.detach(), q.detach()), name
    opt.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("first", ["backward", "autograd_grad"])
def test_a_graph_run_twice_fetches_its_units_each_time(first):
    """A second backward through a graph kept with retain_graph=True ran with every unit
    released (each unit's trigger fired once per forward): a segfault reading address 0."""
    out = []
    for offload in (False, True):
        model = gpt()
        opt = make_opt(model, offload=offload)
        step(model, opt, 1)
        x = ids(2)
        loss = model(x, x)
        if first == "backward":
            loss.backward(retain_graph=True)
        else:
            norm = torch.autograd.grad(loss, model.blocks[1].mlp[0].weight, retain_graph=True)
            out.append(norm[0].norm().item())
        (loss * 0.5).backward()
        opt.step()
        opt.zero_grad()
        out.append([step(model, opt, s) for s in (3, 4)])
        opt.close()
    half = len(out) // 2
    assert out[:half] == out[half:]


def test_trainer_resumes_a_parameter_offload_run(tmp_path):
    """OffloadTrainer's resume loads the model's weights (bringing units back), then the
    optimizer: that load raised 'weights read off-home (bug)'."""
    pytest.importorskip("transformers")
    from .helpers.hf import offload_config, offload_trainer, tiny_gpt2, training_args, weights

    config = offload_config(offload_parameters=True)
    args = training_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    whole = offload_trainer(tiny_gpt2(), args, offload_config=config)
    whole.train()
    args = training_args(tmp_path, max_steps=4)
    resumed = offload_trainer(tiny_gpt2(seed=1), args, offload_config=config)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    want, got = weights(whole.model), weights(resumed.model)
    assert all(torch.equal(got[name], want[name]) for name in want)
