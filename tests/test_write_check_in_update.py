"""The write check made by the update's own pass under parameter offload (Note [the write
check in the update] in optim/update/reconcile.py, Note [the update takes the written
weights] in kernels/convert.py).

Each side of every comparison trains the same model the same way; "fingerprints" is the
library with every bucket's store made to say it cannot check in its update, which is the
check as it was (a hash of every weight, ``reconcile_master`` where one moved). The update
must give those bits, write or no write, and take no fingerprint of its own. A control that
turns the kernel's take off shows the writes would otherwise be lost, so the comparisons
can fail.

CUDA form (``cuda_form``, docs/gpu.md): the step tests. Under parameter offload the homes are
pinned host memory on either kind, so the same comparisons run with the window on
``cuda:0``. The kernel tests are CPU kernels on host arrays: they have no CUDA form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from zero_offload import OffloadAdagrad, OffloadAdamW, OffloadConfig, OffloadLion
from zero_offload.config import LossScalerConfig
from zero_offload.demo.model import GPTConfig, TinyGPT
from zero_offload.kernels import adam_step
from zero_offload.kernels.adagrad import adagrad_step
from zero_offload.kernels.lion import lion_step
from zero_offload.optim.state.store import take_written
from zero_offload.views import param_views

from .helpers.device import on_device, run_accelerator, run_device

VOCAB, SEQ = 64, 16


# -- the kernels ----------------------------------------------------------------------------

KERNELS: dict[str, Callable[..., None]] = {
    "adam": lambda p, g, s, **kw: adam_step(
        p, g, s[0], s[1], step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
        weight_decay=0.1, **kw,
    ),
    "lion": lambda p, g, s, **kw: lion_step(
        p, g, s[0], lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, **kw
    ),
    "adagrad": lambda p, g, s, **kw: adagrad_step(
        p, g, s[0], step=2, lr=1e-2, lr_decay=0.0, weight_decay=0.1, eps=1e-10, **kw
    ),
}  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_taking_written_weights_is_reconcile_then_step(name: str, dtype: torch.dtype) -> None:
    """Bit for bit ``take_written`` (what the check's reconcile does) then the step, with
    the edge cases of comparing by value: +-0 equal, NaN never equal, inf, subnormals."""
    gen = torch.Generator().manual_seed(0)
    n = 4099  # not a multiple of any vector width
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen)
    state = [torch.rand(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.1]
    out = master.to(dtype)
    written = torch.randperm(n, generator=gen)[:300]
    out[written] = torch.randn(300, generator=gen).to(dtype)
    master[:4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    out[:4] = torch.tensor([-0.0, 0.0, 0.0, -0.0]).to(dtype)  # equal values: masters kept
    master[4], out[5], master[6], out[6] = float("nan"), float("nan"), float("nan"), 1.0
    out[7], out[8] = float("inf"), -float("inf")
    tiny = torch.finfo(dtype).tiny
    out[9] = tiny / 4  # a subnormal weight (fp16's and bf16's)
    master[10] = float(tiny) / 3  # a master that rounds to a subnormal
    want = [master.clone(), [s.clone() for s in state], out.clone()]
    take_written(want[0], want[2])
    KERNELS[name](want[0], grad, want[1], out=want[2])
    got = [master.clone(), [s.clone() for s in state], out.clone()]
    KERNELS[name](got[0], grad, got[1], out=got[2], take_written=True)
    assert torch.equal(_bits(got[0]), _bits(want[0]))
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(got[2]), _bits(want[2]))
    # the control: without the take, the written weights are lost
    lost = [master.clone(), [s.clone() for s in state], out.clone()]
    KERNELS[name](lost[0], grad, lost[1], out=lost[2])
    assert not torch.equal(_bits(lost[2]), _bits(want[2]))


@pytest.mark.parametrize("name", list(KERNELS))
def test_take_written_is_checked_before_anything_is_written(name: str) -> None:
    master, grad = torch.randn(8), torch.randn(8)
    state = [torch.zeros(8), torch.zeros(8)]
    before = master.clone()
    with pytest.raises(ValueError, match=r"take_written=True needs out"):
        KERNELS[name](master, grad, state, take_written=True)
    with pytest.raises(TypeError, match=r"take_written must be a bool, got 1"):
        KERNELS[name](master, grad, state, out=master.bfloat16(), take_written=1)
    assert torch.equal(master, before)


# -- the step -------------------------------------------------------------------------------


def _gpt(dtype: torch.dtype) -> TinyGPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=3, hidden=64, heads=4)
    return TinyGPT(config).to(run_device(), dtype)


def _opt(model: TinyGPT, cls: type = OffloadAdamW, *, check: str, **config: object):
    kwargs = {"lr": 1e-2} if cls is not OffloadAdamW else {"lr": 1e-3, "weight_decay": 0.1}
    opt = cls(
        model.parameters(),
        accelerator=run_accelerator(device_budget="64MiB"),
        model=model,
        config=OffloadConfig(
            offload_parameters=True, bucket_bytes=16384, tile_elements=1024, **config
        ),
        **kwargs,
    )
    if check == "fingerprints":
        for bucket in opt.buckets:
            bucket.store.reconciles_in_update = lambda: False
    return opt


def _batches() -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    while True:
        yield on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))


def _units_own(frame) -> bool:
    """Whether a fingerprint is a unit's check of its own slot (``slot_fingerprint``, through
    a subclass's ``_fingerprint`` or not), not the optimizer's write check."""
    for _ in range(3):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code.co_name == "slot_fingerprint":
            return True
    return False


class _Hashes:
    """The optimizer's fingerprint passes (not a unit's own check of its slot)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import sys

        self.count = 0
        fingerprint = param_views.ParamViews._fingerprint

        def counted(views, *args, **kwargs):
            if not _units_own(sys._getframe()):
                self.count += 1
            return fingerprint(views, *args, **kwargs)

        monkeypatch.setattr(param_views.ParamViews, "_fingerprint", counted)


