"""A load supersedes a step announced to ``backward``, by either route.

``opt.backward(loss, step=True)`` runs the step during that backward; ``step()`` then only
finishes it. A checkpoint loaded between the two (a resume after a failed evaluation, say)
is the optimizer's state from then on: ``step()`` steps from the loaded state with the
window's gradients, exactly as after a plain ``backward`` (``StepPolicy.superseding_eager``
in optim/update/policy.py). ``load_state_dict`` did so; ``load_streaming`` let ``step()``
finish the announced step over the loaded state, 1.2e-3 off the plain backward's weights
on this model, with no error. With in-flight staging the window's gradients are gone once
the announced step ran, so ``step()`` is refused after either load.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from zero_offload import OffloadAdamW

from .helpers.models import batches, lm_loss, make_pair, offload_opt, train

DATA = batches(5)
ROUTES = ["state_dict", "streaming"]
IN_FLIGHT = {"grad_staging": "in_flight", "grad_staging_buffers": 2}


def _loaded_after_backward(
    root: Path, route: str, *, announce: bool, **config: object
) -> tuple[torch.nn.Module, OffloadAdamW]:
    """Train two steps, checkpoint (model and optimizer), train two more, run one backward
    (announced or plain), load the checkpoint by ``route``: (model, optimizer)."""
    model, _ = make_pair()
    opt = offload_opt(model, **config)
    train(model, opt, DATA[:2])
    weights = copy.deepcopy(model.state_dict())
    state = opt.state_dict() if route == "state_dict" else None
    opt.save_streaming(root / "ckpt")
    train(model, opt, DATA[2:4])
    tokens, targets = DATA[4]
    opt.backward(lm_loss(model, tokens, targets), step=announce)
    model.load_state_dict(weights)
    if route == "state_dict":
        opt.load_state_dict(state)
    else:
        opt.load_streaming(root / "ckpt")
    return model, opt


def _stepped(root: Path, route: str, *, announce: bool, **config: object) -> dict:
    model, opt = _loaded_after_backward(root, route, announce=announce, **config)
    try:
        opt.step()
        opt.zero_grad()
        return {name: value.clone() for name, value in model.state_dict().items()}
    finally:
        opt.close()


#: (route, where the state lives): NVMe state loads by streaming only.
CASES = [("state_dict", "host"), ("streaming", "host"), ("streaming", "nvme")]


@pytest.mark.parametrize(("route", "storage"), CASES)
def test_step_after_a_load_steps_from_the_loaded_state(
    tmp_path: Path, route: str, storage: str
) -> None:
    config: dict[str, object] = {}
    if storage == "nvme":
        config = {"host_budget": 1, "nvme_dir": tmp_path / "nvme"}
    plain = _stepped(tmp_path / "plain", route, announce=False, **config)
    announced = _stepped(tmp_path / "announced", route, announce=True, **config)
    for name, value in plain.items():
        assert torch.equal(announced[name], value), (
            f"{name}: the announced step was not superseded by {route}: max |diff| = "
            f"{(announced[name].float() - value.float()).abs().max().item():.3e}"
        )


@pytest.mark.filterwarnings("ignore:OffloadConfig.grad_staging='in_flight'.")  # unannounced
@pytest.mark.parametrize("route", ROUTES)
def test_in_flight_staging_refuses_the_superseded_step(tmp_path: Path, route: str) -> None:
    _, opt = _loaded_after_backward(tmp_path, route, announce=True, **IN_FLIGHT)
    try:
        with pytest.raises(RuntimeError, match=r"stepped during backward.*zero_grad"):
            opt.step()
    finally:
        opt.close()
