"""The constructor's checks of its arguments, on every rank together: the optimizer's process
group first (its deadline is the config's), then the checks, then the first comparison
across the ranks (``agree_on_arguments``: the optimizer, its rule and the config fields
every rank must set alike, or this rank's refusal; Notes [the ranks build alike], [a rank
that fails alone] in ``rank_agreement.py``), before any other group or buffer is made."""

from __future__ import annotations

import contextlib
from typing import Any

import torch.distributed as dist

from ..collectives import Comm
from ..config import OffloadConfig, OverlapLanding
from ..views.in_flight import compile_refusal
from .checks import refuse_whole_parameter_features
from .rank_agreement import agree_on_arguments
from .ranks import optimizer_comm
from .rule.base import OptimizerRule

__all__ = ["check_param_offload", "checked_comm", "windows_parameters"]


def windows_parameters(config: OffloadConfig, comm: Any) -> bool:
    """Whether the optimizer keeps a window of units' weights on the device (Note [the
    parameter window] in ``params/offloader.py``): with ``offload_parameters``, and with
    ``partition_parameters`` on several ranks (ZeRO-3, Note [shards on the device] in
    ``params/device_shards.py``); one rank's shard is the whole model, kept on the device
    as without partitioning."""
    return config.offload_parameters or (config.partition_parameters and comm is not None)


def check_param_offload(config: OffloadConfig, comm: Any, model: Any, layers: Any) -> None:
    """Refuse model=/layers= without parameter offload or partitioning, and a window
    without a model. Parameter offload with several ranks is ZeRO-3 with offload (Note [a
    sharded unit] in ``params/sharded_fetch.py``); with ``nvme_dir`` too, each rank's home
    shards beyond ``host_budget`` live in its own weight files (ZeRO-Infinity, Note [sharded
    homes on NVMe] there); partitioning alone there is ZeRO-3 with the shards on the device."""
    if windows_parameters(config, comm):
        if model is None:
            switch = "offload_parameters" if config.offload_parameters else "partition_parameters"
            raise ValueError(
                f"OffloadConfig({switch}=True) needs the model whose blocks it "
                "fetches: pass model=<the nn.Module> (and layers=<its blocks>, by default "
                "the nn.ModuleList holding the most parameters)"
            )
    elif (model is not None or layers is not None) and not config.partition_parameters:
        raise ValueError(
            "model= and layers= are for parameter offload or partitioning; set "
            "OffloadConfig(offload_parameters=True) or partition_parameters=True, or leave "
            "them None"
        )


def _check(
    name: str,
    rule: OptimizerRule,
    defaults: dict[str, Any],
    config: OffloadConfig,
    comm: Comm | None,
    model: Any,
    layers: Any,
) -> None:
    """Everything the constructor checks before it builds, on this rank."""
    rule.check_group(defaults, where=name)
    if config.overlap_step and config.offload_fraction != 1.0:
        raise ValueError(
            "OffloadConfig.overlap_step delays the CPU update by one step; it needs all "
            f"state on the host (offload_fraction=1.0), got {config.offload_fraction!r}"
        )
    landing = config.overlap_landing is OverlapLanding.AT_FIRST_USE
    refusal = compile_refusal() if landing else None  # Note [weights landed at their first use]
    if refusal is not None:
        raise ValueError(refusal)
    # Note [rules that read a whole parameter] in rule/base.py.
    refuse_whole_parameter_features(
        name, rule, config, ranks=1 if comm is None else comm.world_size
    )
    if comm is not None and config.offload_fraction != 1.0:
        raise ValueError(
            f"{comm.where()}: OffloadConfig.offload_fraction must be 1.0 with several "
            f"ranks (device-resident optimizer state is not partitioned yet), got "
            f"{config.offload_fraction!r}"
        )
    check_param_offload(config, comm, model, layers)


def checked_comm(
    name: str,
    rule: OptimizerRule,
    defaults: dict[str, Any],
    config: OffloadConfig,
    *,
    process_group: Any,
    model: Any,
    layers: Any,
) -> Comm | None:
    """The optimizer's ``Comm`` (``optimizer_comm``), once the constructor's checks passed
    on every rank and the ranks agree on the optimizer, rule and config; else this rank's
    refusal, or a ``ValueError`` naming the rank that refused or the first difference,
    with the group made for the optimizer destroyed (Note [a rank that fails alone] in
    ``rank_agreement.py``)."""
    comm = optimizer_comm(process_group, timeout=config.collective_timeout)
    try:
        refused: Exception | None = None
        try:
            _check(name, rule, defaults, config, comm, model, layers)
        except Exception as exc:
            refused = exc
        # Raises ``refused`` here, or what another rank refused, or the first difference.
        agree_on_arguments(name, rule=rule, config=config, comm=comm, refused=refused)
    except BaseException:
        if comm is not None and process_group is None:  # made for this optimizer
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(comm.group)
        raise
    return comm
