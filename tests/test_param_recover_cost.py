"""The window's bookkeeping per backward grows with the units, not with their square (Note
[the live units] in ``zero_offload/params/live_units.py``).

Each use of a unit (a forward pre-hook, a gradient hook, a recompute) looks for units an
interrupt left MOVING and for resident units that left the window. Scanning every unit at each
use costs ``units`` state tests per use, ``units**2`` per backward: 4096 per unit at 64 units
of a checkpointed chain. The count here is structural (every read of ``ParamUnit.state``), not
a timing, so it holds on a loaded machine.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.params.unit import ParamUnit, UnitState


class _CountedState:
    """``ParamUnit.state`` as a data descriptor that counts its reads."""

    def __init__(self) -> None:
        self.reads = 0

    def __get__(self, unit: Any, owner: Any = None) -> Any:
        if unit is None:
            return self
        self.reads += 1
        return unit.__dict__["state"]

    def __set__(self, unit: Any, value: UnitState) -> None:
        unit.__dict__["state"] = value


class _Chain(nn.Module):
    def __init__(self, units: int, *, checkpointed: bool, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(units))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:  # checkpointed: each backward use is a recompute first
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return x


def _reads_per_backward(units: int, *, checkpointed: bool, counter: _CountedState) -> int:
    torch.manual_seed(0)
    model = _Chain(units, checkpointed=checkpointed)
    opt = OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        model=model,
        layers=model.layers,
        config=OffloadConfig(bucket_bytes=4096, offload_parameters=True),
    )
    try:
        x = torch.randn(2, 8)
        for _ in range(2):  # the second backward follows the first forward's trace
            loss = model(x).square().sum()
            before = counter.reads
            loss.backward()
            reads = counter.reads - before
            opt.step()
            opt.zero_grad()
        return reads
    finally:
        opt.close()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "recompute"])
def test_state_tests_per_backward_grow_linearly_with_units(
    monkeypatch: pytest.MonkeyPatch, checkpointed: bool
) -> None:
    counter = _CountedState()
    monkeypatch.setattr(ParamUnit, "state", counter, raising=False)
    small = _reads_per_backward(16, checkpointed=checkpointed, counter=counter)
    large = _reads_per_backward(64, checkpointed=checkpointed, counter=counter)
    # Linear: 4x the units, about 4x the reads (the end of a backward releases every unit,
    # one scan). Quadratic would be 16x. A constant per unit bounds it too: a use looks at
    # the units in the window (prefetch_layers + 2 slots), not at every unit.
    assert large <= 5 * small, (small, large)
    assert large <= 40 * 64, (small, large)
