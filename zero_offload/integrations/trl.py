"""TRL with ``OffloadAdamW``: ``OffloadSFTTrainer``.

``trl.SFTTrainer`` is a ``transformers.Trainer`` that prepares the data (tokenising,
packing, completion-only labels), applies a ``peft_config`` and adds its own metrics; the
optimizer, the clipping and the checkpoints are Trainer's. ``OffloadSFTTrainer`` puts
``OffloadTrainer`` in front of it, so those go to ``OffloadAdamW`` (see
``integrations/transformers.py``) and everything else is TRL's::

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

It takes ``SFTTrainer``'s arguments plus ``OffloadTrainer``'s keyword-only
``offload_config`` and ``offload_device``, and refuses what ``OffloadTrainer`` refuses.
SFTConfig turns bf16 on by default; with ``fp16=True`` set instead, it is refused (torch's
GradScaler needs ``param.grad``).

TRL's other trainers (``DPOTrainer``, ``GRPOTrainer``, ...) are Trainer subclasses too, but
they are not tested here, so no class is shipped for them.
"""

from __future__ import annotations

from typing import Any

from trl import SFTTrainer

from .transformers import OffloadTrainer

__all__ = ["OffloadSFTTrainer"]

#: The Trainer methods OffloadTrainer replaces without calling Trainer's (its
#: ``compute_loss`` and ``training_step`` call the next class's: SFTTrainer's run).
_REPLACED = (
    "create_optimizer",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
)


class OffloadSFTTrainer(OffloadTrainer, SFTTrainer):
    """``trl.SFTTrainer`` training with ``OffloadAdamW``; see the module docstring.

    The method resolution order puts ``OffloadTrainer``'s overrides (the optimizer, the
    clipping and logged norm, the loss scale of fp16 models, the optimizer checkpoint)
    before ``SFTTrainer``'s. Its ``compute_loss`` and ``training_step`` call SFTTrainer's;
    the methods it replaces outright (``_REPLACED``) must not be TRL's, or TRL's version
    would be skipped without a word: construction checks.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        trl_classes = [c for c in SFTTrainer.__mro__ if c.__module__.startswith("trl.")]
        clashes = [
            f"{c.__name__}.{name}" for c in trl_classes for name in _REPLACED if name in vars(c)
        ]
        if clashes:
            raise RuntimeError(
                f"this trl version defines {clashes}, which OffloadSFTTrainer replaces with "
                "OffloadTrainer's (the OffloadAdamW optimizer, clipping and checkpoints), so "
                "TRL's code there would not run; install a trl that zero-offload supports "
                "(see pyproject.toml, the 'test' extra)"
            )
        super().__init__(*args, **kwargs)
