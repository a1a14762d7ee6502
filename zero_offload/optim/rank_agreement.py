"""What every rank must build alike, compared across the optimizer's ranks before anything is
allocated: Note [the ranks build alike].

Note [the ranks build alike]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Collectives match by their order and size only. Two ranks that built their optimizers
differently issue the reduce-scatters and all-gathers of different buckets: where the sizes
differ, gloo aborts the process ("Received data size doesn't match expected size") and
NCCL hangs; where they happen to agree, the ranks average gradients of different
parameters, or clip and step their shards by different rules, and the weights drift apart
with no error at all. So each build (the constructor's param groups; each
``add_param_group``, which every rank must call alike too) compares across the ranks, on
the optimizer's own process group and before anything is allocated (``describe_build``):

- the optimizer's class and its rule (what the state is and how each shard steps);
- the ``OffloadConfig`` fields in ``MUST_AGREE``: ``bucket_bytes`` and ``offload_fraction``
  shape the buckets; ``max_grad_norm``, ``skip_nonfinite``, ``moments_dtype`` and
  ``loss_scaler`` decide what every rank's step computes (one rank clipping or skipping
  alone, or scaling its loss by another factor, is a wrong result on all of them);
  ``overlap_step``, ``offload_parameters`` and ``partition_parameters`` decide which
  collectives run when; with a parameter window, ``prefetch_layers`` decides which units a
  rank gathers again (Note [a sharded unit] in ``params/sharded_fetch.py``);
- the number of param groups and, for each group built, its hyper-parameters (every key
  but ``params`` and ``param_names``) and each parameter's shape, dtype and whether it
  trains, in order;
- with a parameter window (``offload_parameters``, or ``partition_parameters`` on several
  ranks): the blocks passed as ``layers`` (how many) and every parameter of ``model``,
  frozen ones included (its units are gathered whole).

What may differ, rank by rank: how long a rank waits (``collective_timeout``); where it keeps
its state (``nvme_dir``, ``host_budget``); how its CPU update is tiled (``tile_elements``:
tiles split a shard's update, not the buckets); where its gradients land and add up
(``grad_staging``, ``grad_staging_buffers``, ``grad_accumulation``) and where a delayed
update's weights wait (``overlap_shadow``, ``overlap_landing``): the sums and weights are
bitwise the same either way, and their ``"auto"`` already chooses per rank by each rank's
device budget; ``speculative_step`` and ``speculation_bytes`` (no step runs during backward
with several ranks); ``auto_headroom`` (only for ``offload_fraction="auto"``, which several
ranks refuse); and the parameters' names (labels only: shown in the error, never compared).

Only the values at the build are compared: a scheduler may change ``lr`` later, and does so
alike on every rank.

The cost: one all-gather of a 32-byte digest of the description per build. Where the digests
differ, a second all-gather carries every rank's description (JSON), and every rank raises
the same ``ValueError`` naming the first entry that differs, rank 0's value and the first
rank's with another. Every rank raising alike keeps them in step: the constructor releases
what it made (its process group included), ``add_param_group`` drops the group. Both
collectives keep ``collective_timeout`` (Note [collective deadlines] in ``collectives.py``):
a rank that never builds makes the others raise ``CollectiveError`` naming it instead of
hanging.

Note [a rank that fails alone]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A check or an allocation can fail on one rank only: its parameters sit on another device,
its ``nvme_dir`` cannot be written, its host budget is smaller. Raising there alone would
leave the other ranks in their next collective until ``collective_timeout`` (600 s by
default), to name a rank that "did not report", not why. So every failure a build can meet
takes part in the collective the other ranks are in at that point, and every rank raises at
once:

- the constructor's own checks (the rule's hyper-parameters, the config against the ranks,
  ``model=``/``layers=``) run right after the optimizer's process group exists, and take
  part in a first comparison (``agree_on_arguments``: the optimizer, its rule and the
  ``MUST_AGREE`` fields, so ranks that disagree on ``offload_parameters`` never reach the
  group its window makes), before any other group is made;
- the checks of the parameters (torch's and ours, in the constructor's ``param_groups`` and
  in ``add_param_group``) take part in the comparison above: a rank whose checks refused
  sends its refusal instead of its description (``agree_on_build(refused=...)``);
- the allocations and copies after the comparison end in ``share_outcome`` again, just
  before the segment joins the optimizer, so that a rank that failed half-way and one that
  built undo alike; so does moving the originals off the device, before the broadcast of
  rank 0's weights (``BuiltTogether.so_far``, Note [every rank starts from rank 0's
  weights] in ``rank_starts.py``), which a rank that failed there would never reach.

The rank that failed raises its own exception, unchanged; the others raise naming it and
its error (``ValueError`` for refused checks, ``CollectiveError`` for a failed build) and
release what they made, as after any failed construction or ``add_param_group``. The cost:
the constructor's first comparison (one all-gather of a digest) and two all-gathers of one
byte (before the broadcast of rank 0's weights, and after the allocations), per build; one
more, of the descriptions or the errors' text, only when something differed or failed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..collectives import Comm, all_gather_bytes
from ..config import OffloadConfig
from ..errors import CollectiveError
from .rule.base import OptimizerRule

__all__ = [
    "MUST_AGREE",
    "BuiltTogether",
    "Entry",
    "agree_on_arguments",
    "agree_on_build",
    "describe_build",
    "share_outcome",
]

#: The ``OffloadConfig`` fields every rank must set alike (Note [the ranks build alike]).
MUST_AGREE = (
    "bucket_bytes",
    "offload_fraction",
    "max_grad_norm",
    "skip_nonfinite",
    "moments_dtype",
    "loss_scaler",
    "overlap_step",
    "offload_parameters",
    "partition_parameters",
)

#: What a rank that never reaches the comparison has probably done.
_ADVICE = (
    "Every rank must construct the optimizer (and call add_param_group) alike, at the same "
    "point of the program; a rank whose construction raised before it says why in its log."
)

_DIGEST_BYTES = 32  # sha256

#: The first entry of every description: whether this rank's checks of the parameters
#: passed; a rank whose checks refused sends this entry alone, its value the refusal (Note
#: [a rank that fails alone]).
_CHECKS = "this rank's checks"
_PASSED = "passed"


def _refusal(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Entry:
    """One thing every rank must build alike."""

    key: str  # what it is, as the error names it ("OffloadConfig.bucket_bytes")
    value: str  # its value on this rank, canonical text (compared)
    label: str = ""  # shown beside the value, never compared (a parameter's name)


# An object's address differs from process to process: never part of a compared value.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _plain(value: Any) -> str:
    """``value`` as text that is equal on two ranks exactly when the values are."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.detach().cpu().tolist()!r}, {value.dtype})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_plain(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_plain(v)}" for k, v in sorted(value.items())) + "}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return _ADDRESS.sub("", repr(value))


