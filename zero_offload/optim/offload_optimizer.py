"""OffloadOptimizer: an optimizer whose state lives in host memory, updated by the CPU, for any
rule (``optim/rule/``); ``OffloadAdamW`` and ``OffloadAdam`` (``offload_adamw.py``) are its
facades.

A drop-in ``torch.optim.Optimizer``: param groups, ``add_param_group``, LR schedulers,
``state_dict``/``load_state_dict``, ``zero_grad``, ``opt.state[p]``. See docs/design.md,
"How data flows: the two trips", and Note [a bucket's gradient lifecycle] in
``grads/lifecycle.py``.

What differs from the torch optimizer a facade stands for (``torch.optim.AdamW``), visibly:
- ``param.grad`` is ``None`` after backward: each gradient leaves the device as soon as it
  is produced and accumulates in fp32 on the host. ``step()`` uses exactly the gradients of
  the backward passes since the previous ``step()`` or ``zero_grad()``, whatever the loop
  calls to clear gradients. Clip with ``opt.clip_grad_norm_`` or
  ``OffloadConfig(max_grad_norm=...)``: ``torch.nn.utils.clip_grad_norm_`` would find no
  ``.grad`` to clip, so on our parameters it raises (Note [torch's clipping cannot see our
  gradients] in ``torch_clipping.py``). fp16 models use ``opt.backward(loss)``: a plain
  ``loss.backward()`` is refused (Note [a backward carries the loss scale]).
- Parameters become views into flat per-bucket device buffers (``param.data`` is replaced
  once, at construction; modules keep working unchanged). Replacing ``param.data`` later,
  or unfreezing a parameter that was frozen at construction, is refused at the next step.

Several ranks (torch.distributed initialised, or ``process_group=`` given): ZeRO stage 2
with offload (``ranks.ShardedRanks``); one rank is the same code with no collectives.
"""

from __future__ import annotations

import itertools
import logging
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..accelerator import Accelerator, get_accelerator
from ..accelerator.capture import eager_only
from ..collectives import surface_collective_errors
from ..config import OffloadConfig
from ..error_marks import said_to_caller
from ..kernels import release_scratch
from ..memory.manager import TieredMemoryManager
from .backward_methods import BackwardMethods
from .checkpoint.methods import Checkpoints
from .checks import (
    check_new_params,
    check_param_group,
    check_untouched,
)
from .clipping import GradientClipping
from .construction import SegmentBuilder
from .constructor_checks import checked_comm, windows_parameters
from .flat_bucket import FlatBucket
from .grads.lifecycle import GradState
from .kept_zero_grads import KeptZeroGrads
from .lifetime import Resources
from .ranks import Ranks, ShardedParamRanks, ShardedRanks, SingleRank
from .reports.live import OptimizerState
from .reports.summary import PlacementReport, placement_line, placement_of
from .rule import OptimizerRule
from .rule.base import Hyper
from .rule.values import check_torch_switches
from .scaled_backward import ScaleCheckedRouter, ScaledBackwards
from .torch_clipping import refuse_plain_trainer
from .torch_zero_grad import torch_zero_grad
from .update.loss_scaler import LossScaler
from .update.modes import DelayedUpdate, ImmediateUpdate, StepFailed
from .update.policy import StepPolicy

_log = logging.getLogger("zero_offload")

__all__ = ["OffloadOptimizer", "StepFailed"]

_serials = itertools.count(1)


def _announced(owner: weakref.ref[OffloadOptimizer]) -> Callable[[], str | None]:
    """Why ``owner``'s state cannot be written now (Note [writes through opt.state]); a
    weak reference, so that its resources hold no reference back (Note [lifetimes without
    close])."""

    def busy() -> str | None:
        opt = owner()
        if opt is None or opt._policy.eager is None:
            return None
        return (
            "a step is announced and not taken (it ran with the state as it was); call step() first"
        )

    return busy


