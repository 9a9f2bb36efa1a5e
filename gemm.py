"""
gemm.py: Triton GEMMs whose epilogue PyTorch's cuBLAS calls cannot express (DESIGN.md "Triton,
where it is the right tool"); fp4.py's mm backend 'triton' (the NVFP4 GEMM on Hopper).

    mm_scaled(a, b, g, out_dtype) = round_out_dtype( fp32(a @ b.T) * g )

a (M, K) and b (N, K) BF16, K contiguous; g one FP32 number on the device (or None: 1).

Why (SPEC 7, 8.3): Hopper has no FP4 tensor cores, but an NVFP4 element's code * E4M3 block scale
has at most 6 significant bits and is exact in BF16, so the dequantized operands without their
tensor scales go into the BF16 tensor cores exactly and the FP32-accumulated product is the FP4
GEMM up to FP32 summation order. The tensor scales (SPEC 2: value = code * s_b * g) do not fit
BF16: g multiplies the FP32 accumulator once and the product is rounded to BF16 once, as it is
stored. torch.mm cannot do that multiply: addmm's alpha is a host number (reading g from the device
would sync), and _scaled_mm's device-side scales take FP8 operands only. So the bf16 backend writes
the FP32 product to memory and reads it back to scale and round it (fp4._mm_bf16): 8 bytes an output
element more than this kernel, which does it in registers and writes BF16 once.

Numerics, the same as fp4._mm_bf16's: exact products, FP32 sums (any order), one FP32 multiply by g,
one rounding to nearest even into out_dtype. mm_scaled_reference is the PyTorch twin. On exact
probes (every partial sum exact in FP32) the kernel and the twin agree bit for bit
(epilogue_mismatches, test_gemm.py); elsewhere within the FP32-accumulation bound of test_gemm.py.

Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (tests). Triton 3.6's interpreter multiplies
BF16 dot operands wrongly and truncates FP32 -> BF16: there the dot runs on the same values in FP32
(exact products, FP32 sums) and the rounding is done on the bits (_round_bf16).
"""
import contextlib
import functools
import os
import types
from typing import NamedTuple

import torch

import selfcheck

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: fp4.py keeps the bf16 backend; nothing here is launched
    triton = None
    tl = types.SimpleNamespace(constexpr=None)  # lets the kernel's annotations evaluate

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_LIMIT = 2**31  # the kernel indexes with int32: every operand and the output below 2^31 elements


class Config(NamedTuple):
    """A launch: a BM x BN output tile a program, BK of K a step, GROUP_M row tiles a group (L2
    reuse), num_stages software-pipelined loads in flight, num_warps warps a program."""
    bm: int
    bn: int
    bk: int
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8


# Hopper (sm_90, 227 KB shared memory a block): Triton's matmul tutorial's fastest H100 tile, 128 x 256
# with K steps of 64, 3 stages (3 * (128 + 256) * 64 * 2 bytes = 144 KB), 8 warps (two warpgroups of
# wgmma). The 1B shapes (M = 16384 tokens; bench_ops.section_gemm) give 128 to 5632 such tiles for
# 132 SMs. Not yet timed on a GPU: bench.py --sections gemm times it and HOPPER_ALT against cuBLAS.
HOPPER = Config(128, 256, 64, 8, 3, 8)
HOPPER_ALT = Config(128, 128, 64, 8, 4, 8)  # the bench's second candidate (more tiles, deeper pipeline)
# sm_80 / sm_89 (164 / 100 KB shared memory): the tutorial's 128 x 128 x 32, 4 stages (64 KB), 4 warps.
# Also the interpreter's default (few, large blocks: fewer NumPy steps).
OTHER = Config(128, 128, 32, 8, 4, 4)


def config_for(device):
    """The launch mm_scaled uses on `device` when none is given: HOPPER where a block has Hopper's
    shared memory (sm_90, sm_100; sm_120 has ~100 KB), else OTHER."""
    if device.type != "cuda":
        return OTHER
    index = device.index if device.index is not None else torch.cuda.current_device()
    return HOPPER if _capability(index)[0] in (9, 10) else OTHER


