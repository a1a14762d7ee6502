"""Loss scaling: a static scale of 1 for bf16/fp32, dynamic scaling for fp16 (and for fp16
autocast over other weights, ``LossScalerConfig.autocast_fp16``).

The scaler only decides; the optimizer detects overflow (in its fused statistics pass over
the host gradients) and folds ``1 / scale`` into the CPU Adam gradient multiplier.

Note [one loss scale]
~~~~~~~~~~~~~~~~~~~~~
An optimizer has one scaler, whatever mix of training dtypes its buckets hold: dynamic as
soon as any trainable parameter is fp16 (at construction, or when ``add_param_group`` brings
the first ones) or ``LossScalerConfig.autocast_fp16`` asks for it (fp16 autocast over fp32 or
bf16 weights: the activations' gradients are fp16 though the weights' are not), else
``NoLossScaler``. The scale multiplies the whole loss
(``OffloadAdamW.backward``), so every bucket's gradients, the bf16 and fp32 ones beside the
fp16 ones, arrive multiplied by it; the step therefore unscales every bucket by the same
factor (one ``clip / scale`` gradient multiplier), the norm is the global sum of squares
over all buckets divided by the scale, and an overflow in any bucket skips the whole step
and backs the scale off. Scalers per dtype would need a loss per dtype, which does not
exist: one backward produces every bucket's gradients. A backward that did not carry the
scale (a plain ``loss.backward()``) is refused at its first gradient: Note [a backward
carries the loss scale] in ``scaled_backward.py``.
"""

from __future__ import annotations

from typing import Any

from ...config import LossScalerConfig

__all__ = ["DynamicLossScaler", "LossScaler", "NoLossScaler"]


class LossScaler:
    """The interface: ``scale`` to multiply the loss by, ``update(overflow)`` after a step."""

    scale: float = 1.0
    #: Whether an overflowing step is skipped (and the scale backs off): the step cannot
    #: be decided before its statistics are known.
    skips_overflow: bool = False

    def update(self, overflow: bool) -> None:
        """Record whether the step just taken overflowed (and so was skipped)."""

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, for checkpoints."""
        return {}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``load_state_dict(state)`` would fail; change nothing."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (an empty dict keeps the current state)."""


class NoLossScaler(LossScaler):
    """bf16 and fp32: no scaling needed."""

    skips_overflow = False


class DynamicLossScaler(LossScaler):
    """fp16: grow the scale after a run of clean steps, back off after overflows.

    Every overflowing step is skipped by the optimizer. The scale drops only when
    ``hysteresis`` overflows have happened since the last drop or growth (so one stray inf
    does not halve the scale), and never below ``min_scale``. After ``growth_interval``
    consecutive clean steps the scale grows by ``growth_factor`` and the hysteresis resets.
    """

    skips_overflow = True

    def __init__(self, config: LossScalerConfig) -> None:
        self.config = config
        self.scale = float(config.initial_scale)
        self.clean_steps = 0  # consecutive steps without overflow
        self.hysteresis_left = config.hysteresis
        self.overflows = 0  # total overflowing (skipped) steps

    def update(self, overflow: bool) -> None:
        cfg = self.config
        if overflow:
            self.overflows += 1
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
                self.hysteresis_left = cfg.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps >= cfg.growth_interval:
            self.scale *= cfg.growth_factor
            self.clean_steps = 0
            self.hysteresis_left = cfg.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
            "overflows": self.overflows,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        if not state:
            return  # a bf16/fp32 checkpoint has no scaler state: keep the current one
        missing = {"scale", "clean_steps", "hysteresis_left", "overflows"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state is missing {sorted(missing)}")
        scale = state["scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"loss scaler state: 'scale' must be a number > 0, got {scale!r}")
        for key in ("clean_steps", "hysteresis_left", "overflows"):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"loss scaler state: {key!r} must be an int >= 0, got {value!r}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        if not state:
            return
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.overflows = int(state["overflows"])
