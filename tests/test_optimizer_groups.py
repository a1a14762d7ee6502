"""Each optimizer's process group (Note [a process group of the optimizer's own] in
``optim/ranks.py``, Note [the optimizer's own process group] in
``integrations/lightning.py``): every optimizer gets a group of its own, the group an
optimizer made goes when it closes (quietly when torch.distributed is torn down first),
and Lightning's strategy gives each optimizer its own and refuses shared ones."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d

from zero_offload import OffloadAdamW

from .helpers.dist import free_port, join_gloo
from .helpers.models import host_accelerator


def _groups() -> int:
    return len(distributed_c10d._world.pg_map)


def _opt(module: torch.nn.Module, group: object = None) -> OffloadAdamW:
    return OffloadAdamW(module.parameters(), process_group=group, accelerator=host_accelerator())


def _rank_entry(rank: int, world: int, port: int, out: str) -> None:
    from zero_offload.integrations.lightning import OffloadDDPStrategy, check_optimizer_groups

    join_gloo(rank, world, port)
    result: dict[str, object] = {"base": _groups()}
    first, second = _opt(torch.nn.Linear(4, 4)), _opt(torch.nn.Linear(4, 4))
    result["own"] = first.comm.group is not second.comm.group
    result["open"] = _groups()
    first.close()
    second.close()
    result["closed"] = _groups()
    given = dist.new_group()
    third = _opt(torch.nn.Linear(4, 4), given)
    third.close()
    result["given_kept"] = given in distributed_c10d._world.pg_map

    strategy = OffloadDDPStrategy()
    a, b = strategy.optimizer_process_group, strategy.optimizer_process_group
    result["strategy_new"] = a is not b
    ours = [_opt(torch.nn.Linear(4, 4), a), _opt(torch.nn.Linear(4, 4), b)]
    check_optimizer_groups(ours)  # passes: one group each
    refusals = []
    for groups in ([a, a], [None, None]):
        shared = [_opt(torch.nn.Linear(4, 4), g) for g in groups]
        if groups[0] is None:  # on the default group, as a loop passing it would be
            shared[0].close()
            shared[0] = _opt(torch.nn.Linear(4, 4), dist.group.WORLD)
        try:
            check_optimizer_groups([*ours[:1], *shared])
        except ValueError as exc:
            refusals.append(str(exc))
        for opt in shared:
            opt.close()
    result["refusals"] = refusals
    for opt in ours:
        opt.close()

    late = _opt(torch.nn.Linear(4, 4))
    dist.destroy_process_group()  # the loop tears down first: close has nothing to do
    late.close()
    result["late_closed"] = late.closed
    torch.save(result, Path(out) / f"rank{rank}.pt")


def test_each_optimizer_has_its_own_group_which_goes_at_close(tmp_path: Path) -> None:
    mp.spawn(_rank_entry, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["own"]
        assert result["open"] == result["base"] + 2  # one group per optimizer
        assert result["closed"] == result["base"]  # ... destroyed at close
        assert result["given_kept"]  # a group passed in is the caller's
        assert result["strategy_new"]
        shared, default = result["refusals"]
        assert "optimizers 0 and 1 (OffloadAdamW) share process group" in shared
        assert "optimizer 1 (OffloadAdamW) was built on the default process group" in default
        assert result["late_closed"]
