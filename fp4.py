"""
FP4 training numerics: formats, quantizers, QTensor, GEMM backends, and the self-checks of the
accelerated paths. On a GPU the quantizers run as CUDA kernels (kernels.cu), compiled and launched
by cuda_kernels.py. The FP4 linear layer built on them is linear.py's.

Read top to bottom. The PyTorch reference in the first half is the *definition* of every
number this project produces: the CUDA kernels (kernels.cu) and the GEMM backends are tested
against it, bit for bit where SPEC.md says exact. Section numbers (SPEC x) refer to
../shared/SPEC.md.

Formats (SPEC 1-2):
  mxfp4: E2M1 elements, one E8M0 (power of two) scale per 32 elements along the contraction dim.
  nvfp4: E2M1 elements, one E4M3 scale per 16 elements (or per 16x16 tile), one FP32 tensor scale.

Bit-exactness contract with the kernels (everything in FP32, no fused multiply-add):
  - Hadamard: the butterfly (a, b) -> (a + b, a - b) over strides h = 1, 2, 4, ..., n/2, then one
    multiply by the FP32 constant 1/sqrt(n). Signs (+-1) multiply the input first.
  - Block sums (QuEST's sigma, four_over_six's error, MS-EDEN's correction) are halving trees:
    element j is added to element j + n/2, then the first half is summed the same way. A warp's
    butterfly reduction (__shfl_xor 16, 8, 4, 2, 1 over one element per lane) gives exactly this.
  - Stochastic rounding (SPEC 4: the rule of FP4 hardware) takes 8 random
    bits an element: element i = row * K + k of the QTensor's layout (quantized axis last) takes
    byte i mod 4 of the word W(seed, i div 4), W(seed, j) = lowbias32(lo32(j) ^ key(seed, j >> 32))
    (see random_bytes); code magnitude = ((floor(a * 256 / step) + byte) >> 8) * step.
    MS-EDEN's E4M3 scale rounding keeps its own 24-bit draw (see uniform).
  - Random Hadamard signs: random_signs(n, seed), sign i = bit i mod 32 of
    lowbias32(seed + 0x632BE5AB * (i // 32 + 1)); the kernels derive the same bits from a
    DeviceSeed.
"""
import contextlib
import functools
import os

import torch

import cuda_kernels as kernels  # the CUDA kernels' launchers (kernels.cu through CuPy)
import gemm  # the Triton GEMM of mm backend 'triton' (the tensor scales in its epilogue)
import selfcheck  # first-use checks of the accelerated paths (below: "Self-checks")
from formats import (DeviceSeed, DeviceSigns, e2m1_decode, e2m1_encode, e2m1_encode_sr, E2M1_GRID,
                     e4m3_decode, e4m3_encode, e4m3_encode_sr, E4M3_MAX, E4M3_NAN, e8m0_decode,
                     E8M0_NAN, EDEN_GROUP, FORMATS, hadamard, HADAMARD_SIZES, hash_key, mm_probe, pack, QTensor,
                     qtensor_mismatches, quant_args, quant_probe, QUANT_CASES, QUEST_SCALE, random_bytes,
                     random_signs, ROUNDINGS, SCALE_RULES, SR_CASES, to_device, uniform, unpack,
                     _check_hadamard, _check_input, _fwht, _host_rng, _tree_sum)  # noqa: F401 (re-exported: fp4 is the public API)

# ---------------------------------------------------------------------------------------------
# Block quantization: quantize / dequantize (SPEC 2-4)

def _check_options(fmt, scale_rule, rounding, block2d, k, ndim):
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; allowed: {list(FORMATS)}")
    if scale_rule not in SCALE_RULES[fmt]:
        raise ValueError(f"scale_rule {scale_rule!r} is not defined for {fmt}; allowed: {SCALE_RULES[fmt]}")
    if rounding not in ROUNDINGS[fmt]:
        raise ValueError(f"rounding {rounding!r} is not defined for {fmt}; allowed: {ROUNDINGS[fmt]}")
    bs = FORMATS[fmt]
    if k % bs:
        raise ValueError(f"quantized dim of size {k} is not divisible by the {fmt} block size {bs}")
    if rounding == "eden" and (k % EDEN_GROUP or scale_rule != "absmax"):
        raise ValueError(f"rounding 'eden' needs scale_rule 'absmax' and a quantized dim divisible by {EDEN_GROUP}, got {scale_rule!r} and {k}")
    if block2d and (fmt != "nvfp4" or ndim != 2 or scale_rule != "absmax"):
        raise ValueError("block2d (16x16 tiles) is defined for 2-D nvfp4 tensors with scale_rule 'absmax'")


