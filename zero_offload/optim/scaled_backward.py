"""Backwards that carry the loss scale, and the router that refuses gradients of the others.

Note [a backward carries the loss scale]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With the dynamic loss scaler (any fp16 parameter: Note [one loss scale] in
``update/loss_scaler.py``) the step divides every gradient by ``loss_scale``, so a gradient
is right only if its backward started from ``loss * loss_scale``. One from a plain
``loss.backward()`` would be stepped ``loss_scale`` times (65536 at first) too small: its
norm reported that much smaller, clipping never binding, and nothing saying so. A gradient
cannot tell whether its loss was scaled, so whoever applies the scale says so, by running
the backward inside ``ScaledBackwards.scaled()`` (``opt.scaled_backward()``):
``opt.backward(loss)`` does, and so do the integrations that scale the loss themselves
(``OffloadAccelerator.backward``, ``OffloadLightningModule.backward``, and
``OffloadTrainer.training_step``, whose ``compute_loss`` scales the loss's gradient by a
hook). The block is the claim that the scale is applied; the mark is not taken from
anywhere else (reading ``opt.loss_scale`` does not set it).

While the scaler is dynamic, a gradient whose hook fires with no such block open is refused
at that hook, before it is routed (``ScaleCheckedRouter.on_grad``): its ``.grad`` is dropped
and the backward raises, naming the parameter and the fix. Every gradient of that backward
meets the same refusal, so none of it enters the window and the optimizer is as it was. bf16
and fp32 models have no scaler and are never checked: their plain ``loss.backward()`` is
right. A ``.grad`` set by hand is taken as it is (as torch's ``GradScaler`` takes ``.grad``):
scaling it is the caller's part.

The mark is a count of open blocks shared by every thread, not a per-thread flag: autograd
runs a CUDA backward's hooks on its device threads while the thread that called
``backward`` waits inside the block. So it says that a scaled backward is running, not which
one: a plain backward run on another thread at that very moment is not caught.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from ..memory.manager import TieredMemoryManager
from .flat_bucket import FlatBucket
from .ranks import Ranks
from .router import BackwardRouter
from .update.loss_scaler import LossScaler

__all__ = ["ScaleCheckedRouter", "ScaledBackwards"]


class ScaledBackwards:
    """Whether a backward that carries the loss scale is running; Note [a backward carries
    the loss scale].

    Fields:
        owner: the optimizer, as refusals name it (``"OffloadAdamW#3"``; a name, not a
            reference: the router that holds this holds none to the optimizer).
        scaler: the dynamic loss scaler whose scale every backward must carry; None while
            the optimizer has none (no fp16 parameter). Set by ``StepPolicy.use_scaler_for``
            when the first fp16 parameters bring it, never cleared (nor is the scaler).
        _open: ``scaled()`` blocks open now, on any thread; written under ``_lock``.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.scaler: LossScaler | None = None
        self._open = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def scaled(self) -> Iterator[None]:
        """The backwards run inside carry the loss scale (the caller applied it)."""
        with self._lock:
            self._open += 1
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1

    def refusal(self, index: int, param: torch.Tensor) -> RuntimeError | None:
        """The error for parameter ``index``'s gradient arriving now, or None if it may."""
        if self.scaler is None or self._open:
            return None
        scale = f"{self.scaler.scale:g}"
        return RuntimeError(
            f"{self.owner}: parameter {index} (shape {tuple(param.shape)}) got its gradient "
            "from a backward that did not carry the loss scale. This optimizer trains fp16 "
            f"parameters, so it scales the loss by loss_scale ({scale}) and divides every "
            f"gradient by it at the step: this gradient would be stepped {scale} times too "
            "small. Call opt.backward(loss) in place of loss.backward() (OffloadTrainer, "
            "OffloadAccelerator.backward and OffloadLightningModule do it for you); code "
            "that multiplies the loss by opt.loss_scale itself runs its backward inside "
            "`with opt.scaled_backward():`. Nothing of this backward reached the optimizer"
        )


class ScaleCheckedRouter(BackwardRouter):
    """A ``BackwardRouter`` whose hooks refuse a gradient from a backward that did not carry
    the loss scale, while there is one (Note [a backward carries the loss scale])."""

    def __init__(
        self,
        ranks: Ranks,
        manager: TieredMemoryManager,
        *,
        scaled: ScaledBackwards,
        owner: str = "the offload optimizer",
    ) -> None:
        super().__init__(ranks, manager, owner=owner)
        self.scaled = scaled

    def on_grad(self, bucket: FlatBucket, slot_index: int, param: torch.Tensor) -> None:
        if param.grad is not None:
            refused = self.scaled.refusal(bucket.layout.slots[slot_index].index, param)
            if refused is not None:
                param.grad = None  # refused: it must not reach a later step as a hand-set one
                raise refused
        super().on_grad(bucket, slot_index, param)
