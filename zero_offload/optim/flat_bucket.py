"""One bucket of parameters: their flat device weights, gradients and optimizer state.

Two placements, one interface (``FlatBucket``):

- ``OffloadedBucket``: fp32 master weights, Adam moments and the fp32 gradient accumulator
  live in the host pool; gradients leave the device a bucket at a time (D2H on the ``d2h``
  stream), the CPU Adam kernel updates the master tile by tile, and each updated tile goes
  back to the device (H2D on the ``h2d`` stream) while the next tile is computed.
- ``ResidentBucket``: everything stays on the device, updated by torch's fused AdamW there
  (the share ``1 - offload_fraction`` of the parameters).

Both keep the model's parameters as views into one flat device buffer of the training dtype
(``weights_dev``), so a bucket's weights move to the device in one contiguous copy per tile.

Note [a bucket's gradient lifecycle]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
During backward each parameter's gradient is copied into its slot of the bucket's device
gradient buffer (``grad_dev``, taken from the device pool when the bucket's first gradient
arrives, and zeroed so that slots without a gradient and padding add nothing), and
``param.grad`` is released at once. When every parameter of the bucket has reported, or the
backward ends, or the device pool needs the space, the bucket is *flushed*: ``grad_dev`` is
copied to the host staging buffer, ``grad_dev`` is freed (its reuse waits on the copy's
event, Note [block reuse waits on events]), and the host worker adds the staging buffer
into the fp32 accumulator (or overwrites it, for the first flush after ``zero_grad``). A
bucket can be flushed several times in one backward; the accumulator sums the pieces. So
device gradient memory is about two buckets, and accumulation over several backward passes
is exact fp32 addition on the host.

Note [staging is reused only once consumed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each bucket has one host staging buffer. A flush's copy into it must not start before the
host worker has added the previous flush of the same bucket into the accumulator, or that
gradient would be overwritten unread (a lagging worker, an early flush, or micro-batches
while ``overlap_step``'s update occupies the worker). Each flush records an event on the
host worker after its accumulation, and the next flush of that bucket waits for it.

With several ranks (``Sharding``), a flush first averages ``grad_dev`` over the ranks with
a reduce-scatter on the ``comm`` stream (after the compute stream's "gradients ready"
event, so it overlaps the rest of backward), and only this rank's shard of ``grad_dev``
is then copied to the host (Note [who owns which shard] in ``partition.py``): every host
field of an offloaded bucket covers the shard, ``shard_numel`` elements. After the CPU
update each rank copies its updated shard into its slice of ``weights_dev`` and the
optimizer all-gathers the bucket, one collective filling every parameter of it.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.optim.adamw import adamw as torch_adamw

from ..accelerator import Event, Stream
from ..collectives import Comm, reduce_scatter_avg
from ..kernels import accumulate_grad, adam_step
from ..memory.block import Block
from ..memory.manager import TieredMemoryManager
from ..memory.pool import BlockPool
from ..memory.traffic import Category, Direction
from ..partition import BucketLayout, clip_runs
from ..tracing import phase

__all__ = [
    "AdamHyper",
    "BucketPools",
    "DeviceGrad",
    "FlatBucket",
    "OffloadedBucket",
    "ResidentBucket",
    "Sharding",
]


class DeviceGrad(enum.Enum):
    """Whether a bucket holds device gradient memory now."""

    #: No device gradient buffer: 0 device bytes for gradients.
    NONE = "none"
    #: ``grad_dev`` is allocated (padded_numel elements of the training dtype) and
    #: receiving this backward's gradients.
    FILLING = "filling"


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


@dataclass(frozen=True)
class BucketPools:
    """Where a bucket's buffers come from."""

    device: BlockPool  # weights_dev, grad_dev, and a resident bucket's fp32 state
    host: BlockPool  # an offloaded bucket's fp32 state and staging


@dataclass(frozen=True)
class Sharding:
    """How buckets are partitioned across ranks (absent with one rank)."""

    comm: Comm
    stream: Stream  # "comm": reduce-scatters run here, off the compute and copy streams


