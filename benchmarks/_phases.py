"""Phases of a check script: each one bounded in time, reported as rows, and unable to stop
the ones after it.

Note [a phase never takes the script down]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A check that runs once on a borrowed machine must come back with every number it could get.
So each phase is a function run under three guards, by ``PhaseRunner.run``:

1. ``try``/``except``: an exception becomes an ERROR row (type, message; the traceback goes to
   stderr and into the JSON), and the next phase runs.
2. A soft timeout: ``SIGALRM`` after ``timeout_s`` dumps every thread's stack (so a hang says
   where it hangs) and raises ``PhaseTimeout`` inside the phase: a TIMEOUT row, and the next
   phase runs. Python runs the handler between bytecodes, so a phase stuck inside C code
   holding the GIL never sees it; hence
3. a hard timeout: ``faulthandler.dump_traceback_later(exit=True)``, ``hard_grace_s`` after
   the soft one, dumps the stacks to stderr from faulthandler's own C thread and ends the
   process (exit status 1). What was measured until then is already on disk: the report
   is rewritten after every row and names the phase that was running when it went.

Both timers are cancelled when the phase ends. Subprocesses inside a phase get a
``timeout=`` of their own, below the phase's (``Phase.remaining()``). A phase also ends at
the script's budget (``budget_s``); one that needs more time than is left is skipped with a
row that says so.
"""

from __future__ import annotations

import enum
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Phase", "PhaseRunner", "PhaseTimeout", "Report", "Row", "Status"]


class Status(enum.Enum):
    """How a phase (or one of its rows) ended."""

    OK = "ok"  # ran to the end; every check in it held
    FAILED = "FAILED"  # ran to the end; a check did not hold (a number past its tolerance)
    ERROR = "ERROR"  # raised
    TIMEOUT = "TIMEOUT"  # cut at its soft timeout (or the script's budget)
    SKIPPED = "skipped"  # not run: not for this machine, not asked for, or no time left


class PhaseTimeout(BaseException):
    """Raised inside a phase at its soft timeout; see Note [a phase never takes the script
    down]. A ``BaseException``, so that a phase's own ``except Exception`` cannot swallow
    it."""


@dataclass(frozen=True)
class Row:
    """One line of the report."""

    phase: str
    name: str
    value: str
    status: Status


class Report:
    """The rows and phase records of one run, printed as they come and, when ``out_dir`` is
    given, rewritten there after every row (``<name>.json``, ``<name>.md``), atomically."""

    def __init__(self, name: str, *, out_dir: Path | None, meta: dict[str, Any]) -> None:
        self.name = name
        self.out_dir = out_dir
        self.meta = meta  # JSON-able facts about the run (argv, mode, budget)
        self.rows: list[Row] = []
        self.phases: list[dict[str, Any]] = []  # one record per phase, in run order
        self.running: dict[str, Any] | None = None  # the phase in progress, for a hard kill
        self.exit_status: int | None = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)

    def add(self, row: Row) -> None:
        flag = "" if row.status is Status.OK else f"  [{row.status.value}]"
        print(f"{self.name}: {row.name}: {row.value}{flag}", flush=True)
        self.rows.append(row)
        self.write()

    def table(self) -> str:
        """The rows as a markdown table."""
        lines = ["| phase | check | result | status |", "|---|---|---|---|"]
        for r in self.rows:
            cells = (r.phase, r.name, r.value, r.status.value)
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {
            **self.meta,
            "rows": [
                {"phase": r.phase, "name": r.name, "value": r.value, "status": r.status.value}
                for r in self.rows
            ],
            "phases": self.phases,
            "running": self.running,
            "exit_status": self.exit_status,
        }

    def write(self) -> None:
        """Rewrite the files in ``out_dir`` (nothing without one); a reader never sees half a
        file (write, then rename)."""
        if self.out_dir is None:
            return
        for suffix, text in (
            (".json", json.dumps(self.as_json(), indent=2, default=str)),
            (".md", self.table() + "\n"),
        ):
            path = self.out_dir / f"{self.name}{suffix}"
            tmp = path.with_suffix(suffix + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)


