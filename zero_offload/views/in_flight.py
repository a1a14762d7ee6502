"""A bucket's weights still crossing the link, waited for where a parameter is first read.

Note [weights landed at their first use]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``overlap_step`` and no device shadow, ``step()`` k+1 copies update k's weights from the
pinned homes across the link (Note [delayed parameter update] in ``optim/update/modes.py``).
By default (``overlap_landing="at_step"``) it makes compute wait for every copy before it
returns, so the next forward's first layer waits for the last bucket's weights: about 100 ms
a step for 5.4 GB of bf16 weights at 50 GB/s. With ``"at_first_use"`` ``step()`` issues
the copies, last bucket first (buckets hold the parameters in reverse registration order, so
that is the forward's order), and returns; each bucket's parameters are then *in flight*:
their class is switched to a subclass of their own whose ``__torch_function__`` lands the
bucket before any call that reads or writes values (``views/value_reads.py``; metadata goes
through untouched), as a released parameter fetches its unit (Note [a released parameter] in
``params/released.py``). Landing a bucket makes compute wait for its copies (and its
all-gather with several ranks), takes its fingerprints (Note [weights written outside the
optimizer] in ``param_views.py``) and gives every parameter of the bucket its class back: the
forward of the first layers runs while the later buckets' weights cross, and compute pays
the check once per bucket. (A bucket with a device shadow is copied from it on the device
inside ``step()``; only its fingerprints wait for its first use.)

Where it lands: the thread that reads first lands it, with the device bound while it waits.
The stream ``step()`` ran on (the forward's) waits for the copies and takes the fingerprints,
and the reader's own stream, if it is another (an EMA on a side stream), waits for all of
that. Until the parameters get their class back, a read on another thread waits for the
landing in progress (a lock), and a landing that fails fails every later read of the bucket,
naming it: its weights may be torn. The optimizer's release lands what is still in flight
(with the all-gathers) while the pools and the process group exist, and gives the
parameters their class back even where landing fails.

A bucket lands whole, not parameter by parameter, because its fingerprints are taken in one
pass and must be taken before any of its parameters is written: a write between ``step()``
and the forward (``model.load_state_dict``, an EMA swap, ``p.data.mul_``) goes through the
switched class, so the bucket lands first and the next step sees the write. Until it lands,
nothing can have written the bucket since ``step()`` published it, so the next check skips
it (``ParamViews.changed_params``). Everything of the optimizer that reads the weights (the
next ``step()``, ``state_dict``, checkpoints, ``close``) lands every bucket first.

What it cannot see, and why it is opt-in: a tensor taken from a parameter before the step
and kept (``w = p.view(-1)``, ``d = p.data`` stored across steps) reads the weights without
asking the parameter, and on a GPU it may read them while they are being copied.
``torch.compile`` traces the switched class's ``__torch_function__`` at compile time, so
the compiled forward would not wait (a trial trained other weights): a call traced over a
parameter in flight raises, naming ``"at_step"``, which compiles. That needs dynamo to trace
again when the class changes, which it does where it guards on parameters
(``inline_inbuilt_nn_modules``, the default from torch 2.5); where it does not, the optimizer
refuses ``"at_first_use"`` at construction. A CUDA graph or a ``torch.jit.trace`` replayed
over the parameters does not ask them either.
"""

from __future__ import annotations

import copy
import enum
import functools
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .value_reads import intercepted

__all__ = ["InFlight", "Landing", "compile_refusal", "is_in_flight", "land_param"]


class Landing(enum.Enum):
    """Where one bucket's published weights are (``InFlight.state``)."""

    #: The copies are issued; the parameters have the switched class.
    IN_FLIGHT = "in_flight"
    #: Compute is being made to wait; the parameters keep the switched class, and a read
    #: made by the landing itself on its thread runs as it is (``value_reads.intercepted``).
    LANDING = "landing"
    #: Compute waits for the copies; the fingerprints are taken.
    LANDED = "landed"
    #: The wait or the fingerprint raised; ``land()`` raises again (the weights may be torn).
    FAILED = "failed"


_COMPILED = (
    "OffloadConfig(overlap_landing='at_first_use') waits for a bucket's weights where "
    "eager code first reads one of its parameters; torch.compile traces that wait out of "
    "the graph, so the compiled forward would read weights still being copied. Use "
    "overlap_landing='at_step' (the default) with torch.compile"
)

