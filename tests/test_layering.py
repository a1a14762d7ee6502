"""Arrows point down: the package's imports, read from the source, form no cycle and never go
from a lower layer to a higher one.

The layers, lowest first (a module may import its own layer's modules and any lower layer's):

0. ``errors``, ``config``, ``tracing``, ``fileio``, ``progress``, ``post_import``,
   ``hook_errors``, ``error_marks``, ``caller_warning``, ``activation_sizes``: plain types,
   settings, the phase hook, atomic file writes, progress bars, hooks on import, errors kept
   from autograd's hooks, which errors already reached a caller, the line a warning names,
   the activation pools' sizes.
1. ``accelerator``, ``kernels``, ``partition``, ``collectives``, ``thread_budget``: devices
   and streams, numba kernels, which rank owns which slice, stateless collectives, how many
   threads each team may use.
2. ``memory``, ``sysinfo``: pools, the tiered manager, storage; what the machine offers.
3. ``views``, ``profiling``: what optim and params share (parameter views, families);
   the traffic profiler, which listens on the memory managers only.
4. ``params``, ``activations``: parameter offload, activation offload.
5. ``optim``: the optimizer (it reaches ``params`` through one seam module only).
6. ``checkpoint_io``, ``estimate``: consolidated checkpoints; the memory estimator.
7. ``demo``, ``integrations``: the demo; Trainer, accelerate, Lightning, TRL.
8. ``cli``, ``__main__``, and the package's ``__init__``: the command and the public names.

Two rules beyond the order: only ``optim`` imports ``kernels``; nothing imports
``integrations`` but the package's ``__init__`` (whose exports there are lazy).

Inside ``optim`` the same rule holds between its parts (``OPTIM_FLOORS``, lowest first):

0. ``access``, ``unit_pools``, ``ranks``: who reads pinned memory when, the per-unit host
   pools, what the optimizer asks of its ranks.
1. ``grads``, ``publish``, ``shadow``: a bucket's gradients from hook to host; the weight
   copies of an update, and the device shadow a delayed update lands in.
2. ``rule``: the optimizer's rule (what it keeps, how it steps, its hyper-parameters) and
   the host tile loop every rule shares.
3. ``state``: where a bucket's state lives (device, host RAM, NVMe) and its plan.
4. ``flat_bucket``, ``segment_plan``, ``bucket_build``, ``unit_build``: one bucket, a
   gradient path and a state store composed; the plan both construction routes share
   (placement, NVMe, the device pool); one bucket built as its placement says; parameter
   offload's buckets built unit by unit.
5. ``checks``, ``shared_memory``, ``rank_agreement``, ``constructor_checks``, ``router``,
   ``reports``: checks on the caller's input (parameters that share memory among them, the
   constructor's arguments), and that every rank builds alike, or fails together; the backward's routing of each gradient to its bucket;
   ``opt.state`` and the placement report.
6. ``update``, ``scaled_backward``: when a planned step runs and how its weights reach the
   device; which backwards carry the loss scale, and the router that refuses the others.
7. ``checkpoint``: state dicts and streaming checkpoints, and the optimizer's methods for them
   (torch's state-dict hooks around them).
8. ``lifetime``: which optimizer owns which parameter, and closing.
9. ``construction``, ``torch_clipping``, ``framework_clipping``, ``torch_grad_scaler``,
   ``torch_zero_grad``, ``torch_hook_order``, ``kept_zero_grads``, ``clipping``,
   ``backward_methods``: building the buckets; the clipping guards, torch's ``GradScaler``'s,
   torch's ``zero_grad``'s and hook order, and the guard of torch's kept zero gradients;
   the optimizer's own clipping, and several optimizers' together; its backward and
   announced step.
10. ``offload_optimizer``: the public optimizer's machinery, for any rule.
11. ``offload_adamw``, ``offload_lion``, ``offload_adagrad``, ``offload_adafactor``,
    ``offload_muon`` and ``optim``'s ``__init__``: the rules' facades (torch-style constructors), the public
    names.

Cycles are looked for among every import: module level, under ``if TYPE_CHECKING:``, and
deferred into a function (a cycle there is a cycle in the design even if Python never runs
it, or runs it late). The layer rules cover every import too: hiding an upward arrow in a
function does not make it point down.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "zero_offload"

LAYERS: dict[str, int] = {
    "errors": 0,
    "config": 0,
    "settings": 0,
    "tracing": 0,
    "fileio": 0,
    "progress": 0,
    "post_import": 0,
    "hook_errors": 0,
    "error_marks": 0,
    "caller_warning": 0,
    "activation_sizes": 0,
    "accelerator": 1,
    "kernels": 1,
    "partition": 1,
    "collectives": 1,
    "thread_budget": 1,
    "memory": 2,
    "sysinfo": 2,
    "views": 3,
    "weights": 3,
    "profiling": 3,
    "params": 4,
    "activations": 4,
    "optim": 5,
    "checkpoint_io": 6,
    "estimate": 6,
    "hf_export": 6,
    "demo": 7,
    "integrations": 7,
    "cli": 8,
    "__main__": 8,
    "": 8,  # zero_offload/__init__.py
}
ONLY_IMPORTED_BY = {"kernels": {"optim"}, "integrations": {""}}
OPTIM_FLOORS: dict[str, int] = {
    "access": 0,
    "unit_pools": 0,
    "ranks": 0,
    "grads": 1,
    "publish": 1,
    "shadow": 1,
    "rule": 2,
    "state": 3,
    "flat_bucket": 4,
    "segment_plan": 4,
    "bucket_build": 4,
    "unit_build": 4,
    "checks": 5,
    "rank_agreement": 5,
    "rank_starts": 5,
    "constructor_checks": 5,
    "shared_memory": 5,
    "router": 5,
    "reports": 5,
    "update": 6,
    "scaled_backward": 6,
    "checkpoint": 7,
    "lifetime": 8,
    "construction": 9,
    "torch_clipping": 9,
    "framework_clipping": 9,
    "torch_grad_scaler": 9,
    "torch_zero_grad": 9,
    "torch_hook_order": 9,
    "kept_zero_grads": 9,
    "clipping": 9,
    "backward_methods": 9,
    "offload_optimizer": 10,
    "offload_adamw": 11,
    "offload_lion": 11,
    "offload_adagrad": 11,
    "offload_adafactor": 11,
    "offload_muon": 11,
    "": 11,  # zero_offload/optim/__init__.py
}
# The one optim module through which optim reaches params (None: optim imports no params).
OPTIM_PARAMS_SEAM_MAX = 1


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: pathlib.Path, modules: set[str]) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every zero_offload import in the file."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, bool]] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == PACKAGE:
                        found.append((alias.name, top))
            elif isinstance(child, ast.ImportFrom):
                target = resolve(child)
                if target.split(".")[0] != PACKAGE:
                    continue
                for alias in child.names:  # `from pkg import submodule` imports the submodule
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in modules else target, top))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                visit(child, top)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, False)
            else:
                visit(child, top)

    visit(tree, True)
    return found


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    modules = _modules()
    names = set(modules)
    top_level: dict[str, set[str]] = defaultdict(set)
    every: list[tuple[str, str]] = []
    for name, path in modules.items():
        for target, top in _imports(name, path, names):
            if target not in names or target == name:
                continue
            every.append((name, target))
            if top:
                top_level[name].add(target)
    return top_level, every


def test_every_area_has_a_layer() -> None:
    missing = sorted({_area(m) for m in _modules()} - set(LAYERS))
    assert not missing, f"give these parts of zero_offload a layer in LAYERS: {missing}"


def test_no_import_points_up() -> None:
    _, every = _graph()
    wrong = sorted(
        f"{source} -> {target} (layer {LAYERS[_area(source)]} -> {LAYERS[_area(target)]})"
        for source, target in every
        if _area(source) != _area(target)
        and LAYERS.get(_area(source), -1) < LAYERS.get(_area(target), -1)
    )
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(wrong)


def _optim_part(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] != "optim":
        return None
    return parts[2] if len(parts) > 2 else ""


def test_every_optim_part_has_a_floor() -> None:
    missing = sorted(
        {p for m in _modules() if (p := _optim_part(m)) is not None} - set(OPTIM_FLOORS)
    )
    assert not missing, f"give these parts of zero_offload.optim a floor in OPTIM_FLOORS: {missing}"


def test_no_import_inside_optim_points_up() -> None:
    _, every = _graph()
    wrong = sorted(
        f"{source} -> {target} (floor {OPTIM_FLOORS[a]} -> {OPTIM_FLOORS[b]})"
        for source, target in every
        if (a := _optim_part(source)) is not None
        and (b := _optim_part(target)) is not None
        and a != b
        and OPTIM_FLOORS[a] < OPTIM_FLOORS[b]
    )
    assert not wrong, "imports from a lower floor of optim to a higher one:\n" + "\n".join(wrong)


def test_restricted_packages_have_their_only_importers() -> None:
    _, every = _graph()
    wrong = sorted(
        f"{source} -> {target}"
        for source, target in every
        if _area(target) in ONLY_IMPORTED_BY
        and _area(source) != _area(target)
        and _area(source) not in ONLY_IMPORTED_BY[_area(target)]
    )
    assert not wrong, "\n".join(wrong)


def test_optim_reaches_params_through_one_seam() -> None:
    _, every = _graph()
    seams = sorted({s for s, t in every if _area(s) == "optim" and _area(t) == "params"})
    assert len(seams) <= OPTIM_PARAMS_SEAM_MAX, f"optim modules importing params: {seams}"


def test_no_import_cycle() -> None:
    _, every = _graph()
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in every:  # module level, TYPE_CHECKING and in functions alike
        graph[source].add(target)
    # Tarjan's strongly connected components; any component of more than one module (or a
    # module importing itself) is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(_modules()):
        if node not in index:
            connect(node)
    # A package's __init__ that re-exports its submodules, imported by those submodules
    # through the package name, is the same import Python resolves in order; it still
    # counts as a cycle here: import the submodule, not the package, from inside it.
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_is_over_600_lines() -> None:
    """One managed thing per module: a file past 600 lines is answering two questions."""
    long = sorted(
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > 600
    )
    assert not long, "split these modules:\n" + "\n".join(long)
