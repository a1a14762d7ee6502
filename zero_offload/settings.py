"""The spelled settings: the enum-valued fields of ``OffloadConfig`` (``config/offload.py``), each a
``str`` member equal to its spelling, so ``OffloadConfig(grad_staging="in_flight")`` and
``OffloadConfig(grad_staging=GradStaging.IN_FLIGHT)`` are one value."""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "GradAccumulation",
    "GradStaging",
    "OverlapLanding",
    "OverlapShadow",
    "SpelledSetting",
]


class SpelledSetting(str, enum.Enum):
    """A setting whose value is its spelling: a ``str``, so ``OffloadConfig(x="name")`` is the
    member, equal to ``"name"`` and printed as it. The base of the settings' enums below."""

    def __str__(self) -> str:
        return self.value  # the spelling, as ``str.__str__`` on every Python version

    # Equal to its spelling (``str.__eq__``), so it hashes as its spelling too.
    __hash__ = str.__hash__

    @classmethod
    def parse(cls, value: object, *, name: str) -> Any:
        """``value`` (a member, or its spelling) as a member; ``ValueError`` naming ``name``,
        the value and the choices otherwise."""
        try:
            return cls(value)
        except (ValueError, TypeError):  # TypeError: an unhashable value
            choices = " or ".join(repr(member.value) for member in cls)
            raise ValueError(f"{name} must be {choices}, got {value!r}") from None


class GradStaging(SpelledSetting):
    """Where gradients land on the host (``OffloadConfig.grad_staging``)."""

    #: One pinned staging buffer per bucket, for the whole model (each bucket's shard in the
    #: training dtype); it holds the bucket's gradient until ``step()`` consumes it.
    PER_BUCKET = "per_bucket"
    #: A ring of ``grad_staging_buffers`` pinned buffers, each the largest bucket's shard,
    #: shared by every bucket; a bucket's buffer is free again once its CPU update is done
    #: (each step runs during backward: Note [gradient staging for the buckets in flight] in
    #: ``optim/grads/staging_ring.py``).
    IN_FLIGHT = "in_flight"


class GradAccumulation(SpelledSetting):
    """Where micro-batches' gradients add up (``OffloadConfig.grad_accumulation``): Note
    [micro-batches add up on the device] in ``optim/grads/device_acc.py``."""

    #: On the device, in an fp32 accumulator per bucket, when the device budget has room for
    #: it (checked per bucket at its first accumulating window); on the host otherwise.
    AUTO = "auto"
    #: Always on the host, in the pinned fp32 accumulator.
    HOST = "host"


class OverlapShadow(SpelledSetting):
    """Where ``overlap_step``'s delayed update leaves its weights until the next step
    (``OffloadConfig.overlap_shadow``): Note [the delayed update lands in a shadow] in
    ``optim/shadow.py``."""

    #: In a device shadow per bucket (its shard in the training dtype), filled while the
    #: next forward and backward run, when the device budget has room (checked per bucket
    #: at its first update); in the pinned home otherwise.
    AUTO = "auto"
    #: Always in the pinned home, copied to the device by the next ``step()``.
    OFF = "off"


class OverlapLanding(SpelledSetting):
    """Where compute waits for ``overlap_step``'s weight copies across the link
    (``OffloadConfig.overlap_landing``): Note [weights landed at their first use] in
    ``views/in_flight.py``."""

    #: In ``step()``: compute waits for every bucket's copies before it returns.
    AT_STEP = "at_step"
    #: Where a parameter of the bucket is first read (the forward, bucket by bucket in its
    #: order): ``step()`` returns once the copies are issued.
    AT_FIRST_USE = "at_first_use"
