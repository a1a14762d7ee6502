"""Parameter offload: user code reading parameters outside the window gets torch's values.

Each test runs the same loop with a resident copy under ``torch.optim.AdamW`` and compares:
a decoder reusing an encoder's weights read directly (tied autoencoder), ``parameters_to_vector``
and ``torch.cat`` over every parameter, one op taking two units that share a window slot,
one call taking two parameters of one unit, and a foreach EMA over the whole model (Note [a
read outside the window lands privately] in ``zero_offload/params/private_reads.py``).

CUDA form (``cuda_form``, docs/gpu.md): the models, the data and the accelerator are the
running test's (tests/helpers/device.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.errors import StorageError
from zero_offload.memory import io_engine

from .helpers.device import on_device, run_accelerator, run_device

pytestmark = pytest.mark.cuda_form

D = 16
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


class Blocks(nn.Module):
    """Four linear blocks (units 0-3; with ``prefetch_layers=1`` blocks 0 and 3 share ring
    slot 0) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


class TiedAutoencoder(nn.Module):
    """The decoder reuses each encoder weight, transposed, read directly (not through the
    encoder's forward); its biases are one unit of their own, never run by a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.dec_bias = nn.ParameterList(nn.Parameter(on_device(torch.zeros(D))) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.enc:
            h = torch.tanh(layer(h))
        for i in reversed(range(len(self.enc))):
            h = torch.tanh(F.linear(h, self.enc[i].weight.t(), self.dec_bias[i]))
        return h


def pair(
    cls: type[nn.Module], *, budget: str = "256MiB", **config: object
) -> tuple[nn.Module, OffloadAdamW, nn.Module, torch.optim.AdamW]:
    """(offloaded model, its optimizer, resident reference, torch AdamW)."""
    torch.manual_seed(0)
    model = cls().to(run_device())
    ref = copy.deepcopy(model)
    opt = OffloadAdamW(
        model.parameters(),
        **HYPER,
        config=OffloadConfig(
            offload_parameters=True, bucket_bytes=2048, tile_elements=1024, **config
        ),
        accelerator=run_accelerator(device_budget=budget),
        model=model,
    )
    return model, opt, ref, torch.optim.AdamW(ref.parameters(), **HYPER)


def batch(seed: int, cols: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return on_device(torch.randn(8, D, generator=gen)), on_device(
        torch.randn(8, cols, generator=gen)
    )


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def trained_once(
    model: nn.Module, opt: OffloadAdamW, ref: nn.Module, ref_opt: torch.optim.AdamW
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of each on the same batch (parameters released after it); the batch."""
    x, y = batch(0)
    train_step(model, opt, x, y)
    train_step(ref, ref_opt, x, y)
    return x, y


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()
    assert diff <= 1e-5, f"{what}: max |offloaded - torch| = {diff:.3e}"


def assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert_close(p, q, name)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_tied_autoencoder_reusing_weights_directly_trains_like_torch(prefetch: int) -> None:
    """Reading ``dec_bias[i]`` used to evict ``enc[1]`` from the slot whose ``.t()`` view
    autograd had just saved: the loss and every update drifted from torch's."""
    model, opt, ref, ref_opt = pair(TiedAutoencoder, prefetch_layers=prefetch)
    try:
        for seed in range(5):
            x, _ = batch(seed)
            ours = train_step(model, opt, x, x)
            theirs = train_step(ref, ref_opt, x, x)
            assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (seed, ours, theirs)
        assert_same_params(model, ref)
    finally:
        opt.close()


def test_parameters_to_vector_and_cat_see_the_live_weights() -> None:
    """Each ``view(-1)`` of a released parameter used to land in its unit's slot, evicting
    the unit whose view was taken before: the vector held other blocks' bytes."""
    model, opt, ref, ref_opt = pair(Blocks)
    try:
        for seed in range(2):
            x, y = batch(seed)
            train_step(model, opt, x, y)
            train_step(ref, ref_opt, x, y)
        assert_close(
            parameters_to_vector(model.parameters()),
            parameters_to_vector(ref.parameters()),
            "parameters_to_vector",
        )
        assert_close(
            torch.cat([p.detach().flatten() for p in model.parameters()]),
            torch.cat([p.detach().flatten() for p in ref.parameters()]),
            "torch.cat of detached parameters",
        )
        held = model.blocks[0].weight.view(-1)  # a view kept while another unit is read
        assert_close(model.blocks[3].weight, ref.blocks[3].weight, "blocks[3].weight")
        assert_close(held, ref.blocks[0].weight.view(-1), "held view of blocks[0].weight")
        # The window still trains like torch afterwards.
        x, y = batch(7)
        train_step(model, opt, x, y)
        train_step(ref, ref_opt, x, y)
        assert_same_params(model, ref)
    finally:
        opt.close()


def test_one_op_on_two_units_sharing_a_slot() -> None:
    """``blocks[0]`` and ``blocks[3]`` share ring slot 0: bringing back the second used to
    release the first, and the op ran on a zero-byte placeholder (a segfault)."""
    model, opt, ref, ref_opt = pair(Blocks)
    try:
        trained_once(model, opt, ref, ref_opt)
        assert_close(
            model.blocks[0].weight + model.blocks[3].weight,
            ref.blocks[0].weight + ref.blocks[3].weight,
            "blocks[0].weight + blocks[3].weight",
        )
    finally:
        opt.close()


