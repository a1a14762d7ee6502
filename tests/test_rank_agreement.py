"""Every rank builds the optimizer alike, or every rank refuses: Note [the ranks build alike]
in ``optim/rank_agreement.py``. Two spawned gloo ranks build optimizers that differ in one
thing each (a config field, the rule, a hyper-parameter, the parameters' order, dtype or
count, an added group): before the check, some trained on silently apart and the rest
crashed in gloo at the first collective; now both ranks raise a ``ValueError`` naming the
difference and each rank's value, and nothing stays allocated. What may differ (the tiling,
the timeout, where gradients add up) still builds and trains. A rank that never builds makes
the other raise ``CollectiveError`` naming it within ``collective_timeout``.

A rank that fails alone (Note [a rank that fails alone]): a check of its arguments, of its
parameters (torch's or ours, in the constructor or ``add_param_group``), or its build after
the comparison (a ``nvme_dir`` it cannot use). Before, it raised alone and the other rank
waited in its next collective until ``collective_timeout`` (600 s by default), then named a
rank that "did not report". Now the failing rank raises its own error, unchanged, and the
other raises at once naming it and that error, with nothing left allocated and, after a
refused ``add_param_group``, trains on alike."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zero_offload import CollectiveError, OffloadAdamW, OffloadConfig, OffloadLion
from zero_offload.demo.model import GPTConfig, TinyGPT

from .helpers.dist import data, free_port, join_gloo, train_steps
from .helpers.models import host_accelerator, make_pair, offload_opt, train
from .test_build_anywhere import on_simulated_gpu

#: rank 1's differences from rank 0, and what the refusal must name (rank 0's value first).
CASES: dict[str, tuple[dict, str]] = {
    "bucket_bytes": (
        {"bucket_bytes": 16384},
        "OffloadConfig.bucket_bytes: rank 0 has 8192, rank 1 has 16384",
    ),
    "max_grad_norm": (
        {"max_grad_norm": 0.5},
        "OffloadConfig.max_grad_norm: rank 0 has None, rank 1 has 0.5",
    ),
    "moments_dtype": (
        {"moments_dtype": "bfloat16"},
        "OffloadConfig.moments_dtype: rank 0 has 'float32', rank 1 has 'bfloat16'",
    ),
    "rule": ({}, "the optimizer class: rank 0 has OffloadAdamW, rank 1 has OffloadLion"),
    "lr": ({}, "param group 0's lr: rank 0 has 0.001, rank 1 has 0.5"),
    "order": ({}, "param group 0's parameter 0: rank 0 has shape (64, 32), torch.float32"),
    "dtype": (
        {},
        "param group 0's parameter 0: rank 0 has shape (64, 32), torch.float32, trainable, "
        "rank 1 has shape (64, 32), torch.bfloat16, trainable",
    ),
    "extra_layer": ({}, "param group 0's parameter count: rank 0 has 17, rank 1 has 23"),
}
TIMEOUT = 1.5  # seconds: the collective_timeout of the absent and late ranks' cases


def _build(rank: int, case: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Rank 0's optimizer, or rank 1's with ``case``'s difference."""
    config = {"bucket_bytes": 8192, "tile_elements": 1024}
    if rank == 1:
        config.update(CASES[case][0])
    params = list(model.parameters())
    if rank == 1 and case == "order":
        params = params[::-1]
    lr = 0.5 if rank == 1 and case == "lr" else 1e-3
    facade = OffloadLion if rank == 1 and case == "rule" else OffloadAdamW
    return facade(params, lr=lr, config=OffloadConfig(**config), accelerator=host_accelerator())


def _refusals(rank: int) -> dict:
    """Each case's error on this rank, and what stayed allocated or changed after it."""
    acc = host_accelerator()
    found = {}
    for case in CASES:
        dtype = torch.bfloat16 if rank == 1 and case == "dtype" else torch.float32
        layers = 3 if rank == 1 and case == "extra_layer" else 2
        model, _ = make_pair(dtype, layers=layers)
        before = [p.detach().clone() for p in model.parameters()]
        in_use = acc.memory_stats()["in_use"]
        try:
            _build(rank, case, model).close()
            error = None
        except ValueError as exc:
            error = str(exc)
        found[case] = {
            "error": error,
            "in_use": acc.memory_stats()["in_use"] - in_use,
            "weights_kept": all(
                torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
            ),
        }
    return found


