"""Lightning with OffloadAdamW (``zero_offload.integrations.lightning``) against Lightning
with torch's AdamW: a tiny transformer, deterministic batches, CPU.

Tolerances, measured on these 6 steps (clipping binding in each). fp32: torch's foreach and
for-loop AdamW agree bitwise and fused differs by 3e-8 in the weights; OffloadAdamW's CPU
kernel (the clip folded into its gradient multiplier) differs by 7.2e-7 in the weights
(of magnitude ~1) and 4.8e-7 in the losses, and the pre-clip norms agree bitwise. We
allow 1e-6. bf16-mixed: weights within 1.6e-6 and norms within 1.1e-7 relative (a 1-ulp
difference in an fp32 weight can flip the bf16 rounding of an activation); we allow 1e-5
in the weights and 1e-4 in losses and norms.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from zero_offload import LossScalerConfig, OffloadAdamW
from zero_offload.integrations.lightning import OffloadDDPStrategy, OffloadLightningModule

from .helpers.device import run_device
from .helpers.dist import free_port
from .helpers.hf import as_torchrun_rank, lightning_device, offload_config
from .helpers.models import TinyTransformer, batches, host_accelerator, lm_loss

CLIP = 0.5  # the gradient norms of these runs are 1.3 to 2: clipping binds every step
STEPS = 6
ACCUMULATE = 2

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class _Body:
    """The training code both modules share; ``kind`` picks the optimizer."""

    def __init__(self, kind: str, *, seed: int = 0, ranks: int = 1, **config: Any) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = TinyTransformer().to(run_device())
        self.kind = kind
        self.config = config
        self.ranks = ranks  # processes sharing each batch of 4
        self.losses: list[float] = []
        self.norms: list[float] = []  # the pre-clip norm of each step

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        loss = lm_loss(self.net, *batch)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, OffloadAdamW):  # the norm of the step, unscaled
            self.norms.append(optimizer.grad_norm().item())
        else:  # torch's AdamW: the gradients are in param.grad
            grads = [p.grad.flatten() for p in self.parameters() if p.grad is not None]
            self.norms.append(torch.cat(grads).norm().item())

    def configure_optimizers(self) -> Any:
        hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
        if self.kind == "torch":
            opt = torch.optim.AdamW(self.parameters(), **hyper, foreach=False)
        else:
            group = getattr(self.trainer.strategy, "optimizer_process_group", None)
            opt = OffloadAdamW(
                self.parameters(), **hyper, config=offload_config(**self.config),
                accelerator=host_accelerator(), process_group=group,
            )  # fmt: skip
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        tokens, targets = (torch.cat(t) for t in zip(*batches(STEPS * ACCUMULATE), strict=True))
        data = torch.utils.data.TensorDataset(tokens, targets)
        sampler = None
        if self.ranks > 1:  # rank r takes samples r, r + ranks, ...: each batch of 4 is shared
            sampler = torch.utils.data.DistributedSampler(data, self.ranks, self.global_rank, False)
        return torch.utils.data.DataLoader(data, batch_size=4 // self.ranks, sampler=sampler)


class OffloadNet(_Body, OffloadLightningModule):
    pass


class TorchNet(_Body, pl.LightningModule):
    pass


class PlainNet(_Body, pl.LightningModule):
    """A plain LightningModule handed an OffloadAdamW: clipping must be refused."""


def trainer(**overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        **lightning_device(),  # the CPU on the host, cuda:0 in a CUDA form
        "max_steps": STEPS,
        "gradient_clip_val": CLIP,
        "accumulate_grad_batches": ACCUMULATE,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        # No "deterministic": CPU kernels are deterministic already, and Lightning's flag sets
        # cudnn flags, which torch refuses once torch.testing._internal (test_optim_db.py)
        # froze them at collection.
    }
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_importing_zero_offload_imports_neither_lightning_nor_trl() -> None:
    code = (
        "import sys, zero_offload, zero_offload.integrations as z; "
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'trl') if m in sys.modules)); "
        "z.OffloadLightningModule; print('lightning' in sys.modules, 'trl' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True False"]  # imported on first access
    import zero_offload.integrations as integrations

    assert integrations.OffloadDDPStrategy is OffloadDDPStrategy
    with pytest.raises(AttributeError, match="OffloadNothing"):
        integrations.OffloadNothing  # noqa: B018


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("precision", "loss_tol", "weight_tol"),
    [("32-true", 1e-6, 1e-6), ("bf16-mixed", 1e-4, 1e-5)],
    ids=["fp32", "bf16-mixed"],
)
def test_parity_with_torch_adamw_clip_and_accumulate(
    precision: str, loss_tol: float, weight_tol: float
) -> None:
    ref, ours = TorchNet("torch"), OffloadNet("offload")
    trainer(precision=precision).fit(ref)
    trainer(precision=precision).fit(ours)
    assert len(ref.norms) == STEPS and min(ref.norms) > CLIP  # clipping binds every step
    assert len(ours.losses) == STEPS * ACCUMULATE
    torch.testing.assert_close(ours.losses, ref.losses, rtol=0, atol=loss_tol)
    torch.testing.assert_close(ours.norms, ref.norms, rtol=loss_tol, atol=0)
    assert max_diff(weights(ours), weights(ref)) < weight_tol
    # Note [offload metrics in the framework's logs]: logged with self.log_dict each step.
    logged = ours.trainer.callback_metrics
    assert float(logged["offload/cpu_adam_ms"]) > 0 and float(logged["offload/host_bytes"]) > 0
    assert "offload/cpu_adam_ms" not in ref.trainer.callback_metrics


EPOCHS = {"max_steps": -1, "max_epochs": 2, "limit_train_batches": STEPS // 2 * ACCUMULATE}


def whole_and_resumed(out: Path, *, ranks: int = 1) -> tuple[OffloadNet, OffloadNet]:
    """Lightning's own checkpointing: an uninterrupted run of 2 epochs of 3 steps saving
    after each, and a differently initialised module resumed from the first file."""

    def fit(module: OffloadNet, name: str, **kwargs: Any) -> None:
        saver = ModelCheckpoint(dirpath=out / name, save_top_k=-1)
        several: dict[str, Any] = {}
        if ranks > 1:  # each rank samples its own half (see train_dataloader)
            several = {
                "devices": ranks,
                "strategy": OffloadDDPStrategy(),
                "use_distributed_sampler": False,
            }
        trainer(callbacks=[saver], enable_checkpointing=True, **EPOCHS, **several).fit(
            module, **kwargs
        )

    whole = OffloadNet("offload", ranks=ranks)
    fit(whole, "whole")
    (first,) = sorted((out / "whole").glob("epoch=0*.ckpt"))
    resumed = OffloadNet("offload", seed=1, ranks=ranks)
    fit(resumed, "resumed", ckpt_path=first)
    return whole, resumed


@pytest.mark.cuda_form
@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_checkpoint_resume_is_bitwise(tmp_path: Path) -> None:
    whole, resumed = whole_and_resumed(tmp_path)
    assert resumed.losses == whole.losses[STEPS // 2 * ACCUMULATE :]
    assert max_diff(weights(resumed), weights(whole)) == 0.0
    assert resumed.trainer.optimizers[0].state_dict()["state"][0]["step"] == STEPS


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"gradient_clip_algorithm": "value"}, "gradient_clip_algorithm='norm'"),
        # Lightning turns precision="16-mixed" into bf16 on a CPU: the plugin by hand.
        ({"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}, "bf16"),
    ],
    ids=["clip-by-value", "fp16-amp"],
)
def test_refused_before_the_first_backward(overrides: dict, match: str) -> None:
    module = OffloadNet("offload")
    before = weights(module)
    with pytest.raises(ValueError, match=match):
        trainer(**overrides).fit(module)
    assert module.losses == [] or len(module.losses) == 1  # the first forward, no step
    assert max_diff(weights(module), before) == 0.0


def test_state_on_nvme_is_refused_before_the_first_backward(tmp_path: Path) -> None:
    """Lightning's teardown reads every state tensor through ``opt.state`` to move it to the
    CPU: with the state on NVMe it raised ``StateNotInHostRam`` after the last step, the
    training done and the run failed (checkpointing off); now refused at the start."""
    module = OffloadNet("offload", nvme_dir=tmp_path / "nvme", host_budget=1)
    before = weights(module)
    with pytest.raises(ValueError, match=r"on NVMe\. .*Not supported under Lightning"):
        trainer().fit(module)
    assert module.losses == [] or len(module.losses) == 1  # the first forward, no step
    assert max_diff(weights(module), before) == 0.0


def test_state_on_nvme_is_refused_before_a_checkpoint_is_restored(tmp_path: Path) -> None:
    """Resuming (``ckpt_path``) a run saved with the state in RAM into one with NVMe state:
    Lightning loads the optimizer's state and moves it to the device before the first
    backward; the refusal comes before that restore (``on_fit_start``), not as a
    ``StateNotInHostRam`` from inside Lightning's restore."""
    saved = OffloadNet("offload")
    first = trainer(max_steps=2)
    first.fit(saved)
    first.save_checkpoint(tmp_path / "in_ram.ckpt")
    module = OffloadNet("offload", nvme_dir=tmp_path / "nvme", host_budget=1)
    with pytest.raises(ValueError, match=r"on NVMe\. .*Not supported under Lightning"):
        trainer(max_steps=4).fit(module, ckpt_path=tmp_path / "in_ram.ckpt")
    assert module.losses == []  # refused before any forward


