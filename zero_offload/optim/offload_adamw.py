"""OffloadAdamW: AdamW whose state lives in host memory and is updated by the CPU.

A drop-in ``torch.optim.Optimizer``: param groups, ``add_param_group``, LR schedulers,
``state_dict``/``load_state_dict``, ``zero_grad``. See DESIGN.md, "How data flows", and
Note [a bucket's gradient lifecycle] in ``flat_bucket.py``.

What differs from ``torch.optim.AdamW``, visibly:
- ``param.grad`` is ``None`` after backward: each gradient leaves the device as soon as it
  is produced and accumulates in fp32 on the host. Use ``opt.clip_grad_norm_`` (not
  ``torch.nn.utils.clip_grad_norm_``) and ``opt.backward(loss)`` for fp16 models.
- Parameters become views into flat per-bucket device buffers (``param.data`` is replaced
  once, at construction; modules keep working unchanged).

Several ranks (torch.distributed initialised, or ``process_group=`` given): ZeRO stage 2
with offload. Each rank owns a contiguous 1/N shard of every bucket's fp32 master weights,
moments and gradient accumulator (Note [who owns which shard] in ``partition.py``);
gradients are reduce-scattered (averaged) as buckets complete, the norm and overflow flag
are all-reduced, each rank runs CPU Adam on its shard, and the updated shards are
all-gathered into every rank's parameters. One rank is the same code with no collectives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..accelerator import Accelerator, Event, get_accelerator
from ..collectives import (
    Pending,
    all_gather_flat,
    all_reduce_stats,
    make_comm,
    surface_collective_errors,
    wait_all,
)
from ..config import OffloadConfig
from ..errors import PoolExhausted
from ..memory.manager import Tier, TieredMemoryManager
from ..memory.traffic import Category
from ..partition import BucketLayout, plan_buckets
from ..tracing import phase
from .checks import check_hyper, check_new_params, check_params
from .flat_bucket import (
    AdamHyper,
    BucketPools,
    DeviceGrad,
    FlatBucket,
    OffloadedBucket,
    ResidentBucket,
    Sharding,
)
from .loss_scaler import DynamicLossScaler, LossScaler, NoLossScaler
from .placement import POOL_ALIGNMENT, Placement, plan_placement
from .state_io import load_optimizer_state, optimizer_state

__all__ = ["OffloadAdamW"]


class _Segment:
    """The buckets and pools built for one call's worth of param groups.

    The constructor builds one segment for all its groups; each later ``add_param_group``
    builds another, with pools sized for that group alone.
    """

    def __init__(self, buckets: list[FlatBucket], pools: BucketPools) -> None:
        self.buckets = buckets
        self.pools = pools


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights, moments and gradients offloaded to host memory.

    Args follow ``torch.optim.AdamW``; ``config`` (an ``OffloadConfig``) sets bucketing,
    tiling, ``offload_fraction``, clipping, ``overlap_step`` and loss scaling;
    ``accelerator`` defaults to ``get_accelerator()``. ``capturable``, ``differentiable``,
    ``foreach=False`` and ``fused=False`` have no meaning here and are refused.
    ``process_group``: the ranks to partition over (default: torch.distributed's default
    group when it is initialised, else none); every rank must construct the optimizer
    over the same parameters in the same order. See the module docstring.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
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
    ) -> None:
        for name, value in (("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise ValueError(
                    f"OffloadAdamW does not support {name}=True: the update runs on the CPU "
                    f"outside autograd and CUDA graphs; leave {name}=False"
                )
        for name, value in (("foreach", foreach), ("fused", fused)):
            if value is not None:
                raise ValueError(
                    f"OffloadAdamW ignores torch's {name}= implementation switch (it always "
                    f"runs its own fused CPU kernel); leave {name}=None, got {value!r}"
                )
        if config is None:
            config = OffloadConfig()
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        check_hyper(defaults, where="OffloadAdamW")
        if config.overlap_step and config.offload_fraction != 1.0:
            raise ValueError(
                "OffloadConfig.overlap_step delays the CPU update by one step; it needs all "
                f"state on the host (offload_fraction=1.0), got {config.offload_fraction!r}"
            )
        self.config = config
        self.accelerator = accelerator if accelerator is not None else get_accelerator()
        #: Partitioning across ranks; None with one rank (Note [who owns which shard]).
        self.comm = make_comm(process_group, timeout=config.collective_timeout)
        if self.comm is not None and config.offload_fraction != 1.0:
            raise ValueError(
                f"{self.comm.where()}: OffloadConfig.offload_fraction must be 1.0 with several "
                f"ranks (device-resident optimizer state is not partitioned yet), got "
                f"{config.offload_fraction!r}"
            )
        self.manager = TieredMemoryManager(self.accelerator)
        # The comm stream exists with several ranks only: reduce-scatters run on it so that
        # they overlap backward and stay off the copy streams.
        self._sharding = (
            Sharding(self.comm, self.accelerator.new_stream("comm"))
            if self.comm is not None
            else None
        )
        self._segments: list[_Segment] = []
        self._constructing = True
        self._hooks: list[Any] = []
        self._backward_pending = False  # an end-of-backward callback is queued
        self._stats_cache: tuple[int, float, bool] | None = None  # (generation, sumsq, nonfinite)
        self._generation = 0  # bumps whenever host gradients change
        self._update_pending = False  # overlap_step: an update runs on the host worker
        self._clip_once: float | None = None  # set by clip_grad_norm_ for the next step
        self._closed = False  # close() gave the pools back
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        super().__init__(params, defaults)
        self._constructing = False
        self._build(list(range(len(self.param_groups))))
        self.scaler: LossScaler = (
            DynamicLossScaler(config.loss_scaler)
            if self._training_dtype() == torch.float16
            else NoLossScaler()
        )

    # -- construction ------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch does); after construction it gets buckets of its own."""
        group = dict(param_group)
        params = group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set) or params is None:
            raise TypeError(
                "param group 'params' must be a tensor or an ordered iterable of tensors "
                f"(not a set), got {type(params).__name__}"
            )
        group["params"] = params = list(params)
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        check_hyper(group, where=f"param group {len(self.param_groups)}")
        check_new_params(params, self.param_groups)
        super().add_param_group(group)
        if not self._constructing:
            try:
                self._build([len(self.param_groups) - 1])
            except BaseException:
                self.param_groups.pop()  # a failed call leaves the optimizer as it was
                raise

    def _training_dtype(self) -> torch.dtype:
        for segment in self._segments:
            for bucket in segment.buckets:
                return bucket.dtype
        return torch.float32

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _build(self, group_indices: list[int]) -> None:
        """Bucket, place and allocate the trainable parameters of ``group_indices``."""
        params = self._all_params()
        first_index = sum(len(self.param_groups[g]["params"]) for g in range(group_indices[0]))
        families = check_params(
            self.param_groups,
            group_indices,
            first_index=first_index,
            device=self.accelerator.device,
            dtype=self._training_dtype() if self.buckets else None,
        )
        if not families:
            return
        dtype = params[families[0][1][0][0]].dtype
        itemsize = dtype.itemsize
        layouts = plan_buckets(
            [members for _, members in families],
            bucket_numel=max(1, self.config.bucket_bytes // itemsize),
            world_size=self.comm.world_size if self.comm is not None else 1,
            align_numel=POOL_ALIGNMENT // 2,
        )
        amsgrad = any(self.param_groups[g]["amsgrad"] for g, _ in families)
        moments_dtype = torch.bfloat16 if self.config.moments_dtype == "bfloat16" else torch.float32
        stats = self.accelerator.memory_stats()
        placement = plan_placement(
            layouts,
            itemsize=itemsize,
            moment_size=moments_dtype.itemsize,
            amsgrad=amsgrad,
            offload_fraction=self.config.offload_fraction,
            device_free=stats["budget"] - stats["in_use"],
            auto_headroom=self.config.auto_headroom,
            alignment=POOL_ALIGNMENT,
        )
        name = f"offload_adamw.{len(self._segments)}"
        device_pool = self.manager.create_pool(
            Tier.DEVICE, max(placement.device_total, POOL_ALIGNMENT), name=f"{name}.device"
        )
        try:
            host_pool = self.manager.create_pool(
                Tier.HOST, max(placement.host_state, POOL_ALIGNMENT), name=f"{name}.host"
            )
        except BaseException:
            self.manager.discard_pool(device_pool)
            raise
        pools = BucketPools(device=device_pool, host=host_pool)
        # Buckets re-point their parameters into the device pool; keep the originals until
        # every bucket is built, so a failure can put the model back as it was. (No extra
        # peak: the pool already holds a full copy of the weights while they are alive.)
        originals = [(params[i], params[i].data) for _, members in families for i, _ in members]
        try:
            buckets = self._build_buckets(layouts, families, placement, pools, amsgrad)
        except BaseException:
            for param, data in originals:
                param.data = data
            self.manager.discard_pool(device_pool)
            self.manager.discard_pool(host_pool)
            raise
        del originals
        self._segments.append(_Segment(buckets, pools))
        for bucket in buckets:
            for slot_index, param in enumerate(bucket.params):
                self._hooks.append(
                    param.register_post_accumulate_grad_hook(
                        lambda p, b=bucket, i=slot_index: self._on_grad(b, i, p)
                    )
                )

    def _build_buckets(
        self,
        layouts: list[BucketLayout],
        families: list[tuple[int, list[tuple[int, tuple[int, ...]]]]],
        placement: Placement,
        pools: BucketPools,
        amsgrad: bool,
    ) -> list[FlatBucket]:
        """One bucket per layout, resident or offloaded as ``placement`` says."""
        params = self._all_params()
        moments_dtype = torch.bfloat16 if self.config.moments_dtype == "bfloat16" else torch.float32
        base = len(self.buckets)
        buckets: list[FlatBucket] = []
        for local in layouts:
            layout = dataclasses.replace(
                local, index=base + local.index, group=families[local.group][0]
            )
            members = [params[slot.index] for slot in layout.slots]
            if local.index in placement.resident:
                bucket: FlatBucket = ResidentBucket(
                    layout, members, manager=self.manager, pools=pools, amsgrad=amsgrad
                )
            else:
                bucket = OffloadedBucket(
                    layout,
                    members,
                    manager=self.manager,
                    pools=pools,
                    moments_dtype=moments_dtype,
                    amsgrad=amsgrad,
                    tile_elements=self.config.tile_elements,
                    sharding=self._sharding,
                )
            buckets.append(bucket)
        return buckets

    @property
    def buckets(self) -> list[FlatBucket]:
        """Every bucket, in backward order within each segment."""
        return [bucket for segment in self._segments for bucket in segment.buckets]

    # -- backward ----------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The loss scale ``backward`` multiplies by (1.0 unless the model is fp16)."""
        return self.scaler.scale

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by ``loss_scale`` for fp16 models."""
        if self.scaler.scale != 1.0:
            loss = loss * self.scaler.scale
        loss.backward(**kwargs)

    def _on_grad(self, bucket: FlatBucket, slot_index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise ValueError(
                f"parameter {bucket.layout.slots[slot_index].index} (shape "
                f"{tuple(param.shape)}) got a sparse gradient; OffloadAdamW needs dense ones "
                "(e.g. nn.Embedding(sparse=False))"
            )
        if not self._backward_pending:
            self._backward_pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        param.grad = None  # released now: the device keeps about two buckets of gradients
        with surface_collective_errors():
            self._receive(bucket, slot_index, grad)

    def _receive(self, bucket: FlatBucket, slot_index: int, grad: torch.Tensor) -> None:
        try:
            complete = bucket.receive_grad(slot_index, grad)
        except PoolExhausted:
            # More buckets are half-filled than the gradient buffers hold (backward order
            # differs from registration order): hand the others on early and retry.
            for other in self.buckets:
                if other is not bucket and other.device_grad is DeviceGrad.FILLING:
                    other.flush()
            complete = bucket.receive_grad(slot_index, grad)
        self._generation += 1
        if complete:
            bucket.flush()

    def _end_backward(self) -> None:
        self._backward_pending = False
        with surface_collective_errors():
            for bucket in self.buckets:
                bucket.end_backward()

    def _collect_stray_grads(self) -> None:
        """Gradients set by hand (not by autograd) are taken in at step time."""
        stray = False
        for bucket in self.buckets:
            for slot_index, param in enumerate(bucket.params):
                if param.grad is not None:
                    grad, param.grad = param.grad, None
                    self._receive(bucket, slot_index, grad)
                    stray = True
        if stray or self._backward_pending:
            self._end_backward()

    # -- step --------------------------------------------------------------------------

    def _grad_stats(self) -> tuple[float, bool]:
        """Global sum of squares of the (scaled) host gradients, and the overflow flag."""
        if self._stats_cache is not None and self._stats_cache[0] == self._generation:
            return self._stats_cache[1], self._stats_cache[2]
        # Synchronisation point: the CPU must see every gradient copied so far.
        with phase("wait_grads"), surface_collective_errors():
            self.manager.host_worker.synchronize()
        sumsq, nonfinite = 0.0, False
        with phase("grad_stats", track="cpu_optimizer"):
            for bucket in self.buckets:
                part, bad = bucket.grad_sumsq()
                sumsq += part
                nonfinite = nonfinite or bad
        if self.comm is not None:
            # Every rank must clip by the same coefficient and skip the same steps.
            sumsq, nonfinite = all_reduce_stats(
                sumsq, nonfinite, comm=self.comm, device=self.accelerator.device
            )
        self._stats_cache = (self._generation, sumsq, nonfinite)
        return sumsq, nonfinite

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the next step's gradients to ``max_norm``; returns the total norm (as torch's).

        The norm comes from the fused statistics pass over the host gradients and the
        clipping is folded into the CPU Adam gradient multiplier: no extra pass.
        """
        self._check_open("clip_grad_norm_")
        if norm_type != 2.0:
            raise ValueError(f"norm_type must be 2.0 (the L2 norm), got {norm_type!r}")
        if not (isinstance(max_norm, (int, float)) and max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
        self._collect_stray_grads()
        sumsq, _ = self._grad_stats()
        self._clip_once = float(max_norm)
        return torch.tensor(math.sqrt(sumsq) / self.scaler.scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step over every parameter that received a gradient since zero_grad."""
        self._check_open("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._collect_stray_grads()
        if self._update_pending:
            self._publish_pending()
        for bucket in self.buckets:
            bucket.check_external_writes()
        sumsq, overflow = self._grad_stats()
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
            return loss
        clip = 1.0
        if max_norm is not None and math.isfinite(norm):
            clip = min(1.0, max_norm / (norm + 1e-6))
        grad_scale = clip / scale
        if self.config.overlap_step:
            self._launch_delayed_update(grad_scale)
            return loss
        events: list[Event] = []
        gathers: list[Pending] = []
        with phase("cpu_adam", track="cpu_optimizer"):
            for bucket in self.buckets:
                bucket.update(self._hyper(bucket), grad_scale, bucket.plan_update())
                if self.comm is None:
                    events.extend(bucket.publish())
                else:  # this bucket's all-gather overlaps the next bucket's CPU Adam
                    gathers.append(self._gather(bucket, bucket.publish()))
        self._land_weights(events, gathers)
        return loss

    def _gather(self, bucket: FlatBucket, events: list[Event]) -> Pending:
        """Issue the all-gather of ``bucket``'s updated shards once this rank's shard has
        reached ``weights_dev`` (``events``)."""
        comm = self.comm
        if comm is None:
            raise RuntimeError("all-gather with one rank (bug)")
        # Synchronisation point (host accelerator): the collective reads weights_dev now.
        self.manager.wait_for(events, category=Category.WEIGHTS)
        # Not timed as a phase: issuing is quick; _land_weights times the wait.
        return all_gather_flat(
            bucket.weights_dev, comm=comm, what=f"bucket {bucket.layout.index} weights"
        )

    def _land_weights(self, events: list[Event], gathers: list[Pending]) -> None:
        """Make compute wait for the weight copies and all-gathers; record the versions."""
        with phase("wait_weights"):
            self.manager.wait_for(events, category=Category.WEIGHTS)
        if gathers and self.comm is not None:
            with phase("all_gather", track="comm"):
                wait_all(gathers, self.comm)
        for bucket in self.buckets:
            bucket.remember_weights()

    def _hyper(self, bucket: FlatBucket) -> AdamHyper:
        group = self.param_groups[bucket.layout.group]
        beta1, beta2 = group["betas"]
        return AdamHyper(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
        )

    # -- overlap_step (delayed parameter update) ---------------------------------------
    # Note [delayed parameter update]
    # step() k computes the statistics and the skip/clip decision on the caller's thread,
    # then queues the CPU update with gradients g_k on the host worker and returns. The
    # forward and backward of step k+1 run meanwhile on the weights published by step k,
    # which hold the updates g_1..g_{k-1}: one step of staleness. step() k+1 first waits
    # for the update g_k, copies its weights to the device (the next forward waits on those
    # copies) and only then queues update g_{k+1}, which waits for those copies because it
    # rewrites the staging they read. Backward k+1's gradient accumulation is queued on the
    # same host worker behind update g_k, so it never overwrites gradients in use.

    def _launch_delayed_update(self, grad_scale: float) -> None:
        plans = [(bucket, self._hyper(bucket), bucket.plan_update()) for bucket in self.buckets]

        def update() -> None:
            with phase("cpu_adam", track="cpu_optimizer"):
                for bucket, hyper, runs in plans:
                    bucket.update(hyper, grad_scale, runs, publish=False)

        self.manager.host_worker.submit(update)
        self._update_pending = True

    def _publish_pending(self) -> None:
        # Synchronisation point: the delayed update must be finished before its weights go.
        self.manager.host_worker.synchronize()
        events: list[Event] = []
        gathers: list[Pending] = []
        for bucket in self.buckets:
            published = bucket.publish()
            events.extend(published)
            if self.comm is not None:
                gathers.append(self._gather(bucket, published))
        for event in events:
            self.manager.host_worker.wait_event(event)
        self._land_weights(events, gathers)
        self._update_pending = False

    def flush_pending_update(self) -> None:
        """With ``overlap_step``: finish the queued update and publish its weights now."""
        if self._update_pending:
            self._publish_pending()

    # -- zero_grad, state_dict -------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget all gradients since the last step (device and host)."""
        super().zero_grad(set_to_none=True)
        for bucket in self.buckets:
            bucket.zero_grad()
        self._generation += 1

    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``) plus ``master``
        per parameter and the loss scaler under ``zero_offload``. Tensors are CPU copies."""
        self._check_open("state_dict")
        self.flush_pending_update()
        self.manager.synchronize()
        return optimizer_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s output (or a ``torch.optim.AdamW`` one, whose missing
        master weights are taken from the parameters). Everything is checked before anything
        changes: a mismatch raises and leaves the optimizer as it was."""
        self._check_open("load_state_dict")
        self.flush_pending_update()
        self.manager.synchronize()
        load_optimizer_state(self, state_dict)

    def close(self) -> None:
        """Remove the hooks and give every pool back (device pools: to the budget).

        The model keeps working (its parameters keep their memory); the optimizer refuses
        further steps. Calling ``close`` again does nothing.
        """
        if self._closed:
            return
        self.flush_pending_update()
        self.manager.synchronize()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for segment in self._segments:
            for bucket in segment.buckets:
                bucket.close()
            segment.pools.device.close()
            segment.pools.host.close()
        self._segments.clear()
        self.manager.close()
        self._closed = True

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"OffloadAdamW.{what}() after close(): its pools and streams are gone; "
                "build a new optimizer (load_state_dict from a state_dict saved before close)"
            )
