"""The step decision: whether a step runs, when, and with which gradient multiplier.

``StepPolicy`` owns what decides a step: the loss scaler, a one-off ``clip_grad_norm_``,
the window's statistics (global norm, overflow, which parameters got gradients, all-reduced
over the ranks), the announced step run during backward (``eager.EagerStep``) and the
update mode (``modes.ImmediateUpdate``, ``modes.DelayedUpdate``). The optimizer facade
checks what the caller did and hands the policy its buckets' hyper-parameters; the policy
never reads the optimizer.

Note [a step that needs no statistics]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The statistics (the gradients' sum of squares and overflow flag) decide a step only through
clipping (configured, or a clip_grad_norm_ call for this step), a skip on overflow (fp16's
dynamic loss scaling, or skip_nonfinite) or, with several ranks, the all-reduce that also
merges which parameters got gradients. Without any of these the step is known before the
statistics are: every parameter with a gradient takes one Adam step with the gradient
divided by the (static) loss scale. Then step() does not wait for the host worker: CPU Adam
starts on each bucket's first gradient tile as soon as it lands (Note [Adam follows the
gradient in] in ``grads/to_host.py``), and the statistics, computed meanwhile on the host
worker, are read after the update for last_grad_norm and the profiler. It is the same
arithmetic either way (bitwise; see tests/test_step_bytes.py). Kept to the plain case:
offloaded buckets only, an immediate update, no parameter offload.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ...accelerator import latest_per_stream
from ...caller_warning import warn_caller
from ...collectives import surface_collective_errors
from ...config import GradStaging, OffloadConfig
from ...memory.manager import TieredMemoryManager
from ...memory.traffic import Category
from ...tracing import phase
from ..flat_bucket import FlatBucket, StepPlan
from ..publish import Publish
from ..ranks import Ranks
from ..router import BackwardRouter
from ..rule.base import Hyper
from ..scaled_backward import ScaledBackwards
from .eager import EagerStep
from .failures import StepFailed
from .loss_scaler import DynamicLossScaler, LossScaler, NoLossScaler
from .modes import UpdateMode
from .window_clip import WindowClip

__all__ = ["StepPolicy"]

HyperOf = Callable[[FlatBucket], Hyper]


class StepPolicy:
    """One optimizer's step decision; see the module docstring.

    Fields:
        scaler: the loss scaler (Note [one loss scale] in ``loss_scaler.py``).
        scaled: which backwards carry the scale; the dynamic scaler is its ``scaler`` too
            (Note [a backward carries the loss scale] in ``scaled_backward.py``).
        mode: when an update's weights reach the device.
        eager: the announced step (Note [stepping during backward] in ``eager.py``), from
            ``announce`` until the step is taken; also the router's.
        skipped_steps, speculation_failures, last_grad_norm: what the optimizer reports.
        clip: the ``clip_grad_norm_`` bound of the gradients it measured; it holds for every
            step on them, as torch's clipped ``.grad`` does, until a backward or
            ``zero_grad`` (Note [a clip in the middle of a window] in ``window_clip.py``).
        _stats_cache: ``(backwards, sumsq, overflow, arrived)`` of the window, all-reduced
            once per window (a second read must not be a second collective).
    """

    def __init__(
        self,
        *,
        config: OffloadConfig,
        manager: TieredMemoryManager,
        ranks: Ranks,
        router: BackwardRouter,
        mode: UpdateMode,
        param_offload: Callable[[], bool],
        scaled: ScaledBackwards,
    ) -> None:
        self.config = config
        self.manager = manager
        self.ranks = ranks
        self.router = router
        self.mode = mode
        self._param_offload = param_offload  # whether parameter offload is on
        # Dynamic once any trainable parameter is fp16 (use_scaler_for); Note [one loss
        # scale] in loss_scaler.py.
        self.scaler: LossScaler = NoLossScaler()
        self.scaled = scaled
        self.eager: EagerStep | None = None
        self._eager_warned = False
        self.last_eager_share: float | None = None
        self.clip = WindowClip()  # Note [a clip in the middle of a window]
        self._stats_cache: tuple[int, float, bool, np.ndarray] | None = None
        #: Speculative steps that had to be restored and redone (Note [speculative steps]).
        self.speculation_failures = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None

    @property
    def buckets(self) -> list[FlatBucket]:
        return self.router.buckets

    def use_scaler_for(self, buckets: list[FlatBucket]) -> None:
        """The first fp16 parameters bring the dynamic scaler (``autocast_fp16``: the first
        buckets of any dtype): Note [one loss scale]."""
        if self.scaler.skips_overflow or not buckets:
            return
        if self.config.loss_scaler.autocast_fp16 or any(b.dtype == torch.float16 for b in buckets):
            self.scaler = DynamicLossScaler(self.config.loss_scaler)
            self.scaled.scaler = self.scaler  # Note [a backward carries the loss scale]

    def window_changed(self) -> None:
        """A gradient entered the window outside backward: the statistics are stale."""
        self._stats_cache = None

    # -- the decision --------------------------------------------------------------------

    def eager_refusal(self, *, speculative: bool | None = None) -> str | None:
        """Why a step cannot run during backward here, or None; Note [stepping during
        backward] in eager.py. ``speculative``: whether it may speculate (default
        ``OffloadConfig.speculative_step``; Note [speculative steps])."""
        reason = self.ranks.eager_refusal()
        if reason is not None:
            return reason
        if speculative is None:
            speculative = self.config.speculative_step
        if self.config.max_grad_norm is not None and not speculative:
            return (
                "clipping is configured (the norm is known only after backward; "
                "OffloadConfig(speculative_step=True) steps anyway and rolls back)"
            )
        if (self.scaler.skips_overflow or self.config.skip_nonfinite) and not speculative:
            return "an overflow could skip the step (fp16 loss scaling or skip_nonfinite)"
        reason = self.mode.eager_refusal()
        if reason is not None:
            return reason
        if any(bucket.resident for bucket in self.buckets):
            return "some optimizer state is resident on the device (offload_fraction < 1)"
        if self._param_offload() and self.config.grad_staging is not GradStaging.IN_FLIGHT:
            # Note [stepping during backward with parameter offload] in eager.py: taken
            # with in-flight staging, which needs it; per-bucket staging steps in step().
            return "parameter offload (the step writes the pinned weights the fetches read)"
        return None

    def needs_statistics(self) -> bool:
        """Whether this step's decision needs the statistics first (Note [a step that
        needs no statistics]): where a step could not run during backward unspeculated."""
        return self._clip_bound() is not None or self.eager_refusal(speculative=False) is not None

    def grad_stats(self) -> tuple[float, bool, list[np.ndarray]]:
        """Global sum of squares of the (scaled) gradients, the overflow flag, and each
        bucket's per-parameter "got a gradient" flags (OR over the ranks)."""
        generation = self.router.backwards
        on_host = [bucket for bucket in self.buckets if bucket.stats_on_host()]
        if on_host:
            # Synchronisation point: the CPU must see every gradient copied so far. Not for
            # windows summed on the device: their statistics were taken there, and CPU Adam
            # follows their landing tile by tile (Note [host syncs are counted where they
            # can block] in accelerator/host_syncs.py).
            with phase("wait_grads"), surface_collective_errors():
                self.manager.host_worker.synchronize()
        for bucket in on_host:
            bucket.grads.settled()
        with phase("grad_stats", track="cpu_optimizer"):
            shares = [bucket.grad_sumsq() for bucket in self.buckets]
            partials = [x for share in shares for x in share.partials]
            nonfinite = any(share.nonfinite for share in shares)
            on_device = [s.norms_dev for s in shares if s.norms_dev is not None]
            if on_device:
                # Synchronisation point: one device-to-host read for every resident bucket.
                norms = self.manager.accelerator.read_to_host(torch.cat(on_device)).tolist()
                partials.extend(n * n for n in norms)
                nonfinite = nonfinite or not all(math.isfinite(n) for n in norms)
        # Added exactly, rounded once: Note [the norm does not depend on the bucketing]
        # in grads/stat_cells.py.
        sumsq = math.fsum(partials)
        local = [b.grads.arrived for b in self.buckets]
        flat = torch.from_numpy(np.concatenate(local)) if local else torch.zeros(0, dtype=bool)
        if self._stats_cache is not None and self._stats_cache[0] == generation:
            sumsq, nonfinite, merged = self._stats_cache[1:]
        else:
            sumsq, nonfinite, merged_t = self.ranks.all_reduce_stats(sumsq, nonfinite, flat)
            merged = merged_t.numpy().astype(bool)
            self._stats_cache = (generation, sumsq, nonfinite, merged)
        arrived, offset = [], 0
        for bucket in self.buckets:
            n = len(bucket.layout.slots)
            arrived.append(merged[offset : offset + n])
            offset += n
        return sumsq, nonfinite, arrived

    def grad_norm(self) -> float:
        """The global L2 norm of the window's gradients, unscaled."""
        sumsq, _, _ = self.grad_stats()
        return math.sqrt(sumsq) / self.scaler.scale

    # Note [clipping by a total norm]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Several offload optimizers may train one model (OffloadMuon beside an OffloadAdamW for
    # the embeddings, as torch's Muon recipe has it). torch clips such a model by the norm of
    # all its gradients; each optimizer's clip_grad_norm_ knows only its own share, and
    # clipping each by its own norm is not that. So, as torch's get_total_norm and
    # clip_grads_with_norm_ split it, the caller adds the optimizers' grad_norm()s into the
    # total and gives it to each one's clip_grads_with_norm_, which clips by torch's
    # coefficient of that total, min(1, max_norm / (total + 1e-6)). A norm or total that is
    # not finite clips as torch's does when the step runs: an infinite one zeroes the
    # gradients (an infinite element becomes NaN), a NaN one makes them all NaN. A step that
    # the overflow handling skips (fp16's loss scaler, or skip_nonfinite) clips nothing. The
    # optimizers' loss scales must agree (clip_grad_norm_ refuses otherwise).

    def clip_once(
        self,
        max_norm: float,
        total_norm: float | None = None,
        *,
        window_norm: float | None = None,
    ) -> None:
        """Clip the window's gradients to ``max_norm`` (``clip_grad_norm_``, which measured
        their norm, ``window_norm``): every step on them (a second ``step()`` with no
        backward too) uses them clipped, as torch's. With ``total_norm``
        (``clip_grads_with_norm_``), the coefficient comes from it rather than from the
        window's own norm: several optimizers over one model clip alike."""
        self.check_clip_allowed()
        total = None if total_norm is None else float(total_norm)
        self.clip.set(float(max_norm), self.router.backwards, total, window_norm)

    def _clip_bound(self) -> tuple[float, float | None] | None:
        """The ``clip_grad_norm_`` bound of the current window's gradients and the total norm
        it is taken against (None: the window's own), if any."""
        return self.clip.bound(self.router.backwards)

    def check_clip_allowed(self) -> None:
        """Refuse clipping once a step was announced (it runs unclipped)."""
        if self.eager is not None:
            raise RuntimeError(
                "clip_grad_norm_ after backward(step=True)/announce_step(): the step ran "
                "during backward, unclipped. Configure clipping up front with "
                "OffloadConfig(max_grad_norm=...) (the step then runs in step()), or do not "
                "announce the step"
            )

    def decide(self, sumsq: float, overflow: bool) -> tuple[bool, float]:
        """From the window's statistics: whether the step is skipped, and the gradient
        multiplier (loss unscaling and clipping folded into one); updates the loss scaler,
        ``last_grad_norm`` and ``skipped_steps``."""
        scale = self.scaler.scale
        norm = math.sqrt(sumsq) / scale
        self.last_grad_norm = norm
        bound = self._clip_bound()
        max_norm, total = bound if bound is not None else (self.config.max_grad_norm, None)
        skip = overflow and (self.scaler.skips_overflow or self.config.skip_nonfinite)
        self.scaler.update(overflow)
        if skip:
            self.skipped_steps += 1
        self.note_steps()
        clip = 1.0
        against = norm if total is None else total  # Note [clipping by a total norm]
        if max_norm is not None and not skip:
            coefficient = max_norm / (against + 1e-6)
            # torch's clamp(max=1) keeps a NaN coefficient (a NaN norm): NaN gradients
            clip = coefficient if math.isnan(coefficient) else min(1.0, coefficient)
        return skip, clip / scale

    def note_steps(self) -> None:
        """What the profiler reports about the steps (``TieredMemoryManager.step_notes``)."""
        notes = self.manager.step_notes
        notes["skipped_steps"] = self.skipped_steps
        if self.config.speculative_step:
            notes["speculation_failures"] = self.speculation_failures
        if self.last_eager_share is not None:
            notes["share_stepped_during_backward"] = round(self.last_eager_share, 3)

    # -- a step in step() ----------------------------------------------------------------

    def step(self, hyper_of: HyperOf) -> None:
        """Decide and run the window's step (the caller checked and settled everything
        before: Note [a step is all or nothing] in ``modes.py``)."""
        fast = not self.needs_statistics()  # Note [a step that needs no statistics]
        if fast:
            arrived = [bucket.grads.arrived.copy() for bucket in self.buckets]
            grad_scale = 1.0 / self.scaler.scale
        else:
            sumsq, overflow, arrived = self.grad_stats()
            skip, grad_scale = self.decide(sumsq, overflow)
            if skip:
                for bucket in self.buckets:
                    bucket.grads.consume()
                self.router.consumed()
                self.clip.close_window()
                return
        work = [
            (StepPlan(bucket, flags), hyper_of(bucket))
            for bucket, flags in zip(self.buckets, arrived, strict=True)
        ]
        self.mode.run(work, grad_scale)
        for bucket, flags in zip(self.buckets, arrived, strict=True):
            bucket.views.stepped(flags)  # Note [a step moves the version counters]
        self.router.consumed()
        self.clip.close_window()
        if fast:
            self._statistics_after_the_update()

    def _statistics_after_the_update(self) -> None:
        """A step that needed no statistics is applied: read them now, for
        ``last_grad_norm`` and the profiler (Note [a step that needs no statistics])."""
        try:
            sumsq, overflow, _ = self.grad_stats()  # done meanwhile, on the host worker
        except Exception as exc:  # (a KeyboardInterrupt is not the worker failing)
            stepped = [bucket.layout.index for bucket in self.buckets]
            raise StepFailed(
                f"step() was applied to buckets {stepped}, but the host worker's "
                f"statistics of its gradients then failed ({type(exc).__name__}), so "
                "last_grad_norm is not known. Later steps would fail the same way: "
                "rebuild the optimizer (or reload it from a checkpoint)"
            ) from exc
        self.decide(sumsq, overflow)

    # -- a step announced before its backward ----------------------------------------------

    def refuses_announcement(self, owner: Any) -> bool:
        """Whether an announced step must run in step() after all; warns once, naming
        ``owner`` (the optimizer) and the reason."""
        reason = self.eager_refusal()
        if reason is None:
            return False
        if not self._eager_warned:
            self._eager_warned = True
            warn_caller(
                f"{owner!r}: the announced step runs in step(), not during backward: {reason}"
            )
        return True

    def announce(self, hypers: dict[int, Hyper]) -> None:
        """Announce the step (the caller checked ``refuses_announcement`` and what step()
        would refuse): each bucket is stepped as it completes in the next backward."""
        speculative = self.config.speculative_step and (
            self.config.max_grad_norm is not None
            or self.scaler.skips_overflow
            or self.config.skip_nonfinite
        )
        self.eager = EagerStep(
            self.manager,
            hypers,
            grad_scale=1.0 / self.scaler.scale,
            speculation_bytes=self.config.speculation_bytes if speculative else None,
            publish=Publish.LATER if self._param_offload() else Publish.NOW,
        )
        self.router.eager = self.eager

    def warn_announced_changes(self, hyper_of: Callable[[int], Hyper], owner: Any) -> None:
        """Warn, naming ``owner``, for each param group whose hyper-parameters
        (``hyper_of(g)``, read now) differ from those the announced step read and ran with
        (Note [stepping during backward] in eager.py)."""
        eager = self.eager
        if eager is None or eager.landed:
            return
        for g, announced in sorted(eager.hypers.items()):
            try:
                now = hyper_of(g)
            except (IndexError, KeyError, TypeError, ValueError):
                continue  # the step's own checks name what is wrong with the group
            if now == announced or not dataclasses.is_dataclass(now):
                continue
            changed = [
                f"{f.name} {getattr(announced, f.name)!r} -> {getattr(now, f.name)!r}"
                for f in dataclasses.fields(now)
                if getattr(now, f.name) != getattr(announced, f.name)
            ]
            warn_caller(
                f"{owner!r}: param group {g}'s hyper-parameters changed after the step was "
                f"announced ({', '.join(changed)}); the step ran during backward with the "
                "announced values, and the new ones apply from the next step. Change them "
                "(scheduler.step()) after step(), or before the announced backward"
            )

    def land_eager(self) -> None:
        """Take the announced step that ran during backward: land its weights, commit.
        Refusals come first and leave it pending (a retry after fixing them lands it)."""
        eager = self.eager
        if eager is None or eager.landed:
            return
        for bucket in self.buckets:
            if any(param.grad is not None for param in bucket.params):
                raise RuntimeError(
                    "a gradient was set by hand after an announced backward "
                    "(backward(step=True)); the step already ran without it. Clear it "
                    "(param.grad = None) and call step() again"
                )
        with surface_collective_errors():
            if not eager.backward_ended:  # the announced backward never ran
                self.router.finish()
                eager.end_backward(self.buckets)

            def decide() -> tuple[bool, float]:
                sumsq, overflow, _ = self.grad_stats()
                return self.decide(sumsq, overflow)

            if eager.land(self.buckets, self.ranks, decide):
                self.speculation_failures += 1
        self.last_eager_share = eager.share_before_backward_returned
        self.note_steps()
        self._stats_cache = None
        self.router.consumed()
        self.clip.close_window()

    def writing_homes(self) -> bool:
        """Whether an announced step's updates may be writing the parameter homes now (some
        bucket was handed over during backward, not landed yet): Note [stepping during
        backward with parameter offload] in eager.py."""
        eager = self.eager
        return eager is not None and bool(eager.plans) and not eager.landed

    def land_if_ran(self) -> None:
        """Land the announced step if its backward ended (``state_dict``, ``close``)."""
        if self.eager is not None and self.eager.backward_ended:
            self.land_eager()

    def drop_eager(self) -> None:
        """Forget the announced step (it was taken, or is being abandoned)."""
        self.eager = None
        self.router.eager = None

    # -- the window ------------------------------------------------------------------------

    def discard_window(self, owner: Any) -> None:
        """``zero_grad``: forget the window; an announced step that ran is taken, one whose
        backward raised keeps what it stepped (warned, naming ``owner``)."""
        self.clip.forget()  # a clip_grad_norm_ belongs to the window it measured
        eager = self.eager
        if eager is not None:
            if eager.backward_ended:
                if not eager.landed:
                    warn_caller(
                        f"{owner!r}: zero_grad() after an announced backward "
                        "(backward(step=True) or announce_step()) with no step() between: "
                        "the step ran during that backward and is kept. To skip a step, "
                        "decide before its backward and do not announce it"
                    )
                self.land_eager()  # the announced step already ran: take it
            elif not eager.landed:
                # The announced backward raised: what it stepped stays stepped.
                stepped = eager.abandon(self.buckets, self.ranks)
                if stepped:
                    warn_caller(
                        f"{owner!r}: the announced step's backward raised after buckets "
                        f"{stepped} were stepped (backward(step=True) runs them as they "
                        "complete); they keep that step and the rest were not stepped. "
                        "OffloadConfig(speculative_step=True) backs up and restores instead"
                    )
            self.drop_eager()
        self.router.discard()
        self._stats_cache = None

    def loaded(
        self, scaler_state: dict[str, Any], skipped_steps: int | None, pending: bool
    ) -> None:
        """A state was loaded (``load_state_dict``, ``load_streaming``): the scaler's and
        the skip count (None: the state had none, keep ours), and the update mode told
        whether an update was pending."""
        self.scaler.load_state_dict(scaler_state)
        if skipped_steps is not None:
            self.skipped_steps = skipped_steps
        self._stats_cache = None
        self.mode.loaded(self.buckets, pending=pending)

    @contextlib.contextmanager
    def superseding_eager(self) -> Iterator[None]:
        """Around a load: an announced step that ran is superseded by the loaded state. Its
        weight copies land first, and once the load succeeded the weights they wrote are
        stamped as the optimizer's own, so the loaded master replaces them at the next
        step. A write into the model between that backward and the load may have met those
        copies in flight: the loaded master wins there (Note [a loaded state claims no
        weights] in ``checkpoint/state_dict.py``). Without an announced step, the body only."""
        if self.eager is None:
            yield
            return
        self.manager.host_worker.synchronize()
        events = [event for bucket in self.buckets for event in bucket.publish()]
        self.manager.wait_for(latest_per_stream(events), category=Category.WEIGHTS)
        yield
        for bucket in self.buckets:
            bucket.views.remember()
            # the loaded master, not these weights, is the truth: checked by fingerprint
            bucket.master_exposed = True