@pytest.mark.cuda_form
def test_fp16_model_scales_the_loss_by_the_optimizers_loss_scale() -> None:
    """precision="16-true" trains an fp16 model: backward must carry OffloadAdamW's loss
    scale (2**10 here), or the norm it unscales would be 2**10 times too small. Measured:
    the first two norms within 2e-4 relative of the fp32 run's."""
    ref = TorchNet("torch")
    trainer(max_steps=2).fit(ref)
    scaler = LossScalerConfig(initial_scale=2.0**10)
    ours = OffloadNet("offload", loss_scaler=scaler)
    trainer(max_steps=2, precision="16-true").fit(ours)
    opt = ours.trainer.optimizers[0]
    assert opt.loss_scale == 2.0**10 and opt.skipped_steps == 0
    assert next(ours.parameters()).dtype == torch.float16
    torch.testing.assert_close(ours.norms, ref.norms, rtol=2e-3, atol=0)


def test_a_plain_lightning_module_names_the_integration() -> None:
    with pytest.raises(RuntimeError, match="OffloadLightningModule"):
        trainer().fit(PlainNet("offload"))


class ManualNet(OffloadNet):
    """Manual optimization clipping by hand, as Lightning documents it."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        opt = self.optimizers()
        loss = lm_loss(self.net, *batch)
        self.losses.append(loss.item())
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()  # manual optimization steps its schedules itself


@pytest.mark.cuda_form
def test_manual_optimization_clips_like_automatic() -> None:
    """One micro-batch per step, clipped by hand: the automatic run without accumulation."""
    manual = ManualNet("offload")
    trainer(gradient_clip_val=None, accumulate_grad_batches=1).fit(manual)
    automatic = OffloadNet("offload")
    trainer(accumulate_grad_batches=1).fit(automatic)
    assert manual.losses == automatic.losses
    assert max_diff(weights(manual), weights(automatic)) == 0.0


# -- two processes: OffloadDDPStrategy ----------------------------------------------------


def _ddp_rank(rank: int, world: int, port: int, out: str) -> None:
    as_torchrun_rank(rank, world, port)  # Lightning sees LOCAL_RANK: processes exist already
    whole, resumed = whole_and_resumed(Path(out), ranks=world)
    result = {"losses": whole.losses, "weights": weights(whole)}
    result |= {"resumed_losses": resumed.losses, "resumed_weights": weights(resumed)}
    torch.save(result, Path(out) / f"{rank}.pt")


@pytest.mark.slow
def test_two_processes_match_one_and_resume_bitwise(tmp_path: Path) -> None:
    """2 gloo ranks, each with half of every batch, no DDP wrapper (OffloadAdamW
    reduce-scatters): the weights match one process with the whole batch, and a run
    resumed from the consolidated checkpoint is bitwise the uninterrupted one."""
    os.environ.pop("LOCAL_RANK", None)
    mp.spawn(_ddp_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]
    saved = torch.load(next((tmp_path / "whole").glob("epoch=0*.ckpt")), weights_only=False)
    (state,) = saved["optimizer_states"]
    assert state["state"][0]["exp_avg"].shape == (64, 32)  # whole, not a rank's shard
    for rank in ranks:
        assert rank["resumed_losses"] == rank["losses"][STEPS // 2 * ACCUMULATE :]
        assert max_diff(rank["resumed_weights"], rank["weights"]) == 0.0
    assert max_diff(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    one = OffloadNet("offload")
    trainer(**EPOCHS).fit(one)
    # Measured: 9e-8 in the weights, 1e-6 in the losses (each rank's mean over half a batch).
    assert max_diff(ranks[0]["weights"], weights(one)) < 1e-6
    halves = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    torch.testing.assert_close(halves, one.losses, rtol=0, atol=2e-6)


def _nvme_on_one_rank(rank: int, world: int, port: int, out: str) -> None:
    as_torchrun_rank(rank, world, port)
    extra: dict[str, Any] = {"nvme_dir": Path(out) / "nvme", "host_budget": 1} if rank else {}
    module = OffloadNet("offload", ranks=world, **extra)
    several = {"devices": world, "strategy": OffloadDDPStrategy(), "use_distributed_sampler": False}
    try:
        trainer(**several).fit(module)
        outcome = "trained"
    except ValueError as exc:
        outcome = str(exc)
    torch.save(outcome, Path(out) / f"{rank}.pt")


@pytest.mark.slow
def test_state_on_nvme_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    """nvme_dir may differ by rank (Note [the ranks build alike]); Lightning's refusal of
    NVMe state decided by each rank's own config, so the rank without it went on alone into
    the training's collectives. Now every rank refuses at on_fit_start, naming the other
    rank's config where its own has none."""
    os.environ.pop("LOCAL_RANK", None)
    mp.spawn(_nvme_on_one_rank, args=(2, free_port(), str(tmp_path)), nprocs=2)
    outcomes = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]
    assert "another rank's OffloadConfig" in outcomes[0], outcomes[0]
    assert "OffloadConfig(nvme_dir=" in outcomes[1], outcomes[1]
    assert all("Not supported under Lightning" in o for o in outcomes)