def _runs(
    layout: BucketLayout, steps: np.ndarray, arrived: np.ndarray
) -> Iterator[tuple[int, int, int]]:
    """Maximal ``(start, stop, step)`` element ranges of adjacent slots that have a gradient
    and share a step count (each parameter keeps its own step, as torch does)."""
    start = stop = step = -1
    for i, slot in enumerate(layout.slots):
        if not arrived[i]:
            continue
        if slot.offset == stop and steps[i] == step:
            stop = slot.end
            continue
        if start >= 0:
            yield start, stop, step
        start, stop, step = slot.offset, slot.end, int(steps[i])
    if start >= 0:
        yield start, stop, step


class FlatBucket(ABC):
    """What both placements share: the layout, flat device weights, step counts, hooks' state.

    Fields (elements are the bucket's flat elements, ``layout.padded_numel`` in all):
        weights_dev: (padded_numel,) training dtype, device pool; the params are views of it.
        grad_dev: (padded_numel,) training dtype, device pool, only while FILLING.
        steps: (n_slots,) int64, host; each parameter's Adam step count.
        arrived: (n_slots,) bool, host; which parameters got a gradient since zero_grad.
        pending: parameters yet to report in the current backward.
        shard: ``(start, stop)`` of the flat elements this rank owns (the whole padded
            bucket with one rank); see Note [who owns which shard] in ``partition.py``.
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: Sequence[torch.nn.Parameter],
        *,
        manager: TieredMemoryManager,
        pools: BucketPools,
        sharding: Sharding | None = None,
    ) -> None:
        self.layout = layout
        self.sharding = sharding
        self.shard = layout.shard_range(sharding.comm.rank if sharding is not None else 0)
        self.params = list(params)
        self.manager = manager
        self.pools = pools
        self.dtype = self.params[0].dtype
        self.itemsize = self.params[0].element_size()
        self.steps = np.zeros(len(layout.slots), dtype=np.int64)
        self.arrived = np.zeros(len(layout.slots), dtype=bool)
        self.pending = len(layout.slots)
        self.device_grad = DeviceGrad.NONE
        self._grad_block: Block | None = None
        self._state_blocks: dict[str, Block] = {}  # optimizer state and staging, by field name
        self.grad_dev = torch.empty(0, dtype=self.dtype, device=manager.accelerator.device)
        nbytes = layout.padded_numel * self.itemsize
        self._weights_block = pools.device.alloc(nbytes, owner=f"bucket{layout.index}.weights")
        self._weights_block.on_move(self._bind_params)
        flat = self._weights_block.view(self.dtype, (layout.padded_numel,))
        with torch.no_grad():
            flat.zero_()  # see Note [padding stays at the end] in partition.py
            for slot, param in zip(layout.slots, self.params, strict=True):
                flat[slot.offset : slot.end].copy_(param.detach().reshape(-1))
        self._bind_params(self._weights_block)
        # Each parameter's version when the optimizer last wrote or read it; None: unknown.
        # See Note [weights written outside the optimizer].
        self._param_versions: tuple[int, ...] | None = None

    def _bind_params(self, block: Block) -> None:
        """(Re-)point every parameter at its slot of ``weights_dev`` (also after a move)."""
        self.weights_dev = block.view(self.dtype, (self.layout.padded_numel,))
        for slot, param in zip(self.layout.slots, self.params, strict=True):
            param.data = self.weights_dev[slot.offset : slot.end].view(slot.shape)

    def _bind_grad(self, block: Block) -> None:
        self.grad_dev = block.view(self.dtype, (self.layout.padded_numel,))

    # -- backward ----------------------------------------------------------------------

    def receive_grad(self, slot_index: int, grad: torch.Tensor) -> bool:
        """Take one parameter's gradient; True when the bucket is complete for this backward."""
        if self.device_grad is DeviceGrad.NONE:
            self._open_grad()
        slot = self.layout.slots[slot_index]
        self._accumulate_slot(slot.offset, slot.end, grad.reshape(-1))
        self.arrived[slot_index] = True
        self.pending -= 1
        return self.pending == 0

    def _open_grad(self) -> None:
        nbytes = self.layout.padded_numel * self.itemsize
        block = self.pools.device.alloc(nbytes, owner=f"bucket{self.layout.index}.grad")
        block.on_move(self._bind_grad)
        self._grad_block = block
        self._bind_grad(block)
        self.grad_dev.zero_()
        self.device_grad = DeviceGrad.FILLING

    def _accumulate_slot(self, start: int, stop: int, grad: torch.Tensor) -> None:
        self.grad_dev[start:stop].add_(grad)

    def end_backward(self) -> None:
        """Flush what arrived and expect every parameter again in the next backward."""
        if self.device_grad is DeviceGrad.FILLING:
            self.flush()
        self.pending = len(self.layout.slots)

    @abstractmethod
    def flush(self) -> None:
        """Hand this backward's device gradients on; see Note [a bucket's gradient lifecycle]."""

    def zero_grad(self) -> None:
        """Forget the gradients since the last ``zero_grad``."""
        self.arrived[:] = False

    # -- step ----------------------------------------------------------------------------

    # Note [weights written outside the optimizer]
    # The parameters are views of ``weights_dev``. When something else writes them in place
    # (``model.load_state_dict``, an EMA swap, user code under no_grad), the *parameter's*
    # version counter moves; ``check_external_writes`` sees it at the next step and refreshes
    # the fp32 master from the weights, so the step starts from what the model holds instead
    # of silently overwriting it. The optimizer's own writes (weight copies, all-gathers)
    # go through ``weights_dev``, whose counter is the pool buffer's and is shared with every
    # other block of the pool (gradient buffers included), so it cannot be used: each
    # parameter keeps a counter of its own, and writes through ``weights_dev`` never move it.

    def _versions(self) -> tuple[int, ...]:
        return tuple(param._version for param in self.params)

    def check_external_writes(self) -> None:
        """Refresh the master weights if the parameters were written since the last step."""
        versions = self._versions()
        if versions != self._param_versions:
            self.refresh_master()
            self._param_versions = versions

    def remember_weights(self) -> None:
        """Record the parameters' versions after the optimizer's own writes."""
        self._param_versions = self._versions()

    @abstractmethod
    def refresh_master(self) -> None:
        """Set this rank's fp32 master weights from the model's weights (``weights_dev``)."""

    @abstractmethod
    def publish(self) -> list[Event]:
        """Copy updated weights not yet sent to ``weights_dev``; the copies' end events."""

    @abstractmethod
    def grad_sumsq(self) -> tuple[float, bool]:
        """Sum of squares of the accumulated gradient and whether any is non-finite."""

    @abstractmethod
    def update(
        self,
        hyper: AdamHyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: bool = True,
    ) -> None:
        """One AdamW step over ``runs`` (from ``plan_update``). With ``publish``, each
        updated tile's copy to ``weights_dev`` is issued as soon as the tile is done (so it
        overlaps the next tile); otherwise ``publish()`` issues them later."""

    def plan_update(self) -> list[tuple[int, int, int]]:
        """Count a step for every parameter with a gradient, and return the ``(start, stop,
        step)`` ranges that ``update`` must touch. Runs on the caller's thread, so a delayed
        update works from this snapshot while ``zero_grad`` and the next backward go on."""
        self.steps[self.arrived] += 1
        return list(_runs(self.layout, self.steps, self.arrived))

    def state_views(self, slot_index: int) -> tuple[int, int, dict[str, torch.Tensor]]:
        """The piece ``[lo, hi)`` of one flattened parameter that this rank owns (all of it
        with one rank; ``lo == hi`` for none) and flat views of its optimizer state there:
        master, exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad)."""
        slot = self.layout.slots[slot_index]
        start, stop = self.shard
        lo, hi = self.layout.owned_piece(slot, start, stop)
        first = slot.offset + lo - start  # the piece's first element in the state buffers
        names = ["master", "exp_avg", "exp_avg_sq"]
        if self.max_exp_avg_sq is not None:
            names.append("max_exp_avg_sq")
        return lo, hi, {name: getattr(self, name)[first : first + hi - lo] for name in names}

    def _alloc_state(self, pool: BlockPool, fields: list[tuple[str, torch.dtype]], n: int) -> None:
        """Allocate each named ``(n,)`` state field from ``pool``, zeroed, as an attribute
        re-taken after a move; the blocks are in ``_state_blocks`` (freed by ``close``)."""
        for name, dtype in fields:
            block = pool.alloc(n * dtype.itemsize, owner=f"bucket{self.layout.index}.{name}")
            block.on_move(
                lambda b, name=name, dtype=dtype: setattr(self, name, b.view(dtype, (n,)))
            )
            self._state_blocks[name] = block
            tensor = block.view(dtype, (n,))
            tensor.zero_()
            setattr(self, name, tensor)

    def close(self) -> None:
        """Return every block to its pool."""
        if self._grad_block is not None:
            self._grad_block.free()
            self._grad_block = None
        self._weights_block.free()
        for block in self._state_blocks.values():
            block.free()
        self._state_blocks.clear()