def test_one_call_on_two_parameters_of_one_unit() -> None:
    """Bringing back the weight brought the bias back too; the bias then raised
    ``AttributeError: type object 'Parameter' has no attribute '_plain'``."""
    model, opt, ref, ref_opt = pair(Blocks)
    try:
        x, _ = trained_once(model, opt, ref, ref_opt)
        assert_close(
            F.linear(x, model.blocks[0].weight, model.blocks[0].bias),
            F.linear(x, ref.blocks[0].weight, ref.blocks[0].bias),
            "F.linear(x, blocks[0].weight, blocks[0].bias)",
        )
        ours = torch._foreach_norm(list(model.blocks[1].parameters()))
        theirs = torch._foreach_norm(list(ref.blocks[1].parameters()))
        assert_close(torch.stack(ours), torch.stack(theirs), "_foreach_norm of blocks[1]")
    finally:
        opt.close()


def test_foreach_ema_over_every_parameter() -> None:
    """timm's ModelEmaV3 (``foreach=True``): ``torch._foreach_lerp_`` over every parameter
    of the model in one call, and ``_foreach_norm`` over all of them for logging."""
    model, opt, ref, ref_opt = pair(Blocks)
    try:
        ema = [p.detach().clone() for p in ref.parameters()]
        ema_ref = [p.detach().clone() for p in ref.parameters()]
        for seed in range(3):
            x, y = batch(seed)
            train_step(model, opt, x, y)
            train_step(ref, ref_opt, x, y)
            with torch.no_grad():
                torch._foreach_lerp_(ema, list(model.parameters()), 0.1)
                torch._foreach_lerp_(ema_ref, list(ref.parameters()), 0.1)
                norms = torch.stack(torch._foreach_norm(list(model.parameters())))
                norms_ref = torch.stack(torch._foreach_norm(list(ref.parameters())))
            assert_close(norms, norms_ref, f"_foreach_norm of every parameter, step {seed}")
        for i, (a, b) in enumerate(zip(ema, ema_ref, strict=True)):
            assert_close(a, b, f"EMA of parameter {i}")
        assert_same_params(model, ref)
    finally:
        opt.close()


# -- found by a review of the private landing ----------------------------------------------


def test_a_write_then_a_state_dict_then_a_forward_uses_the_written_weights() -> None:
    """The state dict's write-back carried the private buffer's write home, but the slot,
    still holding the unit's bytes from before, was taken as current: the forward ran on the
    weights before the write (0.214 from torch)."""
    model, opt, ref, ref_opt = pair(Blocks, prefetch_layers=1)
    try:
        x, _ = trained_once(model, opt, ref, ref_opt)
        with torch.no_grad():
            model(x)  # leaves blocks[2] released with its bytes still in its slot
            model.blocks[2].weight.add_(1.0)
            ref.blocks[2].weight.add_(1.0)
        model.state_dict()
        with torch.no_grad():
            assert_close(model(x), ref(x), "forward after a write and a state dict")
    finally:
        opt.close()


def test_a_refused_read_gives_its_buffer_back() -> None:
    """A read refused for a replaced ``.data`` kept the private buffer allocated for it:
    the ledger grew by a unit per refused read."""
    model, opt, ref, ref_opt = pair(Blocks, prefetch_layers=1)
    try:
        trained_once(model, opt, ref, ref_opt)
        ledger = opt.manager.accelerator.memory_stats
        in_use = ledger()["in_use"]
        model.blocks[1].weight.data = torch.zeros(D, D, device=run_device())
        for _ in range(3):
            with pytest.raises(ValueError, match="no longer uses the sto"):
                model.blocks[1].bias + 1
            assert ledger()["in_use"] == in_use
    finally:
        opt.close()


def test_a_failed_read_from_nvme_leaves_the_unit_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A private read whose disk read failed cleared the slot of the unit resident there and
    left the unit FETCHING over a buffer nobody filled: the next read returned garbage."""
    model, opt, ref, ref_opt = pair(Blocks, prefetch_layers=1, nvme_dir=tmp_path, host_budget=1)
    try:
        x, _ = trained_once(model, opt, ref, ref_opt)
        with torch.no_grad():
            model(x)  # blocks[3] resident in slot 0, which blocks[0] shares
        real = io_engine._preadv

        def broken(*_: object) -> int:
            raise OSError(5, "Input/output error (injected)")

        monkeypatch.setattr(io_engine, "_preadv", broken)
        with pytest.raises(StorageError):
            model.blocks[0].weight.sum()
        monkeypatch.setattr(io_engine, "_preadv", real)
        assert_close(model.blocks[0].weight, ref.blocks[0].weight, "blocks[0] read again")
        with torch.no_grad():
            assert_close(model(x), ref(x), "forward after the failed read")
    finally:
        opt.close()


def test_a_budget_sized_for_training_still_reads_a_parameter() -> None:
    """The smallest budget that trains has no room for a private copy: the read goes into
    the slot, as before, warning once what that means for views kept."""
    model, opt, ref, ref_opt = pair(Blocks, budget="10KiB", prefetch_layers=1)
    try:
        trained_once(model, opt, ref, ref_opt)
        with pytest.warns(RuntimeWarning, match="no room for a copy of its own"):
            assert_close(model.blocks[0].weight, ref.blocks[0].weight, "blocks[0] read")
    finally:
        opt.close()
