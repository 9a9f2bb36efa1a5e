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
from hypothesis import given, strategies as st

import formats
import fp4
import cuda_kernels as kernels
import linear
from test_formats import fuzz, tensors
from test_fp4 import QUANT_CONFIGS

HAS_GPU = torch.cuda.is_available() and kernels._cupy() is not None
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
    """(kernel result, reference result) of fp4.fn (fn a name; or fn itself, a function that
    dispatches as fp4's do, e.g. linear._rotate_back). The reference runs on CPU copies of the inputs:
    the definition. It is also run on the CUDA inputs (FP4_KERNELS=torch); whether the two agree is
    recorded for failure messages (torch on CUDA divides by a Python scalar as a multiply by its
    reciprocal, so `amax / 6` can differ from the CPU's true division)."""
    fn = fn if callable(fn) else getattr(fp4, fn)
    got = fn(*args, **kw)
    torch.cuda.synchronize()  # surface launch errors here
    with reference():
        want = fn(*_to(args, "cpu"), **_to(kw, "cpu"))
        want_cuda = fn(*args, **kw)
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
@pytest.mark.parametrize("layout", ["quad", "group"])  # kernels.mx_rows_layout: both quant_rows variants
def test_quantize_mx(shape, dtype, rule, rnd, had, signed, special, axis, layout, monkeypatch):
    monkeypatch.setenv("FP4_MX_ROWS", layout)
    if axis == 0 and len(shape) == 3:  # a 3-D tensor quantized along its middle axis instead
        shape, axis = (shape[0], shape[2], shape[1]), 1
    elif axis == 0:
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
    ((1001, 2048), torch.bfloat16, "absmax", "eden", 128, True, False, True),  # the quad grid's tail
    ((48, 384), torch.bfloat16, "absmax", "sr", 128, False, False, True),
    ((64, 256), torch.float32, "four_over_six", "rn", 128, True, False, True),
    ((64, 256), torch.float32, "absmax", "rn", 128, False, True, True),
    ((32, 512), torch.bfloat16, "absmax", "eden", 64, True, True, False),
]


def _nv_group(had, rnd):  # the NVFP4 group a quantize works in: 16, or the Hadamard's / EDEN's 128
    return max(16, had, fp4.EDEN_GROUP if rnd == "eden" else 0)


# each case along both axes and, for 128-groups, in both layouts (kernels.nv128_rows/cols_layout);
# block2d along axis 0 only where both dims are multiples of 16
NV_RUNS = [(*case, axis, layout) for case in NV_CASES for axis in (-1, 0) for layout in ("group", "quad")
           if (layout == "group" or _nv_group(case[4], case[3]) == 128)
           and not (axis == 0 and case[6] and case[0][0] % 16)]


@gpu
@pytest.mark.parametrize("shape,dtype,rule,rnd,had,signed,block2d,special,axis,layout", NV_RUNS)
def test_quantize_nv(shape, dtype, rule, rnd, had, signed, block2d, special, axis, layout, monkeypatch):
    monkeypatch.setenv("FP4_NV128_ROWS", layout)  # axis -1: quant_rows
    monkeypatch.setenv("FP4_NV128_COLS", layout)  # axis 0: quant_cols
    if axis == 0:
        shape = (shape[1], shape[0])
    x = rand(shape, dtype, seed=hash((shape, rule, rnd, had, block2d)) & 0xFFFF, special=special)
    signs = fp4.random_signs(had, 11, "cuda") if signed else None
    got, want = both("quantize", x, "nvfp4", axis=axis, scale_rule=rule, rounding=rnd, hadamard=had,
                     signs=signs, seed=99, block2d=block2d)
    assert_qtensor(got, want)