class OffloadedBucket(FlatBucket):
    """State on the host, updated by the CPU kernel; see the module docstring.

    Host fields (all ``(shard_numel,)``, the elements of ``shard``; host pool, pinned where
    available):
        master: fp32 master weights.
        exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad): fp32 or bf16 moments.
        grad_acc: fp32 gradient accumulator.
        grad_staging: training dtype, the D2H copy's destination.
        weights_staging: training dtype (absent for fp32), the kernel's fused copy-out and
            the H2D copy's source.
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: Sequence[torch.nn.Parameter],
        *,
        manager: TieredMemoryManager,
        pools: BucketPools,
        moments_dtype: torch.dtype,
        amsgrad: bool,
        tile_elements: int,
        sharding: Sharding | None = None,
    ) -> None:
        super().__init__(layout, params, manager=manager, pools=pools, sharding=sharding)
        self.tile_elements = tile_elements
        self.fresh = True  # the next flush overwrites grad_acc; touched on the host worker
        self._stats = (0.0, False)  # (sum of squares, non-finite) of grad_acc; host worker
        self._issued: list[Event] = []  # end events of weight copies issued by the last update
        self._unpublished: list[tuple[int, int]] = []  # updated tiles not yet copied
        n = layout.shard_numel
        fields: list[tuple[str, torch.dtype]] = [
            ("master", torch.float32),
            ("exp_avg", moments_dtype),
            ("exp_avg_sq", moments_dtype),
            ("grad_acc", torch.float32),
            ("grad_staging", self.dtype),
        ]
        if amsgrad:
            fields.append(("max_exp_avg_sq", moments_dtype))
        if self.dtype != torch.float32:
            fields.append(("weights_staging", self.dtype))
        self._alloc_state(pools.host, fields, n)
        self.max_exp_avg_sq: torch.Tensor | None = getattr(self, "max_exp_avg_sq", None)
        self.weights_staging: torch.Tensor | None = getattr(self, "weights_staging", None)
        self._staging_consumed: Event | None = None  # host worker done with grad_staging
        self.refresh_master()  # fp32 master from the model's initial weights

    def refresh_master(self) -> None:
        start, stop = self.shard
        done = self.manager.copy(
            self.master,
            self.weights_dev[start:stop],
            direction=Direction.D2H,
            category=Category.OPTIMIZER_STATE,  # the fp32 master is optimizer state
            after=[self.manager.compute_ready()],
            blocks=[self._weights_block, self._state_blocks["master"]],
            label=f"bucket{self.layout.index} master refresh",
        )
        # Synchronisation point: the next update reads the master (rare: construction,
        # loading a state dict, or weights written outside the optimizer).
        done.synchronize()

    def flush(self) -> None:
        manager = self.manager
        block = self._grad_block
        if block is None:
            raise RuntimeError(f"bucket {self.layout.index} flushed with no device gradient (bug)")
        staging_block = self._state_blocks["grad_staging"]
        if self._staging_consumed is not None and not self._staging_consumed.query():
            # Note [staging is reused only once consumed]: the host worker has not yet added
            # the previous flush of this bucket (earlier micro-batch, or an early flush) into
            # grad_acc. Synchronisation point: the caller waits for it, since a CUDA stream
            # cannot wait on host-thread work; it is rare (the worker is usually far ahead).
            with phase("wait_staging"):
                self._staging_consumed.synchronize()
        after = [manager.compute_ready()]
        if self.sharding is not None:
            after = [self._reduce_scatter(after[0])]
        start, stop = self.shard
        done = manager.copy(
            self.grad_staging,
            self.grad_dev[start:stop],
            direction=Direction.D2H,
            category=Category.GRADIENTS,
            after=after,
            blocks=[block, staging_block],
            label=f"bucket{self.layout.index}",
        )
        block.free()  # reuse waits on `done`, Note [block reuse waits on events]
        self._grad_block = None
        self.grad_dev = torch.empty(0, dtype=self.dtype, device=self.grad_dev.device)
        self.device_grad = DeviceGrad.NONE
        manager.host_worker.wait_event(done)
        manager.host_worker.submit(self._accumulate_on_host)
        self._staging_consumed = manager.host_worker.record_event()

    def _reduce_scatter(self, ready: Event) -> Event:
        """Queue the average of ``grad_dev`` over the ranks on the comm stream (after
        ``ready``); returns the event after which this rank's shard of it holds the mean."""
        sharding = self.sharding
        if sharding is None:
            raise RuntimeError(f"bucket {self.layout.index}: reduce-scatter with one rank (bug)")
        grad, what = self.grad_dev, f"bucket {self.layout.index} ({self.layout.padded_numel} el)"

        def run() -> None:
            with phase("reduce_scatter", track="comm"):
                reduce_scatter_avg(grad, comm=sharding.comm, what=what)

        sharding.stream.wait_event(ready)
        sharding.stream.submit(run)
        return sharding.stream.record_event()

    def _accumulate_on_host(self) -> None:
        # Runs on the host worker, after the D2H copy; see Note [a bucket's gradient lifecycle].
        # The same pass yields the statistics of the accumulated gradient, so step() needs
        # no pass of its own for the norm and the overflow flag.
        self._stats = accumulate_grad(
            self.grad_acc,
            self.grad_staging,
            overwrite=self.fresh,
            stop=self.layout.real_in(*self.shard),
        )
        self.fresh = False

    def zero_grad(self) -> None:
        super().zero_grad()
        self.manager.host_worker.submit(self._mark_fresh)

    def _mark_fresh(self) -> None:
        self.fresh = True

    def grad_sumsq(self) -> tuple[float, bool]:
        # Computed by the last accumulation (the caller synchronised the host worker).
        return self._stats if self.arrived.any() else (0.0, False)

    def update(
        self,
        hyper: AdamHyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: bool = True,
    ) -> None:
        for start, stop, step in clip_runs(runs, *self.shard):
            for lo in range(start, stop, self.tile_elements):
                hi = min(lo + self.tile_elements, stop)
                adam_step(
                    self.master,
                    self.grad_acc,
                    self.exp_avg,
                    self.exp_avg_sq,
                    step=step,
                    lr=hyper.lr,
                    beta1=hyper.beta1,
                    beta2=hyper.beta2,
                    eps=hyper.eps,
                    weight_decay=hyper.weight_decay,
                    maximize=hyper.maximize,
                    grad_scale=grad_scale,
                    max_exp_avg_sq=self.max_exp_avg_sq if hyper.amsgrad else None,
                    out=self.weights_staging,
                    start=lo,
                    stop=hi,
                )
                if publish:
                    self._issued.append(self._copy_tile(lo, hi))
                else:
                    self._unpublished.append((lo, hi))

    def _copy_tile(self, lo: int, hi: int) -> Event:
        source = self.master if self.weights_staging is None else self.weights_staging
        offset = self.shard[0]
        return self.manager.copy(
            self.weights_dev[offset + lo : offset + hi],
            source[lo:hi],
            direction=Direction.H2D,
            category=Category.WEIGHTS,
            blocks=[self._weights_block],
            label=f"bucket{self.layout.index}[{lo}:{hi}]",
        )

    def publish(self) -> list[Event]:
        events = self._issued + [self._copy_tile(lo, hi) for lo, hi in self._unpublished]
        self._issued, self._unpublished = [], []
        return events


