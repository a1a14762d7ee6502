"""The CPU Adam tile loop of the stores whose state lives on the host (RAM or NVMe).

Each tile waits for its gradient (Note [Adam follows the gradient in] in
``grads/to_host.py``), runs the ``adam_step`` kernel over views of that tile's state, and
is published (its H2D copy issued at once, or remembered for ``publish()``). The stores
only say which tiles there are and where each tile's state is: a host-RAM store slices its
tensors, an NVMe store streams records through its I/O buffers (Note [the step streams the
state] in ``state/nvme.py``). The kernel is elementwise, so tile boundaries do not change a
bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...accelerator import Event
from ...kernels import adam_step
from ..grads.path import GradientPath, GradSource
from ..publish import WeightCopies

__all__ = ["AdamHyper", "AdamTiles"]


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


class AdamTiles:
    """One update of one host-side bucket, tile by tile.

    ``source``: the field holding the gradient (the plan's; the window's now when None).
    ``publish``: issue each tile's weight copy as soon as it is written, after ``after``
    (default: the compute issued so far); otherwise ``publish()`` issues them later.
    """

    def __init__(
        self,
        gradients: GradientPath,
        publication: WeightCopies,
        hyper: AdamHyper,
        grad_scale: float,
        *,
        source: GradSource | None,
        publish: bool,
        after: list[Event] | None,
    ) -> None:
        self.gradients = gradients
        self.publication = publication
        self.hyper = hyper
        self.grad_scale = grad_scale
        self.source = source or gradients.window_source()
        self.grad = gradients.gradient(self.source)  # (shard_numel,); reads declared per tile
        self.publish = publish
        self.after = publication.prepare(publish=publish, after=after)

    def step(
        self,
        lo: int,
        hi: int,
        step: int,
        fields: dict[str, torch.Tensor],
        *,
        out: torch.Tensor | None,
        copy_master_to: torch.Tensor | None = None,
    ) -> None:
        """Adam over shard elements ``[lo, hi)``: ``fields`` are that tile's views of the
        state (master, exp_avg, exp_avg_sq, max_exp_avg_sq); ``out`` receives the
        training-dtype weights (None for fp32, whose home is a master); ``copy_master_to``
        receives the fp32 master where the home is not the master itself."""
        hyper = self.hyper
        self.gradients.await_grad(self.grad, self.source, lo, hi)
        master = fields["master"]
        adam_step(
            master,
            self.grad[lo:hi],
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
            grad_scale=self.grad_scale,
            max_exp_avg_sq=fields["max_exp_avg_sq"] if hyper.amsgrad else None,
            out=out,
        )
        if copy_master_to is not None:
            copy_master_to.copy_(master)
        self.publication.tile_written(lo, hi, publish=self.publish, after=self.after)
