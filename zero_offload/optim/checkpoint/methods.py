"""``OffloadOptimizer``'s checkpoint methods: ``state_dict``/``load_state_dict`` (torch's
layout, Note [torch's state-dict hooks] around them) and the streaming pair that never holds
the state in host RAM (``streaming.py``). A mixin over the optimizer's ``_policy``,
``buckets``, ``param_groups``, ``comm``, ``scaler``, ``skipped_steps``, ``rule``, ``config``,
``closed``, ``_check_open`` and torch's ``register_step_pre_hook``.

Note [a refused step changes nothing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A load cut short leaves an optimizer whose steps must refuse until a load completes (Note
[a load cut short] in ``update/resume.py``). The refusal is a step pre-hook, which the load
registers when its copy stops and the next complete load removes (``LoadGuard.finish``):
torch runs it before ``step()``'s body, so it comes before the closure's forward and
backward, before an announced step is landed, and before the window's statistics and a skip
on overflow (which would move the loss scaler). ``close()`` shares the rest of ``step()``'s
path (it settles the update mode) and must still close, publishing nothing: the mode has no
pending update while the load is cut. After ``close()`` the hook stays quiet and ``step()``
says it was closed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ...caller_warning import warn_caller
from ...error_marks import said_to_caller
from ..update.resume import LoadGuard
from . import streaming
from .state_dict import load_optimizer_state, optimizer_state
from .torch_hooks import load_with_hooks, save_with_hooks

__all__ = ["Checkpoints"]


class Checkpoints:
    """The optimizer's checkpoint methods (see the module's docstring)."""

    _policy: Any  # the optimizer's StepPolicy; the rest: its own attributes
    buckets: Any
    param_groups: Any
    comm: Any
    scaler: Any
    skipped_steps: Any
    rule: Any
    config: Any
    closed: Any
    _check_open: Any
    register_step_pre_hook: Any

    # What these raise reached the caller: Note [an error reaches the caller once].
    @said_to_caller
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``) plus ``master``
        per parameter and the loss scaler under ``zero_offload``. Tensors are CPU copies.

        Reads the state without changing training: with ``overlap_step`` it waits for the
        pending update but does not publish it (Note [delayed parameter update])."""
        self._check_open("state_dict")
        # Note [a load cut short] in update/resume.py
        self._policy.mode.load.refuse(f"{type(self).__name__}.state_dict()", nothing=_UNSAVED)
        return save_with_hooks(self, self._state_dict)  # Note [torch's state-dict hooks]

    def _state_dict(self) -> dict[str, Any]:
        self._policy.land_if_ran()  # the step has happened; the next step() only takes it
        self._policy.mode.drain()
        return optimizer_state(
            self.buckets,
            self.param_groups,
            comm=self.comm,
            scaler=self.scaler,
            skipped_steps=self.skipped_steps,
            rule=self.rule,
            **self._policy.mode.saved_pending(self.buckets),
        )

    @said_to_caller
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s output (or a ``torch.optim.AdamW`` one, whose missing
        master weights are taken from the parameters). Everything is checked before anything
        changes: a mismatch raises and leaves the optimizer as it was. A load cut short while
        it copies (Ctrl-C) is redone by calling it again with the same dict; until then
        ``step()`` and the saves refuse (Note [a load cut short] in ``update/resume.py``)."""
        self._check_open("load_state_dict")
        load_with_hooks(self, state_dict, self._load_state_dict)  # Note [torch's state-dict hooks]

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._policy.mode.drain()
        # An announced step that ran is superseded by the loaded state; the window's
        # gradients stay, and the next step() steps from what was loaded. Cut short, the
        # announced step stays for the load that redoes this one to supersede.
        with self._cut_recorded() as guard:
            with self._policy.superseding_eager():
                loaded = load_optimizer_state(
                    self.buckets,
                    self.param_groups,
                    state_dict,
                    comm=self.comm,
                    scaler=self.scaler,
                    rule=self.rule,
                    guard=guard,
                    call="opt.load_state_dict(state_dict)",
                )
            self._policy.drop_eager()
            self._policy.loaded(loaded.scaler_state, loaded.skipped_steps, loaded.pending_update)
        if loaded.fields_dropped and (self.config.overlap_step or self.scaler.skips_overflow):
            # Note [our fields ride in the first param group] in group_fields.py
            warn_caller(
                "load_state_dict: this state holds zero-offload's fp32 master weights but "
                "none of its own fields (the loss scaler, the skip count, whether an "
                "overlap_step update was pending): it came by a route that keeps only each "
                "group's own keys, such as torch.distributed.checkpoint with "
                "flatten_optimizer_state_dict=True. A pending update saved with it is lost "
                "(the model resumes one update behind) and the fp16 loss scale goes on from "
                "this optimizer's. Save with opt.state_dict() or unflattened DCP (the "
                "default), or call opt.flush_pending_update() before a flattened save"
            )

    @said_to_caller
    def save_streaming(self, path: str | os.PathLike[str]) -> None:
        """Write the state under ``path/rank{r}/`` bucket by bucket, tile by tile, never
        holding it in host RAM (``checkpoint/streaming.py``). Every rank calls it with the same
        ``path``. Like ``state_dict()`` it changes nothing about training."""
        self._check_open("save_streaming")
        # Note [a load cut short] in update/resume.py
        self._policy.mode.load.refuse(f"{type(self).__name__}.save_streaming()", nothing=_UNSAVED)
        self._policy.mode.drain()
        streaming.save(
            path,
            self.buckets,
            self.param_groups,
            comm=self.comm,
            scaler=self.scaler,
            skipped_steps=self.skipped_steps,
            **self._policy.mode.saved_pending(self.buckets),
            tile_elements=self.config.tile_elements,
            rule=self.rule.name,
            family=self.rule.state_family,
        )

    @said_to_caller
    def load_streaming(self, path: str | os.PathLike[str]) -> None:
        """Load what ``save_streaming`` wrote under ``path/rank{r}/``, tile by tile;
        everything is checked first: a mismatch raises and changes nothing. The master
        weights come from the checkpoint (the model's weights are the caller's to load). A
        load cut short while it copies (Ctrl-C) is redone by calling it again with the same
        ``path``; until then ``step()`` and the saves refuse (Note [a load cut short] in
        ``update/resume.py``)."""
        self._check_open("load_streaming")
        self._policy.mode.drain()
        # As in load_state_dict: an announced step that ran is superseded by the loaded state.
        with self._cut_recorded() as guard:
            with self._policy.superseding_eager():
                loaded = streaming.load(
                    path,
                    self.buckets,
                    self.param_groups,
                    comm=self.comm,
                    scaler=self.scaler,
                    tile_elements=self.config.tile_elements,
                    rule=self.rule.name,
                    family=self.rule.state_family,
                    guard=guard,
                    call=f"opt.load_streaming({str(path)!r})",
                )
            self._policy.drop_eager()
            for group in self.param_groups:  # loaded keys completed as a new group's are
                self.rule.complete_group(group)  # (AdamW: Note [the decay's form is the group's])
            self._policy.loaded(loaded.scaler_state, loaded.skipped_steps, loaded.pending_update)

    @contextlib.contextmanager
    def _cut_recorded(self) -> Iterator[LoadGuard]:
        """Around a load: if it leaves while its copy is part-way, the guard records it and
        the steps refuse from now on (Notes [a load cut short], [a refused step changes
        nothing]); the exception leaves as itself, a note on it saying what to do."""
        guard = self._policy.mode.load
        try:
            yield guard
        except BaseException as exc:
            guard.stopped(exc)
            if guard.cut and guard.hook is None:
                guard.hook = self.register_step_pre_hook(_refuse_step)
            raise


#: What a save refused by a load cut short left undone.
_UNSAVED = "nothing was saved"


def _refuse_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The step pre-hook of Note [a refused step changes nothing]."""
    if not optimizer.closed:  # closed: step() says so itself
        what = f"{type(optimizer).__name__}.step()"
        optimizer._policy.mode.load.refuse(what, nothing="nothing was stepped")