NV_AMAX_CASES = [  # (shape, axis, dtype, rule, rounding, hadamard, signs): the pre-passes nv_amax takes
    ((3, 48), -1, torch.float32, "absmax", "rn", 0, False),
    ((129, 160), -1, torch.bfloat16, "absmax", "rn", 0, False),
    ((1000, 2080), -1, torch.bfloat16, "four_over_six", "rn", 0, False),
    ((65, 256), -1, torch.float16, "absmax", "sr", 16, True),
    ((129, 160), -1, torch.bfloat16, "absmax", "sr", 16, False),
    ((64, 256), -1, torch.bfloat16, "absmax", "eden", 0, False),  # the quad 128-group kernel's pre-pass
    ((4, 64, 33), 1, torch.bfloat16, "absmax", "rn", 0, False),  # a middle axis: quant_rows on a copy
    ((256, 96), 0, torch.bfloat16, "absmax", "sr", 16, True),  # the nvfp4 recipe's wgrad E^T
    ((256, 96), 0, torch.bfloat16, "absmax", "sr", 16, "device"),  # ... as FP4Linear runs it: DeviceSigns
    ((2080, 1000), 0, torch.bfloat16, "absmax", "rn", 0, False),
    ((160, 129), 0, torch.float32, "four_over_six", "rn", 0, False),
    ((160, 129), 0, torch.bfloat16, "absmax", "rn", 0, False),  # odd K: 2-byte loads
    ((256, 384), 0, torch.bfloat16, "absmax", "eden", 0, False),
    ((48, 40), 0, torch.float16, "absmax", "sr", 16, True),
]


@gpu
@pytest.mark.parametrize("shape,axis,dtype,rule,rnd,had,signed", NV_AMAX_CASES)
@pytest.mark.parametrize("fill", ["plain", "special", "zero"])
def test_nv_amax_kernel_matches_fused(shape, axis, dtype, rule, rnd, had, signed, fill, monkeypatch):
    """FP4_NV_AMAX=kernel (the nv_amax pre-pass) against FP4_NV_AMAX=fused (the quantize kernel's
    pass = 1) and the reference, bit for bit: codes, scales, tensor scale; and that each mode
    launched the kernel it names."""
    names = []
    launch = kernels.launch
    # the first-use checks run (and launch) before recording, under the device key quantize uses ('cuda:0')
    assert fp4._kernel_ok(torch.empty(0, device="cuda").device, "quantize", "sr")
    monkeypatch.setattr(kernels, "launch", lambda dev, name, *a: (names.append(name), launch(dev, name, *a))[1])
    x = rand(shape, dtype, seed=hash((shape, axis, rule, had)) & 0xFFFF, special=fill == "special")
    x = x * 0 if fill == "zero" else x
    seed, signs = 5, fp4.random_signs(had, 23, "cuda") if signed else None
    if signed == "device":  # derived in the kernels (nv_amax's device_rng); the reference reads them back
        t = torch.tensor([977], dtype=torch.int32, device="cuda")
        seed, signs = fp4.DeviceSeed(t, 17), fp4.DeviceSigns(had, fp4.DeviceSeed(t, 5))
    opts = dict(axis=axis, scale_rule=rule, rounding=rnd, hadamard=had, signs=signs, seed=seed)
    monkeypatch.setenv("FP4_NV_AMAX", "kernel")
    got, want = both("quantize", x, "nvfp4", **opts)
    assert names[0].startswith("nv_amax<"), names
    assert_qtensor(got, want)
    monkeypatch.setenv("FP4_NV_AMAX", "fused")
    names.clear()
    fused = fp4.quantize(x, "nvfp4", **opts)
    assert not any(n.startswith("nv_amax") for n in names), names
    assert_qtensor(got, fused)


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
    ((384, 208), "nvfp4", dict(scale_rule="four_over_six"), "nvfp4", dict(rounding="eden", hadamard=128, signed=True)),
    ((256, 96), "mxfp4", dict(), "nvfp4", dict(rounding="sr", hadamard=128, signed=True)),
    ((64, 160), "nvfp4", dict(block2d=True), "nvfp4", dict(rounding="rn")),
    ((128, 96), "mxfp4", dict(), "nvfp4", dict(rounding="sr")),
]


# each case in the group layout and, for NVFP4 128-groups, in the quad one (kernels.nv128_cols_layout)
REQ_RUNS = [(*case, layout) for case in REQ_CASES for layout in ("group", "quad")
            if layout == "group" or (case[3] == "nvfp4" and _nv_group(case[4].get("hadamard", 0), case[4].get("rounding")) == 128)]