def _param(param: torch.Tensor) -> str:
    trains = "trainable" if param.requires_grad else "frozen"
    return f"shape {tuple(param.shape)}, {param.dtype}, {trains}"


def _config_entries(name: str, rule: OptimizerRule, config: OffloadConfig) -> list[Entry]:
    """The optimizer's class (``name``), its rule and the config fields every rank must set
    alike."""
    return [
        Entry("the optimizer class", name),
        Entry("the rule", f"{rule.name} ({type(rule).__qualname__})"),
        *(Entry(f"OffloadConfig.{f}", _plain(getattr(config, f))) for f in MUST_AGREE),
    ]


def describe_build(
    owner: torch.optim.Optimizer,
    group_indices: Sequence[int],
    *,
    rule: OptimizerRule,
    config: OffloadConfig,
    windows: tuple[Any, Any] | None,
) -> list[Entry]:
    """What this rank builds for ``owner``'s groups ``group_indices``, in a fixed order;
    ``windows``: ``(model, layers)`` with a parameter window, else None."""
    entries = _config_entries(type(owner).__qualname__, rule, config)
    if windows is not None:
        model, layers = windows
        entries.append(Entry("OffloadConfig.prefetch_layers", _plain(config.prefetch_layers)))
        entries.append(Entry("layers", "default" if layers is None else f"{len(layers)} blocks"))
        named = list(model.named_parameters())
        entries.append(Entry("the model's parameter count", str(len(named))))
        entries += [
            Entry(f"the model's parameter {i}", _param(p), repr(n))
            for i, (n, p) in enumerate(named)
        ]
    entries.append(Entry("the number of param groups", str(len(owner.param_groups))))
    for g in group_indices:
        group = owner.param_groups[g]
        entries += [
            Entry(f"param group {g}'s {key}", _plain(value))
            for key, value in sorted(group.items())
            if key not in ("params", "param_names")
        ]
        params, names = group["params"], group.get("param_names")
        entries.append(Entry(f"param group {g}'s parameter count", str(len(params))))
        entries += [
            Entry(
                f"param group {g}'s parameter {i}",
                _param(p),
                repr(names[i]) if names is not None else "",
            )
            for i, p in enumerate(params)
        ]
    return entries


