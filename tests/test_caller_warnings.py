"""A warning names the line of the user's program that led to it, not a wrapper of torch's or
ours in between (Note [a warning names the caller's line] in zero_offload/caller_warning.py):
the optimizer's public methods are wrapped (``said_to_caller``), torch wraps ``step()``, and
DCP reaches ``load_state_dict`` through its own functions."""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from zero_offload import OffloadAdamW, OffloadConfig, caller_warning
from zero_offload.caller_warning import warn_caller

from .helpers.models import host_accelerator, mlp, mlp_batches, mlp_loss, mlp_opt


def _line_after(frame_line: int) -> int:
    """The line after ``frame_line``: where a ``pytest.warns`` block's one call sits."""
    return frame_line + 1


def _only(record: pytest.WarningsRecorder, match: str) -> warnings.WarningMessage:
    found = [w for w in record if match in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in record]
    return found[0]


def test_warn_caller_names_the_first_frame_outside_the_library_and_torch() -> None:
    with pytest.warns(UserWarning, match="from here") as record:
        here = inspect.currentframe().f_lineno  # type: ignore[union-attr]
        warn_caller("from here")
    assert record[0].filename == __file__
    assert record[0].lineno == _line_after(here)


def test_zero_grad_after_an_announced_backward_warns_at_the_users_zero_grad() -> None:
    model = mlp()
    opt = mlp_opt(model)
    x, y = mlp_batches(1)[0]
    opt.backward(mlp_loss(model, x, y), step=True)
    with pytest.warns(UserWarning) as record:
        here = inspect.currentframe().f_lineno  # type: ignore[union-attr]
        opt.zero_grad()
    warning = _only(record, "zero_grad() after an announced backward")
    assert (warning.filename, warning.lineno) == (__file__, _line_after(here))
    opt.close()


def test_a_change_after_an_announced_step_warns_at_the_users_step() -> None:
    model = mlp()
    opt = mlp_opt(model)
    x, y = mlp_batches(1)[0]
    opt.backward(mlp_loss(model, x, y), step=True)
    opt.param_groups[0]["lr"] = 0.0  # a scheduler stepped before the optimizer
    with pytest.warns(UserWarning) as record:
        here = inspect.currentframe().f_lineno  # type: ignore[union-attr]
        opt.step()
    warning = _only(record, "hyper-parameters changed")
    assert (warning.filename, warning.lineno) == (__file__, _line_after(here))
    opt.close()


def _net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _overlapped(model: torch.nn.Module) -> OffloadAdamW:
    return OffloadAdamW(
        model.parameters(),
        lr=1e-2,
        config=OffloadConfig(bucket_bytes=1024, tile_elements=1024, overlap_step=True),
        accelerator=host_accelerator(),
    )


def test_a_flattened_dcp_load_warns_at_the_users_set_state_dict() -> None:
    model = _net(0)
    opt = _overlapped(model)
    x = torch.randn(4, 8)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=flat)
    opt.close()
    fresh = _net(5)
    fresh_opt = _overlapped(fresh)
    with pytest.warns(UserWarning) as record:
        here = inspect.currentframe().f_lineno  # type: ignore[union-attr]
        set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd, options=flat)
    warning = _only(record, "flush_pending_update")
    assert (warning.filename, warning.lineno) == (__file__, _line_after(here))
    fresh_opt.close()


_LIBRARY_STAND_IN = """
import contextlib, threading
from zero_offload.caller_warning import warn_caller

warn_caller("at import")


@contextlib.contextmanager
def opened():
    warn_caller("in a with block")
    yield


def in_a_thread():
    def run():
        warn_caller("in a thread")  # the thread's own line: nobody else called it
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
"""


def test_warn_caller_passes_over_with_blocks_imports_and_names_a_threads_own_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module in ``tmp_path`` stands in for the library (``_PACKAGE``): a warning from
    its ``with`` block's generator or its import names this file's line, past contextlib
    and importlib; one from a thread it started names its own line."""
    (tmp_path / "stand_in.py").write_text(_LIBRARY_STAND_IN)
    monkeypatch.setattr(caller_warning, "_PACKAGE", str(tmp_path) + os.sep)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stand_in", raising=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        here = inspect.currentframe().f_lineno  # type: ignore[union-attr]
        import stand_in

        stand_in.in_a_thread()
        with_line = inspect.currentframe().f_lineno  # type: ignore[union-attr]
        with stand_in.opened():
            pass
    where = {str(w.message): (w.filename, w.lineno) for w in record}
    assert where["at import"] == (__file__, _line_after(here))
    assert where["in a with block"] == (__file__, _line_after(with_line))
    thread_file, _ = where["in a thread"]
    assert thread_file == str(tmp_path / "stand_in.py")
