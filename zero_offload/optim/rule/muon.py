"""Muon as a rule: ``torch.optim.Muon`` for every 2-D parameter, ``torch.optim.AdamW`` for
every other one, in one optimizer (Note [Muon routes by shape]).

Not elementwise: Newton–Schulz orthogonalizes a matrix's whole update (Note [rules that
read a whole parameter] in ``base.py``). State: the fp32 master per element; per
parameter, shaped like it and fp32, ``momentum_buffer`` for a matrix (torch's Muon's name)
and ``exp_avg``/``exp_avg_sq`` for the rest (torch's AdamW's). Host bytes per parameter:
8 for a matrix (master, buffer), 12 for the rest (master, two moments).
``OffloadConfig.moments_dtype`` does not apply: the shaped state is fp32. On the host a
matrix steps through ``kernels.muon_step`` (two numba passes around torch's bf16
Newton–Schulz, on the CPU or on the GPU: Note [Muon's host passes], Note [Newton-Schulz
where the matmuls are fast]), the rest through ``kernels.adam_step``. State resident on the
device steps there (Note [whole parameters stepped on the device] in
``state/whole_resident.py``): a matrix through ``kernels.muon.muon_step_torch`` (torch's
operations, bitwise the host's passes), the rest through torch's fused AdamW as
``OffloadAdamW``'s resident buckets are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...kernels import adam_step, muon_step
from ...kernels.muon import muon_step_torch
from .adamw import ADAMW, AdamHyper
from .base import ParamField, StateField, StateFields, WholeParameterRule
from .values import check_flag, check_number, check_number_or_scalar_tensor

__all__ = ["ADJUST_LR_FNS", "MUON", "MuonHyper", "MuonRule", "adamw_rate"]

# Note [Muon routes by shape]
# torch.optim.Muon takes 2-D parameters only and its documentation sends the rest (biases,
# norms) to AdamW. One OffloadMuon holds both, and a parameter's shape alone decides: two
# dims, Muon; any other, AdamW with the group's ``adamw_*`` hyper-parameters. The shape and
# not a group flag, because the shaped state is declared per shape (``param_state``) and
# sized before any group is read; a group flag that could disagree with the shape would be
# a second source of truth. A 2-D parameter meant for AdamW (an embedding, an output head,
# as Keller Jordan's recipe trains them) goes to its own OffloadAdamW; a group that says
# ``use_muon`` (that recipe's flag) is refused with this advice, not silently ignored.

# Note [the AdamW half follows lr's schedule]
# torch's recipe is two optimizers, a Muon and an AdamW, each under the same schedule: a
# scheduler (LambdaLR, every HF Trainer and Lightning schedule, OneCycleLR, StepLR...)
# writes each optimizer's ``lr``, as a factor of where it started. One OffloadMuon group
# has one ``lr``, Muon's, which a scheduler writes, and AdamW's rate in ``adamw_lr``, which
# no scheduler knows: left alone, the biases and norms trained at a constant rate through
# a warmup from zero and a decay to zero. So each group records, when it is made, the
# ``lr`` its ``adamw_lr`` goes with (``adamw_lr_reference``), and its AdamW half steps at
# ``adamw_lr * lr / adamw_lr_reference``: the factor the schedule applies to Muon's rate,
# applied to AdamW's. At the constructed ``lr`` that is ``adamw_lr`` itself (a factor of
# exactly 1). A hand-set ``lr`` moves both halves alike; ``adamw_lr`` set by hand is the
# rate at the reference ``lr``. Where the reference is 0 (a group made with ``lr=0``) no
# factor can be taken: the AdamW half steps at ``adamw_lr``. A schedule that is not a factor
# (CosineAnnealingLR's ``eta_min``, CyclicLR's ``base_lr``) is scaled too, not copied: the
# AdamW half's floor is ``adamw_lr * eta_min / lr``. A checkpoint saved before the key
# existed loads over the group the optimizer made, so its groups keep the reference they
# were made with (the constructor's ``lr``); a group with no reference at all (a hand-made
# dict) steps at ``adamw_lr``.

#: torch's ``adjust_lr_fn`` values.
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


@dataclass(frozen=True)
class MuonHyper:
    """One param group's hyper-parameters for a step: Muon's for its matrices, AdamW's
    (``adamw_*``) for its other parameters."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    eps: float
    ns_steps: int
    adjust_lr_fn: str | None
    adamw_lr: float
    adamw_beta1: float
    adamw_beta2: float
    adamw_eps: float
    adamw_weight_decay: float
    #: Where Newton-Schulz runs (Note [Newton-Schulz where the matmuls are fast] in
    #: ``kernels/muon.py``): the GPU on CUDA (``OffloadMuon`` sets it), else the host CPU.
    ns_device: torch.device | None = None


def is_muon_shape(shape: tuple[int, ...]) -> bool:
    """Whether a parameter of ``shape`` steps by Muon (Note [Muon routes by shape])."""
    return len(shape) == 2