@functools.cache
def _capability(index):  # asked on every GEMM: cached per device (a properties query otherwise)
    return torch.cuda.get_device_capability(index)


def refusals(m, n, k, out_dtype):
    """What mm_scaled would refuse of an (M, K) x (N, K) -> out_dtype GEMM (fp4.mm_refusals asks it
    first, so that the default dispatch takes the bf16 backend instead of raising)."""
    out = [] if out_dtype in OUT_DTYPES else [f"out_dtype {out_dtype} is not one of {OUT_DTYPES}"]
    for name, rows, cols in (("a", m, k), ("b", n, k), ("the output", m, n)):
        if rows * cols >= INDEX_LIMIT:
            out.append(f"{name} has {rows * cols} elements (int32 indexing: fewer than 2^31)")
    return out


def _check(a, b, g, out_dtype):
    """One ValueError naming the argument the kernel cannot take (a raw pointer carries no metadata)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 2:
            what = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"mm_scaled: {name} must be a 2-D BF16 tensor, got {what}")
        if not t.is_contiguous():
            raise ValueError(f"mm_scaled: {name} must be contiguous (K innermost), got strides {t.stride()}")
    if b.device != a.device:
        raise ValueError(f"mm_scaled: b is on {b.device}, a on {a.device}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"mm_scaled: b must be (N, K) with a's K = {a.shape[1]}, got {tuple(b.shape)}")
    tensor = isinstance(g, torch.Tensor)
    if g is not None and not (tensor and g.numel() == 1 and g.dtype == torch.float32 and g.device == a.device):
        what = f"{g.dtype} of {g.numel()} elements on {g.device}" if tensor else type(g).__name__
        raise ValueError(f"mm_scaled: g must be one FP32 number on {a.device}, got {what}")
    refused = refusals(a.shape[0], b.shape[0], a.shape[1], out_dtype)
    if refused:
        raise ValueError(f"mm_scaled: {'; '.join(refused)}")
    if a.is_cuda and triton is None:
        raise ValueError("mm_scaled: needs Triton (it ships with CUDA builds of PyTorch)")
    if not a.is_cuda and not interpreting():
        raise ValueError(f"mm_scaled: a is on {a.device}: the kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1")


def interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def mm_scaled(a, b, g=None, out_dtype=torch.bfloat16, config=None):
    """round_out_dtype(fp32(a @ b.T) * g): a (M, K), b (N, K) BF16; g an FP32 one-element tensor on
    a's device, or None (1); config: a Config (tests pass small blocks), or None for config_for."""
    _check(a, b, g, out_dtype)
    (m, k), n = a.shape, b.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if c.numel() == 0:
        return c
    cfg = config or config_for(a.device)
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn),)
    # Triton launches on the current device (and its current stream): make it a's
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        _mm_scaled_kernel[grid](a, b, c, a if g is None else g, m, n, k,
                                BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, EVEN_K=k % cfg.bk == 0,
                                HAS_G=g is not None, INTERP=interpreting(),
                                num_stages=cfg.num_stages, num_warps=cfg.num_warps)
    return c


def mm_scaled_reference(a, b, g=None, out_dtype=torch.bfloat16):
    """The PyTorch twin, the definition: the FP32 product of the BF16 operands (exact products, FP32
    sums; BF16 values are exact in TF32 too), one FP32 multiply by g, one rounding into out_dtype."""
    acc = a.float() @ b.float().t()  # (M, N)
    return (acc if g is None else acc * g.reshape(())).to(out_dtype)


# ---------------------------------------------------------------------------------------------
# The kernel: one program an output tile, the K loop on the tensor cores, the epilogue in registers

_jit = triton.jit if triton is not None else (lambda fn: fn)


