"""The dynamic loss scaler's settings (``optim/update/loss_scaler.py`` runs them)."""

from __future__ import annotations

from dataclasses import dataclass

from .values import check_int, check_positive_finite

__all__ = ["LossScalerConfig"]


@dataclass(frozen=True)
class LossScalerConfig:
    """Dynamic loss scaling for fp16 models (ignored for bf16 and fp32 unless
    ``autocast_fp16``).

    Attributes:
        initial_scale: the first loss scale. Default 2**16. Must be > 0.
        growth_factor: the scale is multiplied by this after ``growth_interval`` steps
            without overflow. Default 2.0. Must be > 1.
        backoff_factor: the scale is multiplied by this when an overflow lowers it.
            Default 0.5. Must be in (0, 1).
        growth_interval: overflow-free steps before the scale grows. Default 2000. >= 1.
        min_scale: the scale never drops below this. Default 1.0. Must be > 0.
        hysteresis: the scale drops at the ``hysteresis``-th overflowing step since it last
            dropped or grew, consecutive or not (DeepSpeed's rule; clean steps between them
            do not reset the count; 1 is ``torch.amp.GradScaler``'s schedule). Every
            overflowing step is skipped regardless. Default 2. Must be >= 1.
        autocast_fp16: scale dynamically whatever the weights' dtype, for
            ``torch.autocast(dtype=torch.float16)`` over fp32 or bf16 weights (the recipe
            ``torch.amp.GradScaler`` serves, which cannot see an offload optimizer's
            gradients): call ``opt.backward(loss)``, as for an fp16 model (with
            ``hysteresis=1`` the schedule is ``GradScaler``'s). Default False:
            scaled only when a trainable parameter is fp16 (Note [one loss scale]).
    """

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    hysteresis: int = 2
    autocast_fp16: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.autocast_fp16, bool):
            raise TypeError(
                "LossScalerConfig.autocast_fp16 must be True or False, got "
                f"{type(self.autocast_fp16).__name__} {self.autocast_fp16!r}"
            )
        check_positive_finite("LossScalerConfig.initial_scale", self.initial_scale)
        check_positive_finite("LossScalerConfig.min_scale", self.min_scale)
        check_positive_finite("LossScalerConfig.growth_factor", self.growth_factor)
        if self.growth_factor <= 1:
            raise ValueError(
                f"LossScalerConfig.growth_factor must be > 1, got {self.growth_factor!r}"
            )
        check_positive_finite("LossScalerConfig.backoff_factor", self.backoff_factor)
        if self.backoff_factor >= 1:
            raise ValueError(
                f"LossScalerConfig.backoff_factor must be in (0, 1), got {self.backoff_factor!r}"
            )
        for name in ("growth_interval", "hysteresis"):
            value = check_int(f"LossScalerConfig.{name}", getattr(self, name), low=1)
            object.__setattr__(self, name, value)
        if self.min_scale > self.initial_scale:
            raise ValueError(
                f"LossScalerConfig.min_scale ({self.min_scale}) must be <= initial_scale "
                f"({self.initial_scale})"
            )