def _added_group(rank: int) -> dict:
    """A group added with another lr on rank 1 is refused on both and dropped; added alike,
    it trains."""
    model, _ = make_pair()
    head = list(model.head.parameters())
    rest = [p for name, p in model.named_parameters() if not name.startswith("head.")]
    opt = OffloadAdamW(rest, lr=1e-3, config=OffloadConfig(bucket_bytes=8192),
                       accelerator=host_accelerator())  # fmt: skip
    try:
        opt.add_param_group({"params": head, "lr": 0.5 if rank == 1 else 0.01})
        error = None
    except ValueError as exc:
        error = str(exc)
    groups_after = len(opt.param_groups)
    opt.add_param_group({"params": head, "lr": 0.01})
    train_steps(model, opt, data(1), rank, 2)
    opt.close()
    return {"error": error, "groups_after": groups_after}


def _may_differ(rank: int) -> list[torch.Tensor]:
    """What may differ per rank (Note [the ranks build alike]) builds and trains."""
    model, _ = make_pair()
    kept = {"collective_timeout": 300.0, "tile_elements": 2048, "grad_accumulation": "host"}
    opt = offload_opt(model, **(kept if rank == 1 else {}))
    train_steps(model, opt, data(2), rank, 2)
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


def _absent(rank: int) -> dict:
    """Rank 1 never builds: rank 0 raises naming it within the timeout."""
    group = dist.new_group([0, 1])  # given, so that construction makes no group of its own
    dist.barrier()
    result: dict = {}
    if rank == 0:
        model, _ = make_pair()
        began = time.perf_counter()
        try:
            OffloadAdamW(model.parameters(), config=OffloadConfig(collective_timeout=TIMEOUT),
                         process_group=group, accelerator=host_accelerator())  # fmt: skip
        except CollectiveError as exc:
            result = {"error": str(exc)}
        result["seconds"] = time.perf_counter() - began
    dist.barrier()  # rank 1 waits here, having built nothing
    return result


#: How rank 1 alone fails, and what its own error says (rank 0's names it too).
ALONE: dict[str, str] = {
    "arguments": "offload_fraction must be 1.0 with several ranks",
    "groups": "is not a leaf tensor",
    "parameters": "share memory",
    "build": "nvme_dir",
    "added_group": "lr",
}
PATIENCE = 120.0  # collective_timeout of these cases: a rank that waited for it failed


def _one_fails(rank: int, case: str, model: torch.nn.Module, tmp: Path) -> None:
    """Build (and, for ``added_group``, extend) an optimizer on ``model``, failing on rank 1
    in ``case``'s way."""
    config = {"bucket_bytes": 8192, "collective_timeout": PATIENCE}
    params: list = list(model.parameters())
    alone = rank == 1
    if alone and case == "arguments":
        config["offload_fraction"] = 0.5
    if alone and case == "groups":
        params[0] = params[0] * 1.0  # not a leaf
    if alone and case == "parameters":
        params[0] = torch.nn.Parameter(params[1].detach().view(-1)[: params[0].numel()])
    if case == "build":  # rank 1's directory is a file; each rank may keep its own
        (tmp / "file").write_text("")
        config.update(nvme_dir=str(tmp / ("file" if alone else f"dir{rank}")), host_budget=0)
    if case == "added_group":
        head = list(model.head.parameters())
        params = [p for p in params if all(p is not h for h in head)]
    opt = OffloadAdamW(params, lr=1e-3, config=OffloadConfig(**config),
                       accelerator=host_accelerator())  # fmt: skip
    if case == "added_group":
        try:
            opt.add_param_group({"params": head, "lr": -1.0 if alone else 1e-3})
        finally:
            groups = len(opt.param_groups)
            opt.add_param_group({"params": head, "lr": 1e-3})  # alike: it trains
            train_steps(model, opt, data(1), rank, 2)
            opt.close()
            assert groups == 1, groups
    opt.close()


def _fails_alone(rank: int, tmp: Path) -> dict:
    """Each ``ALONE`` case: the error on this rank, how long it took, what stayed."""
    acc = host_accelerator()
    found = {}
    for case in ALONE:
        model, _ = make_pair()
        before = [p.detach().clone() for p in model.parameters()]
        in_use = acc.memory_stats()["in_use"]
        dist.barrier()  # lined up, so the clock measures this case alone
        began = time.perf_counter()
        error: tuple[str, str] | None = None
        try:
            _one_fails(rank, case, model, tmp)
        except Exception as exc:
            error = (type(exc).__name__, str(exc))
        found[case] = {
            "error": error,
            "seconds": time.perf_counter() - began,
            "in_use": acc.memory_stats()["in_use"] - in_use,
            "weights_kept": all(
                torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
            ),
        }
    return found


def _entry(rank: int, world: int, port: int, out: str) -> None:
    join_gloo(rank, world, port)
    result = {
        "refusals": _refusals(rank),
        "added": _added_group(rank),
        "may_differ": _may_differ(rank),
        "alone": _fails_alone(rank, Path(out)),
        "absent": _absent(rank),
    }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    # Rank 0's timed-out collective leaves a thread blocked in gloo: leave at once.
    os._exit(0)


