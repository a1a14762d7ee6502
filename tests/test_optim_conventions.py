"""torch's optimizer conventions: ``named_parameters()``, a 1-element tensor ``lr``, and
``OffloadAdam`` (coupled L2 decay) against ``torch.optim.Adam``.

Tolerance: fp32 everywhere, so the yardstick of tests/test_offload_adamw_parity.py: the CPU
kernel (offloaded buckets) and torch's fused kernel (resident buckets) evaluate Adam in
another order than torch's for-loop, a few ulp per step; 1e-5 absolute over 12 steps.

CUDA form (``cuda_form``): the tests that build through tests/helpers (and the tiny GPT-2,
moved to the test's device) run on ``cuda:0`` under ``--accelerator=cuda``, at the same
tolerance (TF32 off, Note [no TF32 in the CUDA forms] in conftest.py). The tensor-``lr`` and
tensor-``betas`` tests hold CPU tensors, as a user's scheduler does: host only.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from zero_offload import OffloadAdam, OffloadAdamW, OffloadConfig

from .helpers.device import on_device, run_device
from .helpers.models import batches, host_accelerator, make_pair, max_diff, train

FP32_ATOL = 1e-5


def _opt(params: Any, cls: type = OffloadAdamW, offload_fraction: float = 1.0, **hyper: Any) -> Any:
    """``cls`` with small buckets and tiles on the test's accelerator."""
    config = OffloadConfig(bucket_bytes=8192, tile_elements=1024, offload_fraction=offload_fraction)
    return cls(params, **hyper, config=config, accelerator=host_accelerator())


# -- named_parameters ------------------------------------------------------------------


@pytest.mark.cuda_form
def test_named_parameters_keep_their_names_like_torch() -> None:
    model, ref = make_pair()
    opt = _opt(model.named_parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.named_parameters(), lr=1e-3)
    names = [name for name, _ in model.named_parameters()]
    assert opt.param_groups[0]["param_names"] == names
    assert opt.param_groups[0]["params"] == list(model.parameters())
    data = batches(4)
    train(model, opt, data)
    train(ref, ropt, data)
    assert max_diff(model, ref) < FP32_ATOL
    ours, theirs = opt.state_dict(), ropt.state_dict()
    assert ours["param_groups"][0]["param_names"] == theirs["param_groups"][0]["param_names"]
    assert ours["param_groups"][0]["params"] == theirs["param_groups"][0]["params"]
    opt.close()


@pytest.mark.cuda_form
def test_named_groups_round_trip_through_the_state_dict() -> None:
    data = batches(8)
    model, _ = make_pair()

    def groups(module: torch.nn.Module) -> list[dict]:
        named = list(module.named_parameters())
        return [
            {"params": [(n, p) for n, p in named if p.ndim > 1], "weight_decay": 0.1},
            {"params": [(n, p) for n, p in named if p.ndim <= 1], "weight_decay": 0.0},
        ]

    whole = _opt(groups(model), lr=1e-3)
    train(model, whole, data)

    first, _ = make_pair()
    opt1 = _opt(groups(first), lr=1e-3)
    train(first, opt1, data[:4])
    saved = copy.deepcopy(opt1.state_dict())
    assert [g["param_names"] for g in saved["param_groups"]] == [
        g["param_names"] for g in opt1.param_groups
    ]
    resumed, _ = make_pair(seed=3)
    resumed.load_state_dict(first.state_dict())
    # Unnamed on this side: the names come from the state dict, as torch's load does.
    plain = [{k: v for k, v in g.items() if k != "params"} for g in groups(resumed)]
    for group, named in zip(plain, groups(resumed), strict=True):
        group["params"] = [p for _, p in named["params"]]
    opt2 = _opt(plain, lr=1e-3)
    assert "param_names" not in opt2.param_groups[0]
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["param_names"] == saved["param_groups"][0]["param_names"]
    train(resumed, opt2, data[4:])
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    for opt in (whole, opt1, opt2):
        opt.close()


@pytest.mark.cuda_form
def test_add_param_group_takes_names_and_refuses_a_mix() -> None:
    model, _ = make_pair()
    opt = _opt(model.blocks.named_parameters())
    opt.add_param_group({"params": list(model.head.named_parameters()), "lr": 1e-2})
    assert opt.param_groups[1]["param_names"] == ["weight", "bias"]
    with pytest.raises(ValueError, match="param group 2 is without parameter names"):
        opt.add_param_group({"params": list(model.norm.parameters())})
    with pytest.raises(ValueError, match="entry 1 of 'params' has no name"):
        opt.add_param_group(
            {"params": [("weight", model.norm.weight), model.norm.bias]}  # type: ignore[list-item]
        )
    with pytest.raises(TypeError, match=r"entry 0 of 'params' must be a \(name: str"):
        opt.add_param_group({"params": [(0, model.norm.weight)]})
    assert len(opt.param_groups) == 2
    train(model, opt, batches(1))
    opt.close()


# -- a tensor lr -----------------------------------------------------------------------


def test_a_one_element_tensor_lr_steps_in_place_under_a_scheduler() -> None:
    """Schedulers under torch.compile keep ``lr`` a tensor and fill it in place."""
    model, ref = make_pair()
    lr, rlr = torch.tensor(1e-3), torch.tensor(1e-3)
    opt = _opt(model.parameters(), lr=lr, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=rlr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=6)
    rsched = torch.optim.lr_scheduler.LinearLR(
        ropt, start_factor=1.0, end_factor=0.1, total_iters=6
    )
    for tokens, targets in batches(6):
        for m, o, s in ((model, opt, sched), (ref, ropt, rsched)):
            torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), targets.flatten()).backward()
            o.step()
            o.zero_grad()
            s.step()
    assert opt.param_groups[0]["lr"] is lr  # filled in place, never replaced
    torch.testing.assert_close(lr, rlr)
    assert lr.item() < 1e-3
    assert max_diff(model, ref) < FP32_ATOL
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    sched.step()  # writes our group's tensor, not the caller's state dict
    assert saved["param_groups"][0]["lr"] is not opt.param_groups[0]["lr"]
    opt.close()