class ResidentBucket(FlatBucket):
    """State on the device, updated there by torch's fused AdamW (no tier crossing).

    Device fields (all ``(padded_numel,)`` fp32, device pool): master, exp_avg, exp_avg_sq,
    max_exp_avg_sq (amsgrad only), grad_acc.
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: Sequence[torch.nn.Parameter],
        *,
        manager: TieredMemoryManager,
        pools: BucketPools,
        amsgrad: bool,
    ) -> None:
        super().__init__(layout, params, manager=manager, pools=pools)
        n = layout.padded_numel
        names = ["master", "exp_avg", "exp_avg_sq", "grad_acc"]
        if amsgrad:
            names.append("max_exp_avg_sq")
        self._alloc_state(pools.device, [(name, torch.float32) for name in names], n)
        self.max_exp_avg_sq: torch.Tensor | None = getattr(self, "max_exp_avg_sq", None)
        self.fresh = True
        # torch's fused AdamW takes the step count as a tensor on the parameters' device;
        # one per bucket, refilled in place (no host-to-device copy per step).
        self._state_step = torch.zeros((), dtype=torch.float32, device=self.master.device)
        self.refresh_master()

    def refresh_master(self) -> None:
        self.master.copy_(self.weights_dev)  # both on the device: no tier crossed

    def _open_grad(self) -> None:
        # Gradients accumulate straight into the resident fp32 accumulator.
        self.device_grad = DeviceGrad.FILLING

    def _accumulate_slot(self, start: int, stop: int, grad: torch.Tensor) -> None:
        if self.fresh:
            self.grad_acc.zero_()
            self.fresh = False
        self.grad_acc[start:stop].add_(grad)

    def flush(self) -> None:
        self.device_grad = DeviceGrad.NONE

    def zero_grad(self) -> None:
        super().zero_grad()
        self.fresh = True

    def grad_sumsq(self) -> tuple[float, bool]:
        if not self.arrived.any():
            return 0.0, False
        grad = self.grad_acc[: self.layout.numel]
        # Synchronisation point: .item() waits for the device to finish the reduction. In
        # float64 the squares of finite fp32 values cannot overflow, so the norm is
        # non-finite exactly when some gradient is.
        norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64).item())
        return norm * norm, not math.isfinite(norm)

    def publish(self) -> list[Event]:
        return []  # update() writes weights_dev in place: nothing crosses a tier

    def update(
        self,
        hyper: AdamHyper,
        grad_scale: float,
        runs: list[tuple[int, int, int]],
        *,
        publish: bool = True,
    ) -> None:
        for start, stop, step in runs:
            grad = self.grad_acc[start:stop]
            if grad_scale != 1.0:
                # A scaled copy: grad_acc must stay as accumulated (a second step() on the
                # same gradients, like torch, must see them unscaled). Hidden cost: a
                # temporary of the run's size on the device.
                grad = grad * grad_scale
            # torch's fused kernel counts the step itself: it adds 1 before using it.
            state_step = self._state_step.fill_(float(step - 1))
            torch_adamw(
                [self.master[start:stop]],
                [grad],
                [self.exp_avg[start:stop]],
                [self.exp_avg_sq[start:stop]],
                [self.max_exp_avg_sq[start:stop]] if hyper.amsgrad else [],
                [state_step],
                fused=True,
                amsgrad=hyper.amsgrad,
                beta1=hyper.beta1,
                beta2=hyper.beta2,
                lr=hyper.lr,
                weight_decay=hyper.weight_decay,
                eps=hyper.eps,
                maximize=hyper.maximize,
            )
            self.weights_dev[start:stop].copy_(self.master[start:stop])
