"""The optimizer-rule seam (``zero_offload/optim/rule/``, Note [the rule is the only place
that knows the optimizer]).

1. Below the facades no code names Adam's state or hyper-parameters: a grep.
2. A new elementwise optimizer is one rule, one kernel and a thin facade: SGD with momentum,
   written here in a few lines of torch (its "kernel"), plugged into ``OffloadOptimizer``,
   matches ``torch.optim.SGD`` with its state offloaded, resident on the device and on NVMe,
   and round-trips its state dict by the rule's field names.
3. Every planner sizes the state the rule declares: Adam's max moment (amsgrad) costs one
   field more in the host pool, the NVMe record and the estimator.

Tolerance: fp32; SGD's update is one multiply-add per element, evaluated in torch's order.

CUDA form (``cuda_form``): the SGD rule's training, resume and refusal tests build through
tests/helpers (``cuda:0`` under ``--accelerator=cuda``, the half-resident case then running the
rule's device step on the GPU); the greps and the planners' sizes are host only.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig, OffloadOptimizer
from zero_offload.memory.align import aligned
from zero_offload.optim.rule import ADAMW, OptimizerRule, StateField, StateFields
from zero_offload.optim.rule.values import check_number
from zero_offload.optim.state.placement import POOL_ALIGNMENT

from .helpers.models import batches, host_accelerator, make_pair, max_diff, train

ROOT = pathlib.Path(__file__).resolve().parents[1] / "zero_offload"

#: The names only the Adam rule, its kernel and its facade may use.
ADAM_NAMES = re.compile(r"\b(exp_avg\w*|max_exp_avg_sq|amsgrad|AdamHyper)\b")
#: Where they may appear: the rules, the kernels, and the facade's torch-style signature
#: (its argument and the defaults it fills, one line each).
ALLOWED_DIRS = ("optim/rule/", "kernels/")
FACADE = "optim/offload_adamw.py"
FACADE_LINES = 2


def test_no_code_outside_the_rule_names_adam_state() -> None:
    offending: list[str] = []
    facade_hits = 0
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ALLOWED_DIRS):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not ADAM_NAMES.search(line):
                continue
            if rel == FACADE and "amsgrad" in line and "exp_avg" not in line:
                facade_hits += 1
                continue
            offending.append(f"{rel}:{number}: {line.strip()}")
    assert not offending, "ask the rule instead:\n" + "\n".join(offending)
    assert facade_hits <= FACADE_LINES, f"the facade names amsgrad on {facade_hits} lines"


def test_the_grep_sees_a_planner_that_hard_codes_adam(tmp_path: pathlib.Path) -> None:
    """The pattern catches the forms the seam replaced (so the test above can fail)."""
    for line in (
        "names = ['master', 'exp_avg', 'exp_avg_sq']",
        "total += (3 if amsgrad else 2) * moment",
        "def update(self, hyper: AdamHyper) -> None:",
    ):
        assert ADAM_NAMES.search(line), line


# -- a second rule: SGD with momentum -----------------------------------------------------


@dataclass(frozen=True)
class SgdHyper:
    lr: float
    momentum: float
    weight_decay: float


def _sgd_tile(master: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, h: SgdHyper) -> None:
    """The rule's kernel: torch.optim.SGD's single-tensor update (no dampening, no
    nesterov), in torch's order, in place."""
    if h.weight_decay != 0:
        grad = grad.add(master, alpha=h.weight_decay)
    buf.mul_(h.momentum).add_(grad)
    master.add_(buf, alpha=-h.lr)


class SgdRule(OptimizerRule):
    """Momentum SGD as a rule: one field beside the master."""

    name = "sgd-test"
    elementwise = True

    def hyper(self, group: Mapping[str, Any]) -> SgdHyper:
        return SgdHyper(float(group["lr"]), float(group["momentum"]), float(group["weight_decay"]))

    def check_group(self, group: Mapping[str, Any], *, where: str) -> None:
        check_number(where, "lr", group["lr"], low=0.0)
        check_number(where, "momentum", group["momentum"], low=0.0, high=1.0)
        check_number(where, "weight_decay", group["weight_decay"], low=0.0)

    def state_fields(
        self, moments_dtype: torch.dtype, groups: Sequence[Mapping[str, Any]]
    ) -> StateFields:
        master = StateField("master", torch.float32)
        return StateFields((master, StateField("momentum_buffer", moments_dtype)))

    def checkpoint_fields(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",)

    def tile_step(self, fields, grad, *, step, hyper, grad_scale, out) -> None:
        grad = grad.float() * grad_scale
        _sgd_tile(fields["master"], grad, fields["momentum_buffer"], hyper)
        if out is not None:
            out.copy_(fields["master"])

    def device_tile_step(self, fields, grad, *, step, hyper, grad_scale, step_tensor) -> None:
        _sgd_tile(fields["master"], grad * grad_scale, fields["momentum_buffer"], hyper)


class OffloadSgd(OffloadOptimizer):
    """The thin facade: a torch-style constructor, nothing else."""

    rule = SgdRule()

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        **offload: Any,
    ) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        super().__init__(params, defaults, **offload)


