"""Which parameters move together: the units of parameter offload (pure bookkeeping).

Note [what a unit is]
~~~~~~~~~~~~~~~~~~~~~
A *unit* is the set of parameters fetched to the device and released together. Each block of
``layers`` (the repeated transformer blocks; by default the ``nn.ModuleList`` holding the most
parameters) is one unit with all its parameters. Every other trainable parameter belongs to a
unit of the module that registers it directly: the token embedding, the position embedding,
the final norm and the head are each a unit of their own, however large (a 128k x 4096
embedding is 0.5B parameters: nothing is resident by accident). A parameter registered on two
modules (tied input embedding and head) makes those modules one unit, fetched for each use,
and so does a block's parameter tied to a module outside the blocks (BERT's prediction head
named in ``layers``, its decoder tied to the word embedding): the block and that module.
A module that registers parameters directly *and* contains another unit's module would need
its weights for the whole of its children's compute; it is refused, with the fix (move the
parameter into a submodule). Frozen parameters and parameters the optimizer does not train
are in no unit and stay where they are.

A parameter shared by two blocks of ``layers`` (``blocks[3][1].weight =
blocks[1][1].weight``) is refused, naming it and both blocks: each block is one unit fetched
for its own forward, and the unit of the other block would compute on a released parameter
(a shared unit inside two blocks would need fetches nested in a block's forward, which the
window does not do). Tie such weights outside the blocks, or pass smaller blocks. Two blocks
tied through a module outside them (that module registering a parameter of each) are
refused the same way, whichever is registered first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["UnitSpec", "default_layers", "find_units"]


@dataclass(frozen=True)
class UnitSpec:
    """One unit: its name, the modules whose forward uses it, and its trainable parameters
    (in registration order)."""

    name: str
    modules: tuple[nn.Module, ...]
    params: tuple[nn.Parameter, ...]
    param_names: tuple[str, ...]  # each parameter's name in the model (its first)

    def name_of(self, param: nn.Parameter) -> str:
        """``param``'s name in the model (``"?"`` if it is not one of this unit's)."""
        for candidate, name in zip(self.params, self.param_names, strict=True):
            if candidate is param:
                return name
        return "?"

    @property
    def tied(self) -> bool:
        """Used by several modules (tied weights): used at distant points of the forward."""
        return len(self.modules) > 1


def default_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of ``model`` holding the most parameter elements."""
    best: tuple[int, nn.ModuleList] | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            numel = sum(p.numel() for p in module.parameters())
            if best is None or numel > best[0]:
                best = (numel, module)
    if best is None:
        raise ValueError(
            f"parameter offload needs the model's repeated blocks, but {type(model).__name__} "
            "has no nn.ModuleList; pass layers=[...] (the blocks, in forward order) to the "
            "optimizer"
        )
    return best[1]