@gpu
@pytest.mark.parametrize("shape,fin,optin,fout,optout,layout", REQ_RUNS)
def test_requantize(shape, fin, optin, fout, optout, layout, monkeypatch):
    monkeypatch.setenv("FP4_NV128_COLS", layout)
    x = rand(shape, torch.bfloat16, seed=sum(shape), special=True)
    with reference():
        q = fp4.quantize(x, fin, **optin)
    opt = dict(optout)
    had = opt.get("hadamard", 0)
    signs = fp4.random_signs(had, 5, "cuda") if opt.pop("signed", False) else None
    got, want = both("requantize", q, fout, signs=signs, seed=77, **opt)
    assert_qtensor(got, want)


@gpu
@fuzz(40)
@given(st.sampled_from(QUANT_CONFIGS), st.sampled_from([0, 16, 32, 128]), st.booleans(), st.integers(0, 2**31), st.data())
def test_quantize_and_requantize_under_hypothesis(cfg, n, first_axis, seed, data):
    """The kernels against the reference on test_formats.tensors' inputs (zeros, subnormals, +-max,
    ties, NaN, Inf, any binade), every format x rule x rounding x Hadamard, both axes, and the
    re-quantize of the result along the other axis, bit for bit."""
    multiple = max(n, 128 if cfg["rounding"] == "eden" else fp4.FORMATS[cfg["fmt"]])
    x = data.draw(tensors(multiple=multiple, rows=(1, 2), row_multiple=multiple)).cuda()
    signs = fp4.random_signs(n, seed, "cuda") if n else None
    x = x.t().contiguous() if first_axis else x
    got, want = both("quantize", x, axis=0 if first_axis else 1, hadamard=n, signs=signs, seed=seed, **cfg)
    assert_qtensor(got, want)
    if cfg["rounding"] != "eden":  # requantize takes only the 2-D forward formats
        with reference():
            q = fp4.quantize(x, axis=0 if first_axis else 1, **cfg)
        got, want = both("requantize", q, cfg["fmt"], rounding="sr", hadamard=n, signs=signs, seed=seed + 1)
        assert_qtensor(got, want)


@gpu
@pytest.mark.parametrize("shape,spread", [((1, 32), 0), ((3, 96), 4), ((129, 2080), 12), ((1000, 160), 40),
                                          ((33, 11264), 6), ((17, 16384), 30)])  # the last two: 16-byte scale loads
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


FOLD_CASES = [  # (shape, dtype, rule, rounding, hadamard, signs): K/32 threads a row, rounded up to a warp
    ((1, 32), torch.float32, "absmax", "rn", 0, False),
    ((5, 2080), torch.bfloat16, "quest", "rn", 32, False),
    ((129, 2048), torch.bfloat16, "quest", "rn", 32, False),
    ((33, 11264), torch.bfloat16, "absmax", "sr", 32, True),
    ((7, 160), torch.float16, "absmax", "sr", 16, True),
]