class MuonRule(WholeParameterRule):
    """Muon for matrices, AdamW for the rest, as torch's two optimizers step them."""

    name = "muon"
    reads_whole = "Newton-Schulz orthogonalizes each matrix's whole update"

    def __repr__(self) -> str:
        return "MuonRule()"

    def hyper(self, group: Mapping[str, Any]) -> MuonHyper:
        beta1, beta2 = group["adamw_betas"]
        a, b, c = group["ns_coefficients"]
        lr = float(group["lr"])
        return MuonHyper(
            lr=lr,
            weight_decay=float(group["weight_decay"]),
            momentum=float(group["momentum"]),
            nesterov=bool(group["nesterov"]),
            ns_coefficients=(float(a), float(b), float(c)),
            eps=float(group["eps"]),
            ns_steps=int(group["ns_steps"]),
            adjust_lr_fn=group["adjust_lr_fn"],
            adamw_lr=adamw_rate(group, lr),
            adamw_beta1=float(beta1),
            adamw_beta2=float(beta2),
            adamw_eps=float(group["adamw_eps"]),
            adamw_weight_decay=float(group["adamw_weight_decay"]),
        )

    def missing_step(self, where: str) -> str:
        """torch's Muon keeps no count, and Muon's update of a matrix does not read it
        (Note [a loaded entry needs its step] in checkpoint/state_dict.py)."""
        return (
            f"{where}: missing ['step'], the parameter's step count, which every state "
            "OffloadMuon loads must hold. torch.optim.Muon's state dicts keep none (only "
            "'momentum_buffer'): to load one, give each entry a count first, e.g. `for s in "
            "sd['state'].values(): s.setdefault('step', torch.tensor(1.0))` (OffloadMuon's "
            "update of a matrix does not read it; docs/checkpoints.md). Nothing was loaded"
        )

    def check_group(self, group: Mapping[str, Any], *, where: str) -> None:
        """As torch's Muon checks them (``lr``, ``momentum``, ``weight_decay`` >= 0,
        ``adjust_lr_fn``), and beyond (``ns_steps`` an int in [1, 100), which torch checks
        at its first step; ``ns_coefficients`` three numbers; ``eps`` >= 0; ``nesterov`` a
        bool); ``adamw_*`` as torch's AdamW checks its own. A ``use_muon`` key is refused
        (Note [Muon routes by shape])."""
        if "use_muon" in group:
            raise ValueError(
                f"{where}: use_muon={group['use_muon']!r} is not an OffloadMuon option: a "
                "parameter's shape decides (2-D: Muon; any other: AdamW with the adamw_* "
                "hyper-parameters). Give a 2-D parameter that should train with AdamW (an "
                "embedding, an output head) to a separate OffloadAdamW, and drop use_muon"
            )
        check_number_or_scalar_tensor(where, "lr", group["lr"], low=0.0)
        check_number(where, "weight_decay", group["weight_decay"], low=0.0)
        check_number(where, "momentum", group["momentum"], low=0.0)
        check_flag(where, "nesterov", group["nesterov"])
        coefficients = group["ns_coefficients"]
        if not (isinstance(coefficients, (tuple, list)) and len(coefficients) == 3):
            raise ValueError(
                f"{where}: ns_coefficients must be three floats (a, b, c), got {coefficients!r}"
            )
        for i, value in enumerate(coefficients):
            check_number(where, f"ns_coefficients[{i}]", value, low=-float("inf"))
        check_number(where, "eps", group["eps"], low=0.0)
        ns_steps = group["ns_steps"]
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 < ns_steps < 100:
            raise ValueError(f"{where}: ns_steps must be an int in [1, 100), got {ns_steps!r}")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(
                f"{where}: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got "
                f"{group['adjust_lr_fn']!r}"
            )
        check_number(where, "adamw_lr", group["adamw_lr"], low=0.0)
        if "adamw_lr_reference" in group:
            check_number(where, "adamw_lr_reference", group["adamw_lr_reference"], low=0.0)
        check_number(where, "adamw_eps", group["adamw_eps"], low=0.0)
        check_number(where, "adamw_weight_decay", group["adamw_weight_decay"], low=0.0)
        betas = group["adamw_betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{where}: adamw_betas must be a pair (beta1, beta2), got {betas!r}")
        check_number(where, "adamw_betas[0]", betas[0], low=0.0, high=1.0)
        check_number(where, "adamw_betas[1]", betas[1], low=0.0, high=1.0)

    def complete_group(self, group: dict[str, Any]) -> None:
        """The ``lr`` this group's ``adamw_lr`` goes with: its own, unless it names one
        (Note [the AdamW half follows lr's schedule])."""
        group.setdefault("adamw_lr_reference", float(group["lr"]))

    def state_fields(
        self, moments_dtype: torch.dtype, groups: Sequence[Mapping[str, Any]]
    ) -> StateFields:
        """The fp32 master per element; the rest is shaped (``param_state``)."""
        return StateFields((StateField("master", torch.float32),), param_state=self.param_state)

    def param_state(self, shape: tuple[int, ...]) -> tuple[ParamField, ...]:
        if is_muon_shape(shape):
            return (ParamField("momentum_buffer", tuple(shape)),)
        return (ParamField("exp_avg", tuple(shape)), ParamField("exp_avg_sq", tuple(shape)))

    def parameter_step(
        self,
        fields: Mapping[str, torch.Tensor],
        param_state: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        shape: tuple[int, ...],
        step: int,
        hyper: MuonHyper,
        grad_scale: float,
        out: torch.Tensor | None,
    ) -> None:
        """Muon for a matrix, AdamW for any other shape (Note [Muon routes by shape])."""
        master = fields["master"]
        if is_muon_shape(shape):
            muon_step(
                master,
                grad,
                param_state["momentum_buffer"].reshape(-1),
                **_muon_arguments(shape, hyper, grad_scale),
                out=out,
                ns_device=hyper.ns_device,
            )
            return
        adam_step(
            master,
            grad,
            param_state["exp_avg"].reshape(-1),
            param_state["exp_avg_sq"].reshape(-1),
            step=step,
            lr=hyper.adamw_lr,
            beta1=hyper.adamw_beta1,
            beta2=hyper.adamw_beta2,
            eps=hyper.adamw_eps,
            weight_decay=hyper.adamw_weight_decay,
            grad_scale=grad_scale,
            out=out,
        )

    def device_parameter_step(
        self,
        fields: Mapping[str, torch.Tensor],
        param_state: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        shape: tuple[int, ...],
        step: int,
        hyper: MuonHyper,
        grad_scale: float,
        step_tensor: torch.Tensor,
    ) -> None:
        """On the device: Muon for a matrix (Newton-Schulz there too), torch's fused AdamW
        for any other shape, as ``OffloadAdamW``'s resident buckets step it."""
        if is_muon_shape(shape):
            # torch's operations on the device's tensors, Newton-Schulz where they are
            # (Note [Muon as torch steps it]): bitwise the host's two passes.
            muon_step_torch(
                fields["master"],
                grad,
                param_state["momentum_buffer"].reshape(-1),
                **_muon_arguments(shape, hyper, grad_scale),
            )
            return
        ADAMW.device_tile_step(
            {
                "master": fields["master"],
                "exp_avg": param_state["exp_avg"].reshape(-1),
                "exp_avg_sq": param_state["exp_avg_sq"].reshape(-1),
            },
            grad,
            step=step,
            hyper=_adamw_hyper(hyper),
            grad_scale=grad_scale,
            step_tensor=step_tensor,
        )

    def device_parameter_temporary_bytes(
        self, shape: tuple[int, ...], hyper: MuonHyper, grad_scale: float
    ) -> int:
        """A matrix of ``n`` elements, at most: the scaled gradient (``4n``, when scaled),
        the Nesterov update (``4n``), two bf16 iterates of Newton-Schulz (``4n``), an fp32
        copy of the last where adding it into the fp32 master casts it (``4n``), and the
        Gram matrix with its update, ``k x k`` bf16 each (``k`` the shorter side). Any other
        shape: AdamW's (``ADAMW.device_temporary_bytes``)."""
        n = math.prod(shape)
        if not is_muon_shape(shape):
            return ADAMW.device_temporary_bytes(_adamw_hyper(hyper), grad_scale, n)
        k = min(shape)
        scaled = 4 * n if grad_scale != 1.0 else 0
        nesterov = 4 * n if hyper.nesterov else 0
        return scaled + nesterov + 8 * n + 4 * k * k


