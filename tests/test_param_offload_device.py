"""Parameter offload: released parameters keep their device (Note [a released parameter] in
params/released.py), and nothing user code writes is lost (issue 29 items 2-5).

Each test compares with the same model and loop with its weights resident: the device
identity of released parameters, HF GPT-2's ``model.device``/``generate()`` and an eval loop
between steps, state dict entries that follow training, ``load_state_dict`` and in-place
writes reaching the homes (released or resident units), ``.data`` replacement refused,
and a weight tied across two blocks refused.

CUDA form (``cuda_form``, docs/gpu.md): the model, its batches and the accelerator are the
running test's (tests/helpers/device.py), so under ``--accelerator=cuda`` released parameters
are zero-byte ``cuda:0`` tensors and the window is on the GPU. State dict entries are views of
the pinned homes (host memory) with parameter offload and device tensors without it, so the
two runs' entries are compared on one device. Simulator only: the two tests that check every
op under strict mode (the host accelerator's)."""

from __future__ import annotations

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator.strict import host_memory_name, strict_device_checks
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.memory.traffic import Category, Direction
from zero_offload.params import UnitState

from .helpers.device import on_device, run_accelerator, run_device

pytestmark = pytest.mark.cuda_form
STRICT = pytest.mark.simulator_only(reason="strict mode")
VOCAB, SEQ = 64, 16


def gpt(layers: int = 4) -> TinyGPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=layers, hidden=32, heads=4)
    return TinyGPT(config).to(run_device())


def make_opt(model, *, offload: bool, strict: bool = False, layers=None) -> OffloadAdamW:
    strict_mode = {"strict": True} if strict else {}  # the host's (simulator_only)
    accelerator = run_accelerator(device_budget="64MiB" if offload else "1GiB", **strict_mode)
    extra = {"model": model, "layers": layers} if offload else {}
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        weight_decay=0.1,
        config=OffloadConfig(
            offload_parameters=offload, prefetch_layers=1, bucket_bytes=16384, tile_elements=1024
        ),
        accelerator=accelerator,
        **extra,
    )


def batches(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))


def step(model, opt, ids, loss_of=None) -> float:
    loss = model(ids, ids) if loss_of is None else loss_of(model, ids)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's values, read as user code reads them (released ones are fetched)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:  # an entry of a home is host memory, of a resident weight device memory:
        # both are read through a copy to the CPU, as a GPU run must (strict mode refuses
        # an op that mixes the two, Note [strict: host memory is not device memory])
        got, want = (t.to(device="cpu", copy=True) for t in (a[name], b[name]))
        assert torch.equal(got, want), name


def both(run, make=gpt, **kw):
    """``run(model, opt)`` with the weights resident, then offloaded; each run's result and
    final values (taken after close, so both are plain tensors)."""
    out = []
    for offload in (False, True):
        model = make()
        opt = make_opt(model, offload=offload, **kw)
        result = run(model, opt)
        opt.close()
        out.append((result, values(model)))
    return out


def _raw(param: torch.Tensor) -> torch.Tensor:
    """``param`` as the offloader left it (no fetch)."""
    with torch._C.DisableTorchFunctionSubclass():
        return param.data


# -- device identity -------------------------------------------------------------------------


