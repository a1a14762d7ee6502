"""TRL with ``OffloadAdamW``: ``OffloadSFTTrainer`` and ``OffloadDPOTrainer``.

``trl.SFTTrainer`` and ``trl.DPOTrainer`` are ``transformers.Trainer`` subclasses that
prepare the data (tokenising, packing, completion-only labels, preference pairs), apply a
``peft_config``, compute their own losses and metrics, and leave the optimizer, the
clipping and the checkpoints to Trainer's loop. The classes here put ``OffloadTrainer`` in
front of them, so those go to ``OffloadAdamW`` (see ``integrations/transformers.py``) and
everything else is TRL's::

    from trl import SFTConfig
    from zero_offload.integrations.trl import OffloadSFTTrainer

    trainer = OffloadSFTTrainer(  # was: SFTTrainer
        model=model,
        args=SFTConfig(output_dir="out", max_grad_norm=1.0, ...),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(...),  # optional: OffloadAdamW trains the adapters
        offload_config=OffloadConfig(bucket_bytes="32MiB"),  # optional
    )
    trainer.train()

They take the TRL trainer's arguments plus ``OffloadTrainer``'s keyword-only
``offload_config`` and ``offload_device``, and refuse what ``OffloadTrainer`` refuses.
TRL's configs turn bf16 on by default, which works; ``fp16=True`` is refused (torch's
GradScaler needs ``param.grad``).

No class for ``GRPOTrainer``: it defines ``_load_optimizer_and_scheduler`` (to restore its
entropy controller after the optimizer), which ``OffloadTrainer`` replaces without calling
it, so a resumed run would lose that state; construction would refuse the combination
(``_OffloadTRLTrainer``). TRL's other trainers are not tested here, so no class either.
"""

from __future__ import annotations

from typing import Any

from trl import DPOTrainer, SFTTrainer

from .transformers import OffloadTrainer

__all__ = ["OffloadDPOTrainer", "OffloadSFTTrainer"]

#: The Trainer methods OffloadTrainer replaces without calling the next class's (its
#: ``compute_loss`` and ``training_step`` do call it: TRL's run inside them).
_REPLACED = (
    "create_optimizer",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
)


class _OffloadTRLTrainer(OffloadTrainer):
    """``OffloadTrainer`` in front of a TRL trainer (the next class in the MRO).

    The method resolution order puts ``OffloadTrainer``'s overrides (the optimizer, the
    clipping and logged norm, the loss scale of fp16 models, the optimizer checkpoint)
    before the TRL trainer's. Its ``compute_loss`` and ``training_step`` call TRL's; the
    methods it replaces outright (``_REPLACED``) must not be TRL's, or TRL's version would
    be skipped without a word: construction checks.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        trl_classes = [c for c in type(self).__mro__ if c.__module__.startswith("trl.")]
        clashes = [
            f"{c.__name__}.{name}" for c in trl_classes for name in _REPLACED if name in vars(c)
        ]
        if clashes:
            raise RuntimeError(
                f"this trl version defines {clashes}, which {type(self).__name__} replaces "
                "with OffloadTrainer's (the OffloadAdamW optimizer, clipping and checkpoints), "
                "so TRL's code there would not run; install a trl that zero-offload supports "
                "(see pyproject.toml, the 'test' extra)"
            )
        super().__init__(*args, **kwargs)


class OffloadSFTTrainer(_OffloadTRLTrainer, SFTTrainer):
    """``trl.SFTTrainer`` training with ``OffloadAdamW``; see the module docstring."""


class OffloadDPOTrainer(_OffloadTRLTrainer, DPOTrainer):
    """``trl.DPOTrainer`` training with ``OffloadAdamW``; see the module docstring. The
    reference model (``ref_model``, or the adapters disabled with PEFT) is not trained:
    only the policy's parameters are the optimizer's."""
