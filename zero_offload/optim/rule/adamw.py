"""Adam and AdamW as a rule: ``torch.optim.AdamW`` (decoupled decay) and ``torch.optim.Adam``
(L2 decay, or decoupled where its group says ``decoupled_weight_decay``), with amsgrad and
maximize.

State per element: the fp32 master, ``exp_avg`` and ``exp_avg_sq`` (fp32, or bf16 with
``OffloadConfig(moments_dtype="bfloat16")``), and ``max_exp_avg_sq`` when a group of the
bucket asks for amsgrad. On the host the step is the ``adam_step`` kernel, one pass per tile;
on the device, torch's fused AdamW. Elementwise: tile and shard boundaries change no bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adamw import adamw as torch_adamw

from ...kernels import adam_step
from .base import OptimizerRule, StateField, StateFields
from .values import check_flag, check_number, check_number_or_scalar_tensor

__all__ = ["ADAM", "ADAMW", "AdamHyper", "AdamRule"]

#: The group key torch's ``Adam`` reads at each step (Note [the decay's form is the group's]).
_DECOUPLED = "decoupled_weight_decay"

# Note [the decay's form is the group's]
# torch.optim.AdamW is torch.optim.Adam with ``decoupled_weight_decay=True`` in its
# defaults, and both step each group with the group's own key, read at every step. Here:
# - ``hyper`` reads the key, so each group steps with its own form (the kernel takes it per
#   launch); a value set by hand in ``param_groups`` is stepped with, by Adam and AdamW
#   alike, as torch's are. A group without the key steps with the rule's default.
# - AdamW's groups hold True (``complete_group``), made so on every new group and every
#   group loaded by ``load_state_dict`` (``checkpoint/state_dict.py`` completes a loaded
#   group as a new one): torch's ``AdamW.__setstate__`` makes every loaded group True, so
#   AdamW loading Adam's state stays AdamW. torch's ``add_param_group`` would keep a False
#   that a new group names; here it is made True: a group that wants Adam's L2 term
#   belongs to ``OffloadAdam``.
# - Adam's groups hold the key as torch's do: the constructor's ``decoupled_weight_decay``
#   (False by default) in its defaults, a loaded state's, or one set by hand; absent (an
#   old state), it is False, as torch's ``Adam.__setstate__`` fills it in. So Adam
#   loading AdamW's state (which holds True) steps AdamW's decay from then on, as torch's
#   Adam does, and AdamW loading Adam's (False) stays AdamW by either path:
#   ``load_streaming`` completes the groups it loads like ``load_state_dict``.


@dataclass(frozen=True)
class AdamHyper:
    """One param group's hyper-parameters for a step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool
    #: True: AdamW's decoupled decay (``param *= 1 - lr * wd``); False: Adam's L2 term.
    decoupled: bool = True