def quantize(x, fmt="mxfp4", axis=-1, scale_rule="absmax", rounding="rn", hadamard=0, signs=None,
             seed=0, block2d=False, fold=False, amax_reduce=None, index_offset=0):
    """Quantize x along `axis` (the GEMM contraction dim) to a QTensor. If hadamard > 0 the
    blocks are first rotated by H_n (with signs: a random Hadamard). seed drives 'sr'/'eden'.
    fold=True asks the GPU kernels to also emit fold_mx's outputs (QTensor.folded, for the fp8
    GEMM backend) in the same pass where they can; it never changes codes, scales or mask.
    amax_reduce, index_offset: x is a shard (whole rows) of a larger tensor, quantized exactly as
    those rows of the whole tensor would be. amax_reduce maps this shard's finite amax to the whole
    tensor's (an all-reduce MAX over the shards: NVFP4's tensor scale, SPEC 2); index_offset is the
    whole tensor's index of x's first element (row0 * K), where its SR draws start (SPEC 4). These
    run the PyTorch reference, on a GPU too."""
    _check_input(x)
    axis = axis % x.ndim
    xm = x.detach().movedim(axis, -1)
    k = xm.shape[-1]
    signs = _check_quantize(fmt, scale_rule, rounding, hadamard, signs, block2d, xm.shape, x.ndim)
    _check_shard(fmt, rounding, block2d, amax_reduce, index_offset)
    if x.is_cuda and amax_reduce is None and not index_offset and _kernel_ok(x.device, "quantize", rounding):
        fold = fold and _kernel_ok(x.device, "fold")
        return kernels.quantize(x, xm, fmt, axis, scale_rule, rounding, hadamard, signs, seed, block2d, fold)
    seed, signs = _host_rng(seed, signs)
    xf = xm.reshape(-1, k).float()  # (R, K)
    if hadamard:
        xf = _fwht(xf, hadamard, signs)
    if fmt == "mxfp4":
        codes, scales, tscale, mask = _quantize_mx(xf, scale_rule, rounding, seed, index_offset)
    else:
        codes, scales, tscale, mask = _quantize_nv(xf, scale_rule, rounding, seed, block2d, amax_reduce, index_offset)
    lead = xm.shape[:-1]
    mask = None if mask is None else _pack_bits(mask).reshape(*lead, k // 8)
    return QTensor(pack(codes).reshape(*lead, k // 2), scales.reshape(*lead, -1), tscale, fmt,
                   tuple(x.shape), axis, mask)


def _check_quantize(fmt, scale_rule, rounding, hadamard, signs, block2d, moved_shape, ndim):
    """All of quantize's option checks (shared by the reference and the kernels); returns the
    signs as validated host FP32, or None."""
    k = moved_shape[-1]
    _check_options(fmt, scale_rule, rounding, block2d, k, ndim)
    if block2d and moved_shape[0] % 16:
        raise ValueError(f"block2d needs both dims divisible by 16, got {tuple(moved_shape)}")
    if hadamard:
        return _check_hadamard(hadamard, signs, k)
    if signs is not None:
        raise ValueError("signs given without a Hadamard size")
    return None


def _check_shard(fmt, rounding, block2d, amax_reduce, index_offset):
    if amax_reduce is not None and (fmt != "nvfp4" or block2d):
        raise ValueError("amax_reduce is for nvfp4 with 1x16 blocks (a 16x16 tile may straddle shards)")
    if not isinstance(index_offset, int) or index_offset < 0:
        raise ValueError(f"index_offset must be an int >= 0, got {index_offset!r}")
    if index_offset and rounding == "eden":
        raise ValueError("index_offset is for rounding 'rn' or 'sr' (MS-EDEN draws per block)")


def _pack_bits(m):
    w = 1 << torch.arange(8, device=m.device, dtype=torch.uint8)
    return (m.reshape(*m.shape[:-1], -1, 8).to(torch.uint8) * w).sum(-1, dtype=torch.uint8)


def _round(v, rounding, seed, index_offset=0):
    """v (R, K) -> codes; SR draws use the element index index_offset + row * K + k."""
    if rounding == "sr":
        return e2m1_encode_sr(v, random_bytes(seed, v.numel(), v.device, index_offset).view(v.shape))
    return e2m1_encode(v)


def _blocks(xf, bs):
    return xf.view(xf.shape[0], -1, bs)  # (R, K/bs, bs)


def _quantize_mx(xf, scale_rule, rounding, seed, index_offset=0):
    """MXFP4: scale 2^e per 32-block, e in [-127, 127] stored as E8M0 (SPEC 2-3)."""
    xb = _blocks(xf, 32)
    amax = xb.abs().amax(-1)  # (R, K/32); amax propagates NaN
    bad = ~torch.isfinite(amax)  # NaN/Inf in the block -> NaN scale (SPEC 2)
    e = _absmax_exponent(amax)
    if scale_rule == "quest":
        e = _quest_exponent(xb, e)
    e = torch.where(bad, 0, e).clamp(-127, 127)
    scale = torch.where(bad, float("nan"), torch.ldexp(torch.ones_like(amax), e))
    v = (xb / scale.unsqueeze(-1)).view_as(xf)  # exact power-of-two division; NaN in bad blocks
    mask = (v.abs() <= 6) if scale_rule == "quest" else None
    scales = torch.where(bad, E8M0_NAN, e + 127).to(torch.uint8)
    return _round(v, rounding, seed, index_offset), scales, None, mask


def _absmax_exponent(amax):
    """Smallest e with amax / 2^e <= 6, exactly (frexp: amax = m 2^E, m in [0.5, 1)).
    m <= 0.75 -> e = E - 3 (m * 8 <= 6), else e = E - 2. amax = 0 -> -127."""
    m, E = torch.frexp(amax)
    e = torch.where(m <= 0.75, E - 3, E - 2)
    return torch.where(amax == 0, -127, e)


def _quest_exponent(xb, e_absmax):
    """QuEST: 2^floor(log2(0.487079 * sigma)) per block, sigma the block's standard deviation
    (mean(x^2) - mean(x)^2, halving-tree sums). floor(log2 y) = E - 1 with frexp(y) = (m, E).
    A constant block (sigma 0) falls back to the absmax exponent. The sums run on the block in
    units of 2^e_absmax (_unit_scale), and the exponent is shifted back (SPEC 3)."""
    es = e_absmax.clamp(-126, 126)
    xs = xb * _unit_scale(es).unsqueeze(-1)  # |xs| <= 6
    mean = _tree_sum(xs) * (1 / 32)
    mean2 = _tree_sum(xs * xs) * (1 / 32)
    sigma = torch.sqrt((mean2 - mean * mean).clamp(min=0))
    _, E = torch.frexp(sigma * QUEST_SCALE)
    return torch.where(sigma > 0, E - 1 + es, e_absmax)


def _unit_scale(e):
    """2^-e (e clamped to [-126, 126]: a normal FP32) for the sums of squares of QuEST's sigma,
    four_over_six's error and MS-EDEN's correction. Their results are scale-free, but FP32 squares
    overflow above 2^64 (sigma = Inf, all errors Inf: silently the wrong scale) and lose bits below
    2^-63. Multiplying by 2^-e (exact) first brings the block to about 1; where the unscaled
    squares stay normal, every sum is the unscaled one times 2^-2e: the same bits after."""
    e = e.clamp(-126, 126)
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), -e)


