"""accelerate: an ``Accelerator`` that knows ``OffloadAdamW`` keeps gradients on the host.

Use ``OffloadAccelerator`` where the loop would build an ``Accelerator``; the rest of the
loop stays as accelerate documents it::

    accelerator = OffloadAccelerator(mixed_precision="bf16")  # or "no"
    opt = OffloadAdamW(model.parameters(), lr=1e-4)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)                        # scaled for fp16 models
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # clips inside OffloadAdamW
        opt.step()
        opt.zero_grad()

What it changes, and why:

- ``prepare`` wraps an ``OffloadAdamW`` in ``OffloadAcceleratedOptimizer``. See Note
  [no state round trip at prepare].
- ``clip_grad_norm_`` on the parameters of a prepared ``OffloadAdamW`` clips inside the
  optimizer and returns the true pre-clip norm (Note [frameworks clip through the
  optimizer] in ``_optim.py``). Any other parameters go to accelerate's own.
- ``get_state_dict`` (so ``save_model`` and ``save_state``) gives the writing process a
  state dict accelerate's safetensors savers write whole: parameters that share a bucket's
  storage get copies of their own (accelerate would keep one per storage and drop the rest),
  and under ZeRO-3 a tied parameter's names share one tensor (Note [state dicts the savers
  can write] in ``_optim.py``).
- ``load_state`` reads the model file ``save_state`` wrote (safetensors, the default) into a
  model whose parameters are bucket views itself, where accelerate's reader refuses them
  (Note [loading into bucket views]).
- ``save_state`` / ``load_state`` with an offload optimizer whose state may be on NVMe
  (``OffloadConfig.nvme_dir`` set): each process streams its shard to
  ``zero_offload_optimizer/rank{r}/`` in the checkpoint folder (``_1``, ``_2`` after the
  name for the second and third optimizer), as ``OffloadTrainer`` does, and reads it back
  at ``load_state``, which resumes with the same number of processes from a folder every
  process reads; ``optimizer.bin`` then holds only a marker (Note [optimizer state on NVMe
  in save_state]). Other optimizers are written to ``optimizer.bin`` as accelerate does.
- ``backward`` multiplies the loss by the optimizer's loss scale (1 unless the model is
  fp16: ``OffloadAdamW`` has its own dynamic loss scaler).
- With several processes, a model whose trainable parameters an ``OffloadAdamW`` owns is
  not wrapped in ``DistributedDataParallel``: the optimizer reduce-scatters the gradients
  itself, and DDP's all-reduce would come on top (of gradients that are already gone).

``OffloadAdamW`` stands for any offload optimizer here (``OffloadLion``, ``OffloadAdagrad``,
``OffloadAdafactor``, ``OffloadMuon``): each is prepared, clipped and scaled the same way.

``mixed_precision="fp16"`` is refused: torch's ``GradScaler`` unscales ``param.grad``,
which ``OffloadAdamW`` never leaves behind. Use ``"bf16"``, or an fp16 model
(``model.half()``) with ``mixed_precision="no"``, whose loss ``backward`` scales.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from ..optim import OffloadAdamW, OffloadOptimizer
from ..optim.clipping import clip_grad_norm_ as clip_grad_norm_across
from ..optim.clipping import total_grad_norm
from ..profiling.metrics import StepMetrics
from ..weights import has_source
from ._optim import clip_norm, saveable
from .accelerate_streaming import Streamed, behind, streams_on_any_rank

__all__ = ["FP16_AMP_MESSAGE", "OffloadAcceleratedOptimizer", "OffloadAccelerator"]

#: Why accelerate's (and Trainer's) fp16 AMP cannot drive OffloadAdamW, and what to use.
FP16_AMP_MESSAGE = (
    "torch's GradScaler unscales and inf-checks param.grad, which OffloadAdamW never leaves "
    "behind (its gradients go to host memory during backward), so the first step would fail "
    "with 'No inf checks were recorded'. Use bf16 mixed precision instead, or cast the model "
    "to fp16 (model.half()) without fp16 AMP: OffloadAdamW then scales the loss with its own "
    "dynamic loss scaler (OffloadConfig.loss_scaler). fp16 autocast over fp32 or bf16 "
    "weights takes that scaler too, with LossScalerConfig(autocast_fp16=True), in a loop "
    "that calls opt.backward(loss) (a plain loop, or OffloadAccelerator.backward with "
    "mixed_precision='no' and torch.autocast around the forward)"
)


# Note [no state round trip at prepare]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# accelerate's AcceleratedOptimizer.__init__, with device_placement=True (the default of
# Accelerator.prepare and of Trainer), runs optimizer.load_state_dict(move_to_device(
# optimizer.state_dict(), accelerator.device)). For OffloadAdamW that copies every master
# weight and moment out of host memory (16 bytes per parameter), onto the GPU when there is
# one (the very memory the optimizer exists to save), and back, refreshing every master.
# The state is already where the optimizer keeps it, so the wrapper is always built with
# device_placement=False. It is marked prepared, so that Accelerator.prepare (also the one
# Trainer calls) registers it as it is instead of wrapping it again with placement on.
# The rejected alternative, asking callers for prepare(..., device_placement=[...]), is
# one forgotten list away from the round trip.


class OffloadAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper around an ``OffloadAdamW``, without the state round
    trip (Note [no state round trip at prepare]).

    As accelerate's: ``step`` and ``zero_grad`` act only on gradient-sync steps. Adds
    ``clip_grad_norm_`` (the optimizer's), and ``step_was_skipped`` reports the steps
    ``OffloadAdamW`` skipped (fp16 overflow, ``skip_nonfinite``), so Trainer and
    ``Accelerator.optimizer_step_was_skipped`` hold the LR schedule back as with AMP.
    """

    def __init__(self, optimizer: OffloadOptimizer, scaler: Any = None) -> None:
        if not isinstance(optimizer, OffloadOptimizer):
            raise TypeError(
                "OffloadAcceleratedOptimizer wraps a zero_offload offload optimizer, got "
                f"{type(optimizer).__name__}; wrap other optimizers with accelerate's own "
                "AcceleratedOptimizer"
            )
        if scaler is not None:
            raise ValueError(f"OffloadAdamW cannot run under fp16 AMP: {FP16_AMP_MESSAGE}")
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._skipped = False  # whether the last step() was skipped by the optimizer
        self.optimizer_steps = 0  # steps that reached the optimizer (not accumulation steps)
        self._is_accelerate_prepared = True  # see Note [no state round trip at prepare]

    def step(self, closure: Callable[[], float] | None = None) -> None:
        """accelerate's step (a no-op on accumulation micro-steps), recording a skip."""
        before = self.optimizer.skipped_steps
        super().step(closure)
        self._skipped = self.optimizer.skipped_steps != before
        if self.gradient_state.sync_gradients:
            self.optimizer_steps += 1

    @property
    def step_was_skipped(self) -> bool:
        """Whether ``OffloadAdamW`` skipped the last step (overflow or non-finite)."""
        return self._skipped

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``OffloadAdamW.clip_grad_norm_``; ``max_norm=inf`` reads the norm only."""
        return clip_norm(self.optimizer, max_norm, norm_type)


class OffloadAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` for loops that train with ``OffloadAdamW``.

    Takes ``Accelerator``'s arguments; see the module docstring for what differs.
    ``mixed_precision="fp16"`` raises ``ValueError`` (use ``"bf16"``, or an fp16 model).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("mixed_precision") == "fp16":  # before accelerate's global state is set
            raise ValueError(f"OffloadAccelerator(mixed_precision='fp16'): {FP16_AMP_MESSAGE}")
        super().__init__(*args, **kwargs)
        if self.mixed_precision == "fp16":  # from the environment or accelerate's config
            raise ValueError(f"OffloadAccelerator(mixed_precision='fp16'): {FP16_AMP_MESSAGE}")
        #: Optimizers passed to the prepare() call under way, so that prepare_model (which
        #: accelerate calls before prepare_optimizer) knows who owns the model's parameters.
        self._offload_in_prepare: list[OffloadAdamW] = []
        #: Per prepared optimizer: its StepMetrics and the step count at the last collect.
        self._offload_metrics: dict[int, tuple[StepMetrics, int]] = {}
        # Note [optimizer state on NVMe in save_state]
        self.register_save_state_pre_hook(self._save_streamed_optimizers)
        self.register_load_state_pre_hook(self._load_streamed_optimizers)
        self.register_load_state_pre_hook(self._load_offloaded_models)

    def offload_metrics(self) -> dict[str, float]:
        """The offload figures per optimizer step since the last call (Note [offload metrics
        in the framework's logs] in ``profiling/metrics.py``); ``log()`` merges them into
        every record. With several optimizers the keys carry the optimizer's index."""
        merged: dict[str, float] = {}
        prepared = [
            o for o in map(behind, self._optimizers) if isinstance(o, OffloadAcceleratedOptimizer)
        ]
        for index, wrapper in enumerate(prepared):
            metrics, mark = self._offload_metrics.get(id(wrapper), (None, 0))
            if metrics is None:
                metrics = StepMetrics(wrapper.optimizer)
            self._offload_metrics[id(wrapper)] = (metrics, wrapper.optimizer_steps)
            figures = metrics.collect(wrapper.optimizer_steps - mark)
            suffix = "" if len(prepared) == 1 else f"/{index}"
            merged.update({f"{key}{suffix}": value for key, value in figures.items()})
        return merged

    def log(self, values: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """accelerate's tracker log, with ``offload_metrics()`` merged in."""
        super().log({**values, **self.offload_metrics()}, *args, **kwargs)

    def _offload_optimizers(self) -> list[OffloadAdamW]:
        prepared = [
            opt.optimizer
            for opt in map(behind, self._optimizers)
            if isinstance(opt, OffloadAcceleratedOptimizer)
        ]
        return prepared + [opt for opt in self._offload_in_prepare if opt not in prepared]

    def prepare(self, *args: Any, device_placement: list[bool | None] | None = None) -> Any:
        """``Accelerator.prepare``; an ``OffloadAdamW`` comes back as an
        ``OffloadAcceleratedOptimizer`` (Note [no state round trip at prepare])."""
        self._offload_in_prepare = [arg for arg in args if isinstance(arg, OffloadOptimizer)]
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._offload_in_prepare = []

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> torch.optim.Optimizer:
        """``Accelerator.prepare_optimizer``; an ``OffloadAdamW`` is wrapped without moving
        its state, whatever ``device_placement`` says."""
        if isinstance(optimizer, OffloadOptimizer):
            optimizer = OffloadAcceleratedOptimizer(optimizer, scaler=self.scaler)
            # Listening from now on: the first offload_metrics() covers the first steps.
            self._offload_metrics[id(optimizer)] = (StepMetrics(optimizer.optimizer), 0)
            live = {id(o) for o in self._optimizers} | {id(optimizer)}
            for key in [key for key in self._offload_metrics if key not in live]:
                self._offload_metrics.pop(key)[0].close()  # optimizers accelerate let go of
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """``Accelerator.prepare_model``; a model whose trainable parameters an
        ``OffloadAdamW`` owns is neither moved nor, with several processes, wrapped in DDP
        (the optimizer reduce-scatters its gradients itself)."""
        if any(has_source(p) for p in model.parameters()):
            raise ValueError(
                "prepare() got a model whose parameters are still on the meta device, waiting "
                "for their checkpoint (zero_offload.load_pretrained): build OffloadAdamW over "
                "model.parameters() first (it reads them into place), then prepare both"
            )
        if self._owned_by_offload(model):
            # The optimizer was built on the parameters where they are: accelerate's
            # placement could only copy them away from its storage (on CPU, .to("cpu:0")
            # copies).
            device_placement = False
            if self.num_processes > 1:
                # evaluation_mode applies mixed precision and torch.compile, and skips only
                # the distributed wrappers.
                evaluation_mode = True
        return super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )

    def _owned_by_offload(self, model: torch.nn.Module) -> bool:
        """True when an ``OffloadAdamW`` owns every trainable parameter of ``model``;
        ``ValueError`` when it owns only some of them."""
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        owned = {id(p) for opt in self._offload_optimizers() for p in _params(opt)}
        if not trainable & owned:
            return False
        missing = len(trainable - owned)
        if missing:
            raise ValueError(
                f"{missing} of the model's {len(trainable)} trainable parameters belong to no "
                "OffloadAdamW, and DDP cannot reduce only the rest: build OffloadAdamW over "
                "all of model.parameters(), or freeze the others (requires_grad_(False))"
            )
        return True

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """``Accelerator.get_state_dict``, which ``save_model`` and ``save_state`` call on
        every process (under ZeRO-3 a collective: each entry gathers its unit). For a model
        an ``OffloadAdamW`` trains, on the process that writes the files, the state dict is
        made one accelerate's safetensors savers write whole (Note [state dicts the savers
        can write] in ``_optim.py``: without it every parameter sharing a bucket with
        another would be dropped)."""
        state_dict = super().get_state_dict(model, unwrap=unwrap)
        target = self.unwrap_model(model) if unwrap else model
        owned = {id(p) for opt in self._offload_optimizers() for p in _params(opt)}
        if not owned & {id(p) for p in target.parameters()} or not self._writes_files():
            return state_dict
        return saveable(target, state_dict)

    # Note [loading into bucket views]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # ``save_state`` writes each model as ``model{_i}.safetensors`` (accelerate's default),
    # and ``load_state`` reads it back with safetensors' ``load_model``, which first looks
    # for tensors that share a storage in the live ``model.state_dict()`` and refuses any
    # that does not cover its whole storage: every parameter of a model an offload
    # optimizer trains is a view into its bucket, so a resume failed there, in
    # safetensors' words. So a load pre-hook (accelerate calls it with the list of models
    # it is about to load) puts in such a model's place a stand-in (``_LoadsInto``) whose
    # ``state_dict()`` is empty, so there is nothing shared to find, and whose
    # ``load_state_dict`` loads into the model's views and reports the names it misses,
    # less those of a tied pair the saver wrote once (a missing name whose parameter a
    # loaded name is). ``load_model`` then reads the file once, where accelerate puts it,
    # and applies the caller's ``strict`` itself; the stand-in keeps the model's index (its
    # file name). Hooks registered after this one get the stand-in: an ``nn.Module`` of its
    # own (no parameters, its own type and ``training``), which forwards only the
    # attributes a module does not have (``config``, say) to the model.

    def _load_offloaded_models(self, models: list[torch.nn.Module], input_dir: str) -> None:
        """Stand in for each model an offload optimizer trains, so safetensors' loader
        reaches its views (Note [loading into bucket views])."""
        for index, model in enumerate(models):
            if isinstance(model, _LoadsInto):
                continue
            if self._owned_by_offload(self.unwrap_model(model)):
                models[index] = _LoadsInto(model)

    # Note [optimizer state on NVMe in save_state] in accelerate_streaming.py

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> Any:
        """``Accelerator.save_state``; an offload optimizer with ``nvme_dir`` set streams its
        state into the checkpoint folder (Note [optimizer state on NVMe in save_state]).
        Every process calls it, as with accelerate."""
        with self._optimizers_standing_in(streams_on_any_rank):
            return super().save_state(
                output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs
            )

    def load_state(
        self,
        input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """``Accelerator.load_state``; an offload optimizer whose state the checkpoint
        streamed reads it back (the same number of processes), checked before anything is
        loaded (Note [optimizer state on NVMe in save_state])."""
        with self._optimizers_standing_in(lambda wrapper: True):
            super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)

    @contextlib.contextmanager
    def _optimizers_standing_in(
        self, stands_in: Callable[[OffloadAcceleratedOptimizer], bool]
    ) -> Iterator[None]:
        """accelerate's optimizer list with a ``Streamed`` in the place of each offload
        optimizer ``stands_in`` picks, for the length of the block."""
        kept = self._optimizers
        self._optimizers = [
            Streamed(opt, index)
            if isinstance(opt, OffloadAcceleratedOptimizer) and stands_in(opt)
            else opt
            for index, opt in enumerate(kept)
        ]
        try:
            yield
        finally:
            self._optimizers = kept

    def _save_streamed_optimizers(
        self, models: list[torch.nn.Module], weights: list[Any], output_dir: str
    ) -> None:
        """Every rank streams each stood-in optimizer's shard into ``output_dir``."""
        for opt in self._optimizers:
            if isinstance(opt, Streamed):
                opt.save(output_dir)

    def _load_streamed_optimizers(self, models: list[torch.nn.Module], input_dir: str) -> None:
        """Stream back each optimizer the checkpoint streamed, before accelerate loads
        anything; refuse first what cannot load."""
        stand_ins = [opt for opt in self._optimizers if isinstance(opt, Streamed)]
        for opt in stand_ins:
            opt.check_on_every_rank(input_dir)
        for opt in stand_ins:
            opt.load(input_dir)

    def _writes_files(self) -> bool:
        """Whether accelerate's ``save`` writes from this process."""
        if self.project_configuration.save_on_each_node:
            return self.is_local_main_process
        return self.is_main_process

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward``, with the loss multiplied by ``OffloadAdamW``'s loss
        scale (1.0 unless the model is fp16)."""
        scales = {opt.loss_scale for opt in self._offload_optimizers()}
        if len(scales) > 1:
            raise ValueError(
                f"the prepared OffloadAdamW optimizers have different loss scales "
                f"{sorted(scales)}; one backward can apply only one: train the fp16 "
                "parameters with a single OffloadAdamW"
            )
        scale = scales.pop() if scales else 1.0
        with contextlib.ExitStack() as scaled:  # Note [a backward carries the loss scale]
            for opt in self._offload_optimizers():
                scaled.enter_context(opt.scaled_backward())
            super().backward(loss * scale if scale != 1.0 else loss, **kwargs)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """``Accelerator.clip_grad_norm_``; the parameters of a prepared ``OffloadAdamW``
        are clipped inside it (torch's clip would find no ``param.grad``), and the
        returned pre-clip norm is theirs. ``max_norm=inf`` reads the norm only."""
        params = list(parameters)
        passed = {id(p) for p in params if p.requires_grad}
        owners = self._owners(passed)
        if len(owners) > 1 and passed == {id(p) for opt in owners for p in _params(opt)}:
            # several optimizers train these parameters: by the norm of all (Note
            # [clipping by a total norm] in optim/update/policy.py)
            if max_norm == float("inf"):
                return torch.tensor(total_grad_norm(owners))
            return clip_grad_norm_across(owners, max_norm, norm_type)
        opt = self._owner(params, what="clip_grad_norm_")
        if opt is None:
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return clip_norm(opt, max_norm, float(norm_type))

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """``Accelerator.clip_grad_value_``; refused for ``OffloadAdamW``'s parameters."""
        params = list(parameters)
        if self._owner(params, what="clip_grad_value_") is not None:
            raise ValueError(
                f"clip_grad_value_(clip_value={clip_value!r}) on OffloadAdamW's parameters: "
                "it clips by the global norm only (gradients are on the host, not in "
                "param.grad); use accelerator.clip_grad_norm_(model.parameters(), max_norm)"
            )
        super().clip_grad_value_(params, clip_value)

    def _owners(self, passed: set[int]) -> list[OffloadOptimizer]:
        """The prepared offload optimizers that train some of the parameters whose ids are
        ``passed``."""
        return [opt for opt in self._offload_optimizers() if passed & {id(p) for p in _params(opt)}]

    def _owner(self, params: list[torch.Tensor], *, what: str) -> OffloadOptimizer | None:
        """The prepared ``OffloadAdamW`` whose trainable parameters are exactly the
        trainable ones in ``params`` (``None`` if none of them is an ``OffloadAdamW``'s)."""
        passed = {id(p) for p in params if p.requires_grad}
        owners = self._owners(passed)
        if not owners:
            return None
        if len(owners) > 1:
            raise ValueError(
                f"{what}: the parameters belong to {len(owners)} offload optimizers; pass all "
                "of their parameters (model.parameters()) to clip by the norm of all, as "
                "zero_offload.clip_grad_norm_(optimizers, max_norm) does, or each one's own"
            )
        ours = {id(p) for p in _params(owners[0])}
        if passed != ours:
            raise ValueError(
                f"{what}: got {len(passed)} trainable parameters, of which "
                f"{len(passed & ours)} are the OffloadAdamW's {len(ours)}; it clips all of its "
                "parameters together by their global norm: pass exactly its parameters "
                "(model.parameters()), or call opt.clip_grad_norm_(max_norm)"
            )
        return owners[0]


def _params(opt: OffloadOptimizer) -> list[torch.Tensor]:
    """The trainable parameters of ``opt`` (frozen ones get no host state)."""
    return [p for group in opt.param_groups for p in group["params"] if p.requires_grad]


class _LoadsInto(torch.nn.Module):
    """A model's stand-in for accelerate's loaders (Note [loading into bucket views]): no
    state of its own to look through; ``load_state_dict`` loads into the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: no state of its own

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "model"), name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {}

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> Any:
        """Into the model; the names it lacks, less a tied pair's second name; raises as
        torch's does where ``strict``."""
        model = object.__getattribute__(self, "model")
        result = model.load_state_dict(state_dict, strict=False, assign=assign)
        live = model.state_dict(keep_vars=True)
        loaded = {id(live[name]) for name in state_dict if name in live}
        missing = [name for name in result.missing_keys if id(live[name]) not in loaded]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(model).__name__}: missing keys "
                f"{missing}, unexpected keys {list(result.unexpected_keys)}"
            )
        return torch.nn.modules.module._IncompatibleKeys(missing, list(result.unexpected_keys))
