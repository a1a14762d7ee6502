"""Streaming checkpoints for the rules that read whole parameters (issue 37): Adafactor and
Muon keep state shaped by each parameter (Note [rules that read a whole parameter] in
zero_offload/optim/rule/base.py), which ``save_streaming`` writes after each bucket's tiles
(Note [shaped state in a streamed checkpoint] in optim/checkpoint/bucket_file.py).

1. A run saved with ``save_streaming`` after 4 steps, loaded into a fresh optimizer over a
   model built from another seed and continued, is bitwise a run that never stopped: weights,
   masters, shaped state and step counts, for both rules, fp32 and bf16 weights, plain and
   ``overlap_step``. The TinyTransformer has matrices and vectors, so Adafactor's factored
   (``row_var``/``col_var``) and full (``variance``) second moments are both saved, as are
   Muon's ``momentum_buffer`` and its AdamW's ``exp_avg``/``exp_avg_sq`` (torch's Adafactor
   has no first moment, so there is no momentum case for it). Right after the load,
   ``state_dict()`` is bitwise the saved optimizer's: the consolidated view agrees.
2. Wrong input raises a ``ValueError`` naming what differs and leaves the optimizer as it
   was: another rule's checkpoint (by the recorded rule name, and by the shaped state's
   names where no name was recorded), parameters of other shapes with the same sizes, a
   corrupted shaped record.

CUDA forms: the resume tests (ours against ours; model, data and accelerator from the
helpers). The wrong-input tests check files on the host and stay host only.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from zero_offload import OffloadAdafactor, OffloadAdamW, OffloadConfig, OffloadMuon
from zero_offload.optim.offload_optimizer import OffloadOptimizer

from .helpers.models import batches, host_accelerator, lm_loss, make_pair

RULES = {
    "adafactor": (OffloadAdafactor, {"lr": 1e-2, "weight_decay": 0.1}),
    "muon": (OffloadMuon, {"lr": 0.02, "adamw_lr": 3e-3}),
}
#: The shaped state's names, per rule: (a matrix's, a vector's).
SHAPED = {
    "adafactor": ({"row_var", "col_var"}, {"variance"}),
    "muon": ({"momentum_buffer"}, {"exp_avg", "exp_avg_sq"}),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SAVE_AT, STEPS = 4, 8


def _build(rule: str, model: nn.Module, *, overlap: bool = False) -> OffloadOptimizer:
    cls, hyper = RULES[rule]
    config = OffloadConfig(bucket_bytes=8192, tile_elements=1024, overlap_step=overlap)
    return cls(model.parameters(), **hyper, config=config, accelerator=host_accelerator())


def _steps(model: nn.Module, opt: OffloadOptimizer, part: list) -> None:
    for tokens, targets in part:
        lm_loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad()


def _state(opt: OffloadOptimizer) -> dict[int, dict[str, torch.Tensor]]:
    return opt.state_dict()["state"]


def _assert_same_state(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for index, entry in want.items():
        assert set(got[index]) == set(entry), index
        for name, value in entry.items():
            assert torch.equal(got[index][name], value), (index, name)


def _finish(model: nn.Module, opt: OffloadOptimizer) -> tuple[dict, list[torch.Tensor]]:
    """The final state, then the weights once a pending delayed update has landed."""
    state = _state(opt)
    opt.close()
    return state, [p.detach().clone() for p in model.parameters()]


@pytest.mark.cuda_form
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap_step"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rule", list(RULES))
def test_a_streamed_resume_is_bitwise_the_uninterrupted_run(
    rule: str, dtype: str, overlap: bool, tmp_path: pathlib.Path
) -> None:
    data = batches(STEPS)
    uninterrupted, _ = make_pair(DTYPES[dtype])
    opt = _build(rule, uninterrupted, overlap=overlap)
    _steps(uninterrupted, opt, data)
    want_state, want_weights = _finish(uninterrupted, opt)

    model, _ = make_pair(DTYPES[dtype])
    opt = _build(rule, model, overlap=overlap)
    _steps(model, opt, data[:SAVE_AT])
    opt.save_streaming(tmp_path / "ckpt")
    saved = _state(opt)
    model_state = {name: value.clone() for name, value in model.state_dict().items()}
    opt.close()
    # Both kinds of shaped state are in the checkpoint, and none of it is still zero: a
    # load that dropped or mixed it up would part the runs.
    matrix, vector = SHAPED[rule]
    kinds = {frozenset(entry) - {"master", "step"} for entry in saved.values()}
    assert kinds == {frozenset(matrix), frozenset(vector)}
    assert all(value.abs().sum() > 0 for entry in saved.values() for value in entry.values())

    resumed, _ = make_pair(DTYPES[dtype], seed=1)  # everything comes from the checkpoint
    ropt = _build(rule, resumed, overlap=overlap)
    resumed.load_state_dict(model_state)
    ropt.load_streaming(tmp_path / "ckpt")
    _assert_same_state(_state(ropt), saved)  # the consolidated view of what was loaded
    _steps(resumed, ropt, data[SAVE_AT:])
    got_state, got_weights = _finish(resumed, ropt)
    _assert_same_state(got_state, want_state)
    for got, want in zip(got_weights, want_weights, strict=True):
        assert torch.equal(got, want)


# -- 2. wrong input ----------------------------------------------------------------------------


def _saved(rule: str, tmp_path: pathlib.Path) -> pathlib.Path:
    """A streaming checkpoint of ``rule`` over the TinyTransformer after 2 steps."""
    model, _ = make_pair()
    opt = _build(rule, model)
    _steps(model, opt, batches(2))
    opt.save_streaming(tmp_path / rule)
    opt.close()
    return tmp_path / rule


def _refused(opt: OffloadOptimizer, model: nn.Module, path: pathlib.Path, match: str) -> None:
    """Loading ``path`` raises a ValueError matching ``match`` and changes nothing."""
    before = _state(opt)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        opt.load_streaming(path)
    _assert_same_state(_state(opt), before)
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p.detach(), w)


def _trained(rule: str) -> tuple[nn.Module, OffloadOptimizer]:
    model, _ = make_pair(seed=3)
    opt = _build(rule, model)
    _steps(model, opt, batches(1, seed=3))
    return model, opt


def _drop_rule_name(path: pathlib.Path) -> None:
    """Rewrite ``meta.pt`` as a save from before the rule's name was recorded."""
    meta = torch.load(path / "rank0" / "meta.pt", weights_only=True)
    del meta["rule"]
    torch.save(meta, path / "rank0" / "meta.pt")