def _adamw_hyper(hyper: MuonHyper) -> AdamHyper:
    """The ``adamw_*`` hyper-parameters as AdamW's rule takes them (torch's AdamW defaults
    for the switches Muon's group does not have)."""
    return AdamHyper(
        lr=hyper.adamw_lr,
        beta1=hyper.adamw_beta1,
        beta2=hyper.adamw_beta2,
        eps=hyper.adamw_eps,
        weight_decay=hyper.adamw_weight_decay,
        amsgrad=False,
        maximize=False,
    )


#: ``torch.optim.Muon``'s rule with AdamW beside it (``OffloadMuon``).
MUON = MuonRule()


def adamw_rate(group: Mapping[str, Any], lr: float) -> float:
    """The rate the group's AdamW half steps at, given its current ``lr``: ``adamw_lr``
    scaled as ``lr`` is from ``adamw_lr_reference`` (Note [the AdamW half follows lr's
    schedule])."""
    adamw_lr = float(group["adamw_lr"])
    reference = float(group.get("adamw_lr_reference", lr))
    if reference <= 0.0 or lr == reference:
        return adamw_lr
    return adamw_lr * (lr / reference)


def _muon_arguments(shape: tuple[int, ...], hyper: MuonHyper, grad_scale: float) -> dict[str, Any]:
    """A matrix's step arguments from its group's hyper-parameters (``muon_step`` and
    ``muon_step_torch`` take the same)."""
    return {
        "shape": tuple(shape),
        "lr": hyper.lr,
        "weight_decay": hyper.weight_decay,
        "momentum": hyper.momentum,
        "nesterov": hyper.nesterov,
        "ns_coefficients": hyper.ns_coefficients,
        "ns_steps": hyper.ns_steps,
        "eps": hyper.eps,
        "adjust_lr_fn": hyper.adjust_lr_fn,
        "grad_scale": grad_scale,
    }
