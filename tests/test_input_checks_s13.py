"""Inputs that were silently wrong or failed with an unrelated error: the same optimizer
given twice to ``clip_grad_norm_``, numpy scalars as hyper-parameters, ``estimate()``'s
``seq_len`` beside a ``ModelShape``, a non-finite ``--params``, sparse gradients under any
rule, and the profiler's outputs before ``start()`` or into a folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import zero_offload
from zero_offload import cli
from zero_offload.estimate import ModelShape, estimate
from zero_offload.profiling import profile

from .helpers.device import run_accelerator
from .helpers.models import max_diff, mlp, mlp_batches, mlp_loss, mlp_opt


class _Wrapped:
    """A framework's wrapper (accelerate's prepared optimizer holds ours as ``.optimizer``)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer


def _backward(model: nn.Module, seed: int = 1) -> None:
    ((x, y),) = mlp_batches(1, seed=seed)
    mlp_loss(model, x, y).backward()


# -- clip_grad_norm_ over optimizers -----------------------------------------------------


@pytest.mark.parametrize("given", ["twice", "wrapped and raw", "one, not a list"])
def test_clip_grad_norm_counts_each_optimizer_once(given: str) -> None:
    ref_model, model = mlp(), mlp()
    ref_opt, opt = mlp_opt(ref_model), mlp_opt(model)
    _backward(ref_model)
    _backward(model)
    want = zero_offload.clip_grad_norm_([ref_opt], 0.01)
    ref_opt.step()
    args = {"twice": [opt, opt], "wrapped and raw": [_Wrapped(opt), opt], "one, not a list": opt}
    norm = zero_offload.clip_grad_norm_(args[given], 0.01)
    opt.step()
    assert float(norm) == float(want)  # not sqrt(2) times it
    assert max_diff(model, ref_model) == 0.0  # and clipped by the same coefficient
    with pytest.raises(TypeError, match="offload optimizers"):
        zero_offload.clip_grad_norm_(torch.optim.SGD(model.parameters(), lr=0.1), 1.0)
    for o in (ref_opt, opt):
        o.close()


# -- numpy scalars as hyper-parameters ---------------------------------------------------


def test_numpy_scalars_are_numbers_for_hyper_parameters_and_clipping() -> None:
    lr, eps, wd = np.float32(1e-2), np.float32(1e-8), np.float64(0.1)
    runs = []
    for values in ((lr, eps, wd), (float(lr), float(eps), float(wd))):
        model = mlp()
        opt = zero_offload.OffloadAdamW(
            model.parameters(),
            lr=values[0],
            eps=values[1],
            weight_decay=values[2],
            accelerator=run_accelerator(),
        )
        for x, y in mlp_batches(2):
            mlp_loss(model, x, y).backward()
            opt.clip_grad_norm_(np.float32(0.5) if values[0] is lr else 0.5)
            opt.step()
            opt.zero_grad()
        opt.close()
        runs.append(model)
    assert max_diff(*runs) == 0.0  # a numpy value steps as its float does


