"""Reads of released parameters by user code, outside the window: each unit in a device
buffer of its own (``PrivateReads``, mixed into ``ParamOffloader``).

Note [a read outside the window lands privately]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
User code may read any parameter at any time: a decoder reusing an encoder's weight
(``F.linear(h, enc[i].weight.t())``), ``parameters_to_vector(model.parameters())``, an EMA
``torch._foreach_lerp_(ema, list(model.parameters()), w)``. Each such read keeps what it got:
a view (``.t()``, ``.view(-1)``, ``.detach()``) saved by autograd or held in a list, read
later. Fetching the unit into its slot would evict the slot's occupant (its views, held by
user code or saved by autograd, would then read this unit's bytes), and the window's next
move would overwrite the slot under the new views in turn. So ``materialize`` never
touches a slot: the unit lands in a *private* device buffer of its own
(``ParamUnit.fetch_private``: the same copies, from the homes or through the bounce ring,
into the buckets' ranges of that buffer), waited for, and its parameters are views of it
until the unit is released as any resident unit is: by the window's next move (whose uses
fetch into the slot), the end of a backward, a step. A release gives the buffer back to the
device budget; a view user code or autograd still holds keeps its storage alive (torch's
refcount) and the values it had, which are the live weights until the next step or write.

Budget: each private buffer is allocated from the device budget (``allocate_device``,
``ParamUnit.private_bytes()``: the unit's slot bytes). When it does not fit, the units
landed privately earlier are released, oldest first, except those landed by the torch call
under way (``released.current_call``: one call reading several released parameters needs
them all at once); if that is not enough and the call holds other units,
``DeviceBudgetExceeded`` names the unit, its parameters and the fix. A budget sized for
training alone (the estimator counts no private buffer) has no room even for one: the read
then goes into the unit's slot, as before private landing (evicting the slot's occupant),
and a warning, once, says what that means for views kept. A released buffer still
referenced by a view user code keeps (``parameters_to_vector`` keeps every view until its
``cat``) is user memory, as a tensor user code allocates is: the budget no longer counts it.

With several ranks the read goes into the slot as before (a gather into the slot, in the
ranks' order: Note [a sharded unit] in ``sharded_fetch.py``); docs/parameter-offload.md
lists that limit.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..caller_warning import warn_caller
from ..config import format_bytes
from ..errors import DeviceBudgetExceeded
from ..memory.manager import TieredMemoryManager
from . import released
from .unit import ParamUnit

__all__ = ["PrivateReads"]


class PrivateReads:
    """``ParamOffloader``'s landing of a read outside the window (Note [a read outside the
    window lands privately]). Uses the offloader's ``manager``, ``name`` and ``_fetch``;
    keeps ``_private`` (units landed privately, oldest first) and ``_slot_reads_warned``."""

    manager: TieredMemoryManager
    name: str
    _private: list[ParamUnit]
    _slot_reads_warned: bool

    def _fetch(self, unit: ParamUnit, *, demand: bool) -> None:
        raise NotImplementedError  # ParamOffloader's

    def _land_for_user(self, unit: ParamUnit) -> None:
        """Note [a read outside the window lands privately]: ``unit`` in a buffer of its
        own, its copies waited for; in its slot, as the window would, when the budget has
        no room for the buffer and nothing else is held for the call."""
        if unit.resident:
            return
        occupant = unit.slot.occupant
        if occupant is not None and occupant is not unit and occupant.pending:
            occupant.finish_fetch()  # its disk reads use the slot's bounce range first
        call = released.current_call()
        buffer = self._private_buffer(unit, call)
        if buffer is None:
            self._fetch(unit, demand=True)
            return
        unit.fetch_private(self.manager, buffer)  # gives the buffer back if it raises
        unit.private_call = call
        self._private.append(unit)
        try:
            unit.use(self.manager)
            if unit.fetched is not None:
                # Synchronisation point: user code reads the weights next, and a release
                # may give the buffer back while the copies are queued; a fetch for user
                # code is waited for (Note [a released parameter]).
                unit.fetched.synchronize()
                unit.fetched = None
        except BaseException:
            # A failed read (NVMe) leaves the unit released and the buffer given back, not
            # FETCHING over a buffer nobody filled (later reads would see its garbage).
            with contextlib.suppress(Exception):  # the read's error is the one to raise
                unit.release()
            raise

    def _private_buffer(self, unit: ParamUnit, call: int | None) -> Any:
        """A device buffer of ``unit.private_bytes()``, within the budget: units landed
        privately by earlier calls are released, oldest first, until it fits. None when it
        cannot fit and the call holds no other unit: the read then goes into the slot."""
        nbytes = unit.private_bytes()
        what = f"{self.name} {unit!r} read outside the window"
        accelerator = self.manager.accelerator
        while True:
            self._private = [u for u in self._private if u.private is not None]
            try:
                return accelerator.allocate_device(nbytes, what=what)
            except DeviceBudgetExceeded as error:
                older = [u for u in self._private if call is None or u.private_call != call]
                if older:
                    older[0].release()
                    continue
                if not self._private:
                    self._warn_slot_read(unit, nbytes)
                    return None
                names = ", ".join(unit.spec.param_names[:4])
                more = len(unit.spec.param_names) - 4
                stats = accelerator.memory_stats()
                raise DeviceBudgetExceeded(
                    f"reading parameter(s) {names}{f' (+{more} more)' if more > 0 else ''} "
                    f"of {unit!r} outside the parameter-offload window, in one torch call "
                    f"with {len(self._private)} other unit(s), needs a device copy of each "
                    f"({format_bytes(nbytes)} for this one), but the device budget is "
                    f"{format_bytes(stats['budget'])} with {format_bytes(stats['in_use'])} in "
                    "use. One torch call taking parameters of many units (e.g. "
                    "torch._foreach_* over model.parameters()) needs them all on the device "
                    "at once: split it per block, or raise the device budget "
                    "(AcceleratorConfig(device_budget=...)). Nothing was read"
                ) from error

    def _warn_slot_read(self, unit: ParamUnit, nbytes: int) -> None:
        """Once per offloader: a read outside the window went into the slot (no room)."""
        if self._slot_reads_warned:
            return
        self._slot_reads_warned = True
        warn_caller(
            f"zero-offload: reading {unit!r} outside the parameter-offload window: the device "
            f"budget has no room for a copy of its own ({format_bytes(nbytes)}), so it was "
            "read into its window slot, as the window fetches it. A view of it kept across "
            "a read of another unit that shares the slot, or across the window's next move, "
            "then shows that unit's weights: clone() what you keep, or raise the device "
            "budget (Note [a read outside the window lands privately]). Warned once",
            RuntimeWarning,
        )