def agree_on_arguments(
    name: str,
    *,
    rule: OptimizerRule,
    config: OffloadConfig,
    comm: Comm | None,
    refused: Exception | None = None,
) -> None:
    """The constructor's part of the comparison, before any group beyond the optimizer's
    own is made (``ShardedParamRanks`` makes one where ``offload_parameters`` or
    ``partition_parameters`` say so): the optimizer ``name``, its rule and the config's
    ``MUST_AGREE`` fields; ``refused``: this rank's constructor checks refused with that
    exception. Raises as ``agree_on_build`` does (Notes [the ranks build alike], [a rank
    that fails alone]). A collective: every rank calls it in its constructor."""
    entries = None if refused is not None else _config_entries(name, rule, config)
    _agree(
        entries,
        refused,
        comm=comm,
        owner=name,
        checks="the constructor's checks",
        what="the optimizer, rule and config each rank builds",
    )


def agree_on_build(
    owner: torch.optim.Optimizer,
    group_indices: Sequence[int],
    *,
    rule: OptimizerRule,
    config: OffloadConfig,
    windows: tuple[Any, Any] | None,
    comm: Comm | None,
    refused: Exception | None = None,
) -> None:
    """Raise ``ValueError`` on every rank alike unless every rank of ``comm`` builds what
    this one does (``describe_build``); nothing with one rank. ``refused``: this rank's
    checks of the parameters refused them with that exception, which this rank raises
    while the others raise naming it (Note [a rank that fails alone]). A collective: every
    rank of the optimizer calls it at each build. See Note [the ranks build alike]."""
    entries = None
    if refused is None and comm is not None:
        entries = describe_build(owner, group_indices, rule=rule, config=config, windows=windows)
    _agree(
        entries,
        refused,
        comm=comm,
        owner=type(owner).__name__,
        checks="the checks of the parameters",
        what="what each rank builds",
    )


def _agree(
    described: list[Entry] | None,
    refused: Exception | None,
    *,
    comm: Comm | None,
    owner: str,
    checks: str,
    what: str,
) -> None:
    """Compare ``described`` (this rank's entries; None where ``refused``) across the
    ranks: one all-gather of a digest, and of the descriptions where the digests differ.
    Raise ``refused`` here, and elsewhere a ``ValueError`` naming the rank whose
    ``checks`` refused, or the first entry that differs."""
    if comm is None:
        if refused is not None:
            raise refused
        return
    if refused is None:
        entries = [Entry(_CHECKS, _PASSED), *(described or [])]
    else:  # Note [a rank that fails alone]
        entries = [Entry(_CHECKS, _refusal(refused))]
    compared = json.dumps([[e.key, e.value] for e in entries]).encode()
    digests = all_gather_bytes(
        hashlib.sha256(compared).digest(),
        comm=comm,
        what=f"the digest of {what} (Note [the ranks build alike])",
        advice=_ADVICE,
        length=_DIGEST_BYTES,
    )
    if all(d == digests[0] for d in digests):
        if refused is not None:  # every rank refused alike
            raise refused
        return
    every = all_gather_bytes(
        json.dumps([[e.key, e.value, e.label] for e in entries]).encode(),
        comm=comm,
        what=f"{what} (Note [the ranks build alike])",
        advice=_ADVICE,
    )
    if refused is not None:
        raise refused
    ranks = [[Entry(*e) for e in json.loads(b)] for b in every]
    name = f"{comm.where()}: {owner}"
    refusing = [r for r, entries in enumerate(ranks) if entries[0].value != _PASSED]
    if refusing:
        raise ValueError(
            f"{name}: {checks} failed on {_named(refusing)} "
            f"({ranks[refusing[0]][0].value}); every rank raises with it rather than wait "
            "for it (Note [a rank that fails alone])"
        )
    others = [r for r, d in enumerate(digests) if d != digests[0]]
    raise ValueError(f"{name}: {_difference(ranks, others)}")


