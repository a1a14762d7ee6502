"""Hooks and backward state: where gradients go, in what order, and when a backward ends.

One ``BackwardRouter`` per optimizer. Each trainable parameter's post-accumulate-grad hook
hands its gradient to its bucket (Note [a bucket's gradient lifecycle] in
``lifecycle.py``). The hooks hold the router weakly and the router holds no reference
to the optimizer, so an optimizer that is dropped without ``close()`` is collected, and its
finalizer removes the hooks (Note [lifetimes without close] in ``lifetime.py``).

Note [end of backward, once per backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The end of a backward is a callback queued on autograd's graph task the first time one of
our hooks fires in it (keyed by ``torch._C._current_graph_task_id()``, so a backward that
raised and never ran its callbacks cannot block the next one). Reentrant activation
checkpointing (``use_reentrant=True``) runs each segment's backward as a nested graph task:
its callback fires while the outer task is still executing a node
(``torch._C._current_autograd_node()`` is that node), so it is not the end; it hooks the
outer node instead, whose post-hook queues the callback on the outer task. The buckets are
therefore flushed once per real backward, not once per checkpointed segment, and several
``backward()`` calls on one graph (``retain_graph=True``) are several backwards.

The order buckets go to the host in is the ranks' ``BucketOrder`` (``order.py``).

Note [a gradient set by hand]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ``.grad`` set by hand (``param.grad = g``) is taken in at the step (``receive``), as a
hook takes one, and so is stepped as torch steps it, where no backward of the window gave
that parameter a gradient (``BucketGrads.arrived``). Where one did, that gradient left for
the bucket and ``.grad`` was None after it: torch would step the ``.grad`` set in its place,
while taking it in would step their sum, so it is refused and left on ``.grad``, nothing
taken. What cannot be seen: ``param.grad = None`` after a backward (it was None already);
docs/gradient-semantics.md says what to do instead. (``model.zero_grad()`` reaches the
window: Note [zero_grad from elsewhere reaches the window] in ``torch_zero_grad.py``.)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..accelerator.capture import eager_only
from ..collectives import surface_collective_errors
from ..hook_errors import reported
from ..memory.manager import TieredMemoryManager
from .flat_bucket import FlatBucket
from .grads.lifecycle import GradState
from .grads.order import AnnouncedStep, BucketOrder, bucket_order
from .ranks import Ranks

__all__ = ["BackwardRouter"]


def _engine() -> Any:
    return torch.autograd.Variable._execution_engine


# Note [the router's hooks run eagerly]
# Autograd calls the gradient hooks and the end-of-backward callback inside whatever frame
# evaluation is active: a backward inside a torch.compile'd function (or under compiled
# autograd) had dynamo trace them, into the copies' capture refusal (which blamed the step),
# or, with nothing to copy, into compiling the library's bookkeeping (18 graphs, a recompile
# limit hit). They are torch.compiler.disable'd, as the activation hooks are: dynamo breaks
# the graph there and they run eagerly (about 0.6 µs a call outside compile).


@eager_only
def _on_grad(
    ref: weakref.ReferenceType[BackwardRouter],
    bucket: FlatBucket,
    slot_index: int,
    param: torch.Tensor,
) -> None:
    router = ref()
    if router is not None:
        router.on_grad(bucket, slot_index, param)


@eager_only  # Note [the router's hooks run eagerly]
def _on_task_end(ref: weakref.ReferenceType[BackwardRouter], task: int) -> None:
    router = ref()
    if router is None:
        return
    with router._lock:
        router._armed.discard(task)
    node = torch._C._current_autograd_node()
    if node is not None:
        # A nested graph task (reentrant checkpointing): the outer backward goes on.
        # See Note [end of backward, once per backward].
        fired = [False]

        @eager_only
        def rearm(*_: object) -> None:
            if fired[0]:  # the hook stays on the node; a retained graph may run it again
                return
            fired[0] = True
            outer = ref()
            if outer is not None:
                outer.arm()

        node.register_hook(rearm)
        return
    with surface_collective_errors():
        router.end_backward()


class BackwardRouter:
    """The optimizer's hooks, the end-of-backward callback and the bucket order.

    Fields:
        buckets: every bucket, in the fixed order (``plan_buckets``' backward order within
            each segment); extended by ``add_param_group``.
        backwards: completed backwards so far (for tests and the profiler).
        _armed: graph task ids with an end callback queued; guarded by ``_lock`` (hooks may
            run on autograd's device threads).
        order: in what order buckets go to the host (``order.py``), from the ranks.
        owner: the optimizer's class name, as refusals name it (a name, not a reference:
            the router holds none to the optimizer).
        _strays_checked: whether the hand-set gradients now being taken in (``receive``,
            from the optimizer's stray-gradient pass) were all checked to be dense; reset
            by ``finish`` and ``discard``, which end that pass.
    """

    def __init__(
        self, ranks: Ranks, manager: TieredMemoryManager, *, owner: str = "the offload optimizer"
    ) -> None:
        self.ranks = ranks
        self.manager = manager  # zero_grad after an interrupted backward waits on it
        self.owner = owner
        self.buckets: list[FlatBucket] = []
        self.backwards = 0
        self._hooks: list[Any] = []
        #: Each routed parameter's hook, by id(param): Note [the optimizer's hook runs last]
        #: in torch_hook_order.py moves it behind hooks registered later.
        self._hook_ids: dict[int, int] = {}
        self._armed: set[int] = set()
        self._lock = threading.Lock()
        self.order: BucketOrder = bucket_order(ranks)
        #: The announced step (Note [stepping during backward] in update/eager.py), from
        #: announce_step() until step() takes it; set and cleared by the optimizer.
        self.eager: AnnouncedStep | None = None  # an update.eager.EagerStep
        # A step consumed the window: the next gradient opens a new one for every bucket
        # (Note [a bucket's gradient lifecycle]: buckets without a gradient in the new
        # window must not keep the old one).
        self._window_consumed = False
        self._strays_checked = False

    def add(self, buckets: list[FlatBucket]) -> None:
        """Route the gradients of ``buckets``' parameters (appended to the order)."""
        ref = weakref.ref(self)
        for bucket in buckets:
            for slot_index, param in enumerate(bucket.params):
                hook: Callable[[torch.Tensor], None] = functools.partial(
                    _on_grad, ref, bucket, slot_index
                )
                # Note [errors raised inside autograd hooks] in hook_errors.py
                handle = param.register_post_accumulate_grad_hook(reported(hook))
                self._hooks.append(handle)
                self._hook_ids[id(param)] = handle.id
        self.buckets.extend(buckets)
        self.order.buckets_added()

    def remove_hooks(self) -> None:
        """Stop receiving gradients (``close`` and the finalizer)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._hook_ids.clear()

    def keep_last(self, param: torch.Tensor) -> None:
        """Move ``param``'s hook behind every hook registered on it so far (Note [the
        optimizer's hook runs last] in ``torch_hook_order.py``)."""
        hooks = param._post_accumulate_grad_hooks
        key = self._hook_ids.get(id(param))
        if hooks is not None and key in hooks:
            # Popped and set again, not move_to_end: autograd walks the dict's own storage
            # (PyDict_Next), which move_to_end leaves in insertion order.
            hooks[key] = hooks.pop(key)

    # -- one gradient ------------------------------------------------------------------

    def on_grad(self, bucket: FlatBucket, slot_index: int, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook of one parameter."""
        grad = param.grad
        if grad is None:
            return
        if self.eager is not None and self.eager.backward_ended:
            raise RuntimeError(
                "a backward after backward(step=True)/announce_step() and before step(): "
                "the announced step already ran, without this backward's gradients. Call "
                "step() first, or announce the step on the last micro-batch only"
            )
        if grad.layout is not torch.strided:
            param.grad = None  # refused: it must not reach a later step as a hand-set one
            raise self._sparse_refusal(bucket, slot_index, grad, "got")
        self.arm()
        param.grad = None  # released now: the device keeps about two buckets of gradients
        slot = bucket.layout.slots[slot_index]
        if param.data_ptr() != bucket.weights_dev[slot.offset :].data_ptr():
            # Replaced behind the optimizer: step() refuses with the parameter's name
            # (Note [parameters replaced behind the optimizer]); its gradient has no slot.
            return
        with surface_collective_errors():
            self._take(bucket, slot_index, grad)

    def _sparse_refusal(
        self, bucket: FlatBucket, slot_index: int, grad: torch.Tensor, how: str
    ) -> ValueError:
        param = bucket.params[slot_index]
        return ValueError(
            f"parameter {bucket.layout.slots[slot_index].index} (shape {tuple(param.shape)}) "
            f"{how} a sparse gradient ({grad.layout}); {self.owner} needs dense ones (e.g. "
            "nn.Embedding(sparse=False), or .grad = g.to_dense())"
        )

    def land(self) -> None:
        """Every window summed on the device lands on the host (the step, or its norm, is
        next): Note [micro-batches add up on the device] in ``grads/device_acc.py``."""
        for bucket in self.buckets:
            bucket.gradients.land()

    def consumed(self) -> None:
        """A step consumed the window (the next gradient opens a new one); its staging may
        be reused once the host worker's queue is done (Note [gradient staging for the
        buckets in flight] in ``staging_ring.py``)."""
        self._window_consumed = True
        for bucket in self.buckets:
            bucket.gradients.window_consumed()

    def _open_window(self) -> None:
        self._window_consumed = False
        for bucket in self.buckets:
            if bucket.grads.state is GradState.CONSUMED:
                bucket.grads.discard()  # no device buffer to release in CONSUMED

    def receive(self, bucket: FlatBucket, slot_index: int, grad: torch.Tensor) -> None:
        """Take in one gradient set by hand (``param.grad = g``, not by autograd: the
        optimizer's stray-gradient pass, which has just set that ``.grad`` to None), as the
        hook takes one. The first call of a pass checks every parameter's gradient, so that a
        sparse one is refused before any of them is taken: then the refused gradient is put
        back on its ``.grad`` and nothing has changed."""
        refused: Exception | None = None
        if grad.layout is not torch.strided:
            refused = self._sparse_refusal(bucket, slot_index, grad, "has")
        elif not self._strays_checked:
            refused = self._stray_refusal(bucket, slot_index)
        if refused is not None:
            bucket.params[slot_index].grad = grad  # as it was: nothing is taken
            raise refused
        self._strays_checked = True
        self._take(bucket, slot_index, grad)

    def _stray_refusal(self, first: FlatBucket, first_slot: int) -> Exception | None:
        """Why the hand-set gradients of this pass cannot be taken (the first one, ``first``'s
        ``first_slot``, already off its ``.grad``): a sparse one, or one set after a backward
        of this window gave its parameter a gradient (Note [a gradient set by hand])."""
        for bucket in self.buckets:
            for slot_index, param in enumerate(bucket.params):
                ours = bucket is first and slot_index == first_slot
                grad = param.grad
                if grad is None and not ours:
                    continue
                if grad is not None and grad.layout is not torch.strided:
                    return self._sparse_refusal(bucket, slot_index, grad, "has")
                if not bucket.grads.opens_window and bucket.grads.arrived[slot_index]:
                    return self._replaced_refusal(bucket, slot_index)
        return None

    def _replaced_refusal(self, bucket: FlatBucket, slot_index: int) -> RuntimeError:
        param = bucket.params[slot_index]
        return RuntimeError(
            f"parameter {bucket.layout.slots[slot_index].index} (shape {tuple(param.shape)}) "
            "has a .grad set by hand after a backward of this window gave it a gradient, "
            f"which went to {self.owner}'s buckets and left .grad None: torch would step the "
            ".grad you set in place of that gradient, but it cannot be taken back from the "
            "buckets, and adding yours would step the sum. Edit gradients with a hook "
            "(param.register_hook) before backward, or call zero_grad() to drop the "
            "window's gradients before setting .grad. A loop that fills missing gradients "
            "with zeros (if p.grad is None: p.grad = zeros) sees None on every parameter "
            "here, so it is refused too: drop it, or fill only the parameters no backward "
            "reached (Note [a gradient set by hand]): nothing was taken"
        )

    def _take(self, bucket: FlatBucket, slot_index: int, grad: torch.Tensor) -> None:
        """Add one gradient to its bucket; flush what is ready, in the ranks' order."""
        if self._window_consumed:
            self._open_window()
        self.order.receive(self, bucket, slot_index, grad)

    def finished(self, indices: list[int]) -> None:
        """The buckets ``indices`` get no more gradients in this backward on this rank
        (ZeRO-3: their units' backward is over, Note [a sharded unit] in
        ``params/sharded_fetch.py``): they go in their turn, not at the end of backward."""
        if self._window_consumed:
            self._open_window()
        self.order.finished(self, indices)

    # -- the end of a backward ---------------------------------------------------------

    def arm(self) -> None:
        """Queue the end-of-backward callback on the current graph task, once per task."""
        task = torch._C._current_graph_task_id()
        with self._lock:
            if task in self._armed:
                return
            self._armed.add(task)
        _engine().queue_callback(functools.partial(_on_task_end, weakref.ref(self), task))

    @property
    def open(self) -> bool:
        """Whether a backward's gradients are not all handed on yet (running, or raised)."""
        return (
            bool(self._armed)
            or self.order.in_progress
            or any(b.grads.holds_device_buffer for b in self.buckets)
        )

    def end_backward(self) -> None:
        """Flush what arrived (several ranks: every remaining bucket, in order) and expect
        every parameter again in the next backward."""
        self.order.end_backward(self)
        self.order.reset()
        for bucket in self.buckets:
            bucket.grads.end_backward()
        self.backwards += 1

    def finish(self) -> None:
        """Close a backward that has not ended (step time, or its callback never ran
        because it raised), so nothing of it is left in flight."""
        self._strays_checked = False
        if self.open:
            self.end_backward()
        with self._lock:
            self._armed.clear()

    def discard(self) -> None:
        """``zero_grad``: forget every gradient of the window, in flight or not."""
        if self.open:
            # A backward that did not end (it raised, or was interrupted): wait for what it
            # queued before its buffers go (Note [an interrupted gradient path] in
            # to_host.py). Synchronisation point, on that path only. A stream's own
            # failure is sticky and is raised by the next step, not here.
            with contextlib.suppress(Exception):
                self.manager.synchronize()
        with self._lock:
            self._armed.clear()
        self.order.reset()
        self._window_consumed = False
        self._strays_checked = False
        for bucket in self.buckets:
            bucket.discard()
