"""zero_offload.save_pretrained: trained weights as an HF safetensors checkpoint (one file or
sharded with its index), streamed from where they live, loaded back by transformers'
from_pretrained (in a process without zero-offload, too).

CUDA form (``cuda_form``, docs/gpu.md): the optimizer tests train through test_build_anywhere's
device-aware builders, so under ``--accelerator=cuda`` the weights are streamed to the files
from ``cuda:0``, pinned homes or NVMe; what transformers loads back is on the CPU, and the
trained weights are moved there to compare. Host only: the exports of a plain model (no
optimizer, no accelerator) and the refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file, save_model
from torch import nn
from transformers import GPT2LMHeadModel

from zero_offload import OffloadAdamW, load_pretrained, save_pretrained

from .helpers.models import host_accelerator
from .test_build_anywhere import make_opt, on_meta, saved, train


def trained(path: Path, *, meta: bool, **config: object) -> tuple[GPT2LMHeadModel, OffloadAdamW]:
    model = load_pretrained(on_meta(), path) if meta else GPT2LMHeadModel.from_pretrained(path)
    opt = make_opt(model, **config)
    train(model, opt)
    return model, opt


def assert_same_weights(loaded: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = dict(loaded.named_parameters())
    assert got.keys() == expected.keys()
    for name, value in expected.items():  # got: loaded on the CPU
        assert torch.equal(got[name], value.to(got[name].device)), name


@pytest.mark.cuda_form
@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize(
    "config",
    [{}, {"offload_parameters": True}, {"nvme_dir": "NVME", "host_budget": 0}],
    ids=["resident-weights", "param-offload", "nvme-state"],
)
def test_export_round_trips_through_from_pretrained(
    tmp_path: Path, sharded: bool, config: dict[str, object]
) -> None:
    path = saved(tmp_path, sharded=False)
    config = {k: (str(tmp_path / v) if k == "nvme_dir" else v) for k, v in config.items()}
    # The reference: trained with everything resident (bitwise the same run,
    # test_build_anywhere), its parameters read plainly.
    reference, ref_opt = trained(path, meta=False)
    expected = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_opt.close()
    model, opt = trained(path, meta=True, **config)
    out = tmp_path / "export"
    files = save_pretrained(model, out, optimizer=opt, max_shard_size="20KB" if sharded else "5GB")
    opt.close()
    assert (out / "config.json").is_file()
    index = out / "model.safetensors.index.json"
    if sharded:
        assert len(files) > 1 and index.is_file()
        weight_map = json.loads(index.read_text())["weight_map"]
        assert sorted(set(weight_map.values())) == sorted(f.name for f in files)
        assert "lm_head.weight" not in weight_map  # tied: saved once, as transformers does
    else:
        assert files == [out / "model.safetensors"] and not index.exists()
    assert_same_weights(GPT2LMHeadModel.from_pretrained(out), expected)


@pytest.mark.cuda_form
def test_export_loads_in_a_process_without_zero_offload(tmp_path: Path) -> None:
    path = saved(tmp_path, sharded=False)
    model, opt = trained(path, meta=True)
    out = tmp_path / "export"
    save_pretrained(model, out, optimizer=opt, max_shard_size="20KB")
    weights = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    torch.save(weights, tmp_path / "w.pt")  # loaded beside a CPU model
    opt.close()
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import GPT2LMHeadModel
        model = GPT2LMHeadModel.from_pretrained({str(out)!r})
        expected = torch.load({str(tmp_path / "w.pt")!r})
        got = dict(model.named_parameters())
        assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
        assert all(torch.equal(got[k], v) for k, v in expected.items())
        assert not any(m.startswith("zero_offload") for m in sys.modules), "imported"
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_one_file_export_replaces_a_sharded_one(tmp_path: Path) -> None:
    path = saved(tmp_path, sharded=False)
    model = GPT2LMHeadModel.from_pretrained(path)
    out = tmp_path / "export"
    save_pretrained(model, out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        model.transformer.ln_f.bias.add_(1.0)
    save_pretrained(model, out)
    left = sorted(p.name for p in out.iterdir() if "safetensors" in p.name)
    assert left == ["model.safetensors"]
    loaded = GPT2LMHeadModel.from_pretrained(out)
    assert torch.equal(loaded.transformer.ln_f.bias, model.transformer.ln_f.bias)


def test_bad_arguments_are_refused_by_name(tmp_path: Path) -> None:
    model = GPT2LMHeadModel.from_pretrained(saved(tmp_path, sharded=False))
    with pytest.raises(ValueError, match="max_shard_size"):
        save_pretrained(model, tmp_path / "a", max_shard_size=0)
    with pytest.raises(ValueError, match=r"max_shard_size='5'.*'5GiB'"):  # not 5 bytes a shard
        save_pretrained(model, tmp_path / "a", max_shard_size="5")
    with pytest.raises(TypeError, match="optimizer must be the OffloadAdamW"):
        save_pretrained(model, tmp_path / "a", optimizer=torch.optim.SGD(model.parameters()))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="meta device"):
        save_pretrained(on_meta(), tmp_path / "b")
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


@pytest.mark.cuda_form
@pytest.mark.parametrize("nvme", [False, True], ids=["host-state", "nvme-state"])
def test_master_weights_export_the_fp32_master(tmp_path: Path, nvme: bool) -> None:
    path = saved(tmp_path, sharded=False)
    # The reference master: the same bf16 run with its state in host RAM (state_dict()).
    twin = GPT2LMHeadModel.from_pretrained(path, dtype=torch.bfloat16)
    twin_opt = make_opt(twin)
    train(twin, twin_opt)
    masters = [entry["master"] for _, entry in sorted(twin_opt.state_dict()["state"].items())]
    twin_opt.close()
    model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.bfloat16)
    config: dict[str, object] = {"nvme_dir": str(tmp_path / "nvme"), "host_budget": 0}
    opt = make_opt(model, **(config if nvme else {}))
    train(model, opt)
    out = tmp_path / "export"
    save_pretrained(model, out, optimizer=opt, master_weights=True, max_shard_size="20KB")
    loaded = dict(GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).named_parameters())
    trained = {n: p.detach().cpu() for n, p in model.named_parameters()}  # beside loaded
    for (name, param), master in zip(model.named_parameters(), masters, strict=True):
        assert torch.equal(loaded[name], master.view(param.shape)), name
        assert torch.equal(loaded[name].to(torch.bfloat16), trained[name]), name
    # The master carries what bf16 cannot: the export is not just the weights widened.
    assert any(not torch.equal(loaded[n], trained[n].float()) for n in trained)
    opt.close()
    with pytest.raises(ValueError, match=r"master_weights=True .* optimizer="):
        save_pretrained(model, tmp_path / "c", master_weights=True)


def test_safetensors_of_a_model_state_dict_round_trips_and_save_model_is_the_documented_limit(
    tmp_path: Path,
) -> None:
    """docs/checkpoints.md: without parameter offload each parameter is a view of its
    bucket's flat buffer, so ``safetensors.torch.save_model`` (which wants a tensor covering
    each storage) raises; ``save_file(model.state_dict())`` and ``save_pretrained`` write
    the live weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = OffloadAdamW(model.parameters(), lr=1e-2, accelerator=host_accelerator())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    save_file(model.state_dict(), tmp_path / "weights.safetensors")
    back = load_file(tmp_path / "weights.safetensors")
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    save_pretrained(model, tmp_path / "pretrained", optimizer=opt)
    exported = load_file(tmp_path / "pretrained" / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError, match="None is covering the entire storage"):
        save_model(model, str(tmp_path / "model.safetensors"))
    opt.close()