def test_ranks_that_build_differently_are_refused_on_every_rank(tmp_path: Path) -> None:
    mp.spawn(_entry, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, result in enumerate(results):
        for case, (_, named) in CASES.items():
            refusal = result["refusals"][case]
            assert refusal["error"] is not None, (rank, case)
            assert refusal["error"].startswith(f"rank {rank}/2: "), refusal["error"]
            assert named in refusal["error"], (case, refusal["error"])
            assert "every rank must build the optimizer alike" in refusal["error"]
            assert refusal["in_use"] == 0, (rank, case)  # nothing left half-built
            assert refusal["weights_kept"], (rank, case)
        added = result["added"]
        assert "param group 1's lr: rank 0 has 0.01, rank 1 has 0.5" in added["error"]
        assert added["groups_after"] == 1  # the refused group was dropped
    # Different tiles, timeouts and accumulation places: the one-process result.
    model, _ = make_pair()
    opt = offload_opt(model)
    train(model, opt, data(2))
    opt.close()
    for result in results:
        for ours, one in zip(result["may_differ"], model.parameters(), strict=True):
            assert (ours - one.detach()).abs().max().item() < 1e-5
    for case, said in ALONE.items():
        mine, theirs = results[1]["alone"][case], results[0]["alone"][case]
        assert mine["error"] is not None and said in mine["error"][1], (case, mine)
        kind = "CollectiveError" if case == "build" else "ValueError"
        assert theirs["error"] is not None and theirs["error"][0] == kind, (case, theirs)
        assert theirs["error"][1].startswith("rank 0/2: OffloadAdamW: "), theirs["error"]
        assert "on rank 1 (" in theirs["error"][1] and said in theirs["error"][1], theirs
        for result in (mine, theirs):
            assert result["seconds"] < PATIENCE / 4, (case, result)  # not the deadline
            assert result["in_use"] == 0, (case, result)
            assert result["weights_kept"] or case == "added_group", (case, result)
    absent = results[0]["absent"]
    assert "Rank(s) 1 did not report" in absent["error"], absent
    assert "the digest of the optimizer, rule and config each rank builds" in absent["error"]
    assert absent["seconds"] < TIMEOUT + 2.0 + 3.0  # + the roll call's grace


# -- the checkpoints' collectives keep the deadline and name themselves ------------------------

LATE = 6.0  # seconds rank 1 arrives after rank 0


def _late_entry(rank: int, world: int, port: int, out: str, what: str) -> None:
    """Rank 1 reaches ``what`` LATE seconds after rank 0."""
    from zero_offload.checkpoint_io import save_consolidated

    join_gloo(rank, world, port)
    model, _ = make_pair()
    opt = offload_opt(model, collective_timeout=TIMEOUT)
    train_steps(model, opt, data(1), rank, world)
    dist.barrier()  # lined up, so the clock measures the late rank alone
    if rank == 1:
        time.sleep(LATE)
    began = time.perf_counter()
    result: dict = {"type": None, "error": None}
    try:
        if what == "save_consolidated":
            save_consolidated(opt, Path(out) / "opt.pt")
        else:
            opt.save_streaming(Path(out) / "streamed")
    except Exception as exc:
        result = {"type": type(exc).__name__, "error": str(exc)}
    result["seconds"] = time.perf_counter() - began
    torch.save(result, Path(out) / f"late.rank{rank}.pt")
    os._exit(0)  # a timed-out collective leaves a thread blocked in gloo


@pytest.mark.parametrize(
    ("what", "collective"),
    [
        ("save_consolidated", "every rank's optimizer state for rank 0's consolidated state dict"),
        ("save_streaming", "all_reduce of the save id of save_streaming"),
    ],
)
def test_a_late_rank_at_a_checkpoint_is_named_within_the_timeout(
    what: str, collective: str, tmp_path: Path
) -> None:
    mp.spawn(_late_entry, args=(2, free_port(), str(tmp_path), what), nprocs=2)
    first = torch.load(tmp_path / "late.rank0.pt", weights_only=False)
    assert first["type"] == "CollectiveError", first
    assert first["error"].startswith("rank 0/2: "), first["error"]
    assert collective in first["error"], first["error"]
    assert "gradient norm" not in first["error"], first["error"]
    assert "Rank(s) 1 did not report" in first["error"], first["error"]
    assert first["seconds"] < LATE - 0.5  # it did not wait for the late rank


# -- failures injected in the build, after the comparison ---------------------------------------

#: Where rank 1's build fails: what its own error says, and rank 0's.
INJECTED: dict[str, tuple[str, str]] = {
    # Weights on the device leave it first; rank 1's copy to the host fails.
    "originals": ("copying an original", "failed on rank 1 (MemoryError: simulated: copying"),
    # A bucket fails, and the originals cannot go back (rank 1 raises that): told first.
    "restore": ("cannot go back", "failed on rank 1 (MemoryError: simulated: a bucket's store"),
    # Rank 0 alone keeps a window, whose gather group it would make before the comparison.
    "offload_parameters": (
        "OffloadConfig.offload_parameters: rank 0 has True, rank 1 has False",
        "OffloadConfig.offload_parameters: rank 0 has True, rank 1 has False",
    ),
}


@contextlib.contextmanager
def _injected(rank: int, case: str) -> Iterator[None]:
    """Rank 1's build fails in ``case``'s way while inside (each patch undone after)."""
    from zero_offload.optim import construction
    from zero_offload.weights import source

    def fail(why: str) -> Callable[..., None]:
        def raising(*args: object, **kwargs: object) -> None:
            raise MemoryError(f"simulated: {why}")

        return raising

    patches = (
        {
            "originals": [(source.DeviceOriginals, "_to_host", fail("copying an original"))],
            "restore": [
                (construction.SegmentBuilder, "_bucket", fail("a bucket's store")),
                (source.DeviceOriginals, "restore", fail("the originals cannot go back")),
            ],
        }.get(case, [])
        if rank == 1
        else []
    )
    kept = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in kept:
            setattr(owner, name, value)


def _injected_build(rank: int, case: str, group: object, tmp: Path) -> None:
    torch.manual_seed(0)
    config: dict = {"bucket_bytes": 8192, "collective_timeout": PATIENCE}
    if case == "offload_parameters":
        model = TinyGPT(GPTConfig(vocab_size=50, seq_len=32, layers=3, hidden=64, heads=4))
        config.update(offload_parameters=rank == 0)
        extra = {"model": model} if rank == 0 else {}
    else:
        model, _ = make_pair()
        on_simulated_gpu(model)
        extra = {}
    with _injected(rank, case):
        OffloadAdamW(model.parameters(), config=OffloadConfig(**config), process_group=group,
                     accelerator=host_accelerator(), **extra).close()  # fmt: skip


def _injected_entry(rank: int, world: int, port: int, out: str) -> None:
    join_gloo(rank, world, port)
    # Given, so a failing rank does not close the group's sockets on its way out: its peers
    # learn of the failure only from the library, as with NCCL.
    group = dist.new_group([0, 1])
    found = {}
    for case in INJECTED:
        dist.barrier()
        began = time.perf_counter()
        error: tuple[str, str] | None = None
        try:
            _injected_build(rank, case, group, Path(out))
        except Exception as exc:
            error = (type(exc).__name__, str(exc))
        found[case] = {"error": error, "seconds": time.perf_counter() - began}
    torch.save(found, Path(out) / f"injected.rank{rank}.pt")
    os._exit(0)


def test_a_build_that_fails_on_one_rank_after_the_comparison_fails_on_every_rank(
    tmp_path: Path,
) -> None:
    mp.spawn(_injected_entry, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"injected.rank{r}.pt") for r in range(2)]
    for case, (theirs, ours) in INJECTED.items():
        for rank, said in ((1, theirs), (0, ours)):
            found = results[rank][case]
            assert found["error"] is not None, (case, rank)
            assert said in found["error"][1], (case, rank, found)
            assert found["seconds"] < PATIENCE / 4, (case, rank, found)  # not the deadline
        kinds = ("ValueError", "ValueError") if case == "offload_parameters" else None
        kinds = kinds or ("CollectiveError", "MemoryError")
        assert tuple(r[case]["error"][0] for r in results) == kinds, case


def test_a_bounce_ring_that_cannot_be_pinned_leaves_the_model_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parameter offload with homes on NVMe: the bounce ring is pinned inside the build, so
    its failure is undone like any other (before, it came after the build and left every
    parameter released: any read raised "a released parameter was read")."""
    from zero_offload.params import home_store

    def fail(*args: object, **kwargs: object) -> None:
        raise MemoryError("simulated: pinning the bounce ring")

    monkeypatch.setattr(home_store.Bounce, "__init__", fail)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, seq_len=32, layers=3, hidden=64, heads=4))
    before = [p.detach().clone() for p in model.parameters()]
    config = OffloadConfig(offload_parameters=True, nvme_dir=str(tmp_path), host_budget=1)
    with pytest.raises(MemoryError, match="bounce ring"):
        OffloadAdamW(model.parameters(), config=config, model=model, layers=model.blocks,
                     accelerator=host_accelerator())  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model(torch.zeros(1, 8, dtype=torch.long))  # a forward reads every weight
