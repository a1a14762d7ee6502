"""Smoke test of the installed wheel: run from outside the source tree, in a venv that has the
wheel and its dependencies and nothing of the checkout.

Each feature runs once on a tiny model and is compared with torch where a comparison is
cheap: the plain optimizer, NVMe state, parameter offload, activation offload, the profiler,
consolidated checkpoints, the estimator, and the command line. A module left out of the
wheel (as zero_offload.params once was) fails here, not in a user's first run.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import pkgutil
import subprocess
import sys
import tempfile

import torch
from torch import nn

import zero_offload
from zero_offload import (
    ActivationOffloader,
    OffloadAdamW,
    OffloadConfig,
    checkpoint,
    estimate,
    load_consolidated,
    profile,
    save_consolidated,
)

HERE = pathlib.Path(zero_offload.__file__).resolve().parent


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"wheel smoke test FAILED: {what}")
    print(f"ok   {what}")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(
        self, x: torch.Tensor, offloader: ActivationOffloader | None = None
    ) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x) if offloader is None else checkpoint(layer, x, offloader=offloader)
        return self.head(x)


def model_and_data(seed: int = 0) -> tuple[Tiny, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return Tiny(), torch.randn(8, 16), torch.randn(8, 4)


def train_torch(steps: int) -> list[torch.Tensor]:
    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def train_ours(
    steps: int, config: OffloadConfig, *, acts: bool = False, **kw: object
) -> list[torch.Tensor]:
    model, x, y = model_and_data()
    if config.offload_parameters:
        kw.setdefault("model", model)
        kw.setdefault("layers", model.layers)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, config=config, **kw)
    offloader = ActivationOffloader(manager=opt.manager) if acts else None
    for _ in range(steps):
        opt.backward(nn.functional.mse_loss(model(x, offloader), y))
        opt.step()
        opt.zero_grad()
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(a, b, strict=True))


def main() -> None:
    check(
        not str(HERE).startswith(str(pathlib.Path(__file__).resolve().parents[1])),
        f"zero_offload is imported from the installed wheel ({HERE})",
    )
    names = [m.name for m in pkgutil.walk_packages([str(HERE)], prefix="zero_offload.")]
    names = [n for n in names if not n.endswith("__main__")]  # running it is the CLI test
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:  # an optional framework (integrations) is fine
            if (error.name or "").startswith("zero_offload"):
                raise
            print(f"skip {name}: needs {error.name}, an optional dependency")
    for needed in ("zero_offload.params", "zero_offload.kernels", "zero_offload.optim"):
        check(needed in names, f"{needed} is in the wheel")
    check(len(names) > 40, f"all {len(names)} modules import")

    reference = train_torch(3)
    check(close(train_ours(3, OffloadConfig()), reference), "OffloadAdamW matches torch AdamW")
    with tempfile.TemporaryDirectory() as nvme:
        check(
            close(train_ours(3, OffloadConfig(nvme_dir=nvme, host_budget="1MiB")), reference),
            "optimizer state on NVMe matches torch AdamW",
        )
    check(
        close(train_ours(3, OffloadConfig(offload_parameters=True)), reference),
        "parameter offload matches torch AdamW",
    )
    check(
        close(train_ours(3, OffloadConfig(), acts=True), reference),
        "activation offload matches torch AdamW",
    )

    model, x, y = model_and_data()
    opt = OffloadAdamW(model.parameters(), lr=1e-2)
    with profile(opt, link_bandwidth=1e9) as prof:
        opt.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        prof.step()
    check("host" in prof.report().lower(), "the profiler reports traffic")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        save_consolidated(opt, path)
        model2, _, _ = model_and_data(seed=1)
        opt2 = OffloadAdamW(model2.parameters(), lr=1e-2)
        load_consolidated(opt2, path)
        a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
        same = a.keys() == b.keys() and all(
            torch.equal(a[k][name], b[k][name]) for k in a for name in ("exp_avg", "exp_avg_sq")
        )
        check(same, "a consolidated checkpoint loads bitwise")
        opt.close()
        opt2.close()

    check(estimate(model).__class__.__name__ == "MemoryEstimate", "the estimator runs")
    for args in (["--help"], ["info"]):
        out = subprocess.run(
            [sys.executable, "-m", "zero_offload", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        check(out.returncode == 0, f"`zero-offload {' '.join(args)}` runs: {out.stderr[-500:]}")
    print("wheel smoke test passed")


if __name__ == "__main__":
    main()