@pytest.mark.parametrize(
    ("lr", "error", "match"),
    [
        (torch.tensor([1e-3, 1e-3]), ValueError, "exactly 1 element, got shape"),
        (torch.tensor(-1.0), ValueError, r"lr must be >= 0.0"),
        (torch.tensor(1), TypeError, "real floating-point tensor"),
        (torch.tensor(1e-3, requires_grad=True), TypeError, "does not require grad"),
    ],
)
def test_bad_tensor_lrs_are_refused(lr: torch.Tensor, error: type, match: str) -> None:
    model, _ = make_pair()
    with pytest.raises(error, match=match):
        _opt(model.parameters(), lr=lr)


def test_tensor_betas_both_or_neither() -> None:
    model, _ = make_pair()
    with pytest.raises(ValueError, match="both floats or both 1-element tensors"):
        _opt(model.parameters(), betas=(0.9, torch.tensor(0.99)))
    opt = _opt(model.parameters(), betas=(torch.tensor([[0.9]]), torch.tensor([0.99])))
    train(model, opt, batches(1))
    opt.close()


# -- OffloadAdam: torch.optim.Adam's coupled L2 decay ----------------------------------


@pytest.mark.cuda_form
@pytest.mark.parametrize("offload_fraction", [1.0, 0.0])
@pytest.mark.parametrize(
    "hyper",
    [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "maximize": True},
        {"weight_decay": 0.1, "amsgrad": True},
        {"weight_decay": 0.1, "amsgrad": True, "maximize": True},
    ],
    ids=["default", "weight_decay", "maximize", "amsgrad", "amsgrad_maximize"],
)
def test_offload_adam_matches_torch_adam(hyper: dict, offload_fraction: float) -> None:
    model, ref = make_pair()
    opt = _opt(model.parameters(), OffloadAdam, offload_fraction, lr=1e-3, **hyper)
    assert {b.resident for b in opt.buckets} == {offload_fraction == 0.0}
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-3, **hyper)
    data = batches(12)
    ours = train(model, opt, data)
    theirs = train(ref, ropt, data)
    assert max_diff(model, ref) < FP32_ATOL
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
    opt.close()


@pytest.mark.cuda_form
def test_offload_adam_decay_is_coupled_not_decoupled() -> None:
    """With a large weight decay the two rules visibly part: OffloadAdam follows
    torch.optim.Adam and not AdamW (so the test above cannot pass by accident)."""
    model, ref = make_pair()
    coupled = copy.deepcopy(ref)
    opt = _opt(model.parameters(), OffloadAdam, lr=1e-2, weight_decay=0.5)
    adam = torch.optim.Adam(coupled.parameters(), lr=1e-2, weight_decay=0.5)
    adamw = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.5)
    data = batches(4)
    train(model, opt, data)
    train(coupled, adam, data)
    train(ref, adamw, data)
    assert max_diff(model, coupled) < FP32_ATOL
    assert max_diff(model, ref) > 100 * FP32_ATOL
    assert opt.defaults["weight_decay"] == 0.5
    default = _opt(make_pair()[0].parameters(), OffloadAdam)
    assert default.defaults["weight_decay"] == 0.0  # torch.optim.Adam's default
    for optimizer in (opt, default):
        optimizer.close()


# -- tied weights ----------------------------------------------------------------------


def _tiny_gpt2(vocab: int = 64) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=vocab,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(config).to(run_device())


def _gpt2_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = on_device(torch.randint(0, 64, (2, 16), generator=gen))
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.cuda_form
def test_tied_gpt2_embeddings_train_like_torch_and_stay_tied() -> None:
    model = _tiny_gpt2()
    ref = copy.deepcopy(model)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one Parameter
    opt = _opt(model.parameters(), lr=1e-3, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    trained = [p for b in opt.buckets for p in b.params]
    assert sum(p is model.transformer.wte.weight for p in trained) == 1  # one slot, both uses
    ours, theirs = _gpt2_steps(model, opt, 6), _gpt2_steps(ref, ropt, 6)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
    assert max_diff(model, ref) < FP32_ATOL
    opt.close()


@pytest.mark.cuda_form
def test_resize_token_embeddings_after_construction_is_refused_at_the_next_step() -> None:
    model = _tiny_gpt2()
    opt = _opt(model.parameters())
    _gpt2_steps(model, opt, 1)
    before = model.transformer.h[0].mlp.c_fc.weight.detach().clone()
    model.resize_token_embeddings(72)
    tokens = on_device(torch.randint(0, 72, (2, 16)))
    model(input_ids=tokens, labels=tokens).loss.backward()
    with pytest.raises(ValueError, match=r"its \.data was replaced .*resize_token_embeddings"):
        opt.step()
    # Nothing was stepped: the other weights are as they were.
    assert torch.equal(model.transformer.h[0].mlp.c_fc.weight, before)
    opt.close()


@pytest.mark.cuda_form
def test_refusals_name_a_named_parameter() -> None:
    model, _ = make_pair()
    with torch.no_grad():
        model.norm.bias.data = model.norm.bias.data.double()
    with pytest.raises(
        TypeError, match=r"parameter \d+ \('norm.bias', shape \(32,\), torch.float64"
    ):
        _opt(model.named_parameters())
