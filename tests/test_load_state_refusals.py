"""A refused ``load_state_dict`` names the field and changes nothing (Note [a load checks
everything, then copies] in ``optim/checkpoint/state_dict.py``).

Each case takes a trained optimizer's own dict, changes every entry's values (so a partial
load would show), breaks one field of the last matrix's entry or of the dict itself, and
loads it. The
load must raise a ``ValueError``/``TypeError`` naming the field (and the parameter), leave
``state_dict()`` bitwise as it was, and the optimizer must then train bitwise as one that
never tried. Over AdamW (elementwise), Adafactor (shaped state) and Muon (shaped state and
an AdamW half).

Host only: the faults (meta, sparse and fake tensors) are about the dict, not the device.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from zero_offload import OffloadAdafactor, OffloadAdamW, OffloadConfig, OffloadMuon

from .helpers.models import host_accelerator, mlp, mlp_batches, mlp_loss

#: Buckets of 1 KiB: the (8, 16, 4) MLP spreads over several, so a load crosses buckets.
CONFIG = {"bucket_bytes": 1024, "tile_elements": 1024}
BUILDERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda m: OffloadAdamW(m.parameters(), lr=1e-2, config=OffloadConfig(**CONFIG),
                                    accelerator=host_accelerator()),
    "adafactor": lambda m: OffloadAdafactor(m.parameters(), lr=1e-2,
                                            config=OffloadConfig(**CONFIG),
                                            accelerator=host_accelerator()),
    "muon": lambda m: OffloadMuon(m.parameters(), lr=0.02, adamw_lr=3e-3,
                                  config=OffloadConfig(**CONFIG), accelerator=host_accelerator()),
}  # fmt: skip
DATA = mlp_batches(4, d_in=8, d_out=4)
BEFORE, AFTER = DATA[:2], DATA[2:]


def _model() -> nn.Module:
    return mlp(dims=(8, 16, 4))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, data: list) -> None:
    for x, y in data:
        mlp_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()


_REFERENCE: dict[str, list[torch.Tensor]] = {}


def _reference(rule: str) -> list[torch.Tensor]:
    """The weights after all of ``DATA`` with no load tried (once per rule)."""
    if rule not in _REFERENCE:
        model = _model()
        opt = BUILDERS[rule](model)
        _steps(model, opt, DATA)
        _REFERENCE[rule] = [p.detach().clone() for p in model.parameters()]
        opt.close()
    return _REFERENCE[rule]


def _assert_same(a: Any, b: Any, path: str = "state_dict") -> None:
    """Bitwise equal, recursively (tensors by value and dtype)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {a.keys() ^ b.keys()}"
        for key in a:
            _assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _changed(sd: dict[str, Any]) -> dict[str, Any]:
    """Every entry's tensors, lr and the skip count changed: what a partial load would take."""
    bad = copy.deepcopy(sd)
    for entry in bad["state"].values():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[name] = value * 0.5 + 0.25
    for group in bad["param_groups"]:
        group["lr"] = 0.123
    bad["zero_offload"]["skipped_steps"] = 7
    return bad


