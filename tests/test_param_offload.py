"""Parameter offload (OffloadConfig(offload_parameters=True)): a window of units' weights on
the device. Parity against the same model trained with its weights resident, the device
peak against its formula, prefetch hiding the copies on a slow link, activation
checkpointing, tied weights, a Hugging Face GPT-2, and the errors.

CUDA form (``cuda_form``, docs/gpu.md): the model, its batches and the accelerator come from
tests/helpers/device.py, so under ``--accelerator=cuda`` the window, the homes' copies and the
bitwise comparisons run on ``cuda:0`` (both sides run the same kernels there); the device
peaks are the accelerator's ledger of library bytes, the same pools on either kind. Simulator
only: the tests that time copies over a simulated link."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.activations import checkpoint as offload_checkpoint
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.errors import DeviceBudgetExceeded
from zero_offload.estimate import ModelShape, estimate, param_offload_bytes
from zero_offload.memory.traffic import Category, Direction
from zero_offload.optim.state.placement import GRAD_BUFFERS, POOL_ALIGNMENT
from zero_offload.params import UnitState

from .helpers.device import on_device, run_accelerator, run_device

pytestmark = pytest.mark.cuda_form
SLOW_LINK = pytest.mark.simulator_only(reason="copies timed over a simulated link")

VOCAB, SEQ = 64, 16


def gpt(dtype: torch.dtype, *, layers: int = 12, hidden: int = 64, tied: bool = False, runner=None):
    torch.manual_seed(0)
    model = TinyGPT(
        GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=layers, hidden=hidden, heads=4),
        runner=runner,
    ).to(run_device(), dtype)
    if tied:
        model.head.weight = model.tokens.weight
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def make_opt(model, budget, *, offload: bool, prefetch: int = 1, link=None, **config):
    link_config = {} if link is None else {"link_bandwidth": link}  # the host's only
    accelerator = run_accelerator(device_budget=budget, **link_config)
    config.setdefault("bucket_bytes", 16384)
    config.setdefault("tile_elements", 1024)
    extra = {"model": model} if offload else {}
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=OffloadConfig(offload_parameters=offload, prefetch_layers=prefetch, **config),
        accelerator=accelerator,
        **extra,
    )


def train(model, opt, steps: int, *, batch: int = 2, seq: int = SEQ, loss_of=None) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = on_device(torch.randint(0, VOCAB, (batch, seq), generator=gen))
        loss = model(ids, ids) if loss_of is None else loss_of(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x.detach(), y.detach()), name


def reference(
    make: Callable[[], torch.nn.Module], steps: int, **kw
) -> tuple[list[float], torch.nn.Module]:
    """The same model trained with its weights resident, under a large budget."""
    model = make()
    opt = make_opt(model, "1GiB", offload=False)
    losses = train(model, opt, steps, **kw)
    opt.close()
    return losses, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_three_times_the_budget_train_bitwise_like_resident(dtype):
    make = functools.partial(gpt, dtype)
    budget = weight_bytes(make()) // 3
    with pytest.raises(DeviceBudgetExceeded):  # without parameter offload it cannot fit
        make_opt(make(), budget, offload=False)
    want_losses, want = reference(make, 20)
    model = make()
    opt = make_opt(model, budget, offload=True)
    losses = train(model, opt, 20)
    stats = opt.accelerator.memory_stats()
    offloader = opt.param_offloader
    assert all(unit.state is UnitState.ON_HOST for unit in offloader.units)
    opt.close()
    assert losses == want_losses
    assert_same(model, want)
    assert stats["peak"] <= budget < weight_bytes(model)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // POOL_ALIGNMENT) * POOL_ALIGNMENT


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_device_peak_matches_the_formula(prefetch, tied):
    model = gpt(torch.bfloat16, layers=8, tied=tied)
    # One bucket per unit (bucket_bytes above the largest unit), so a unit's bytes are its
    # bucket's aligned bytes.
    opt = make_opt(model, "64MiB", offload=True, prefetch=prefetch, bucket_bytes=2**20)
    train(model, opt, 2)
    offloader = opt.param_offloader
    bucket_bytes = {id(b.params[0]): _aligned(b.layout.padded_numel * 2) for b in opt.buckets}
    unit_bytes = [
        sum(bucket_bytes.get(id(p), 0) for p in unit.spec.params) for unit in offloader.units
    ]
    ring = prefetch + 2
    ring_slots = [0] * ring
    position = 0
    tied_bytes = 0
    for unit, nbytes in zip(offloader.units, unit_bytes, strict=True):
        if unit.spec.tied:  # tokens + head: a slot of its own
            tied_bytes += nbytes
            continue
        ring_slots[position % ring] = max(ring_slots[position % ring], nbytes)
        position += 1
    expected = (
        # the optimizer's device pool: no weights (they are in the window), GRAD_BUFFERS
        # gradient buffers of the largest bucket
        GRAD_BUFFERS * max(bucket_bytes.values())
        # the window: prefetch + 2 ring slots, each of the largest unit placed in it
        + sum(ring_slots)
        # plus a slot per tied unit (used at both ends of the forward)
        + tied_bytes
    )
    assert len([u for u in offloader.units if u.spec.tied]) == int(tied)
    stats = opt.accelerator.memory_stats()
    opt.close()
    assert stats["peak"] == expected
    # (prefetch_layers + 2) slots of the largest unit bound the window
    assert sum(ring_slots) <= (prefetch + 2) * max(unit_bytes)


def _exposed_and_copy_seconds(prefetch: int, link: float) -> tuple[float, float]:
    model = gpt(torch.float32, layers=8, hidden=96)
    opt = make_opt(model, "256MiB", offload=True, prefetch=prefetch, link=link)
    train(model, opt, 1, batch=64)  # warm-up: the forward order is learned
    manager = opt.manager
    exposed0 = manager.exposed_seconds.get(Category.WEIGHTS, 0.0)
    bytes0 = manager.counters.bytes(Direction.H2D, Category.WEIGHTS)
    train(model, opt, 3, batch=64)
    manager.synchronize()
    exposed = manager.exposed_seconds.get(Category.WEIGHTS, 0.0) - exposed0
    copied = manager.counters.bytes(Direction.H2D, Category.WEIGHTS) - bytes0
    opt.close()
    return exposed, copied / link


@SLOW_LINK
@pytest.mark.skipif(
    os.environ.get("ZERO_OFFLOAD_STRICT") == "1",
    reason="times copies against compute: strict mode completes compute events late by "
    "design, so a prefetch waits for them (exposed 0.54x of the copy time there)",
)
def test_prefetch_hides_the_parameter_copies_on_a_slow_link():
    # bytes/s: a block (12 x 96^2 fp32 ~ 0.44 MB) crosses in ~4.4 ms, about a third of its
    # forward + backward compute at 64 x 16 tokens on two cores; each step moves ~70 MB.
    link = 100e6
    exposed, copy = _exposed_and_copy_seconds(1, link)
    on_demand, copy0 = _exposed_and_copy_seconds(0, link)
    assert copy > 0.15 and copy0 > 0.15
    # Fetched on demand, compute waits for (nearly) every copy...
    assert on_demand > 0.7 * copy0
    # ...prefetched one unit ahead, at most a third of the copy time is exposed.
    assert exposed < 0.33 * copy, (exposed, copy)


def _torch_ckpt(reentrant: bool):
    def runner(block, x):
        return torch_checkpoint.checkpoint(block, x, use_reentrant=reentrant)

    return runner


@pytest.mark.parametrize(
    "runner",
    [
        pytest.param(lambda block, x: offload_checkpoint(block, x), id="zero_offload.checkpoint"),
        pytest.param(_torch_ckpt(False), id="torch-nonreentrant"),
        pytest.param(_torch_ckpt(True), id="torch-reentrant"),
    ],
)
def test_activation_checkpointing_with_parameter_offload_is_bitwise(runner):
    make = functools.partial(gpt, torch.bfloat16, layers=12, runner=runner)
    want_losses, want = reference(make, 6)
    model = make()
    opt = make_opt(model, weight_bytes(model) // 2, offload=True)
    losses = train(model, opt, 6)
    opt.close()
    assert losses == want_losses
    assert_same(model, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_weights_are_one_unit_fetched_for_both_uses(dtype):
    make = functools.partial(gpt, dtype, layers=6, tied=True)
    want_losses, want = reference(make, 8)
    model = make()
    opt = make_opt(model, "64MiB", offload=True)
    offloader = opt.param_offloader
    tied = [unit for unit in offloader.units if unit.spec.tied]
    assert len(tied) == 1 and len(tied[0].spec.modules) == 2
    assert model.head.weight is model.tokens.weight
    losses = train(model, opt, 8)
    opt.close()
    assert losses == want_losses
    assert_same(model, want)
    assert model.head.weight is model.tokens.weight


def test_hf_gpt2_blocks_default_to_transformer_h():
    pytest.importorskip("transformers")
    from .helpers.hf import tiny_gpt2 as tiny_gpt2_host

    def tiny_gpt2():
        return tiny_gpt2_host().to(run_device())

    def loss_of(model, ids):
        return model(input_ids=ids, labels=ids).loss

    want_losses, want = reference(tiny_gpt2, 5, loss_of=loss_of)
    model = tiny_gpt2()
    opt = make_opt(model, "64MiB", offload=True)
    offloader = opt.param_offloader
    names = [unit.spec.name for unit in offloader.units]
    assert [n for n in names if ".h." in n] == ["transformer.h.0", "transformer.h.1"]
    assert "transformer.wte+lm_head" in names  # tied: one unit
    losses = train(model, opt, 5, loss_of=loss_of)
    assert offloader.fetches > 0
    opt.close()
    assert losses == want_losses
    assert_same(model, want)


def test_gradient_accumulation_and_eval_forwards():
    make = functools.partial(gpt, torch.float32, layers=4)

    def loop(model, opt):
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            for _ in range(2):  # two micro-batches
                ids = on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))
                model(ids, ids).backward()
            with torch.no_grad():  # an eval forward between backward and step
                model(ids, ids)
            opt.step()
            opt.zero_grad()

    want = make()
    ref = make_opt(want, "1GiB", offload=False)
    loop(want, ref)
    ref.close()
    model = make()
    opt = make_opt(model, "64MiB", offload=True)
    loop(model, opt)
    opt.close()
    assert_same(model, want)


def test_model_keeps_its_weights_after_close_and_writes_between_steps_count():
    model = gpt(torch.float32, layers=3)
    opt = make_opt(model, "64MiB", offload=True)
    train(model, opt, 2)
    with torch.no_grad():  # a write outside the optimizer, while the units are on the host
        model.blocks[1].mlp[0].weight.fill_(0.5)
    train(model, opt, 1)
    opt.close()
    weight = model.blocks[1].mlp[0].weight
    # The write was the starting point of the step (not overwritten by the old master).
    assert (weight - 0.5).abs().max() < 0.01
    ids = on_device(torch.randint(0, VOCAB, (2, SEQ)))
    assert torch.isfinite(model(ids, ids))  # the model works without the optimizer


def test_errors_name_the_fix():
    model = gpt(torch.float32, layers=2)
    accelerator = run_accelerator(device_budget="64MiB")
    with pytest.raises(ValueError, match="model="):
        OffloadAdamW(
            model.parameters(),
            config=OffloadConfig(offload_parameters=True),
            accelerator=accelerator,
        )
    with pytest.raises(ValueError, match="offload_parameters=True"):
        OffloadAdamW(model.parameters(), accelerator=accelerator, model=model)
    with pytest.raises(ValueError, match="overlap_step=False"):
        OffloadConfig(offload_parameters=True, overlap_step=True)
    with pytest.raises(ValueError, match=r"offload_fraction=1\.0"):
        OffloadConfig(offload_parameters=True, offload_fraction=0.5)
    with pytest.raises(ValueError, match="prefetch_layers"):
        OffloadConfig(offload_parameters=True, prefetch_layers=-1)
    with pytest.raises(TypeError, match="layers"):
        OffloadAdamW(
            model.parameters(),
            config=OffloadConfig(offload_parameters=True),
            accelerator=accelerator,
            model=model,
            layers=model.blocks[0],
        )
    with pytest.raises(DeviceBudgetExceeded, match="parameter-offload window needs"):
        make_opt(gpt(torch.float32, layers=2), 4096, offload=True)
    opt = make_opt(model, "64MiB", offload=True)
    with pytest.warns(UserWarning, match="parameter offload"):
        assert opt.announce_step() is False
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(on_device(torch.zeros(4)))]})
    opt.close()


def test_root_parameters_beside_units_are_refused():
    class WithRootParam(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))  # host: moved with the module
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x * self.scale

    model = WithRootParam().to(run_device())
    with pytest.raises(ValueError, match="Move them into a submodule"):
        make_opt(model, "64MiB", offload=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_estimator_pools_equal_the_optimizers(dtype):
    shape = ModelShape(layers=4, hidden=64, heads=4, vocab=VOCAB, seq_len=SEQ)
    model = gpt(dtype, layers=4)
    opt = make_opt(model, "64MiB", offload=True, bucket_bytes=16384)
    pools = opt.manager.pool_stats()
    capacity = {name.rsplit(".", 1)[-1]: stats["capacity_bytes"] for name, stats in pools.items()}
    # The host pools, one per unit (Note [homes are pinned unit by unit]), together.
    capacity["host"] = sum(s["capacity_bytes"] for n, s in pools.items() if n.endswith(".host"))
    opt.close()
    window, grad_buffers, host = param_offload_bytes(
        shape, itemsize=dtype.itemsize, bucket_bytes=16384
    )
    assert capacity["window"] == window
    assert capacity["device"] == grad_buffers  # the optimizer's device pool: no weights
    assert capacity["host"] == host
    rows = {
        row.name: row
        for row in estimate(shape, dtype=dtype, device_memory=2**30, bucket_bytes=16384).rows
    }
    assert rows["ZeRO-Offload + parameter offload"].device_model_states == window


@SLOW_LINK
def test_profiler_reports_the_parameter_fetches_with_their_exposed_time():
    from zero_offload import profile

    model = gpt(torch.float32, layers=4)
    opt = make_opt(model, "64MiB", offload=True, link=2e8)
    train(model, opt, 1)
    labels: list[str] = []

    def listen(record):
        if getattr(record, "direction", None) is Direction.H2D:
            labels.append(f"{record.category.value}: {record.label}")

    unsubscribe = opt.manager.subscribe(listen)
    before = opt.manager.exposed_seconds.get(Category.WEIGHTS, 0.0)
    bytes0 = opt.manager.counters.bytes(Direction.H2D, Category.WEIGHTS)
    with profile(opt, link_bandwidth=2e8) as prof:
        train(model, opt, 2)
    unsubscribe()
    rows = {row["name"]: row for row in prof.to_dict()["transfers"]}
    weights = rows["weights H2D"]
    # Every weight H2D copy is a parameter fetch: the step itself publishes nothing.
    assert weights["bytes"] == opt.manager.counters.bytes(Direction.H2D, Category.WEIGHTS) - bytes0
    assert weights["count"] == len(labels) > 0
    assert all(label.startswith("weights: param ") for label in labels)
    exposed = opt.manager.exposed_seconds.get(Category.WEIGHTS, 0.0) - before
    assert weights["waited_seconds"] == pytest.approx(exposed)  # the whole stall
    assert weights["exposed_seconds"] <= weights["waited_seconds"] + 1e-12
    opt.close()


def test_every_module_computes_on_window_bytes_and_holds_no_bytes_otherwise():
    model = gpt(torch.bfloat16, layers=6)
    opt = make_opt(model, "64MiB", offload=True)
    offloader = opt.param_offloader
    window = offloader.window.slots[0].block.view(torch.uint8)
    lo = window.untyped_storage().data_ptr()
    hi = lo + window.untyped_storage().nbytes()
    seen = []

    def check(unit, module, args):  # runs after the offloader's own pre-hook
        assert unit.state is UnitState.ON_DEVICE
        for param in unit.spec.params:
            assert lo <= param.data_ptr() < hi
        seen.append(unit.index)

    for unit in offloader.units:
        for module in unit.spec.modules:
            module.register_forward_pre_hook(functools.partial(check, unit))
    train(model, opt, 2)
    assert sorted(set(seen)) == list(range(len(offloader.units)))
    for unit in offloader.units:  # between steps: zero-byte placeholders on the device
        assert unit.state is UnitState.ON_HOST
        for param in unit.spec.params:
            with torch._C.DisableTorchFunctionSubclass():
                assert param.untyped_storage().nbytes() == 0
            assert param.device == opt.accelerator.device
    opt.close()


def test_saved_tensor_offload_with_parameter_offload_is_bitwise():
    from zero_offload import ActivationOffloader, offload_activations
    from zero_offload.activations.config import ActivationOffloadConfig

    make = functools.partial(gpt, torch.bfloat16, layers=6)
    want_losses, want = reference(make, 5)
    model = make()
    opt = make_opt(model, "64MiB", offload=True)
    offloader = ActivationOffloader(
        manager=opt.manager,
        config=ActivationOffloadConfig(host_pool_bytes="64MiB", device_pool_bytes="16MiB"),
    )

    def loss_of(model, ids):
        with offload_activations(min_bytes=1, offloader=offloader):
            return model(ids, ids)

    losses = train(model, opt, 5, loss_of=loss_of)
    assert opt.manager.counters.bytes(Direction.D2H, Category.ACTIVATIONS) > 0
    offloader.close()
    opt.close()
    assert losses == want_losses
    assert_same(model, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resume_continues_bitwise(dtype):
    make = functools.partial(gpt, dtype, layers=4)
    want_losses, want = reference(make, 6)
    model = make()
    opt = make_opt(model, "64MiB", offload=True)
    losses = train(model, opt, 3)
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    opt.close()
    resumed = make()
    resumed.load_state_dict(model_state)
    opt = make_opt(resumed, "64MiB", offload=True)
    opt.load_state_dict(opt_state)
    gen_skip = torch.Generator().manual_seed(1)  # the same batches as the uninterrupted run
    for _ in range(3):
        torch.randint(0, VOCAB, (2, SEQ), generator=gen_skip)  # host: only advances gen_skip
    for _ in range(3):
        ids = on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen_skip))
        loss = resumed(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.close()
    assert losses == want_losses
    assert_same(resumed, want)


def test_two_forwards_then_one_backward():
    make = functools.partial(gpt, torch.bfloat16, layers=4)

    def loss_of(model, ids):  # both forwards' graphs live until the one backward
        return model(ids, ids) + model(ids.flip(1), ids.flip(1))

    want_losses, want = reference(make, 4, loss_of=loss_of)
    model = make()
    opt = make_opt(model, "64MiB", offload=True)
    losses = train(model, opt, 4, loss_of=loss_of)
    opt.close()
    assert losses == want_losses
    assert_same(model, want)
