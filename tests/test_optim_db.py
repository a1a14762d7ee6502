"""torch's own optimizer test inputs (``optim_db``, the Adam and AdamW entries) against
``OffloadAdam`` and ``OffloadAdamW``.

Every config that means something here trains to parity with torch's optimizer on a small
fp32 model; the configs and switches we refuse by design (``capturable``,
``differentiable``, and torch's ``foreach``/``fused`` implementation switches: the update
always runs our fused CPU kernel, outside autograd and CUDA graphs) raise ``ValueError``.
Every error input raises ``ValueError`` or ``TypeError`` from our constructor, naming the
argument. The configs of every device type are taken (the CUDA ones bring tensor ``lr`` and
``betas``), since the host accelerator stands in for any device.

CUDA form (``--accelerator=cuda``): the parity and refusal tests build through tests/helpers,
so their model, data, accelerator and optimizer are on ``cuda:0``, with the same tolerance
(TF32 off, Note [no TF32 in the CUDA forms] in conftest.py: ours and torch's run the same
forward and backward kernels, and differ only by the optimizer's rounding). The error inputs
are torch's CPU tensors, made at collection: host only.

Tolerance: fp32 everywhere, as tests/test_offload_adamw_parity.py: a few ulp per step from
the kernel's evaluation order; 1e-5 absolute over 6 steps at lr 1e-3, scaled with the lr
(the spread of each step is proportional to the update).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

# torch's test utilities import expecttest, a test-only package a GPU machine may lack: skip
# this file there instead of aborting the collection of every file named with it.
pytest.importorskip("expecttest")

from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

from zero_offload import OffloadAdam, OffloadAdamW, OffloadConfig

from .helpers.models import batches, host_accelerator, make_pair, max_diff, train

OURS = {torch.optim.Adam: OffloadAdam, torch.optim.AdamW: OffloadAdamW}
INFOS = [info for info in optim_db if info.optim_cls in OURS]
REFUSED = ("capturable", "differentiable")  # refused whatever their value, when True
SWITCHES = [("foreach", True), ("foreach", False), ("fused", True), ("fused", False)]


def _configs(info: Any) -> list[Any]:
    """Every device type's configs, once each (by description)."""
    seen: dict[str, Any] = {}
    for device in ("cpu", "cuda", "mps"):
        for config in info.optim_inputs_func(device=device):
            seen.setdefault(config.desc, config)
    return list(seen.values())


def _refusal(kwargs: dict[str, Any]) -> str | None:
    for flag in REFUSED:
        if kwargs.get(flag):
            return f"{flag}=True is refused by design (tested in test_refused_configs_raise)"
    return None


def _parity_cases() -> list[Any]:
    cases = []
    for info in INFOS:
        name = info.optim_cls.__name__
        for config in _configs(info):
            reason = _refusal(config.kwargs)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            cases.append(
                pytest.param(info.optim_cls, config.kwargs, marks=marks, id=f"{name}-{config.desc}")
            )
            if reason:  # what remains of it without the refused flags must still train
                kept = {k: v for k, v in config.kwargs.items() if k not in REFUSED}
                cases.append(
                    pytest.param(info.optim_cls, kept, id=f"{name}-{config.desc}-without-refused")
                )
    return cases


def _refused_cases() -> list[Any]:
    cases = []
    for info in INFOS:
        name = info.optim_cls.__name__
        for config in _configs(info):
            if _refusal(config.kwargs):
                cases.append(
                    pytest.param(info.optim_cls, config.kwargs, id=f"{name}-{config.desc}")
                )
            for flag, value in SWITCHES:
                if flag in info.supported_impls:
                    cases.append(
                        pytest.param(
                            info.optim_cls,
                            {**config.kwargs, flag: value},
                            id=f"{name}-{config.desc}-{flag}={value}",
                        )
                    )
            if "differentiable" in info.supported_impls:
                cases.append(
                    pytest.param(
                        info.optim_cls,
                        {**config.kwargs, "differentiable": True},
                        id=f"{name}-{config.desc}-differentiable",
                    )
                )
    return cases


