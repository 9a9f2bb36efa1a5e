"""The Triton GEMM with the tensor scales in its epilogue (gemm.py; fp4.py's mm backend 'triton').

Tested as the bf16 backend is: bit for bit on exact probes (every partial sum exact in FP32, so any
summation order gives the same bits) against the emulated mm and the kernel's PyTorch twin, and on
random NVFP4 operands within the bound of an FP32-accumulated product. The bound, against the exact
product P = S g_ab (S = sum_k a_k b_k of the exact BF16 operands code * s, g_ab = g_a g_b the tensor
scales, SPEC 2), with T = sum_k |a_k b_k| g_ab:
  acc = S + e, |e| <= gamma_K T / g_ab       FP32 sums of exact products, any order (Higham 3.1)
  g = g_ab (1 + d2), y = acc g (1 + d3)      fp4 forms g in one FP32 product; one FP32 multiply
  => |y - P| <= gamma_(K+2) T,  gamma_n = n u / (1 - n u)
  BF16 output: |out - y| <= 2^-8 |out|       round to nearest, 8 significant bits
u = 2^-24 for round-to-nearest sums (the interpreter's NumPy); 2^-23 on a GPU, whose tensor cores
are reported to align addends by truncation (Fasi, Higham, Mikaitis, Pranesh 2021: at most twice
the round-to-nearest error an addition). A g wrong by 2^-6 misses this bound in most elements.

The kernel's tests run under TRITON_INTERPRET=1, which must be set before triton.jit decorates:
test_kernels_under_triton_interpret runs this file's test_interp_* tests in a subprocess with it set
(`TRITON_INTERPRET=1 python -m pytest test_gemm.py -k test_interp_` does the same by hand). The GPU
tests skip without CUDA. Speed is not a test: `python bench.py --sections gemm` (bench_ops.py).
"""
import os
import subprocess
import sys

import pytest
import torch

import fp4
import gemm
import selfcheck

INTERP = gemm.interpreting()
interp = pytest.mark.skipif(not (INTERP and gemm.triton is not None),
                            reason="runs under TRITON_INTERPRET=1 (test_kernels_under_triton_interpret's subprocess)")
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and gemm.triton is not None and not INTERP),
                         reason="needs a CUDA GPU and Triton")
SMALL = gemm.Config(16, 16, 32, group_m=4, num_stages=1, num_warps=1)  # many tiles, a partial group
F32_TINY = 2.0**-149


@pytest.fixture(autouse=True)
def fresh():
    selfcheck.reset()  # each test is a fresh process for the first-use checks
    yield
    selfcheck.reset()


def patch_interpreter():
    """Triton 3.6's interpreter takes int() of one-element arrays (a loop bound from a kernel
    argument), which NumPy 2.4 refuses: read the element instead."""
    import numpy as np
    import triton.runtime.interpreter as interpreter
    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    interpreter._patch_lang_tensor = patched


if INTERP and gemm.triton is not None:
    patch_interpreter()


