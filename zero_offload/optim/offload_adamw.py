"""OffloadAdamW (and OffloadAdam): Adam whose state lives in host memory, updated by the CPU.

A drop-in ``torch.optim.Optimizer``: param groups, ``add_param_group``, LR schedulers,
``state_dict``/``load_state_dict``, ``zero_grad``, ``opt.state[p]``. See DESIGN.md, "How
data flows", and Note [a bucket's gradient lifecycle] in ``grad_lifecycle.py``.

What differs from ``torch.optim.AdamW``, visibly:
- ``param.grad`` is ``None`` after backward: each gradient leaves the device as soon as it
  is produced and accumulates in fp32 on the host. ``step()`` uses exactly the gradients of
  the backward passes since the previous ``step()`` or ``zero_grad()``, whatever the loop
  calls to clear gradients. Clip with ``opt.clip_grad_norm_`` or
  ``OffloadConfig(max_grad_norm=...)``: ``torch.nn.utils.clip_grad_norm_`` would find no
  ``.grad`` to clip, so on our parameters it raises (Note [torch's clipping cannot see our
  gradients] in ``torch_clipping.py``). fp16 models use ``opt.backward(loss)``.
- Parameters become views into flat per-bucket device buffers (``param.data`` is replaced
  once, at construction; modules keep working unchanged). Replacing ``param.data`` later,
  or unfreezing a parameter that was frozen at construction, is refused at the next step.

Several ranks (torch.distributed initialised, or ``process_group=`` given): ZeRO stage 2
with offload (``ranks.ShardedRanks``); one rank is the same code with no collectives.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..accelerator import Accelerator, get_accelerator
from ..collectives import make_comm, surface_collective_errors
from ..config import OffloadConfig
from ..memory.manager import TieredMemoryManager
from ..tracing import phase
from .checks import (
    check_hyper,
    check_new_params,
    describe_param,
    plain_trainer_calling,
    split_names,
)
from .construction import build_group, check_param_offload
from .flat_bucket import FlatBucket, StepPlan
from .grads.lifecycle import GradState
from .grads.router import BackwardRouter
from .lifetime import Resources
from .ranks import Ranks, ShardedRanks, SingleRank
from .state.live import OptimizerState
from .state.state_dict import load_optimizer_state, optimizer_state
from .update.eager import EagerStep
from .update.loss_scaler import DynamicLossScaler, LossScaler, NoLossScaler
from .update.modes import DelayedUpdate, ImmediateUpdate, StepFailed, UpdateMode
from .update.tiles import AdamHyper

__all__ = ["OffloadAdam", "OffloadAdamW", "StepFailed"]

_serials = itertools.count(1)


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights, moments and gradients offloaded to host memory.

    Args follow ``torch.optim.AdamW``; ``config`` (an ``OffloadConfig``) sets bucketing,
    tiling, ``offload_fraction``, clipping, ``overlap_step`` and loss scaling;
    ``accelerator`` defaults to ``get_accelerator()``. ``capturable``, ``differentiable``,
    ``foreach=False`` and ``fused=False`` have no meaning here and are refused.
    ``process_group``: the ranks to partition over (default: torch.distributed's default
    group when it is initialised, else none); every rank must construct the optimizer
    over the same parameters in the same order. See the module docstring.

    Clipping: ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would see no
    gradients (they are on the host), so on this optimizer's parameters it raises. Use
    ``opt.clip_grad_norm_(max_norm)``, or ``OffloadConfig(max_grad_norm=...)``, or the
    integrations (``OffloadTrainer``, ``OffloadAccelerator``).

    As in torch, ``params`` may be ``model.named_parameters()`` (the names are kept as each
    group's ``param_names``, state dict included), and ``lr`` and ``betas`` may be 1-element
    tensors. Trainable parameters may mix training dtypes (fp32, bf16, fp16: bf16 layers with
    fp32 norms, fp32 adapters on a bf16 base); each bucket holds one dtype. With any fp16
    parameter one dynamic loss scaler serves them all: ``opt.backward(loss)`` scales the
    whole loss, and every bucket's gradients are unscaled by the same factor at the step.

    Parameter offload (``OffloadConfig(offload_parameters=True)``, one rank): ``model`` is
    the module whose forward runs and ``layers`` its repeated blocks (default: the
    ``nn.ModuleList`` holding the most parameters); only a window of units' weights stays
    on the device, fetched ahead of each forward and backward (``zero_offload.params``).
    """

    #: AdamW's decoupled weight decay; ``OffloadAdam`` sets False (torch.optim.Adam's L2).
    _decoupled = True
    _default_weight_decay = 1e-2

    def __init__(
        self,
        params: Iterable[torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]]
        | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        config: OffloadConfig | None = None,
        accelerator: Accelerator | None = None,
        process_group: Any = None,
        model: torch.nn.Module | None = None,
        layers: Sequence[torch.nn.Module] | None = None,
    ) -> None:
        name = type(self).__name__
        for flag, value in (("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise ValueError(
                    f"{name} does not support {flag}=True: the update runs on the CPU "
                    f"outside autograd and CUDA graphs; leave {flag}=False"
                )
        for flag, value in (("foreach", foreach), ("fused", fused)):
            if value is not None:
                raise ValueError(
                    f"{name} ignores torch's {flag}= implementation switch (it always "
                    f"runs its own fused CPU kernel); leave {flag}=None, got {value!r}"
                )
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
        if weight_decay is None:
            weight_decay = self._default_weight_decay
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        check_hyper(defaults, where=name)
        if config.overlap_step and config.offload_fraction != 1.0:
            raise ValueError(
                "OffloadConfig.overlap_step delays the CPU update by one step; it needs all "
                f"state on the host (offload_fraction=1.0), got {config.offload_fraction!r}"
            )
        self.config = config
        self.accelerator = accelerator if accelerator is not None else get_accelerator()
        comm = make_comm(process_group, timeout=config.collective_timeout)
        if comm is not None and config.offload_fraction != 1.0:
            raise ValueError(
                f"{comm.where()}: OffloadConfig.offload_fraction must be 1.0 with several "
                f"ranks (device-resident optimizer state is not partitioned yet), got "
                f"{config.offload_fraction!r}"
            )
        check_param_offload(config, comm, model, layers)
        # Parameter offload (zero_offload.params): the model and its blocks, for _build.
        self._param_offload_of = (model, layers) if config.offload_parameters else None
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
            self._ranks = ShardedRanks(comm, stream, accelerator=self.accelerator)
        self._router = BackwardRouter(self._ranks)
        self._resources = Resources(self.manager, self._router)
        self._resources.extra_streams = extra_streams
        # See Note [lifetimes without close]: nothing passed here references self.
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._mode: UpdateMode = (
            DelayedUpdate(self.manager, self._ranks)
            if config.overlap_step
            else ImmediateUpdate(self.manager, self._ranks)
        )
        self._constructing = True
        self._stats_cache: tuple[int, float, bool, np.ndarray] | None = None
        self._clip_once: float | None = None  # set by clip_grad_norm_ for the next step
        self._eager: EagerStep | None = None  # an announced step (Note [stepping during backward])
        self._eager_warned = False
        self._last_eager_share: float | None = None
        #: Speculative steps that had to be restored and redone (Note [speculative steps]).
        self.speculation_failures = 0
        self.skipped_steps = 0
        # Dynamic once any trainable parameter is fp16 (_build); Note [one loss scale] in
        # loss_scaler.py.
        self.scaler: LossScaler = NoLossScaler()
        self.last_grad_norm: float | None = None
        try:
            super().__init__(params, defaults)
            self._constructing = False
            self._state_view = OptimizerState(drain=self.manager.host_worker.synchronize)
            self._resources.state = self._state_view
            build_group(self, list(range(len(self.param_groups))))
        except BaseException:
            self._finalizer()
            raise
        self.state = self._state_view  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}#{self.serial}"

    # -- construction ------------------------------------------------------------------

    @property
    def param_offloader(self) -> Any:
        """The ``zero_offload.params.ParamOffloader`` with ``offload_parameters=True`` (its
        ``units``, ``fetches``, ``window_bytes``), else None."""
        return self._resources.param_offload

    @property
    def comm(self) -> Any:
        """The process group's ``Comm`` (``collectives.Comm``), or ``None`` with one rank."""
        return self._ranks.comm

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch does); after construction it gets buckets of its own (and
        the dynamic loss scaler, if it brings the first fp16 parameters)."""
        if getattr(self, "_eager", None) is not None:
            raise RuntimeError(
                "add_param_group between backward(step=True)/announce_step() and step(): "
                "the announced step is planned for the current groups; call step() first"
            )
        group = dict(param_group)
        params = group.get("params")
        where = f"param group {len(self.param_groups)}"
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set) or params is None:
            raise TypeError(
                "param group 'params' must be a tensor or an ordered iterable of tensors "
                f"(not a set), got {type(params).__name__}"
            )
        params, names = split_names(list(params), where=where)
        group["params"] = params
        if names is not None:
            group["param_names"] = names
        if self.param_groups and ("param_names" in group) != (
            "param_names" in self.param_groups[0]
        ):
            raise ValueError(
                f"{where} is {'with' if names is not None else 'without'} parameter names but "
                "the optimizer's first group is not; pass every group as named_parameters() "
                "pairs or none of them (as torch requires)"
            )
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        check_hyper(group, where=where)
        check_new_params(params, self.param_groups, names=names)
        if (
            isinstance(getattr(self, "scaler", None), NoLossScaler)
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
        super().add_param_group(group)
        if not self._constructing:
            try:
                build_group(self, [len(self.param_groups) - 1])
            except BaseException:
                self.param_groups.pop()  # a failed call leaves the optimizer as it was
                raise

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # Construction: construction.build_group (Note [construction holds one copy] there).

    @property
    def buckets(self) -> list[FlatBucket]:
        """Every bucket, in the fixed order (backward order within each segment)."""
        return self._router.buckets

    # -- backward ----------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The loss scale ``backward`` multiplies by (1.0 unless the model is fp16)."""
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, *, step: bool = False, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by ``loss_scale`` for fp16 models.

        ``step=True`` announces that ``step()`` follows this backward with no clipping or
        other backward in between (``announce_step``): where that makes the update exact,
        it runs during backward."""
        if step:
            self.announce_step()
        if self.scaler.scale != 1.0:
            loss = loss * self.scaler.scale
        loss.backward(**kwargs)

    def _eager_refusal(self, *, speculative: bool | None = None) -> str | None:
        """Why a step cannot run during backward here, or None; Note [stepping during
        backward] in stepping.py. ``speculative``: whether it may speculate (default
        ``OffloadConfig.speculative_step``; Note [speculative steps])."""
        if self._ranks.world_size > 1:
            return "several ranks (the all-gathers and arrival flags are collective)"
        if speculative is None:
            speculative = self.config.speculative_step
        if self.config.max_grad_norm is not None and not speculative:
            return (
                "clipping is configured (the norm is known only after backward; "
                "OffloadConfig(speculative_step=True) steps anyway and rolls back)"
            )
        if (
            isinstance(self.scaler, DynamicLossScaler) or self.config.skip_nonfinite
        ) and not speculative:
            return "an overflow could skip the step (fp16 loss scaling or skip_nonfinite)"
        if not isinstance(self._mode, ImmediateUpdate):
            return "overlap_step delays the update instead"
        if any(bucket.resident for bucket in self.buckets):
            return "some optimizer state is resident on the device (offload_fraction < 1)"
        if self._resources.param_offload is not None:
            return "parameter offload (the step writes the pinned weights the fetches read)"
        return None

    def can_step_during_backward(self) -> bool:
        """Whether an announced step (``backward(step=True)``, ``announce_step()``) would
        run during backward here, as opposed to in ``step()``; Note [stepping during
        backward] in stepping.py."""
        self._check_open("can_step_during_backward")
        return self._eager_refusal() is None

    @property
    def step_announced(self) -> bool:
        """Whether a step is announced and not taken yet (``step()`` takes it)."""
        return self._eager is not None

    def announce_step(self) -> bool:
        """Announce that the next backward is the window's last and ``step()`` follows it
        with no clipping or another backward in between (for loops that call
        ``loss.backward()`` themselves). Returns whether the step will run during that
        backward; where it cannot be exact (see ``_eager_refusal``) it runs in ``step()``
        as usual. Note [stepping during backward] in stepping.py."""
        self._check_open("announce_step")
        if self._eager is not None:
            raise RuntimeError(
                "a step is already announced and not taken yet; call step() after the "
                "announced backward before announcing another"
            )
        reason = self._eager_refusal()
        if reason is not None:
            if not self._eager_warned:
                self._eager_warned = True
                warnings.warn(
                    f"{self!r}: the announced step runs in step(), not during backward: {reason}",
                    stacklevel=2,
                )
            return False
        self._check_untouched()  # refuse now what step() would refuse, before any update
        self._reconcile_written_weights()
        hypers = {g: self._group_hyper(g) for g in {b.layout.group for b in self.buckets}}
        speculative = self.config.speculative_step and (
            self.config.max_grad_norm is not None
            or isinstance(self.scaler, DynamicLossScaler)
            or self.config.skip_nonfinite
        )
        self._eager = EagerStep(
            self.manager,
            hypers,
            grad_scale=1.0 / self.scaler.scale,
            speculation_bytes=self.config.speculation_bytes if speculative else None,
        )
        self._router.eager = self._eager
        return True

    @property
    def share_stepped_during_backward(self) -> float | None:
        """Of the last announced step's elements, the share whose CPU Adam had finished
        when its backward returned (None before any announced step)."""
        return self._last_eager_share

    @property
    def backwards(self) -> int:
        """Backward passes completed since construction (each flushed once)."""
        return self._router.backwards

    def _collect_stray_grads(self) -> None:
        """Gradients set by hand (not by autograd) are taken in at step time, and a backward
        that did not end (it raised, or its callback has not run) is closed."""
        with surface_collective_errors():
            for bucket in self.buckets:
                for slot_index, param in enumerate(bucket.params):
                    if param.grad is not None:
                        grad, param.grad = param.grad, None
                        self._router.receive(bucket, slot_index, grad)
                        self._stats_cache = None  # the window changed
            self._router.finish()

    # -- step --------------------------------------------------------------------------

    def _check_untouched(self) -> None:
        """Refuse, before anything changes, what happened behind the optimizer's back:
        Notes [parameters replaced behind the optimizer] and [a step is all or nothing]."""
        trained = {id(p) for bucket in self.buckets for p in bucket.params}
        index = 0
        for g, group in enumerate(self.param_groups):
            for param in group["params"]:
                if id(param) not in trained and param.grad is not None:
                    raise ValueError(
                        f"{describe_param(index, param)} in param group {g} has a gradient, "
                        f"but it was frozen (requires_grad=False) or empty when {self!r} was "
                        "built, so it has no optimizer state. Build the optimizer after "
                        "unfreezing, or pass the parameters that will train: nothing was "
                        "stepped"
                    )
                index += 1
        for bucket in self.buckets:
            detached = bucket.views.detached()
            if detached:
                slot_index, param = detached[0]
                slot = bucket.layout.slots[slot_index]
                raise ValueError(
                    f"{describe_param(slot.index, param)} no longer uses the storage "
                    f"{self!r} gave it (its .data was replaced after construction: "
                    "model.half()/.to(dtype), load_state_dict(assign=True), PEFT "
                    "merge_and_unload, resize_token_embeddings...). The optimizer would "
                    "update memory the model does not read. Rebuild the optimizer after such "
                    f"changes (load_state_dict carries the state over): nothing was stepped"
                )
        for g, group in enumerate(self.param_groups):
            check_hyper(group, where=f"param group {g}")
        for bucket in self.buckets:
            group = self.param_groups[bucket.layout.group]
            if group["amsgrad"] and "max_exp_avg_sq" not in bucket.store.state_names():
                raise ValueError(
                    f"param group {bucket.layout.group} has amsgrad=True, but {self!r} was "
                    "built without it (its max_exp_avg_sq buffers do not exist): build the "
                    "optimizer with amsgrad=True (load_state_dict carries the state over). "
                    "Nothing was stepped"
                )

    def _refuse_invisible_clipping(self) -> None:
        """A plain HF ``Trainer`` would silently not clip and log grad_norm 0: refuse."""
        trainer = plain_trainer_calling(sys._getframe(2))
        if trainer is not None:
            raise RuntimeError(
                f"{type(trainer).__name__} clips (max_grad_norm="
                f"{getattr(trainer.args, 'max_grad_norm', None)!r}) and computes the "
                "grad_norm it logs with torch.nn.utils.clip_grad_norm_, which cannot see "
                f"{type(self).__name__}'s gradients (they live on the host): it would clip "
                "nothing and log grad_norm 0. Use "
                "zero_offload.integrations.transformers.OffloadTrainer, which clips inside "
                "the optimizer and logs the true norm. Nothing was stepped"
            )

    def _grad_stats(self) -> tuple[float, bool, list[np.ndarray]]:
        """Global sum of squares of the (scaled) gradients, the overflow flag, and each
        bucket's per-parameter "got a gradient" flags (OR over the ranks)."""
        generation = self._router.backwards
        # Synchronisation point: the CPU must see every gradient copied so far.
        with phase("wait_grads"), surface_collective_errors():
            self.manager.host_worker.synchronize()
        for bucket in self.buckets:
            bucket.grads.settled()
        sumsq, nonfinite = 0.0, False
        with phase("grad_stats", track="cpu_optimizer"):
            for bucket in self.buckets:
                part, bad = bucket.grad_sumsq()
                sumsq += part
                nonfinite = nonfinite or bad
        local = [b.grads.arrived for b in self.buckets]
        flat = torch.from_numpy(np.concatenate(local)) if local else torch.zeros(0, dtype=bool)
        if self._stats_cache is not None and self._stats_cache[0] == generation:
            sumsq, nonfinite, merged = self._stats_cache[1:]
        else:
            sumsq, nonfinite, merged_t = self._ranks.all_reduce_stats(sumsq, nonfinite, flat)
            merged = merged_t.numpy().astype(bool)
            self._stats_cache = (generation, sumsq, nonfinite, merged)
        arrived, offset = [], 0
        for bucket in self.buckets:
            n = len(bucket.layout.slots)
            arrived.append(merged[offset : offset + n])
            offset += n
        return sumsq, nonfinite, arrived

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the next step's gradients to ``max_norm``; returns the total norm (as torch's).

        The norm comes from the fused statistics pass over the host gradients and the
        clipping is folded into the CPU Adam gradient multiplier: no extra pass.
        """
        self._check_open("clip_grad_norm_")
        if self._eager is not None:
            raise RuntimeError(
                "clip_grad_norm_ after backward(step=True)/announce_step(): the step ran "
                "during backward, unclipped. Configure clipping up front with "
                "OffloadConfig(max_grad_norm=...) (the step then runs in step()), or do not "
                "announce the step"
            )
        if norm_type != 2.0:
            raise ValueError(f"norm_type must be 2.0 (the L2 norm), got {norm_type!r}")
        if not (
            isinstance(max_norm, (int, float))
            and not isinstance(max_norm, bool)
            and max_norm > 0
            and math.isfinite(max_norm)
        ):
            raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
        norm = self.grad_norm()
        self._clip_once = float(max_norm)
        return norm

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients the next step will use (unscaled; the same
        on every rank), read-only: it sets no clipping. From the fused statistics pass, so
        it costs no pass over the gradients."""
        self._check_open("grad_norm")
        self._collect_stray_grads()
        sumsq, _, _ = self._grad_stats()
        return torch.tensor(math.sqrt(sumsq) / self.scaler.scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Adam step over every parameter that received a gradient since the previous
        step or ``zero_grad``; see Note [a step is all or nothing] in ``stepping.py``."""
        self._check_open("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._eager is not None:
            self._land_eager()  # nothing more when state_dict() already landed it
            self._drop_eager()
            return loss
        self._check_untouched()
        self._refuse_invisible_clipping()
        self._collect_stray_grads()
        self._mode.settle(self.buckets)
        self._reconcile_written_weights()
        fast = not self._step_needs_statistics()  # Note [a step that needs no statistics]
        if fast:
            arrived = [bucket.grads.arrived.copy() for bucket in self.buckets]
            grad_scale = 1.0 / self.scaler.scale
        else:
            sumsq, overflow, arrived = self._grad_stats()
            skip, grad_scale = self._decide(sumsq, overflow)
            if skip:
                for bucket in self.buckets:
                    bucket.grads.consume()
                self._router.consumed()
                return loss
        work = [
            (StepPlan(bucket, flags), self._hyper(bucket))
            for bucket, flags in zip(self.buckets, arrived, strict=True)
        ]
        self._mode.run(work, grad_scale)
        self._router.consumed()
        if fast:
            self._statistics_after_the_update()
        return loss

    # Note [a step that needs no statistics]
    # The statistics (the gradients' sum of squares and overflow flag) decide a step only
    # through clipping (configured, or a clip_grad_norm_ call for this step), a skip on
    # overflow (fp16's dynamic loss scaling, or skip_nonfinite) or, with several ranks,
    # the all-reduce that also merges which parameters got gradients. Without any of these
    # the step is known before the statistics are: every parameter with a gradient takes
    # one Adam step with the gradient divided by the (static) loss scale. Then step()
    # does not wait for the host worker: CPU Adam starts on each bucket's first gradient
    # tile as soon as it lands (Note [Adam follows the gradient in] in offloaded.py), and
    # the statistics, computed meanwhile on the host worker, are read after the update for
    # last_grad_norm and the profiler. It is the same arithmetic either way (bitwise; see
    # tests/test_step_bytes.py). Kept to the plain case: offloaded buckets only, an
    # immediate update, no parameter offload.

    def _step_needs_statistics(self) -> bool:
        """Whether this step's decision needs the statistics first (Note [a step that
        needs no statistics]): where a step could not run during backward unspeculated."""
        return self._clip_once is not None or self._eager_refusal(speculative=False) is not None

    def _statistics_after_the_update(self) -> None:
        """A step that needed no statistics is applied: read them now, for
        ``last_grad_norm`` and the profiler (Note [a step that needs no statistics])."""
        try:
            sumsq, overflow, _ = self._grad_stats()  # done meanwhile, on the host worker
        except Exception as exc:  # (a KeyboardInterrupt is not the worker failing)
            stepped = [bucket.layout.index for bucket in self.buckets]
            raise StepFailed(
                f"step() was applied to buckets {stepped}, but the host worker's "
                f"statistics of its gradients then failed ({type(exc).__name__}), so "
                "last_grad_norm is not known. Later steps would fail the same way: "
                "rebuild the optimizer (or reload it from a checkpoint)"
            ) from exc
        self._decide(sumsq, overflow)

    def _land_eager(self) -> None:
        """Take the announced step that ran during backward: land its weights, commit.
        Refusals come first and leave it pending (a retry after fixing them lands it)."""
        eager = self._eager
        if eager is None or eager.landed:
            return
        for bucket in self.buckets:
            if any(param.grad is not None for param in bucket.params):
                raise RuntimeError(
                    "a gradient was set by hand after an announced backward "
                    "(backward(step=True)); the step already ran without it. Clear it "
                    "(param.grad = None) and call step() again"
                )
        with surface_collective_errors():
            if not eager.backward_ended:  # the announced backward never ran
                self._router.finish()
                eager.end_backward(self.buckets)

            def decide() -> tuple[bool, float]:
                sumsq, overflow, _ = self._grad_stats()
                return self._decide(sumsq, overflow)

            eager.land(self.buckets, self._ranks, decide)
        if eager.rolled_back:
            self.speculation_failures += 1
        self._last_eager_share = eager.share_before_backward_returned
        self._note_steps()
        self._stats_cache = None
        self._router.consumed()

    def _drop_eager(self) -> None:
        """Forget the announced step (it was taken, or is being abandoned)."""
        self._eager = None
        self._router.eager = None

    def _decide(self, sumsq: float, overflow: bool) -> tuple[bool, float]:
        """From the window's statistics: whether the step is skipped, and the gradient
        multiplier (loss unscaling and clipping folded into one); updates the loss scaler,
        ``last_grad_norm`` and ``skipped_steps``."""
        scale = self.scaler.scale
        norm = math.sqrt(sumsq) / scale
        self.last_grad_norm = norm
        max_norm = self._clip_once if self._clip_once is not None else self.config.max_grad_norm
        self._clip_once = None
        skip = overflow and (
            isinstance(self.scaler, DynamicLossScaler) or self.config.skip_nonfinite
        )
        self.scaler.update(overflow)
        if skip:
            self.skipped_steps += 1
        self._note_steps()
        clip = 1.0
        if max_norm is not None and math.isfinite(norm):
            clip = min(1.0, max_norm / (norm + 1e-6))
        return skip, clip / scale

    def _note_steps(self) -> None:
        """What the profiler reports about the steps (``TieredMemoryManager.step_notes``)."""
        notes = self.manager.step_notes
        notes["skipped_steps"] = self.skipped_steps
        if self.config.speculative_step:
            notes["speculation_failures"] = self.speculation_failures
        if self._last_eager_share is not None:
            notes["share_stepped_during_backward"] = round(self._last_eager_share, 3)

    def _reconcile_written_weights(self) -> None:
        """Note [weights written outside the optimizer] in param_views.py."""
        for bucket in self.buckets:
            if bucket.views.changed():
                bucket.store.reconcile_master()
                bucket.views.remember()

    def _hyper(self, bucket: FlatBucket) -> AdamHyper:
        return self._group_hyper(bucket.layout.group)

    def _group_hyper(self, index: int) -> AdamHyper:
        group = self.param_groups[index]
        beta1, beta2 = group["betas"]
        return AdamHyper(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            decoupled=self._decoupled,
        )

    def flush_pending_update(self) -> None:
        """With ``overlap_step``: finish the queued update and publish its weights now."""
        self._check_open("flush_pending_update")
        self._mode.settle(self.buckets)

    # -- zero_grad, state_dict -------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget every gradient since the last step, in flight or not (device and host)."""
        super().zero_grad(set_to_none=True)
        if self._finalizer.alive:
            self._clip_once = None  # a clip_grad_norm_ belongs to the window it measured
            eager = self._eager
            if eager is not None:
                if eager.backward_ended:
                    self._land_eager()  # the announced step already ran: take it
                elif not eager.landed:
                    # The announced backward raised: what it stepped stays stepped.
                    stepped = eager.abandon(self.buckets, self._ranks)
                    if stepped:
                        warnings.warn(
                            f"{self!r}: the announced step's backward raised after buckets "
                            f"{stepped} were stepped (backward(step=True) runs them as they "
                            "complete); they keep that step and the rest were not stepped. "
                            "OffloadConfig(speculative_step=True) backs up and restores instead",
                            stacklevel=2,
                        )
                self._drop_eager()
            self._router.discard()
            self._stats_cache = None

    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``) plus ``master``
        per parameter and the loss scaler under ``zero_offload``. Tensors are CPU copies.

        Reads the state without changing training: with ``overlap_step`` it waits for the
        pending update but does not publish it (Note [delayed parameter update])."""
        self._check_open("state_dict")
        if self._eager is not None and self._eager.backward_ended:
            self._land_eager()  # the step has happened; the next step() only takes it
        self._mode.drain()
        return optimizer_state(self, pending_update=self._mode.pending)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s output (or a ``torch.optim.AdamW`` one, whose missing
        master weights are taken from the parameters). Everything is checked before anything
        changes: a mismatch raises and leaves the optimizer as it was."""
        self._check_open("load_state_dict")
        self._mode.drain()
        if self._eager is not None:
            # An announced step that ran is superseded by the loaded state; the window's
            # gradients stay, and the next step() steps from what was loaded.
            self.manager.host_worker.synchronize()
            for bucket in self.buckets:
                bucket.publish()  # collect the copies already issued
        pending = load_optimizer_state(self, state_dict)
        if self._eager is not None:
            self._drop_eager()
        if isinstance(self._mode, DelayedUpdate):
            if pending:
                self._mode.resume_pending(self.buckets)
            else:
                self._mode.forget_pending()
        self._stats_cache = None

    def close(self) -> None:
        """Publish a pending update, remove the hooks and give every pool back (device
        pools: to the budget). Optional: an optimizer that is dropped is released the same
        way (Note [lifetimes without close]).

        The model keeps working (its parameters keep their memory); the optimizer refuses
        further steps. Calling ``close`` again does nothing.
        """
        if not self._finalizer.alive:
            return
        try:
            if self._eager is not None and self._eager.backward_ended:
                self._land_eager()
            self._drop_eager()
            self._mode.settle(self.buckets)
        finally:
            self._finalizer()

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


class OffloadAdam(OffloadAdamW):
    """Adam with coupled L2 weight decay (``torch.optim.Adam``'s semantics, default
    ``weight_decay=0``), offloaded exactly like ``OffloadAdamW``."""

    _decoupled = False
    _default_weight_decay = 0.0
