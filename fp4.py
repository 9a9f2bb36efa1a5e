"""
FP4 training numerics: formats, quantizers, GEMM backends, FP4 linear layers. On a GPU the
quantizers run as CUDA kernels (kernels.cu), compiled and launched by cuda_kernels.py.

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
  - Stochastic rounding (SPEC 4, revised 2026-12-01: the rule of FP4 hardware) takes 8 random
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
import math
import os
from dataclasses import dataclass

import torch

import cuda_kernels as kernels  # the CUDA kernels' launchers (kernels.cu through CuPy)

# ---------------------------------------------------------------------------------------------
# E2M1: the FP4 element (SPEC 1)

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; bit 3 = sign
# Round to nearest, ties to the even code: a magnitude's code is the number of midpoints below it,
# where a midpoint whose tie goes down (to the even code below) counts only if strictly below:
# 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (SPEC 1).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _grid(device):
    return torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)


def e2m1_encode(v):
    """FP32 values already divided by their scale -> E2M1 codes (uint8, 0..15). RN-even,
    saturating at +-6. The sign bit is set iff v < 0 (so -0.0 gives code 0); NaN -> code 0
    (callers mark non-finite blocks through their scale)."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for m, tie_up in _MIDPOINTS:  # NaN compares false everywhere: code 0
        code += (a >= m) if tie_up else (a > m)
    return _with_sign(code, v)


def e2m1_encode_sr(v, r):
    """Stochastic rounding to E2M1 with 8 random bits an element (SPEC 4, revised; Blackwell's
    cvt.rs): a = min(|v|, 6), step s = 0.5 below 2, 1 below 4, 2 above; the magnitude is
    ((floor(a * 256 / s) + r) >> 8) * s for the element's random byte r in 0..255 (integer tensor).
    a * 256 / s is a power-of-two scaling (exact), so P(round up) = floor(256 f) / 256 for the
    fraction f of a / s: the hardware's bias toward zero below s / 256. NaN -> code 0."""
    a = v.abs().clamp(max=6.0)
    k = torch.where(a < 2, 512.0, torch.where(a < 4, 256.0, 128.0))  # 256 / s
    t = torch.floor(a * k).nan_to_num(0.0).to(torch.int32)  # < 3072
    n = (t + r.to(torch.int32)) >> 8  # multiples of s: 0..4 (s .5), 2..4 (s 1), 2..3 (s 2)
    code = n + torch.where(a < 2, 0, torch.where(a < 4, 2, 4))
    code = torch.where(torch.isnan(v), 0, code)
    return _with_sign(code.to(torch.uint8), v)


def _with_sign(code, v):
    return code | ((v < 0).to(torch.uint8) << 3)


def e2m1_decode(codes):
    """uint8 codes 0..15 -> FP32 values."""
    grid = _grid(codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack(codes):
    """(..., K) codes -> (..., K/2) bytes; element 2i in the low nibble (float4_e2m1fn_x2)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack needs an even last dim, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed):
    """(..., K/2) bytes -> (..., K) codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Scale formats: E8M0 (MX) and E4M3 (NV) (SPEC 2)

E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
E4M3_MAX = 448.0


def e8m0_decode(bits):
    """uint8 biased exponents -> FP32 2^(bits - 127); 0xFF -> NaN."""
    v = torch.ldexp(torch.ones_like(bits, dtype=torch.float32), bits.int() - 127)
    return torch.where(bits == E8M0_NAN, float("nan"), v)


def e4m3_encode(x):
    """FP32 >= 0 -> E4M3 bits, round to nearest even, saturating at 448; NaN -> 0x7F."""
    return x.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits):
    return bits.view(torch.float8_e4m3fn).float()


def e4m3_encode_sr(t, u):
    """Stochastic rounding of FP32 t >= 0 to E4M3 (MS-EDEN's scales): between the neighbours
    lo <= t < hi round up with probability (t - lo) / (hi - lo). Saturates at 448."""
    rn = e4m3_encode(t)
    lo_bits = torch.where(e4m3_decode(rn) > t, rn - 1, rn)  # positive E4M3 bits are monotone
    hi_bits = (lo_bits + 1).clamp(max=0x7E)
    lo, hi = e4m3_decode(lo_bits), e4m3_decode(hi_bits)
    p = torch.where(hi > lo, (t - lo) / (hi - lo), torch.zeros_like(t))
    out = torch.where(u < p, hi_bits, lo_bits)
    return torch.where(torch.isnan(t), E4M3_NAN, out).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Counter-based random numbers (for stochastic rounding), identical in kernels.cu

_M32 = 0xFFFFFFFF


def _lowbias32(x):
    """32-bit integer mixer (C. Wellons' 'lowbias32'), on int64 tensors holding uint32 values.
    Products wrap in int64; the low 32 bits are the uint32 product."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _lowbias32_py(x):
    """The same mixer on one Python int."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _s32(c):
    return c - (1 << 32) if c >= 1 << 31 else c  # a uint32 constant as the int32 with its bits


