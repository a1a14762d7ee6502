"""adam_step matches torch.optim.Adam / AdamW; tiles compose; bad input changes nothing."""

import itertools

import numba
import numpy as np
import pytest
import torch

from zero_offload.kernels import adam_step

STEPS = 10
LR, BETA1, BETA2, EPS = 1e-2, 0.9, 0.999, 1e-8
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# fp32 tolerance: the kernel performs torch's operations in torch's order on fp32 values,
# but LLVM may fuse a multiply and an add into one FMA (one rounding instead of two) where
# torch's compiled kernel did not, or the reverse. That is a difference of an ulp or so per
# step in each value; over 10 steps it stays within a few ulps of the values, i.e. a
# relative error around 1e-6. Moments can be near zero, hence the small absolute term.
FP32_TOL = {"rtol": 4e-6, "atol": 1e-7}


def _grads(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(STEPS)]


def _torch_reference(p0, grads, *, adamw, maximize, amsgrad, wd, scale):
    p = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([p], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=wd,
              amsgrad=amsgrad, maximize=maximize, foreach=False)  # fmt: skip
    for g in grads:
        p.grad = g.float() * scale
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq")


def _ours(p0, grads, *, adamw, maximize, amsgrad, wd, scale, moment_dtype=torch.float32,
          out_dtype=None):  # fmt: skip
    p = p0.clone()
    m = torch.zeros_like(p, dtype=moment_dtype)
    v = torch.zeros_like(p, dtype=moment_dtype)
    vmax = torch.zeros_like(p, dtype=moment_dtype) if amsgrad else None
    out = None if out_dtype is None else torch.empty_like(p, dtype=out_dtype)
    for step, g in enumerate(grads, start=1):
        adam_step(p, g, m, v, step=step, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS,
                  weight_decay=wd, decoupled_weight_decay=adamw, maximize=maximize,
                  grad_scale=scale, max_exp_avg_sq=vmax, out=out)  # fmt: skip
    return p, m, v, vmax, out


FLAGS = list(itertools.product([True, False], [False, True], [False, True], [0.0, 0.1],
                               [1.0, 0.37]))  # fmt: skip


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("adamw,maximize,amsgrad,wd,scale", FLAGS)
def test_fp32_parity_small_sizes(grad_dtype, adamw, maximize, amsgrad, wd, scale) -> None:
    flags = dict(adamw=adamw, maximize=maximize, amsgrad=amsgrad, wd=wd, scale=scale)
    for n in (1, 7, 64, 1000):
        p0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
        grads = _grads(n, grad_dtype, seed=n + 1)
        expected = _torch_reference(p0, grads, **flags)
        got = _ours(p0, grads, **flags)
        for name, e, g in zip(
            ["param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"], expected, got, strict=False
        ):
            if e is not None:
                torch.testing.assert_close(
                    g, e, **FP32_TOL, msg=lambda s, n=n, k=name: f"{k} n={n}: {s}"
                )


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("adamw,maximize,amsgrad,wd,scale",
                         [(True, False, False, 0.1, 0.37), (False, True, True, 0.1, 1.0)])  # fmt: skip
def test_fp32_parity_large(grad_dtype, adamw, maximize, amsgrad, wd, scale) -> None:
    n = 2**20 + 3
    flags = dict(adamw=adamw, maximize=maximize, amsgrad=amsgrad, wd=wd, scale=scale)
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(3))
    grads = _grads(n, grad_dtype, seed=4)
    expected = _torch_reference(p0, grads, **flags)
    got = _ours(p0, grads, **flags)
    for e, g in zip(expected, got, strict=False):
        if e is not None:
            torch.testing.assert_close(g, e, **FP32_TOL)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_out_is_bit_exact_copy_of_updated_weights(out_dtype, amsgrad) -> None:
    n = 5000
    p0 = torch.randn(n)
    grads = _grads(n, torch.bfloat16, seed=7)
    flags = dict(adamw=True, maximize=False, amsgrad=amsgrad, wd=0.1, scale=1.0)
    p, _, _, _, out = _ours(p0, grads, out_dtype=out_dtype, **flags)
    assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16))
    torch.testing.assert_close(p, _torch_reference(p0, grads, **flags)[0], **FP32_TOL)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_bf16_moments_close_to_fp32_reference(amsgrad) -> None:
    # bf16 keeps 8 significant bits: each stored moment is off by up to 2**-9 relative, so
    # each step's update (lr * m / sqrt(v)) is off by about 2**-8 of lr; over 10 steps the
    # weights can drift by 10 * lr * 2**-8 ~ 4e-4 at lr=1e-2. We allow 1e-3. exp_avg can
    # cancel to near zero, so its error is bounded against the gradient scale (~1):
    # 10 roundings of 2**-9 of |m| <= 2**-7. exp_avg_sq sums positives: relative 2**-6.
    n = 4096
    p0 = torch.randn(n)
    grads = _grads(n, torch.float32, seed=9)
    flags = dict(adamw=True, maximize=False, amsgrad=amsgrad, wd=0.1, scale=1.0)
    p, m, v, _, _ = _ours(p0, grads, moment_dtype=torch.bfloat16, **flags)
    ref_p, ref_m, ref_v, _ = _torch_reference(p0, grads, **flags)
    torch.testing.assert_close(p, ref_p, rtol=0, atol=1e-3)
    torch.testing.assert_close(m.float(), ref_m, rtol=0, atol=2**-7)
    torch.testing.assert_close(v.float(), ref_v, rtol=2**-6, atol=0)