#: In-flight parameters and the bucket each lands with. The values hold their keys (and the
#: optimizer's manager) until the bucket lands: the optimizer's release lands or abandons
#: every bucket first.
_LANDINGS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class InFlight:
    """One bucket's weights crossing the link: its parameters and how compute waits for them
    (Note [weights landed at their first use]). ``land`` runs once, on the thread that reads
    first; ``what`` names the bucket in errors."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], land: Callable[[], None], *, what: str
    ) -> None:
        self.params = tuple(params)
        self.what = what
        self.state = Landing.IN_FLIGHT
        self._land = land
        self._error: BaseException | None = None
        self._lock = threading.RLock()  # a second thread reading waits for the first's landing
        for param in self.params:
            if not isinstance(param, _InFlightParam):
                param.__class__ = _in_flight_class(type(param))
            _LANDINGS[param] = self

    def land(self) -> None:
        """Make compute wait for the bucket's copies and take its fingerprints (once).

        The parameters keep the switched class until that is done: a read on another thread
        waits here for the landing, and one made by the landing itself on this thread (the
        lock is reentrant) runs as it is, without landing again."""
        with self._lock:
            if self.state is Landing.FAILED:
                raise RuntimeError(
                    f"{self.what}: its weights did not land on the device (the wait for "
                    "their copies failed; the cause is chained): reload the model and the "
                    "optimizer from a checkpoint"
                ) from self._error
            if self.state is not Landing.IN_FLIGHT:
                return
            self.state = Landing.LANDING
            try:
                self._land()
            except BaseException as exc:
                # Every later read raises too: the weights may be torn.
                self.state, self._error = Landing.FAILED, exc
                raise
            for param in self.params:
                _plain_again(param)
            self.state = Landing.LANDED

    def abandon(self) -> None:
        """The optimizer is going away and landing failed or was not possible: give the
        parameters their class back (the model keeps working on what the device holds)."""
        with self._lock:
            for param in self.params:
                _plain_again(param)
            if self.state is Landing.IN_FLIGHT:
                self.state = Landing.LANDED


def _dynamo_guards_parameter_classes() -> bool:
    """Whether a graph ``torch.compile`` made is guarded on its parameters' classes, so that
    it is traced again (and refused) once they are in flight: dynamo's
    ``inline_inbuilt_nn_modules``, on by default from torch 2.5 (later always on)."""
    config = sys.modules.get("torch._dynamo.config")
    with warnings.catch_warnings():  # deprecated where it is always on
        warnings.simplefilter("ignore", FutureWarning)
        inlined = getattr(config, "inline_inbuilt_nn_modules", None)
    if inlined is not None:
        return bool(inlined)
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def compile_refusal() -> str | None:
    """Why ``overlap_landing="at_first_use"`` cannot be trusted with this torch, or None: a
    graph compiled before the parameters were in flight would keep running over them
    without landing them, where dynamo does not guard on their classes."""
    if _dynamo_guards_parameter_classes():
        return None
    return (
        "OffloadConfig(overlap_landing='at_first_use') needs torch.compile to trace a "
        "graph again when the parameters' class changes (dynamo's inline_inbuilt_nn_modules"
        f", off in torch {torch.__version__}): a graph compiled before would keep reading "
        "weights still being copied. Set torch._dynamo.config.inline_inbuilt_nn_modules = "
        "True (torch >= 2.5 does by default), or use overlap_landing='at_step'"
    )


def _plain_again(param: torch.Tensor) -> None:
    if isinstance(param, _InFlightParam):
        param.__class__ = type(param)._plain
    _LANDINGS.pop(param, None)


def land_param(param: torch.Tensor) -> None:
    """Land ``param``'s bucket (its class becomes the plain one again)."""
    landing = _LANDINGS.get(param)
    if landing is None:  # not ours: a tensor torch made of an in-flight parameter's class
        _plain_again(param)
        return
    landing.land()


def is_in_flight(param: torch.Tensor) -> bool:
    """Whether ``param``'s bucket has not landed yet."""
    return isinstance(param, _InFlightParam)


class _InFlightParam:
    """Mixed into a parameter's class while its bucket is in flight."""

    _plain: type  # the class the parameter has once landed

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():
            raise RuntimeError(_COMPILED)
        return intercepted(_InFlightParam, func, args, kwargs, land_param)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        land_param(self)  # type: ignore[arg-type]
        return copy.deepcopy(self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        land_param(self)  # type: ignore[arg-type]
        return self.__reduce_ex__(protocol)


@functools.cache
def _in_flight_class(plain: type) -> type:
    return type(f"InFlight{plain.__name__}", (_InFlightParam, plain), {"_plain": plain})
