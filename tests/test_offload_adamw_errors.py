"""Bad input gets a clear error naming the parameter, and a failed call changes nothing.

CUDA form (``cuda_form``): the tests whose parameters come from tests/helpers or are moved
with ``on_device`` run on ``cuda:0`` under ``--accelerator=cuda``; the meta-device refusals
are about the meta device, and stay host only. A state dict's tensors are host tensors, as a
user's checkpoint holds them (``# host:``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zero_offload import DeviceBudgetExceeded, OffloadAdamW, OffloadConfig

from .helpers.device import on_device, run_device
from .helpers.models import batches, host_accelerator, lm_loss, make_pair, offload_opt, train


def _opt(params, **kwargs) -> OffloadAdamW:
    kwargs.setdefault("accelerator", host_accelerator())
    return OffloadAdamW(params, **kwargs)


@pytest.mark.cuda_form
def test_complex_and_integer_parameters_are_refused() -> None:
    with pytest.raises(TypeError, match=r"parameter 1 \(shape \(3,\), torch.complex64\)"):
        _opt(
            [
                nn.Parameter(torch.zeros(2, device=run_device())),
                nn.Parameter(torch.zeros(3, dtype=torch.complex64, device=run_device())),
            ]
        )
    with pytest.raises(TypeError, match=r"parameter 0 .*int64"):
        _opt(
            [
                nn.Parameter(
                    torch.zeros(2, dtype=torch.int64, device=run_device()), requires_grad=False
                )
            ]
        )
    with pytest.raises(TypeError, match="float64 is not supported"):
        _opt([nn.Parameter(torch.zeros(2, dtype=torch.float64, device=run_device()))])


def test_parameter_on_another_device_is_refused() -> None:
    # Meta parameters are told to materialise (to_empty); model.to('cpu') would fail on them.
    with pytest.raises(ValueError, match=r"parameter 0 .* is on the meta device .*to_empty"):
        _opt([nn.Parameter(torch.zeros(2, device="meta"))])


@pytest.mark.cuda_form
def test_non_leaf_is_refused() -> None:
    # Mixed training dtypes are accepted: tests/test_mixed_dtypes.py.
    leaf = nn.Parameter(on_device(torch.ones(3)))
    with pytest.raises(ValueError, match=r"parameter 0 .* not a leaf"):
        _opt([leaf * 2])


@pytest.mark.cuda_form
def test_the_same_parameter_in_two_groups_is_refused() -> None:
    p = nn.Parameter(on_device(torch.ones(3)))
    with pytest.raises(ValueError, match="more than one parameter group"):
        _opt([{"params": [p]}, {"params": [p]}])


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capturable": True}, "capturable=True"),
        ({"differentiable": True}, "differentiable=True"),
        ({"foreach": False}, "foreach"),
        ({"fused": True}, "fused"),
        ({"lr": -1.0}, "lr must be >= 0.0, got -1.0"),
        ({"betas": (1.0, 0.9)}, r"betas\[0\] must be in \[0.0, 1.0\)"),
        ({"eps": float("nan")}, "eps must be a finite number"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"config": {"bucket_bytes": 5}}, "config must be an OffloadConfig"),
    ],
)
def test_unsupported_options_and_bad_hyper_parameters(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        _opt([nn.Parameter(on_device(torch.ones(3)))], **kwargs)


@pytest.mark.cuda_form
def test_sparse_gradient_is_a_clear_error() -> None:
    emb = nn.Embedding(10, 4, sparse=True).to(run_device())
    opt = _opt(emb.parameters())
    with pytest.raises((ValueError, RuntimeError), match="sparse gradient"):
        emb(on_device(torch.tensor([1, 2]))).sum().backward()
    opt.close()


@pytest.mark.cuda_form
def test_budget_too_small_fails_at_construction_and_leaks_nothing() -> None:
    model, _ = make_pair()
    acc = host_accelerator(device_budget=20_000)
    with pytest.raises(DeviceBudgetExceeded) as info:
        offload_opt(model, accelerator=acc)
    message = str(info.value)
    assert "weights" in message and "gradient buffers" in message and "bucket_bytes" in message
    assert acc.memory_stats()["in_use"] == 0


@pytest.mark.cuda_form
def test_failed_construction_leaves_the_model_and_budget_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, _ = make_pair()
    before = copy.deepcopy(model.state_dict())
    acc = host_accelerator()
    from zero_offload.optim.state import host

    calls = {"n": 0}
    original = host.HostState.__init__

    def fail_third(self, *args, **kwargs) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("injected")
        original(self, *args, **kwargs)

    monkeypatch.setattr(host.HostState, "__init__", fail_third)
    with pytest.raises(MemoryError, match="injected"):
        offload_opt(model, accelerator=acc)
    assert acc.memory_stats()["in_use"] == 0
    for param in model.parameters():
        # Note [construction holds one copy]: the parameters of the buckets built before
        # the failure got private storage back, not views of the discarded pool.
        assert param.untyped_storage().nbytes() == param.numel() * param.element_size()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    # Nothing is left owning the parameters: a new optimizer over them builds.
    offload_opt(model, accelerator=acc).close()


@pytest.mark.cuda_form
def test_failed_add_param_group_leaves_the_optimizer_as_it_was() -> None:
    model, _ = make_pair()
    opt = offload_opt(model.blocks)
    groups = len(opt.param_groups)
    with pytest.raises(TypeError, match="float64 is not supported"):
        opt.add_param_group(
            {"params": [nn.Parameter(on_device(torch.ones(3, dtype=torch.float64)))]}
        )
    assert len(opt.param_groups) == groups
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": list(model.head.parameters()), "lr": -2.0})
    assert len(opt.param_groups) == groups
    train(model, opt, batches(1))


def _state_equal(a: dict, b: dict) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(
        torch.equal(a["state"][k][name], b["state"][k][name])
        for k in a["state"]
        for name in a["state"][k]
    )


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])), "groups"),
        (lambda sd: sd["param_groups"][0]["params"].pop(), "parameters"),
        (lambda sd: sd["state"][0].update(exp_avg=torch.zeros(3)), "shape"),  # host: a state dict
        (lambda sd: sd["state"][0].pop("exp_avg_sq"), "missing"),
        (lambda sd: sd["state"][0].update(exp_avg=sd["state"][0]["exp_avg"].long()), "dtype"),
        (lambda sd: sd["state"][0].update(step=torch.tensor(-1.0)), "step"),  # host: a state dict
        (lambda sd: sd["state"].update({999: {}}), "unknown parameter"),
    ],
)
def test_bad_load_state_dict_raises_and_changes_nothing(mutate, match: str) -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    train(model, opt, batches(2))
    before = copy.deepcopy(opt.state_dict())
    # A last entry whose content is valid goes in before the bad one is found, if loading
    # were not checked first: put the fault late.
    bad = copy.deepcopy(before)
    mutate(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.load_state_dict(bad)
    assert _state_equal(before, opt.state_dict())


@pytest.mark.cuda_form
def test_failed_load_state_dict_changes_nothing_even_late() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    train(model, opt, batches(2))
    saved = opt.state_dict()
    bad = copy.deepcopy(saved)
    bad["param_groups"][0]["lr"] = -1.0  # checked before anything is copied
    bad["state"][0]["exp_avg"].fill_(123.0)
    with pytest.raises(ValueError, match=r"lr must be >= 0\.0"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == saved["param_groups"][0]["lr"]
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])


@pytest.mark.cuda_form
def test_clip_grad_norm_rejects_bad_arguments() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(-1.0)


@pytest.mark.cuda_form
def test_config_validation_names_each_field() -> None:
    for field, value in (
        ("bucket_bytes", 10),
        ("tile_elements", 3),
        ("offload_fraction", 1.5),
        ("offload_fraction", "most"),
        ("auto_headroom", 1.0),
        ("max_grad_norm", 0.0),
        ("moments_dtype", "float16"),
    ):
        with pytest.raises(ValueError, match=f"OffloadConfig.{field}"):
            OffloadConfig(**{field: value})
    with pytest.raises(TypeError, match="overlap_step"):
        OffloadConfig(overlap_step=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="overlap_step"):
        _opt(
            [nn.Parameter(on_device(torch.ones(3)))],
            config=OffloadConfig(overlap_step=True, offload_fraction=0.5),
        )


def test_meta_parameters_are_told_to_use_to_empty() -> None:
    with torch.device("meta"):
        layer = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"meta device .* model\.to_empty\(device="):
        OffloadAdamW(layer.parameters(), accelerator=host_accelerator())


@pytest.mark.cuda_form
def test_step_and_close_after_close() -> None:
    model, _ = make_pair()
    opt = offload_opt(model)
    opt.close()
    opt.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"step\(\) after close"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"state_dict\(\) after close"):
        opt.state_dict()
    assert lm_loss(model, *batches(1)[0]).isfinite()  # the model still works