def test_a_scheduler_returning_numpy_floats_trains() -> None:
    model = mlp()
    opt = mlp_opt(model)
    warm = np.linspace(0.0, 1.0, 4, dtype=np.float32)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warm[min(s, 3)])
    for x, y in mlp_batches(3):
        mlp_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * float(warm[3]))
    opt.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": "1e-3"}, TypeError, "lr must be a real number .* got str '1e-3'"),
        ({"eps": None}, TypeError, "eps must be a real number .* got NoneType None"),
        ({"weight_decay": 1j}, TypeError, "weight_decay must be a real number"),
        ({"eps": np.float32("nan")}, ValueError, "eps must be a finite number"),
        ({"lr": np.float64(-1.0)}, ValueError, r"lr must be >= 0\.0"),
    ],
)
def test_wrong_types_are_type_errors_and_bad_values_value_errors(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        zero_offload.OffloadAdamW([nn.Parameter(torch.ones(3))], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("max_norm", "error"),
    [("1.0", TypeError), (None, TypeError), (True, TypeError), (np.float32(0), ValueError)],
)
def test_clip_max_norm_types_and_values(max_norm: object, error: type[Exception]) -> None:
    model = mlp()
    opt = mlp_opt(model)
    _backward(model)
    with pytest.raises(error, match="max_norm must be a number > 0"):
        opt.clip_grad_norm_(max_norm)  # type: ignore[arg-type]
    opt.close()


# -- estimate(ModelShape, seq_len=...) ---------------------------------------------------


def test_estimate_refuses_seq_len_it_would_ignore_for_a_shape() -> None:
    shape = ModelShape(layers=2, hidden=64, heads=4, vocab=100, seq_len=16)
    memory = {"host_memory": "64GiB"}  # no device_memory: no search for the largest fit
    with pytest.raises(ValueError, match=r"dataclasses\.replace\(shape, seq_len=4096, micro_"):
        estimate(shape, seq_len=4096, micro_batch=8, **memory)
    with pytest.raises(ValueError, match=r"micro_batch=8\)"):
        estimate(shape, micro_batch=8, **memory)
    # the defaults and the shape's own values are not in conflict
    assert repr(estimate(shape, seq_len=16, **memory)) == repr(estimate(shape, **memory))
    longer = estimate(dataclasses.replace(shape, seq_len=4096, micro_batch=8), **memory)
    assert (longer.shape.seq_len, longer.shape.micro_batch) == (4096, 8)


# -- zero-offload estimate --params ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("inf", "--params='inf' is not a finite parameter count"),
        ("1e400", "--params='1e400' is outside [1, 1e15] parameters"),
        ("1e300B", "--params='1e300B' is outside [1, 1e15] parameters"),
        ("nan", "--params='nan' is not a finite parameter count"),
        ("-1", "--params='-1' is outside [1, 1e15] parameters"),
        ("0", "--params='0' is outside [1, 1e15] parameters"),
    ],
)
def test_params_that_are_no_count_exit_2_with_one_line(
    value: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["estimate", f"--params={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "argument --params" in err and needle in err, err


# -- sparse gradients --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["OffloadLion", "OffloadAdagrad"])
def test_sparse_gradient_refusal_names_no_other_optimizer(name: str) -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = getattr(zero_offload, name)(emb.parameters(), accelerator=run_accelerator())
    with pytest.raises(ValueError, match="sparse gradient") as err:
        emb(torch.tensor([1, 2])).sum().backward()
    assert "OffloadAdamW" not in str(err.value)
    assert opt._router.owner in str(err.value)
    opt.close()


def test_a_sparse_grad_set_by_hand_is_refused_before_any_is_taken() -> None:
    model, ref = mlp(), mlp()
    opt, ref_opt = mlp_opt(model), mlp_opt(ref)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
    for p, r, g in zip(model.parameters(), ref.parameters(), grads, strict=True):
        p.grad, r.grad = g.clone(), g.clone()
    params = list(model.parameters())
    params[2].grad = params[2].grad.to_sparse()  # a middle one: dense ones on both sides
    given = [p.grad for p in params]
    with pytest.raises(ValueError, match=r"parameter 2 \(shape \(32, 32\)\) has a sparse grad"):
        opt.step()
    assert all(p.grad is g for p, g in zip(params, given, strict=True))  # nothing was taken
    params[2].grad = params[2].grad.to_dense()
    opt.step()
    ref_opt.step()
    assert max_diff(model, ref) == 0.0
    for o in (opt, ref_opt):
        o.close()


# -- the profiler's outputs --------------------------------------------------------------


def test_profiler_outputs_before_start_and_into_a_folder(tmp_path: Path) -> None:
    model = mlp()
    opt = mlp_opt(model)
    prof = profile(opt, link_bandwidth=1e9)
    for output in (prof.report, prof.to_dict, prof.to_json):
        with pytest.raises(RuntimeError, match=r"recorded nothing yet: call start\(\)"):
            output()
    assert "nothing recorded yet" in str(prof)
    with prof:
        _backward(model)
        opt.step()
        prof.step()
    for method, name in (("export_chrome_trace", "trace.json"), ("to_json", "profile.json")):
        with pytest.raises(ValueError, match=f"{method}: path=.* is a directory.*{name}"):
            getattr(prof, method)(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no temp file left beside it either
    assert prof.export_chrome_trace(tmp_path / "t.json").is_file()
    opt.close()
