"""Parameter offload (OffloadConfig(offload_parameters=True)) under backwards that are not one
plain pass: a backward building a graph (a gradient penalty) is refused before anything
moves; reentrant activation checkpointing around a module holding several units trains as
torch does; a block of ``layers`` tied to an embedding outside the blocks (BERT's
prediction head) is one unit; a parameter resized after construction is refused, naming the
shapes. Each is compared with torch or with the resident optimizer (fp32: bitwise)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from zero_offload import AcceleratorConfig, HostAccelerator, OffloadAdamW, OffloadConfig

H = 32
LR = 1e-2


def make_opt(model: nn.Module, *, offload: bool, prefetch: int = 1, layers=None) -> OffloadAdamW:
    extra = {"model": model, "layers": layers} if offload else {}
    return OffloadAdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=LR,
        weight_decay=0.01,
        config=OffloadConfig(
            offload_parameters=offload, prefetch_layers=prefetch, bucket_bytes=16384
        ),
        accelerator=HostAccelerator(AcceleratorConfig(device_budget="256MiB")),
        **extra,
    )


def torch_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01
    )


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max(a, key=lambda n: (a[n] - b[n]).abs().max().item())
    assert (a[worst] - b[worst]).abs().max().item() <= tol, worst


# -- a backward that builds a graph --------------------------------------------------------


class Block(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H) if norm else nn.Identity()
        self.fc = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Chain(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(norm) for _ in range(4))
        self.head = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def chain(norm: bool) -> Chain:
    torch.manual_seed(0)
    return Chain(norm)


def inputs(step: int) -> torch.Tensor:
    return torch.randn(8, H, generator=torch.Generator().manual_seed(step)).requires_grad_(True)


def plain_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        model(inputs(step)).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("norm", [False, True], ids=["linear", "layernorm"])
@pytest.mark.parametrize("how", ["autograd_grad", "backward"])
def test_a_backward_with_create_graph_is_refused_before_anything_moves(norm, how):
    """A gradient penalty's graph would keep views of the window (and LayerNorm's weight
    itself) for a later backward that fetches nothing: refused at the first unit gradient,
    naming create_graph and the resident optimizer; the optimizer then trains on, bitwise
    like the resident one trained without the refused step."""
    model = chain(norm)
    opt = make_opt(model, offload=True)
    plain_steps(model, opt, range(1))
    x = inputs(1)
    loss = model(x)
    expected = "create_graph=True.*offload_parameters=False"
    with pytest.raises(RuntimeError, match=re.compile(expected, re.S)):
        if how == "autograd_grad":
            torch.autograd.grad(loss, x, create_graph=True)
        else:
            loss.backward(create_graph=True)
    opt.zero_grad()
    plain_steps(model, opt, range(2, 4))
    got = weights(model)
    opt.close()

    reference = chain(norm)
    ref_opt = make_opt(reference, offload=False)
    plain_steps(reference, ref_opt, range(1))
    plain_steps(reference, ref_opt, range(2, 4))
    ref = weights(reference)
    ref_opt.close()
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_the_resident_optimizer_trains_a_gradient_penalty_like_torch():
    """What the refusal above advises: offload_parameters=False differentiates twice."""

    def run(opt_of) -> dict[str, torch.Tensor]:
        model = chain(True)
        opt = opt_of(model)
        for step in range(2):
            x = inputs(step)
            loss = model(x)
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            (loss + gx.pow(2).sum()).backward()
            opt.step()
            opt.zero_grad()
        out = weights(model)
        if isinstance(opt, OffloadAdamW):
            opt.close()
        return out

    assert_close(run(lambda m: make_opt(m, offload=False)), run(torch_opt), 1e-6)


# -- reentrant checkpointing around several units ---------------------------------------------


class Checkpointed(nn.Module):
    """``pre`` (not in ``layers``: each Linear and LayerNorm is a unit) checkpointed whole,
    optionally with a checkpoint nested inside it, then four blocks (the layers)."""

    def __init__(self, *, reentrant: bool, nested: bool) -> None:
        super().__init__()
        self.reentrant, self.nested = reentrant, nested
        self.pre = nn.Sequential(
            nn.LayerNorm(H), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H), nn.LayerNorm(H)
        )
        self.inner = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(4))

    def _region(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        if self.nested:
            return torch_checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return self.inner(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch_checkpoint.checkpoint(self._region, x, use_reentrant=self.reentrant)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


# A reentrant checkpoint nested in another runs first under no_grad: torch warns, as without us.
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("nested", [False, True], ids=["one", "nested"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "nonreentrant"])
@pytest.mark.parametrize("prefetch", [0, 1, 8])
def test_checkpoint_around_several_units_trains_like_torch(reentrant, nested, prefetch):
    """The recompute touches seven units (more than the ring's slots for prefetch 0 and 1):
    each is fetched back before the checkpoint's backward uses it (Note [a recompute moves
    nothing]); bitwise like the resident optimizer, and like torch's AdamW."""

    def run(opt_of) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = Checkpointed(reentrant=reentrant, nested=nested)
        opt = opt_of(model)
        losses = []
        for step in range(3):
            loss = model(inputs(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out = weights(model)
        if isinstance(opt, OffloadAdamW):
            opt.close()
        return losses, out

    losses, got = run(lambda m: make_opt(m, offload=True, prefetch=prefetch, layers=m.blocks))
    resident_losses, resident = run(lambda m: make_opt(m, offload=False))
    torch_losses, reference = run(torch_opt)
    assert losses == resident_losses
    assert all(torch.equal(got[n], resident[n]) for n in resident)
    assert losses == pytest.approx(torch_losses, abs=1e-6)
    assert_close(got, reference, 1e-6)


def test_hf_t5_reentrant_gradient_checkpointing_trains_like_torch():
    """T5's encoder blocks are not ``layers`` (the decoder's are), so each encoder block's
    reentrant checkpoint recomputes a dozen units."""
    transformers = pytest.importorskip("transformers")

    def run(opt_of) -> list[float]:
        torch.manual_seed(0)
        config = transformers.T5Config(
            d_model=H, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            vocab_size=64, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1,
        )  # fmt: skip
        model = transformers.T5ForConditionalGeneration(config)
        model.config.use_cache = False
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        opt = opt_of(model)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            ids = torch.randint(2, 64, (2, 12), generator=gen)
            loss = model(input_ids=ids, labels=ids.flip(1)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if isinstance(opt, OffloadAdamW):
            opt.close()
        return losses

    assert run(lambda m: make_opt(m, offload=True)) == pytest.approx(run(torch_opt), abs=1e-5)


# -- a block tied to a module outside the blocks --------------------------------------------


class TiedHead(nn.Module):
    """An embedding, blocks, and a head block whose decoder shares the embedding's weight
    (BERT's ``cls.predictions``: a transform, the tied decoder, a bias of its own)."""

    def __init__(self, tie_twice: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, H)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(H, H), nn.LayerNorm(H), nn.Linear(H, 64))
        self.head[2].weight = self.embed.weight
        if tie_twice:  # refused at construction: never run
            self.blocks[1][0].weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def test_a_block_tied_to_an_embedding_outside_the_blocks_is_one_unit_like_torch():
    """layers=[*blocks, head] with head's decoder tied to the embedding: one unit (embedding
    and head block), fetched for each use, as tied embedding and head are by default."""

    def run(opt_of) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = TiedHead()
        opt = opt_of(model)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            model(torch.randint(0, 64, (2, 8), generator=gen)).backward()
            opt.step()
            opt.zero_grad()
        out = weights(model)
        if isinstance(opt, OffloadAdamW):
            opt.close()
        return out

    got = run(lambda m: make_opt(m, offload=True, layers=[*m.blocks, m.head]))
    assert_close(got, run(torch_opt), 1e-6)


def test_the_units_of_a_block_tied_outside_the_blocks():
    from zero_offload.params.units import find_units

    model = TiedHead()
    specs = find_units(model, [*model.blocks, model.head], list(model.parameters()))
    names = [spec.name for spec in specs]
    assert names == ["embed+head", "blocks.0", "blocks.1", "blocks.2"]
    assert specs[0].tied
    assert {id(p) for p in specs[0].params} == {id(p) for p in [model.embed.weight]} | {
        id(p) for p in model.head.parameters()
    }


def test_a_parameter_shared_by_two_blocks_names_the_two_blocks():
    """Not the embedding outside them, which the old message called a block."""
    model = TiedHead(tie_twice=True)
    with pytest.raises(ValueError) as info:
        make_opt(model, offload=True, layers=[*model.blocks, model.head])
    message = str(info.value)
    assert "'embed.weight'" in message
    assert "two blocks of layers=[...]: 'blocks.1' and 'head'" in message


class TiedThroughOutside(nn.Module):
    """Blocks 0 and 2 both used by a module after them: ``registered`` makes it register
    their weights (which ties the two blocks, refused); otherwise it reads them through the
    blocks, as the refusal advises."""

    def __init__(self, registered: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(H, H) for _ in range(3))
        self.mix = nn.Module()
        if registered:
            self.mix.a, self.mix.b = self.blocks[0].weight, self.blocks[2].weight
        self.head = nn.Linear(H, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        x = x @ self.blocks[0].weight.t() + x @ self.blocks[2].weight.t()
        return self.head(x).square().mean()


def test_two_blocks_tied_through_a_module_outside_them_are_refused():
    """The module registering their weights comes after the blocks: the two blocks' units
    were merged into one, silently; tied the other way round (the outside module first,
    ``TiedHead(tie_twice=True)``) they were refused."""
    model = TiedThroughOutside(registered=True)
    with pytest.raises(ValueError) as info:
        make_opt(model, offload=True)
    message = str(info.value)
    assert "module 'mix', outside layers=[...]" in message
    assert "'blocks.0' and 'blocks.2'" in message
    assert "without registering" in message


def test_a_module_reading_two_blocks_weights_trains_like_torch():
    def run(opt_of) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = TiedThroughOutside(registered=False)
        opt = opt_of(model)
        for step in range(3):
            model(inputs(step)).backward()
            opt.step()
            opt.zero_grad()
        out = weights(model)
        if isinstance(opt, OffloadAdamW):
            opt.close()
        return out

    assert_close(run(lambda m: make_opt(m, offload=True)), run(torch_opt), 1e-6)


def test_hf_bert_masked_lm_with_its_prediction_head_in_layers_trains_like_torch():
    """The default refusal advises naming cls.predictions in layers; doing so trains."""
    transformers = pytest.importorskip("transformers")

    def run(offload: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        config = transformers.BertConfig(
            hidden_size=H, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            vocab_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0,
        )  # fmt: skip
        model = transformers.BertForMaskedLM(config)
        model.train()
        if offload:
            with pytest.raises(ValueError, match=r"add 'cls\.predictions' to layers=\[\.\.\.\]"):
                make_opt(model, offload=True)
            layers = [*model.bert.encoder.layer, model.cls.predictions]
            opt = make_opt(model, offload=True, layers=layers)
        else:
            opt = torch_opt(model)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            ids = torch.randint(2, 64, (2, 12), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out = weights(model)
        if offload:
            opt.close()
        return losses, out

    losses, got = run(True)
    torch_losses, reference = run(False)
    assert losses == pytest.approx(torch_losses, abs=1e-5)
    assert_close(got, reference, 1e-5)


# -- a parameter resized after construction ---------------------------------------------------


def test_a_parameter_resized_after_construction_is_refused_naming_the_shapes():
    """HF's resize_token_embeddings replaces the embedding's .data by one of another shape:
    the refusal says so (not model.half(), and not that load_state_dict carries it over)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    opt = make_opt(model, offload=True)
    ids = torch.randint(2, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    model.resize_token_embeddings(80)
    with pytest.raises(ValueError) as info:
        model(input_ids=ids, labels=ids)
    message = str(info.value)
    assert "'model.embed_tokens.weight'" in message
    assert "(80, 32)" in message and "(64, 32)" in message
    assert "resize_token_embeddings" in message and "before building the optimizer" in message
    assert "half()" not in message and "load_state_dict carries" not in message
    opt.close()
