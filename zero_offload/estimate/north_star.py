"""The north star of the big-models issue: a full fine-tune of a Llama-3-8B shape on one
24 GiB GPU with 128 GiB of host memory, and of a Llama-3-70B shape on one 24 GiB GPU with
256 GiB of host memory and 2 TB of NVMe, 4096-token sequences, bf16, micro-batch 1.

``north_star()`` estimates both and chooses a configuration for each: the first row of the
table (least offloaded first) that fits, preferring one the library runs today over an
estimate of one it does not run yet; the ZeRO paper's rows (other systems) are never chosen.
Where no row fits, it says so, and names the closest row the library runs and the limits
that row exceeds.

A row that holds only under conditions (in-flight gradient staging: every step run during
backward, so no gradient clipping; ``estimate/in_flight.py``) may be chosen, and then the
conditions are printed beside it, with the best row that holds without them: a full
fine-tune usually clips, and with clipping only that one applies.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import format_bytes
from .api import estimate
from .result import ConfigEstimate, MemoryEstimate

__all__ = [
    "NORTH_STARS",
    "Answer",
    "NorthStar",
    "choose",
    "exceeded",
    "north_star",
    "north_star_text",
]


@dataclass(frozen=True)
class NorthStar:
    """A model (a name in ``KNOWN_MODELS``) and the machine it must train on."""

    title: str
    model: str
    seq_len: int
    device_memory: str  # per GPU
    host_memory: str  # per node
    disk_memory: str | None  # NVMe per node; None: no NVMe

    def command(self) -> str:
        """The ``zero-offload estimate`` flags that reproduce this estimate."""
        flags = f"--hf-config {self.model} --seq-len {self.seq_len}"
        flags += f" --device-memory {self.device_memory} --host-memory {self.host_memory}"
        return flags + (f" --disk-memory {self.disk_memory}" if self.disk_memory else "")


NORTH_STARS = (
    NorthStar("Llama-3-8B", "llama-3-8b", 4096, "24GiB", "128GiB", None),
    NorthStar("Llama-3-70B", "llama-3-70b", 4096, "24GiB", "256GiB", "2TB"),
)


@dataclass(frozen=True)
class Answer:
    """A north star's estimate and the configuration chosen for it (``None``: none fits);
    ``running``: the best row the library runs today with no conditions (gradient clipping
    allowed), whether or not it fits; ``short_of_disk``: where no such row fits, the row
    the library runs with no conditions that misses only the disk (it fits with its
    ``disk`` bytes of NVMe), the least disk first; else ``None``."""

    star: NorthStar
    estimate: MemoryEstimate
    chosen: ConfigEstimate | None
    running: ConfigEstimate | None
    short_of_disk: ConfigEstimate | None = None


def choose(result: MemoryEstimate) -> ConfigEstimate | None:
    """The first row that fits among those the library runs, else among those it does not
    run yet; ``None`` if no row of this library fits."""
    for library in ("yes", "not yet"):
        for row in result.rows:
            if row.library == library and row.fits:
                return row
    return None


def exceeded(row: ConfigEstimate, result: MemoryEstimate) -> dict[str, tuple[int, int]]:
    """Each limit of ``result``'s machine that ``row`` exceeds: ``{"host": (bytes needed,
    bytes there)}`` (host: the host memory less the reserve; disk: none given holds
    nothing); empty when it fits or the limits are unknown."""
    limits = [("device", row.device_total, result.device_memory)]
    if result.host_memory is not None:
        limits.append(("host", row.host, result.host_memory - result.host_reserve))
    limits.append(("disk", row.disk, result.disk_memory or 0))
    return {name: (need, have) for name, need, have in limits if have is not None and need > have}


def _exceeded_text(row: ConfigEstimate, result: MemoryEstimate) -> str:
    return ", ".join(
        f"{name} {format_bytes(need)} > {format_bytes(have)}"
        for name, (need, have) in exceeded(row, result).items()
    )


def _unconditional(result: MemoryEstimate) -> list[ConfigEstimate]:
    """The rows the library runs whatever the training loop does (clipping included)."""
    return [row for row in result.rows if row.library == "yes" and not row.conditions]


def _closest_running(result: MemoryEstimate) -> ConfigEstimate | None:
    """The row the library runs with no conditions that fits, else the one with the
    largest model that fits, and of those the one that exceeds the fewest limits (then the
    first)."""
    running = _unconditional(result)
    fitting = [row for row in running if row.fits]
    if fitting:
        return fitting[0]
    return min(
        running,
        key=lambda row: (-(row.largest_fitting_params or 0), len(exceeded(row, result))),
        default=None,
    )


def _short_of_disk(result: MemoryEstimate) -> ConfigEstimate | None:
    """The row the library runs with no conditions whose only exceeded limit is the disk,
    the least disk first; ``None`` if such a row fits or none is short of disk alone."""
    running = _unconditional(result)
    if any(row.fits for row in running):
        return None
    short = [row for row in running if list(exceeded(row, result)) == ["disk"]]
    return min(short, key=lambda row: row.disk, default=None)


def north_star() -> list[Answer]:
    """Both north stars, estimated, each with its chosen configuration."""
    answers = []
    for star in NORTH_STARS:
        result = estimate(
            star.model,
            seq_len=star.seq_len,
            device_memory=star.device_memory,
            host_memory=star.host_memory,
            disk_memory=star.disk_memory,
        )
        answers.append(
            Answer(star, result, choose(result), _closest_running(result), _short_of_disk(result))
        )
    return answers


def _describe(row: ConfigEstimate) -> str:
    return (
        f"{row.name}: device {format_bytes(row.device_total)} per GPU, host "
        f"{format_bytes(row.host)}, disk {format_bytes(row.disk)}"
    )


def north_star_text(answers: list[Answer] | None = None) -> str:
    """Each north star: the machine, the chosen configuration and its bytes per tier, and
    what the library runs today; then the full tables."""
    answers = north_star() if answers is None else answers
    lines = []
    for answer in answers:
        star, row = answer.star, answer.chosen
        disk = star.disk_memory or "no NVMe"
        lines.append(
            f"{star.title} ({answer.estimate.params / 1e9:.2f} B parameters, {star.seq_len} tokens): one "
            f"{star.device_memory} GPU, {star.host_memory} host, {disk}"
        )
        if row is None:
            lines.append("  no configuration of this library fits")
        else:
            lines.append(f"  chosen: {_describe(row)}")
            if row.library != "yes":
                lines.append(f"  (an estimate: the library does not run it yet: {row.not_run})")
            if row.conditions:
                lines.append(f"  only where {row.conditions}.")
                lines.append(
                    "  A full fine-tune usually clips gradients (max_grad_norm): then this row "
                    "does not apply, and what follows is what runs"
                )
        running = answer.running
        if running is not None and running is not row:
            verdict = (
                "fits"
                if running.fits
                else (
                    f"does not fit ({_exceeded_text(running, answer.estimate)}); the "
                    f"largest it fits here is "
                    f"{(running.largest_fitting_params or 0) / 1e9:.2f} B parameters"
                )
            )
            clipping = " with clipping" if row is not None and row.conditions else ""
            lines.append(
                f"  best the library runs today{clipping}: {_describe(running)}, {verdict}"
            )
        short = answer.short_of_disk
        if short is not None:
            lines.append(
                f"  with {format_bytes(short.disk)} of NVMe or more, {short.name} fits "
                f"(the library runs it): host {format_bytes(short.host)}"
            )
        lines.append(f"  reproduce: zero-offload estimate {star.command()}")
    tables = "\n\n".join(answer.estimate.table() for answer in answers)
    return "\n".join(lines) + "\n\n" + tables