@gpu
@pytest.mark.parametrize("shape,dtype,rule,rnd,had,signed", FOLD_CASES)
@pytest.mark.parametrize("spread", [0, 12])
def test_quantize_fold(shape, dtype, rule, rnd, had, signed, spread):
    """quantize(fold=True) (quant_rows_fold): the same QTensor as the reference, and its folded
    E4M3 elements + row scales equal fold_mx of the reference QTensor, bit for bit."""
    x = rand(shape, torch.float32, seed=shape[1], special=True)
    if spread:  # block exponents spanning `spread` binades in a row (the fold's subnormal path)
        gen = torch.Generator(device="cuda").manual_seed(2)
        e = torch.randint(-spread, 1, (shape[0], shape[1] // 32, 1), generator=gen, device="cuda").float()
        x = (x.view(shape[0], -1, 32) * torch.exp2(e)).view(shape)
    x = x.to(dtype)
    opts = dict(scale_rule=rule, rounding=rnd, hadamard=had, seed=123,
                signs=fp4.random_signs(had, 9) if signed else None)
    got = fp4.quantize(x, "mxfp4", fold=True, **opts)
    torch.cuda.synchronize()
    assert got.folded is not None, "quantize(fold=True) did not emit the fold"
    with reference():
        want = fp4.quantize(x.cpu(), "mxfp4", **opts)
        e_want, r_want = fp4.fold_mx(want)
    assert_qtensor(got, _to(want, "cuda"))
    assert_same(got.folded[0].view(torch.uint8), e_want.view(torch.uint8).cuda(), "folded fp8 elements")
    assert_same(got.folded[1], r_want.cuda(), "folded row scales")


DSEED_CASES = [  # every kernel that draws random numbers or takes random signs
    dict(fmt="mxfp4", rounding="sr", hadamard=32),
    dict(fmt="mxfp4", rounding="sr", hadamard=32, fold=True),
    dict(fmt="mxfp4", rounding="sr", hadamard=32, axis=0),
    dict(fmt="nvfp4", rounding="eden", hadamard=128),
    dict(fmt="nvfp4", rounding="sr", hadamard=16, axis=0),
]


@gpu
@pytest.mark.parametrize("opts", DSEED_CASES)
@pytest.mark.parametrize("layout", ["group", "quad"])
def test_device_seed_matches_host_seed(opts, layout, monkeypatch):
    """A DeviceSeed (read by the kernels from GPU memory) and DeviceSigns (derived in the kernels)
    give the same QTensor as the equal host seed and fp4.random_signs, for quantize, requantize
    and the reference path."""
    monkeypatch.setenv("FP4_MX_ROWS", layout)
    monkeypatch.setenv("FP4_NV128_ROWS", layout)
    monkeypatch.setenv("FP4_NV128_COLS", layout)
    x = rand((256, 384), torch.bfloat16, seed=8, special=True)
    t = torch.tensor([2**31 - 5], dtype=torch.int32, device="cuda")
    dseed, dsigns = fp4.DeviceSeed(t, 17), fp4.DeviceSigns(opts["hadamard"], fp4.DeviceSeed(t, 5))
    hseed, hsigns = (2**31 - 5 + 17), fp4.random_signs(opts["hadamard"], 2**31 - 5 + 5)
    got = fp4.quantize(x, seed=dseed, signs=dsigns, **opts)
    want = fp4.quantize(x, seed=hseed, signs=hsigns, **opts)
    torch.cuda.synchronize()
    assert_qtensor(got, want)
    if opts.get("fold"):
        assert_same(got.folded[0].view(torch.uint8), want.folded[0].view(torch.uint8), "folded elements")
    q = fp4.quantize(x, opts["fmt"])
    ropts = dict(rounding=opts["rounding"], hadamard=opts["hadamard"])
    assert_qtensor(fp4.requantize(q, seed=dseed, signs=dsigns, **ropts), fp4.requantize(q, seed=hseed, signs=hsigns, **ropts))
    opts = {k: v for k, v in opts.items() if k != "fold"}
    with reference():
        assert_qtensor(fp4.quantize(x, seed=dseed, signs=dsigns, **opts), fp4.quantize(x, seed=hseed, signs=hsigns, **opts))


@gpu
@pytest.mark.parametrize("recipe", ["quartet", "nvfp4"])
def test_linear_cuda_graph_fresh_randomness(recipe):
    """FP4Linear forward + backward captured in a CUDA graph (torch.cuda.make_graphed_callables):
    the forward replays exactly, and every backward replay draws a fresh seed on the GPU, so
    successive gradients differ, each one FP4-close to the BF16 gradient."""
    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    lin = linear.FP4Linear(512, 384, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    y_eager = lin(x).detach()
    graphed = torch.cuda.make_graphed_callables(lin, (x,))
    ref_dx = (g.float() @ lin.weight.float())
    grads = []
    for _ in range(3):
        x.grad, lin.weight.grad = None, None
        y = graphed(x)
        y.backward(g)
        grads.append(x.grad.float().clone())
    torch.cuda.synchronize()
    assert torch.equal(y.detach(), y_eager)
    assert not torch.equal(grads[0], grads[1]) and not torch.equal(grads[1], grads[2]), "a replay reused its randomness"
    for dx in grads:
        rel = float((dx - ref_dx).norm() / ref_dx.norm())
        assert rel < 0.5, f"graphed dX is {rel:.2f} (relative) from the BF16 gradient"


@gpu
@pytest.mark.parametrize("shape,dtype", [((1, 32), torch.float32), ((129, 2080), torch.bfloat16),
                                         ((64, 6144), torch.bfloat16), ((33, 96), torch.float16)])
def test_rotate_back(shape, dtype):
    """The quartet backward's straight-through step (clip mask, inverse Hadamard-32, rounding to
    the gradient's dtype): the rotate_back kernel (through linear._rotate_back) against
    fp4.rotate_back_reference."""
    x = rand(shape, torch.float32, seed=3, special=True)
    with reference():
        q = fp4.quantize(x, "mxfp4", scale_rule="quest", hadamard=32)
    if x.numel() > 10**5:
        assert not bool(q.clip_mask().all()), "no element clipped: the mask is not exercised"
    d = rand(shape, dtype, seed=4, special=True)
    got, want = both(linear._rotate_back, d, q, 32)
    assert_same(got, want, "masked, rotated gradient")


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

@pytest.fixture(scope="module")
def nvcc_cubin(tmp_path_factory):
    """kernels.cu built by nvcc for a target, once a target: the folder holding the cubin and, kept
    by -keep, the PTX that ptxas assembled into it (byte for byte what nvcc -ptx writes), so the
    PTX checks below read it instead of running nvcc's front end a second time (half a build)."""
    built = {}

    def build(arch):
        if arch not in built:
            d = tmp_path_factory.mktemp(arch)
            cmd = ["nvcc", "-std=c++17", "-fmad=false", f"-arch={arch}", "-cubin", "-keep", "-keep-dir", str(d),
                   "-o", str(d / "kernels.cubin"), KERNELS_CU]
            res = subprocess.run(cmd, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-4000:]
            built[arch] = d
        return built[arch]
    return build


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_120a"])
def test_nvcc_compiles(arch, nvcc_cubin):
    assert (nvcc_cubin(arch) / "kernels.cubin").stat().st_size > 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_blackwell_sr_uses_cvt_rs_only_where_it_exists(nvcc_cubin):
    """SPEC 4: sm_100a encodes SR with cvt.rs.satfinite.e2m1x4.f32; sm_120a has no cvt.rs (PTX ISA
    8.7) and must compute the same rule in integers; Hopper likewise."""
    counts = {arch: (nvcc_cubin(arch) / "kernels.ptx").read_text().count("cvt.rs.satfinite.e2m1x4.f32")
              for arch in ("sm_90a", "sm_100a", "sm_120a")}
    assert counts["sm_100a"] > 0 and counts["sm_90a"] == 0 and counts["sm_120a"] == 0, counts


def test_nv_amax_variant(monkeypatch):
    """Which pre-passes nv_amax takes (kernels.nv_amax_variant), and FP4_NV_AMAX=fused keeps them all fused."""
    f32, bf16 = kernels._SRC_KIND[torch.float32], kernels._SRC_KIND[torch.bfloat16]
    monkeypatch.delenv("FP4_NV_AMAX", raising=False)
    assert kernels.nv_amax_variant("rows", bf16, 64, 128, 0, False) == 0  # the default: the nv_amax kernel
    monkeypatch.setenv("FP4_NV_AMAX", "kernel")
    assert kernels.nv_amax_variant("rows", bf16, 64, 128, 0, False) == 0
    assert kernels.nv_amax_variant("rows", f32, 64, 128, 16, False) == 0
    assert kernels.nv_amax_variant("cols", bf16, 64, 128, 16, False) == 2
    assert kernels.nv_amax_variant("cols", bf16, 64, 129, 0, False) == 1
    assert kernels.nv_amax_variant("cols", f32, 64, 128, 0, False) == 1
    for args in (("rows", bf16, 64, 128, 0, True), ("rows", bf16, 64, 128, 32, False), ("cols", 4, 64, 128, 16, False),
                 ("rows", bf16, 1 << 16, 1 << 19, 0, False), ("rows", bf16, 64, 128, 128, False)):
        assert kernels.nv_amax_variant(*args) is None, args
    monkeypatch.setenv("FP4_NV_AMAX", "fused")
    assert kernels.nv_amax_variant("rows", bf16, 64, 128, 0, False) is None
    with open(KERNELS_CU) as f:  # the grid's CTAs an SM are what the kernel's launch bounds ask for
        minb = kernels._NV_AMAX_CTAS_PER_SM
        assert f"#define FP4_NVA_MINB(H) ((H) ? {minb[16]} : {minb[0]})" in f.read()


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


@gpu
@pytest.mark.parametrize("opts", BAD_OPTIONS)
def test_dispatch_errors_match_reference(opts):
    """Bad options on a CUDA tensor raise the reference's error before any launch (quantize and
    requantize check once, in fp4._check_quantize, then dispatch)."""
    opts = dict(opts)
    x = torch.randn(opts.pop("shape", (32, 64)))
    fmt = opts.pop("fmt")
    with pytest.raises((ValueError, TypeError)) as want:
        fp4.quantize(x, fmt, **opts)
    with pytest.raises(type(want.value)) as got:
        fp4.quantize(x.cuda(), fmt, **opts)
    assert str(got.value) == str(want.value)


def test_sign_words():
    signs = torch.tensor([1.0, -1.0] * 32 + [-1.0] * 64)
    assert kernels.sign_words(signs) == [0xAAAAAAAA, 0xAAAAAAAA, 0xFFFFFFFF, 0xFFFFFFFF]
    assert kernels.sign_words(torch.tensor([-1.0] + [1.0] * 15)) == [1, 0, 0, 0]


# ---------------------------------------------------------------------------------------------
# CPU: every launcher checks its arguments on the host, before any launch (the checks fire on
# CPU tensors: kernels.launch is replaced by a recorder). A wrong pointer handed to a kernel reads
# out of bounds and poisons the CUDA context for the rest of the process, self-checks included.

@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "launch", lambda device, name, grid, block, args: calls.append(name))
    monkeypatch.setattr(kernels, "_sm_count", lambda index: 132)
    monkeypatch.setattr(kernels, "_nv_amax_wave", lambda index, hadamard: 660)
    return calls


def refused(match, fn, *args, launches):
    """fn(*args) raises a ValueError matching `match` and launched nothing."""
    before = len(launches)
    with pytest.raises(ValueError, match=match):
        fn(*args)
    assert len(launches) == before


def _q(fmt, shape=(64, 128), **kw):
    return fp4.quantize(torch.randn(*shape), fmt, **kw)


def test_launch_refuses_a_non_cuda_device():
    with pytest.raises(ValueError, match="launches on a CUDA device, got cpu"):
        kernels.launch(torch.device("cpu"), "dequant<0>", (1,), (256,), ())


def test_quantize_launcher_refusals(launches):
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    kernels.quantize(x, x, "mxfp4", 1, "absmax", "rn", 0, None, 0, False)
    kernels.quantize(x, x, "nvfp4", 1, "absmax", "sr", 16, fp4.random_signs(16, 1), 3, False)
    assert launches, "valid arguments reach the launch"
    n = len(launches)
    xi = torch.zeros(64, 128, dtype=torch.int32)
    refused("dense input must be a float32, bfloat16 or float16 tensor", kernels.quantize, xi, xi, "mxfp4", 1,
            "absmax", "rn", 0, None, 0, False, launches=launches)
    x48 = torch.randn(64, 48)
    refused("quantized dim 48 is not a multiple of the kernel's group 32", kernels.quantize, x48, x48, "mxfp4", 1,
            "absmax", "rn", 0, None, 0, False, launches=launches)
    seed = formats.DeviceSeed(torch.zeros(1, dtype=torch.int32, device="meta"))
    refused("'DeviceSeed' is on meta, the launch on cpu", kernels.quantize, x, x, "mxfp4", 1, "absmax", "sr", 0,
            None, seed, False, launches=launches)
    assert len(launches) == n


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_qtensor_launcher_refusals(fmt, launches):
    """dequantize, requantize and fold take a QTensor: codes, scales and tensor scale on the launch
    device, in the QTensor layout (codes (R, K/2), scales (R, K/block)), NVFP4 with its tensor scale."""
    q = _q(fmt)
    kernels.dequantize(q, torch.float32)
    kernels.requantize(q, fmt, "absmax", "sr", 0, None, 5)
    assert len(launches) >= 2
    bad = {
        "'scales' must hold \\(64, \\d+\\) elements": dataclasses.replace(q, scales=q.scales.t().contiguous()),
        "'scales' is on meta, the launch on cpu": dataclasses.replace(q, scales=q.scales.to("meta")),
        "'codes' must be torch.uint8": dataclasses.replace(q, codes=q.codes.view(torch.int8)),
        "'scales' must hold": dataclasses.replace(q, scales=q.scales[:32]),
    }
    if fmt == "nvfp4":
        bad["'tensor_scale' must be a tensor"] = dataclasses.replace(q, tensor_scale=None)
        bad["'tensor_scale' is on meta"] = dataclasses.replace(q, tensor_scale=q.tensor_scale.to("meta"))
    for match, bq in bad.items():
        refused(match, kernels.dequantize, bq, torch.float32, launches=launches)
        refused(match, kernels.requantize, bq, fmt, "absmax", "sr", 0, None, 5, launches=launches)
    if fmt == "mxfp4":
        kernels.fold(q)
        refused("'scales' must hold", kernels.fold, bad["'scales' must hold"], launches=launches)
    else:
        refused("fold_mx: folds MXFP4 QTensors, got nvfp4", kernels.fold, q, launches=launches)


def test_rotate_back_refuses_a_mask_that_is_not_the_forward_quantize_layout(launches):
    """The clip mask is the forward quantize's (M, K/8) bit layout, on the gradient's device: a mask
    left on another device (the self-check's probe did this: an illegal address on the GPU, then a
    dead CUDA context), transposed, of another dtype or size is refused before the launch."""
    q = _q("mxfp4", scale_rule="quest", hadamard=32)
    d = torch.randn(64, 128, dtype=torch.bfloat16)
    kernels.rotate_back(d, q.mask, 32)
    assert launches == ["rotate_back<1, 32>"]
    m = q.mask
    for match, mask in (("'mask' is on meta, the launch on cpu", m.to("meta")),
                        ("'mask' must hold \\(64, 16\\) elements, got shape \\(128, 8\\)", _q("mxfp4", (128, 64), scale_rule="quest", hadamard=32).mask),
                        ("'mask' must be torch.uint8", m.view(torch.int8)),
                        ("'mask' must hold", m[:32]),
                        ("'mask' must be contiguous", torch.zeros(16, 64, dtype=torch.uint8).t())):
        refused(match, kernels.rotate_back, d, mask, 32, launches=launches)
    refused("the Hadamard size must be 32, 64 or 128", kernels.rotate_back, d, m, 16, launches=launches)
    refused("must be a multiple of 128", kernels.rotate_back, torch.randn(64, 96), m, 128, launches=launches)
    refused("dense input must be", kernels.rotate_back, d.int(), m, 32, launches=launches)


def test_adamw_launcher_refusals(launches):
    import optim
    p = torch.nn.Parameter(torch.randn(33, 128))
    p.grad = torch.randn(33, 128)
    opt = optim.AdamW([p], lr=1e-2, state="nvfp4", hadamard=128, mean="block", fused=False, seed=3)
    opt.step()  # the reference builds the packed states
    st, group = opt.state[p], opt.param_groups[0]
    c = optim._nvfp4_scalars(group, 2)
    m, v = st["exp_avg"], st["exp_avg_sq"]
    kernels.adamw_nvfp4(p.detach(), p.grad, m, v, 128, "sr", "sr", c, True, (1, 2))
    assert launches == ["adamw_nvfp4<128, 1, 1, true, true>"] * 2
    for match, args in (
            ("'grad' must hold \\(33, 128\\)", (p.detach(), p.grad[:32], m, v)),
            ("'grad' must be torch.float32", (p.detach(), p.grad.bfloat16(), m, v)),
            ("'exp_avg codes' is on meta", (p.detach(), p.grad, m | {"codes": m["codes"].to("meta")}, v)),
            ("'exp_avg_sq mean' must be a tensor", (p.detach(), p.grad, m, v | {"mean": None})),
            ("'exp_avg_sq scales' must hold", (p.detach(), p.grad, m, v | {"scales": v["scales"][:, :4]})),
            ("last dim divisible by 128", (torch.randn(33, 64), torch.randn(33, 64), m, v))):
        refused(match, kernels.adamw_nvfp4, *args, 128, "sr", "sr", c, True, (1, 2), launches=launches)


@pytest.mark.parametrize("family", ["quantize", "sr", "dequantize", "requantize", "fold", "rotate_back"])
def test_kernel_self_check_probes_pass_the_launch_checks(family, launches):
    """Each kernel family's first-use check, run on a device of its own ('meta': tensors without
    data, so a probe tensor left on the CPU is refused as it would be on a GPU), reaches its launches
    through every host check; reading the (dataless) outputs back is the only thing that fails."""
    try:
        fp4._check_kernel(family)(torch.device("meta"))
    except (NotImplementedError, RuntimeError) as err:  # copying meta outputs to the CPU
        assert "meta" in str(err), err
    assert launches, f"kernel.{family}'s check launched nothing"
