"""TRL with ``OffloadAdamW``: ``OffloadSFTTrainer``, ``OffloadDPOTrainer``, ``OffloadGRPOTrainer``.

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

``OffloadGRPOTrainer`` trains ``trl.GRPOTrainer``'s policy the same way: TRL generates the
completions, scores them with the reward functions and computes the group-relative loss;
the optimizer and its checkpoint are ours, and a resumed run also restores GRPO's adaptive
entropy controller (Note [a TRL trainer that extends a replaced route]). TRL's other
trainers are not tested here, so no class for them.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer
from trl import DPOTrainer, GRPOTrainer, SFTTrainer

from .transformers import OffloadTrainer

__all__ = ["OffloadDPOTrainer", "OffloadGRPOTrainer", "OffloadSFTTrainer"]

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

    #: Replaced routes whose TRL override this class runs after OffloadTrainer's (Note [a
    #: TRL trainer that extends a replaced route]).
    _EXTENDED: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        trl_classes = [c for c in type(self).__mro__ if c.__module__.startswith("trl.")]
        clashes = [
            f"{c.__name__}.{name}"
            for c in trl_classes
            for name in _REPLACED
            if name in vars(c) and name not in self._EXTENDED
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


# Note [a TRL trainer that extends a replaced route]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# GRPOTrainer overrides ``_load_optimizer_and_scheduler``, one of the routes OffloadTrainer
# replaces: it calls Trainer's (the optimizer and scheduler) and then restores its adaptive
# entropy controller from ``entropy_ctrl_state.json``, which its ``_save_checkpoint`` wrote.
# With OffloadTrainer first in the MRO, TRL's version would never run and a resumed run
# would restart the controller. So ``OffloadGRPOTrainer`` loads the optimizer and scheduler
# OffloadTrainer's way, then calls the next class after OffloadTrainer in the MRO, which is
# GRPOTrainer's version (or, if a TRL version drops it, nothing). Its own ``super()`` call
# then reaches ``_OptimizerLoadedAbove``, placed after GRPOTrainer and before Trainer, which
# does nothing: Trainer's loading (torch.load into the optimizer) never runs. TRL's code
# runs whole, not a copy of it, so a TRL version that restores more state restores it here.


class _OptimizerLoadedAbove(Trainer):
    """Ends the TRL trainer's ``super()._load_optimizer_and_scheduler`` chain: OffloadTrainer
    has loaded both already (Note [a TRL trainer that extends a replaced route])."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        return


class OffloadGRPOTrainer(_OffloadTRLTrainer, GRPOTrainer, _OptimizerLoadedAbove):
    """``trl.GRPOTrainer`` training with an offload optimizer; see the module docstring. TRL
    generates and scores the completions with the policy being trained (a forward pass
    through the same parameters: they stay where the optimizer keeps them)."""

    _EXTENDED = ("_load_optimizer_and_scheduler",)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """OffloadTrainer's optimizer and scheduler, then GRPOTrainer's own state (Note [a
        TRL trainer that extends a replaced route])."""
        super()._load_optimizer_and_scheduler(checkpoint)
        super(OffloadTrainer, self)._load_optimizer_and_scheduler(checkpoint)
