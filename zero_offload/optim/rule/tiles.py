"""The CPU tile loop of the stores whose state lives on the host (RAM or NVMe), for any rule.

Each tile waits for its gradient (Note [Adam follows the gradient in] in
``grads/to_host.py``), runs the rule's ``tile_step`` over views of that tile's state, and is
published (its H2D copy issued at once, or remembered for ``publish()``). The stores only
say which tiles there are and where each tile's state is: a host-RAM store slices its
tensors, an NVMe store streams records through its I/O buffers (Note [the step streams the
state] in ``state/nvme.py``). An elementwise rule's tile boundaries do not change a bit;
a rule that reads whole parameters is stepped one whole parameter per call
(``step_parameter``; Note [rules that read a whole parameter] in ``base.py``).

Note [a launch spans the tiles that landed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A tile is the unit the gradient lands in and CPU Adam may follow, not the unit Adam must be
launched in. Launched per 2M-element tile, the kernel's thread team stood idle between tiles
while Python checked the next launch's arguments, waited for its gradient and issued its
weight copy: on the H200 run's 16-core host a tile's Adam takes about 0.4 ms, about as long
as that turn (issue 39: CPU Adam at a quarter of the bare kernel's rate). So a launch takes
the tile it needs and every following tile of the run whose gradient has *already* landed
(``GradientPath.landed_through``, which never waits), up to ``LAUNCH_ELEMENTS``: after
backward, when every gradient is on the host, a bucket's run is one launch, one weight copy
and one streamed hash; during an announced backward, or while the copies are still
arriving, Adam still starts on the first tile that landed. An elementwise rule gives the
same bits for any launch boundaries (``adam_step`` is elementwise), so nothing else changes.
``LAUNCH_ELEMENTS`` bounds the delay before a launch's weight copy starts (about 10 ms of
the bare kernel on that host).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...accelerator import Event
from ..grads.path import GradientPath, GradSource
from ..publish import Publish, WeightCopies
from .base import Hyper, OptimizerRule

__all__ = ["LAUNCH_ELEMENTS", "RuleTiles"]

#: The most elements one launch takes: Note [a launch spans the tiles that landed].
LAUNCH_ELEMENTS = 1 << 25


class RuleTiles:
    """One update of one host-side bucket, tile by tile.

    ``source``: the field holding the gradient (the plan's; the window's now when None).
    ``publish``: ``Publish.NOW`` issues each tile's weight copy as soon as it is written,
    after ``after`` (default: the compute issued so far); with ``Publish.LATER``
    ``publish()`` issues them later. ``take_written``: each tile's master first takes the
    weights written in its home since the last step (the rule's ``takes_written``; Note
    [the update takes the written weights] in kernels/convert.py), and the published tiles
    are not fingerprinted: the write check is that pass (Note [the write check in the
    update] in update/reconcile.py). Where ``out`` is None the master is the weights' home
    and there is nothing to take.
    """

    def __init__(
        self,
        rule: OptimizerRule,
        gradients: GradientPath,
        publication: WeightCopies,
        hyper: Hyper,
        grad_scale: float,
        *,
        source: GradSource | None,
        publish: Publish,
        after: list[Event] | None,
        take_written: bool = False,
    ) -> None:
        self.rule = rule
        self.take_written = take_written
        self.gradients = gradients
        self.publication = publication
        self.hyper = hyper
        self.grad_scale = grad_scale
        self.source = source or gradients.window_source()
        self.grad = gradients.gradient(self.source)  # (shard_numel,); reads declared per tile
        self.publish = publish
        self.after = publication.prepare(publish=publish, after=after, fingerprint=not take_written)

    def wait(self, lo: int, hi: int) -> None:
        """Wait until the gradient of shard elements ``[lo, hi)`` is where the step reads it
        (``GradientPath.await_grad``)."""
        self.gradients.await_grad(self.grad, self.source, lo, hi)

    def launch_end(self, lo: int, stop: int, tile_elements: int) -> int:
        """Where the launch starting at ``lo`` (of a run ending at ``stop``) ends: its first
        tile, and the tiles after it whose gradient landed; Note [a launch spans the tiles
        that landed]."""
        first = min(lo + tile_elements, stop)
        limit = min(lo + max(LAUNCH_ELEMENTS, tile_elements), stop)
        if limit <= first or not self.rule.elementwise:
            return first
        return max(first, self.gradients.landed_through(self.source, lo, limit))

    def step(
        self,
        lo: int,
        hi: int,
        step: int,
        fields: dict[str, torch.Tensor],
        *,
        out: torch.Tensor | None,
        copy_master_to: torch.Tensor | None = None,
        declare: Callable[[int, int], None] | None = None,
    ) -> None:
        """The rule over shard elements ``[lo, hi)``: ``fields`` are that tile's views of
        the state (the rule's ``state_fields``); ``out`` receives the training-dtype weights
        (None for fp32, whose home is a master); ``copy_master_to`` receives the fp32 master
        where the home is not the master itself. ``declare(lo, hi)``, once the gradient is
        waited for: the store declares what the launch writes (for the race checker, after
        the wait that orders it)."""
        # passed only when taken: a rule that never takes (its tile_step written without the
        # argument, tests/test_rule_seam.py's) keeps working
        take = {"take_written": True} if self._takes(out) else {}
        self.gradients.await_grad(self.grad, self.source, lo, hi)
        if declare is not None:
            declare(lo, hi)
        self.rule.tile_step(
            fields,
            self.grad[lo:hi],
            step=step,
            hyper=self.hyper,
            grad_scale=self.grad_scale,
            out=out,
            **take,
        )
        self._written(lo, hi, fields, copy_master_to)

    def step_parameter(
        self,
        lo: int,
        hi: int,
        step: int,
        fields: dict[str, torch.Tensor],
        param_state: dict[str, torch.Tensor],
        *,
        shape: tuple[int, ...],
        out: torch.Tensor | None,
        copy_master_to: torch.Tensor | None = None,
    ) -> None:
        """The rule over one whole parameter of ``shape``, shard elements ``[lo, hi)``
        (Note [rules that read a whole parameter]): ``fields`` its per-element state,
        ``param_state`` its shaped state, ``out`` and ``copy_master_to`` as in ``step``;
        published as one tile."""
        self._takes(out)  # a whole-parameter rule never takes: raises where asked to
        self.gradients.await_grad(self.grad, self.source, lo, hi)
        self.rule.parameter_step(
            fields,
            param_state,
            self.grad[lo:hi],
            shape=shape,
            step=step,
            hyper=self.hyper,
            grad_scale=self.grad_scale,
            out=out,
        )
        self._written(lo, hi, fields, copy_master_to)

    def _takes(self, out: torch.Tensor | None) -> bool:
        """Whether this tile's master takes the weights written in ``out`` (none to take
        where the master is the home); a rule that cannot is a bug, raised first."""
        take = self.take_written and out is not None
        if take and not self.rule.takes_written:
            raise RuntimeError(
                f"the {self.rule.name} rule cannot take written weights in its pass (a bug: "
                "Note [the write check in the update] in update/reconcile.py)"
            )
        return take

    def _written(
        self, lo: int, hi: int, fields: dict[str, torch.Tensor], copy_master_to: torch.Tensor | None
    ) -> None:
        if copy_master_to is not None:
            copy_master_to.copy_(fields["master"])
        self.publication.tile_written(lo, hi, publish=self.publish, after=self.after)
