"""The refusal of a fetch over parameters replaced behind the optimizer while their unit was
released: a pure check of a unit's views, made before a fetch changes anything (a refusal
changes nothing: Note [an interrupted move] in ``unit.py``), whose errors say what replaced
them and what to do (Note [parameters replaced behind the optimizer] in
``views/param_views.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from .units import UnitSpec
from .windowed_views import WindowedViews

__all__ = ["refuse_replaced"]


def refuse_replaced(unit: object, spec: UnitSpec, views: Sequence[WindowedViews]) -> None:
    """A released parameter whose ``.data`` was replaced is refused before the fetch
    would undo the replacement (Note [parameters replaced behind the optimizer]); one
    of another shape (a resize) is told so, since no state can carry over to it. ``unit``
    names the unit in the error; ``views`` are its buckets'."""
    for bucket in views:
        for i, param in bucket.detached():
            name = spec.name_of(param)
            shape = bucket.layout.slots[i].shape
            if tuple(param.shape) != shape:
                raise ValueError(
                    f"parameter {name!r} of {unit!r} was resized after the optimizer "
                    f"was built: its shape is {tuple(param.shape)}, the optimizer's is "
                    f"{shape} (model.resize_token_embeddings(), or its .data or module "
                    "replaced by one of another shape). With "
                    "OffloadConfig(offload_parameters=True) its weights and optimizer "
                    "state live in the optimizer's pinned homes at the old shape, which "
                    "the new one cannot use. Resize the model before building the "
                    "optimizer; for a model trained already, close() this optimizer, "
                    "load the model's state_dict() into a fresh model, resize that one "
                    "and build a new optimizer over it (its state starts afresh)"
                )
            raise ValueError(
                f"parameter {name!r} of {unit!r} no longer uses the storage the optimizer "
                "gave it (its .data was replaced after construction: model.half()/"
                ".to(dtype), .to_empty(), load_state_dict(assign=True)...). With "
                "OffloadConfig(offload_parameters=True) its weights live in the "
                "optimizer's pinned home, which would go on training while the model "
                "reads something else. Rebuild the optimizer after such changes "
                "(load_state_dict carries the state over)"
            )
