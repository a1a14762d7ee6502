"""PEFT LoRA under OffloadTrainer: a bf16 base with fp32 adapters (PEFT's default upcast).

Against the same Trainer run with torch's AdamW on the adapters, clipping binding. Measured:
equal losses, grad norms within 1.1e-7 relative, adapters within 6e-8 (fp32 rounding of
the update); we allow 1e-6 in each. The merged model's logits (|x| < 0.6) are within
2e-3 of the adapted model's: one bf16 ulp at 0.5 is 3.9e-3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from zero_offload.optim.placement import POOL_ALIGNMENT

from ._hf import logged, offload_trainer, tiny_gpt2, torch_trainer, training_args, weights

MAX_NORM = 0.02  # the adapters' gradient norms are 0.03 to 0.05


def lora_gpt2(**lora: Any) -> torch.nn.Module:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, **lora)
    return get_peft_model(tiny_gpt2(dtype=torch.bfloat16), config)


class MasterAdamW(torch.optim.AdamW):
    """torch's mixed-precision reference: torch's AdamW steps fp32 master copies of the
    bf16 parameters (fp32 ones are their own master), whose gradients are the bf16
    gradients cast up, and the bf16 weights are the masters cast down after each step."""

    def __init__(self, groups: list[dict[str, Any]], **hyper: Any) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        master_groups = []
        for group in groups:
            masters = []
            for param in group["params"]:
                master = param if param.dtype == torch.float32 else param.detach().float()
                self.pairs.append((param, master))
                masters.append(master)
            master_groups.append({**group, "params": masters})
        super().__init__(master_groups, **hyper)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for param, master in self.pairs:
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()
        super().step()
        for param, master in self.pairs:
            if master is not param:
                param.copy_(master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for param, _ in self.pairs:
            param.grad = None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // POOL_ALIGNMENT) * POOL_ALIGNMENT


def test_lora_bf16_base_fp32_adapters(tmp_path: Path) -> None:
    ref_model, model = lora_gpt2(), lora_gpt2()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen_before = {
        n: p.detach().clone() for n, p in model.named_parameters() if n not in trainable
    }
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values())
    assert {p.dtype for n, p in model.named_parameters() if n not in trainable} == {torch.bfloat16}

    ref = torch_trainer(ref_model, training_args(tmp_path / "torch", max_grad_norm=MAX_NORM))
    ref.train()
    ours = offload_trainer(model, training_args(tmp_path / "offload", max_grad_norm=MAX_NORM))
    ours.train()

    assert min(logged(ref, "grad_norm")) > MAX_NORM  # clipping binds
    torch.testing.assert_close(logged(ours, "loss"), logged(ref, "loss"), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        logged(ours, "grad_norm"), logged(ref, "grad_norm"), rtol=1e-6, atol=0
    )
    ref_weights, our_weights = weights(ref_model), weights(model)
    for name in trainable:
        torch.testing.assert_close(our_weights[name], ref_weights[name], rtol=0, atol=1e-6)
    assert any(our_weights[n].abs().max() > 0 for n in trainable if "lora_B" in n)  # trained
    # The frozen bf16 base: bitwise untouched.
    for name, before in frozen_before.items():
        assert torch.equal(our_weights[name], before), name

    # Host state for the adapters alone (Note in optim/placement.py, fp32 training dtype,
    # fp32 moments, one rank): per bucket of n padded elements, master + grad accumulator
    # 2*a(4n), exp_avg + exp_avg_sq 2*a(4n), gradient staging a(4n); no weight staging.
    opt = ours.offload_optimizer
    assert sum(p.numel() for b in opt.buckets for p in b.params) == sum(
        p.numel() for p in trainable.values()
    )
    host = sum(pool.capacity for pool in opt.manager.pools if pool.name.endswith(".host"))
    assert host == sum(5 * _aligned(4 * b.layout.padded_numel) for b in opt.buckets)
    frozen_numel = sum(p.numel() for p in frozen_before.values())
    assert host < 4 * frozen_numel  # an fp32 master of the base alone would not fit

    # merge_and_unload after training: the merged bf16 model computes what the adapted one
    # did (to bf16 rounding of the merged weights).
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = model(input_ids=batch).logits.float()
        merged = model.merge_and_unload()
        assert not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(
            merged(input_ids=batch).logits.float(), adapted, rtol=0, atol=4e-3
        )
    moved = merged.transformer.h[0].attn.c_attn.weight
    assert not torch.equal(
        moved, frozen_before["base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"]
    )


def test_lora_with_a_bf16_module_to_save_mixes_training_dtypes(tmp_path: Path) -> None:
    """fp32 adapters and a trainable bf16 copy of ln_f (PEFT modules_to_save) in one
    optimizer: against the torch mixed-precision reference (fp32 masters, torch AdamW,
    casts). That reference clips the bf16 gradients in bf16 (torch's clip_grad_norm_ takes
    each bf16 norm in bf16), where OffloadAdamW sums them in fp32: norms agree to 1e-2
    relative, losses to 1e-3, trained weights to 2 bf16 ulps."""
    ref_model, model = lora_gpt2(modules_to_save=["ln_f"]), lora_gpt2(modules_to_save=["ln_f"])
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {
        torch.float32,
        torch.bfloat16,
    }
    args = {"max_grad_norm": MAX_NORM, "max_steps": 6}
    reference = torch_trainer(ref_model, training_args(tmp_path / "torch", **args))
    decay = set(reference.get_decay_parameter_names(ref_model))
    named = [(n, p) for n, p in ref_model.named_parameters() if p.requires_grad]
    reference.optimizer = MasterAdamW(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
    )
    reference.train()
    ours = offload_trainer(model, training_args(tmp_path / "offload", **args))
    ours.train()
    torch.testing.assert_close(logged(ours, "loss"), logged(reference, "loss"), rtol=0, atol=1e-3)
    torch.testing.assert_close(
        logged(ours, "grad_norm"), logged(reference, "grad_norm"), rtol=1e-2, atol=0
    )
    ref_weights, our_weights = weights(ref_model), weights(model)
    for name, param in model.named_parameters():
        if param.requires_grad:
            ulp = 2.0**-7 if param.dtype == torch.bfloat16 else 1e-6
            torch.testing.assert_close(
                our_weights[name].float(), ref_weights[name].float(), rtol=2 * ulp, atol=1e-6
            )