def find_units(
    model: nn.Module,
    layers: Sequence[nn.Module],
    trainable: Sequence[torch.Tensor],
) -> list[UnitSpec]:
    """The units of ``model`` (Note [what a unit is]) covering the parameters in
    ``trainable``, in the order their modules are registered (the order of the blocks for
    ``layers``)."""
    wanted = {id(p) for p in trainable}
    names = {id(module): name or type(model).__name__ for name, module in model.named_modules()}
    param_names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        param_names.setdefault(id(param), name)
    block_ids = {id(block) for block in layers}
    block_order = {id(block): i for i, block in enumerate(layers)}
    for i, block in enumerate(layers):
        if id(block) not in names:
            raise ValueError(
                f"layers[{i}] ({type(block).__name__}) is not a submodule of "
                f"{type(model).__name__}; pass blocks of the model being trained"
            )
    inside_blocks: set[int] = set()
    for block in layers:
        inside_blocks.update(id(m) for m in block.modules())
    # Units in first-registration order; a unit is keyed by its first module's id.
    order: list[int] = []
    modules_of: dict[int, list[nn.Module]] = {}
    params_of: dict[int, list[nn.Parameter]] = {}
    unit_of_param: dict[int, int] = {}
    unit_of_module: dict[int, int] = {}

    def new_unit(module: nn.Module) -> int:
        key = id(module)
        order.append(key)
        modules_of[key], params_of[key] = [module], []
        unit_of_module[key] = key
        return key

    def merge(into: int, gone: int) -> None:
        """Unit ``gone`` joins unit ``into`` (a parameter tied across them)."""
        for other in params_of.pop(gone):
            params_of[into].append(other)
            unit_of_param[id(other)] = into
        for other_module in modules_of.pop(gone):
            modules_of[into].append(other_module)
            unit_of_module[id(other_module)] = into
        order.remove(gone)

    def block_of(key: int) -> nn.Module | None:
        return next((m for m in modules_of[key] if id(m) in block_ids), None)

    for module in model.modules():
        if id(module) in block_ids:
            key = new_unit(module)
            for local, param in module.named_parameters():
                if id(param) not in wanted:
                    continue
                other = unit_of_param.get(id(param))
                if other == key:
                    continue
                if other is not None:
                    block = block_of(other)
                    if block is not None:
                        raise ValueError(
                            f"parameter {param_names[id(param)]!r} {tuple(param.shape)} is "
                            f"shared by two blocks of layers=[...]: {names[id(block)]!r} and "
                            f"{names[id(module)]!r} (as {names[id(module)]}.{local}). Parameter "
                            "offload fetches each block as one unit for its own forward, so "
                            "the second block would compute on a released parameter. Tie the "
                            "weight outside the blocks, or pass blocks that do not share "
                            "parameters as layers=[...]"
                        )
                    # Tied with modules outside the blocks (an embedding and a head block):
                    # one unit, fetched for each use, as tied embedding and head are.
                    merge(other, key)
                    key = other
                    continue
                params_of[key].append(param)
                unit_of_param[id(param)] = key
            continue
        if id(module) in inside_blocks:
            continue
        for param in module._parameters.values():
            if param is None or id(param) not in wanted:
                continue
            by_param = unit_of_param.get(id(param))
            by_module = unit_of_module.get(id(module))
            if by_param is None:
                key = by_module if by_module is not None else new_unit(module)
                params_of[key].append(param)
                unit_of_param[id(param)] = key
            elif by_module is None:  # a tied parameter: this module joins its unit
                modules_of[by_param].append(module)
                unit_of_module[id(module)] = by_param
            elif by_module != by_param:  # tied across two units: merge them
                tied = [block_of(by_param), block_of(by_module)]
                if tied[0] is not None and tied[1] is not None:
                    first, second = (
                        names[id(block)] for block in sorted(tied, key=lambda b: block_order[id(b)])
                    )
                    raise ValueError(
                        f"module {names[id(module)]!r}, outside layers=[...], registers "
                        f"parameters of two of its blocks, {first!r} and {second!r} (here "
                        f"{param_names[id(param)]!r} {tuple(param.shape)}), which ties them. "
                        "Parameter offload fetches each block as one unit for its own "
                        "forward, and two blocks sharing a unit are refused however they are "
                        "tied. Let that module read the blocks' weights without registering "
                        "them (as a decoder reusing its encoder's weights does), or pass "
                        "blocks that share nothing as layers=[...]"
                    )
                merge(by_param, by_module)
    missing = [i for i, p in enumerate(trainable) if id(p) not in unit_of_param]
    if missing:
        param = trainable[missing[0]]
        raise ValueError(
            f"parameter {missing[0]} (shape {tuple(param.shape)}) is trained by the optimizer "
            f"but is not a parameter of {type(model).__name__}; pass model=<the module that "
            "owns every parameter>, or train that parameter with another optimizer"
        )
    units = []
    for key in order:
        if not params_of[key]:
            continue
        for module in modules_of[key]:
            if id(module) in block_ids:
                continue
            for child in module.modules():
                if child is module:
                    continue
                if any(
                    p is not None and id(p) in unit_of_param for p in child._parameters.values()
                ):
                    raise ValueError(
                        f"module {names[id(module)]!r} registers parameters directly and also "
                        f"contains module {names[id(child)]!r}, which has parameters of its "
                        "own; parameter offload fetches a module's own parameters for its "
                        "forward only. Move them into a submodule of their own, or add "
                        f"{names[id(module)]!r} to layers=[...] beside the repeated blocks "
                        "(layers=[*blocks, that module])"
                    )
        units.append(
            UnitSpec(
                name="+".join(names[id(m)] for m in modules_of[key]),
                modules=tuple(modules_of[key]),
                params=tuple(params_of[key]),
                param_names=tuple(param_names[id(p)] for p in params_of[key]),
            )
        )
    return units