class AdamRule(OptimizerRule):
    """Adam(W): ``decoupled`` True for AdamW, whose groups are made decoupled, new or
    loaded; False for Adam, whose groups step the L2 term unless they say otherwise. Each
    group steps with its own ``decoupled_weight_decay`` (Note [the decay's form is the
    group's])."""

    elementwise = True
    takes_written = True

    def __init__(self, *, decoupled: bool) -> None:
        self.decoupled = decoupled
        self.name = "adamw" if decoupled else "adam"  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"AdamRule(decoupled={self.decoupled})"

    @property
    def state_family(self) -> str:
        return "adam"  # the decay's form changes the step, not what the moments mean

    def hyper(self, group: Mapping[str, Any]) -> AdamHyper:
        beta1, beta2 = group["betas"]
        return AdamHyper(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            # Note [the decay's form is the group's]
            decoupled=bool(group.get(_DECOUPLED, self.decoupled)),
        )

    def check_group(self, group: Mapping[str, Any], *, where: str) -> None:
        """As torch checks them. ``lr`` and ``betas`` may be 1-element tensors, as torch
        allows. The constructor's arguments (a group without ``params``: the defaults) must
        have both betas floats or both tensors, as torch's constructor requires; a param
        group may mix them, as torch's step takes them (``OneCycleLR`` and ``CyclicLR``
        with ``cycle_momentum`` write a float ``beta1`` beside a tensor ``beta2``)."""
        check_number_or_scalar_tensor(where, "lr", group["lr"], low=0.0)
        check_number(where, "eps", group["eps"], low=0.0)
        check_number(where, "weight_decay", group["weight_decay"], low=0.0)
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
        mixed = isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor)
        if mixed and "params" not in group:
            raise ValueError(
                f"{where}: betas must be both floats or both 1-element tensors (as torch's "
                f"constructor requires), got {betas!r}"
            )
        check_number_or_scalar_tensor(where, "betas[0]", betas[0], low=0.0, high=1.0)
        check_number_or_scalar_tensor(where, "betas[1]", betas[1], low=0.0, high=1.0)
        for flag in ("amsgrad", "maximize"):
            check_flag(where, flag, group[flag])
        if _DECOUPLED in group:
            check_flag(where, _DECOUPLED, group[_DECOUPLED])

    def complete_group(self, group: dict[str, Any]) -> None:
        """AdamW's groups are decoupled, new or loaded; Adam's keep what they name (Note
        [the decay's form is the group's])."""
        if self.decoupled:
            group[_DECOUPLED] = True

    def state_fields(
        self, moments_dtype: torch.dtype, groups: Sequence[Mapping[str, Any]]
    ) -> StateFields:
        names = ["exp_avg", "exp_avg_sq"]
        if any(group["amsgrad"] for group in groups):
            names.append("max_exp_avg_sq")
        master = StateField("master", torch.float32)
        return StateFields((master, *(StateField(n, moments_dtype) for n in names)))

    def checkpoint_fields(self, group: Mapping[str, Any]) -> tuple[str, ...]:
        if group["amsgrad"]:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")

    def missing_state(self, group: Mapping[str, Any], names: Sequence[str]) -> str | None:
        if group["amsgrad"] and "max_exp_avg_sq" not in names:
            return (
                "it has amsgrad=True, but the optimizer was built without it (its "
                "max_exp_avg_sq buffers do not exist): build the optimizer with amsgrad=True "
                "(load_state_dict carries the state over)"
            )
        return None

    def tile_step(
        self,
        fields: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        step: int,
        hyper: AdamHyper,
        grad_scale: float,
        out: torch.Tensor | None,
        take_written: bool = False,
    ) -> None:
        adam_step(
            fields["master"],
            grad,
            fields["exp_avg"],
            fields["exp_avg_sq"],
            step=step,
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            eps=hyper.eps,
            weight_decay=hyper.weight_decay,
            decoupled_weight_decay=hyper.decoupled,
            maximize=hyper.maximize,
            grad_scale=grad_scale,
            max_exp_avg_sq=fields["max_exp_avg_sq"] if hyper.amsgrad else None,
            out=out,
            take_written=take_written,
        )

    def device_tile_step(
        self,
        fields: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        *,
        step: int,
        hyper: AdamHyper,
        grad_scale: float,
        step_tensor: torch.Tensor,
    ) -> None:
        """torch's fused AdamW over the tile."""
        if grad_scale != 1.0:
            # A scaled copy: the accumulated gradient must stay as it is (a second step()
            # on the same gradients, like torch, must see it unscaled); a tile temporary.
            grad = grad * grad_scale
        master = fields["master"]
        maximize = hyper.maximize
        if not hyper.decoupled and hyper.weight_decay != 0:
            # Adam's coupled L2 decay (torch.optim.Adam): the sign flip of maximize comes
            # first, then the decay term; a tile-sized temporary.
            grad = (-grad if maximize else grad) + hyper.weight_decay * master
            maximize = False
        # torch's fused kernel counts the step itself: it adds 1 before using it.
        step_tensor.fill_(float(step - 1))
        torch_adamw(
            [master],
            [grad],
            [fields["exp_avg"]],
            [fields["exp_avg_sq"]],
            [fields["max_exp_avg_sq"]] if hyper.amsgrad else [],
            [step_tensor],
            fused=True,
            amsgrad=hyper.amsgrad,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            lr=hyper.lr,
            weight_decay=hyper.weight_decay if hyper.decoupled else 0.0,
            eps=hyper.eps,
            maximize=maximize,
        )

    def device_temporary_bytes(
        self, hyper: AdamHyper, grad_scale: float, tile_elements: int
    ) -> int:
        """Up to two fp32 tiles at once (the scaled gradient, the L2 term)."""
        scaled = grad_scale != 1.0 or (not hyper.decoupled and hyper.weight_decay != 0)
        return 8 * tile_elements if scaled else 0


#: ``torch.optim.AdamW``'s rule (``OffloadAdamW``).
ADAMW = AdamRule(decoupled=True)
#: ``torch.optim.Adam``'s rule (``OffloadAdam``).
ADAM = AdamRule(decoupled=False)