def _lowbias32_i32(x):
    """lowbias32 on int32 tensors holding uint32 bits: int32 products wrap like uint32 ones,
    and a logical right shift is an arithmetic one masked to the remaining bits."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _s32(0x7FEB352D)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _s32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def hash_key(seed, hi=0):
    """key(seed, hi) = lowbias32(seed + 0x9E3779B9 * (hi + 1) mod 2^32), hi = index >> 32."""
    return _lowbias32_py((seed & _M32) + 0x9E3779B9 * (hi + 1))


def _hash_words(seed, n, device="cpu"):
    """lowbias32(lo32(j) ^ key(seed, j >> 32)) for j = 0..n-1, as int32 tensors holding uint32 bits."""
    out = []
    for start in range(0, n, 1 << 32):  # one key per 2^32 indices
        m = min(n - start, 1 << 32)
        idx = torch.arange(m, dtype=torch.int64, device=device)
        lo = (idx - (idx >= 1 << 31).long() * (1 << 32)).int()  # uint32 bits as int32
        out.append(_lowbias32_i32(lo ^ _s32(hash_key(seed, start >> 32))))
    return torch.cat(out) if len(out) > 1 else out[0]


def uniform(seed, n, device="cpu"):
    """n uniform FP32 numbers in [0, 1) for the indices 0..n-1 (MS-EDEN's scale rounding):
    u[i] = (lowbias32(lo32(i) ^ key(seed, i >> 32)) >> 8) * 2^-24 (24 bits, exact in FP32)."""
    return ((_hash_words(seed, n, device) >> 8) & 0xFFFFFF).float() * 2.0**-24


def random_bytes(seed, n, device="cpu"):
    """Stochastic rounding's 8 random bits for the element indices 0..n-1 (SPEC 4): element i takes
    byte i mod 4 (bits 8(i mod 4) .. 8(i mod 4) + 7) of the word W(seed, i div 4), one hash per four
    elements, as Blackwell's cvt.rs consumes one 32-bit rbits word per four values. int32 0..255."""
    words = _hash_words(seed, -(-n // 4), device)  # (n/4,)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=device)
    return ((words.unsqueeze(-1) >> shifts) & 0xFF).reshape(-1)[:n]


def random_signs(n, seed, device="cpu"):
    """A +-1 FP32 vector of length n <= 128 for a random Hadamard rotation: sign i is -1 iff bit
    i mod 32 of lowbias32(seed + 0x632BE5AB * (i // 32 + 1) mod 2^32) is set. Pure host
    arithmetic (no generator, no device work): the backward draws fresh signs on every call."""
    if not 0 < n <= 128:
        raise ValueError(f"random_signs takes 1 <= n <= 128, got {n}")
    words = [_lowbias32_py(((seed & _M32) + 0x632BE5AB * (w + 1)) & _M32) for w in range((n + 31) // 32)]
    return torch.tensor([-1.0 if words[i >> 5] >> (i & 31) & 1 else 1.0 for i in range(n)],
                        dtype=torch.float32, device=device)


@dataclass(frozen=True, eq=False)
class DeviceSeed:
    """A seed held on the GPU: t[0] (an int32 CUDA tensor of shape (1,)) + offset. The kernels
    read it from device memory, so a CUDA graph that draws t with torch.randint gets fresh
    randomness on every replay (FP4Linear's backward does). Anywhere a seed is accepted; the
    reference path reads it back with host() (a device sync)."""
    t: torch.Tensor
    offset: int = 0

    def __post_init__(self):
        if not (isinstance(self.t, torch.Tensor) and self.t.dtype == torch.int32 and self.t.numel() >= 1):
            raise TypeError("DeviceSeed takes an int32 tensor with at least one element")

    def __add__(self, k):
        return DeviceSeed(self.t, self.offset + k)

    def host(self):
        return (int(self.t.view(torch.int32)[0].item()) + self.offset) & _M32


@dataclass(frozen=True, eq=False)
class DeviceSigns:
    """random_signs(n, seed) for a DeviceSeed, derived inside the kernels (never on the host)."""
    n: int
    seed: DeviceSeed

    def host(self):
        return random_signs(self.n, self.seed.host())


def _host_rng(seed, signs):
    """Host seed and signs for the reference path (reads device seeds back)."""
    seed = seed.host() if isinstance(seed, DeviceSeed) else seed
    signs = signs.host() if isinstance(signs, DeviceSigns) else signs
    return seed, signs


# ---------------------------------------------------------------------------------------------
# Hadamard rotations (SPEC 4)

HADAMARD_SIZES = (16, 32, 64, 128)


def _fwht(x, n, signs=None):
    """Blockwise normalized Sylvester Hadamard along the last dim of an FP32 tensor: each
    n-block b becomes b @ H_n (H_n symmetric). The butterfly order is part of the kernel
    contract (module docstring)."""
    shape = x.shape
    if signs is not None:
        x = (x.reshape(-1, n) * signs.to(x.device)).reshape(shape)
    x = x.reshape(-1, n)
    h = 1
    while h < n:
        xv = x.view(-1, n // (2 * h), 2, h)
        a, b = xv[:, :, 0], xv[:, :, 1]
        if x.requires_grad:  # differentiable path
            y = torch.stack((a + b, a - b), dim=2)
        else:  # no temporaries: write both halves in place
            y = torch.empty_like(xv)
            torch.add(a, b, out=y[:, :, 0])
            torch.sub(a, b, out=y[:, :, 1])
        x = y.reshape(-1, n)
        h *= 2
    return (x * _hadamard_scale(n)).view(shape)


@functools.cache
def _hadamard_scale(n):
    return torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32).item()  # FP32-rounded


def _check_hadamard(n, signs, k):
    if n not in HADAMARD_SIZES:
        raise ValueError(f"hadamard size must be one of {HADAMARD_SIZES} (or 0 for none), got {n!r}")
    if k % n:
        raise ValueError(f"dim of size {k} is not divisible by the Hadamard size {n}")
    if isinstance(signs, DeviceSigns):
        if signs.n != n:
            raise ValueError(f"signs for Hadamard size {signs.n} given with hadamard={n}")
        return signs
    if signs is not None:  # n <= 128 values: checked and kept on the host (no device sync later)
        if signs.shape != (n,):
            raise ValueError(f"signs must have shape ({n},), got {tuple(signs.shape)}")
        if signs.is_cuda:  # a device-to-host copy waits for the GPU: pass CPU signs where it matters
            signs = signs.detach().cpu()
        if not all(v == 1.0 or v == -1.0 for v in signs.tolist()):
            raise ValueError("signs must be +1 or -1")
        signs = signs.detach().float() if signs.dtype != torch.float32 else signs.detach()
    return signs


def hadamard(x, n, signs=None, axis=-1):
    """x with every n-block along `axis` multiplied by H_n (after the +-1 signs, if given).
    Without signs, applying it twice gives x back (up to FP32 rounding)."""
    _check_input(x)
    xm = x.movedim(axis, -1)
    signs = _check_hadamard(n, signs, xm.shape[-1])
    return _fwht(xm.float(), n, signs).to(x.dtype).movedim(-1, axis)


def _tree_sum(x):
    """Sum over the last dim (a power of two) as a halving tree: the kernels' reduction order."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


# ---------------------------------------------------------------------------------------------
# Block quantization: quantize / dequantize (SPEC 2-4)

FORMATS = {"mxfp4": 32, "nvfp4": 16}  # block size along the contraction dim
SCALE_RULES = {"mxfp4": ("absmax", "quest"), "nvfp4": ("absmax", "four_over_six")}
ROUNDINGS = {"mxfp4": ("rn", "sr"), "nvfp4": ("rn", "sr", "eden")}
QUEST_SCALE = 0.487079  # MSE-optimal FP4 grid step for a unit Gaussian, 2.92247856 / 6 (SPEC 3)
EDEN_GROUP = 128  # MS-EDEN correction group (SPEC 4)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class QTensor:
    """A block-quantized FP4 tensor. The quantized axis is moved last:
    codes  uint8 (*lead, K/2), two E2M1 codes a byte, element 2i in the low nibble;
    scales uint8 (*lead, K/block), E8M0 bits (mxfp4) or E4M3 bits (nvfp4);
    tensor_scale FP32 0-d tensor (nvfp4) or None; mask: QuEST clip mask packed 8 per byte
    (bit i of byte j is element 8j+i), (*lead, K/8), or None. shape is the input's shape and
    axis the input's (non-negative) quantized axis. folded: the Hopper fold (fold_mx) when a
    kernel emitted it together with the codes, else None."""
    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    fmt: str
    shape: tuple
    axis: int
    mask: torch.Tensor | None = None
    folded: tuple | None = None

    @property
    def block(self):
        return FORMATS[self.fmt]

    @property
    def lead_shape(self):
        """The shape with the quantized axis moved last: the layout of codes and scales."""
        s = list(self.shape)
        return tuple(s[: self.axis] + s[self.axis + 1:] + [s[self.axis]])

    def clip_mask(self):
        """The QuEST clip mask as a bool tensor in the moved-last layout, or None."""
        if self.mask is None:
            return None
        bits = (self.mask.unsqueeze(-1) >> torch.arange(8, device=self.mask.device, dtype=torch.uint8)) & 1
        return bits.flatten(-2).bool()


def _check_input(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"FP4 quantization takes float32, bfloat16 or float16 input, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"cannot quantize an empty tensor (shape {tuple(x.shape)})")


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
             seed=0, block2d=False, fold=False):
    """Quantize x along `axis` (the GEMM contraction dim) to a QTensor. If hadamard > 0 the
    blocks are first rotated by H_n (with signs: a random Hadamard). seed drives 'sr'/'eden'.
    fold=True asks the GPU kernels to also emit fold_mx's outputs (QTensor.folded, for the fp8
    GEMM backend) in the same pass where they can; it never changes codes, scales or mask."""
    _check_input(x)
    axis = axis % x.ndim
    xm = x.detach().movedim(axis, -1)
    k = xm.shape[-1]
    signs = _check_quantize(fmt, scale_rule, rounding, hadamard, signs, block2d, xm.shape, x.ndim)
    if x.is_cuda and kernels_enabled():
        return kernels.quantize(x, xm, fmt, axis, scale_rule, rounding, hadamard, signs, seed, block2d, fold)
    seed, signs = _host_rng(seed, signs)
    xf = xm.reshape(-1, k).float()  # (R, K)
    if hadamard:
        xf = _fwht(xf, hadamard, signs)
    quant = _quantize_mx if fmt == "mxfp4" else _quantize_nv
    codes, scales, tscale, mask = quant(xf, scale_rule, rounding, seed, block2d)
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


def _pack_bits(m):
    w = 1 << torch.arange(8, device=m.device, dtype=torch.uint8)
    return (m.reshape(*m.shape[:-1], -1, 8).to(torch.uint8) * w).sum(-1, dtype=torch.uint8)


def _round(v, rounding, seed):
    """v (R, K) -> codes; SR draws use the element index row * K + k."""
    if rounding == "sr":
        return e2m1_encode_sr(v, random_bytes(seed, v.numel(), v.device).view(v.shape))
    return e2m1_encode(v)


def _blocks(xf, bs):
    return xf.view(xf.shape[0], -1, bs)  # (R, K/bs, bs)


def _quantize_mx(xf, scale_rule, rounding, seed, block2d):
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
    return _round(v, rounding, seed), scales, None, mask


def _absmax_exponent(amax):
    """Smallest e with amax / 2^e <= 6, exactly (frexp: amax = m 2^E, m in [0.5, 1)).
    m <= 0.75 -> e = E - 3 (m * 8 <= 6), else e = E - 2. amax = 0 -> -127."""
    m, E = torch.frexp(amax)
    e = torch.where(m <= 0.75, E - 3, E - 2)
    return torch.where(amax == 0, -127, e)


def _quest_exponent(xb, e_absmax):
    """QuEST: 2^floor(log2(0.487079 * sigma)) per block, sigma the block's standard deviation
    (mean(x^2) - mean(x)^2, halving-tree sums). floor(log2 y) = E - 1 with frexp(y) = (m, E).
    A constant block (sigma 0) falls back to the absmax exponent."""
    mean = _tree_sum(xb) * (1 / 32)
    mean2 = _tree_sum(xb * xb) * (1 / 32)
    sigma = torch.sqrt((mean2 - mean * mean).clamp(min=0))
    _, E = torch.frexp(sigma * QUEST_SCALE)
    return torch.where(sigma > 0, E - 1, e_absmax)


def _tensor_scale(block_amax):
    """NVFP4 tensor scale g = amax / (6 * 448), amax over the finite blocks (a NaN/Inf block
    must not poison the others); 1 for an all-zero tensor."""
    finite_amax = torch.where(torch.isfinite(block_amax), block_amax, 0).amax()
    g = finite_amax / _full(finite_amax, 6 * E4M3_MAX)
    return torch.where(finite_amax > 0, g, torch.ones_like(g))


def _quantize_nv(xf, scale_rule, rounding, seed, block2d):
    """NVFP4: E4M3 scale per 16-block (or 16x16 tile), FP32 tensor scale g (SPEC 2-4)."""
    xb = _blocks(xf, 16)
    amax = xb.abs().amax(-1)  # (R, K/16)
    bad = ~torch.isfinite(amax)
    g = _tensor_scale(amax)
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
    return _round(v, rounding, seed), s, g, None


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
    whichever gives the smaller squared error (halving-tree sums; a tie keeps 6)."""
    s4 = e4m3_encode(amax / 4 / g)
    errs = []
    for s in (s6, s4):
        q = e2m1_encode(_nv_divide(xb, s, g))
        d = xb - _nv_dequant_blocks(q, s, g)
        errs.append(_tree_sum(d * d))
    return torch.where(errs[1] < errs[0], s4, s6)


def _eden_scales(xb, codes, s, g, seed):
    """MS-EDEN (SPEC 4): per 128-group the correction c = sum(x^2) / sum(x q) of the RN values q,
    folded into the group's E4M3 block scales with stochastic rounding. Draws: uniform(seed,
    block index), block index = row * (K/16) + block."""
    r, nb, _ = xb.shape
    q = _nv_dequant_blocks(codes.view_as(xb), s, g)
    xg, qg = xb.reshape(r, -1, EDEN_GROUP), q.reshape(r, -1, EDEN_GROUP)
    num, den = _tree_sum(xg * xg), _tree_sum(xg * qg)  # (R, K/128)
    c = num / den
    c = torch.where(torch.isfinite(c) & (den > 0), c, torch.ones_like(c))  # zero or non-finite group
    t = e4m3_decode(s) * c.repeat_interleave(EDEN_GROUP // 16, dim=-1)  # (R, K/16)
    return e4m3_encode_sr(t, uniform(seed, r * nb, xb.device).view(r, nb))


def dequantize(q, dtype=torch.float32):
    """QTensor -> tensor of the input's shape (still rotated if a Hadamard was applied)."""
    if q.codes.is_cuda and kernels_enabled():
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
    if q.codes.is_cuda and kernels_enabled():
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
    if q.codes.is_cuda and kernels_enabled():
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


# ---------------------------------------------------------------------------------------------
# GEMM backends: mm(a, b) = dequantize(a) @ dequantize(b).T (SPEC 7, DESIGN "Backends")

MM_BACKENDS = ("emulated", "bf16", "fp8", "native")
# Hopper's FP8 tensor cores with use_fast_accum keep partial sums in a narrower accumulator.
# Every folded MXFP4 element is m * 2^(d - 1), m an integer <= 12, d >= -span (the row's block-
# exponent span), so products are multiples of 2^(-2 - span_a - span_b) and at most 36 in size:
# every partial sum is exact while K * 144 * 2^(span_a + span_b) <= 2^FAST_ACCUM_BITS. Measured
# on the H200 (bench.py --sections accum, results/nvidia-h200/bench_accum.json): the fast mode
# keeps 14 significant bits, so it is provably exact only for K <= 113 at span 0. Real layers
# (K >= 2048) therefore use the promoted (exact FP32) mode; the 1.95x fast-mode probe in SPEC 7
# was exact only because its partial sums happened to stay small. 0 disables the fast mode.
FAST_ACCUM_BITS = int(os.environ.get("FP4_FAST_ACCUM_BITS", "14"))


def mm(a, b, out_dtype=torch.bfloat16, backend=None):
    """dequantize(a) @ dequantize(b).T for QTensors a (M, K) and b (N, K) quantized along K."""
    _check_mm(a, b)
    backend = backend or mm_backend(a.fmt, a.codes.device)
    if backend not in MM_BACKENDS:
        raise ValueError(f"unknown mm backend {backend!r}; allowed: {MM_BACKENDS}")
    if backend == "emulated":  # the definition: FP32 values, an FP32 GEMM (never TF32)
        with ieee_fp32(a.codes.device):
            return (_dequantize_lead(a) @ _dequantize_lead(b).t()).to(out_dtype)
    if not a.codes.is_cuda:
        raise ValueError(f"mm backend {backend!r} needs CUDA tensors; use 'emulated' on the CPU")
    return {"bf16": _mm_bf16, "fp8": _mm_fp8, "native": _mm_native}[backend](a, b, out_dtype)


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
    return "bf16"


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
    """Exact operands in BF16: MXFP4 values code * 2^e, NVFP4 values code * s (<= 6 significant
    bits; the tensor scales g multiply the FP32-accumulated product instead)."""
    if a.fmt == "mxfp4":
        a1, b1 = _dequantize_lead(a, torch.bfloat16), _dequantize_lead(b, torch.bfloat16)
        return _mm_f32(a1, b1).to(out_dtype)
    one = torch.ones((), device=a.codes.device)
    a1 = _dequantize_lead(QTensor(a.codes, a.scales, one, a.fmt, a.shape, a.axis), torch.bfloat16)
    b1 = _dequantize_lead(QTensor(b.codes, b.scales, one, b.fmt, b.shape, b.axis), torch.bfloat16)
    out = _mm_f32(a1, b1)  # (M, N) FP32
    g = a.tensor_scale * b.tensor_scale
    if out_dtype == torch.float32:
        return out.mul_(g)
    # the FP32 product rounded to out_dtype as it is stored: one pass over the FP32 output instead
    # of two (mul_, then .to), the same bits (an FP32 multiply, then one rounding either way)
    return torch.mul(out, g, out=torch.empty(out.shape, dtype=out_dtype, device=out.device))


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
    a8, sa = fold_mx(a)
    b8, sb = fold_mx(b)
    return torch._scaled_mm(a8, b8.t(), scale_a=sa.unsqueeze(1), scale_b=sb.unsqueeze(0),
                            out_dtype=out_dtype, use_fast_accum=fast_accum_ok(a, b))


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
    """Blackwell (sm_100 / sm_120) native FP4 GEMM. NOT YET RUN ON HARDWARE (see README)."""
    y = torch.nn.functional.scaled_mm(**native_args(a, b), output_dtype=torch.float32)
    if a.fmt == "nvfp4":
        y = y * (a.tensor_scale * b.tensor_scale)
    return y.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# FP4 linear layers: the recipes (SPEC 5), all three GEMMs in FP4

# How each operand of each GEMM is quantized. Forward: Y = Q(X) Q(W)^T (contraction over K).
# Backward: dgrad dX = E W (contraction over N), wgrad dW = E^T X (contraction over M, tokens);
# "requant" re-quantizes the forward's saved FP4 tensor along the other axis, "transpose" reuses
# 16x16-tile codes as they are. The two operands of a GEMM share their random Hadamard signs.
_Q, _SR32 = dict(scale_rule="quest", rounding="rn", hadamard=32), dict(rounding="sr", hadamard=32)
_EDEN = dict(rounding="eden", hadamard=128)
RECIPES = {
    "bf16": None,  # plain nn.Linear, for comparison
    "quartet": dict(fmt="mxfp4", x=_Q, w=_Q, dgrad_e=_SR32, dgrad_w=_SR32, wgrad_e=_SR32,
                    wgrad_x=_SR32, rotate_back=32),
    "nvfp4": dict(fmt="nvfp4", x=dict(), w=dict(block2d=True), dgrad_e=dict(rounding="sr"),
                  dgrad_w="transpose", wgrad_e=dict(rounding="sr", hadamard=16),
                  wgrad_x=dict(rounding="rn", hadamard=16), rotate_back=0),
    "quartet2": dict(fmt="nvfp4", x=dict(scale_rule="four_over_six"), w=dict(scale_rule="four_over_six"),
                     dgrad_e=_EDEN, dgrad_w=_EDEN, wgrad_e=_EDEN, wgrad_x=_EDEN, rotate_back=0),
    # Full-Stack FP4 (SPEC 8.4): these FP4 GEMMs run on R = W - L (see "LoRA-SVD" below). The
    # backward is quartet2's: lower gradient error than nvfp4's treatment, measured (README)
    "fullstack": dict(fmt="nvfp4", x=dict(scale_rule="four_over_six"), w=dict(scale_rule="four_over_six"),
                      dgrad_e=_EDEN, dgrad_w=_EDEN, wgrad_e=_EDEN, wgrad_x=_EDEN, rotate_back=0),
}


def _recipe(name):
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; allowed: {list(RECIPES)}")
    return RECIPES[name]


def _dim_multiple(recipe):
    """What every GEMM dim (in, out and tokens) must be divisible by under a recipe (not cached:
    a few lookups, and torch.compile traces through it without a warning)."""
    r = _recipe(recipe)
    if r is None:
        return 1
    specs = [r[k] for k in ("x", "w", "dgrad_e", "dgrad_w", "wgrad_e", "wgrad_x") if isinstance(r[k], dict)]
    return max([FORMATS[r["fmt"]]] + [s.get("hadamard", 0) for s in specs] +
               [EDEN_GROUP for s in specs if s.get("rounding") == "eden"])


def _flat(q):
    """QTensor -> (codes, scales, mask, tensor_scale) with (fresh) empty tensors for None."""
    dev = q.codes.device
    mask = q.mask if q.mask is not None else torch.empty(0, dtype=torch.uint8, device=dev)
    ts = q.tensor_scale if q.tensor_scale is not None else torch.empty(0, device=dev)
    return q.codes, q.scales, mask, ts


def _unflat(codes, scales, mask, ts, fmt, shape):
    return QTensor(codes, scales, ts if ts.numel() else None, fmt, tuple(shape), 1,
                   mask if mask.numel() else None)


def _linear_fwd_impl(x, w, recipe, out_dtype):
    """Y (M, N) = Q(X) Q(W)^T for X (M, K), W (N, K); also returns the FP4 tensors the backward
    re-quantizes (codes, scales, mask, tensor scale of X, then of W) instead of BF16 copies."""
    r = RECIPES[recipe]
    fold = mm_backend(r["fmt"], x.device) == "fp8"  # the kernels emit the fp8 operands directly
    qx = quantize(x, r["fmt"], fold=fold, **r["x"])
    qw = quantize(w, r["fmt"], fold=fold, **r["w"])
    return (mm(qx, qw, out_dtype),) + _flat(qx) + _flat(qw)


# torch.compile sees the linear layer as two custom ops (opaque, no graph breaks); eager mode
# calls the same functions through an autograd.Function, which dispatches faster.
@torch.library.custom_op("fp4::linear_fwd", mutates_args=())
def _linear_fwd(x: torch.Tensor, w: torch.Tensor, recipe: str, out_dtype: torch.dtype) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _linear_fwd_impl(x, w, recipe, out_dtype)


@_linear_fwd.register_fake
def _(x, w, recipe, out_dtype):
    r, (m, k), n = RECIPES[recipe], x.shape, w.shape[0]
    bs, masked = FORMATS[r["fmt"]], r["x"].get("scale_rule") == "quest"
    def saved(rows):
        u8 = dict(dtype=torch.uint8)
        mask = x.new_empty(rows, k // 8, **u8) if masked else x.new_empty(0, **u8)
        ts = x.new_empty((), dtype=torch.float32) if r["fmt"] == "nvfp4" else x.new_empty(0, dtype=torch.float32)
        return x.new_empty(rows, k // 2, **u8), x.new_empty(rows, k // bs, **u8), mask, ts
    return (x.new_empty(m, n, dtype=out_dtype),) + saved(m) + saved(n)


@torch.library.custom_op("fp4::linear_bwd", mutates_args=())
def _linear_bwd(e: torch.Tensor, xc: torch.Tensor, xs: torch.Tensor, xm: torch.Tensor, xg: torch.Tensor,
                wc: torch.Tensor, ws: torch.Tensor, wm: torch.Tensor, wg: torch.Tensor, recipe: str,
                x_dtype: torch.dtype, w_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _linear_bwd_impl(e, xc, xs, xm, xg, wc, ws, wm, wg, recipe, x_dtype, w_dtype)


def _linear_bwd_impl(e, xc, xs, xm, xg, wc, ws, wm, wg, recipe, x_dtype, w_dtype):
    """dX = E Q(W) and dW = E^T Q(X), both GEMMs on FP4 operands. Fresh seeds and Hadamard signs
    on every call: with the kernels, one seed drawn on the GPU (torch's CUDA generator; the
    kernels read it and derive the signs: no host sync, and CUDA-graph replays stay random),
    else from torch's CPU generator. Checkpoints hold both generators' states."""
    r = RECIPES[recipe]
    (m, n), k = e.shape, xc.shape[1] * 2
    qx = _unflat(xc, xs, xm, xg, r["fmt"], (m, k))
    qw = _unflat(wc, ws, wm, wg, r["fmt"], (n, k))
    if e.is_cuda and kernels_enabled():  # drawn on the GPU: graph-safe, no host sync
        seed = DeviceSeed(torch.randint(0, 2**31 - 1, (1,), device=e.device, dtype=torch.int32))
    else:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    dx = _grad_gemm(e, qw, r, "dgrad", seed, axis=1)  # (M, K): contraction over N
    dw = _grad_gemm(e, qx, r, "wgrad", seed + 1, axis=0)  # (N, K): contraction over M
    if r["rotate_back"]:  # quartet: straight-through with the clip mask, then undo the rotation
        dx, dw = _rotate_back(dx, qx, r["rotate_back"]), _rotate_back(dw, qw, r["rotate_back"])
    return dx.to(x_dtype), dw.to(w_dtype)


def _rotate_back(d, q, n):
    """(dL/d(XH) * m) H^T (SPEC 5): the straight-through estimator with QuEST's clip mask, then
    the inverse rotation (H is symmetric), computed in FP32 and rounded to d's dtype. On a GPU
    one kernel does it in one pass (rotate_back in kernels.cu), bit for bit."""
    if d.is_cuda and kernels_enabled() and q.mask is not None and n % 32 == 0:
        return kernels.rotate_back(d, q.mask, n)
    m = q.clip_mask()
    return hadamard(d * m if m is not None else d, n)


@_linear_bwd.register_fake
def _(e, xc, xs, xm, xg, wc, ws, wm, wg, recipe, x_dtype, w_dtype):
    k = xc.shape[1] * 2
    return e.new_empty(e.shape[0], k, dtype=x_dtype), e.new_empty(e.shape[1], k, dtype=w_dtype)


def _grad_gemm(e, saved, r, which, seed, axis):
    """One backward GEMM: E quantized along `axis` (N for dgrad, M for wgrad) against the saved
    forward operand re-quantized along the same dim, with shared random signs."""
    fmt, spec_e, spec_s = r["fmt"], r[which + "_e"], r[which + ("_w" if which == "dgrad" else "_x")]
    n = spec_e.get("hadamard", 0)
    if not n:
        signs = None
    elif isinstance(seed, DeviceSeed):
        signs = DeviceSigns(n, seed)  # derived in the kernels from the device seed
    else:
        signs = random_signs(n, seed)  # host signs: no device copy either way
    qe = quantize(e, fmt, axis=axis, seed=seed, signs=signs, fold=mm_backend(fmt, e.device) == "fp8", **spec_e)
    if spec_s == "transpose":
        qs = transpose_2d(saved)
    else:
        qs = requantize(saved, fmt, seed=seed + 7919, signs=signs, **spec_s)
    return mm(qe, qs, e.dtype)


def _linear_setup(ctx, inputs, output):
    x, w, recipe, _ = inputs
    ctx.recipe, ctx.x_dtype, ctx.w_dtype = recipe, x.dtype, w.dtype
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[1:])


def _linear_backward(ctx, grad_y, *_):
    dx, dw = _linear_bwd(grad_y.contiguous(), *ctx.saved_tensors, ctx.recipe, ctx.x_dtype, ctx.w_dtype)
    return dx, dw, None, None


torch.library.register_autograd("fp4::linear_fwd", _linear_backward, setup_context=_linear_setup)


class _LinearFn(torch.autograd.Function):
    """The eager twin of the custom ops above (same functions, less dispatch overhead)."""

    @staticmethod
    def forward(ctx, x, w, recipe, out_dtype):
        out = _linear_fwd_impl(x, w, recipe, out_dtype)
        _linear_setup(ctx, (x, w, recipe, out_dtype), out)
        return out[0]

    @staticmethod
    def backward(ctx, grad_y):
        dx, dw = _linear_bwd_impl(grad_y.contiguous(), *ctx.saved_tensors, ctx.recipe, ctx.x_dtype, ctx.w_dtype)
        return dx, dw, None, None


class FP4Linear(torch.nn.Linear):
    """nn.Linear whose forward, input-gradient and weight-gradient GEMMs run on FP4 operands
    under `recipe` (RECIPES). Same parameters and state_dict as nn.Linear; fullstack adds L's two
    BF16 factors as buffers (lora_rank: see "LoRA-SVD projections" below)."""

    def __init__(self, in_features, out_features, bias=False, recipe="quartet", device=None, dtype=None,
                 lora_rank=0):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        mult = _dim_multiple(recipe)
        if in_features % mult or out_features % mult:
            raise ValueError(f"recipe {recipe!r} needs in and out features divisible by {mult}, got {in_features}->{out_features}")
        self.recipe = recipe
        _init_lora(self, lora_rank, device)  # fullstack: the BF16 rank-r part (SPEC 8.4)

    def forward(self, x):
        if self.recipe == "bf16":
            return torch.nn.functional.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)  # (M, K), M = tokens
        if x2.shape[0] % _dim_multiple(self.recipe):
            raise ValueError(f"recipe {self.recipe!r} needs the token count (batch * seq = {x2.shape[0]}) divisible by {_dim_multiple(self.recipe)}")
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x2 = x2.to(out_dtype) if x2.dtype != out_dtype else x2
        w = _lora_residual(self) if self.lora_rank else self.weight  # fullstack: R = W - L
        if torch.compiler.is_compiling():
            y = _linear_fwd(x2, w, self.recipe, out_dtype)[0]
        else:
            y = _LinearFn.apply(x2, w, self.recipe, out_dtype)
        if self.lora_rank:
            y = y + _lora_lowrank(self, x2)
        y = y.view(*x.shape[:-1], self.out_features)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self):
        return super().extra_repr() + f", recipe={self.recipe}" + (f", lora_rank={self.lora_rank}" if self.lora_rank else "")


def to_fp4(model, recipe="quartet", skip=None, lora_rank=0):
    """Swap every nn.Linear in `model` for an FP4Linear (same Parameters), in place. skip is a
    callable skip(name, module) -> bool, or an iterable of name substrings to leave alone.
    lora_rank: FP4Linear's (fullstack only); L starts at 0: call refit_lora(model) to fit it."""
    _recipe(recipe)
    if skip is not None and not callable(skip):
        names = tuple(skip)
        skip = lambda name, _: any(s in name for s in names)  # noqa: E731
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not torch.nn.Linear or (skip and skip(full, child)):
                continue
            new = FP4Linear(child.in_features, child.out_features, child.bias is not None, recipe,
                            device="meta", lora_rank=lora_rank)
            new.weight, new.bias = child.weight, child.bias
            _lora_place(new)
            setattr(mod, child_name, new)
    return model


# ---------------------------------------------------------------------------------------------
# LoRA-SVD projections and the fullstack recipe (SPEC 8.4)
#
# W, the FP32 master (the Parameter), is split as W = L + R. L = U_r S_r V_r^T, the top-r part of
# W from a randomized SVD, lives in two BF16 buffers, lora_us = U_r S_r (N, r) and lora_v = V_r
# (K, r), fixed between refits (refit_lora) and saved in the state_dict. R = W - L is recomputed
# in FP32 every step and goes through the recipe's FP4 linear (four_over_six NVFP4). So
#   forward  y  = (x V_r)(U_r S_r)^T   [BF16]  +  Q(x) Q(R)^T             [NVFP4]
#   dgrad    dX = (E U_r S_r) V_r^T    [BF16]  +  Q(E) Q(R)               [NVFP4]
#   wgrad    dW = dR = Q(E)^T Q(X)                                        [NVFP4]
# The BF16 part is plain torch ops (autograd differentiates it; the buffers get no gradient), and
# dR/dW = I, so the recipe's FP4 weight gradient is W's gradient.

LORA_OVERSAMPLE = 16  # p: Halko et al. suggest 5-10; a refit is rare, so spend a little more
LORA_POWER_ITERS = 4  # q: subspace iterations (A A^T)^q A Omega, for slowly decaying spectra
LORA_FRACTION = 1 / 16  # default rank: this fraction of min(in, out), in multiples of 16 (README)


def lora_rank_for(in_features, out_features):
    """The default rank: min(in, out) * LORA_FRACTION rounded up to a multiple of 16 (BF16 GEMM
    tiles), at least 16."""
    return 16 * max(1, math.ceil(min(in_features, out_features) * LORA_FRACTION / 16))


def randomized_svd(a, rank, oversample=LORA_OVERSAMPLE, power_iters=LORA_POWER_ITERS, seed=0):
    """The top-`rank` singular triplets of a (m, n): U (m, r), S (r,), V (n, r), FP32, by
    randomized subspace iteration and a small exact SVD (Halko, Martinsson, Tropp 2011, SIAM
    Review 53(2), Algorithms 4.4 and 5.1). a ~= U diag(S) V^T."""
    if a.ndim != 2:
        raise ValueError(f"randomized_svd takes a 2-D tensor, got shape {tuple(a.shape)}")
    if not 0 < rank <= min(a.shape):
        raise ValueError(f"rank must be in 1..min{tuple(a.shape)} = {min(a.shape)}, got {rank}")
    if oversample < 0 or power_iters < 0:
        raise ValueError(f"oversample and power_iters must be >= 0, got {oversample} and {power_iters}")
    a = a.detach().float()
    q = _range_finder(a, min(rank + oversample, min(a.shape)), power_iters, seed)  # (m, l)
    ub, s, vh = torch.linalg.svd(q.t() @ a, full_matrices=False)  # B = Q^T A (l, n) = Ub S Vh
    return q @ ub[:, :rank], s[:rank], vh[:rank].t()


def _range_finder(a, l, power_iters, seed):
    """Q (m, l) with orthonormal columns, range(Q) ~ the top-l left singular space of a: QR of
    A Omega (Omega (n, l) Gaussian, drawn on the CPU from seed: the same on every device), then
    power_iters rounds of A^T, A with a QR after each product (Halko Alg. 4.4: without the
    re-orthonormalization FP32 loses every direction below sigma_1 * eps^(1/(2q+1)))."""
    omega = torch.randn(a.shape[1], l, generator=torch.Generator().manual_seed(seed))
    q = torch.linalg.qr(a @ omega.to(a.device)).Q
    for _ in range(power_iters):
        q = torch.linalg.qr(a.t() @ q).Q  # (n, l)
        q = torch.linalg.qr(a @ q).Q  # (m, l)
    return q


def _init_lora(layer, lora_rank, device):
    """FP4Linear's LoRA state: layer.lora_rank (0: none) and, for r > 0, the two BF16 buffers,
    zero (L = 0) until refit_lora fits them. lora_rank 0 asks for lora_rank_for(in, out), -1 for
    no low-rank part (the fullstack ablation)."""
    n, k = layer.out_features, layer.in_features
    if not isinstance(lora_rank, int) or isinstance(lora_rank, bool):
        raise TypeError(f"lora_rank must be an int, got {type(lora_rank).__name__}")
    if layer.recipe != "fullstack":
        if lora_rank:
            raise ValueError(f"lora_rank is a parameter of recipe 'fullstack', not {layer.recipe!r}")
        layer.lora_rank = 0
        return
    r = lora_rank_for(k, n) if lora_rank == 0 else max(lora_rank, 0)
    if lora_rank < -1 or r > min(n, k):
        raise ValueError(f"lora_rank must be -1 (none), 0 (default) or 1..min(in, out) = {min(n, k)} "
                         f"for a {k}->{n} layer, got {lora_rank}")
    layer.lora_rank = r
    if r:
        layer.register_buffer("lora_us", torch.zeros(n, r, device=device, dtype=torch.bfloat16))  # U_r S_r
        layer.register_buffer("lora_v", torch.zeros(k, r, device=device, dtype=torch.bfloat16))  # V_r


def _lora_place(layer):
    """Give a layer built on the meta device (to_fp4) real zero buffers on its weight's device."""
    dev = layer.weight.device
    for name in ("lora_us", "lora_v"):
        buf = getattr(layer, name, None)
        if buf is not None and buf.device != dev:
            setattr(layer, name, torch.zeros(buf.shape, device=dev, dtype=torch.bfloat16))


def _lora_residual(layer):
    """R = W - U_r S_r V_r^T in FP32 (N, K); its gradient is W's. Autocast off: L's product
    must not be rounded to BF16 before the subtraction. (TF32, if allowed, changes only the
    summation order: BF16 factors are exact in TF32, their products exact in FP32.)"""
    with torch.autocast(layer.weight.device.type, enabled=False):
        low = layer.lora_us.float() @ layer.lora_v.float().t()  # (N, r) @ (r, K)
        return layer.weight.float() - low


def _lora_lowrank(layer, x2):
    """(x V_r)(U_r S_r)^T in BF16 for x2 (M, K): (M, K) @ (K, r) -> (M, r) @ (r, N) -> (M, N)."""
    xr = x2.to(torch.bfloat16) @ layer.lora_v.to(torch.bfloat16)
    return xr @ layer.lora_us.to(torch.bfloat16).t()


@torch.no_grad()
def refit_lora(model, seed=0):
    """Refit L = U_r S_r V_r^T of every fullstack FP4Linear in `model` (a module, or an
    FP4Linear) from its current weight, by randomized_svd (seed + the layer's index). W is not
    changed: R = W - L absorbs the difference from the next forward on. Returns the number of
    layers refitted."""
    layers = [m for m in model.modules() if isinstance(m, FP4Linear) and m.lora_rank]
    for i, layer in enumerate(layers):
        if not torch.isfinite(layer.weight).all():
            raise ValueError(f"refit_lora: layer {i} ({layer.extra_repr()}) has a non-finite weight")
        u, s, v = randomized_svd(layer.weight, layer.lora_rank, seed=seed + i)
        layer.lora_us.copy_(u * s)  # (N, r) * (r,): the singular values go with U
        layer.lora_v.copy_(v)
    return len(layers)


def backends(device=None):
    """What this machine uses: the quantization path and the mm backend per format."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quant = "cuda" if dev.type == "cuda" and kernels_enabled() else "torch"
    return {"device": str(dev), "quantize": quant, "mm": mm_backend("mxfp4", dev),
            "mm_nvfp4": mm_backend("nvfp4", dev), "fast_accum_bits": FAST_ACCUM_BITS}


def kernels_enabled():
    """True when CUDA tensors go through kernels.cu (CuPy importable, FP4_KERNELS not 'torch')."""
    return kernels.enabled()