WRITES: dict[str, Callable[[TinyGPT], None]] = {
    # what a user's code writes between steps, each through another door
    "data": lambda m: m.blocks[0].mlp[0].weight.data.mul_(0.5),
    "no_grad op": lambda m: m.blocks[1].norm2.weight.add_(1.0),
    "load_state_dict": lambda m: m.load_state_dict(
        {"blocks.2.attn.out.weight": torch.zeros_like(m.blocks[2].attn.out.weight)},
        strict=False,
    ),
}


def _train(model: TinyGPT, opt, steps: int, write: Callable[[TinyGPT], None] | None) -> None:
    data = _batches()
    for _ in range(steps):
        ids = next(data)
        opt.backward(model(ids, ids).float())  # the loss scale, for fp16 models
        if write is not None:
            with torch.no_grad():
                write(model)
        opt.step()
        opt.zero_grad()


def _weights(model: TinyGPT) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(_bits(a[key].float()), _bits(b[key].float())), key


def _assert_same_states(a: dict, b: dict) -> None:
    """Two optimizers' state dicts, bit for bit, every state tensor of every parameter."""
    for i, entry in b["state"].items():
        _assert_same(a["state"][i], entry)


def _run(
    dtype: torch.dtype,
    *,
    check: str,
    write: str | None,
    cls: type = OffloadAdamW,
    hashes: _Hashes | None = None,
) -> tuple[dict[str, torch.Tensor], int, dict]:
    """Three steps of a fresh model, ``write`` made before each: its weights, the
    optimizer's fingerprint passes, and its state dict."""
    model = _gpt(dtype)
    opt = _opt(model, cls, check=check)
    try:
        if hashes is not None:
            hashes.count = 0
        _train(model, opt, 3, None if write is None else WRITES[write])
        return _weights(model), 0 if hashes is None else hashes.count, opt.state_dict()
    finally:
        opt.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("write", [None, *WRITES], ids=lambda w: w or "nothing")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_the_update_checks_as_the_fingerprints_did(
    dtype: torch.dtype, write: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashes = _Hashes(monkeypatch)
    want, want_hashes, want_state = _run(dtype, check="fingerprints", write=write, hashes=hashes)
    got, got_hashes, got_state = _run(dtype, check="in the update", write=write, hashes=hashes)
    _assert_same(got, want)
    _assert_same_states(got_state, want_state)
    assert want_hashes > 0 and got_hashes == 0  # the check was the update's, no hash


@pytest.mark.cuda_form
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_without_the_take_a_write_is_lost(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: the same run with the kernel told not to take trains other weights."""
    import zero_offload.optim.rule.adamw as adamw_rule

    want = _run(dtype, check="in the update", write="data")[0]
    step = adamw_rule.adam_step
    monkeypatch.setattr(
        adamw_rule, "adam_step", lambda *a, **kw: step(*a, **{**kw, "take_written": False})
    )
    lost = _run(dtype, check="in the update", write="data")[0]
    key = "blocks.0.mlp.0.weight"
    assert not torch.equal(lost[key].float(), want[key].float())


@pytest.mark.cuda_form
@pytest.mark.parametrize("cls", [OffloadLion, OffloadAdagrad], ids=lambda c: c.__name__)
def test_lion_and_adagrad_check_in_their_update(cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    hashes = _Hashes(monkeypatch)
    dtype = torch.bfloat16
    want, want_hashes, _ = _run(dtype, check="fingerprints", write="data", cls=cls, hashes=hashes)
    got, got_hashes, _ = _run(dtype, check="in the update", write="data", cls=cls, hashes=hashes)
    _assert_same(got, want)
    assert want_hashes > 0 and got_hashes == 0


@pytest.mark.cuda_form
def test_a_parameter_without_a_gradient_keeps_its_bucket_on_fingerprints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bucket whose update would not cover a slot (a parameter the forward never uses
    gets no gradient) is checked by fingerprint: a write into that slot still reaches the
    master, as torch's loop keeps it."""
    hashes = _Hashes(monkeypatch)
    results = {}
    for check in ("fingerprints", "in the update"):
        model = _gpt(torch.bfloat16)
        model.unused = torch.nn.Linear(8, 8).to(run_device(), torch.bfloat16)
        opt = _opt(model, check=check)
        try:
            data = _batches()
            hashes.count = 0
            for i in range(3):
                ids = next(data)
                model(ids, ids).float().backward()
                with torch.no_grad():
                    model.unused.weight.data.mul_(1.5 + i)
                    WRITES["data"](model)
                opt.step()
                opt.zero_grad()
            results[check] = (_weights(model), opt.state_dict(), hashes.count)
        finally:
            opt.close()
    (want, want_state, want_hashes), (got, got_state, got_hashes) = results.values()
    _assert_same(got, want)
    _assert_same_states(got_state, want_state)
    assert 0 < got_hashes < want_hashes  # the unused parameter's bucket only


@pytest.mark.cuda_form
def test_a_skipped_step_still_takes_the_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp16 overflow skips the update: the buckets left to it are reconciled by value
    when the step ends, so the master after ``step()`` is what the fingerprints gave."""
    results = {}
    for check in ("fingerprints", "in the update"):
        model = _gpt(torch.float16)
        opt = _opt(model, check=check, loss_scaler=LossScalerConfig(initial_scale=2.0**40))
        try:
            ids = next(_batches())
            opt.backward(model(ids, ids).float())  # 2**40 overflows fp16: skipped
            with torch.no_grad():
                WRITES["data"](model)
            opt.step()
            assert opt.skipped_steps == 1
            results[check] = opt.state_dict()
            opt.zero_grad()
        finally:
            opt.close()
    want, got = results.values()
    _assert_same_states(got, want)


def zero3_scenario(rank: int, world: int, out: Path, *, check: str) -> dict:
    """On each of ``world`` gloo ranks: ZeRO-3 (each rank's home holds its shard), three
    steps on the rank's share with one weight written through ``.data`` before each; the
    fingerprints the optimizer took (``remember``: the sharded views hash in their own
    ``_fingerprint``)."""
    from .helpers.zero3 import batches, gpt, make_opt, share

    taken = [0]
    remember = param_views.ParamViews.remember

    def counted(views) -> None:
        taken[0] += 1
        remember(views)

    param_views.ParamViews.remember = counted
    model = gpt(torch.bfloat16, layers=2)
    opt = make_opt(model, offload=True)
    if check == "fingerprints":
        for bucket in opt.buckets:
            bucket.store.reconciles_in_update = lambda: False
    taken[0] = 0  # construction's own
    for ids, targets in batches(3):
        model(share(ids, rank, world), share(targets, rank, world)).backward()
        with torch.no_grad():
            WRITES["data"](model)  # every rank alike: the unit is gathered to be written
        opt.step()
        opt.zero_grad()
    opt.close()  # collective: every parameter gets its gathered weights
    return {"weights": _weights(model), "hashes": taken[0]}


@pytest.mark.cuda_form
@pytest.mark.simulator_only("spawns gloo ranks on the host accelerator")
def test_zero3_ranks_check_their_shards_in_the_update(tmp_path: Path) -> None:
    """Each rank's update takes the writes into its shard of the master (its home holds the
    shard only), as each rank's fingerprints of its shard did."""
    from .helpers.zero3 import run

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = run(2, zero3_scenario, tmp_path / "a", check="fingerprints")
    got = run(2, zero3_scenario, tmp_path / "b", check="in the update")
    for mine, theirs in zip(got, want, strict=True):
        _assert_same(mine["weights"], theirs["weights"])
        assert theirs["hashes"] > 0 and mine["hashes"] == 0


@pytest.mark.cuda_form
def test_a_master_written_through_opt_state_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """``opt.state[p]["master"]`` is writable: the step after such a write keeps it, as the
    fingerprints (the weights unchanged) do, and once the views are gone the next step is
    checked in its update again (Note [a master written outside the optimizer])."""
    hashes = _Hashes(monkeypatch)
    results = {}
    for check in ("fingerprints", "in the update"):
        model = _gpt(torch.bfloat16)
        opt = _opt(model, check=check)
        try:
            _train(model, opt, 1, None)
            weight = model.blocks[0].mlp[0].weight
            opt.state[weight]["master"].add_(0.25)  # the view goes with the dict
            counts = []
            for _ in range(2):
                hashes.count = 0
                _train(model, opt, 1, None)
                counts.append(hashes.count)
            results[check] = (_weights(model), opt.state_dict(), counts)
        finally:
            opt.close()
    (want, want_state, want_counts), (got, got_state, got_counts) = results.values()
    _assert_same(got, want)
    _assert_same_states(got_state, want_state)
    # the written bucket by fingerprint (cold and streamed), then none
    assert got_counts[0] > 0 and got_counts[1] == 0 and want_counts[1] > 0


def test_a_rule_whose_tile_step_cannot_take_keeps_the_fingerprints() -> None:
    from zero_offload.optim.rule.adamw import AdamRule

    class Mine(AdamRule):
        def tile_step(self, fields, grad, *, step, hyper, grad_scale, out):  # no take_written
            super().tile_step(fields, grad, step=step, hyper=hyper, grad_scale=grad_scale,
                              out=out)  # fmt: skip

    class Inherits(AdamRule):
        pass

    assert AdamRule.takes_written and Inherits.takes_written
    assert not Mine.takes_written