@pytest.mark.parametrize(("saved", "loaded"), [("adafactor", "muon"), ("muon", "adafactor")])
def test_another_rules_checkpoint_is_refused_by_name(
    saved: str, loaded: str, tmp_path: pathlib.Path
) -> None:
    path = _saved(saved, tmp_path)
    model, opt = _trained(loaded)
    _refused(opt, model, path, rf"'{saved}' rule, this one steps with the '{loaded}' rule")
    # Without the recorded name, the shaped state's names tell them apart.
    _drop_rule_name(path)
    # Bucket 0 starts with the head's bias: Adafactor's full second moment, Muon's AdamW.
    vector = {"adafactor": "'variance', \\[64\\]", "muon": "'exp_avg', \\[64\\]"}
    _refused(opt, model, path,
             rf"different \['param_state'\] \(.*{vector[saved]}.* saved, .*{vector[loaded]}.* here")  # fmt: skip
    opt.close()


def test_an_elementwise_rules_checkpoint_is_refused(tmp_path: pathlib.Path) -> None:
    model, _ = make_pair()
    adamw = OffloadAdamW(model.parameters(), config=OffloadConfig(bucket_bytes=8192,
                         tile_elements=1024), accelerator=host_accelerator())  # fmt: skip
    _steps(model, adamw, batches(2))
    adamw.save_streaming(tmp_path / "adamw")
    adamw.close()
    model, opt = _trained("adafactor")
    _refused(
        opt, model, tmp_path / "adamw", r"'adamw' rule, this one steps with the 'adafactor' rule"
    )
    _drop_rule_name(tmp_path / "adamw")
    _refused(opt, model, tmp_path / "adamw", r"different \['fields', 'param_state'\]")
    opt.close()


def _linear(fan_in: int, fan_out: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(fan_in, fan_out, bias=False))


