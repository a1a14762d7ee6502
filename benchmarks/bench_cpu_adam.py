"""CPU optimizer throughput: our numba kernels (Adam, Lion, Adagrad, Adafactor, Muon's host
passes) vs torch,
against a measured bandwidth roofline for each access pattern.

    python benchmarks/bench_cpu_adam.py [--quick | --large] [--rounds N]

Prints one table per size (params/s, ratio to the roofline of the variant's streams and to
torch's fused AdamW) and writes benchmarks/results/bench_cpu_adam.json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch
from numba import njit, prange

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, time_rounds, write_json

from zero_offload.kernels import adafactor_step, adagrad_step, adam_step, lion_step, warmup
from zero_offload.kernels import muon as muon_kernels

HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
# bytes moved per parameter by each access pattern
BYTES = {"fp32": 28, "mixed": 28, "bf16_moments": 20, "one_state_fp32": 20}
#: The rows measured against the one-state roofline (Lion, Adagrad: read p, g, s; write p, s).
ONE_STATE = ("Lion", "Adagrad")
#: Adafactor's row: one square matrix of the size's parameters, against the streams of the
#: two passes it makes where no element is clamped, as here (Note [Adafactor's three passes]
#: and Note [the update's norm from the factors] in kernels/adafactor*.py: read p, g; read p,
#: g, write p: 20 B/param; its factors, 8 B per row, stay in cache). The second pass needs
#: the first whole (the factors and the clipping norm), so the two cannot share a stream; the
#: kernel's arithmetic is not counted (U costs two multiplies and a select per element: Note
#: [the update from the factors]). The roofline of three passes (read g once more: 24
#: B/param) is what a step costs where an element may be clamped, and was this row's
#: yardstick before the norm came from the factors; both are printed.
#: Muon's row: its two host passes around Newton-Schulz (Note [Muon's host passes] in
#: kernels/muon.py: read g, B, write B and U in bf16; read p and O in bf16, write p: 24
#: B/param), with Newton-Schulz replaced by the identity, as a GPU runs it (Note
#: [Newton-Schulz where the matmuls are fast]); beside it torch's operations (what
#: ``muon_step_torch`` runs) over the same matrix, with the same stand-in.
MUON_ROOF = "roofline Muon fp32 (2 passes, 24 B/param)"
ADAFACTOR_ROOF = "roofline Adafactor fp32 (2 passes, 20 B/param)"
ADAFACTOR_ROOF3 = "roofline Adafactor fp32 (3 passes, 24 B/param)"


@njit(parallel=True, fastmath=True)
def _roofline_sum(a, b, partial, nchunks):
    """One reading pass (Adafactor's passes 1 and 2): sum of a + b, per chunk."""
    n = a.shape[0]
    for c in prange(nchunks):
        lo, hi = n * c // nchunks, n * (c + 1) // nchunks
        a_t, b_t = a[lo:hi], b[lo:hi]
        s = np.float32(0.0)
        for i in range(hi - lo):
            s += a_t[i] + b_t[i]
        partial[c] = s
    return 0


def _roofline_passes(p, g, nchunks, *, passes: int):
    """The streams of Adafactor's passes (read p, g; with ``passes`` 3, read g; read p, g,
    write p), trivial arithmetic."""
    partial = np.empty(nchunks, np.float32)
    _roofline_sum(p, g, partial, nchunks)
    if passes == 3:
        _roofline_sum(g, g, partial, nchunks)  # g twice: one stream, as pass 2 reads it
    _roofline_update(p, g, nchunks)


@njit(parallel=True)
def _roofline_update(p, g, nchunks):
    """Adafactor's third pass's streams: read p, g; write p."""
    n = p.shape[0]
    for c in prange(nchunks):
        lo, hi = n * c // nchunks, n * (c + 1) // nchunks
        p_t, g_t = p[lo:hi], g[lo:hi]
        for i in range(hi - lo):
            p_t[i] = p_t[i] + g_t[i]
    return 0


@njit(parallel=True)
def _roofline(p, g, m, v, out, nchunks):
    """Same streams as the Adam pass (read p,g,m,v; write p,m,v[,out]), trivial arithmetic."""
    n = p.shape[0]
    for c in prange(nchunks):
        lo, hi = n * c // nchunks, n * (c + 1) // nchunks
        p_t, g_t, m_t, v_t = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
        o_t = out[lo:hi]
        for i in range(hi - lo):
            x = g_t[i]
            p_t[i] = p_t[i] + 1
            m_t[i] = m_t[i] + x
            v_t[i] = v_t[i] + x
            if o_t.shape[0] > 0:
                o_t[i] = x
    return 0


@njit(parallel=True)
def _roofline_one_state(p, g, s, nchunks):
    """The streams of a one-state pass (Lion, Adagrad: read p,g,s; write p,s), trivial
    arithmetic."""
    n = p.shape[0]
    for c in prange(nchunks):
        lo, hi = n * c // nchunks, n * (c + 1) // nchunks
        p_t, g_t, s_t = p[lo:hi], g[lo:hi], s[lo:hi]
        for i in range(hi - lo):
            x = g_t[i]
            p_t[i] = p_t[i] + 1
            s_t[i] = s_t[i] + x
    return 0


@njit(parallel=True)
def _roofline_muon(p, g, b, u, nchunks):
    """The streams of Muon's two host passes (read g, b, write b, u (16-bit); read p, u,
    write p), trivial arithmetic."""
    n = p.shape[0]
    for c in prange(nchunks):
        lo, hi = n * c // nchunks, n * (c + 1) // nchunks
        g_t, b_t, u_t = g[lo:hi], b[lo:hi], u[lo:hi]
        for i in range(hi - lo):
            x = b_t[i] + g_t[i]
            b_t[i] = x
            u_t[i] = np.uint16(x > 0)
    for c in prange(nchunks):
        lo, hi = n * c // nchunks, n * (c + 1) // nchunks
        p_t, u_t = p[lo:hi], u[lo:hi]
        for i in range(hi - lo):
            p_t[i] = p_t[i] + np.float32(u_t[i])
    return 0


def _muon(step_fn, p, g, b, side: int):
    """One Muon step of a side x side matrix through ``step_fn`` (``muon_step`` or
    ``muon_step_torch``), Newton-Schulz replaced by the identity (see MUON_ROOF)."""

    def run() -> None:
        saved = muon_kernels.newton_schulz
        muon_kernels.newton_schulz = _identity_ns
        try:
            step_fn(p, g, b, shape=(side, side), lr=0.02, weight_decay=0.1, momentum=0.95,
                    nesterov=True, ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5,
                    eps=1e-7, adjust_lr_fn=None)  # fmt: skip
        finally:
            muon_kernels.newton_schulz = saved

    return run


def _identity_ns(update: torch.Tensor, **_: object) -> torch.Tensor:
    """Newton-Schulz's stand-in: its bf16 input, as the device's result would land."""
    return update.bfloat16()


def _deepspeed_adam():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its extension does not build here
        return None
    return DeepSpeedCPUAdam


def bench_size(n: int, rounds: int) -> dict[str, float]:
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)  # (n,) fp32 master weights, ours
    g = torch.randn(n, generator=gen) * 1e-2  # (n,) fp32 gradient
    m, v = torch.zeros(n), torch.zeros(n)  # (n,) fp32 moments
    g_bf16 = g.bfloat16()  # (n,) bf16 gradient as a mixed-precision backward leaves it
    out_bf16 = torch.empty(n, dtype=torch.bfloat16)  # (n,) bf16 training weights
    m_bf16 = torch.zeros(n, dtype=torch.bfloat16)
    v_bf16 = torch.zeros(n, dtype=torch.bfloat16)
    p_u16 = g_bf16.view(torch.int16).numpy().view(np.uint16)  # roofline's 16-bit streams
    out_u16 = out_bf16.view(torch.int16).numpy().view(np.uint16)
    arrays = [t.numpy() for t in (p, g, m, v)]
    no_out = np.empty(0, np.uint16)
    step = {"n": 0}

    def ours(grad, exp_avg, exp_avg_sq, out=None):
        def run():
            step["n"] += 1
            adam_step(p, grad, exp_avg, exp_avg_sq, step=step["n"], out=out, **HYPER)

        return run

    def ours_lion():
        lion_step(p, g, m, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.01)

    def ours_adagrad():
        step["n"] += 1
        adagrad_step(p, g, v, step=step["n"], lr=1e-2, lr_decay=0.0, weight_decay=0.0, eps=1e-10)

    tp = torch.nn.Parameter(torch.randn(n, generator=gen))  # torch's own weights
    tp.grad = g.clone()
    kw = {"lr": HYPER["lr"], "betas": (HYPER["beta1"], HYPER["beta2"]), "eps": HYPER["eps"],
          "weight_decay": HYPER["weight_decay"]}  # fmt: skip
    foreach = torch.optim.AdamW([tp], foreach=True, **kw)
    fused = torch.optim.AdamW([tp], fused=True, **kw)
    fused_mixed = torch.optim.AdamW([tp], fused=True, **kw)
    tp_out = torch.empty(n, dtype=torch.bfloat16)

    def torch_mixed():
        tp.grad.copy_(g_bf16)  # bf16 -> fp32 gradient
        fused_mixed.step()
        tp_out.copy_(tp)  # fp32 -> bf16 weights for the next forward

    fns = {
        "roofline fp32 (28 B/param)": lambda: _roofline(*arrays, no_out, threads),
        "roofline mixed (bf16 g in, bf16 w out)": lambda: _roofline(
            arrays[0], p_u16, arrays[2], arrays[3], out_u16, threads
        ),
        "ours fp32": ours(g, m, v),
        "ours bf16 grad in + bf16 weights out": ours(g_bf16, m, v, out_bf16),
        "ours bf16 moments": ours(g, m_bf16, v_bf16),
        "torch AdamW foreach": foreach.step,
        "torch AdamW fused": fused.step,
        "torch mixed (cast g, fused, cast w)": torch_mixed,
    }
    adagrad_p = torch.nn.Parameter(torch.randn(n, generator=gen))
    adagrad_p.grad = g.clone()
    fns["roofline one state fp32 (20 B/param)"] = lambda: _roofline_one_state(
        arrays[0], arrays[1], arrays[2], threads
    )
    fns["ours Lion fp32"] = ours_lion
    fns["ours Adagrad fp32"] = ours_adagrad
    fns["torch Adagrad (for-loop)"] = torch.optim.Adagrad([adagrad_p], lr=1e-2).step
    side = math.isqrt(n)  # a side x side matrix: n is a power of 4 here
    row_var, col_var = np.zeros(side, np.float32), np.zeros(side, np.float32)

    def ours_adafactor():
        step["n"] += 1
        adafactor_step(p, g, shape=(side, side), row_var=row_var, col_var=col_var,
                       step=step["n"], lr=1e-2, beta2_decay=-0.8, eps1=1.2e-7, eps2=1e-3,
                       d=1.0, weight_decay=0.0)  # fmt: skip

    adafactor_p = torch.nn.Parameter(torch.randn(side, side, generator=gen))
    adafactor_p.grad = g.view(side, side).clone()
    fns[ADAFACTOR_ROOF] = lambda: _roofline_passes(arrays[0], arrays[1], threads, passes=2)
    fns[ADAFACTOR_ROOF3] = lambda: _roofline_passes(arrays[0], arrays[1], threads, passes=3)
    fns["ours Adafactor fp32"] = ours_adafactor
    muon_b = torch.zeros(n)  # (n,) fp32 momentum buffer
    muon_u = np.empty(n, np.uint16)  # (n,) the roofline's 16-bit U
    fns[MUON_ROOF] = lambda: _roofline_muon(arrays[0], arrays[1], muon_b.numpy(), muon_u, threads)
    fns["ours Muon fp32 (host passes)"] = _muon(muon_kernels.muon_step, p, g, muon_b, side)
    fns["torch ops Muon (host, as muon_step_torch)"] = _muon(
        muon_kernels.muon_step_torch, p, g, muon_b, side
    )
    fns["torch Adafactor (for-loop)"] = torch.optim.Adafactor([adafactor_p], lr=1e-2).step
    ds = _deepspeed_adam()
    if ds is None:
        print("DeepSpeedCPUAdam: skipped (deepspeed not importable)")
    else:
        fns["DeepSpeedCPUAdam"] = ds([tp], **kw).step
    with torch.no_grad():
        return {name: n / t for name, t in time_rounds(fns, rounds=rounds).items()}


