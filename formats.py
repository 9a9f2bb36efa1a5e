"""
formats.py: the bits of FP4 training. The E2M1 element, the E8M0 and E4M3 block scales, the
counter-based random numbers that stochastic rounding and random Hadamard signs draw, the
Hadamard rotation, and QTensor, the packed container every quantizer returns.

fp4.py builds the quantizers and GEMMs on these; cuda_kernels.py launches kernels.cu, which
computes the same bits (the bit-exactness contract is in fp4.py's docstring). Section numbers
(SPEC x) refer to ../shared/SPEC.md.
"""
import functools
import math
from dataclasses import dataclass

import torch

import selfcheck  # the self-checks' comparison (the probes below report through it)

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


def _hash_words(seed, n, device="cpu", start=0):
    """lowbias32(lo32(j) ^ key(seed, j >> 32)) for j = start..start+n-1, as int32 tensors holding
    uint32 bits."""
    out, j, end = [], start, start + n
    while j < end:  # one key per 2^32 indices
        stop = min(end, ((j >> 32) + 1) << 32)
        idx = torch.arange(j, stop, dtype=torch.int64, device=device) & _M32
        lo = (idx - (idx >= 1 << 31).long() * (1 << 32)).int()  # uint32 bits as int32
        out.append(_lowbias32_i32(lo ^ _s32(hash_key(seed, j >> 32))))
        j = stop
    return torch.cat(out) if len(out) > 1 else out[0]


def uniform(seed, n, device="cpu"):
    """n uniform FP32 numbers in [0, 1) for the indices 0..n-1 (MS-EDEN's scale rounding):
    u[i] = (lowbias32(lo32(i) ^ key(seed, i >> 32)) >> 8) * 2^-24 (24 bits, exact in FP32)."""
    return ((_hash_words(seed, n, device) >> 8) & 0xFFFFFF).float() * 2.0**-24


def random_bytes(seed, n, device="cpu", start=0):
    """Stochastic rounding's 8 random bits for the element indices start..start+n-1 (SPEC 4): element
    i takes byte i mod 4 (bits 8(i mod 4) .. 8(i mod 4) + 7) of the word W(seed, i div 4), one hash per
    four elements, as Blackwell's cvt.rs consumes one 32-bit rbits word per four values. int32 0..255.
    start > 0: the draws of a shard whose first element is element `start` of the whole tensor."""
    first = start // 4
    words = _hash_words(seed, -(-(start + n) // 4) - first, device, first)  # the words covering them
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=device)
    skip = start - 4 * first
    return ((words.unsqueeze(-1) >> shifts) & 0xFF).reshape(-1)[skip:skip + n]


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


# ---------------------------------------------------------------------------------------------
# Fixed probe inputs of the self-checks (selfcheck.py): small, where a layout error shows

def mm_probe(fmt, k=256):
    """Fixed operands a (144, k), b (80, k) where a layout error hides: rows padded to 128-row scale
    tiles (every dim a multiple of 16, as torch._scaled_mm and the native path demand: fp4.mm_refusals)
    and several 4-column tiles, every nibble value (-0 too), scales varying inside a tile, a
    NaN block scale, NVFP4 tensor scales. Values code * scale with scales in [2^-1, 4]: every
    product and partial sum is exact in FP32 (< 24 bits), so any summation order gives the same bits."""
    g = torch.Generator().manual_seed(7)
    bs = FORMATS[fmt]

    def operand(rows, ts):
        codes = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
        if fmt == "mxfp4":
            scales = torch.randint(126, 130, (rows, k // bs), generator=g, dtype=torch.uint8)
        else:
            grid = torch.tensor([0.5, 0.75, 1.0, 1.5, 2.0, 3.0])
            scales = e4m3_encode(grid[torch.randint(0, 6, (rows, k // bs), generator=g)])
        tscale = None if fmt == "mxfp4" else torch.tensor(ts)
        return QTensor(codes, scales, tscale, fmt, (rows, k), 1)

    a, b = operand(144, 0.25), operand(80, 2.0)
    a.scales[5, 1] = E8M0_NAN if fmt == "mxfp4" else E4M3_NAN  # row 5 of the product: NaN
    return a, b


def to_device(q, device):
    """q with every tensor on `device`: codes, scales, tensor scale and clip mask (a kernel given
    a pointer to another device's memory reads out of bounds)."""
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    folded = None if q.folded is None else tuple(move(t) for t in q.folded)
    return QTensor(move(q.codes), move(q.scales), move(q.tensor_scale), q.fmt, q.shape, q.axis, move(q.mask), folded)


def quant_probe():
    """(160, 256): rows padded to scale tiles (and divisible by 32 for a requantize along them),
    blocks of magnitudes 2^-8..2^7, -0, a NaN, a zero block, SR's probe values."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(160, 256, generator=g) * 2.0 ** torch.randint(-8, 8, (160, 8, 1), generator=g).repeat_interleave(32, 1).view(160, 256)
    x[3, 5], x[4, 0:32], x[9, 17] = -0.0, 0.0, float("nan")
    x[10] = torch.tensor([1.25, -2.5, 4.4, 0.3, 1.75, -3.1, 5.0, 0.7]).repeat(32)  # SR's probe values
    return x


def qtensor_mismatches(got, want, what):
    bad = selfcheck.mismatches(got.codes.cpu(), want.codes, what + " codes ")
    bad += selfcheck.mismatches(got.scales.cpu(), want.scales, what + " scales ")
    if want.tensor_scale is not None:
        bad += selfcheck.mismatches(got.tensor_scale.cpu().view(-1), want.tensor_scale.view(-1), what + " tensor scale ")
    if want.mask is not None:
        bad += selfcheck.mismatches(got.mask.cpu(), want.mask, what + " mask ")
    return bad


QUANT_CASES = [dict(fmt="mxfp4"), dict(fmt="mxfp4", scale_rule="quest", hadamard=32),
               dict(fmt="nvfp4"), dict(fmt="nvfp4", scale_rule="four_over_six"),
               dict(fmt="nvfp4", block2d=True)]
SR_CASES = [dict(fmt="mxfp4", rounding="sr", seed=5), dict(fmt="nvfp4", rounding="sr", hadamard=16, seed=6)]


def quant_args(kw):
    """A probe case -> (fmt, the rest of quantize's arguments), Hadamard signs drawn."""
    o = dict(axis=1, scale_rule="absmax", rounding="rn", hadamard=0, signs=None, seed=0, block2d=False) | kw
    fmt = o.pop("fmt")
    if o["hadamard"]:
        o["signs"] = random_signs(o["hadamard"], 3)
    return fmt, o