@pytest.mark.parametrize("rule", list(RULES))
def test_parameters_of_other_shapes_are_refused(rule: str, tmp_path: pathlib.Path) -> None:
    """(16 -> 48) and (48 -> 16) weights have the same size, so the per-element state would
    fit; the shaped state names the parameter whose shapes differ."""
    x = torch.randn(4, 16)
    model = _linear(16, 48)
    opt = _build(rule, model)
    model(x).square().sum().backward()
    opt.step()
    opt.save_streaming(tmp_path / "ckpt")
    opt.close()
    other = _linear(48, 16)
    opt2 = _build(rule, other)
    other(torch.randn(4, 48)).square().sum().backward()
    opt2.step()
    opt2.zero_grad()
    shapes = {"adafactor": r"\[\['row_var', \[48, 1\]\], \['col_var', \[1, 16\]\]\]",
              "muon": r"\[\['momentum_buffer', \[48, 16\]\]\]"}  # fmt: skip
    _refused(opt2, other, tmp_path / "ckpt",
             rf"different \['param_state'\] \(param_state: parameter 0 of the bucket: {shapes[rule]} saved")  # fmt: skip
    opt2.close()


@pytest.mark.parametrize("rule", list(RULES))
def test_a_corrupted_shaped_record_is_refused(rule: str, tmp_path: pathlib.Path) -> None:
    """The last bytes of a bucket's file are its last parameter's shaped state."""
    path = _saved(rule, tmp_path)
    target = path / "rank0" / "bucket0.bin"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x40
    target.write_bytes(bytes(data))
    model, opt = _trained(rule)
    _refused(
        opt, model, path, r"bucket0.bin: shaped-state record \d+ \(\[.*\]\) fails its checksum"
    )
    opt.close()


def test_a_truncated_shaped_record_is_refused(tmp_path: pathlib.Path) -> None:
    path = _saved("adafactor", tmp_path)
    target = path / "rank0" / "bucket0.bin"
    target.write_bytes(target.read_bytes()[:-4])
    model, opt = _trained("adafactor")
    _refused(opt, model, path, r"bucket0.bin ends early: truncated checkpoint")
    opt.close()


def test_adam_and_adamw_load_each_others_checkpoints(tmp_path) -> None:
    # One family of state (OptimizerRule.state_family): the moments mean the same, as
    # torch's Adam and AdamW load each other's state dicts.
    from zero_offload import OffloadAdam

    model, _ = make_pair()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, accelerator=host_accelerator())
    for tokens, targets in batches(2):
        opt.backward(lm_loss(model, tokens, targets))
        opt.step()
        opt.zero_grad()
    opt.save_streaming(tmp_path / "ckpt")
    saved = opt.state_dict()
    opt.close()
    other = OffloadAdam(model.parameters(), lr=1e-3, accelerator=host_accelerator())
    other.load_streaming(tmp_path / "ckpt")
    loaded = other.state_dict()
    other.close()
    for index, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(loaded["state"][index][name])
            )


@pytest.mark.cuda_form
@pytest.mark.parametrize("rule", list(RULES))
def test_nvme_state_resumes_bitwise_and_moves_to_host_ram(
    rule: str, tmp_path: pathlib.Path
) -> None:
    # NVMe state (Note [NVMe tiles follow whole parameters]) streams the same tiles as the
    # host-RAM store, the shaped state from host RAM: a streamed checkpoint of a run with
    # its master on NVMe resumes bitwise, into NVMe state and into host RAM.
    cls, hyper = RULES[rule]

    def build(model: nn.Module, nvme: pathlib.Path | None) -> OffloadOptimizer:
        extra = {} if nvme is None else {"nvme_dir": nvme, "host_budget": 1}
        config = OffloadConfig(bucket_bytes=8192, tile_elements=1024, **extra)
        return cls(model.parameters(), **hyper, config=config, accelerator=host_accelerator())

    data = batches(STEPS)
    uninterrupted, _ = make_pair()
    opt = build(uninterrupted, None)
    _steps(uninterrupted, opt, data)
    want = [p.detach().clone() for p in uninterrupted.parameters()]
    opt.close()
    model, _ = make_pair()
    opt = build(model, tmp_path / "nvme-a")
    _steps(model, opt, data[:SAVE_AT])
    opt.save_streaming(tmp_path / "ckpt")
    model_state = {name: value.clone() for name, value in model.state_dict().items()}
    opt.close()
    for where in (tmp_path / "nvme-b", None):
        resumed, _ = make_pair(seed=1)
        ropt = build(resumed, where)
        resumed.load_state_dict(model_state)
        ropt.load_streaming(tmp_path / "ckpt")
        _steps(resumed, ropt, data[SAVE_AT:])
        ropt.close()
        for got, expected in zip(resumed.parameters(), want, strict=True):
            assert torch.equal(got.detach(), expected), where