class OffloadOptimizer(BackwardMethods, GradientClipping, Checkpoints, torch.optim.Optimizer):
    """An optimizer whose fp32 master weights, state and gradients are offloaded to host
    memory, stepped by its ``rule`` (``optim/rule/``). A facade (``OffloadAdamW``) sets
    ``rule`` and turns its torch-style arguments into ``defaults``, which the rule checks.

    ``config`` (an ``OffloadConfig``) sets bucketing, tiling, ``offload_fraction``,
    clipping, ``overlap_step`` and loss scaling; ``accelerator`` defaults to
    ``get_accelerator()``. ``process_group``: the ranks to partition over (default:
    torch.distributed's default group's ranks, in a group of the optimizer's own, when it
    is initialised, else none); every rank must construct the optimizer over the same
    parameters in the same order. A group passed here is used as given: keep other
    collectives off it while the optimizer runs (Note [a process group of the optimizer's
    own] in ``ranks.py``).

    Clipping: ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would see no
    gradients (they are on the host), so on this optimizer's parameters it raises. Use
    ``opt.clip_grad_norm_(max_norm)`` (``clipping.py``), or ``OffloadConfig(max_grad_norm=...)``,
    or the integrations (``OffloadTrainer``, ``OffloadAccelerator``); a model several offload
    optimizers train, ``zero_offload.clip_grad_norm_(optimizers, max_norm)``.

    As in torch, ``params`` may be ``model.named_parameters()`` (the names are kept as each
    group's ``param_names``, state dict included). Trainable parameters may mix training
    dtypes (fp32, bf16, fp16: bf16 layers with fp32 norms, fp32 adapters on a bf16 base);
    each bucket holds one dtype. With any fp16 parameter one dynamic loss scaler serves them
    all: ``opt.backward(loss)`` scales the whole loss, and every bucket's gradients are
    unscaled by the same factor at the step.

    Parameter offload (``OffloadConfig(offload_parameters=True)``; sharded, ZeRO-3, on several
    ranks): ``model`` is the module whose forward runs and ``layers`` its repeated blocks
    (default: the ``nn.ModuleList`` holding the most parameters); only a window of units'
    weights stays on the device, fetched ahead of each forward and backward.
    """

    #: What the state is and how it steps (``optim/rule/``); each facade sets its own.
    rule: OptimizerRule

    def __init__(
        self,
        params: Iterable[torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]]
        | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        config: OffloadConfig | None = None,
        accelerator: Accelerator | None = None,
        process_group: Any = None,
        model: torch.nn.Module | None = None,
        layers: Sequence[torch.nn.Module] | None = None,
    ) -> None:
        name = type(self).__name__
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
        self.config = config
        self.accelerator = accelerator if accelerator is not None else get_accelerator()
        comm = checked_comm(
            name, self.rule, defaults, config, process_group=process_group, model=model,
            layers=layers,
        )  # fmt: skip
        self.serial = next(_serials)
        self.manager = TieredMemoryManager(self.accelerator)
        extra_streams = []
        if comm is None:
            self._ranks: Ranks = SingleRank()
        else:
            # The comm stream exists with several ranks only: reduce-scatters run on it so
            # that they overlap backward and stay off the copy streams.
            stream = self.accelerator.new_stream("comm")
            extra_streams.append(stream)
            ranks = ShardedParamRanks if windows_parameters(config, comm) else ShardedRanks
            self._ranks = ranks(
                comm, stream, accelerator=self.accelerator, owns_group=process_group is None
            )
        self._scaled = ScaledBackwards(repr(self))  # Note [a backward carries the loss scale]
        self._router = ScaleCheckedRouter(
            self._ranks, self.manager, scaled=self._scaled, owner=type(self).__name__
        )
        self._resources = Resources(self.manager, self._router)
        self._resources.extra_streams = extra_streams
        # See Note [lifetimes without close]: nothing passed here references self.
        self._finalizer = weakref.finalize(self, self._resources.release)
        resources = self._resources
        self._policy = StepPolicy(
            config=config,
            manager=self.manager,
            ranks=self._ranks,
            router=self._router,
            mode=DelayedUpdate(
                self.manager,
                self._ranks,
                shadow=config.overlap_shadow,
                landing=config.overlap_landing,
                name=f"offload_{self.rule.name}{self.serial}.delayed_update",
            )
            if config.overlap_step
            else ImmediateUpdate(self.manager, self._ranks),
            param_offload=lambda: resources.param_offload is not None,
            scaled=self._scaled,
        )
        self._kept_zeros = KeptZeroGrads()  # Note [zero gradients are not kept]
        self._constructing = True
        try:
            self._state_view = OptimizerState(
                drain=self.manager.host_worker.synchronize, busy=_announced(weakref.ref(self))
            )
            self._resources.state = self._state_view
            self._builder = SegmentBuilder(
                config=config,
                manager=self.manager,
                ranks=self._ranks,
                resources=self._resources,
                state_view=self._state_view,
                policy=self._policy,
                rule=self.rule,
                name=f"offload_{self.rule.name}{self.serial}",
                param_offload_of=(model, layers) if windows_parameters(config, comm) else None,
            )
            try:
                super().__init__(params, defaults)
            except Exception as exc:  # torch's checks and ours, in add_param_group
                self._builder.refuse(self, exc)  # Note [a rank that fails alone]
            self._constructing = False
            self._builder.build(self, list(range(len(self.param_groups))))
        except BaseException as exc:
            try:
                self._finalizer()
            except Exception as lost:  # the build's own failure is the one to see
                exc.add_note(f"(releasing what was built failed too: {lost})")
            raise
        # Note [construction says where the state went] in reports/summary.py.
        _log.info(placement_line(repr(self), self.placement, str(self.accelerator.device)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}#{self.serial}"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{self!r} cannot be pickled or copied (pickle, copy.deepcopy, torch.save of the "
            "optimizer): its state lives in pinned host pools, device buffers and worker "
            "threads. Save opt.state_dict() instead (torch.save(opt.state_dict(), path)) and "
            "load it into a new optimizer with load_state_dict"
        )

    @property  # type: ignore[override]
    def state(self) -> OptimizerState:
        """torch's ``opt.state``, as live views: Notes [opt.state is torch's before the
        first step] and [writes through opt.state] in ``reports/live.py``."""
        return self._state_view

    @state.setter
    def state(self, value: Any) -> None:
        if not self._constructing:  # torch's Optimizer.__init__ assigns its defaultdict
            self._state_view.assign(value, where=f"{self!r}.state")

    # -- construction ------------------------------------------------------------------

    @property
    def param_offloader(self) -> Any:
        """The ``zero_offload.params.ParamOffloader`` with ``offload_parameters=True`` (its
        ``units``, ``fetches``, ``window_bytes``), else None."""
        return self._resources.param_offload

    @property
    def construction_peaks(self) -> Any:
        """``(device, host)`` bytes the last build held at most (``construction.py``'s
        SegmentBuilder; Notes [construction holds one copy], [construction peaks])."""
        return self._builder.peaks

    @property
    def comm(self) -> Any:
        """The process group's ``Comm`` (``collectives.Comm``), or ``None`` with one rank."""
        return self._ranks.comm

    @said_to_caller
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch does); after construction it gets buckets of its own (and
        the dynamic loss scaler, if it brings the first fp16 parameters)."""
        self._check_open("add_param_group")
        if self._policy.eager is not None:
            raise RuntimeError(
                "add_param_group between backward(step=True)/announce_step() and step(): "
                "the announced step is planned for the current groups; call step() first"
            )
        try:
            super().add_param_group(self._checked_group(param_group))
        except Exception as exc:
            if not self._constructing:  # the constructor shares its own refusal
                self._builder.refuse(self, exc)  # Note [a rank that fails alone]
            raise
        if not self._constructing:
            try:
                self._builder.build(self, [len(self.param_groups) - 1])
            except BaseException:
                self.param_groups.pop()  # a failed call leaves the optimizer as it was
                raise

    def _checked_group(self, param_group: dict[str, Any]) -> dict[str, Any]:
        """``param_group`` checked, with the defaults and the rule's derived keys filled in
        (a new dict: the caller's is left as it was)."""
        where = f"param group {len(self.param_groups)}"
        group, params, names = check_param_group(param_group, self.param_groups, where=where)
        check_torch_switches(where, group)  # Note [torch's implementation switches in a group]
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        self.rule.check_group(group, where=where)
        self.rule.complete_group(group)
        check_new_params(params, self.param_groups, names=names)
        if (
            not self._policy.scaler.skips_overflow
            and any(p.dtype == torch.float16 and p.requires_grad for p in params)
            and any(
                b.grads.state not in (GradState.EMPTY, GradState.CONSUMED) for b in self.buckets
            )
        ):
            raise ValueError(
                "add_param_group brings the first fp16 parameters, whose loss scaler would "
                "unscale the gradients already accumulated in this window: add the group "
                "between steps (after step() or zero_grad())"
            )
        return group

    @property
    def placement(self) -> PlacementReport:
        """Where the optimizer state is: bytes per tier, pinned host bytes, the budget."""
        return placement_of(self.buckets, self.manager, self.accelerator)

    @property
    def buckets(self) -> list[FlatBucket]:
        """Every bucket, in the fixed order (backward order within each segment)."""
        return self._router.buckets

    # -- backward ----------------------------------------------------------------------

    @property
    def scaler(self) -> LossScaler:
        """The loss scaler (Note [one loss scale] in ``update/loss_scaler.py``)."""
        return self._policy.scaler

    @property
    def loss_scale(self) -> float:
        """The loss scale ``backward`` multiplies by (1.0 unless the model is fp16)."""
        return self._policy.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on overflow (fp16 loss scaling, or ``skip_nonfinite``)."""
        return self._policy.skipped_steps

    @property
    def speculation_failures(self) -> int:
        """Speculative steps restored and redone (Note [speculative steps])."""
        return self._policy.speculation_failures

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (unscaled), None before one."""
        return self._policy.last_grad_norm

    def _collect_stray_grads(self) -> None:
        """Gradients set by hand (not by autograd) are taken in at step time, and a backward
        that did not end (it raised, or its callback has not run) is closed."""
        with surface_collective_errors():
            for bucket in self.buckets:
                for slot_index, param in enumerate(bucket.params):
                    if param.grad is not None:
                        grad, param.grad = param.grad, None
                        self._router.receive(bucket, slot_index, grad)
                        self._policy.window_changed()
            self._router.finish()
            self._router.land()

    # -- step --------------------------------------------------------------------------

    @eager_only  # Note [the step runs eagerly]
    @torch.no_grad()
    @said_to_caller  # Note [an error reaches the caller once] in error_marks.py
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of this optimizer's rule over every parameter that received a gradient
        since the previous step or ``zero_grad``; see Note [a step is all or nothing] in ``update/modes.py``."""
        self._check_open("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._policy.eager is not None:
            self._policy.warn_announced_changes(self._group_hyper, self)
            self._policy.land_eager()  # nothing more when state_dict() already landed it
            self._policy.drop_eager()
            return loss
        self._policy.mode.land_all()  # Note [weights landed at their first use]
        check_untouched(self, self.param_groups, self.buckets, rule=self.rule)
        refuse_plain_trainer(type(self).__name__, sys._getframe(1))
        self._collect_stray_grads()
        # Note [a clip in the middle of a window] in update/window_clip.py
        self._policy.clip.check_not_dropped(self._router.backwards, type(self).__name__)
        ranks = 1 if self.comm is None else self.comm.world_size
        self._kept_zeros.check_step(self, self.buckets, self.param_groups, ranks=ranks)
        mode = self._policy.mode
        mode.settle(self.buckets)
        # Note [weights written outside the optimizer] in views/param_views.py; Note [the
        # write check in the update] in update/reconcile.py
        mode.write_checks.check(self.buckets, in_update=mode.checks_in_update)
        try:
            self._policy.step(self._hyper)
        except BaseException:
            mode.write_checks.abandon()
            raise
        mode.write_checks.finish(self.buckets)
        return loss

    def _hyper(self, bucket: FlatBucket) -> Hyper:
        return self._group_hyper(bucket.layout.group)

    def _group_hyper(self, index: int) -> Hyper:
        return self.rule.hyper(self.param_groups[index])

    @said_to_caller
    def flush_pending_update(self) -> None:
        """With ``overlap_step``: finish the queued update and publish its weights now."""
        self._check_open("flush_pending_update")
        self._policy.mode.settle(self.buckets)
        self._policy.mode.land_all()

    # -- zero_grad, close ---------------------------------------------------------------

    # Note [the step runs eagerly]
    # torch's docs compile the optimizer's step (torch.compile(opt.step), or a train_step
    # calling it). Ours issues copies, waits on streams and reads its finalizer, none of
    # which a graph can hold: dynamo traced into it and failed with its own internal error
    # ("Guard failed on the same frame it was created"), or the copies raised
    # CaptureRefused. step() and zero_grad() are torch.compiler.disable'd: a compiled
    # caller breaks the graph there and runs them eagerly, as it runs the backward hooks
    # (Note [the router's hooks run eagerly] in router.py); a CUDA graph capture of them is
    # still refused at the first copy.

    @eager_only  # Note [the step runs eagerly]
    @said_to_caller
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget every gradient since the last step, in flight or not (device and host).
        No ``.grad`` is kept either way; after ``set_to_none=False`` a step refuses where
        torch would step a parameter with its kept zero ``.grad`` (Note [zero gradients are
        not kept] in ``kept_zero_grads.py``)."""
        self._kept_zeros.zero_grad(set_to_none)
        torch_zero_grad(self, set_to_none=True)  # torch's, unwrapped (torch_zero_grad.py)
        if self._finalizer.alive:
            self._policy.discard_window(self)

    @said_to_caller
    def close(self) -> None:
        """Publish a pending update, remove the hooks and give every pool back (device
        pools: to the budget). Optional: an optimizer that is dropped is released the same
        way (Note [lifetimes without close]).

        The model keeps working (its parameters keep their memory); the optimizer refuses
        further steps. Calling ``close`` again does nothing, or finishes a release a Ctrl-C
        cut short.
        """
        if not self._finalizer.alive:
            if not self._resources.released:  # Note [a release cut short] in lifetime.py
                self._resources.release()
            return
        try:
            self._policy.land_if_ran()
            self._policy.drop_eager()
            self._policy.mode.settle(self.buckets)
            self._policy.mode.land_all()
        finally:
            self._finalizer()
            release_scratch()  # the buffers the steps on this thread kept

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran (or construction failed)."""
        return not self._finalizer.alive

    def _check_open(self, what: str) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(
                f"{type(self).__name__}.{what}() after close(): its pools and streams are "
                "gone; build a new optimizer (load_state_dict from a state_dict saved before "
                "close)"
            )