def _error_cases() -> list[Any]:
    cases = []
    for info in INFOS:
        name = info.optim_cls.__name__
        for error in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
            desc = error.optimizer_error_input.desc
            cases.append(pytest.param(info.optim_cls, error, id=f"{name}-{desc}"))
    return cases


def _copy_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Tensor hyper-parameters are stepped in place by schedulers: each side its own."""
    out = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            value = value.clone()
        elif isinstance(value, tuple):
            value = tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in value)
        out[key] = value
    return out


@pytest.mark.cuda_form  # everything through tests/helpers: on cuda:0 under --accelerator=cuda
@pytest.mark.parametrize(("torch_cls", "kwargs"), _parity_cases())
def test_config_trains_to_parity_with_torch(torch_cls: type, kwargs: dict[str, Any]) -> None:
    model, ref = make_pair(layers=1, dim=16, vocab=32)
    opt = OURS[torch_cls](
        model.parameters(),
        **_copy_kwargs(kwargs),
        config=OffloadConfig(bucket_bytes=4096, tile_elements=1024),
        accelerator=host_accelerator(),
    )
    ropt = torch_cls(ref.parameters(), **_copy_kwargs(kwargs))
    data = batches(6, vocab=32)
    ours = train(model, opt, data)
    theirs = train(ref, ropt, data)
    lr = float(kwargs.get("lr", 1e-3))
    assert max_diff(model, ref) < 1e-5 * max(1.0, lr / 1e-3)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4 * max(1.0, lr / 1e-3)
    opt.close()


@pytest.mark.cuda_form  # the model and the accelerator of tests/helpers: cuda:0 under cuda
@pytest.mark.parametrize(("torch_cls", "kwargs"), _refused_cases())
def test_refused_configs_raise(torch_cls: type, kwargs: dict[str, Any]) -> None:
    model, _ = make_pair(layers=1, dim=16, vocab=32)
    flag = next(
        k for k in ("capturable", "differentiable", "foreach", "fused") if kwargs.get(k) is not None
    )
    with pytest.raises(ValueError, match=flag):
        OURS[torch_cls](model.parameters(), **kwargs, accelerator=host_accelerator())


# What our message names for each of torch's error inputs (by its description); an input
# that a later torch adds is held to the type alone.
NAMED = {
    "invalid param type": "iterable of Tensors",
    "a param group cannot have duplicate parameters": "more than one parameter group",
    "duplicate parameters should not occur across param groups either": "more than one",
    "Tensor lr must be 1-element": "lr must have exactly 1 element",
    "all optimizer params should be with/without names": "has no name",
    "all optimizer param groups should be with/without names.": "parameter names",
    "beta1 should be between 0 and 1": r"betas\[0\] must be in \[0.0, 1.0\)",
    "weight_decay should > 0": "weight_decay must be >= 0.0",
    "lr as Tensor doesn't work with foreach & not capturable": "foreach",
    "betas must be either both floats or both Tensors": "both floats or both",
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True": "foreach",
}


@pytest.mark.parametrize(("torch_cls", "error"), _error_cases())
def test_error_inputs_raise_value_or_type_errors(torch_cls: type, error: Any) -> None:
    """torch warns on a duplicate parameter within a group (UserWarning); we refuse it
    (ValueError): its hooks would fire twice and its gradient be counted twice."""
    config = error.optimizer_error_input
    params = config.params
    if params is None:
        params = [torch.nn.Parameter(torch.randn(2, 3))]
    assert error.error_on in (
        OptimizerErrorEnum.CONSTRUCTION_ERROR,
        OptimizerErrorEnum.STEP_ERROR,
    )
    with pytest.raises((ValueError, TypeError), match=NAMED.get(config.desc)):
        opt = OURS[torch_cls](params, **config.kwargs, accelerator=host_accelerator())
        opt.step()
        opt.close()


def test_the_lists_are_not_empty() -> None:
    """A torch that renamed or dropped these entries must not leave this file testing
    nothing."""
    assert {info.optim_cls for info in INFOS} == set(OURS)
    assert len(_parity_cases()) >= 10 and len(_refused_cases()) >= 20
    assert len(_error_cases()) >= 20
    descs = {case.id.split("-", 1)[1] for case in _error_cases()}
    assert descs <= set(NAMED), descs - set(NAMED)
