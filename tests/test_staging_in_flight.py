"""OffloadConfig(grad_staging="in_flight"): gradient staging for the buckets in flight (Note
[gradient staging for the buckets in flight] in optim/grads/staging_ring.py).

Bitwise the default per-bucket staging, with and without parameter offload (and with NVMe),
fp32 and bf16, over several steps, many tiny buckets through a ring of two on a slow link
(so a flush often finds its slot's update still running), under the race checker, and in
strict mode; the refusals; the fallback of a step that runs in step() (exact, the ring grows,
warned); the host pools against a formula.

CUDA form (``cuda_form``, docs/gpu.md): the models, batches and optimizers come from
tests/helpers, and ``_accelerator`` is the running test's: on the host accelerator a slow
simulated link under the race checker, on ``cuda:0`` the real link and streams (a CUDA
accelerator has neither a simulated link nor the race checker). What the bitwise comparisons,
the ring's slots and the pools prove holds on either. Simulator only: the strict-mode cases
(``STRICT``). Two timings hold on the slow simulated link only and are checked there (the
share of the step done when backward returned, record writes before it returned); on a
real link they depend on the GPU's speed against the host's, so they are not asserted there.
Host only: the config refusals (no model, no accelerator)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig
from zero_offload.accelerator import Accelerator
from zero_offload.accelerator.host import HostAccelerator
from zero_offload.config import AcceleratorConfig
from zero_offload.memory.align import aligned
from zero_offload.optim.grads.staging_ring import SlotState, StagingRing
from zero_offload.optim.state.placement import POOL_ALIGNMENT

from .helpers.device import on_device, run_accelerator, run_device, run_kind
from .helpers.models import batches, lm_loss, make_pair, max_diff, offload_opt
from .test_param_offload import SEQ, VOCAB, assert_same, gpt

IN_FLIGHT = {"grad_staging": "in_flight", "grad_staging_buffers": 2}
#: The strict-mode case of a parametrized test: strict mode is the host accelerator's.
STRICT = pytest.param(True, id="strict", marks=pytest.mark.simulator_only(reason="strict mode"))


def _on_slow_link() -> bool:
    """Whether ``_accelerator`` simulates the slow link (the host's), where the module
    docstring's timings hold."""
    return run_kind() == "host"


def _accelerator(*, strict: bool = False, budget: str = "256MiB") -> Accelerator:
    if run_kind() == "cuda":  # the real link; strict cases are simulator_only
        return run_accelerator(device_budget=budget)
    # A slow simulated link: each gradient copy takes long, so bucket b+2's flush often
    # finds bucket b's CPU Adam still running and must wait for its slot.
    return HostAccelerator(  # host: a simulated link under the race checker
        AcceleratorConfig(  # host: as above
            device_budget=budget, link_bandwidth=2e8, check_races=True, strict=strict or None
        )
    )


def _ring(opt: OffloadAdamW) -> StagingRing:
    return opt.buckets[0].gradients.staging.ring


def _train_lm(opt: OffloadAdamW, model: torch.nn.Module, steps: int, *, announce: bool) -> None:
    for tokens, targets in batches(steps):
        opt.backward(lm_loss(model, tokens, targets), step=announce)
        opt.step()
        opt.zero_grad()


@pytest.mark.cuda_form
@pytest.mark.parametrize("strict", [False, STRICT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_flight_staging_is_bitwise_per_bucket_staging(dtype: torch.dtype, strict: bool) -> None:
    ring_model, plain_model = make_pair(dtype)
    ring = offload_opt(
        ring_model, accelerator=_accelerator(strict=strict), bucket_bytes=2048, **IN_FLIGHT
    )
    plain = offload_opt(plain_model, bucket_bytes=2048)
    assert len(ring.buckets) >= 10  # many buckets through a ring of two
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no refusal, no growth
        _train_lm(ring, ring_model, 4, announce=True)
    _train_lm(plain, plain_model, 4, announce=False)
    assert max_diff(ring_model, plain_model) == 0.0
    assert ring.state_dict()["state"][0]["step"] == plain.state_dict()["state"][0]["step"]
    assert ring.last_grad_norm == plain.last_grad_norm
    assert len(_ring(ring).slots) == 2 and not _ring(ring).grown
    assert ring.share_stepped_during_backward is not None
    ring.close()
    plain.close()


def _po_opt(model: torch.nn.Module, *, strict: bool = False, **config: object) -> OffloadAdamW:
    return OffloadAdamW(
        model.parameters(),
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        config=OffloadConfig(
            offload_parameters=True, bucket_bytes=4096, tile_elements=1024, **config
        ),  # type: ignore[arg-type]
        accelerator=_accelerator(strict=strict, budget="64MiB"),
        model=model,
    )


def _train_gpt(opt: OffloadAdamW, model: torch.nn.Module, steps: int, *, announce: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))
        opt.backward(model(ids, ids), step=announce)
        opt.step()
        opt.zero_grad()


@pytest.mark.cuda_form
@pytest.mark.parametrize(
    ("dtype", "tied", "strict"),
    [
        (torch.float32, False, False),
        (torch.bfloat16, True, False),
        pytest.param(torch.bfloat16, False, True, marks=STRICT.marks, id="bf16-strict"),
    ],
)
def test_with_parameter_offload_the_step_runs_during_backward_bitwise(
    dtype: torch.dtype, tied: bool, strict: bool
) -> None:
    ring_model = gpt(dtype, layers=4, tied=tied)
    plain_model = gpt(dtype, layers=4, tied=tied)
    ring = _po_opt(ring_model, strict=strict, **IN_FLIGHT)
    plain = _po_opt(plain_model)  # per-bucket staging: the step runs in step()
    assert ring.can_step_during_backward()
    assert not plain.can_step_during_backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_gpt(ring, ring_model, 3, announce=True)
    _train_gpt(plain, plain_model, 3, announce=False)
    assert len(_ring(ring).slots) == 2
    # Most of the step's CPU Adam was done when backward returned (on the slow link).
    assert ring.share_stepped_during_backward is not None
    if _on_slow_link():
        assert ring.share_stepped_during_backward > 0.5
    ring.close()
    plain.close()
    assert_same(ring_model, plain_model)


@pytest.mark.cuda_form
def test_with_parameter_offload_and_nvme(tmp_path) -> None:
    ring_model = gpt(torch.bfloat16, layers=4)
    plain_model = gpt(torch.bfloat16, layers=4)
    # A host budget for about half the state: the rest streams from NVMe.
    state = 12 * sum(p.numel() for p in ring_model.parameters())
    nvme = {"host_budget": state // 2}
    ring = _po_opt(ring_model, nvme_dir=str(tmp_path / "ring"), **nvme, **IN_FLIGHT)
    plain = _po_opt(plain_model, nvme_dir=str(tmp_path / "plain"), **nvme)
    assert any(b.store.on_storage_tier for b in ring.buckets)
    assert not all(b.store.on_storage_tier for b in ring.buckets)
    _train_gpt(ring, ring_model, 3, announce=True)
    _train_gpt(plain, plain_model, 3, announce=False)
    assert len(_ring(ring).slots) == 2
    ring.close()
    plain.close()
    assert_same(ring_model, plain_model)


class _HomeFileWatch:
    """Every weight-file access of one optimizer, in order: a fetch's reads (issued, then
    settled in ``PendingFetch.finish``/``drop``) and the step's record writes; ``step()``
    ends a step. Checks, per file, that the update writes no record while a fetch's reads
    are outstanding and that no fetch reads the file after the update wrote it, until
    ``step()`` published it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: str) -> None:
        from zero_offload.params import home_store
        from zero_offload.weights import nvme_home

        self.lock = threading.Lock()
        self.open: dict[str, int] = {}  # file -> fetches whose reads are outstanding
        self.dirty: set[str] = set()  # files the step wrote, not yet published
        self.errors: list[str] = []
        self.writes = self.reads = 0
        self.writes_in_backward = 0
        self.in_backward = False
        watch = self
        read_all, write = nvme_home.WeightFile.begin_read_all, nvme_home.WeightFile.write
        finish, drop = home_store.PendingFetch.finish, home_store.PendingFetch.drop

        def begin_read_all(file, manager, area):  # type: ignore[no-untyped-def]
            if file.path.startswith(root):
                with watch.lock:
                    watch.reads += 1
                    watch.open[file.path] = watch.open.get(file.path, 0) + 1
                    if file.path in watch.dirty:
                        watch.errors.append(f"fetch read {file.path} after the step wrote it")
            return read_all(file, manager, area)

        def settled(method):  # type: ignore[no-untyped-def]
            def wrapped(fetch):  # type: ignore[no-untyped-def]
                try:
                    return method(fetch)
                finally:
                    if fetch.home is not None and fetch.home.path.startswith(root):
                        with watch.lock:
                            watch.open[fetch.home.path] -= 1

            return wrapped

        def record_write(file, manager, tile, buffer):  # type: ignore[no-untyped-def]
            if file.path.startswith(root):
                with watch.lock:
                    watch.writes += 1
                    watch.writes_in_backward += watch.in_backward
                    if watch.open.get(file.path, 0):
                        watch.errors.append(f"step wrote {file.path} during a fetch's read")
                    watch.dirty.add(file.path)
            return write(file, manager, tile, buffer)

        monkeypatch.setattr(nvme_home.WeightFile, "begin_read_all", begin_read_all)
        monkeypatch.setattr(nvme_home.WeightFile, "write", record_write)
        monkeypatch.setattr(home_store.PendingFetch, "finish", settled(finish))
        monkeypatch.setattr(home_store.PendingFetch, "drop", settled(drop))

    def train(self, opt: OffloadAdamW, model: torch.nn.Module, steps: int) -> None:
        """``_train_gpt`` with announced steps, marking backward and step."""
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            ids = on_device(torch.randint(0, VOCAB, (2, SEQ), generator=gen))
            loss = model(ids, ids)
            self.in_backward = True
            opt.backward(loss, step=True)
            self.in_backward = False
            opt.step()
            with self.lock:
                self.dirty.clear()  # published: the next fetch reads the new weights
            opt.zero_grad()


@pytest.mark.cuda_form
@pytest.mark.parametrize("strict", [pytest.param(False, id="plain"), STRICT])
@pytest.mark.parametrize(("homes", "tied"), [("all", False), ("some", True)])
def test_with_parameter_offload_and_homes_on_nvme(
    tmp_path, monkeypatch: pytest.MonkeyPatch, homes: str, tied: bool, strict: bool
) -> None:
    # The ZeRO-Infinity configuration: the host budget holds some homes (or none),
    # the other buckets' weights in weight files, every bucket's state on NVMe, gradient
    # staging for the buckets in flight. The step during backward writes each bucket's
    # weight records (NvmeHomeState) after its unit's last fetch of this backward and marks
    # the slot stale only in step() (Note [stepping during backward with parameter
    # offload]): under the race checker, bitwise the per-bucket staging run with the same
    # placement, whose step runs in step(); and no fetch's disk read of a home overlaps or
    # follows the update's writes of that file before step() (the race checker sees streams,
    # not files: _HomeFileWatch does).
    from zero_offload.optim.state.nvme_weights import NvmeHomeState

    ring_model = gpt(torch.bfloat16, layers=4, tied=tied)
    plain_model = gpt(torch.bfloat16, layers=4, tied=tied)
    # Homes-first budget: none, or about half the bf16 homes (2 bytes a parameter).
    budget = 0 if homes == "all" else sum(p.numel() for p in ring_model.parameters())
    nvme = {"host_budget": budget}
    root = str(tmp_path / "r")
    ring = _po_opt(ring_model, strict=strict, nvme_dir=root, **nvme, **IN_FLIGHT)
    plain = _po_opt(plain_model, strict=strict, nvme_dir=str(tmp_path / "p"), **nvme)
    on_disk = [isinstance(b.store, NvmeHomeState) for b in ring.buckets]
    assert on_disk == [isinstance(b.store, NvmeHomeState) for b in plain.buckets]
    assert any(on_disk) and (all(on_disk) if homes == "all" else not all(on_disk))
    assert ring.can_step_during_backward()
    watch = _HomeFileWatch(monkeypatch, root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.train(ring, ring_model, 3)
    _train_gpt(plain, plain_model, 3, announce=False)
    assert watch.errors == []
    assert watch.reads > 0 and watch.writes > 0 and not any(watch.open.values())
    if _on_slow_link():  # some records were written before backward returned
        assert watch.writes_in_backward > 0
    assert len(_ring(ring).slots) == 2 and not _ring(ring).grown
    assert ring.share_stepped_during_backward is not None
    ring.close()
    plain.close()
    assert_same(ring_model, plain_model)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_grad_norm", 1.0),
        ("skip_nonfinite", True),
        ("speculative_step", True),
        ("overlap_step", True),
        ("offload_fraction", 0.5),
    ],
)
def test_settings_that_need_every_gradient_first_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"grad_staging='in_flight'.*{field}"):
        OffloadConfig(grad_staging="in_flight", **{field: value})  # type: ignore[arg-type]
    OffloadConfig(**{field: value})  # type: ignore[arg-type]  # fine with per-bucket staging


def test_bad_values_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"grad_staging must be 'per_bucket' or 'in_flight'"):
        OffloadConfig(grad_staging="ring")
    with pytest.raises(ValueError, match=r"grad_staging_buffers must be an int >= 1"):
        OffloadConfig(grad_staging="in_flight", grad_staging_buffers=0)


@pytest.mark.cuda_form
def test_fp16_parameters_are_refused_at_construction() -> None:
    model, _ = make_pair(torch.float16)
    with pytest.raises(ValueError, match=r"grad_staging='in_flight'.*fp16.*grad_staging="):
        offload_opt(model, **IN_FLIGHT)


@pytest.mark.cuda_form
def test_a_step_in_step_grows_the_ring_and_stays_exact() -> None:
    """Not announced, or micro-batches accumulating: every gradient waits for step(), so
    the ring grows (warned once) and the result is per-bucket staging's, bitwise."""
    ring_model, plain_model = make_pair(torch.bfloat16)
    ring = offload_opt(ring_model, accelerator=_accelerator(), bucket_bytes=2048, **IN_FLIGHT)
    plain = offload_opt(plain_model, bucket_bytes=2048)
    n = len(ring.buckets)
    with pytest.warns(UserWarning, match="ring grows by one buffer"):
        _train_lm(ring, ring_model, 2, announce=False)
    _train_lm(plain, plain_model, 2, announce=False)
    # Every bucket held its slot until step(): one slot each, kept for later steps.
    assert len(_ring(ring).slots) == n
    # Two micro-batches per step, the last one announced: the first one's gradients stay
    # in staging until the second backward folds them into the accumulator.
    data = batches(4, seed=1)
    for i in (0, 2):
        for j, (tokens, targets) in enumerate(data[i : i + 2]):
            ring.backward(lm_loss(ring_model, tokens, targets), step=j == 1)
            plain.backward(lm_loss(plain_model, tokens, targets))
        ring.step()
        plain.step()
        ring.zero_grad()
        plain.zero_grad()
    assert max_diff(ring_model, plain_model) == 0.0
    assert all(s.state is not SlotState.HELD for s in _ring(ring).slots)
    ring.close()
    plain.close()


@pytest.mark.cuda_form
def test_clipping_after_the_backward_is_refused() -> None:
    model, _ = make_pair()
    opt = offload_opt(model, **IN_FLIGHT)
    opt.backward(lm_loss(model, *batches(1)[0]), step=True)
    with pytest.raises(RuntimeError, match=r"step ran during backward, unclipped"):
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.close()


@pytest.mark.cuda_form
def test_zero_grad_after_a_raising_backward_frees_every_slot() -> None:
    model, _ = make_pair()
    opt = offload_opt(model, bucket_bytes=2048, **IN_FLIGHT)
    tokens, targets = batches(1)[0]

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    handle = model.embed.weight.register_hook(boom)  # raises late in backward
    with pytest.raises(RuntimeError, match="boom"):
        opt.backward(lm_loss(model, tokens, targets), step=True)
    handle.remove()
    with pytest.warns(UserWarning, match="were stepped"):
        opt.zero_grad()
    assert all(s.state is not SlotState.HELD for s in _ring(opt).slots)
    _train_lm(opt, model, 2, announce=True)  # trains on, no growth
    assert len(_ring(opt).slots) == 2
    opt.close()


@pytest.mark.cuda_form
@pytest.mark.parametrize("offload_parameters", [False, True])
def test_host_pools_against_the_formula(offload_parameters: bool) -> None:
    """The host pool shrinks by every bucket's own staging; the ring adds K slots of the
    largest shard."""

    def build(**config: object) -> tuple[torch.nn.Module, OffloadAdamW]:
        model = gpt(torch.bfloat16, layers=4)
        if offload_parameters:
            return model, _po_opt(model, **config)
        return model, offload_opt(model, accelerator=_accelerator(), bucket_bytes=4096, **config)

    _, plain = build()
    model, ring = build(**IN_FLIGHT)
    pools = {p.name: p.capacity for p in ring.manager.pools}
    plain_pools = {p.name: p.capacity for p in plain.manager.pools}
    # The host pools: one, or with parameter offload one per unit (Note [homes are pinned
    # unit by unit] in optim/unit_pools.py).
    host = sum(c for name, c in pools.items() if name.endswith(".host"))
    plain_host = sum(c for name, c in plain_pools.items() if name.endswith(".host"))
    ring_bytes = next(c for name, c in pools.items() if name.endswith(".grad_staging_ring"))
    s = 2  # bf16 training dtype: bytes per gradient element
    shards = [b.layout.shard_numel for b in ring.buckets]  # one rank: each bucket whole
    # Per-bucket staging: a(k*s) per bucket, for the whole model (what the ring replaces).
    own_staging = sum(aligned(s * k, POOL_ALIGNMENT) for k in shards)
    # The ring: K slots, each the largest shard's a(k*s).
    slot = max(aligned(s * k, POOL_ALIGNMENT) for k in shards)
    assert host == plain_host - own_staging
    assert ring_bytes == 2 * slot
    # The host pool holds, per bucket of k elements: the fp32 master a(4k), two fp32
    # moments 2 a(4k), and the bf16 weight staging a(2k) (the home with parameter offload).
    per_bucket = sum(
        aligned(4 * k, POOL_ALIGNMENT) + 2 * aligned(4 * k, POOL_ALIGNMENT) + aligned(s * k, 512)
        for k in shards
    )
    assert host == per_bucket
    # Per parameter, against 16 bytes with per-bucket staging: 14 bytes, plus the ring.
    params = sum(p.numel() for p in model.parameters())
    assert host + ring_bytes < plain_host
    assert host <= 14 * params + len(shards) * 4 * POOL_ALIGNMENT
    ring.close()
    plain.close()


class _Mixed(torch.nn.Module):
    """bf16 layers and fp32 layers: buckets of two training dtypes share one ring."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 96).to(torch.bfloat16)  # moved with the module
        self.down = torch.nn.Linear(96, 16)
        self.out = torch.nn.Linear(16, 96).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.relu(self.up(x.bfloat16())).float())
        return self.out(h.bfloat16()).float()


@pytest.mark.cuda_form
def test_buckets_of_two_dtypes_share_the_ring() -> None:
    torch.manual_seed(0)
    ring_model = _Mixed().to(run_device())
    plain_model = _Mixed().to(run_device())
    plain_model.load_state_dict(ring_model.state_dict())
    ring = offload_opt(ring_model, accelerator=_accelerator(), bucket_bytes=1024, **IN_FLIGHT)
    plain = offload_opt(plain_model, bucket_bytes=1024)
    dtypes = {b.dtype for b in ring.buckets}
    assert dtypes == {torch.bfloat16, torch.float32} and len(ring.buckets) >= 6
    # The slot is the largest shard in bytes, whichever dtype it is.
    slot = max(aligned(b.layout.shard_numel * b.dtype.itemsize, 512) for b in ring.buckets)
    assert _ring(ring).slot_bytes == slot
    gen = torch.Generator().manual_seed(2)
    inputs = [on_device(torch.randn(8, 16, generator=gen)) for _ in range(3)]
    _step_both(ring, ring_model, plain, plain_model, inputs, lambda m, x, i: m(x).square().mean())


@pytest.mark.cuda_form
def test_buckets_without_gradients_in_a_step_are_left_alone() -> None:
    # Every other step skips the blocks: their buckets get no gradient, and a step must
    # not take their last window's (stepped, released) staging for this one's.
    ring_model, plain_model = make_pair(torch.bfloat16)
    ring = offload_opt(ring_model, accelerator=_accelerator(), bucket_bytes=2048, **IN_FLIGHT)
    plain = offload_opt(plain_model, bucket_bytes=2048)

    def loss_of(model: torch.nn.Module, batch: tuple, i: int) -> torch.Tensor:
        tokens, targets = batch
        if i % 2 == 0:
            return lm_loss(model, tokens, targets)
        logits = model.head(model.norm(model.embed(tokens)))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    _step_both(ring, ring_model, plain, plain_model, batches(4), loss_of)


def _step_both(
    ring: OffloadAdamW,
    ring_model: torch.nn.Module,
    plain: OffloadAdamW,
    plain_model: torch.nn.Module,
    inputs: list,
    loss_of: object,
) -> None:
    """A step per input on both (announced on the ring), then bitwise equal, the ring not
    grown, both closed."""
    for i, batch in enumerate(inputs):
        for opt, model, announce in ((ring, ring_model, True), (plain, plain_model, False)):
            opt.backward(loss_of(model, batch, i), step=announce)  # type: ignore[operator]
            opt.step()
            opt.zero_grad()
    assert max_diff(ring_model, plain_model) == 0.0
    assert len(_ring(ring).slots) == 2
    ring.close()
    plain.close()


@pytest.mark.cuda_form
def test_a_superseded_step_cannot_be_redone_from_released_staging() -> None:
    """Per-bucket staging keeps the gradients of a step run during backward, so after a
    load_state_dict superseded it, step() steps from the loaded state; the ring gave them
    to the next buckets, so that step() is refused, and a zero_grad() starts over."""
    model, _ = make_pair(torch.bfloat16)
    opt = offload_opt(model, bucket_bytes=2048, **IN_FLIGHT)
    saved = opt.state_dict()
    tokens, targets = batches(1)[0]
    opt.backward(lm_loss(model, tokens, targets), step=True)
    opt.load_state_dict(saved)
    with pytest.raises(RuntimeError, match=r"stepped during backward.*zero_grad"):
        opt.step()
    opt.zero_grad()
    _train_lm(opt, model, 2, announce=True)
    assert len(_ring(opt).slots) == 2
    opt.close()
