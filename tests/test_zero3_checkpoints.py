"""Checkpoints under ZeRO-3 (parameter offload on several gloo ranks, Note [a sharded unit] in
params/sharded_fetch.py): a consolidated checkpoint saved there loads on one process (with
and without parameter offload), on stage 2 and on 3 ranks, and the reverse; the streamed
checkpoint resumes on the same world size and on another; the HF export
from sharded homes loads in ``transformers`` and through ``load_pretrained`` on meta.

Every run trains the same tiny GPT on the same global batches, saves at step ``SAVED_AT``
and trains to ``STEPS``; a resume starts from zeroed weights, loads the model's state dict
and the optimizer's checkpoint, and trains the same remaining steps (tests/helpers/zero3_ckpt.py).

Tolerances (tests/test_zero3.py's module docstring): ZeRO-3 and stage 2 on the same two
ranks compute bitwise the same steps, so a resume on two ranks, either stage, ends bitwise
equal to the uninterrupted 2-rank run. Any other world size reduces the gradients in
another order: its end is within ``FP32_ATOL`` of the uninterrupted one-process run. What a
load restores (the weights at the save) is bitwise the saved weights everywhere.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel

from .helpers.zero3_ckpt import one_process, one_process_resumes, run

FP32_ATOL = 1e-5  # tests/test_zero3.py


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process, then 2 ranks (loading its checkpoint), then 3 ranks and one process
    again (loading the 2-rank ones): one spawn per world size."""
    out = tmp_path_factory.mktemp("zero3_ckpt")
    one = one_process(out)
    two = run(2, "two", out)
    three = run(3, "three", out)
    resumed = one_process_resumes(out)
    return {"one": one, "two": two, "three": three, "resumed": resumed, "out": out}


def test_same_world_and_stage_resumes_bitwise(worlds: dict) -> None:
    """Saved under ZeRO-3 on 2 ranks: the consolidated and the streamed checkpoint both
    resume bitwise (fp32, and bf16 with the optimizer loaded before the model); so does
    stage 2 from the ZeRO-3 checkpoint and ZeRO-3 from stage 2's."""
    for result in worlds["two"]:
        s3 = result["s3"]
        assert _max_diff(s3["final"], result["s2"]["final"]) == 0.0  # the stages agree
        for key in ("s3<-s3", "s2<-s3", "s3<-s2"):
            resumed = result[key]
            assert _max_diff(resumed["loaded"], s3["at_save"]) == 0.0, key  # the homes
            assert _max_diff(resumed["final"], s3["final"]) == 0.0, key
        assert _max_diff(result["s3<-stream"]["final"], s3["final"]) == 0.0
        b3 = result["b3"]  # bf16, the optimizer loaded before the model
        assert _max_diff(result["b3<-b3"]["loaded"], b3["at_save"]) == 0.0
        for key in ("b3<-b3", "b3<-stream"):
            assert _max_diff(result[key]["final"], b3["final"]) == 0.0, key


def test_other_world_sizes_resume_within_tolerance(worlds: dict) -> None:
    """One process from ZeRO-3 (no offload, parameter offload), ZeRO-3 on 2 ranks from one
    process, ZeRO-3 on 3 ranks from ZeRO-3 and stage 2 on 2 ranks and from one process."""
    one = worlds["one"]["one"]
    two = worlds["two"][0]
    assert _max_diff(two["s3"]["final"], one["final"]) < FP32_ATOL  # the reference agrees
    cases = [(worlds["resumed"][k], two["s3"]) for k in ("one<-s3", "one-offload<-s3")]
    cases += [(result["s3<-one"], one) for result in worlds["two"]]
    for result in worlds["three"]:
        cases += [(result["s3<-s3"], two["s3"]), (result["s3<-s2"], two["s2"])]
        cases += [(result["s3<-one"], one)]
    for resumed, saved in cases:
        assert _max_diff(resumed["loaded"], saved["at_save"]) == 0.0
        assert _max_diff(resumed["final"], one["final"]) < FP32_ATOL
        assert _max_diff(resumed["final"], saved["at_save"]) > 0.0  # it trained on


def test_a_streamed_checkpoint_resumes_on_another_world_size(worlds: dict) -> None:
    """Streamed under ZeRO-3 on 2 ranks, loaded on 3 (Note [a streamed checkpoint on another
    world size] in optim/checkpoint/reshard.py): bitwise the resume from the consolidated
    checkpoint of the same save, so within the other world sizes' tolerance."""
    one = worlds["one"]["one"]
    for rank, result in enumerate(worlds["three"]):
        resumed = result["s3<-stream"]
        assert "error" not in resumed, (rank, resumed)
        assert _max_diff(resumed["final"], result["s3<-s3"]["final"]) == 0.0
        assert _max_diff(resumed["final"], one["final"]) < FP32_ATOL


def test_the_export_from_sharded_homes_loads_in_transformers_and_on_meta(worlds: dict) -> None:
    """Every rank calls save_pretrained, rank 0 writes HF shards and their index; they load
    in transformers alone, equal to the trained weights; load_pretrained on meta under
    ZeRO-3 then trains bitwise like a normal load."""
    ranks = [result["export"] for result in worlds["two"]]
    assert ranks[0]["files"] == ranks[1]["files"] and len(ranks[0]["files"]) > 1
    trained = ranks[0]["trained"]
    for other in ranks[1:]:
        assert _max_diff(other["trained"], trained) == 0.0
    # A second export failing on rank 0 after its first shard (a full disk): every rank
    # raises it, and they stay in step (each gathered the trained weights after it).
    assert ranks[0]["failure"].startswith("OSError: [Errno 28]")
    assert "failed on rank 0" in ranks[1]["failure"] and "Errno 28" in ranks[1]["failure"]
    for result in ranks:
        assert _max_diff(result["runs"]["meta"], result["runs"]["normal"]) == 0.0
        assert _max_diff(result["runs"]["meta"], trained) > 0.0  # it trained on


def test_the_export_is_what_transformers_reads(worlds: dict) -> None:
    out = worlds["out"]
    trained = worlds["two"][0]["export"]["trained"]
    model = GPT2LMHeadModel.from_pretrained(out / "export")  # the failed export left it
    got = {name: p.detach() for name, p in model.named_parameters()}
    assert _max_diff(got, trained) == 0.0
    assert (out / "export" / "model.safetensors.index.json").is_file()
    # tied lm_head saved once, as transformers does
    keys = set().union(*(load_file(f).keys() for f in (out / "export").glob("*.safetensors")))
    assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys
