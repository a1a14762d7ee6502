"""PyTorch Lightning with ``OffloadAdamW``: ``OffloadLightningModule`` and ``OffloadDDPStrategy``.

Two lines change in a Lightning program: the module's base class and the optimizer::

    import lightning.pytorch as pl
    from zero_offload import OffloadAdamW
    from zero_offload.integrations.lightning import OffloadLightningModule

    class Net(OffloadLightningModule):  # was: pl.LightningModule
        ...
        def configure_optimizers(self):
            return OffloadAdamW(self.parameters(), lr=1e-3)  # was: torch.optim.AdamW

    pl.Trainer(gradient_clip_val=1.0, accumulate_grad_batches=4, precision="bf16-mixed").fit(Net())

``OffloadAdamW`` stands for any offload optimizer here (``OffloadLion``, ``OffloadAdagrad``,
``OffloadAdafactor``, ``OffloadMuon``): each is clipped and scaled the same way.

Several processes (``torchrun`` or Lightning's own launcher) add a third:
``Trainer(strategy=OffloadDDPStrategy())`` instead of ``strategy="ddp"``.

Note [Lightning clips through the module]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Lightning clips in ``LightningModule.clip_gradients``, which ``configure_gradient_clipping``
(the hook users override) calls, and which manual optimization calls by hand. It hands the
work to the precision plugin, whose ``clip_grad_by_norm`` calls
``torch.nn.utils.clip_grad_norm_`` on the optimizer's parameters: refused for ours (Note
[torch's clipping cannot see our gradients] in ``optim/torch_clipping.py``). So
``OffloadLightningModule.clip_gradients`` takes ``Trainer(gradient_clip_val=...)`` (or the
values passed to it) and, for an ``OffloadAdamW``, calls ``opt.clip_grad_norm_(max_norm)``
(Note [frameworks clip through the optimizer] in ``_optim.py``); other optimizers go to
Lightning's own path unchanged. Overriding the module rather than a precision plugin keeps
every precision plugin and strategy as Lightning builds them (``32-true``, ``bf16-mixed``
and ``16-true`` are tested), and covers automatic and manual optimization alike.
``gradient_clip_algorithm="value"`` clips each element of ``param.grad``: OffloadAdamW has
only the global norm, so it is refused.

Note [Lightning's steps are ordinary]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Automatic optimization calls ``optimizer.step(closure)`` where the closure runs forward,
backward and the clip; ``OffloadAdamW.step`` runs the closure first, as torch's optimizers
do. ``accumulate_grad_batches`` runs backward without stepping and clears gradients at
the window's start: the gradient semantics of ``OffloadAdamW`` (docs/design.md, "The
gradient semantics"). bf16-mixed
autocasts the forward and leaves fp32 gradients: a plain ``loss.backward()`` is right. An
fp16 model (``precision="16-true"``) needs the optimizer's loss scale on the loss, which
``OffloadLightningModule.backward`` applies. fp16 AMP (``precision="16-mixed"``) uses
torch's GradScaler on ``param.grad``: refused before the first backward.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from ..checkpoint_io import consolidated_state_dict
from ..optim import OffloadOptimizer
from ..profiling.metrics import StepMetrics
from ._optim import each_rank, state_on_nvme
from .accelerate import FP16_AMP_MESSAGE

__all__ = ["OffloadDDPStrategy", "OffloadLightningModule"]

_VALUE_REFUSAL = (
    "gradient_clip_algorithm='value' clips each element of param.grad, and OffloadAdamW keeps "
    "no param.grad (its gradients are in host memory; it clips by the global norm only). Use "
    "gradient_clip_algorithm='norm' (the default) with gradient_clip_val, or leave "
    "gradient_clip_val unset"
)


def _offload_optimizer(optimizer: object) -> OffloadOptimizer | None:
    """``optimizer``, or the one behind Lightning's ``LightningOptimizer``, if it is ours."""
    inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer.optimizer
    return inner if isinstance(inner, OffloadOptimizer) else None


