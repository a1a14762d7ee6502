"""What ``model.state_dict()`` shows for an offloaded parameter, and how a write to such an
entry reaches the parameter's home.

The hooks that call this module are registered by ``hooks.py``; the homes and their views
are ``windowed_views.py``'s.

Note [state dict entries are views of the homes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Torch's ``state_dict()`` entries alias the parameters: they show the live weights and a write
to one writes the parameter. Under parameter offload the live weights are the homes, so the
state-dict hooks on every module that registers an offloaded parameter make each entry a
view of the parameter's home (pinned host memory), never of a window slot, which holds
another unit after the next move (issue 29 item 4). The pre-hook first copies a written
resident slot home (Note [a write to a resident unit reaches its home]); a released
parameter's ``detach()`` gives its home view without fetching. Views rather than copies:
copies would not follow training (torch's entries do), would cost a model's worth of memory,
and on the device the model does not fit. The price: the entries are on the host, not on the
device as the parameters say; ``.to(device)`` them where device tensors are needed. A write
through an entry reaches the home, which the optimizer reconciles by value at its next step;
the unit's next fetch sees the home's version move and copies it afresh. ``keep_vars=True``
gives the parameters themselves, as in torch. Each entry owns a storage of exactly its
parameter's bytes (Note [a state dict entry owns a storage of its bytes] in ``windowed_views.py``), so
``torch.save`` writes the weights, not the pool. A home on NVMe (Note [homes on NVMe] in
``optim/state/nvme_plan.py``) cannot be viewed: its entries are private copies read from
disk (what a saved checkpoint needs, as FSDP's full state dict gives), and a write to such a
copy is carried to the file at the next forward, step or ``state_dict()`` while the copy is
alive (``ParamOffloader.flush_copies``); one written and dropped before then is lost (write through the
parameters or ``load_state_dict``, which reach the home, instead).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn

from .unit import ParamUnit
from .windowed_views import WindowedViews

__all__ = ["Owned", "StateDictEntries", "owners"]

#: (name in its module, unit index, bucket of the unit, parameter index in the bucket)
Owned = tuple[str, int, int, int]


def owners(model: nn.Module, units: Sequence[ParamUnit]) -> list[tuple[nn.Module, list[Owned]]]:
    """Each module of ``model`` that registers offloaded parameters, with where each of them
    lives."""
    where: dict[int, tuple[int, int, int]] = {}
    for unit in units:
        for b, views in enumerate(unit.views):
            for i, param in enumerate(views.params):
                where[id(param)] = (unit.index, b, i)
    out = []
    for module in model.modules():
        owned = [
            (name, *where[id(param)])
            for name, param in module._parameters.items()
            if param is not None and id(param) in where
        ]
        if owned:
            out.append((module, owned))
    return out


class StateDictEntries:
    """The state-dict entries handed out for one offloader's parameters: views of the homes,
    and the private copies of homes on NVMe whose writes are still to be carried home.

    Fields: ``copies``: per live copy, (the copy, weakly; its version when last carried;
    its bucket's views; the parameter's index in the bucket).
    """

    def __init__(self) -> None:
        self.copies: list[tuple[weakref.ref, int, WindowedViews, int]] = []

    def to_homes(
        self,
        units: Sequence[ParamUnit],
        owned: list[Owned],
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
    ) -> None:
        """Replace ``module``'s entries in ``state_dict`` by views of the homes (Note [state
        dict entries are views of the homes])."""
        for name, unit, bucket, index in owned:
            key = prefix + name
            param = module._parameters.get(name)
            if key not in state_dict or state_dict[key] is param:  # keep_vars=True
                continue
            views = units[unit].views[bucket]
            if views.params[index] is not param or any(p is param for _, p in views.detached()):
                continue  # replaced: its entry is what the module holds now
            state_dict[key] = entry = views.home_view(index)
            if views.nvme_home is not None:  # a copy: its writes are carried home later
                self.copies.append((weakref.ref(entry), entry._version, views, index))

    def flush(self) -> None:
        """Carry the writes made to copies of NVMe homes home; forget the copies that are
        gone."""
        alive = []
        for ref, version, views, index in self.copies:
            entry = ref()
            if entry is None or views.nvme_home is None:
                continue
            if entry._version != version:
                views.write_home(index, entry)
                version = entry._version
            alive.append((ref, version, views, index))
        self.copies = alive
