"""Hugging Face ``Trainer`` with an offload optimizer: ``OffloadTrainer``.

A drop-in ``transformers.Trainer`` (so also a base for TRL's trainers)::

    from zero_offload import OffloadConfig
    from zero_offload.integrations.transformers import OffloadTrainer

    trainer = OffloadTrainer(
        model=model,
        args=TrainingArguments(output_dir="out", bf16=True, max_grad_norm=1.0, ...),
        train_dataset=train_dataset,
        offload_config=OffloadConfig(bucket_bytes="32MiB"),  # optional
    )
    trainer.train()

What it does, in the Trainer methods made for overriding:

- ``create_optimizer`` builds the offload optimizer ``TrainingArguments.optim`` names
  (``adamw_torch``/``adamw_torch_fused``: ``OffloadAdamW``; ``adagrad``: ``OffloadAdagrad``;
  ``lion_32bit``/``paged_lion_32bit``: ``OffloadLion``; Note [Trainer's optim names] in
  ``_optim_names.py``) from the arguments Trainer would give that optimizer, with Trainer's
  own two parameter groups (``get_decay_parameter_names``: no decay for biases and norms),
  and wraps it for accelerate without the state round trip (Note [no state round trip at
  prepare] in ``accelerate.py``). An offload optimizer passed as ``optimizers=(opt,
  scheduler)`` (any rule: ``OffloadAdafactor`` and ``OffloadMuon`` on one rank) is used as
  it is.
- ``_clip_grad_norm`` / ``_get_grad_norm`` clip at ``args.max_grad_norm`` inside the
  optimizer and return the true pre-clip norm, which Trainer logs as ``grad_norm``
  (Note [frameworks clip through the optimizer] in ``_optim.py``).
- ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` write and read
  ``optimizer.pt`` in the consolidated layout (``zero_offload.checkpoint_io``): with several
  ranks every rank's shard is in it, and it resumes on any number of ranks. State that may
  be on NVMe (``OffloadConfig.nvme_dir`` set) cannot be consolidated in host RAM: it
  streams to ``zero_offload_optimizer/rank{r}/`` in the checkpoint folder instead
  (``opt.save_streaming``), which resumes from a folder every rank reads (a shared file
  system, as ``optimizer.pt`` needs), on the same number of ranks or, for an elementwise
  rule, another (Note [a streamed checkpoint on another world size] in
  ``optim/checkpoint/reshard.py``).
- ``compute_loss``: for an fp16 model, the gradient of the loss is multiplied by
  the optimizer's loss scale during backward (Trainer's own backward does not scale).
- With several ranks (``torchrun``) the model is not wrapped in DDP: the optimizer
  reduce-scatters the gradients itself.
- ``_save``: with parameter offload on several ranks (ZeRO-3) every rank takes the model's
  state dict, which gathers each unit (Note [the model is saved on every rank under
  ZeRO-3]); rank 0 writes it.

Refused at construction, with a ``ValueError`` saying what to use: ``fp16=True`` (torch's
GradScaler needs ``param.grad``; use ``bf16=True`` or an fp16 model), an ``optim`` no offload
rule reproduces (``adafactor`` among them: transformers' Adafactor is not torch's), DeepSpeed,
FSDP, several GPUs in one process, and a clipping threshold in ``offload_config`` (clipping is
``TrainingArguments.max_grad_norm``'s job).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

from ..accelerator import Accelerator as OffloadDevice
from ..checkpoint_io import load_consolidated, save_consolidated
from ..config import OffloadConfig
from ..fileio import save_torch
from ..optim import OffloadOptimizer
from ..profiling.metrics import StepMetrics
from ..weights import has_source, load_pretrained
from ._optim import (
    STREAMING_NAME,
    find_offload_optimizer,
    parameters_sharded,
    pre_clip_norm,
    saveable,
    state_on_nvme,
)
from ._optim_names import optimizer_cls_and_kwargs
from .accelerate import FP16_AMP_MESSAGE, OffloadAcceleratedOptimizer

__all__ = ["OffloadTrainer"]

#: The Trainer methods OffloadTrainer overrides; a transformers without them would bypass
#: the clipping and checkpoint routes silently, so construction checks they exist.
_OVERRIDDEN = (
    "create_optimizer",
    "get_decay_parameter_names",
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
    "compute_loss",
    "_save",
)


class OffloadTrainer(Trainer):
    """``transformers.Trainer`` training with an offload optimizer (``OffloadAdamW``,
    ``OffloadAdagrad`` or ``OffloadLion`` by ``TrainingArguments.optim``, or the one passed
    in ``optimizers=``); see the module docstring.

    Takes ``Trainer``'s arguments, plus keyword-only:
        offload_config: bucketing, tiling, ``offload_fraction``, loss scaling and the other
            ``OffloadConfig`` fields for the optimizer it builds (default
            ``OffloadConfig()``). Its ``max_grad_norm`` must be ``None``: Trainer's
            ``max_grad_norm`` sets the clipping.
        offload_device: the zero-offload accelerator for the optimizer (default
            ``zero_offload.get_accelerator()``).
        weights: an HF safetensors checkpoint (directory or file) to load ``model`` from,
            ``model`` being built on the meta device (``zero_offload.load_pretrained``):
            each trainable weight is read into its device slot when the optimizer is built,
            so the model is never whole in host or device memory (docs/big-models.md).
        step_during_backward: whether a window's last micro-batch announces the step, so
            that it runs during backward where it can (default True; Note [Trainer steps
            during backward]). False for a model that reads a parameter's value outside its
            gradient's path (``.detach()``), which such a step refuses mid-backward.

    With ``OffloadConfig(offload_parameters=True)`` or ``partition_parameters=True`` the
    optimizer is given the model and finds its blocks itself.
    """

    def __init__(
        self,
        *args: Any,
        offload_config: OffloadConfig | None = None,
        offload_device: OffloadDevice | None = None,
        weights: str | os.PathLike[str] | None = None,
        step_during_backward: bool = True,
        **kwargs: Any,
    ) -> None:
        missing = [name for name in _OVERRIDDEN if not hasattr(Trainer, name)]
        if missing:
            raise RuntimeError(
                f"this transformers version's Trainer has no {missing}, through which "
                "OffloadTrainer clips, logs grad_norm and checkpoints; install a transformers "
                "that zero-offload supports (see pyproject.toml, the 'test' extra)"
            )
        for name, value, kind in (
            ("offload_config", offload_config, OffloadConfig),
            ("offload_device", offload_device, OffloadDevice),
        ):
            if value is not None and not isinstance(value, kind):
                raise TypeError(
                    f"{name} must be a zero_offload.{kind.__name__} or None, got "
                    f"{type(value).__name__}"
                )
        if offload_config is not None and offload_config.max_grad_norm is not None:
            raise ValueError(
                f"offload_config.max_grad_norm={offload_config.max_grad_norm!r}: OffloadTrainer "
                "clips at TrainingArguments.max_grad_norm; set that instead and leave "
                "OffloadConfig.max_grad_norm=None"
            )
        if not isinstance(step_during_backward, bool):
            raise TypeError(
                "step_during_backward must be True or False, got "
                f"{type(step_during_backward).__name__} {step_during_backward!r}"
            )
        self.step_during_backward = step_during_backward
        self.offload_config = offload_config if offload_config is not None else OffloadConfig()
        self.offload_device = offload_device
        self._offload_metrics: StepMetrics | None = None  # from the first training log on
        self._offload_logged_step = 0
        if weights is not None:
            model = kwargs.get("model", args[0] if args else None)
            if not isinstance(model, torch.nn.Module):
                raise TypeError(
                    f"OffloadTrainer(weights={str(weights)!r}) loads into model=, which must be "
                    f"an nn.Module built on the meta device, got {type(model).__name__}"
                )
            load_pretrained(model, weights, accelerator=offload_device)
        super().__init__(*args, **kwargs)
        self._check_setup()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log, with the offload figures merged into training records (Note
        [offload metrics in the framework's logs] in ``profiling/metrics.py``)."""
        if "loss" in logs and self.optimizer is not None:
            if self._offload_metrics is None:
                self._offload_metrics = StepMetrics(self.offload_optimizer)
            steps = self.state.global_step - self._offload_logged_step
            self._offload_logged_step = self.state.global_step
            logs = {**logs, **self._offload_metrics.collect(steps)}
        super().log(logs, start_time)

    def _check_setup(self) -> None:
        """Refuse what would train wrongly, now rather than at the first step."""
        args = self.args
        if args.fp16:
            raise ValueError(
                f"OffloadTrainer with TrainingArguments(fp16=True): {FP16_AMP_MESSAGE}"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "OffloadTrainer does not combine with DeepSpeed or FSDP (each partitions the "
                "optimizer state its own way); remove TrainingArguments.deepspeed / fsdp, or use "
                "a plain Trainer with them"
            )
        if args.n_gpu > 1:
            raise ValueError(
                f"OffloadTrainer sees {args.n_gpu} GPUs in one process (torch.nn.DataParallel); "
                "launch one process per GPU with torchrun, or expose one GPU "
                "(CUDA_VISIBLE_DEVICES)"
            )
        if self.optimizer_cls_and_kwargs is not None:
            raise ValueError(
                "OffloadTrainer builds its offload optimizer itself: drop "
                "optimizer_cls_and_kwargs and set the rule and its hyper-parameters in "
                "TrainingArguments (optim, learning_rate, adam_beta1/2, adam_epsilon, "
                "weight_decay, optim_args) and the offload settings in offload_config, or pass "
                "an offload optimizer in optimizers=(opt, None)"
            )
        if self.optimizer is None:
            optimizer_cls_and_kwargs(args)  # refuses a name or optim_args no rule reproduces
            return
        opt = find_offload_optimizer(self.optimizer, where="OffloadTrainer(optimizers=...)")
        limit = opt.config.max_grad_norm
        if limit is not None and limit != args.max_grad_norm:
            raise ValueError(
                f"the {type(opt).__name__} passed in optimizers= clips at "
                "OffloadConfig.max_grad_norm="
                f"{limit!r} but TrainingArguments.max_grad_norm={args.max_grad_norm!r}; set "
                "TrainingArguments.max_grad_norm to the same value, or build the optimizer "
                "with OffloadConfig(max_grad_norm=None) and let Trainer's setting clip"
            )

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        """Trainer's placement, except for a model whose trainable parameters wait on meta
        for the optimizer to read them from their checkpoint (``load_pretrained``): the
        optimizer places them, and the rest is on the device already."""
        if any(has_source(p) for p in model.parameters()):
            return
        super()._move_model_to_device(model, device)

    # -- the optimizer -----------------------------------------------------------------

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the offload optimizer ``TrainingArguments.optim`` names (or take the one
        passed in ``optimizers=``) and wrap it for accelerate (Note [no state round trip at
        prepare])."""
        if self.accelerator.num_processes > 1:
            # Several ranks: the optimizer reduce-scatters the gradients itself. Preparing the
            # model here in evaluation mode (mixed precision, compile; no DDP) marks it
            # prepared, so the prepare() that Trainer calls next leaves it unwrapped. No
            # placement: Trainer placed the model at construction, and accelerate's device
            # ("cpu:0") would make .to() copy every parameter away from the optimizer's
            # storage.
            self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        if self.optimizer is None:
            self.optimizer = self._build_offload_optimizer(self.model if model is None else model)
        if not isinstance(self.optimizer, OffloadAcceleratedOptimizer):
            opt = find_offload_optimizer(self.optimizer, where="OffloadTrainer")
            self.optimizer = OffloadAcceleratedOptimizer(opt, scaler=self.accelerator.scaler)
            if self._offload_metrics is not None:  # a new train(): the old optimizer's go
                self._offload_metrics.close()
            self._offload_metrics = StepMetrics(opt)  # listening from the first step on
            self._offload_logged_step = self.state.global_step
        return self.optimizer

    def _build_offload_optimizer(self, model: torch.nn.Module) -> OffloadOptimizer:
        """The rule ``args.optim`` names (Note [Trainer's optim names] in ``_optim_names.py``)
        over Trainer's two parameter groups."""
        args = self.args
        cls, kwargs = optimizer_cls_and_kwargs(args)
        decay = set(self.get_decay_parameter_names(model))
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        # Trainer's own grouping (create_optimizer), so a checkpoint of a Trainer run with
        # the torch optimizer of the same name has the same groups.
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        config = dataclasses.replace(
            self.offload_config,
            max_grad_norm=_clip_at(args),
        )
        return cls(
            groups,
            **kwargs,
            config=config,
            accelerator=self.offload_device,
            # Parameter offload and ZeRO-3 fetch the model's blocks (``layers`` found by
            # the optimizer: the nn.ModuleList holding the most parameters).
            model=model if config.offload_parameters or config.partition_parameters else None,
        )

    @property
    def offload_optimizer(self) -> OffloadOptimizer:
        """The offload optimizer behind ``self.optimizer`` (after ``create_optimizer``)."""
        if self.optimizer is None:
            raise RuntimeError(
                "OffloadTrainer.offload_optimizer before the optimizer exists; call "
                "trainer.create_optimizer() or trainer.train() first"
            )
        return find_offload_optimizer(self.optimizer, where="OffloadTrainer")

    # -- stepping during backward -------------------------------------------------------

    # Note [Trainer steps during backward]
    # Trainer runs the window's last micro-batch, then clips, then steps, with nothing in
    # between that changes the gradients. So on that micro-batch (accelerate's
    # sync_gradients) OffloadTrainer announces the step before backward when the optimizer
    # can take it there (Note [stepping during backward] in optim/update/eager.py): with no
    # clipping (max_grad_norm=0), or with OffloadConfig(speculative_step=True), which
    # steps at once and rolls back when the clip binds. The optimizer must then clip at
    # TrainingArguments.max_grad_norm itself (the one it builds does), so Trainer's clip
    # call only reads the pre-clip norm. Bitwise the step taken in step(); the share of
    # CPU Adam done during backward shows in the profiler.

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Trainer's training step; the window's last one announces the optimizer step
        where it can run during backward (Note [Trainer steps during backward])."""
        opt = self.offload_optimizer
        clip = _clip_at(self.args)
        if (
            self.step_during_backward
            and self.accelerator.sync_gradients
            and not opt.step_announced
            and opt.config.max_grad_norm == clip
            and opt.can_step_during_backward()
        ):
            opt.announce_step()
        # compute_loss scales the loss's gradient: Note [a backward carries the loss scale]
        with opt.scaled_backward():
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            except RuntimeError as exc:
                explained = opt.stepped_read_error(
                    exc, "OffloadTrainer(step_during_backward=False)"
                )
                if explained is None:
                    raise
                raise explained from exc

    # -- clipping and the logged norm ----------------------------------------------------

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """Clip at ``args.max_grad_norm`` inside the optimizer; the pre-clip norm. After an
        announced step the optimizer clips at that value itself (Note [Trainer steps during
        backward]): only the norm is read."""
        opt = self.offload_optimizer
        if opt.step_announced:
            return opt.grad_norm()
        return opt.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(
        self, model: torch.nn.Module, grad_norm: torch.Tensor | float | None = None
    ) -> torch.Tensor | float:
        """The pre-clip norm Trainer logs as ``grad_norm`` (read from the optimizer when
        ``max_grad_norm`` is 0, so nothing clipped)."""
        if grad_norm is not None:
            return grad_norm
        opt = self.offload_optimizer
        return opt.grad_norm() if opt.step_announced else pre_clip_norm(opt)

    # -- fp16 models: the loss scale ---------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Trainer's loss; for an fp16 model its gradient is scaled by the optimizer's loss
        scale during backward, as ``OffloadOptimizer.backward`` would (the value returned, and
        logged, stays unscaled)."""
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        loss = result[0] if return_outputs else result
        if (
            self.optimizer is not None
            and isinstance(loss, torch.Tensor)
            and loss.requires_grad
            and self.offload_optimizer.loss_scale != 1.0
        ):
            opt = self.offload_optimizer
            # Read at backward time: an overflow in between may have lowered the scale.
            loss.register_hook(lambda grad: grad * opt.loss_scale)
        return result

    # -- checkpoints -------------------------------------------------------------------

    # Note [the model is saved on every rank under ZeRO-3]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Trainer saves the model from the writing rank only (``_save`` returns at once on the
    # others, and ``save_pretrained`` takes ``model.state_dict()`` on rank 0). With parameter
    # offload on several ranks each rank's homes hold a shard of each unit, so reading a
    # released parameter gathers its unit: a collective (Note [a sharded unit] in
    # ``params/sharded_fetch.py``). Rank 0 alone would wait in the first gather forever. So
    # every rank takes the state dict, in the same order, and hands it to Trainer's
    # ``_save``, which writes it on rank 0 and drops it on the others (as Trainer does for
    # an FSDP full state dict). Its entries are host copies, so the names of one (tied)
    # parameter are pointed at one of them again (Note [state dicts the savers can write] in
    # ``_optim.py``). Hidden cost: each rank holds a host copy of the whole model for the
    # moment of the save.

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's ``_save``; under ZeRO-3 the state dict is taken on every rank first
        (Note [the model is saved on every rank under ZeRO-3])."""
        if (
            state_dict is None
            and self.optimizer is not None
            and parameters_sharded(self.offload_optimizer)
        ):
            state_dict = saveable(self.model, self.model.state_dict())
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """``optimizer.pt`` in the consolidated layout (every rank takes part; rank 0 writes
        it), or with ``nvme_dir`` set a streaming checkpoint in ``STREAMING_NAME``, and
        Trainer's ``scheduler.pt``."""
        opt = self.offload_optimizer
        if state_on_nvme(opt):  # every rank alike: each writes its own shard, tile by tile
            opt.save_streaming(os.path.join(output_dir, STREAMING_NAME))
        else:
            save_consolidated(opt, os.path.join(output_dir, OPTIMIZER_NAME))
        if self.args.should_save:
            path = os.path.join(output_dir, SCHEDULER_NAME)
            save_torch(self.lr_scheduler.state_dict(), path, what="scheduler.pt")  # atomically

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Every rank reads ``optimizer.pt`` and keeps its own shard (any world size), or
        streams its own shard back from ``STREAMING_NAME`` (any world size for an elementwise
        rule, the saving one for a rule that reads whole parameters); as Trainer,
        a checkpoint saved without them (``save_only_model``) loads neither."""
        if checkpoint is None:
            return
        opt_path = os.path.join(checkpoint, OPTIMIZER_NAME)
        streamed = os.path.join(checkpoint, STREAMING_NAME)
        scheduler_path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isdir(streamed) and os.path.isfile(scheduler_path):
            self.offload_optimizer.load_streaming(streamed)
        elif os.path.isfile(opt_path) and os.path.isfile(scheduler_path):
            load_consolidated(self.offload_optimizer, opt_path)
        else:
            return
        self.lr_scheduler.load_state_dict(torch.load(scheduler_path, weights_only=True))


def _clip_at(args: Any) -> float | None:
    """The clipping ``TrainingArguments.max_grad_norm`` asks of the optimizer: None for 0
    (off) and for ``inf``, which Trainer takes as "log the norm, clip nothing" (the norm is
    still read: ``clip_grad_norm_(inf)`` clips nothing)."""
    limit = args.max_grad_norm
    return limit if 0 < limit < float("inf") else None