def share_outcome(failed: Exception | None, *, comm: Comm | None, what: str, owner: str) -> None:
    """Tell every rank of ``comm`` whether ``what`` failed on this one (``failed``) and
    learn the same of theirs. Where it passed and failed elsewhere, raise
    ``CollectiveError`` naming the first rank where it failed and its error. Where it
    failed, return, for the caller to raise its own. Nothing
    with one rank. A collective: every rank calls it at the same point of its build. See
    Note [a rank that fails alone]."""
    if comm is None:
        return
    flags = all_gather_bytes(
        b"\x00" if failed is None else b"\x01",
        comm=comm,
        what=f"whether {what} passed on each rank (Note [a rank that fails alone])",
        advice=_ADVICE,
        length=1,
    )
    failing = [r for r, flag in enumerate(flags) if flag != b"\x00"]
    if not failing:
        return
    errors = all_gather_bytes(
        b"" if failed is None else _refusal(failed).encode(),
        comm=comm,
        what=f"why {what} failed (Note [a rank that fails alone])",
        advice=_ADVICE,
    )
    if failed is not None:
        return
    raise CollectiveError(
        f"{comm.where()}: {owner}: {what} failed on {_named(failing)} "
        f"({errors[failing[0]].decode(errors='replace')}); every rank raises with it rather "
        "than wait for it (Note [a rank that fails alone])"
    )


class BuiltTogether:
    """The end of one build's allocations, told to every rank once (``share_outcome``): a
    route calls ``built()`` as its last move before the segment joins the optimizer, and
    the build calls ``failed(exc)`` when the route raised, ``built()``'s own refusal
    included (then already told). Note [a rank that fails alone]."""

    WHAT = "building the optimizer's buckets"

    def __init__(self, comm: Comm | None, *, owner: str) -> None:
        self._comm = comm
        self._owner = owner
        self._told = False

    def built(self) -> None:
        """This rank built its share: raise ``CollectiveError`` if another rank did not."""
        self._told = True
        share_outcome(None, comm=self._comm, what=self.WHAT, owner=self._owner)

    def so_far(self) -> None:
        """Every rank got this far in its build: raise ``CollectiveError`` if one did not,
        before a collective every rank must reach (the broadcast of rank 0's weights, Note
        [every rank starts from rank 0's weights] in ``rank_starts.py``). A rank that failed
        before here told the others in the same all-gather (``failed``)."""
        try:
            share_outcome(None, comm=self._comm, what=self.WHAT, owner=self._owner)
        except CollectiveError:
            self._told = True  # the others know: they failed
            raise

    def failed(self, exc: BaseException) -> None:
        """This rank's build raised ``exc``, which the caller raises next: tell the others,
        unless they know already or ``exc`` stops the process (an interrupt: they will
        meet their deadline)."""
        if self._told or not isinstance(exc, Exception):
            return
        self._told = True
        try:
            share_outcome(exc, comm=self._comm, what=self.WHAT, owner=self._owner)
        except CollectiveError as lost:
            exc.add_note(f"(the other ranks could not be told: {lost})")


def _named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _value(entries: dict[str, Entry], key: str) -> str | None:
    entry = entries.get(key)
    return None if entry is None else entry.value


def _difference(described: list[list[Entry]], others: list[int]) -> str:
    """The sentence naming the first entry in which rank ``others[0]`` differs from rank
    0 (and how many more differ)."""
    first = others[0]
    ours = {e.key: e for e in described[0]}
    theirs = {e.key: e for e in described[first]}
    keys = [*ours, *(k for k in theirs if k not in ours)]
    differ = [k for k in keys if _value(ours, k) != _value(theirs, k)]
    if not differ:  # their digests differ, so must their descriptions
        raise RuntimeError(f"ranks 0 and {first} differ in digest only (bug)")

    def has(entry: Entry | None) -> str:
        if entry is None:
            return "nothing there"
        return f"{entry.value} ({entry.label})" if entry.label else entry.value

    key = differ[0]
    text = (
        f"the ranks disagree on {key}: rank 0 has {has(ours.get(key))}, rank {first} has "
        f"{has(theirs.get(key))}"
    )
    if len(differ) > 1:
        shown = ", ".join(differ[1:4]) + (", ..." if len(differ) > 4 else "")
        text += f" ({len(differ) - 1} more entries differ: {shown})"
    if len(others) > 1:
        text += f"; ranks {', '.join(map(str, others))} differ from rank 0"
    return (
        f"{text}; every rank must build the optimizer alike: the same optimizer, parameters "
        "(in the same order, shapes and dtypes), param groups and OffloadConfig fields "
        f"{', '.join(MUST_AGREE)} (Note [the ranks build alike]; docs/multi-rank.md)"
    )