def _sgd(model: torch.nn.Module, **config: Any) -> OffloadSgd:
    cfg = OffloadConfig(bucket_bytes=8192, tile_elements=1024, **config)
    return OffloadSgd(
        model.parameters(),
        lr=0.05,
        momentum=0.9,
        weight_decay=0.01,
        config=cfg,
        accelerator=host_accelerator(),
    )


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    "where",
    [
        pytest.param({}, id="host"),
        pytest.param({"offload_fraction": 0.5}, id="half-resident"),
        pytest.param({"nvme": True}, id="nvme"),
    ],
)
def test_a_new_rule_matches_torch_sgd(where: dict[str, Any], tmp_path: pathlib.Path) -> None:
    config = dict(where)
    if config.pop("nvme", False):
        config.update(nvme_dir=str(tmp_path), host_budget=1)
    model, ref = make_pair()
    opt = _sgd(model, **config)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    data = batches(6)
    train(model, opt, data)
    train(ref, ropt, data)
    assert max_diff(model, ref) < 1e-6
    on_nvme = "nvme_dir" in config  # opt.state cannot hand out NVMe state as tensors
    for p, rp in zip(model.parameters(), ref.parameters(), strict=not on_nvme):
        if on_nvme:
            break
        ours = opt.state[p]["momentum_buffer"]
        assert torch.allclose(ours.reshape(rp.shape), ropt.state[rp]["momentum_buffer"], atol=1e-6)
    places = {b.store.location for b in opt.buckets}
    assert places == (
        {"nvme"}
        if "nvme_dir" in config
        else {"host", "device"}
        if "offload_fraction" in config
        else {"host"}
    )
    opt.close()


@pytest.mark.cuda_form
def test_a_new_rule_resumes_bitwise_from_its_state_dict() -> None:
    data = batches(8)
    model, twin = make_pair()
    opt = _sgd(model)
    train(model, opt, data[:4])
    saved = opt.state_dict()
    assert set(next(iter(saved["state"].values()))) == {"master", "momentum_buffer", "step"}
    twin.load_state_dict(model.state_dict())
    opt2 = _sgd(twin)
    opt2.load_state_dict(saved)
    train(model, opt, data[4:])
    train(twin, opt2, data[4:])
    assert max_diff(model, twin) == 0.0
    bad = {**saved, "state": {k: {"step": v["step"]} for k, v in saved["state"].items()}}
    with pytest.raises(ValueError, match=r"missing \['momentum_buffer'\]"):
        opt2.load_state_dict(bad)
    opt.close()
    opt2.close()


@pytest.mark.cuda_form
def test_a_new_rule_checks_its_own_hyper_parameters() -> None:
    model, _ = make_pair()
    with pytest.raises(ValueError, match=r"OffloadSgd: momentum must be in \[0.0, 1.0\), got 1.5"):
        OffloadSgd(model.parameters(), momentum=1.5, accelerator=host_accelerator())


# -- the planners size what the rule declares ---------------------------------------------


def test_the_host_pool_holds_exactly_the_rule_fields() -> None:
    """Measured from the pools: per bucket of shard ``k`` (fp32 training dtype, so no weight
    staging) the host pool holds the rule's fields, ``sum a(4k)`` over them, and the
    gradient staging ``a(4k)``. So AdamW with amsgrad holds one ``a(4k)`` per bucket more
    than AdamW, and SGD (one field beside the master) one less; the state bytes the report
    counts are the fields' bytes per real parameter: 16, 12 and 8."""
    config = OffloadConfig(bucket_bytes=8192)
    builds = {
        "adamw": lambda m: OffloadAdamW(
            m.parameters(), config=config, accelerator=host_accelerator()
        ),
        "amsgrad": lambda m: OffloadAdamW(
            m.parameters(), amsgrad=True, config=config, accelerator=host_accelerator()
        ),
        "sgd": lambda m: OffloadSgd(m.parameters(), config=config, accelerator=host_accelerator()),
    }
    pools, state, fields = {}, {}, {}
    for name, build in builds.items():
        model, _ = make_pair()
        opt = build(model)
        report = opt.placement
        pools[name] = report.pinned + report.pageable
        state[name] = (report.host, report.parameters)
        fields[name] = {b.store.fields for b in opt.buckets}
        one_field = sum(aligned(4 * b.layout.shard_numel, POOL_ALIGNMENT) for b in opt.buckets)
        opt.close()
    assert fields["adamw"] == {ADAMW.state_fields(torch.float32, ())}
    assert pools["amsgrad"] - pools["adamw"] == one_field
    assert pools["adamw"] - pools["sgd"] == one_field
    for name, per_param in {"amsgrad": 16, "adamw": 12, "sgd": 8}.items():
        host, params = state[name]
        assert host == per_param * params, name


def test_the_nvme_record_and_the_estimator_ask_the_rule() -> None:
    from zero_offload.estimate.pools import rule_state
    from zero_offload.estimate.rows import Context
    from zero_offload.optim.state.nvme_plan import RecordLayout

    adam = ADAMW.state_fields(torch.bfloat16, [{"amsgrad": True}])
    record = RecordLayout.make(4096, adam)
    assert [name for name, _, _ in record.fields] == list(adam.names)
    assert record.record_bytes == 4096 * (4 + 3 * 2)  # each field 4 KiB-aligned already
    sgd = SgdRule().state_fields(torch.float32, ())
    assert RecordLayout.make(4096, sgd).record_bytes == 4096 * 8
    assert rule_state("adamw").bytes_per_element == 12
    assert Context(itemsize=2, world_size=1, ranks_per_node=1, bucket_bytes=1).state_bytes == 12
    assert Context(itemsize=4, world_size=1, ranks_per_node=1, bucket_bytes=1).state_bytes == 8
    assert rule_state("lion").bytes_per_element == 8
    with pytest.raises(ValueError, match="unknown optimizer rule 'sgd'"):
        rule_state("sgd")