def _tensor_scale(block_amax, amax_reduce=None):
    """NVFP4 tensor scale g = amax / (6 * 448), amax over the finite blocks (a NaN/Inf block
    must not poison the others); 1 for an all-zero tensor. amax_reduce: a shard's amax -> the
    whole tensor's (quantize's docstring)."""
    finite_amax = torch.where(torch.isfinite(block_amax), block_amax, 0).amax()
    if amax_reduce is not None:
        finite_amax = amax_reduce(finite_amax)
    g = finite_amax / _full(finite_amax, 6 * E4M3_MAX)
    return torch.where(finite_amax > 0, g, torch.ones_like(g))


def _quantize_nv(xf, scale_rule, rounding, seed, block2d, amax_reduce=None, index_offset=0):
    """NVFP4: E4M3 scale per 16-block (or 16x16 tile), FP32 tensor scale g (SPEC 2-4)."""
    xb = _blocks(xf, 16)
    amax = xb.abs().amax(-1)  # (R, K/16)
    bad = ~torch.isfinite(amax)
    g = _tensor_scale(amax, amax_reduce)
    if block2d:  # one amax per 16x16 tile, repeated on the tile's 16 rows
        r, c = amax.shape
        amax = amax.view(r // 16, 16, c).amax(1, keepdim=True).expand(r // 16, 16, c).reshape(r, c)
        bad = bad.view(r // 16, 16, c).any(1, keepdim=True).expand(r // 16, 16, c).reshape(r, c)
    s = e4m3_encode(amax / _full(amax, 6.0) / g)
    if scale_rule == "four_over_six":
        s = _four_over_six(xb, amax, s, g)
    s = torch.where(bad, E4M3_NAN, s)
    v = _nv_divide(xb, s, g).view_as(xf)  # NaN in bad blocks -> code 0
    if rounding == "eden":
        s = torch.where(bad, E4M3_NAN, _eden_scales(xb, e2m1_encode(v), s, g, seed))
        return e2m1_encode(v), s, g, None
    return _round(v, rounding, seed, index_offset), s, g, None


def _full(like, value):
    """value as a tensor of like's shape: CUDA computes tensor / python-number as a multiply by
    the FP32 reciprocal, which rounds differently from the true division the kernels do."""
    return torch.full_like(like, value)


def _nv_divide(xb, s, g):
    """x / (s * g); a zero block scale divides by +inf (every value there rounds to 0)."""
    denom = e4m3_decode(s) * g
    denom = torch.where(denom == 0, float("inf"), denom)
    return xb / denom.unsqueeze(-1)


def _nv_dequant_blocks(codes_b, s, g):
    """(code * s) * g, in that order (kernels do the same)."""
    return e2m1_decode(codes_b) * e4m3_decode(s).unsqueeze(-1) * g


def _four_over_six(xb, amax, s6, g):
    """Quartet II / four-over-six: per 16-block keep the scale mapping amax to 6 or to 4,
    whichever gives the smaller squared error (halving-tree sums of the errors in units of the
    block's 2^e_absmax, _unit_scale; a tie keeps 6)."""
    s4 = e4m3_encode(amax / 4 / g)
    unit = _unit_scale(_absmax_exponent(amax)).unsqueeze(-1)
    errs = []
    for s in (s6, s4):
        q = e2m1_encode(_nv_divide(xb, s, g))
        d = (xb - _nv_dequant_blocks(q, s, g)) * unit
        errs.append(_tree_sum(d * d))
    return torch.where(errs[1] < errs[0], s4, s6)


def _eden_scales(xb, codes, s, g, seed):
    """MS-EDEN (SPEC 4): per 128-group the correction c = sum(x^2) / sum(x q) of the RN values q,
    folded into the group's E4M3 block scales with stochastic rounding. Draws: uniform(seed,
    block index), block index = row * (K/16) + block. The sums take x and q in units of g's
    power of two 2^E (_unit_scale; |x| <= 2688 g < 2^(E + 13)): c is scale-free, the sums not."""
    r, nb, _ = xb.shape
    unit = _unit_scale(torch.frexp(g)[1] - 1)  # 2^-floor(log2 g)
    q = _nv_dequant_blocks(codes.view_as(xb), s, g * unit)  # (code * s) * (g 2^-E): q 2^-E exactly
    xg, qg = (xb * unit).reshape(r, -1, EDEN_GROUP), q.reshape(r, -1, EDEN_GROUP)
    num, den = _tree_sum(xg * xg), _tree_sum(xg * qg)  # (R, K/128)
    c = num / den
    c = torch.where(torch.isfinite(c) & (den > 0), c, torch.ones_like(c))  # zero or non-finite group
    t = e4m3_decode(s) * c.repeat_interleave(EDEN_GROUP // 16, dim=-1)  # (R, K/16)
    return e4m3_encode_sr(t, uniform(seed, r * nb, xb.device).view(r, nb))


def dequantize(q, dtype=torch.float32):
    """QTensor -> tensor of the input's shape (still rotated if a Hadamard was applied)."""
    if q.codes.is_cuda and _kernel_ok(q.codes.device, "dequantize"):
        return kernels.dequantize(q, dtype)
    k = q.lead_shape[-1]
    codes = unpack(q.codes).reshape(-1, k // q.block, q.block)
    scales = q.scales.reshape(codes.shape[:-1])
    if q.fmt == "mxfp4":
        v = e2m1_decode(codes) * e8m0_decode(scales).unsqueeze(-1)
    else:
        v = _nv_dequant_blocks(codes, scales, q.tensor_scale)
    return v.reshape(q.lead_shape).movedim(-1, q.axis).to(dtype)


# ---------------------------------------------------------------------------------------------
# Blackwell scale layout (SPEC 7): cuBLAS's 1D block-scaling-factor layout of 128x4 tiles

def swizzle_scales(scales):
    """(R, C) uint8 block scales -> the flat swizzled layout cuBLAS reads for FP4 GEMMs.
    Pads R to a multiple of 128 and C to a multiple of 4 with zeros; returns (R_pad * C_pad,)."""
    r, c = scales.shape
    rp, cp = -(-r // 128) * 128, -(-c // 4) * 4
    padded = torch.zeros(rp, cp, dtype=scales.dtype, device=scales.device)
    padded[:r, :c] = scales
    tiles = padded.view(rp // 128, 128, cp // 4, 4).permute(0, 2, 1, 3)
    return tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)


def unswizzle_scales(flat, r, c):
    """Inverse of swizzle_scales: the flat swizzled buffer -> (r, c)."""
    rp, cp = -(-r // 128) * 128, -(-c // 4) * 4
    tiles = flat.view(-1, 32, 4, 4).transpose(1, 2).reshape(rp // 128, cp // 4, 128, 4)
    return tiles.permute(0, 2, 1, 3).reshape(rp, cp)[:r, :c]


# ---------------------------------------------------------------------------------------------
# The backward's re-quantization and the Hopper fold (SPEC 5, 7)

def requantize(q, fmt=None, scale_rule="absmax", rounding="sr", hadamard=0, signs=None, seed=0):
    """Dequantize a 2-D QTensor and quantize it along its other axis: the Quartet backward's
    step (dequantize, transpose, random Hadamard, stochastic rounding), without a BF16 copy."""
    if len(q.shape) != 2:
        raise ValueError(f"requantize takes a 2-D QTensor, got shape {q.shape}")
    fmt = fmt or q.fmt
    if q.codes.is_cuda and _kernel_ok(q.codes.device, "requantize", rounding):
        k = q.shape[1 - q.axis]
        signs = _check_quantize(fmt, scale_rule, rounding, hadamard, signs, False, (k,), 2)
        return kernels.requantize(q, fmt, scale_rule, rounding, hadamard, signs, seed)
    seed, signs = _host_rng(seed, signs)
    return quantize(dequantize(q), fmt, 1 - q.axis, scale_rule, rounding, hadamard, signs, seed)


def fold_mx(q):
    """MXFP4 -> FP8 for Hopper's tensor cores (SPEC 7): element = code * 2^(e_block - e_rowmax)
    rounded to E4M3 (exact while a row's block exponents span <= 8 binades), row scale
    2^e_rowmax in FP32 (NaN if a block of the row is NaN). Returns ((R, K) float8_e4m3fn, (R,) FP32)
    with R the product of the lead dims."""
    if q.fmt != "mxfp4":
        raise ValueError(f"fold_mx takes an mxfp4 QTensor, got {q.fmt}")
    if q.folded is not None:
        return q.folded
    if q.codes.is_cuda and _kernel_ok(q.codes.device, "fold"):
        return kernels.fold(q)
    k = q.lead_shape[-1]
    codes = unpack(q.codes).reshape(-1, k // 32, 32)
    nan_block = q.scales.reshape(codes.shape[:-1]) == E8M0_NAN
    e = torch.where(nan_block, -127, q.scales.reshape(codes.shape[:-1]).int() - 127)  # (R, K/32)
    e_row = e.amax(-1)
    rel = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - e_row.unsqueeze(-1))
    elems = (e2m1_decode(codes) * rel.unsqueeze(-1)).reshape(-1, k).to(torch.float8_e4m3fn)
    row = torch.ldexp(torch.ones_like(e_row, dtype=torch.float32), e_row)
    return elems, torch.where(nan_block.any(-1), float("nan"), row)


def transpose_2d(q):
    """The QTensor of W^T for a 2-D QTensor quantized with 16x16 tiles (block2d): the same codes,
    transposed, and the tile scales transposed. No rounding happens (SPEC 5, nvfp4 recipe)."""
    r, k = q.lead_shape
    codes = unpack(q.codes).t().contiguous()  # (K, R)
    tiles = q.scales.view(r // 16, 16, k // 16)[:, 0]  # (R/16, K/16): one scale per tile
    scales = tiles.t().repeat_interleave(16, dim=0).contiguous()  # (K, R/16)
    return QTensor(pack(codes), scales, q.tensor_scale, q.fmt, q.shape, 1 - q.axis, None)


def rotate_back_reference(d, q, n):
    """(d * m) H_n: a gradient d with respect to the rotated, quantized operand of QTensor q, times
    q's clip mask m (QuEST's straight-through estimator; no mask: all ones), rotated back by the
    Hadamard H_n (symmetric: its own inverse), in FP32 and rounded to d's dtype (SPEC 5). The
    reference of kernels.cu's rotate_back; linear.py's backward calls one or the other."""
    m = q.clip_mask()
    return hadamard(d * m if m is not None else d, n)


# ---------------------------------------------------------------------------------------------
# GEMM backends: mm(a, b) = dequantize(a) @ dequantize(b).T (SPEC 7, DESIGN "Backends")

MM_BACKENDS = ("emulated", "bf16", "fp8", "native", "triton")
# Hopper's FP8 tensor cores with use_fast_accum keep partial sums in a narrower accumulator.
# Every folded MXFP4 element is m * 2^(d - 1), m an integer <= 12, d >= -span (the row's block-
# exponent span), so products are multiples of 2^(-2 - span_a - span_b) and at most 36 in size:
# every partial sum is exact while K * 144 * 2^(span_a + span_b) <= 2^FAST_ACCUM_BITS. Measured
# on the H200 (bench.py --sections accum, results/nvidia-h200/linear/bench_accum.json): the fast mode
# keeps 14 significant bits, so it is provably exact only for K <= 113 at span 0. Real layers
# (K >= 2048) therefore use the promoted (exact FP32) mode; the 1.95x fast-mode probe in SPEC 7
# was exact only because its partial sums happened to stay small. 0 disables the fast mode.
FAST_ACCUM_BITS = int(os.environ.get("FP4_FAST_ACCUM_BITS", "14"))


def mm(a, b, out_dtype=torch.bfloat16, backend=None):
    """dequantize(a) @ dequantize(b).T for QTensors a (M, K) and b (N, K) quantized along K."""
    _check_mm(a, b)
    if backend is None:  # the default is self-checked on first use; a backend asked for runs as asked
        backend = checked_backend(mm_backend(a.fmt, a.codes.device), a.codes.device)
        while mm_refusals(backend, a, b, out_dtype):  # operands it would refuse: its exact fallback
            backend = _MM_FALLBACK[backend]
    if backend not in MM_BACKENDS:
        raise ValueError(f"unknown mm backend {backend!r}; allowed: {MM_BACKENDS}")
    if backend == "emulated":  # the definition: FP32 values, an FP32 GEMM (never TF32)
        with ieee_fp32(a.codes.device):
            return (_dequantize_lead(a) @ _dequantize_lead(b).t()).to(out_dtype)
    if not a.codes.is_cuda and backend != "bf16":
        raise ValueError(f"mm backend {backend!r} needs CUDA tensors; use 'emulated' or 'bf16' on the CPU")
    return {"bf16": _mm_bf16, "fp8": _mm_fp8, "native": _mm_native, "triton": _mm_triton}[backend](a, b, out_dtype)


def mm_refusals(backend, a, b, out_dtype, cc=None):
    """What `backend` would refuse in mm(a, b): the libraries' own rules, stated here and checked
    before any call, so that neither a self-check probe nor a training shape reaches a GEMM that
    raises or reads out of bounds. cc: the device's compute capability (read from a's device if
    None). An empty list: the backend takes them."""
    if backend in ("emulated", "bf16") or (backend == "fp8" and a.fmt != "mxfp4"):
        return []  # torch.mm takes any shape (fp8 sends NVFP4 to the bf16 backend)
    (m, k), n = a.lead_shape, b.lead_shape[0]
    if backend == "triton":  # any shape (masked tiles); int32 indexing, a floating-point output
        return gemm.refusals(m, n, k, out_dtype)
    # torch._scaled_mm's own checks: mat1 (M, K) with K % 16, mat2 (K, N) with K % 16 and N % 16
    # (16-byte leading dims). FP4 operands pack 2 codes a byte, so their K needs 32; M % 16 is asked
    # of the native path too, a margin (not run on Blackwell here) that costs training nothing: its
    # dims are multiples of 32 (_dim_multiple). The block scales are padded to 128x4 tiles by
    # swizzle_scales, so M and N need no more.
    need = {"fp8": 16, "native": 32}[backend]
    out = [f"K = {k} is not a multiple of {need}"] if k % need else []
    dims = (("M", m), ("N", n)) if backend == "native" else (("N", n),)
    out += [f"{name} = {d} is not a multiple of 16" for name, d in dims if d % 16]
    if backend == "fp8" and out_dtype not in (torch.bfloat16, torch.float16):
        # row-wise scales with an FP32 output exist only through cuBLASLt on sm_90; torch's
        # CUTLASS row-wise kernel elsewhere (sm_89, sm_100) writes BF16/FP16 alone
        cc = cc or (_capability(a.codes.device.index or 0) if a.codes.is_cuda else (9, 0))
        if cc != (9, 0):
            out.append(f"a {out_dtype} output with row-wise scales needs sm_90, not sm_{cc[0]}{cc[1]}")
    return out


def _refuse(backend, a, b, out_dtype):
    """One line naming what `backend` cannot take (mm_refusals), before its library is called."""
    refused = mm_refusals(backend, a, b, out_dtype)
    if refused:
        raise ValueError(f"mm backend {backend!r} cannot take these operands: {'; '.join(refused)}")


def _check_mm(a, b):
    if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
        raise TypeError("mm takes two QTensors")
    if a.fmt != b.fmt:
        raise ValueError(f"mm operands must share a format, got {a.fmt} and {b.fmt}")
    if len(a.lead_shape) != 2 or len(b.lead_shape) != 2 or a.lead_shape[1] != b.lead_shape[1]:
        raise ValueError(f"mm needs (M, K) and (N, K) operands quantized along K, got {a.lead_shape} and {b.lead_shape}")
    if a.codes.device != b.codes.device:
        raise ValueError(f"mm operands are on {a.codes.device} and {b.codes.device}")


def mm_backend(fmt, device):
    """The backend mm uses by default: FP4_BACKEND if set, else by device and format."""
    forced = os.environ.get("FP4_BACKEND")
    if forced:
        if forced not in MM_BACKENDS:
            raise ValueError(f"FP4_BACKEND={forced!r} is not one of {MM_BACKENDS}")
        return forced
    device = torch.device(device)
    if device.type != "cuda":
        return "emulated"
    cc = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cc[0] in (10, 12):
        return "native"
    if cc == (9, 0) and fmt == "mxfp4":
        return "fp8"
    if cc == (9, 0) and gemm.triton is not None and _nv_gemm() == "triton":
        return "triton"  # NVFP4 on Hopper: the bf16 backend's operands, g in the GEMM's epilogue
    return "bf16"


def _nv_gemm():
    """FP4_NV_GEMM: NVFP4's default GEMM on Hopper, 'bf16' (cuBLAS with an FP32 output, then a
    scaling pass) or 'triton' (gemm.py: the tensor scales in the epilogue, BF16 written once). 'bf16'
    is the default: on the H100 the 1B shapes' 12 GEMMs took 9.15 ms through it and 10.14 ms through
    the Triton kernel (cuBLAS BF16 alone: 6.36 ms; docs/speed.md, bench.py --sections gemm)."""
    choice = os.environ.get("FP4_NV_GEMM", "bf16")
    if choice not in ("triton", "bf16"):
        raise ValueError(f"FP4_NV_GEMM={choice!r}: choose triton or bf16")
    return choice


@functools.cache
def _capability(index):  # asked on every GEMM: cached per device (a properties query otherwise)
    return torch.cuda.get_device_capability(index)


@contextlib.contextmanager
def ieee_fp32(device):
    """FP32 matmuls on a CUDA `device` in IEEE FP32, whatever torch.backends.cuda.matmul.allow_tf32
    says (train.py turns TF32 on for speed, process-wide): a reference's FP32 GEMM must not round
    its operands to TF32's 10 mantissa bits. A no-op elsewhere (CPU matmuls ignore the flag)."""
    flags = torch.backends.cuda.matmul
    if torch.device(device).type != "cuda" or not flags.allow_tf32:
        yield
        return
    flags.allow_tf32 = False
    try:
        yield
    finally:
        flags.allow_tf32 = True


def _dequantize_lead(q, dtype=torch.float32):
    """Dequantized values in the QTensor's layout (quantized axis last)."""
    return dequantize(q, dtype).movedim(q.axis, -1)


def _mm_bf16(a, b, out_dtype):
    """Exact operands in BF16: MXFP4 values code * 2^e, NVFP4 values code * s * 2^k (<= 6
    significant bits), the rest of the tensor scales multiplying the FP32-accumulated product."""
    a1, b1, g = _bf16_operands(a, b)
    out = _mm_f32(a1, b1)  # (M, N) FP32
    if g is None:
        return out.to(out_dtype)
    if out_dtype == torch.float32:
        return out.mul_(g)
    # the FP32 product rounded to out_dtype as it is stored: one pass over the FP32 output instead
    # of two (mul_, then .to), the same bits (an FP32 multiply, then one rounding either way)
    return torch.mul(out, g, out=torch.empty(out.shape, dtype=out_dtype, device=out.device))


def _mm_triton(a, b, out_dtype):
    """The bf16 backend's operands and numbers, g multiplied in the Triton GEMM's epilogue (gemm.py):
    no FP32 output written and read back."""
    return gemm.mm_scaled(*_bf16_operands(a, b), out_dtype)


def _bf16_operands(a, b):
    """a, b dequantized exactly into BF16, (M, K) and (N, K), and the FP32 0-d factor g their product
    takes (None for MXFP4, whose operands hold their whole scales)."""
    if a.fmt == "mxfp4":
        return _dequantize_lead(a, torch.bfloat16), _dequantize_lead(b, torch.bfloat16), None
    # g = m 2^E with m in [1, 2). The operands take 2^k, k = E clamped to [-116, 116] (code * s in
    # [2^-10, 2688] times 2^k stays a normal BF16), the output m_a m_b 2^(E_a - k_a + E_b - k_b),
    # in [2^-66, 4). One FP32 product g_a g_b here underflowed to 0 where the tensor amaxes multiply
    # below ~1e-38 (the whole output silently 0) and overflowed above ~1e45 (0 * Inf = NaN); in
    # FP32's normal range both give the same bits (one rounding of the same product).
    (ma, ea), (mb, eb) = torch.frexp(a.tensor_scale), torch.frexp(b.tensor_scale)  # m in [0.5, 1)
    ka, kb = (ea - 1).clamp(-116, 116), (eb - 1).clamp(-116, 116)
    return _nv_bf16(a, ka), _nv_bf16(b, kb), torch.ldexp((ma * 2) * (mb * 2), ea - 1 - ka + eb - 1 - kb)


def _nv_bf16(q, k):
    """code * s * 2^k of an NVFP4 QTensor in BF16, quantized axis last (exact for k in [-116, 116])."""
    pow2 = torch.ldexp(torch.ones_like(q.tensor_scale), k)
    return _dequantize_lead(QTensor(q.codes, q.scales, pow2, q.fmt, q.shape, q.axis), torch.bfloat16)


def _mm_f32(a1, b1):
    """BF16 operands, FP32 accumulation and FP32 output (not rounded to BF16 in between)."""
    try:
        return torch.mm(a1, b1.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):  # no mm(out_dtype=) here: FP32 GEMM
        return a1.float() @ b1.float().t()


def fast_accum_ok(a, b):
    """Whether fp8 fast accumulation is exact for these operands (the bound above)."""
    k = a.lead_shape[1]
    if k * 144 > 2**FAST_ACCUM_BITS:  # fails even at span 0: decided without reading the scales
        return False
    return k * 144 * 2.0 ** (_exponent_span(a) + _exponent_span(b)) <= 2.0**FAST_ACCUM_BITS


def _exponent_span(q):
    e = q.scales.view(q.scales.shape[0], -1).int()
    e = torch.where(e == E8M0_NAN, 0, e)
    return int((e.amax(-1) - e.amin(-1)).max())


def _mm_fp8(a, b, out_dtype):
    """Hopper: MXFP4 folded into E4M3 + FP32 row scales, row-wise scaled FP8 GEMM (SPEC 7)."""
    if a.fmt != "mxfp4":
        return _mm_bf16(a, b, out_dtype)
    _refuse("fp8", a, b, out_dtype)
    a8, sa = fold_mx(a)
    b8, sb = fold_mx(b)
    # On sm_90 the product is written in FP32 and rounded here once, as the reference rounds its
    # FP32 GEMM: asked for BF16 directly, cuBLASLt's row-wise path came out 1 BF16 ulp off the
    # reference on the H100 (the self-check's probe: -920 for -916). Elsewhere row-wise scales
    # write BF16 / FP16 alone, and the first-use check decides whether those bits are the reference's.
    fp32 = a.codes.is_cuda and _capability(a.codes.device.index or 0) == (9, 0)
    y = torch._scaled_mm(a8, b8.t(), scale_a=sa.unsqueeze(1), scale_b=sb.unsqueeze(0),
                         out_dtype=torch.float32 if fp32 else out_dtype, use_fast_accum=fast_accum_ok(a, b))
    return y.to(out_dtype)


def native_args(a, b):
    """The operands of a Blackwell FP4 GEMM through torch.nn.functional.scaled_mm: packed codes
    viewed as float4_e2m1fn_x2, b transposed (column-major), block scales in cuBLAS's swizzled
    128x4 layout as E8M0 (mxfp4, 1x32) or E4M3 (nvfp4, 1x16). Built on any device (tested on CPU)."""
    from torch.nn.functional import ScalingType, SwizzleType
    sdtype = torch.float8_e8m0fnu if a.fmt == "mxfp4" else torch.float8_e4m3fn
    recipe = ScalingType.BlockWise1x32 if a.fmt == "mxfp4" else ScalingType.BlockWise1x16
    sa = swizzle_scales(a.scales).view(sdtype)
    sb = swizzle_scales(b.scales).view(sdtype)
    return dict(mat_a=a.codes.view(torch.float4_e2m1fn_x2), mat_b=b.codes.view(torch.float4_e2m1fn_x2).t(),
                scale_a=sa, scale_recipe_a=recipe, scale_b=sb, scale_recipe_b=recipe,
                swizzle_a=SwizzleType.SWIZZLE_32_4_4, swizzle_b=SwizzleType.SWIZZLE_32_4_4)


def _mm_native(a, b, out_dtype):
    """Blackwell (sm_100 / sm_120) native FP4 GEMM. Not run on hardware here: python check.py verifies it (docs/numerics.md)."""
    _refuse("native", a, b, out_dtype)
    y = torch.nn.functional.scaled_mm(**native_args(a, b), output_dtype=torch.float32)
    if a.fmt == "nvfp4":
        y = y * (a.tensor_scale * b.tensor_scale)
    return y.to(out_dtype)


def backends(device=None):
    """What this machine uses: the quantization path and the mm backend per format."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quant = "cuda" if dev.type == "cuda" and kernels_enabled() else "torch"
    return {"device": str(dev), "quantize": quant, "mm": mm_backend("mxfp4", dev),
            "mm_nvfp4": mm_backend("nvfp4", dev), "fast_accum_bits": FAST_ACCUM_BITS}


def kernels_enabled():
    """True when CUDA tensors go through kernels.cu (CuPy importable, FP4_KERNELS not 'torch')."""
    return kernels.enabled()


# ---------------------------------------------------------------------------------------------
# Self-checks of the accelerated paths (DESIGN.md "Self-checks", docs/selfcheck.md): each GEMM
# backend and kernel family, on small fixed inputs, against the reference on the CPU

_MM_FALLBACK = {"native": "bf16", "fp8": "bf16", "triton": "bf16", "bf16": "emulated"}  # each exact (SPEC 7)


def checked_backend(backend, device):
    """The backend mm uses by default, or its exact fallback where the first-use check failed."""
    while backend != "emulated" and not selfcheck.verified("mm." + backend, device):
        backend = _MM_FALLBACK[backend]
    return backend


def _kernel_ok(device, family, rounding=None):
    """kernels.cu's `family` (and its SR encoder, for rounding 'sr') on `device`: enabled and
    verified on first use; else the PyTorch reference computes it (the integer SR rule)."""
    return (kernels.enabled() and selfcheck.verified("kernel." + family, device)
            and (rounding != "sr" or selfcheck.verified("kernel.sr", device)))


def _mm_check(backend):
    """The backend on the probes against the emulated mm; the emulated mm against FP64 (exact here)."""
    def run(device):
        bad = []
        for fmt in ("mxfp4", "nvfp4"):
            a, b = mm_probe(fmt)
            ad, bd = to_device(a, device), to_device(b, device)
            if backend == "emulated":
                want = (_dequantize_lead(a).double() @ _dequantize_lead(b).double().t()).float()
                bad += selfcheck.mismatches(mm(ad, bd, torch.float32, backend="emulated"), want, f"emulated {fmt} ")
                continue
            # training's BF16 output, and FP32 where the backend has it (fp8: sm_90 only)
            for out_dtype in (torch.float32, torch.bfloat16):
                refused = mm_refusals(backend, ad, bd, out_dtype)
                if refused and out_dtype == torch.float32 and all("output" in r for r in refused):
                    continue
                if refused:  # a probe the backend refuses checks nothing (test_selfcheck holds this)
                    bad.append(f"{backend} {fmt}: the probe breaks the backend's rules: {'; '.join(refused)}")
                    continue
                want = mm(a, b, out_dtype, backend="emulated")
                # the backend function is looked up now: tests swap in stand-ins
                got = {"bf16": _mm_bf16, "fp8": _mm_fp8, "native": _mm_native, "triton": _mm_triton}[backend](ad, bd, out_dtype)
                bad += selfcheck.mismatches(got, want, f"{backend} {fmt} {str(out_dtype)[6:]} ")
        # the mm probes' tensor scales are powers of two (g = 1): the epilogue's multiply, checked apart
        return bad + (gemm.epilogue_mismatches(device) if backend == "triton" else [])
    return run


def _check_reference_quantizer(device):
    """The reference quantizer against SPEC 1-2's facts: every E2M1 value (and -0) codes back to
    itself (block amax 6: scale 1), SPEC 1's ties round to even, a NaN makes the block scale NaN."""
    grid = torch.tensor(E2M1_GRID)
    vals = torch.cat([grid, -grid, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    want = torch.cat([grid, -grid, torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])])
    x = torch.cat([vals, torch.zeros(32 - vals.numel())]).view(1, 32)
    x = torch.cat([x, x.flip(-1) * float("nan")])  # (2, 32): block 2 holds NaNs
    q = quantize(x, "mxfp4")  # on the CPU: the reference
    want[8] = 0.0  # -0 codes as +0: the sign bit is set for v < 0 only
    got = dequantize(q)[0, : vals.numel()]
    return selfcheck.mismatches(got, want, "E2M1 ") + selfcheck.mismatches(q.scales[:, 0].cpu(), torch.tensor([127, E8M0_NAN], dtype=torch.uint8), "scale ")


def sr_mismatches(quantize_fn, device):
    """SR quantization through `quantize_fn` (the kernels, or a stand-in) against the reference's
    integer rule (SPEC 4). Every element takes a different random byte: a wrong byte -> element
    mapping (cvt.rs's, unconfirmed) moves about half of the probe's 1.25s."""
    x, bad = quant_probe(), []
    for fmt, o in map(quant_args, SR_CASES):
        bad += qtensor_mismatches(quantize_fn(x.to(device), x.to(device), fmt, **o), quantize(x, fmt, **o), f"{fmt} sr")
    return bad


def _check_kernel(family):
    def run(device):
        if family == "sr":
            return sr_mismatches(kernels.quantize, device)
        x, bad = quant_probe(), []
        cases = {"quantize": QUANT_CASES, "dequantize": QUANT_CASES[:3], "requantize": SR_CASES,
                 "fold": QUANT_CASES[:1], "rotate_back": QUANT_CASES[1:2]}[family]
        for fmt, o in map(quant_args, cases):
            bad += _kernel_case(family, quantize(x, fmt, **o), fmt, o, x, device)
        return bad
    return run


def _kernel_case(family, want, fmt, o, x, device):
    xd, q = x.to(device), to_device(want, device)
    if family == "quantize":
        return qtensor_mismatches(kernels.quantize(xd, xd, fmt, **o), want, fmt)
    if family == "dequantize":
        return selfcheck.mismatches(kernels.dequantize(q, torch.float32).cpu(), dequantize(want), fmt)
    if family == "requantize":
        r = dict(scale_rule="absmax", rounding="sr", hadamard=o["hadamard"], signs=o["signs"], seed=9)
        return qtensor_mismatches(kernels.requantize(q, fmt, **r), requantize(want, fmt, **r), fmt + " requantize")
    if family == "fold":
        (ge, gr), (we, wr) = kernels.fold(q), fold_mx(want)
        return selfcheck.mismatches(ge.cpu(), we, "fold elements ") + selfcheck.mismatches(gr.cpu(), wr, "fold rows ")
    d = x.bfloat16()  # rotate_back: the clip mask and Hadamard-32 applied to a BF16 gradient
    return selfcheck.mismatches(kernels.rotate_back(d.to(device), q.mask, 32).cpu(), rotate_back_reference(d, want, 32), "rotate_back ")


def _speed(path, n=2048):
    """The table's speed: TFLOP/s of an mm backend on (n, n) MXFP4 operands (the CPU: n / 4); GB/s
    of the quantize kernel, (4n, 4n) BF16 -> MXFP4, against a device copy of as many bytes."""
    def speed(device):
        if path.startswith("mm."):
            m = n if device.type == "cuda" else n // 4
            a, b = (quantize(torch.randn(m, m, device=device), "mxfp4") for _ in range(2))
            return selfcheck.gemm_speed(lambda: mm(a, b, backend=path[3:]), 2 * m**3, device)
        x = torch.randn(4 * n, 4 * n, device=device, dtype=torch.bfloat16)
        quant = lambda: kernels.quantize(x, x, "mxfp4", 1, "absmax", "rn", 0, None, 0, False)  # noqa: E731
        return selfcheck.kernel_speed(quant, int(x.numel() * (2 + 1 / 2 + 1 / 32)), device)
    return speed if path.startswith("mm.") or path == "kernel.quantize" else None


def _why_not(device, cc=None):
    """None where a GPU path exists on `device`, else why not; cc: the compute capabilities it needs
    (None: a kernels.cu family, which needs CuPy)."""
    if device.type != "cuda":
        return "no CUDA device"
    have = _capability(device.index or 0)
    if cc is None:
        return None if kernels.enabled() else "kernels.cu off (no CuPy, or FP4_KERNELS=torch)"
    return None if cc(have) else f"not on sm_{have[0]}{have[1]}"


_EXACT = "the emulated mm (FP32 GEMM of the dequantized operands), bit for bit on exact probes"
for _path, _run, _against, _fallback, _avail in (
        ("mm.emulated", _mm_check("emulated"), "an FP64 product of the dequantized operands", "-", None),
        ("quantize.reference", _check_reference_quantizer, "SPEC 1-2: E2M1 grid, ties to even, NaN scale", "-",
         lambda d: None if d.type == "cpu" else "runs on the CPU"),
        ("mm.bf16", _mm_check("bf16"), _EXACT, "the emulated mm", None),
        ("mm.fp8", _mm_check("fp8"), _EXACT, "the bf16 mm backend", lambda d: _why_not(d, lambda c: c >= (8, 9))),
        ("mm.native", _mm_check("native"), _EXACT, "the bf16 mm backend", lambda d: _why_not(d, lambda c: c[0] in (10, 12))),
        ("mm.triton", _mm_check("triton"), _EXACT + "; gemm.py's twin on a full-mantissa g", "the bf16 mm backend",
         lambda d: ("no Triton" if d.type == "cuda" and gemm.triton is None else _why_not(d, lambda c: c >= (8, 0)))),
        *(("kernel." + f, _check_kernel(f), "the PyTorch reference on the CPU, bit for bit" + (" (SPEC 4's integer SR rule)" if f == "sr" else ""),
           "the PyTorch reference", _why_not) for f in ("quantize", "sr", "dequantize", "requantize", "fold", "rotate_back"))):
    selfcheck.register(selfcheck.Check(_path, _run, _against, _fallback, _avail or (lambda d: None), _speed(_path)))