def _table(n: int, rates: dict[str, float]) -> str:
    roof_fp32 = rates["roofline fp32 (28 B/param)"]
    roof_mixed = rates["roofline mixed (bf16 g in, bf16 w out)"]
    fused = rates["torch AdamW fused"]
    lines = [f"\n### {n / 2**20:g}M parameters", "",
             "| variant | Mparams/s | x roofline | x torch fused |", "|---|---:|---:|---:|"]  # fmt: skip
    roof_one = rates["roofline one state fp32 (20 B/param)"]
    for name, r in rates.items():
        roof = roof_mixed if ("bf16 grad" in name or "mixed" in name) else roof_fp32
        one_state = name.startswith("roofline one state") or any(k in name for k in ONE_STATE)
        roof = roof_one if one_state else roof
        roof = rates[ADAFACTOR_ROOF] if "Adafactor" in name else roof
        roof = rates[MUON_ROOF] if "Muon" in name else roof
        lines.append(f"| {name} | {r / 1e6:.0f} | {r / roof:.2f} | {r / fused:.2f} |")
    return "\n".join(lines)


def _targets(rates: dict[str, float]) -> dict[str, tuple[float, float]]:
    """(measured ratio, target) for each goal of issue 3."""
    return {
        "fp32 / roofline": (rates["ours fp32"] / rates["roofline fp32 (28 B/param)"], 0.9),
        "fp32 / torch fused": (rates["ours fp32"] / rates["torch AdamW fused"], 1.0),
        "bf16 in+out / torch mixed": (
            rates["ours bf16 grad in + bf16 weights out"]
            / rates["torch mixed (cast g, fused, cast w)"],
            1.4,
        ),
        "bf16 moments / ours fp32": (rates["ours bf16 moments"] / rates["ours fp32"], 1.3),
        # issue 37: each rule's kernel at 0.9x the roofline of its own streams
        **{
            f"{rule} fp32 / its roofline": (
                rates[f"ours {rule} fp32"] / rates["roofline one state fp32 (20 B/param)"],
                0.9,
            )
            for rule in ONE_STATE
        },
        "Adafactor fp32 / its roofline (2 passes)": (
            rates["ours Adafactor fp32"] / rates[ADAFACTOR_ROOF],
            0.9,
        ),
        "Muon fp32 host passes / their roofline": (
            rates["ours Muon fp32 (host passes)"] / rates[MUON_ROOF],
            0.9,
        ),
        "Muon fp32 host passes / torch's operations": (
            rates["ours Muon fp32 (host passes)"]
            / rates["torch ops Muon (host, as muon_step_torch)"],
            1.0,
        ),
        "Adafactor fp32 / the roofline of 3 passes": (
            rates["ours Adafactor fp32"] / rates[ADAFACTOR_ROOF3],
            0.9,
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the tables, write the JSON; return what was written."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M and 16M, 5 rounds")
    ap.add_argument("--large", action="store_true", help="also 256M parameters")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5/9)")
    args = ap.parse_args(argv)
    sizes = [1 << 20, 16 << 20] if args.quick else [1 << 20, 16 << 20, 64 << 20]
    if args.large:
        sizes.append(256 << 20)
    rounds = args.rounds or (5 if args.quick else 9)
    info = {**machine(), "torch_threads": torch.get_num_threads(), "rounds": rounds}
    compile_times = warmup()
    print(f"machine: {info}; kernel warm-up {compile_times['total']:.2f} s")
    results = {}
    for n in sizes:
        rates = bench_size(n, rounds)
        targets = _targets(rates)
        print(_table(n, rates))
        for name, (ratio, goal) in targets.items():
            print(
                f"  target {name}: {ratio:.2f} (goal >= {goal}) {'met' if ratio >= goal else 'MISSED'}"
            )
        results[str(n)] = {"params_per_s": rates, "targets": targets}
    payload = {"machine": info, "warmup_s": compile_times, "sizes": results}
    print(f"\nwrote {write_json('bench_cpu_adam', payload)}")
    return payload


if __name__ == "__main__":
    main()
