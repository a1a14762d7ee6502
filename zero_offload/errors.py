"""Exception types shared across the library."""

from __future__ import annotations

__all__ = ["DeviceBudgetExceeded", "StreamError"]


class DeviceBudgetExceeded(MemoryError):
    """A request for library-owned device memory does not fit the configured budget."""


class StreamError(RuntimeError):
    """Work queued on a stream failed; the original exception is the ``__cause__``.

    See Note [stream errors are sticky] in ``zero_offload.accelerator.base``.
    """