def nvfp4_pair(m, n, k, device="cpu", seed=0):
    """NVFP4 operands (M, K) and (N, K) with tensor scales of full mantissas (amax / 2688)."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g) * 3.7, torch.randn(n, k, generator=g) * 0.013
    return fp4.quantize(x.to(device), "nvfp4"), fp4.quantize(w.to(device), "nvfp4")


def off_bound(got, a, b, unit):
    """Elements of mm(a, b) = got beyond the bound of the module doc: a boolean (M, N) tensor."""
    def values(q):  # code * s, exactly, before the tensor scale
        return fp4.dequantize(fp4.QTensor(q.codes, q.scales, torch.ones((), device=q.codes.device), q.fmt, q.shape, q.axis)).double()
    ua, ub = values(a), values(b)
    g_ab = a.tensor_scale.double() * b.tensor_scale.double()  # exact in FP64 (24 x 24 bits)
    exact, mass = (ua @ ub.t()) * g_ab, (ua.abs() @ ub.abs().t()) * g_ab
    n = a.lead_shape[1] + 2
    bound = n * unit / (1 - n * unit) * mass + 2 * F32_TINY
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * got.double().abs()
    return (got.double() - exact).abs() > bound


# --- on the CPU: the host checks, the dispatch, the check's fallback ---------------------------------

def bf16(*shape):
    return torch.ones(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("args, match", [
    ((bf16(4, 8).float(), bf16(2, 8), None), "a must be a 2-D BF16 tensor, got torch.float32"),
    ((bf16(4, 8), bf16(2, 8, 1), None), r"b must be a 2-D BF16 tensor, got torch.bfloat16 of shape \(2, 8, 1\)"),
    ((bf16(8, 4).t(), bf16(2, 8), None), r"a must be contiguous \(K innermost\), got strides \(1, 4\)"),
    ((bf16(4, 8), bf16(2, 8).to("meta"), None), "b is on meta, a on cpu"),
    ((bf16(4, 8), bf16(2, 6), None), r"b must be \(N, K\) with a's K = 8, got \(2, 6\)"),
    ((bf16(4, 8), bf16(2, 8), torch.ones(2)), "g must be one FP32 number on cpu, got torch.float32 of 2 elements on cpu"),
    ((bf16(4, 8), bf16(2, 8), torch.ones((), dtype=torch.float64)), "g must be one FP32 number on cpu, got torch.float64"),
    ((bf16(4, 8), bf16(2, 8), torch.ones((), device="meta")), "g must be one FP32 number on cpu, got .* on meta"),
    ((bf16(4, 8), bf16(2, 8), 0.5), "g must be one FP32 number on cpu, got float"),
])
def test_host_checks_name_the_argument(args, match):
    with pytest.raises(ValueError, match="^mm_scaled: " + match):
        gemm.mm_scaled(*args)


def test_refusals_are_the_dispatchs():
    """What the kernel cannot take (int32 indexing, an integer output) is refused before launch, and
    fp4.mm_refusals says the same, so the default dispatch takes the bf16 backend instead."""
    with pytest.raises(ValueError, match=r"out_dtype torch.int32 is not one of"):
        gemm.mm_scaled(bf16(4, 8), bf16(2, 8), None, torch.int32)
    assert gemm.refusals(2**16, 2**15, 2**15, torch.bfloat16) == [  # b: 2^30 elements, taken
        "a has 2147483648 elements (int32 indexing: fewer than 2^31)",
        "the output has 2147483648 elements (int32 indexing: fewer than 2^31)"]
    a, b = fp4.mm_probe("nvfp4")
    assert fp4.mm_refusals("triton", a, b, torch.bfloat16) == fp4.mm_refusals("triton", a, b, torch.float32) == []
    assert fp4.mm_refusals("triton", a, b, torch.int8) == gemm.refusals(144, 80, 256, torch.int8) != []
    if not INTERP:
        with pytest.raises(ValueError, match="runs on CUDA, or on the CPU under TRITON_INTERPRET=1"):
            gemm.mm_scaled(bf16(4, 8), bf16(2, 8))


def test_default_backend(monkeypatch):
    """NVFP4 on Hopper defaults to 'bf16' (measured faster than the Triton GEMM; MXFP4 keeps fp8);
    FP4_NV_GEMM=triton takes the Triton GEMM where Triton is, else bf16; elsewhere bf16;
    FP4_BACKEND=triton asks for it anywhere; its fallback is bf16."""
    monkeypatch.delenv("FP4_BACKEND", raising=False)
    monkeypatch.delenv("FP4_NV_GEMM", raising=False)
    gpu0 = torch.device("cuda", 0)
    monkeypatch.setattr(fp4, "_capability", lambda index: (9, 0))
    triton_here = gemm.triton is not None
    assert (fp4.mm_backend("mxfp4", gpu0), fp4.mm_backend("nvfp4", gpu0)) == ("fp8", "bf16")
    monkeypatch.setenv("FP4_NV_GEMM", "triton")
    assert fp4.mm_backend("nvfp4", gpu0) == ("triton" if triton_here else "bf16")
    monkeypatch.setenv("FP4_NV_GEMM", "cutlass")
    with pytest.raises(ValueError, match="FP4_NV_GEMM='cutlass': choose triton or bf16"):
        fp4.mm_backend("nvfp4", gpu0)
    monkeypatch.setenv("FP4_NV_GEMM", "triton")
    monkeypatch.setattr(gemm, "triton", None)
    assert fp4.mm_backend("nvfp4", gpu0) == "bf16"
    assert selfcheck.CHECKS["mm.triton"].available(gpu0) == "no Triton"
    monkeypatch.undo()
    monkeypatch.delenv("FP4_NV_GEMM", raising=False)
    for cc in ((8, 0), (8, 9)):
        monkeypatch.setattr(fp4, "_capability", lambda index, cc=cc: cc)
        assert fp4.mm_backend("nvfp4", gpu0) == "bf16"
        assert selfcheck.CHECKS["mm.triton"].available(gpu0) == (None if triton_here else "no Triton")
    monkeypatch.setattr(fp4, "_capability", lambda index: (7, 5))
    assert selfcheck.CHECKS["mm.triton"].available(gpu0) in ("not on sm_75", "no Triton")
    monkeypatch.setenv("FP4_BACKEND", "triton")
    assert fp4.mm_backend("nvfp4", "cpu") == "triton" and fp4._MM_FALLBACK["triton"] == "bf16"
    assert selfcheck.CHECKS["mm.triton"].available(torch.device("cpu")) == "no CUDA device"


@pytest.mark.parametrize("drops_g", [False, True])
def test_check_catches_a_kernel_without_the_multiply(monkeypatch, drops_g):
    """The registered check of mm.triton, with the twin standing in for the kernel: it passes; the
    twin without its multiply by g passes the mm probes (their tensor scales are powers of two,
    g = 1) and is caught by the epilogue probe: the default backend falls back to bf16, warning once."""
    def standin(a, b, g=None, out_dtype=torch.bfloat16, config=None):
        return gemm.mm_scaled_reference(a, b, None if drops_g else g, out_dtype)
    monkeypatch.setattr(gemm, "mm_scaled", standin)
    cpu = torch.device("cpu")
    if not drops_g:
        assert fp4.checked_backend("triton", cpu) == "triton"
        return
    assert not [ln for ln in fp4._mm_check("triton")(cpu) if not ln.startswith("epilogue")]
    with pytest.warns(RuntimeWarning, match=r"mm\.triton on cpu .*FAILED.*epilogue bfloat16 .*got .*want"):
        assert fp4.checked_backend("triton", cpu) == "bf16"
    assert fp4.checked_backend("triton", cpu) == "bf16"  # cached
    assert list(selfcheck.summary()["fallbacks"]) == ["mm.triton on cpu"]


# --- the kernel in Triton's interpreter (CPU) ------------------------------------------------------

@pytest.mark.skipif(gemm.triton is None or INTERP, reason="needs Triton (its CPU interpreter); runs them from outside it")
def test_kernels_under_triton_interpret():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                          "-k", "test_interp_"], env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    print(res.stdout[-2000:])
    assert res.returncode == 0 and " passed" in res.stdout and "skipped" not in res.stdout, res.stdout[-4000:] + res.stderr[-3000:]


@interp
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "16x16x32"])
def test_interp_probes_bit_for_bit(config):
    """The mm probes (both formats, NaN block scale, 144 x 80 x 256) against the emulated mm, BF16 and
    FP32 outputs; the epilogue probe (150 x 90 x 200: ragged, a NaN and an Inf, g = 0.3) against the
    twin. config None: the registered self-check itself (the default launch)."""
    cpu = torch.device("cpu")
    if config is None:
        assert fp4._mm_check("triton")(cpu) == []
        return
    for fmt in ("mxfp4", "nvfp4"):
        a, b = fp4.mm_probe(fmt)
        for out_dtype in (torch.bfloat16, torch.float32):
            got = gemm.mm_scaled(*fp4._bf16_operands(a, b), out_dtype, config)
            assert selfcheck.mismatches(got, fp4.mm(a, b, out_dtype, backend="emulated")) == []
    assert gemm.epilogue_mismatches(cpu, config) == []


@interp
@pytest.mark.parametrize("shape", [(48, 40, 96), (33, 17, 80), (7, 50, 32)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_interp_random_nvfp4_within_bound(shape, out_dtype):
    """Random NVFP4 operands (full-mantissa tensor scales), ragged shapes: within the module doc's
    bound (u = 2^-24), like the bf16 backend on the same operands; a g off by 2^-6 is not."""
    a, b = nvfp4_pair(*shape, seed=sum(shape))
    a1, b1, g = fp4._bf16_operands(a, b)
    got = gemm.mm_scaled(a1, b1, g, out_dtype, SMALL)
    assert got.shape == shape[:2] and got.dtype == out_dtype
    off = off_bound(got, a, b, 2.0**-24)
    assert not off.any(), f"{int(off.sum())} elements off the bound, first {off.nonzero()[:3].tolist()}"
    assert not off_bound(fp4._mm_bf16(a, b, out_dtype), a, b, 2.0**-24).any()
    wrong = gemm.mm_scaled(a1, b1, g * (1 + 2.0**-6), out_dtype, SMALL)
    assert off_bound(wrong, a, b, 2.0**-24).float().mean() > 0.5


@interp
def test_interp_without_g_and_empty():
    """g None multiplies by nothing (MXFP4); an empty output launches nothing; K = 0 gives zeros."""
    a, b, _ = gemm.epilogue_probe(20, 12, 64)
    got = gemm.mm_scaled(a, b, None, torch.float32, SMALL)
    assert selfcheck.mismatches(got, gemm.mm_scaled_reference(a, b, None, torch.float32)) == []
    assert gemm.mm_scaled(a[:0], b).shape == (0, 12)
    assert torch.equal(gemm.mm_scaled(a[:, :0].contiguous(), b[:, :0].contiguous(), None, torch.float32, SMALL), torch.zeros(20, 12))


# --- GPU ---------------------------------------------------------------------------------------------

@gpu
def test_gpu_probes_bit_for_bit():
    """The registered check with the launch this GPU gets (HOPPER on sm_90), and each candidate
    launch on the epilogue probe: bit for bit."""
    dev = torch.device("cuda")
    assert fp4._mm_check("triton")(dev) == []
    hopper = torch.cuda.get_device_capability() >= (9, 0)  # Hopper's tiles need its shared memory
    for config in ((gemm.HOPPER, gemm.HOPPER_ALT) if hopper else ()) + (gemm.OTHER, SMALL):
        assert gemm.epilogue_mismatches(dev, config) == [], config


@gpu
@pytest.mark.parametrize("k, n", [(2048, 6144), (2048, 2048), (2048, 11264), (5632, 2048)])
def test_gpu_1b_shapes_within_bound(k, n):
    """The 1B linears' shapes (bench_ops.LINEAR_SHAPES, 1024 tokens) through fp4.mm's 'triton'
    backend, forward (M, K) x (N, K) and the weight gradient's long contraction (N, M = 8192 tokens)
    x (K, M): within the bound with u = 2^-23 (tensor cores' truncating accumulation)."""
    for m, kk, nn in ((1024, k, n), (n, 8192, k)):
        a, b = nvfp4_pair(m, nn, kk, "cuda", seed=kk + nn)
        for out_dtype in (torch.bfloat16, torch.float32):
            got = fp4.mm(a, b, out_dtype, backend="triton")
            off = off_bound(got, a, b, 2.0**-23)
            assert not off.any(), (m, kk, nn, out_dtype, int(off.sum()))


@gpu
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="Hopper's default")
def test_gpu_hopper_triton_when_asked(monkeypatch):
    monkeypatch.delenv("FP4_BACKEND", raising=False)
    monkeypatch.setenv("FP4_NV_GEMM", "triton")
    a, b = nvfp4_pair(256, 192, 512, "cuda")
    assert fp4.backends("cuda")["mm_nvfp4"] == "triton"
    assert torch.equal(fp4.mm(a, b), fp4.mm(a, b, backend="triton"))
    assert "mm.triton on cuda" in " ".join(selfcheck.summary()["verified"])
