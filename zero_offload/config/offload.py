"""How the offload optimizer places and streams its state: ``OffloadConfig``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..settings import GradAccumulation, GradStaging, OverlapLanding, OverlapShadow
from .loss_scaler import LossScalerConfig
from .values import check_int, check_positive_finite, parse_bytes_with_unit

__all__ = ["OffloadConfig"]


@dataclass(frozen=True)
class OffloadConfig:
    """How ``OffloadAdamW`` places and streams optimizer state.

    Attributes:
        bucket_bytes: gradient bytes (in the training dtype) per bucket; gradients leave
            the device a bucket at a time. An int of bytes or a string with a unit
            (``"32MiB"``; a string without one, ``"32"``, is refused rather than read as
            bytes, as for every byte count here). Default 32 MiB. Must be >= 1 KiB.
        tile_elements: elements the CPU optimizer updates before issuing that tile's copy to
            the device, so the copy of one tile overlaps the compute of the next; gradients
            reach the host in tiles of this size too, and CPU Adam starts on the first.
            Default 2**21. Must be >= 1024.
        offload_fraction: share of the parameters (by element count) whose fp32 master
            weights and Adam moments live on the host and are updated by the CPU; the rest
            stay on the device and are updated there by torch's fused AdamW. A float in
            [0, 1] or ``"auto"``: the largest on-device share that fits the device budget
            with ``auto_headroom`` to spare. Default 1.0 (everything offloaded).
        auto_headroom: share of the device budget that ``offload_fraction="auto"`` leaves
            free for activations and the caching allocator. Default 0.25. In [0, 1).
        max_grad_norm: clip the global gradient norm to this (``None``: no clipping). > 0.
        overlap_step: delayed parameter update (ZeRO-Offload's DPU): step ``k``'s CPU update
            runs while step ``k+1``'s forward and backward run, so each forward sees weights
            one update behind. Default False.
        skip_nonfinite: skip (and count) a step whose gradients hold inf or NaN instead of
            letting them poison the weights as torch would. Always on for fp16 (the loss
            scaler's job). Default False.
        speculative_step: with an announced step (``opt.backward(loss, step=True)``), run
            each bucket's CPU Adam during backward even though clipping or an overflow skip
            may still change the step: the state it overwrites is backed up first, and if
            the norm turns out to bind (or the step must be skipped) the buckets are
            restored and stepped again with the right coefficient; bitwise the ordinary
            step either way. Default False.
        speculation_bytes: host bytes the backups of speculatively stepped buckets may use
            at once (the fp32 master and the rule's state: 12 bytes per parameter for AdamW,
            16 with its max-moment option);
            buckets beyond it are stepped in ``step()``. An int of bytes or a string with a
            unit such as ``"2GiB"``. Default ``"1GiB"``.
        moments_dtype: ``"float32"`` or ``"bfloat16"`` for the host Adam moments
            (bf16 saves 4 bytes per parameter of host memory and traffic, math stays fp32).
            Default ``"float32"``.
        loss_scaler: dynamic loss scaling for fp16 models.
        collective_timeout: seconds a collective across ranks (reduce-scatter, all-gather,
            the norm all-reduce) may wait before the rank raises ``CollectiveError`` naming
            the collective, instead of hanging when another rank failed or never arrived.
            Default 600.0. Must be > 0. Unused with one rank.
        nvme_dir: a directory on a local disk for the optimizer state (fp32 master and
            moments) that does not fit ``host_budget``; each rank uses ``nvme_dir/rank{r}``
            (``zero_offload.memory.storage``). Default ``None``: all state in host RAM.
        host_budget: bytes of host RAM for the offloaded buckets' master and moments (per
            rank), an int of bytes, a string with a unit such as ``"48GiB"``, or ``"auto"``
            (``"48"`` is refused: 48 bytes is never what it means): the RAM available at
            construction less max(10% of total RAM, 2 GiB) and less the gradient staging and
            I/O buffers. Buckets are placed whole, in bucket order: on the host while they
            fit, the rest on NVMe. Gradients, staging and the tier's I/O buffers are in host
            RAM whatever the budget (docs/nvme.md). Default ``None``: ``"auto"`` when
            ``nvme_dir`` is set. Needs ``nvme_dir``.
        offload_parameters: keep only a window of layers' training-dtype weights on the
            device; the pinned host copy that CPU Adam writes is the authoritative one and
            each unit (a block of ``layers``, the embeddings, the head, ...) is fetched
            ``prefetch_layers`` units ahead of its forward and its backward
            (``zero_offload.params``; docs/parameter-offload.md). Needs ``model=`` on the
            optimizer, ``offload_fraction=1.0`` and no ``overlap_step``. With several ranks
            it is ZeRO-3 with offload: each rank's homes hold its shard of each unit, which
            is all-gathered before use (docs/parameter-offload.md, "Several ranks"). With
            ``nvme_dir`` ``host_budget`` (per rank) holds the units' homes (the
            training-dtype weights; each rank's shards on several ranks) first, the homes
            beyond it in weight files on NVMe, then the master and moments, the rest on NVMe
            (docs/nvme.md, "With parameter offload"; several ranks: "Several ranks
            (ZeRO-Infinity)"). Default False.
        partition_parameters: ZeRO-3: with several ranks each rank keeps only its shard of
            each unit's training-dtype weights, and the units are all-gathered
            ``prefetch_layers`` ahead of their forward and backward into a window of slots
            (FSDP's configuration). Alone, the shards stay on the device and the shard's
            master and moments on the host, as in ZeRO-Offload (docs/parameter-offload.md,
            "Shards on the device"); with ``offload_parameters=True`` the shards live in
            pinned host homes instead, which is what ``offload_parameters`` alone means on
            several ranks (ZeRO-3 with offload). Needs ``model=`` on several ranks,
            ``offload_fraction=1.0``, no ``overlap_step`` and, without
            ``offload_parameters``, no ``nvme_dir``. On one rank a shard is the whole
            model: the optimizer is built as without it (``model=``/``layers=`` unused).
            Default False.
        prefetch_layers: with ``offload_parameters`` or ``partition_parameters``, how many
            units ahead the fetches run (0: fetched when needed, nothing hidden). Device
            weights are then ``prefetch_layers + 2`` slots of the largest units. An int >= 0.
            Default 1.
        grad_staging: where gradients land on the host, a ``GradStaging`` or its spelling
            (normalised to the member). ``"per_bucket"`` (default): a
            pinned staging buffer per bucket, for the whole model (2 bytes a parameter in
            bf16). ``"in_flight"``: a ring of ``grad_staging_buffers`` buffers, each as large
            as the largest bucket's shard, shared by every bucket; each step must then run
            during backward (announce it: ``opt.backward(loss, step=True)`` or
            ``opt.announce_step()``; the transformers integration does), so that a bucket's
            buffer is free again once its CPU Adam is done (docs/optimizer.md, "Gradient
            staging for the buckets in flight"). Refused with clipping (``max_grad_norm``),
            ``skip_nonfinite``, ``speculative_step``, ``overlap_step`` or
            ``offload_fraction`` other than 1.0, which keep every gradient until
            ``step()``; a step that runs in ``step()`` anyway (not announced, micro-batches
            accumulating, fp16's loss scaler, several ranks) stays exact and grows the ring,
            warned once.
        grad_staging_buffers: with ``grad_staging="in_flight"``, the ring's buffers (K). An
            int >= 1. Default 2: one bucket's copy lands while the previous one's CPU Adam
            runs.
        grad_accumulation: where micro-batches' gradients add up, a ``GradAccumulation`` or
            its spelling. ``"auto"`` (default): in an fp32 accumulator on the device (4
            device bytes a parameter of the offloaded buckets, taken at the first window
            that accumulates, bucket by bucket while the device budget has room; the rest,
            logged, on the host), landing on the host once per step. ``"host"``: always in
            the pinned fp32 accumulator on the host. The sum is bitwise the same; on the
            device its norm is taken per parameter, equal to the host's to about 1e-16
            (docs/gradient-semantics.md, "Accumulation on the device").
        overlap_shadow: with ``overlap_step``, where the delayed update's weights wait for
            the next step, an ``OverlapShadow`` or its spelling. ``"auto"`` (default): in a
            device shadow per bucket (2 device bytes a bf16 parameter, taken at the bucket's
            first update while the device budget has room; the rest, logged, in the pinned
            home), filled during the next forward and backward, so ``step()`` copies on the
            device. ``"off"``: in the pinned home, copied across the link by the next
            ``step()``. The weights are bitwise the same.
        overlap_landing: with ``overlap_step``, where compute waits for the weight copies
            across the link (buckets without a shadow), an ``OverlapLanding`` or its
            spelling. ``"at_step"`` (default): ``step()`` makes compute wait for all of them.
            ``"at_first_use"``: ``step()`` returns once they are issued and each bucket is
            waited for where one of its parameters is first read, so the forward's first
            layers run while the later buckets cross (Note [weights landed at their first
            use] in ``views/in_flight.py``: ``torch.compile`` is refused; tensors
            taken from a parameter and kept across steps are not waited for). The weights
            are bitwise the same.
    """

    bucket_bytes: int | str = 32 * 2**20
    tile_elements: int = 2**21
    offload_fraction: float | str = 1.0
    auto_headroom: float = 0.25
    max_grad_norm: float | None = None
    overlap_step: bool = False
    skip_nonfinite: bool = False
    speculative_step: bool = False
    speculation_bytes: int | str = "1GiB"
    moments_dtype: str = "float32"
    loss_scaler: LossScalerConfig = LossScalerConfig()
    collective_timeout: float = 600.0
    nvme_dir: str | os.PathLike[str] | None = None
    host_budget: int | str | None = None
    offload_parameters: bool = False
    partition_parameters: bool = False
    prefetch_layers: int = 1
    grad_staging: GradStaging | str = GradStaging.PER_BUCKET
    grad_staging_buffers: int = 2
    grad_accumulation: GradAccumulation | str = GradAccumulation.AUTO
    overlap_shadow: OverlapShadow | str = OverlapShadow.AUTO
    overlap_landing: OverlapLanding | str = OverlapLanding.AT_STEP

    def __post_init__(self) -> None:
        nbytes = parse_bytes_with_unit(self.bucket_bytes, name="OffloadConfig.bucket_bytes")
        if nbytes < 1024:
            raise ValueError(f"OffloadConfig.bucket_bytes must be >= 1 KiB, got {nbytes} bytes")
        object.__setattr__(self, "bucket_bytes", nbytes)
        object.__setattr__(
            self,
            "tile_elements",
            check_int("OffloadConfig.tile_elements", self.tile_elements, low=1024),
        )
        fraction = self.offload_fraction
        if fraction != "auto":
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
                raise ValueError(
                    f"OffloadConfig.offload_fraction must be a number in [0, 1] or 'auto', "
                    f"got {fraction!r}"
                )
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(
                    f"OffloadConfig.offload_fraction must be in [0, 1] or 'auto', got {fraction!r}"
                )
        if not (isinstance(self.auto_headroom, (int, float)) and 0 <= self.auto_headroom < 1):
            raise ValueError(
                f"OffloadConfig.auto_headroom must be in [0, 1), got {self.auto_headroom!r}"
            )
        if self.max_grad_norm is not None:
            check_positive_finite("OffloadConfig.max_grad_norm", self.max_grad_norm)
        check_positive_finite("OffloadConfig.collective_timeout", self.collective_timeout)
        object.__setattr__(
            self,
            "speculation_bytes",
            parse_bytes_with_unit(self.speculation_bytes, name="OffloadConfig.speculation_bytes"),
        )
        for name in ("overlap_step", "skip_nonfinite", "speculative_step"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"OffloadConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.moments_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"OffloadConfig.moments_dtype must be 'float32' or 'bfloat16', "
                f"got {self.moments_dtype!r}"
            )
        if not isinstance(self.loss_scaler, LossScalerConfig):
            raise TypeError(
                f"OffloadConfig.loss_scaler must be a LossScalerConfig, got {self.loss_scaler!r}"
            )
        if self.nvme_dir is not None:
            if not isinstance(self.nvme_dir, (str, os.PathLike)) or not os.fspath(self.nvme_dir):
                raise TypeError(
                    f"OffloadConfig.nvme_dir must be a directory path (str or os.PathLike), "
                    f"got {self.nvme_dir!r}"
                )
            # ``~`` is the user's home, as in a shell; the directory itself is checked when
            # the optimizer opens it (Note [the directory is checked and private]).
            object.__setattr__(self, "nvme_dir", os.path.expanduser(os.fspath(self.nvme_dir)))
        if self.host_budget is not None:
            if self.nvme_dir is None:
                raise ValueError(
                    f"OffloadConfig.host_budget={self.host_budget!r} needs nvme_dir, the place "
                    "for the state that does not fit it; set nvme_dir='/path/on/local/nvme' or "
                    "leave host_budget=None (all state in host RAM)"
                )
            if self.host_budget != "auto":
                object.__setattr__(
                    self,
                    "host_budget",
                    parse_bytes_with_unit(self.host_budget, name="OffloadConfig.host_budget"),
                )
        elif self.nvme_dir is not None:
            object.__setattr__(self, "host_budget", "auto")
        for name in ("offload_parameters", "partition_parameters"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"OffloadConfig.{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(
            self,
            "prefetch_layers",
            check_int("OffloadConfig.prefetch_layers", self.prefetch_layers, low=0),
        )
        self._check_grad_staging()
        if self.offload_parameters:
            for name, value, fix in (
                ("offload_fraction", self.offload_fraction != 1.0, "offload_fraction=1.0"),
                ("overlap_step", self.overlap_step, "overlap_step=False"),
            ):
                if value:
                    raise ValueError(
                        f"OffloadConfig.offload_parameters=True does not combine with "
                        f"{name}={getattr(self, name)!r} yet (the pinned training-dtype copy "
                        f"must be in host RAM and current before each forward); set {fix}"
                    )
        if self.partition_parameters:
            self._check_partition()

    def _check_partition(self) -> None:
        """What ``partition_parameters=True`` does not combine with (docs/parameter-
        offload.md, "Shards on the device")."""
        for name, value, fix, why in (
            (
                "offload_fraction",
                self.offload_fraction != 1.0,
                "offload_fraction=1.0",
                "optimizer state on the device is not partitioned",
            ),
            (
                "overlap_step",
                self.overlap_step,
                "overlap_step=False",
                "each shard must be current before the next forward gathers it",
            ),
            (
                "nvme_dir",
                self.nvme_dir is not None and not self.offload_parameters,
                "nvme_dir=None, or offload_parameters=True as well (one rank only)",
                "the optimizer state under device shards is in host RAM only",
            ),
        ):
            if value:
                raise ValueError(
                    f"OffloadConfig.partition_parameters=True does not combine with "
                    f"{name}={getattr(self, name)!r} ({why}); set {fix}"
                )

    def _check_grad_staging(self) -> None:
        """``grad_staging`` and what refuses ``"in_flight"``: settings that need every
        gradient before any update (Note [gradient staging for the buckets in flight])."""
        staging = GradStaging.parse(self.grad_staging, name="OffloadConfig.grad_staging")
        object.__setattr__(self, "grad_staging", staging)
        accumulation = GradAccumulation.parse(
            self.grad_accumulation, name="OffloadConfig.grad_accumulation"
        )
        object.__setattr__(self, "grad_accumulation", accumulation)
        shadow = OverlapShadow.parse(self.overlap_shadow, name="OffloadConfig.overlap_shadow")
        object.__setattr__(self, "overlap_shadow", shadow)
        landing = OverlapLanding.parse(self.overlap_landing, name="OffloadConfig.overlap_landing")
        object.__setattr__(self, "overlap_landing", landing)
        if landing is OverlapLanding.AT_FIRST_USE and not self.overlap_step:
            raise ValueError(
                "OffloadConfig(overlap_landing='at_first_use') defers the wait for the "
                "delayed update's weight copies, but overlap_step=False: a plain step() "
                "copies each tile as it is written. Set overlap_step=True, or leave "
                "overlap_landing='at_step'"
            )
        object.__setattr__(
            self,
            "grad_staging_buffers",
            check_int("OffloadConfig.grad_staging_buffers", self.grad_staging_buffers, low=1),
        )
        if staging is not GradStaging.IN_FLIGHT:
            return
        for name, value, why in (
            ("max_grad_norm", self.max_grad_norm is not None, "clipping needs the global norm"),
            ("skip_nonfinite", self.skip_nonfinite, "a skip needs every gradient's check"),
            ("speculative_step", self.speculative_step, "a rollback reads the gradients again"),
            ("overlap_step", self.overlap_step, "the delayed update reads them a step later"),
            ("offload_fraction", self.offload_fraction != 1.0, "resident buckets step later"),
        ):
            if value:
                raise ValueError(
                    f"OffloadConfig(grad_staging='in_flight') steps each bucket during "
                    f"backward and reuses its staging at once, but {name}="
                    f"{getattr(self, name)!r} keeps every gradient until step() ({why}). "
                    f"Use grad_staging='per_bucket' (the default) with {name}, or drop {name}"
                )