def test_non_finite_gradient_propagates_like_torch() -> None:
    n = 100
    p0 = torch.randn(n)
    grads = _grads(n, torch.float32, seed=11)
    grads[3][5] = float("nan")
    grads[3][17] = float("inf")
    grads[6][40] = float("-inf")
    for amsgrad in (False, True):
        flags = dict(adamw=True, maximize=False, amsgrad=amsgrad, wd=0.1, scale=1.0)
        expected = _torch_reference(p0, grads, **flags)
        got = _ours(p0, grads, **flags)
        for e, g in zip(expected, got, strict=False):
            if e is None:
                continue
            assert torch.equal(torch.isnan(g), torch.isnan(e))
            assert torch.equal(torch.isinf(g), torch.isinf(e))
            fin = torch.isfinite(e)
            torch.testing.assert_close(g[fin], e[fin], **FP32_TOL)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiles_equal_one_call_bitwise(grad_dtype) -> None:
    n = 200_003
    p0 = torch.randn(n)
    g = torch.randn(n).to(grad_dtype)
    kw = dict(step=3, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.1)
    whole = [p0.clone(), torch.rand(n), torch.rand(n), torch.empty(n, dtype=torch.bfloat16)]
    tiled = [t.clone() for t in whole]
    adam_step(whole[0], g, whole[1], whole[2], out=whole[3], **kw)
    bounds = [0, 1, 999, 65536, 65537, 150_000, n]
    threads = min(2, numba.config.NUMBA_NUM_THREADS)  # one core (taskset): a pool of one
    for lo, hi in itertools.pairwise(bounds):
        adam_step(tiled[0], g, tiled[1], tiled[2], out=tiled[3], start=lo, stop=hi,
                  num_threads=1 + lo % threads, **kw)  # fmt: skip
    for a, b in zip(whole, tiled, strict=False):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def _args(n=8):
    return [torch.ones(n), torch.ones(n), torch.ones(n), torch.ones(n)]


KW = dict(step=1, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a, k: a.__setitem__(0, torch.ones(16)[::2]), ValueError, r"param must be a contiguous"),
        (lambda a, k: a.__setitem__(1, torch.ones(8, dtype=torch.float64)), TypeError, r"grad has dtype torch.float64"),
        (lambda a, k: a.__setitem__(2, torch.ones(8, dtype=torch.bfloat16)), TypeError, r"exp_avg is bfloat16"),
        (lambda a, k: a.__setitem__(3, torch.ones(9)), ValueError, r"exp_avg_sq has 9 elements"),
        (lambda a, k: a.__setitem__(1, torch.ones(2, 4)), ValueError, r"grad must be a contiguous 1-D"),
        (lambda a, k: a.__setitem__(1, [1.0] * 8), TypeError, r"grad must be a CPU torch.Tensor"),
        (lambda a, k: a.__setitem__(0, torch.ones(8, device="meta")), ValueError, r"param is on device meta"),
        (lambda a, k: k.update(out=torch.ones(8)), TypeError, r"out has dtype torch.float32"),
        (lambda a, k: k.update(max_exp_avg_sq=torch.ones(8, dtype=torch.bfloat16)), TypeError, r"max_exp_avg_sq is bfloat16"),
        (lambda a, k: k.update(start=3, stop=2), ValueError, r"start=3, stop=2"),
        (lambda a, k: k.update(stop=9), ValueError, r"stop=9"),
        (lambda a, k: k.update(step=0), ValueError, r"step=0"),
        (lambda a, k: k.update(lr=-1.0), ValueError, r"lr=-1.0"),
        (lambda a, k: k.update(beta2=1.0), ValueError, r"beta2=1.0"),
        (lambda a, k: k.update(eps=float("nan")), ValueError, r"eps=nan"),
        (lambda a, k: k.update(weight_decay="0.1"), TypeError, r"weight_decay must be a real"),
        (lambda a, k: k.update(grad_scale=float("inf")), ValueError, r"grad_scale=inf"),
        (lambda a, k: k.update(num_threads=10_000), ValueError, r"num_threads=10000"),
    ],
)  # fmt: skip
def test_bad_input_raises_and_changes_nothing(change, error, match) -> None:
    args, kw = _args(), dict(KW)
    change(args, kw)
    before = [a.clone() if isinstance(a, torch.Tensor) and a.device.type == "cpu" else None
              for a in args]  # fmt: skip
    with pytest.raises(error, match=match):
        adam_step(*args, **kw)
    for a, b in zip(args, before, strict=False):
        if b is not None:
            assert torch.equal(a, b)


def test_numpy_inputs_and_read_only_output() -> None:
    p = np.ones(8, np.float32)
    g = np.full(8, 0.5, np.float16)
    m, v = np.zeros(8, np.uint16), np.zeros(8, np.uint16)  # bf16 bit patterns
    adam_step(p, g, m, v, **KW)
    assert np.all(p < 1) and np.all(m != 0)
    ro = np.ones(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"param is a read-only"):
        adam_step(ro, g, m, v, **KW)
