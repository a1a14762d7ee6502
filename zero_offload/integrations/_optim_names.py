"""``TrainingArguments.optim`` as ``OffloadTrainer`` reads it: the offload optimizer each
accepted name builds, with which of the arguments, and why the others are refused.

Note [Trainer's optim names]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Trainer builds its optimizer from ``TrainingArguments.optim`` (one handler per name in
transformers' ``trainer_optimizer.py``) over its two parameter groups (``weight_decay`` for
the decay group, 0 for biases and norms). ``OffloadTrainer`` accepts a name only where an
offload rule steps as the optimizer Trainer would build, from the same arguments:

- ``adamw_torch``, ``adamw_torch_fused``: ``torch.optim.AdamW(lr=learning_rate,
  betas=(adam_beta1, adam_beta2), eps=adam_epsilon)``: ``OffloadAdamW``. ``fused`` picks
  torch's kernel, not the update.
- ``adagrad``: ``torch.optim.Adagrad(lr=learning_rate)`` with ``lr_decay`` and ``eps`` taken
  from ``optim_args`` when given, torch's defaults otherwise (``eps`` 1e-10, not
  ``adam_epsilon``; ``initial_accumulator_value`` 0): ``OffloadAdagrad``, which follows
  torch's Adagrad (weight decay added to the gradient, as torch's).
- ``lion_32bit``, ``paged_lion_32bit``: bitsandbytes' ``Lion(lr=learning_rate,
  betas=(adam_beta1, adam_beta2))`` with an fp32 moment (no ``eps``: Lion has none):
  ``OffloadLion``, the paper's rule. Paging only decides where bitsandbytes allocates the
  moment (CUDA unified memory the driver may evict to the host under pressure); the update
  is the same, and ``OffloadLion`` keeps the moment in host memory anyway. Weight decay is
  decoupled (``p *= 1 - lr * wd``, outside the sign), as in the paper, bitsandbytes' 8-bit
  kernel and its 32-bit kernel since the fix of bitsandbytes#1992; releases before that fix
  added ``wd * p`` to the gradient in the 32-bit path (the bug that issue reports), so with
  ``weight_decay > 0`` a run there differs from this one. With 0 they agree.

``optim_args`` (``"key=value,..."``): only the keys transformers reads for the name, as
floats; any other key is refused (transformers would ignore it without a word).
``weight_decay`` in it is refused too: transformers passes it as Adagrad's default, which
both of Trainer's groups override, so it never acts; ``TrainingArguments.weight_decay`` does.

Refused, each with what works instead:

- ``adafactor``: transformers' own ``Adafactor`` (``transformers.optimization``), built with
  ``scale_parameter=False, relative_step=False``: each step moves a parameter by
  ``learning_rate`` times its clipped update, and ``eps[0]=1e-30`` is added to ``g**2``
  before the factors average it. ``OffloadAdafactor`` follows ``torch.optim.Adafactor``,
  whose step is ``max(eps2, RMS(p)) * min(lr, 1/sqrt(t))`` (scaled by the parameter's RMS,
  capped by the relative step) and whose ``eps1**2`` floors the variance estimate: another
  update, which no setting of either turns into the other.
- ``lion_8bit``, ``paged_lion_8bit``: bitsandbytes keeps the moment 8-bit blockwise
  quantized, and its rounding is part of the update; ``OffloadLion``'s is fp32.
- every other name: no offload rule reproduces it here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..optim import OffloadAdagrad, OffloadAdamW, OffloadLion, OffloadOptimizer

__all__ = ["ACCEPTED", "optimizer_cls_and_kwargs"]


@dataclass(frozen=True)
class NamedRule:
    """What one accepted ``TrainingArguments.optim`` name builds."""

    cls: type[OffloadOptimizer]  # the offload optimizer built
    mirrors: str  # the optimizer Trainer builds for the name, for the messages
    options: tuple[str, ...]  # the optim_args keys read (as floats), as transformers reads them
    kwargs: Callable[[Any], dict[str, Any]]  # TrainingArguments -> constructor keywords


def _adamw(args: Any) -> dict[str, Any]:
    return {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
    }


def _adagrad(args: Any) -> dict[str, Any]:
    return {"lr": args.learning_rate, "weight_decay": args.weight_decay}


def _lion(args: Any) -> dict[str, Any]:
    return {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "weight_decay": args.weight_decay,
    }


_ADAMW = NamedRule(OffloadAdamW, "torch.optim.AdamW", (), _adamw)
_LION = NamedRule(OffloadLion, "bitsandbytes' 32-bit Lion", (), _lion)

#: The accepted names; Note [Trainer's optim names].
NAMES: dict[str, NamedRule] = {
    "adamw_torch": _ADAMW,
    "adamw_torch_fused": _ADAMW,
    "adagrad": NamedRule(OffloadAdagrad, "torch.optim.Adagrad", ("lr_decay", "eps"), _adagrad),
    "lion_32bit": _LION,
    "paged_lion_32bit": _LION,
}
ACCEPTED = tuple(NAMES)

_LION_8BIT = (
    "bitsandbytes keeps Lion's moment 8-bit blockwise quantized, and that rounding is part "
    "of its update; OffloadLion keeps it in fp32: use optim='lion_32bit'"
)

#: Names refused with a reason of their own; Note [Trainer's optim names].
REFUSED: dict[str, str] = {
    "adafactor": (
        "Trainer builds transformers' own Adafactor (scale_parameter=False, "
        "relative_step=False: each step is learning_rate times the clipped update, eps 1e-30 "
        "added to grad**2), while OffloadAdafactor follows torch.optim.Adafactor (each step "
        "is max(eps2, RMS(param)) * min(lr, 1/sqrt(step)), the variance floored at eps1**2): "
        "a different update. For torch's Adafactor pass optimizers=(OffloadAdafactor("
        "model.parameters(), lr=...), None)"
    ),
    "lion_8bit": _LION_8BIT,
    "paged_lion_8bit": _LION_8BIT,
}


def _parse(optim_args: str | None, name: str, rule: NamedRule) -> dict[str, float]:
    """``optim_args`` (``"key=value,..."``, spaces ignored, as transformers parses it) as
    float keywords; a key the name does not read is refused."""
    if not optim_args:
        return {}
    options: dict[str, float] = {}
    for item in optim_args.replace(" ", "").split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(
                f"TrainingArguments.optim_args={optim_args!r}: {item!r} is not key=value; "
                "write them as 'key=value,key=value'"
            )
        if key == "weight_decay":
            raise ValueError(
                f"TrainingArguments.optim_args={optim_args!r}: weight_decay there would never "
                "act (Trainer's two parameter groups set their own: "
                "TrainingArguments.weight_decay, and 0 for biases and norms; transformers' "
                f"{name!r} ignores it too); set TrainingArguments.weight_decay instead"
            )
        if key not in rule.options:
            reads = f"only {rule.options}" if rule.options else "none"
            raise ValueError(
                f"TrainingArguments.optim_args={optim_args!r}: key {key!r} is not read for "
                f"optim={name!r} (of optim_args, transformers reads {reads} for "
                f"{rule.mirrors}); remove it, "
                "and put offload settings in offload_config=OffloadConfig(...)"
            )
        try:
            options[key] = float(value)
        except ValueError:
            raise ValueError(
                f"TrainingArguments.optim_args={optim_args!r}: {key}={value!r} is not a number"
            ) from None
    return options


def optimizer_cls_and_kwargs(args: Any) -> tuple[type[OffloadOptimizer], dict[str, Any]]:
    """The offload optimizer ``args.optim`` names and its keywords from ``args`` (``lr``,
    the rule's hyper-parameters, ``optim_args``), Trainer's groups aside; ``ValueError`` for
    a name no offload rule reproduces (Note [Trainer's optim names])."""
    name = str(getattr(args.optim, "value", args.optim))
    rule = NAMES.get(name)
    if rule is None:
        reason = REFUSED.get(name, "no offload rule steps as the optimizer Trainer builds for it")
        raise ValueError(
            f"TrainingArguments.optim={name!r}: {reason}. OffloadTrainer builds its optimizer "
            f"for optim in {ACCEPTED}; for another rule, build the offload optimizer yourself "
            "and pass optimizers=(opt, None)"
        )
    return rule.cls, {**rule.kwargs(args), **_parse(args.optim_args, name, rule)}
