"""kernels.cu against the PyTorch reference in fp4.py: codes, scales, masks and folded outputs bit
for bit, on shapes that are not multiples of any tile, with NaN/Inf, tiny and huge values.

GPU tests need CUDA and CuPy (skipped otherwise). The reference runs on the same CUDA tensors
with FP4_KERNELS=torch. The CPU tests compile kernels.cu with nvcc (when present) and check the
dispatch's argument validation against the reference's errors.
"""
import dataclasses
import os
import shutil
import subprocess
from contextlib import contextmanager

import pytest
import torch

import fp4

HAS_GPU = torch.cuda.is_available() and fp4._cupy() is not None
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and CuPy")
KERNELS_CU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.cu")


@contextmanager
def reference():
    old = os.environ.get("FP4_KERNELS")
    os.environ["FP4_KERNELS"] = "torch"
    try:
        yield
    finally:
        if old is None:
            del os.environ["FP4_KERNELS"]
        else:
            os.environ["FP4_KERNELS"] = old


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, fp4.QTensor):
        return dataclasses.replace(obj, **{f.name: _to(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                                           if isinstance(getattr(obj, f.name), (torch.Tensor, tuple))})
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    return obj


def _same(a, b):
    a, b = _to(a, "cpu"), _to(b, "cpu")
    if isinstance(a, fp4.QTensor):
        return all(_same(getattr(a, f), getattr(b, f)) for f in ("codes", "scales", "mask", "tensor_scale"))
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all())


NOTE = {}


def both(fn, *args, **kw):
    """(kernel result, reference result) of fp4.fn. The reference runs on CPU copies of the inputs:
    the definition. It is also run on the CUDA inputs (FP4_KERNELS=torch); whether the two agree is
    recorded for failure messages (torch on CUDA divides by a Python scalar as a multiply by its
    reciprocal, so `amax / 6` can differ from the CPU's true division)."""
    got = getattr(fp4, fn)(*args, **kw)
    torch.cuda.synchronize()  # surface launch errors here
    with reference():
        want = getattr(fp4, fn)(*_to(args, "cpu"), **_to(kw, "cpu"))
        want_cuda = getattr(fp4, fn)(*args, **kw)
    NOTE["ref"] = (f"[kernel == CUDA-run reference: {_same(got, want_cuda)}; "
                   f"CUDA-run reference == CPU reference: {_same(want_cuda, want)}]")
    return got, _to(want, "cuda")


def assert_same(got, want, what):
    """Bit-exact equality (NaN == NaN for float tensors); print the first mismatches."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.dtype.is_floating_point:
        bad = ~((got == want) | (torch.isnan(got) & torch.isnan(want)))
        bad |= torch.signbit(got) != torch.signbit(want)
        bad &= ~(torch.isnan(got) & torch.isnan(want))
    else:
        bad = got != want
    if bad.any():
        idx = bad.nonzero()[:8]
        lines = [f"  {tuple(i.tolist())}: got {got[tuple(i)].item()!r}, expected {want[tuple(i)].item()!r}" for i in idx]
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} differ {NOTE.get('ref', '')}; first:\n" + "\n".join(lines))


def assert_qtensor(got, want):
    assert (got.fmt, got.shape, got.axis) == (want.fmt, want.shape, want.axis)
    assert_same(got.codes, want.codes, "codes")
    assert_same(got.scales, want.scales, "scales")
    assert (got.mask is None) == (want.mask is None), "mask presence"
    if want.mask is not None:
        assert_same(got.mask, want.mask, "mask")
    assert (got.tensor_scale is None) == (want.tensor_scale is None), "tensor scale presence"
    if want.tensor_scale is not None:
        assert_same(got.tensor_scale.reshape(()), want.tensor_scale.reshape(()), "tensor_scale")


def rand(shape, dtype=torch.bfloat16, seed=0, special=False):
    """Gaussian data with per-row magnitudes spread over many binades; `special` plants NaN, +-Inf,
    tiny (1e-30), huge (1e30), all-zero blocks, -0.0 and constant blocks."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=gen, device="cuda")
    x = x * torch.exp2(torch.randint(-20, 20, shape[:-1] + (1,), generator=gen, device="cuda").float())
    if special:
        flat = x.view(-1)
        n = flat.numel()
        pick = torch.randint(0, n, (12,), generator=gen, device="cuda")
        flat[pick[0]] = float("nan")
        flat[pick[1]] = float("inf")
        flat[pick[2]] = -float("inf")
        flat[pick[3:6]] = 1e-30
        flat[pick[6:8]] = 1e30
        flat[pick[8]] = -0.0
        flat[:32] = 0.0  # an all-zero block (first row)
        if n >= 128:
            flat[64:96] = 0.75  # a constant block: QuEST's sigma == 0
            flat[96:112] = -1e-38  # subnormal-ish magnitudes
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------
# quantize along the last dim (quant_rows) and along the first (quant_cols)