def _target(sd: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The entry to break and its index: the last matrix, whose state is shaped under
    Adafactor (``row_var``, ``col_var``) and Muon (``momentum_buffer``); the entries before
    it would be loaded already if the load copied as it checked."""
    index = max(k for k, entry in sd["state"].items() if entry["master"].dim() == 2)
    return index, sd["state"][index]


def _field(entry: dict[str, Any]) -> str:
    """The entry's first state field other than the master and the step."""
    return next(name for name in entry if name not in ("master", "step"))


def _put(name: str | None, make: Callable[[torch.Tensor], Any]) -> Callable[[dict], None]:
    """Replace the target's ``name`` (None: its first state field) with ``make(value)``."""

    def mutate(sd: dict[str, Any]) -> None:
        _, entry = _target(sd)
        field = name or _field(entry)
        entry[field] = make(entry[field])

    return mutate


def _fake(value: torch.Tensor) -> torch.Tensor:
    with FakeTensorMode():
        return torch.zeros(value.shape)


def _set(*keys: Any, value: Any) -> Callable[[dict], None]:
    """Set ``sd[keys[0]]...[keys[-1]] = value``."""

    def mutate(sd: dict[str, Any]) -> None:
        target = sd
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return mutate


def _drop_params(sd: dict[str, Any]) -> None:
    del sd["param_groups"][0]["params"]


def _twice(sd: dict[str, Any]) -> None:
    params = sd["param_groups"][0]["params"]
    params[-1] = params[0]


# (id, mutate, error, message): {p} is the target entry's index, {f} its first state field.
CASES = [
    ("field-on-meta", _put(None, lambda v: torch.zeros_like(v, device="meta")), ValueError,
     r"state of parameter {p}: '{f}' is on the meta device, which holds no values"),
    ("master-on-meta", _put("master", lambda v: torch.zeros_like(v, device="meta")),
     ValueError, r"state of parameter {p}: 'master' is on the meta device"),
    ("field-sparse", _put(None, lambda v: v.to_sparse()), TypeError,
     r"state of parameter {p}: '{f}' has layout torch.sparse_coo; .* pass value.to_dense\(\)"),
    ("field-fake", _put(None, _fake), TypeError,
     r"state of parameter {p}: '{f}' is a FakeTensor, a tensor subclass with its own dispatch"),
    ("step-nan", _put("step", lambda v: float("nan")), ValueError,
     r"state of parameter {p}: 'step' must be a whole number >= 0 .*got nan"),
    ("step-inf", _put("step", lambda v: float("inf")), ValueError,
     r"state of parameter {p}: 'step' must be a whole number >= 0 .*got inf"),
    ("step-tensor-nan", _put("step", lambda v: torch.tensor(float("nan"))), ValueError,
     r"state of parameter {p}: 'step' must be a whole number >= 0 .*got tensor\(nan\)"),
    ("step-2-elements", _put("step", lambda v: torch.tensor([1.0, 2.0])), ValueError,
     r"state of parameter {p}: 'step' must be .*got a tensor of shape \(2,\)"),
    ("step-past-int64", _put("step", lambda v: 1e30), ValueError,
     r"state of parameter {p}: 'step' 1e\+30 is past the largest step count kept"),
    ("step-str", _put("step", lambda v: "3"), TypeError,
     r"state of parameter {p}: 'step' must be a whole number >= 0 .*got str '3'"),
    ("entry-none", lambda sd: sd["state"].__setitem__(_target(sd)[0], None), TypeError,
     r"state of parameter {p} must be a dict \(field name -> value.*got NoneType None"),
    ("state-list", _set("state", value=[]), TypeError,
     r"state_dict\['state'\] must be a dict \(parameter id -> state\), got list \[\]"),
    ("zero-offload-list", _set("zero_offload", value=[]), TypeError,
     r"state_dict\['zero_offload'\] must be a dict .*got list \[\]"),
    ("group-without-params", _drop_params, ValueError,
     r"state_dict param group 0 has no 'params' .*the list of its parameter ids"),
    ("group-params-str", _set("param_groups", 0, "params", value="abcdef"), TypeError,
     r"state_dict param group 0: 'params' must be a list of parameter ids .*got str 'abcdef'"),
    ("group-params-twice", _twice, ValueError,
     r"state_dict param group 0: parameter id 0 appears twice"),
    ("group-value-uncopyable", _set("param_groups", 0, "note", value=threading.Lock()),
     TypeError, r"state_dict param group 0: a value cannot be copied"),
    ("skipped-str", _set("zero_offload", "skipped_steps", value="x"), TypeError,
     r"'skipped_steps' must be an int >= 0 \(the steps skipped for overflow\), got str 'x'"),
    ("skipped-negative", _set("zero_offload", "skipped_steps", value=-3), ValueError,
     r"'skipped_steps' must be an int >= 0 .*got -3"),
    ("skipped-bool", _set("zero_offload", "skipped_steps", value=True), TypeError,
     r"'skipped_steps' must be an int >= 0 .*got bool True"),
    ("pending-str", _set("zero_offload", "pending_update", value="no"), TypeError,
     r"'pending_update'\] must be a bool .*got 'no'"),
    ("written-int", _set("zero_offload", "written_since_step", value=5), TypeError,
     r"'written_since_step'\] must be a list of parameter ids .*got 5"),
    ("scaler-int", _set("zero_offload", "loss_scaler", value=7), TypeError,
     r"state_dict\['zero_offload'\]\['loss_scaler'\] must be a dict .*got int 7"),
]  # fmt: skip


@pytest.mark.parametrize("rule", list(BUILDERS))
@pytest.mark.parametrize(("mutate", "error", "message"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_a_refused_load_changes_nothing(
    rule: str, mutate: Callable[[dict], None], error: type[Exception], message: str
) -> None:
    model = _model()
    opt = BUILDERS[rule](model)
    _steps(model, opt, BEFORE)
    before = copy.deepcopy(opt.state_dict())
    bad = _changed(before)
    index, entry = _target(bad)
    match = message.format(p=index, f=_field(entry))
    mutate(bad)
    with pytest.raises(error, match=match):
        opt.load_state_dict(bad)
    _assert_same(opt.state_dict(), before)
    _steps(model, opt, AFTER)
    for mine, want in zip(model.parameters(), _reference(rule), strict=True):
        assert torch.equal(mine.detach(), want)
    opt.close()


@pytest.mark.parametrize("rule", list(BUILDERS))
def test_a_state_that_requires_grad_loads_by_value(rule: str) -> None:
    """As torch's ``Optimizer.load_state_dict`` takes it: the values, detached; the run
    continues bitwise as one loaded from the plain dict."""
    runs = []
    for grad in (False, True):
        model = _model()
        opt = BUILDERS[rule](model)
        _steps(model, opt, BEFORE)
        saved = copy.deepcopy(opt.state_dict())
        if grad:
            for entry in saved["state"].values():
                for name, value in entry.items():
                    if value.is_floating_point() and value.dim() > 0:
                        entry[name] = value.clone().requires_grad_()
        opt.load_state_dict(saved)
        assert not any(
            value.requires_grad for entry in opt.state_dict()["state"].values()
            for value in entry.values()
        )  # fmt: skip
        _steps(model, opt, AFTER)
        runs.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    for plain, with_grad, want in zip(*runs, _reference(rule), strict=True):
        assert torch.equal(plain, with_grad) and torch.equal(plain, want)