def _cell(text: str) -> str:
    """``text`` as one markdown table cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


@dataclass
class Phase:
    """What a phase function gets: a place for rows and data, and its clock."""

    name: str
    report: Report
    deadline: float  # time.monotonic() of the soft timeout
    data: dict[str, Any] = field(default_factory=dict)  # JSON-able, lands in the phase record
    failed: bool = False  # a row said a check did not hold

    def row(self, name: str, value: str, *, ok: bool = True) -> None:
        """Report one result now; ``ok=False`` marks the phase FAILED (it still runs on)."""
        self.failed |= not ok
        self.report.add(Row(self.name, name, value, Status.OK if ok else Status.FAILED))

    def remaining(self) -> float:
        """Seconds until the soft timeout: the most a subprocess in this phase may take."""
        return max(0.0, self.deadline - time.monotonic())


@dataclass(frozen=True)
class Faults:
    """Failures to inject, by phase name, to check the guards themselves (tests, and a
    first run on a new machine): ``fail`` raises at the start of the phase, ``hang`` sleeps
    past the soft timeout, ``stuck`` sleeps with SIGALRM ignored, so only the hard timeout
    ends it (and the process)."""

    fail: frozenset[str] = frozenset()
    hang: frozenset[str] = frozenset()
    stuck: frozenset[str] = frozenset()


class PhaseRunner:
    """Runs phases under Note [a phase never takes the script down]'s guards, within the
    script's budget of ``budget_s`` seconds from ``started`` (a ``time.monotonic()``)."""

    def __init__(
        self,
        report: Report,
        *,
        started: float,
        budget_s: float,
        hard_grace_s: float = 30.0,
        timeouts: dict[str, float] | None = None,
        faults: Faults = Faults(),
    ) -> None:
        if budget_s <= 0 or hard_grace_s <= 0:
            raise ValueError(
                f"budget_s and hard_grace_s must be > 0 seconds, got {budget_s}, {hard_grace_s}"
            )
        self.report = report
        self.started = started
        self.budget_s = budget_s
        self.hard_grace_s = hard_grace_s
        self.timeouts = dict(timeouts or {})  # phase name -> seconds, overriding the default
        self.faults = faults
        # Where a soft timeout dumps the stacks (stderr without an out_dir). A hard timeout
        # dumps them to stderr, the last thing the console shows of the process.
        self.traces: Path | None = None
        if report.out_dir is not None:
            self.traces = report.out_dir / f"{report.name}_tracebacks.txt"
        self._alarms = hasattr(signal, "setitimer")  # POSIX; the hard timeout works anywhere
        self._armed = False  # the soft timeout may fire (cleared before the timers are)

    def budget_left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def skip(self, name: str, why: str) -> Status:
        """Record ``name`` as not run, with the reason."""
        self.report.add(Row(name, name, f"skipped: {why}", Status.SKIPPED))
        self.report.phases.append({"name": name, "status": Status.SKIPPED.value, "why": why})
        self.report.write()
        return Status.SKIPPED

    def run(
        self, name: str, fn: Callable[[Phase], None], *, timeout_s: float, needs_s: float = 0.0
    ) -> Status:
        """Run ``fn`` as the phase ``name`` with a soft timeout of ``timeout_s`` (or the
        ``timeouts`` override, or what is left of the budget, whichever is least); skip it
        when less than ``needs_s`` seconds of the budget are left."""
        left = self.budget_left()
        if left < max(needs_s, 1.0):
            return self.skip(
                name,
                f"needs about {needs_s:.0f} s, {max(left, 0):.0f} s left of the "
                f"{self.budget_s:.0f} s budget (--budget-s)",
            )
        timeout = min(self.timeouts.get(name, timeout_s), left)
        start = time.monotonic()
        phase = Phase(name, self.report, deadline=start + timeout)
        self.report.running = {
            "name": name,
            "timeout_s": timeout,
            "hard_timeout_s": timeout + self.hard_grace_s,
        }
        self.report.write()
        status, error, trace = Status.OK, None, None
        self._arm(name, timeout)
        try:
            self._inject(name)
            fn(phase)
        except PhaseTimeout as exc:
            status, error = Status.TIMEOUT, str(exc)
        except Exception as exc:
            status, error = Status.ERROR, f"{type(exc).__name__}: {exc}"
            trace = traceback.format_exc()
            print(trace, file=sys.stderr, flush=True)
        finally:
            self._disarm()
        seconds = time.monotonic() - start
        if status is Status.OK and phase.failed:
            status = Status.FAILED
        if status in (Status.ERROR, Status.TIMEOUT):
            self.report.add(
                Row(name, name, f"{status.value} after {seconds:.1f} s: {error}", status)
            )
        self.report.running = None
        self.report.phases.append(
            {
                "name": name,
                "status": status.value,
                "seconds": round(seconds, 3),
                "timeout_s": timeout,
                "error": error,
                "traceback": trace,
                "data": phase.data,
            }
        )
        self.report.write()
        return status

    # -- the guards ------------------------------------------------------------------------

    def _arm(self, name: str, timeout: float) -> None:
        faulthandler.dump_traceback_later(
            timeout + self.hard_grace_s, exit=True, file=sys.__stderr__
        )
        if not self._alarms:
            return

        def on_alarm(signum: int, frame: object) -> None:
            if not self._armed:  # the phase ended as the timer fired
                return
            header = f"\n--- phase {name!r}: soft timeout ({timeout:.3g} s), stacks:\n"
            if self.traces is None:
                sys.__stderr__.write(header)
                sys.__stderr__.flush()
                faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
            else:
                with open(self.traces, "a") as traces:
                    traces.write(header)
                    traces.flush()
                    faulthandler.dump_traceback(file=traces, all_threads=True)
            where = "stderr" if self.traces is None else self.traces
            raise PhaseTimeout(f"no result within {timeout:.3g} s; stacks in {where}")

        self._armed = True
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)

    def _disarm(self) -> None:
        self._armed = False
        if self._alarms:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
        faulthandler.cancel_dump_traceback_later()

    def _inject(self, name: str) -> None:
        if name in self.faults.fail:
            raise RuntimeError(f"failure injected into phase {name!r} (--inject-failure)")
        if name in self.faults.hang:
            while True:  # interrupted by the soft timeout
                time.sleep(0.1)
        if name in self.faults.stuck:
            # As for a phase inside C code: the soft timeout's handler never gets to run.
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            while True:  # only the hard timeout ends this, and the process with it
                time.sleep(0.1)