MX_CASES = [  # (shape, dtype, rule, rounding, hadamard, signs, special)
    ((1, 32), torch.float32, "absmax", "rn", 0, False, False),
    ((3, 96), torch.bfloat16, "quest", "rn", 32, False, True),
    ((129, 160), torch.bfloat16, "quest", "rn", 32, False, True),
    ((1000, 2080), torch.bfloat16, "quest", "rn", 32, False, True),
    ((129, 160), torch.float32, "absmax", "sr", 32, True, True),
    ((1000, 2080), torch.bfloat16, "absmax", "sr", 32, True, True),
    ((3, 128), torch.float16, "absmax", "rn", 16, True, True),
    ((65, 256), torch.bfloat16, "quest", "sr", 64, True, True),
    ((7, 384), torch.float32, "absmax", "rn", 128, True, True),
    ((2, 3, 96), torch.bfloat16, "absmax", "rn", 0, False, True),
]


@gpu
@pytest.mark.parametrize("shape,dtype,rule,rnd,had,signed,special", MX_CASES)
@pytest.mark.parametrize("axis", [-1, 0])
def test_quantize_mx(shape, dtype, rule, rnd, had, signed, special, axis):
    if axis == 0:
        if len(shape) != 2:
            pytest.skip("axis 0 cases are 2-D")
        shape = (shape[1], shape[0])  # the quantized axis (first) keeps the sizes above
    x = rand(shape, dtype, seed=hash((shape, rule, rnd, had)) & 0xFFFF, special=special)
    signs = fp4.random_signs(had, 7, "cuda") if signed else None
    got, want = both("quantize", x, "mxfp4", axis=axis, scale_rule=rule, rounding=rnd, hadamard=had,
                     signs=signs, seed=1234)
    assert_qtensor(got, want)


NV_CASES = [  # (shape, dtype, rule, rounding, hadamard, signs, block2d, special)
    ((1, 16), torch.float32, "absmax", "rn", 0, False, False, False),
    ((3, 48), torch.bfloat16, "absmax", "rn", 0, False, False, True),
    ((129, 160), torch.bfloat16, "four_over_six", "rn", 0, False, False, True),
    ((1000, 2080), torch.bfloat16, "four_over_six", "rn", 0, False, False, False),
    ((129, 160), torch.bfloat16, "absmax", "sr", 16, True, False, True),
    ((48, 160), torch.float32, "absmax", "rn", 0, False, True, True),
    ((992, 2080), torch.bfloat16, "absmax", "rn", 0, False, True, False),
    ((3, 256), torch.bfloat16, "absmax", "eden", 128, True, False, True),
    ((129, 384), torch.float32, "absmax", "eden", 128, True, False, False),
    ((5, 128), torch.float16, "absmax", "eden", 0, False, False, True),
]


@gpu
@pytest.mark.parametrize("shape,dtype,rule,rnd,had,signed,block2d,special", NV_CASES)
@pytest.mark.parametrize("axis", [-1, 0])
def test_quantize_nv(shape, dtype, rule, rnd, had, signed, block2d, special, axis):
    if axis == 0:
        shape = (shape[1], shape[0])
        if block2d and shape[1] % 16:
            pytest.skip("block2d needs both dims divisible by 16")
    x = rand(shape, dtype, seed=hash((shape, rule, rnd, had, block2d)) & 0xFFFF, special=special)
    signs = fp4.random_signs(had, 11, "cuda") if signed else None
    got, want = both("quantize", x, "nvfp4", axis=axis, scale_rule=rule, rounding=rnd, hadamard=had,
                     signs=signs, seed=99, block2d=block2d)
    assert_qtensor(got, want)


@gpu
def test_quantize_views():
    """A transposed view quantized along its first axis reads the contiguous storage (quant_rows);
    an odd storage offset is realigned."""
    base = rand((96, 64), torch.bfloat16, seed=3)
    for x in (base.t(), base[:, 1:33], base.view(-1)[1:].view(-1)[: 95 * 32].view(95, 32)):
        got, want = both("quantize", x, "mxfp4", axis=0 if x.shape[0] % 32 == 0 else -1, scale_rule="quest",
                         hadamard=32)
        assert_qtensor(got, want)


# ---------------------------------------------------------------------------------------------
# requantize (dequantize + transpose + rotate + quantize in one pass), fold, dequantize

