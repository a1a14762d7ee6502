"""Several gloo ranks, a weight used more than once per backward under reentrant
checkpointing (Note [a parameter's gradient may arrive several times] in
``optim/grads/order.py``).

Reentrant checkpointing (``use_reentrant=True``) runs each segment's backward as its own
graph task, so a weight used in two segments (an ALBERT-style shared block, or a tied
embedding used inside a checkpointed block and by the head) gets its post-accumulate-grad
hook once per use. One process adds the pieces up; several ranks must reduce-scatter each
bucket once per backward, in one order. These runs must equal one process on the global
batch. Tolerance as in test_dist_offload.py (``FP32_ATOL``, the summation order across ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

from .helpers.dist import GLOBAL_BATCH, free_port, join_gloo, shard_batch
from .helpers.models import batches, offload_opt, torch_adamw

FP32_ATOL = 1e-5
STEPS = 4


class SharedBlocks(nn.Module):
    """An embedding tied to the output head, and one block applied ``uses`` times, each
    use a reentrant checkpoint segment. With ``embed_inside`` the tied weight is also used
    inside every segment (a projection back onto the vocabulary, as some models mix it)."""

    def __init__(self, *, uses: int, embed_inside: bool, vocab: int = 64, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.uses = uses
        self.embed_inside = embed_inside

    def _segment(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.block(x)
        if self.embed_inside:
            x = x + 0.1 * torch.tanh(x @ self.embed.weight.t()) @ self.embed.weight
        return x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for _ in range(self.uses):
            x = checkpoint(self._segment, x, use_reentrant=True)
        return self.norm(x) @ self.embed.weight.t()  # the tied head


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model(case: dict) -> nn.Module:
    torch.manual_seed(0)
    return SharedBlocks(uses=case["uses"][0], embed_inside=case["embed_inside"])


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, uses: list[int]
) -> list[str]:
    """One step per global batch, the shared block used ``uses[step]`` times; a step whose
    backward raises is retried once after ``zero_grad()``. Returns the errors seen."""
    errors = []
    for step, (tokens, targets) in enumerate(batches(STEPS, batch=GLOBAL_BATCH)):
        model.uses = uses[step]
        for _attempt in range(2):
            loss = _loss(model, shard_batch(tokens, rank, world), shard_batch(targets, rank, world))
            try:
                loss.backward()
            except RuntimeError as exc:
                errors.append(str(exc))
                opt.zero_grad()
                continue
            break
        opt.step()
        opt.zero_grad()
    return errors


def _rank_entry(rank: int, world: int, port: int, out: str, case: dict) -> None:
    join_gloo(rank, world, port)
    model = _model(case)
    opt = offload_opt(model, bucket_bytes=case["bucket_bytes"])
    errors = _train(model, opt, rank, world, case["uses"])
    opt.close()
    weights = [p.detach().clone() for p in model.parameters()]
    torch.save({"weights": weights, "errors": errors}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _run(world: int, out: Path, case: dict) -> list[dict]:
    mp.spawn(_rank_entry, args=(world, free_port(), str(out), case), nprocs=world)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _reference(case: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process on the global batch: OffloadAdamW and torch AdamW."""
    model, ref = _model(case), _model(case)
    opt = offload_opt(model, bucket_bytes=case["bucket_bytes"])
    assert _train(model, opt, 0, 1, case["uses"]) == []
    opt.close()
    _train(ref, torch_adamw(ref), 0, 1, case["uses"])
    return [p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# bucket_bytes: 1024 puts the embedding (and each Linear) in a bucket of its own, 64 KiB
# puts everything in one; either way the repeated gradients used to arrive after their
# bucket had gone ("got a gradient after it was reduce-scattered in this backward").
CASES = [
    pytest.param({"uses": [3] * STEPS, "embed_inside": False, "bucket_bytes": 1024}, id="albert"),
    pytest.param(
        {"uses": [3] * STEPS, "embed_inside": False, "bucket_bytes": 65536}, id="albert-one"
    ),
    pytest.param({"uses": [2] * STEPS, "embed_inside": True, "bucket_bytes": 1024}, id="tied"),
]


@pytest.mark.parametrize("case", CASES)
def test_weights_used_twice_under_reentrant_checkpointing_train_like_one_process(
    case: dict, tmp_path: Path
) -> None:
    ours, torch_ref = _reference(case)
    assert _max_diff(ours, torch_ref) < FP32_ATOL  # one process trains it (the baseline)
    for result in _run(2, tmp_path, case):
        assert result["errors"] == []
        assert _max_diff(result["weights"], ours) < FP32_ATOL


def test_more_uses_than_the_first_backward_raise_naming_the_parameter_then_train(
    tmp_path: Path,
) -> None:
    """The first backward learns 2 reports per shared weight; a later backward with 3 can
    only be refused (its bucket already went), naming the parameter and the cause. After
    zero_grad() the retried backward waits for 3 and the run equals one process."""
    case = {"uses": [2, 3, 3, 3], "embed_inside": False, "bucket_bytes": 1024}
    ours, torch_ref = _reference(case)
    assert _max_diff(ours, torch_ref) < FP32_ATOL
    for result in _run(2, tmp_path, case):
        assert len(result["errors"]) == 1, result["errors"]
        error = result["errors"][0]
        assert "got its gradient 3 times in this backward" in error
        assert "parameter " in error and "use_reentrant" in error and "zero_grad()" in error
        assert _max_diff(result["weights"], ours) < FP32_ATOL