@STRICT
def test_released_parameters_are_zero_byte_device_tensors_of_the_right_shape():
    model = gpt()
    shapes = {n: (p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters()}
    opt = make_opt(model, offload=True, strict=True)
    it = batches()
    with strict_device_checks():
        for _ in range(2):
            step(model, opt, next(it))
    offloader = opt.param_offloader
    try:
        assert all(unit.state is UnitState.ON_HOST for unit in offloader.units)
        device = opt.accelerator.device
        for name, param in model.named_parameters():
            assert _raw(param).untyped_storage().nbytes() == 0, name
            assert param.device == device
            assert (param.shape, param.dtype, param.requires_grad) == shapes[name]
            assert isinstance(param, torch.nn.Parameter)
        assert next(model.parameters()).device == device
        # Reading one fetches its unit: the values are the live weights, not address 0.
        weight = model.blocks[2].mlp[0].weight
        unit = offloader.units[offloader._index_of_param[id(weight)]]
        views, index = next(
            (v, i) for v in unit.views for i, p in enumerate(v.params) if p is weight
        )
        got = weight.detach().clone()
        assert unit.state is UnitState.ON_DEVICE
        assert torch.equal(got.to("cpu", copy=True), views.home_view(index)) and got.abs().sum() > 0
        assert host_memory_name(weight) is None  # the slot: device memory
        assert "tensor(" in repr(model.blocks[3].norm1.weight)  # printing fetches too
    finally:
        opt.close()


@STRICT
def test_hf_gpt2_model_device_generate_and_an_eval_loop_between_steps():
    pytest.importorskip("transformers")
    from .helpers.hf import tiny_gpt2

    def run(model, opt):
        it = batches()
        out = []
        strict = opt.accelerator.config.strict
        with strict_device_checks():
            for _ in range(3):
                ids = next(it)
                model.train()
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                assert model.device == opt.accelerator.device
                if strict and opt.param_offloader is not None:  # every unit released
                    for name, param in model.named_parameters():
                        assert _raw(param).untyped_storage().nbytes() == 0, name
                model.eval()
                with torch.no_grad():  # an eval loop between steps
                    for _ in range(2):
                        out.append(model(input_ids=next(it)).logits)
                prompt = next(it)[:1, :4]
                generated = model.generate(
                    prompt, max_new_tokens=6, do_sample=False, pad_token_id=0
                )
                out.append(generated)
        return out

    (want, want_values), (got, got_values) = both(run, make=tiny_gpt2, strict=True)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert_same(got_values, want_values)


# -- state dicts -----------------------------------------------------------------------------


def test_state_dict_entries_follow_training_and_are_never_window_slots():
    def run(model, opt):
        it = batches()
        step(model, opt, next(it))
        with torch.no_grad():  # leaves the last units on the device
            model(next(it))
        kept = model.state_dict()  # kept without copying, as torch allows
        for _ in range(2):
            step(model, opt, next(it))
        if opt.param_offloader is not None:
            offloader = opt.param_offloader
            window = [s.block.view(torch.uint8) for s in offloader.window.slots]
            spans = [(w.data_ptr(), w.data_ptr() + w.numel()) for w in window]
            for name, entry in kept.items():
                assert not any(lo <= entry.data_ptr() < hi for lo, hi in spans), name
        return {name: entry.clone() for name, entry in kept.items()}

    (want_kept, _), (got_kept, got) = both(run)
    assert_same(got_kept, want_kept)
    assert_same(got_kept, got)  # the entries are the live weights


def tied_gpt() -> TinyGPT:
    model = gpt()
    model.head.weight = model.tokens.weight  # one unit with a slot of its own
    return model


def test_a_write_through_a_state_dict_entry_reaches_the_model():
    def run(model, opt):
        it = batches()
        step(model, opt, next(it))
        with torch.no_grad():
            model(next(it))  # the tied unit (head) stays on the device, in its own slot
        if opt.param_offloader is not None:
            tied = next(u for u in opt.param_offloader.units if u.spec.tied)
            assert tied.state is UnitState.ON_DEVICE
        kept = model.state_dict()
        with torch.no_grad():  # entries alias the weights, as in torch
            kept["tokens.weight"].mul_(0.5)  # a unit on the device
            kept["blocks.0.mlp.0.weight"].mul_(0.5)  # a released unit
        with torch.no_grad():
            evaluated = model(next(it))  # before any step: sees both writes
        return [evaluated, *(step(model, opt, next(it)) for _ in range(2))]

    (want_out, want), (out, got) = both(run, make=tied_gpt)
    assert torch.equal(out[0], want_out[0])
    assert out[1:] == want_out[1:]
    assert_same(got, want)


def test_load_state_dict_reaches_the_homes_released_or_resident():
    source = {name: p.detach() * 0.5 for name, p in gpt().named_parameters()}

    def run(model, opt):
        it = batches()
        step(model, opt, next(it))
        model.load_state_dict(source)  # every unit released
        step(model, opt, next(it))
        with torch.no_grad():
            model(next(it))  # the last units stay on the device
        model.load_state_dict(source)
        return [step(model, opt, next(it)) for _ in range(2)]

    (want_losses, want), (losses, got) = both(run)
    assert losses == want_losses
    assert_same(got, want)


# -- writes while a unit is on the device (issue 29 item 2) ------------------------------------


@pytest.mark.parametrize("how", ["in_place", "through_data"])
def test_writes_to_a_resident_unit_reach_its_home(how):
    def write(model, how):
        last = model.blocks[-1].mlp[0].weight  # on the device after a forward
        with torch.no_grad():
            if how == "in_place":
                last.mul_(0.5)
            else:
                last.data.copy_(torch.full_like(last.data, 0.25))

    def run(model, opt):
        it = batches()
        step(model, opt, next(it))
        with torch.no_grad():
            model(next(it))
        if opt.param_offloader is not None:
            unit = opt.param_offloader.units[-2]  # the last block's unit
            assert unit.state is UnitState.ON_DEVICE
        write(model, how)  # after an eval forward
        step(model, opt, next(it))
        ids = next(it)
        loss = model(ids, ids)
        write(model, "through_data")  # between forward and backward (torch allows .data only)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if opt.param_offloader is not None:
            assert opt.manager.counters.bytes(Direction.D2H, Category.WEIGHTS) > 0
        return [step(model, opt, next(it)) for _ in range(2)]

    (want_losses, want), (losses, got) = both(run)
    assert losses == want_losses
    assert_same(got, want)


def test_in_place_writes_to_released_parameters_between_steps_count():
    def run(model, opt):
        it = batches()
        step(model, opt, next(it))
        with torch.no_grad():
            for block in model.blocks:  # every unit released
                block.norm2.weight.add_(1.0)
                block.mlp[0].bias.data.zero_()
        return [step(model, opt, next(it)) for _ in range(2)]

    (want_losses, want), (losses, got) = both(run)
    assert losses == want_losses
    assert_same(got, want)


# -- .data replaced (issue 29 item 3) ----------------------------------------------------------


@pytest.mark.parametrize(
    "replace",
    [
        lambda model: model.half(),
        lambda model: model.to(torch.float64),
        lambda model: model.blocks[1].to_empty(device=run_device()),
    ],
    ids=["half", "double", "to_empty"],
)
@pytest.mark.parametrize("next_call", ["step", "forward"])
def test_data_replacement_is_refused_naming_the_parameter(replace, next_call):
    model = gpt()
    opt = make_opt(model, offload=True)
    it = batches()
    step(model, opt, next(it))
    replace(model)
    ids = next(it)
    try:
        with pytest.raises(ValueError, match=r"blocks\.1\.|\.data was replaced") as error:
            if next_call == "step":
                opt.step()
            else:
                model(ids, ids)
        assert "Rebuild the optimizer" in str(error.value)
    finally:
        opt.close()


def test_load_state_dict_assign_is_refused_at_the_next_step():
    model = gpt()
    opt = make_opt(model, offload=True)
    step(model, opt, next(batches()))
    fresh = {name: p.detach().clone() for name, p in gpt().named_parameters()}
    model.load_state_dict(fresh, assign=True)
    try:
        with pytest.raises(ValueError, match="replaced in its module"):
            opt.step()
    finally:
        opt.close()


# -- a weight tied across two blocks (issue 29 item 5) -----------------------------------------


def test_a_weight_tied_across_two_blocks_is_refused_naming_both():
    model = gpt()
    model.blocks[3].mlp[0].weight = model.blocks[1].mlp[0].weight
    with pytest.raises(
        ValueError, match=r"'blocks\.1\.mlp\.0\.weight'.*'blocks\.1' and 'blocks\.3'"
    ):
        make_opt(model, offload=True)
    model.blocks[3].mlp[0].weight = torch.nn.Parameter(model.blocks[1].mlp[0].weight.clone())
    opt = make_opt(model, offload=True)  # untied: accepted
    opt.close()


def test_close_gives_back_plain_parameters_that_work():
    """The class switch of released parameters is undone at close, with their weights."""
    model = gpt()
    opt = make_opt(model, offload=True)
    step(model, opt, next(batches()))
    assert any(type(p) is not torch.nn.Parameter for p in model.parameters())
    opt.close()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    ids = next(batches())
    assert torch.isfinite(model(ids, ids))