REQ_CASES = [  # (shape, in fmt, in options, out fmt, out options)
    ((224, 96), "mxfp4", dict(scale_rule="quest", hadamard=32), "mxfp4", dict(rounding="sr", hadamard=32, signed=True)),
    ((992, 2080), "mxfp4", dict(scale_rule="quest", hadamard=32), "mxfp4", dict(rounding="sr", hadamard=32, signed=True)),
    ((96, 992), "mxfp4", dict(axis=0), "mxfp4", dict(rounding="rn")),
    ((160, 48), "nvfp4", dict(scale_rule="four_over_six"), "nvfp4", dict(rounding="sr", hadamard=16, signed=True)),
    ((256, 384), "nvfp4", dict(), "nvfp4", dict(rounding="eden", hadamard=128, signed=True)),
    ((64, 160), "nvfp4", dict(block2d=True), "nvfp4", dict(rounding="rn")),
    ((128, 96), "mxfp4", dict(), "nvfp4", dict(rounding="sr")),
]


@gpu
@pytest.mark.parametrize("shape,fin,optin,fout,optout", REQ_CASES)
def test_requantize(shape, fin, optin, fout, optout):
    x = rand(shape, torch.bfloat16, seed=sum(shape), special=True)
    with reference():
        q = fp4.quantize(x, fin, **optin)
    opt = dict(optout)
    had = opt.get("hadamard", 0)
    signs = fp4.random_signs(had, 5, "cuda") if opt.pop("signed", False) else None
    got, want = both("requantize", q, fout, signs=signs, seed=77, **opt)
    assert_qtensor(got, want)


@gpu
@pytest.mark.parametrize("shape,spread", [((1, 32), 0), ((3, 96), 4), ((129, 2080), 12), ((1000, 160), 40)])
def test_fold(shape, spread):
    x = rand(shape, torch.float32, seed=shape[0], special=spread > 20)
    if spread:  # block exponents spanning `spread` binades in a row (inexact fold beyond 8)
        gen = torch.Generator(device="cuda").manual_seed(1)
        e = torch.randint(-spread, 1, (shape[0], shape[1] // 32, 1), generator=gen, device="cuda").float()
        x = (x.view(shape[0], -1, 32) * torch.exp2(e)).view(shape)
    with reference():
        q = fp4.quantize(x, "mxfp4", scale_rule="quest", hadamard=32)
    (e_got, r_got), (e_want, r_want) = both("fold_mx", q)
    assert_same(e_got.view(torch.uint8), e_want.view(torch.uint8), "fp8 elements")
    assert_same(r_got, r_want, "row scales")


@gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("axis", [-1, 0])
def test_dequantize(fmt, dtype, axis):
    x = rand((96, 160), torch.float32, seed=5, special=True) * 1e-3
    with reference():
        q = fp4.quantize(x, fmt, axis=axis)
    got, want = both("dequantize", q, dtype)
    assert_same(got, want, "dequantized")


# ---------------------------------------------------------------------------------------------
# CPU: nvcc builds kernels.cu for every target; the dispatch raises the reference's errors

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_120a"])
def test_nvcc_compiles(arch, tmp_path):
    out = tmp_path / f"kernels_{arch}.cubin"
    cmd = ["nvcc", "-std=c++17", "-fmad=false", f"-arch={arch}", "-cubin", "-o", str(out), KERNELS_CU]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]


BAD_OPTIONS = [
    dict(fmt="fp8"),
    dict(fmt="mxfp4", scale_rule="four_over_six"),
    dict(fmt="nvfp4", rounding="eden", scale_rule="four_over_six"),
    dict(fmt="mxfp4", hadamard=24),
    dict(fmt="mxfp4", hadamard=0, signs=torch.ones(32)),
    dict(fmt="mxfp4", hadamard=32, signs=torch.ones(16)),
    dict(fmt="mxfp4", hadamard=32, signs=torch.full((32,), 2.0)),
    dict(fmt="mxfp4", block2d=True),
    dict(fmt="nvfp4", block2d=True, shape=(24, 64)),
    dict(fmt="mxfp4", shape=(4, 48)),
    dict(fmt="mxfp4", hadamard=64, shape=(4, 96)),
]


@pytest.mark.parametrize("opts", BAD_OPTIONS)
def test_dispatch_errors_match_reference(opts):
    opts = dict(opts)
    x = torch.randn(opts.pop("shape", (32, 64)))
    fmt = opts.pop("fmt")
    with pytest.raises((ValueError, TypeError)) as want:
        fp4.quantize(x, fmt, **opts)
    with pytest.raises(type(want.value)) as got:
        fp4._kernel_quantize(x, fmt, opts.pop("axis", -1), opts.get("scale_rule", "absmax"),
                             opts.get("rounding", "rn"), opts.get("hadamard", 0), opts.get("signs"), 0,
                             opts.get("block2d", False))
    assert str(got.value) == str(want.value)


def test_sign_words():
    signs = torch.tensor([1.0, -1.0] * 32 + [-1.0] * 64)
    assert fp4._sign_words(signs) == [0xAAAAAAAA, 0xAAAAAAAA, 0xFFFFFFFF, 0xFFFFFFFF]
    assert fp4._sign_words(torch.tensor([-1.0] + [1.0] * 15)) == [1, 0, 0, 0]