class OffloadLightningModule(pl.LightningModule):
    """A ``LightningModule`` whose clipping and backward know ``OffloadAdamW``.

    Derive from it instead of ``LightningModule`` and return ``OffloadAdamW`` from
    ``configure_optimizers``. ``Trainer(gradient_clip_val=v)`` (algorithm ``"norm"``) then
    clips inside the optimizer (Note [Lightning clips through the module]); an fp16 model's
    loss is scaled by the optimizer's loss scale (Note [Lightning's steps are ordinary]).
    Optimizers other than ``OffloadAdamW`` behave as under a plain ``LightningModule``.
    """

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Lightning's ``clip_gradients``; for an ``OffloadAdamW``, ``opt.clip_grad_norm_``
        at ``gradient_clip_val`` (default the Trainer's). Algorithm ``"value"`` is refused."""
        opt = _offload_optimizer(optimizer)
        if opt is None:
            super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        trainer = self.trainer
        if gradient_clip_val is None:
            gradient_clip_val = trainer.gradient_clip_val or 0.0
        if gradient_clip_algorithm is None:
            gradient_clip_algorithm = trainer.gradient_clip_algorithm or "norm"
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm))
        if algorithm.lower() != "norm":
            raise ValueError(f"gradient_clip_algorithm={algorithm!r}: {_VALUE_REFUSAL}")
        if isinstance(gradient_clip_val, bool) or not isinstance(gradient_clip_val, (int, float)):
            raise TypeError(
                f"gradient_clip_val must be an int or a float, got {gradient_clip_val!r}"
            )
        if gradient_clip_val > 0:  # Lightning's rule: 0 (or unset) does not clip
            opt.clip_grad_norm_(float(gradient_clip_val))

    def on_fit_start(self) -> None:
        """Refuses optimizer state on NVMe after the optimizers are built and before a
        checkpoint (``ckpt_path``) is restored into them; call ``super().on_fit_start()``
        when you override it (``backward`` refuses it again otherwise, before the first
        gradient)."""
        super().on_fit_start()
        trainer = self._trainer
        if trainer is not None:
            ours = [o for o in map(_offload_optimizer, trainer.optimizers) if o is not None]
            _refuse_nvme_state(ours, every_rank=True)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Logs the offload figures per optimizer step with ``self.log_dict`` (Note [offload
        metrics in the framework's logs] in ``profiling/metrics.py``); call
        ``super().on_train_batch_end(...)`` when you override it."""
        super().on_train_batch_end(outputs, batch, batch_idx)
        trainer = self._trainer
        if trainer is None:
            return
        ours = [o for o in (_offload_optimizer(o) for o in trainer.optimizers) if o is not None]
        if not ours:
            return
        built_for = getattr(self, "_offload_metrics_for", None)
        if built_for != [id(opt) for opt in ours]:  # first batch, or new optimizers
            for old in getattr(self, "_offload_metrics", None) or []:
                old.close()
            self._offload_metrics = [StepMetrics(opt) for opt in ours]
            self._offload_metrics_for = [id(opt) for opt in ours]
            self._offload_mark = trainer.global_step  # counted from the next step on
        steps = trainer.global_step - self._offload_mark
        if steps <= 0:  # an accumulation micro-batch: no optimizer step since the last log
            return
        self._offload_mark = trainer.global_step
        for index, metrics in enumerate(self._offload_metrics):
            suffix = "" if len(self._offload_metrics) == 1 else f"/{index}"
            figures = {f"{k}{suffix}": v for k, v in metrics.collect(steps).items()}
            self.log_dict(figures, on_step=True, on_epoch=False, prog_bar=False)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()``; refuses fp16 AMP and clipping by value before any gradient
        exists, and scales an fp16 model's loss by the optimizer's loss scale."""
        trainer = self._trainer
        optimizers = [] if trainer is None else [_offload_optimizer(o) for o in trainer.optimizers]
        ours = [opt for opt in optimizers if opt is not None]
        if ours:
            self._check_trainer(trainer)
            _refuse_nvme_state(ours)
            scales = {opt.loss_scale for opt in ours}
            if len(scales) > 1:
                raise ValueError(
                    f"the OffloadAdamW optimizers have different loss scales {sorted(scales)}; "
                    "one backward can carry one: give the fp16 parameters a single optimizer"
                )
            (scale,) = scales
            if scale != 1.0:
                loss = loss * scale
        with contextlib.ExitStack() as scaled:  # Note [a backward carries the loss scale]
            for opt in ours:
                scaled.enter_context(opt.scaled_backward())
            super().backward(loss, *args, **kwargs)

    @staticmethod
    def _check_trainer(trainer: pl.Trainer) -> None:
        plugin = trainer.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            raise ValueError(f"Trainer(precision={plugin.precision!r}): {FP16_AMP_MESSAGE}")
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", None)
        if trainer.gradient_clip_val and algorithm == "value":
            raise ValueError(
                f"Trainer(gradient_clip_algorithm='value', gradient_clip_val="
                f"{trainer.gradient_clip_val!r}): {_VALUE_REFUSAL}"
            )


def _refuse_nvme_state(optimizers: list[OffloadOptimizer], *, every_rank: bool = False) -> None:
    """Refuse optimizer state on NVMe (``OffloadConfig.nvme_dir``, on any rank):
    Lightning reads the whole state through ``opt.state`` at teardown (to move it to the
    CPU) and through ``state_dict()`` in its checkpoints, which NVMe state cannot hand out
    (``StateNotInHostRam``), nor take a restored checkpoint's. Refused at ``on_fit_start``
    (before Lightning restores a checkpoint into the optimizer) and again before the first
    backward, not after the last step. ``every_rank`` (at ``on_fit_start``, which every
    rank runs): where any rank's config sets ``nvme_dir`` (it may differ by rank), every
    rank refuses (one all-gather per optimizer), so none goes on alone into collectives the
    others left."""
    for opt in optimizers:
        mine = state_on_nvme(opt)
        on_nvme = mine
        if every_rank:
            what = "whether each rank keeps optimizer state on NVMe (Lightning refuses it)"
            on_nvme = any(each_rank(mine, opt, what))
        if on_nvme:
            config = (
                f"OffloadConfig(nvme_dir={str(opt.config.nvme_dir)!r}, host_budget="
                f"{opt.config.host_budget!r})"
                if mine
                else "another rank's OffloadConfig (nvme_dir set there, not on this rank)"
            )
            raise ValueError(
                f"{type(opt).__name__}: {config} keeps the optimizer state past "
                "host_budget on NVMe. Lightning reads the whole state as tensors through "
                "opt.state when it tears the strategy down and through opt.state_dict() in "
                "its checkpoints, and NVMe state cannot be handed out that way, so the run "
                "would fail after its last step. Not supported under Lightning: leave "
                "nvme_dir unset (zero-offload estimate says how much host RAM the state "
                "needs), or train with NVMe state in a plain loop and checkpoint with "
                "opt.save_streaming(path) / opt.load_streaming(path)"
            )


def check_optimizer_groups(optimizers: list[torch.optim.Optimizer]) -> None:
    """Refuse an ``OffloadAdamW`` on the default process group, or sharing its group with
    another: Note [the optimizer's own process group]."""
    owners: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        opt = _offload_optimizer(optimizer)
        if opt is None or opt.comm is None:
            continue
        group = opt.comm.group
        fix = (
            "under OffloadDDPStrategy build each OffloadAdamW with process_group="
            "self.trainer.strategy.optimizer_process_group (a new group per read), or "
            "without process_group=, or its collectives interleave with other ones on one "
            "group and hang (Note [the optimizer's own process group] in "
            "zero_offload/integrations/lightning.py)"
        )
        if group is None or group is dist.group.WORLD:
            raise ValueError(
                f"{opt.comm.where()}: optimizer {index} (OffloadAdamW) was built on the "
                f"default process group, where Lightning runs its own collectives; {fix}"
            )
        if id(group) in owners:
            raise ValueError(
                f"{opt.comm.where()}: optimizers {owners[id(group)]} and {index} (OffloadAdamW) "
                f"share process group {group!r}; each needs its own: {fix}"
            )
        owners[id(group)] = index


class OffloadDDPStrategy(DDPStrategy):
    """``DDPStrategy`` for ``OffloadAdamW``: one process per device, no DDP wrapper.

    ``OffloadAdamW`` reduce-scatters the gradients itself, so the model is not wrapped in
    ``DistributedDataParallel`` (which would all-reduce every gradient a second time);
    rank 0's initial weights are broadcast, as DDP's constructor would. Each optimizer must
    run its collectives on a process group of its own (Note [the optimizer's own process
    group])::

        def configure_optimizers(self):
            group = self.trainer.strategy.optimizer_process_group  # a new group per read
            return OffloadAdamW(self.parameters(), lr=1e-3, process_group=group)

    (``OffloadAdamW`` built without ``process_group=`` makes a group of its own too.)

    Checkpoints hold the optimizer state consolidated from every rank's shard
    (``checkpoint_io``), written by rank 0; on resume every rank keeps the pieces it owns,
    on any number of ranks. The state is not moved to the device after loading: it lives in
    host memory by design. Takes ``DDPStrategy``'s arguments; those that configure the DDP
    wrapper do nothing.
    """

    # Note [the optimizer's own process group]
    # Lightning issues collectives on the default group from the main thread: a broadcast
    # before every batch (the SIGTERM check), reductions for sync_dist logging, barriers.
    # OffloadAdamW issues its reduce-scatters and all-gathers from its communication thread
    # while the main thread goes on (the last bucket's reduce-scatter is still in flight
    # when backward returns). On one group the two streams of calls would interleave in a
    # different order on each rank, and a collective matched against the wrong one hangs.
    # Two OffloadAdamW (a GAN's, or a model's and its head's) have a communication thread
    # each, so they cannot share a group either. So every read of
    # ``optimizer_process_group`` makes a new group over the same ranks (a collective:
    # every rank's configure_optimizers reads it in the same order), and an OffloadAdamW
    # on the default group, or sharing its group with another, is refused before the
    # first batch.

    @property
    def optimizer_process_group(self) -> Any:
        """A new process group over the default group's ranks, for one ``OffloadAdamW``
        (``process_group=``); read it once per optimizer, in configure_optimizers. Note
        [the optimizer's own process group]."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "OffloadDDPStrategy.optimizer_process_group before the processes are set up; "
                "read it in configure_optimizers (self.trainer.strategy.optimizer_process_group)"
            )
        return dist.new_group(backend=dist.get_backend())

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's ``configure_optimizers``; each ``OffloadAdamW`` must use a group of
        its own (Note [the optimizer's own process group])."""
        super().setup_optimizers(trainer)
        check_optimizer_groups(self.optimizers)

    def configure_ddp(self) -> None:
        """Leave the module unwrapped; every rank starts from rank 0's weights."""
        if not isinstance(self.model, pl.LightningModule):
            raise RuntimeError(
                f"OffloadDDPStrategy expected the LightningModule itself, found "
                f"{type(self.model).__name__}; this is a bug"
            )
        _sync_module_states(self.model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The consolidated state on rank 0, ``{}`` on the others (a collective: Lightning
        calls it on every rank when it saves)."""
        opt = _offload_optimizer(optimizer)
        if opt is None:
            return super().optimizer_state(optimizer)
        state = consolidated_state_dict(opt)
        return {} if state is None else state

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Each ``OffloadAdamW`` loads the consolidated state and keeps its pieces; other
        optimizers as Lightning does."""
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"the checkpoint holds {len(states)} optimizer states, the module configures "
                f"{len(self.optimizers)} optimizers"
            )
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)
            if _offload_optimizer(optimizer) is None:
                _optimizer_to_device(optimizer, self.root_device)
