"""The optimizer's rule: what it keeps and how it steps (``base.py``: the protocol; AdamW and
Adam in ``adamw.py``, Lion in ``lion.py``, Adagrad in ``adagrad.py``, Adafactor, which reads
whole parameters, in ``adafactor.py``; Muon, with AdamW for what is not a matrix, in
``muon.py``; the host tile loop every rule shares in ``tiles.py``)."""

from .adafactor import ADAFACTOR
from .adagrad import ADAGRAD
from .adamw import ADAM, ADAMW
from .base import OptimizerRule, ParamField, StateField, StateFields
from .lion import LION
from .muon import MUON

__all__ = [
    "ADAFACTOR",
    "ADAGRAD",
    "ADAM",
    "ADAMW",
    "LION",
    "MUON",
    "OptimizerRule",
    "ParamField",
    "StateField",
    "StateFields",
    "by_name",
]

#: Every rule by the name users choose it with.
RULES: dict[str, OptimizerRule] = {
    rule.name: rule for rule in (ADAMW, ADAM, LION, ADAGRAD, ADAFACTOR, MUON)
}


def by_name(name: str) -> OptimizerRule:
    """The rule called ``name``; a clear error listing the known names otherwise."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown optimizer rule {name!r}; known: {sorted(RULES)}") from None