@_jit
def _mm_scaled_kernel(a_ptr, b_ptr, c_ptr, g_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, HAS_G: tl.constexpr, INTERP: tl.constexpr):
    """C[tile] = round(fp32(A[rows] @ B[cols]^T) * g); A (M, K), B (N, K), C (M, N), all row-major."""
    # Grouped ordering (Triton's matmul tutorial): consecutive programs sweep GROUP_M row tiles down
    # one column of tiles before moving right, so the B tiles they share stay in L2.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = GROUP_M * tiles_n
    first_m = (pid // group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m
    # Rows and columns past M, N wrap around (their loads stay in bounds, their results are not
    # stored), so only K needs a load mask, and only where K is not a multiple of BK.
    rm = (pid_m * BM + tl.arange(0, BM)) % M  # (BM,)
    rn = (pid_n * BN + tl.arange(0, BN)) % N  # (BN,)
    rk = tl.arange(0, BK)  # (BK,)
    a_ptrs = a_ptr + rm[:, None] * K + rk[None, :]  # (BM, BK)
    b_ptrs = b_ptr + rn[None, :] * K + rk[:, None]  # (BK, BN): B^T's tile, K along the rows
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:  # zeros past K add nothing: 0 * 0 (a NaN or Inf in range still reaches its row)
            a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BK, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < K - k * BK, other=0.0)
        acc = _dot(a, b, acc, INTERP)
        a_ptrs += BK
        b_ptrs += BK
    # The epilogue (SPEC 2's tensor scale): one FP32 multiply, one rounding, one store.
    if HAS_G:
        acc = acc * tl.load(g_ptr)
    cm = pid_m * BM + tl.arange(0, BM)
    cn = pid_n * BN + tl.arange(0, BN)
    c_ptrs = c_ptr + cm[:, None] * N + cn[None, :]
    mask = (cm[:, None] < M) & (cn[None, :] < N)
    if c_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(c_ptrs, _round_bf16(acc, INTERP), mask=mask)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@_jit
def _dot(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b, FP32 accumulation; in the interpreter on the same values in FP32 (module doc)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@_jit
def _round_bf16(x, INTERP: tl.constexpr):
    """FP32 -> BF16 to nearest, ties to even (the GPU's cvt.rn). The interpreter truncates: there the
    bits are rounded first (finite x; NaN stays NaN), after which its truncation is exact."""
    if INTERP:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


# ---------------------------------------------------------------------------------------------
# The epilogue's own probe (fp4.py's mm.triton self-check adds it to the mm probes)

def epilogue_probe(m=150, n=90, k=200):
    """BF16 operands whose every partial sum is exact in FP32 (integers in [-8, 8] times 2^-2..2^2:
    multiples of 2^-4 below 2^18), a NaN in row 3 and an Inf in column 5 of b, and a tensor scale
    with a full mantissa. fp4's mm probes have power-of-two tensor scales, where g = 1: a kernel that
    skipped the multiply would pass them. Ragged on purpose: no dimension a multiple of a tile."""
    gen = torch.Generator().manual_seed(29)

    def operand(rows):
        ints = torch.randint(-8, 9, (rows, k), generator=gen).float()
        return (ints * 2.0 ** torch.randint(-2, 3, (rows, k), generator=gen)).to(torch.bfloat16)
    a, b = operand(m), operand(n)
    a[3, 7], b[5, 11] = float("nan"), float("inf")
    return a, b, torch.tensor(0.3, dtype=torch.float32)


def epilogue_mismatches(device, config=None):
    """The kernel against its twin on the epilogue probe, BF16 and FP32 outputs: bit for bit."""
    a, b, g = epilogue_probe()
    bad = []
    for out_dtype in (torch.bfloat16, torch.float32):
        got = mm_scaled(a.to(device), b.to(device), g.to(device), out_dtype, config)
        bad += selfcheck.mismatches(got, mm_scaled_reference(a, b, g, out_dtype), f"epilogue {str(out_dtype)[6:]} ")
    return bad
