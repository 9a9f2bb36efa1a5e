"""
Attention for FP4 training: BF16 (SDPA) and NVFP4 (Full-Stack FP4, SPEC 8.3), forward and backward.

attention(q, k, v, causal=True, fmt=None) on (B, H, T, D) tensors, k and v with H or fewer heads
(GQA: H % Hkv == 0). fmt=None is torch's scaled_dot_product_attention. fmt='nvfp4' is defined by
the PyTorch reference below (materialised scores, any device); on a GPU, Triton kernels compute the
same numbers without materialising the scores and are tested against it.

The numerics of fmt='nvfp4' (SPEC 8.3; SPEC 2 for NVFP4). Q, K and V are quantized ONCE, along the
head dim (1x16 blocks, E4M3 block scales, one FP32 tensor scale each, absmax, round to nearest); only
these FP4 tensors, O and the log-sum-exp are saved for the backward. Write q^ = code * block scale
(exact in BF16: at most 6 significant bits) and gq for Q's tensor scale, so dequantize(Q) = q^ gq:

  forward   S = (q^ k^T) c,  c = scale gq gk          Q K^T on NVFP4 operands, FP32 accumulation
            m = rowmax S,  E = exp(S - m),  l = rowsum E,  lse = m + log l
            O = ((bf16(E) v^) / l) gv                  P V in BF16 (the tensor scale gv after)
  backward  delta = rowsum(dO O),  P = exp(S - lse)    S recomputed from the same q^, k^
            dV = bf16(P)^T bf16(dO)                    BF16 (summed over the heads of a GQA group)
            dP = (bf16(dO) v^T) gv,  dS = P (dP - delta)
            dQ = scale gkt (Qk(dS) kt^)                NVFP4 x NVFP4, contraction over keys
            dK = scale gqt (Qq(dS)^T qt^)              NVFP4 x NVFP4, contraction over queries

Kt and Qt are K and Q re-quantized along the tokens: dequantize (exactly, in FP32), quantize in
16-blocks of tokens (the last block zero-padded), absmax, RN, a new tensor scale (fp4.requantize),
so both operands of each dS product are NVFP4 along its contraction dim, as a native FP4 GEMM needs.
kt^, gkt: their code * block scale and tensor scale. These two are made in the backward, not saved.

Qk(dS) and Qq(dS): dS quantized to NVFP4 in 16-blocks along keys (for dQ) or queries (for dK), with
the FP32 tensor scale replaced by one scale G per 64x64 tile of the (query, key) score matrix: a
global amax of dS would need a whole extra pass over the scores, and a tile's own scale is finer.
G is a power of two, so that code * s_b * G is still exact in BF16 and each tile's values go into
the FP32-accumulating GEMM as they are (a general FP32 G would multiply every tile's partial product
separately; measured: 64 more registers a thread in the kernels):
  G = the smallest power of two >= amax(|dS| in the tile) / (6 * 448); 1 for an all-zero tile;
      NaN if the tile holds a NaN or Inf
  s_b = e4m3_rn(min(amax_b / 6 / G, 448)) per 16-block,  r_b = 1 / (s_b G) (0 if s_b G == 0)
  v = dS r_b,  a = min(|v|, 6),  step = 0.5 (a < 2), 1 (a < 4), 2: the E2M1 grid spacing at a
  'sr' (default): |code| = min(floor((floor(a 256 / step) + byte) / 256) step, 6)   (SPEC 4's rule)
  'rn':           |code| = rint(a / step) step, ties to even (the E2M1 code ties of SPEC 1)
  value = sign(v) |code| s_b G, exact in BF16.
dS is a gradient: stochastic rounding, as the nvfp4 recipe does for its gradients (SPEC 5), keeps
dQ and dK unbiased. The random byte of element n of a layout (n = row * Tp + col, Tp = T rounded up
to 64; rows are queries for Qk and keys for Qq) is byte n mod 4 of lowbias32((n div 4) ^ key),
key = fp4.hash_key(seed, 2 (b H + h) + {0 for Qk, 1 for Qq}), seed drawn per backward call.
"""
import math
import os
import types

import torch
import torch.nn.functional as F

import formats
import fp4
import selfcheck  # the Triton kernels' first-use check (below)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference runs; the kernels below are never launched
    triton = None
    tl = types.SimpleNamespace(constexpr=None)  # lets the kernels' annotations evaluate

FORMATS = (None, "nvfp4")
DS_ROUNDINGS = ("sr", "rn")
BWD_LAYOUTS = ("split", "fused")  # the GPU backward's kernels (_bwd_layout)
TILE = 64  # the dS scale tile (64 queries x 64 keys); both backward kernels use it as their tile
E4M3_MAX = 448.0
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Public API

def attention(q, k, v, causal=True, fmt=None, scale=None, ds_rounding="sr"):
    """Softmax attention of q (B, H, T, D) over k, v (B, Hkv, T, D), H % Hkv == 0; returns
    (B, H, T, D) in q's dtype. fmt=None: SDPA; 'nvfp4': the FP4 attention of this module.
    scale defaults to 1/sqrt(D); ds_rounding ('sr' or 'rn') rounds dS in the backward."""
    _check(q, k, v, fmt, ds_rounding)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if fmt is None:
        return _sdpa(q, k, v, causal, scale)
    return _fp4_attention(q, k, v, bool(causal), scale, ds_rounding)[0]


def _check(q, k, v, fmt, ds_rounding):
    if fmt not in FORMATS:
        raise ValueError(f"attention fmt must be one of {FORMATS}, got {fmt!r}")
    if ds_rounding not in DS_ROUNDINGS:
        raise ValueError(f"ds_rounding must be one of {DS_ROUNDINGS}, got {ds_rounding!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"attention: {name} must be (B, H, T, D), got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"attention: {name} has dtype {t.dtype}; allowed: float32, bfloat16, float16")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise TypeError(f"attention: q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} "
                        f"on {q.device}/{k.device}/{v.device}")
    (b, h, t, d), (bk, hk, tk, dk) = q.shape, k.shape
    if v.shape != k.shape or b != bk or t != tk or d != dk:
        raise ValueError(f"attention: k and v must be (B, Hkv, T, D) matching q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if h % hk:
        raise ValueError(f"attention: q's {h} heads are not a multiple of k's {hk} heads (GQA)")
    if fmt == "nvfp4" and d % 16:
        raise ValueError(f"attention fmt='nvfp4' needs a head dim divisible by 16 (NVFP4 blocks), got {d}")


def _sdpa(q, k, v, causal, scale):
    """BF16 attention: torch's fused SDPA (flash / cuDNN / efficient, whichever torch picks)."""
    if k.shape[1] != q.shape[1]:
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        except TypeError:  # torch without enable_gqa: give every q head its kv head
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


# ---------------------------------------------------------------------------------------------
# NVFP4 operands: Q, K, V along D (saved); Qt, Kt along the tokens (made in the backward)

def quantize_qkv(x):
    """NVFP4 along the head dim (SPEC 2: absmax, RN), a QTensor with codes (B, H, T, D/2),
    scales (B, H, T, D/16) and an FP32 tensor scale. CUDA tensors go through kernels.cu."""
    return fp4.quantize(x.contiguous(), "nvfp4", axis=-1)


def _unit(qt, dtype=torch.bfloat16):
    """code * block scale, without the tensor scale: exact in BF16 (<= 6 significant bits)."""
    one = torch.ones((), dtype=torch.float32, device=qt.codes.device)
    return fp4.dequantize(fp4.QTensor(qt.codes, qt.scales, one, qt.fmt, qt.shape, qt.axis), dtype)


def along_tokens(qt):
    """Re-quantize a (B, H, T, D) NVFP4 QTensor along T in 16-blocks (T zero-padded to T16, a
    multiple of 16), absmax, RN: the QTensor of the (B*H*T16, D) matrix quantized along its rows,
    codes (D, B*H*T16/2), scales (D, B*H*T16/16). With T % 16 == 0 this is fp4.requantize (one
    kernel pass on a GPU); otherwise dequantize, pad and quantize, which gives the same numbers."""
    b, h, t, d = qt.shape
    if t % 16 == 0:
        flat = fp4.QTensor(qt.codes.reshape(b * h * t, d // 2), qt.scales.reshape(b * h * t, d // 16),
                           qt.tensor_scale, "nvfp4", (b * h * t, d), 1)
        return fp4.requantize(flat, "nvfp4", scale_rule="absmax", rounding="rn")
    t16 = -(-t // 16) * 16
    x = F.pad(fp4.dequantize(qt), (0, 0, 0, t16 - t))  # (B, H, T16, D) FP32, exact
    return fp4.quantize(x.reshape(b * h * t16, d), "nvfp4", axis=0)


def _unit_tokens(qtt, bh, t16, dtype=torch.bfloat16):
    """along_tokens' values code * block scale as (B*H, T16, D) (a view of a (D, B*H*T16) buffer)."""
    return _unit(qtt, dtype).view(bh, t16, -1)


def _constants(scale, gq, gk, gv, gqt=None, gkt=None):
    """The FP32 scalars both implementations use, made by the same torch ops (no host sync):
    [c = scale gq gk, c log2(e), gv, scale gqt, scale gkt]."""
    s = torch.tensor(scale, dtype=torch.float32, device=gq.device)
    c = s * gq * gk
    gqt = gq if gqt is None else gqt
    gkt = gk if gkt is None else gkt
    return torch.stack([c, c * LOG2E, gv, s * gqt, s * gkt])


# ---------------------------------------------------------------------------------------------
# The PyTorch reference: the definition (materialised (T, T) scores; for modest T)

def _bf16(x):
    return x.to(torch.bfloat16).float()


def _scores(q1, k1, c, causal):
    """S = (q^ k^T) c (B, H, T, T) in FP32, -inf above the diagonal when causal."""
    s = (q1 @ k1.transpose(-1, -2)) * c
    if causal:
        t = s.shape[-1]
        above = torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _heads(x, group):
    return x.repeat_interleave(group, 1) if group > 1 else x


def _group_sum(x, group):
    """(B, H, ...) -> (B, H/group, ...): the gradient of a kv head sums over its q heads."""
    return x.unflatten(1, (-1, group)).sum(2) if group > 1 else x


def _exact_operands(qq, kq, vq, scale):
    """q^, k^, v^ in FP32 (kv heads repeated for GQA), c = scale gq gk and gv."""
    group = qq.shape[1] // kq.shape[1]
    q1 = _unit(qq).float()
    k1, v1 = (_heads(_unit(t).float(), group) for t in (kq, vq))
    c, _, gv, _, _ = _constants(scale, qq.tensor_scale, kq.tensor_scale, vq.tensor_scale)
    return q1, k1, v1, c, gv


def reference_forward(qq, kq, vq, causal, scale):
    """O (B, H, T, D) FP32 and lse (B, H, T) FP32 from the NVFP4 Q, K, V (module docstring)."""
    q1, k1, v1, c, gv = _exact_operands(qq, kq, vq, scale)
    s = _scores(q1, k1, c, causal)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    o = ((_bf16(e) @ v1) / l) * gv
    return o, (m + torch.log(l)).squeeze(-1)


def reference_backward(do, o, lse, qq, kq, vq, causal, scale, seed, ds_rounding="sr", quantize_ds=True):
    """dQ, dK, dV (FP32) given dO and the saved O, lse and NVFP4 Q, K, V (module docstring).
    quantize_ds=False (for tests) multiplies the FP32 dS by the dequantized K and Q instead."""
    group = qq.shape[1] // kq.shape[1]
    _, ds, dv = _probs_and_ds(do, o, lse, qq, kq, vq, causal, scale)
    dv = _group_sum(dv, group)
    if not quantize_ds:
        kf, qf = _heads(fp4.dequantize(kq), group), fp4.dequantize(qq)
        return scale * (ds @ kf), _group_sum(scale * (ds.transpose(-1, -2) @ qf), group), dv
    b, h, t, d = qq.shape
    qt, kt = along_tokens(qq), along_tokens(kq)
    t16 = qt.shape[0] // (b * h)
    qt1 = _unit_tokens(qt, b * h, t16).float().view(b, h, t16, d)
    kt1 = _heads(_unit_tokens(kt, b * kq.shape[1], t16).float().view(b, -1, t16, d), group)
    cst = _constants(scale, qq.tensor_scale, kq.tensor_scale, vq.tensor_scale, qt.tensor_scale, kt.tensor_scale)
    dq = _ds_product(ds, kt1, seed, 0, ds_rounding) * cst[4]
    dk = _ds_product(ds.transpose(-1, -2), qt1, seed, 1, ds_rounding) * cst[3]
    return dq, _group_sum(dk, group), dv


def _probs_and_ds(do, o, lse, qq, kq, vq, causal, scale):
    """P = exp(S - lse), dS = P (dP - delta) (B, H, T, T) FP32, and dV per q head (the BF16 part)."""
    q1, k1, v1, c, gv = _exact_operands(qq, kq, vq, scale)
    p = torch.exp(_scores(q1, k1, c, causal) - lse.unsqueeze(-1))
    dob = _bf16(do.float())
    delta = (do.float() * o.float()).sum(-1, keepdim=True)
    dv = _bf16(p).transpose(-1, -2) @ dob
    dp = (dob @ v1.transpose(-1, -2)) * gv
    return p, p * (dp - delta), dv


def _ds_product(x, other, seed, which, rounding):
    """Q(x) @ other for x (B, H, T, T) quantized along its last dim (module docstring) and other
    (B, H, T16, D) FP32: (B, H, T, D)."""
    b, h, t, _ = x.shape
    tp = -(-t // TILE) * TILE
    xp = F.pad(x, (0, tp - t, 0, tp - t))  # zero padding: the kernels' masked loads
    keys = torch.tensor([fp4.hash_key(seed, 2 * i + which) for i in range(b * h)], device=x.device).view(b, h, 1, 1)
    vals = quantize_ds(xp, keys, rounding)[0]  # (B, H, Tp, Tp)
    return (vals @ F.pad(other, (0, 0, 0, tp - other.shape[2])))[:, :, :t]


def quantize_ds(x, keys, rounding):
    """dS (B, H, Tp, Tp), Tp % 64 == 0, quantized along its last dim in 16-blocks with one scale G
    per 64x64 tile (module docstring). keys (B, H, 1, 1) int64 (None for 'rn'). Returns the values
    sign * |code| * s_b * G (FP32, exact in BF16) and G (B, H, Tp/64, Tp/64)."""
    b, h, r, c = x.shape
    tiles = x.view(b, h, r // TILE, TILE, c // TILE, TILE)
    finite = torch.isfinite(tiles).all(5).all(3)
    amax = tiles.abs().amax(5).amax(3)
    g = _pow2_ceil(amax / torch.full_like(amax, 6 * E4M3_MAX))
    g = torch.where(finite, torch.where(amax > 0, g, torch.ones_like(g)), float("nan"))
    xb = x.view(b, h, r, c // 16, 16)
    gb = g.repeat_interleave(TILE, 2).repeat_interleave(TILE // 16, 3)  # (B, H, Tp, Tp/16)
    amax_b = xb.abs().amax(-1)
    s = fp4.e4m3_decode(fp4.e4m3_encode(amax_b / torch.full_like(amax_b, 6.0) / gb))
    sg = s * gb
    rcp = torch.where(sg > 0, 1.0 / sg, torch.zeros_like(sg))
    v = xb * rcp.unsqueeze(-1)
    rand = None if rounding == "rn" else _random_bytes(keys, r, c).view_as(v)
    mag = e2m1_round(v.abs(), rand)
    return (torch.where(v < 0, -mag, mag) * sg.unsqueeze(-1)).view(b, h, r, c), g


def _pow2_ceil(x):
    """The smallest power of two >= x for FP32 x > 0 (normal): x itself if its mantissa is zero,
    else the next exponent, on the bits (kernels do the same)."""
    bits = x.view(torch.int32)
    up = torch.where((bits & 0x7FFFFF) == 0, bits, (bits & 0x7F800000) + 0x800000)
    return up.view(torch.float32)


def e2m1_round(a, rand=None):
    """|v| -> E2M1 magnitude: RN (ties to even) when rand is None, else SPEC 4's stochastic
    rounding with one random byte (0..255) per element. NaN stays NaN."""
    a = a.clamp(max=6.0)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    if rand is None:
        return torch.round(a / step) * step  # torch.round: half to even
    m = torch.floor(a * (256.0 / step))
    return torch.clamp(torch.floor((m + rand) / 256.0) * step, max=6.0)


def _random_bytes(keys, r, c):
    """Byte n mod 4 of lowbias32((n div 4) ^ key) for n = row * c + col: (B, H, r, c) FP32."""
    n = torch.arange(r * c, dtype=torch.int64, device=keys.device).view(r, c)
    w = formats._lowbias32((n >> 2) ^ keys)
    return ((w >> ((n & 3) * 8)) & 255).float()


# ---------------------------------------------------------------------------------------------
# Autograd and torch.compile: two custom ops (opaque to the compiler, no graph breaks)

def _use_kernels(device):
    """Triton kernels on CUDA unless FP4_ATTENTION=torch (or Triton is missing), once they passed
    their first-use check on this device (else the PyTorch reference)."""
    return _triton_here(device) and selfcheck.verified("triton.attention", device)


def _triton_here(device):
    return device.type == "cuda" and triton is not None and os.environ.get("FP4_ATTENTION", "triton") != "torch"


def _check_triton(device):
    """The Triton forward and backward against the PyTorch reference on the same quantized operands
    and seed: (1, 2, 80, 32), causal, T not a multiple of the 64-tile, SR dS. Not bit for bit (FP32
    sums in another order; dS's SR flips where a sum lands on a rounding boundary): within
    test_attention.py's bounds, relative O 4e-3, dQ and dK 3e-2, dV 4e-3, absolute lse 1e-4."""
    g = torch.Generator().manual_seed(80)
    q, k, v, do = (torch.randn(1, 2, 80, 32, generator=g).to(device, torch.bfloat16) for _ in range(4))
    qq, kq, vq = quantize_qkv(q), quantize_qkv(k), quantize_qkv(v)
    sc = 32 ** -0.5
    o, lse = triton_forward(qq, kq, vq, True, sc, torch.bfloat16)
    o_r, lse_r = reference_forward(qq, kq, vq, True, sc)
    seed = torch.tensor([7], dtype=torch.int32, device=device)
    grads = triton_backward(do, o, lse, qq, kq, vq, True, sc, seed, "sr")
    want = reference_backward(do, o, lse, qq, kq, vq, True, sc, 7, "sr")
    pairs = (("O", o, o_r, 4e-3), ("dQ", grads[0], want[0], 3e-2), ("dK", grads[1], want[1], 3e-2), ("dV", grads[2], want[2], 4e-3))
    errs = [(name, float((x.float() - y.float()).norm() / y.float().norm()), bound) for name, x, y, bound in pairs]
    errs.append(("lse (absolute)", float((lse.float() - lse_r.float()).abs().max()), 1e-4))
    return [f"{name}: error {err:.2e} > {bound}" for name, err, bound in errs if not err <= bound]


selfcheck.register(selfcheck.Check(
    "triton.attention", _check_triton, "the PyTorch reference (reference_forward/backward), within test_attention's bounds",
    "the PyTorch reference", lambda d: None if _triton_here(d) else "no CUDA device with Triton (or FP4_ATTENTION=torch)"))


def _fwd_impl(q, k, v, causal, scale):
    """(O, lse, then codes, scales, tensor scale of Q, K and V): the saved tensors besides O.
    Autocast reaches into custom ops' bodies: it is off here, the numerics are this module's."""
    with torch.autocast(q.device.type, enabled=False):
        qq, kq, vq = quantize_qkv(q), quantize_qkv(k), quantize_qkv(v)
        if _use_kernels(q.device):
            o, lse = triton_forward(qq, kq, vq, causal, scale, q.dtype)
        else:
            o, lse = reference_forward(qq, kq, vq, causal, scale)
            o = o.to(q.dtype)
    return (o, lse) + tuple(t for qt in (qq, kq, vq) for t in (qt.codes, qt.scales, qt.tensor_scale))


@torch.library.custom_op("fp4::attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            ds_rounding: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, causal, scale)


@_fwd_op.register_fake
def _(q, k, v, causal, scale, ds_rounding):
    def saved(x):
        b, h, t, d = x.shape
        u8 = dict(dtype=torch.uint8)
        return x.new_empty(b, h, t, d // 2, **u8), x.new_empty(b, h, t, d // 16, **u8), x.new_empty((), dtype=torch.float32)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return (torch.empty_like(q, memory_format=torch.contiguous_format), lse) + saved(q) + saved(k) + saved(v)


def _qtensors(qc, qs, qg, kc, ks, kg, vc, vs, vg):
    def qt(c, s, g):
        return fp4.QTensor(c, s, g, "nvfp4", tuple(c.shape[:3]) + (c.shape[3] * 2,), 3)
    return qt(qc, qs, qg), qt(kc, ks, kg), qt(vc, vs, vg)


def _bwd_impl(do, o, lse, qc, qs, qg, kc, ks, kg, vc, vs, vg, causal, scale, ds_rounding):
    """dQ, dK, dV in O's dtype. One fresh seed per call from torch's generator of the device (on a
    GPU drawn there: no host sync; checkpoints hold the generators' states)."""
    qq, kq, vq = _qtensors(qc, qs, qg, kc, ks, kg, vc, vs, vg)
    do = do.contiguous()
    with torch.autocast(do.device.type, enabled=False):
        if _use_kernels(do.device):
            seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=do.device)
            return triton_backward(do, o, lse, qq, kq, vq, causal, scale, seed, ds_rounding)
        seed = int(torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=do.device).item())
        grads = reference_backward(do, o, lse, qq, kq, vq, causal, scale, seed, ds_rounding)
    return tuple(g.to(o.dtype) for g in grads)


@torch.library.custom_op("fp4::attention_bwd", mutates_args=())
def _bwd_op(do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, qc: torch.Tensor, qs: torch.Tensor,
            qg: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor, kg: torch.Tensor, vc: torch.Tensor,
            vs: torch.Tensor, vg: torch.Tensor, causal: bool, scale: float, ds_rounding: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(do, o, lse, qc, qs, qg, kc, ks, kg, vc, vs, vg, causal, scale, ds_rounding)


@_bwd_op.register_fake
def _(do, o, lse, qc, qs, qg, kc, ks, kg, vc, vs, vg, causal, scale, ds_rounding):
    kshape = kc.shape[:3] + (kc.shape[3] * 2,)
    return torch.empty_like(o), o.new_empty(kshape), o.new_empty(kshape)


def _setup(ctx, inputs, output):
    ctx.causal, ctx.scale, ctx.ds_rounding = inputs[3], inputs[4], inputs[5]
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output)  # O, lse and the NVFP4 Q, K, V: nothing in BF16 besides O


def _backward(ctx, do, *_):
    dq, dk, dv = _bwd_op(do, *ctx.saved_tensors, ctx.causal, ctx.scale, ctx.ds_rounding)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("fp4::attention_fwd", _backward, setup_context=_setup)


def _fp4_attention(q, k, v, causal, scale, ds_rounding):
    return _fwd_op(q, k, v, causal, scale, ds_rounding)


# ---------------------------------------------------------------------------------------------
# GPU: Triton kernels, the same numbers without materialising the scores (FlashAttention-2 tiling)

_jit = triton.jit if triton is not None else (lambda fn: fn)


@_jit
def _lowbias32(x):
    """formats._lowbias32 on uint32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@_jit
def _dot(a, b, INTERP: tl.constexpr):
    """a @ b with FP32 accumulation. Triton 3.6's interpreter (TRITON_INTERPRET=1) multiplies BF16
    operands wrongly (a 16x16 dot of values ~1e3 came out ~1e3 times too large), so there the same
    values multiply in FP32: exact products, FP32 sums, the same numbers up to summation order."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@_jit
def _rn_bf16(x, INTERP: tl.constexpr):
    """FP32 -> BF16, round to nearest even. The interpreter truncates instead: there round the FP32
    bits first (finite x), after which its truncation is exact."""
    if INTERP:
        b = x.to(tl.uint32, bitcast=True)
        x = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@_jit
def _store(ptr, x, mask, INTERP: tl.constexpr):
    """tl.store with the BF16 rounding of _rn_bf16 when ptr holds BF16."""
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr, _rn_bf16(x, INTERP), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@_jit
def _e2m1(c):
    """E2M1 codes (int32, 0..15) -> FP32. Magnitudes 1..6 (codes 2..7) are the FP32 numbers with
    bits (code + 252) << 22 (exponent and one mantissa bit); codes 0 and 1 are 0 and 0.5."""
    m = c & 7
    big = ((m + 252) << 22).to(tl.float32, bitcast=True)
    mag = tl.where(m >= 2, big, m.to(tl.float32) * 0.5)
    return tl.where((c & 8) != 0, -mag, mag)


@_jit
def _tile_mask(t, d, T, D: tl.constexpr):
    """In-range rows t < T (and columns d < D when the head dim was padded to a power of two)."""
    if d.shape[0] == D:
        m = (t < T)[:, None]
    else:
        m = (t < T)[:, None] & (d < D)[None, :]
    return m


@_jit
def _rows_tile(codes, scales, vals, row0, t, d, T, D: tl.constexpr, CODES: tl.constexpr):
    """(len t, len d) BF16 tile, code * block scale, of rows row0 + t of a (rows, D) tensor quantized
    along D (Q, K, V). CODES: decode packed codes and E4M3 scales in registers; else read the BF16
    copy `vals` holding the same numbers. 64-bit scalar bases, 32-bit tile offsets."""
    mask = _tile_mask(t, d, T, D)
    base = row0.to(tl.int64)
    if CODES:
        byte = tl.load(codes + base * (D // 2) + (t[:, None] * (D // 2) + (d // 2)[None, :]), mask=mask, other=0)
        c = (byte.to(tl.int32) >> ((d & 1) * 4)[None, :]) & 15
        s = tl.load(scales + base * (D // 16) + (t[:, None] * (D // 16) + (d // 16)[None, :]), mask=mask, other=0)
        return (_e2m1(c) * s.to(tl.float8e4nv, bitcast=True).to(tl.float32)).to(tl.bfloat16)
    return tl.load(vals + base * D + (t[:, None] * D + d[None, :]), mask=mask, other=0.0).to(tl.bfloat16)


@_jit
def _tokens_tile(codes, scales, vals, row0, t, d, T, ROWS, D: tl.constexpr, CODES: tl.constexpr):
    """(len t, len d) BF16 tile of rows row0 + t of along_tokens' (ROWS, D) matrix, quantized along
    its rows: codes (D, ROWS/2), scales (D, ROWS/16); `vals` the (D, ROWS) BF16 copy. row0 is a
    multiple of 16 (a head starts at b H T16)."""
    mask = _tile_mask(t, d, T, D)
    base = row0.to(tl.int64)
    if CODES:
        byte = tl.load(codes + base // 2 + ((t // 2)[:, None] + (d * (ROWS // 2))[None, :]), mask=mask, other=0)
        c = (byte.to(tl.int32) >> ((t & 1) * 4)[:, None]) & 15
        s = tl.load(scales + base // 16 + ((t // 16)[:, None] + (d * (ROWS // 16))[None, :]), mask=mask, other=0)
        return (_e2m1(c) * s.to(tl.float8e4nv, bitcast=True).to(tl.float32)).to(tl.bfloat16)
    return tl.load(vals + base + (t[:, None] + (d * ROWS)[None, :]), mask=mask, other=0.0).to(tl.bfloat16)


@_jit
def _kv_head(bh, H, GROUP):
    """The kv head (b Hkv + h / GROUP) that q head bh = b H + h attends with (GQA)."""
    return (bh // H) * (H // GROUP) + (bh % H) // GROUP


@_jit
def _keys_end(pid_m, BM: tl.constexpr, T, CAUSAL: tl.constexpr):
    """End of the key loop of query block pid_m: the diagonal when causal (tiles past T masked)."""
    end = T
    if CAUSAL:
        end = (pid_m + 1) * BM
    return end


@_jit
def _fwd_kernel(Qc, Qs, Qv, Kc, Ks, Kv, Vc, Vs, Vv, O, LSE, CST, T, H, GROUP,
                BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                CAUSAL: tl.constexpr, CODES: tl.constexpr, INTERP: tl.constexpr):
    """One (BM queries, head) block of O and lse: online softmax over BN-key tiles (FA-2)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    bkv = _kv_head(bh, H, GROUP)
    m_idx = pid_m * BM + tl.arange(0, BM)
    d = tl.arange(0, BD)
    q = _rows_tile(Qc, Qs, Qv, bh * T, m_idx, d, T, D, CODES)
    c2, gv = tl.load(CST + 1), tl.load(CST + 2)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    for n0 in range(0, _keys_end(pid_m, BM, T, CAUSAL), BN):
        n_idx = n0 + tl.arange(0, BN)
        k = _rows_tile(Kc, Ks, Kv, bkv * T, n_idx, d, T, D, CODES)
        v = _rows_tile(Vc, Vs, Vv, bkv * T, n_idx, d, T, D, CODES)
        s = _dot(q, tl.trans(k), INTERP) * c2  # (BM, BN), log2 units
        keep = (n_idx < T)[None, :]
        if CAUSAL:
            keep = keep & (m_idx[:, None] >= n_idx[None, :])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(_rn_bf16(p, INTERP), v, INTERP)
        m_i = m_new
    o = (acc / l_i[:, None]) * gv
    mask = _tile_mask(m_idx, d, T, D)
    _store(O + (bh * T).to(tl.int64) * D + (m_idx[:, None] * D + d[None, :]), o, mask, INTERP)
    tl.store(LSE + bh * T + m_idx, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=m_idx < T)


@_jit
def _delta_kernel(DO, O, DELTA, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """delta = rowsum(dO O) in FP32 for BR rows of the (N, D) matrices."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    mask = (r < N)[:, None] & (d < D)[None, :]
    off = r.to(tl.int64)[:, None] * D + d[None, :]
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + r, tl.sum(do * o, 1), mask=r < N)


@_jit
def _max_nan(a, b):
    """max that propagates NaN (tl.max's reduction drops it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@_jit
def _quant_ds(x, rows, c0, TP, key, R: tl.constexpr, C: tl.constexpr, SR: tl.constexpr):
    """One 64x64 dS tile x (R, C) FP32 quantized along C in 16-blocks (module docstring): sign |code|
    s_b G, exact in BF16. Its elements' layout indices are n = rows * TP + c0 + (0..C-1) (for the
    random bytes; TP and c0 are multiples of 4, so each 4 consecutive columns share one word)."""
    xb = tl.reshape(x, (R, C // 16, 16))
    amax_b = tl.reduce(tl.abs(xb), 2, _max_nan)  # (R, C/16); NaN where a block holds a NaN
    amax = tl.reduce(tl.reduce(amax_b, 1, _max_nan), 0, _max_nan)
    bad = amax - amax  # NaN iff the tile holds a NaN or Inf (then every value below is NaN), else 0
    gb = tl.math.div_rn(amax, 6 * 448.0).to(tl.uint32, bitcast=True)
    gb = tl.where((gb & 0x7FFFFF) == 0, gb, (gb & 0x7F800000) + 0x800000)  # _pow2_ceil
    g = tl.where(amax > 0, gb.to(tl.float32, bitcast=True), 1.0) + bad
    s = _e4m3_rn(tl.minimum(tl.math.div_rn(tl.math.div_rn(amax_b, 6.0), g), 448.0))
    sg = s * g
    rcp = tl.where(sg > 0, tl.math.div_rn(1.0, sg), 0.0)
    v = xb * rcp[:, :, None]
    a = tl.minimum(tl.abs(v), 6.0)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    per_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))  # 1 / step, exactly: no division
    if SR:  # one hash a word, four bytes from it: word n // 4 = rows * TP / 4 + c0 / 4 + (0..C/4-1)
        n4 = rows.to(tl.uint32)[:, None] * (TP // 4) + (c0 // 4 + tl.arange(0, C // 4)).to(tl.uint32)[None, :]
        w = _lowbias32(n4 ^ key)  # (R, C/4)
        sh = (tl.arange(0, 4) * 8).to(tl.uint32)
        rb = tl.reshape(((w[:, :, None] >> sh[None, None, :]) & 255).to(tl.float32), (R, C // 16, 16))
        m = tl.floor(a * (per_step * 256.0))
        mag = tl.minimum(tl.floor((m + rb) * (1.0 / 256.0)) * step, 6.0)
    else:  # x + 2^23 - 2^23 rounds to an integer, ties to even (0 <= x < 2^22)
        mag = ((a * per_step + 8388608.0) - 8388608.0) * step
    val = tl.where(v < 0, -mag, mag) * sg[:, :, None]
    return tl.reshape(val, (R, C)).to(tl.bfloat16)


@_jit
def _e4m3_rn(x):
    """FP32 0 <= x <= 448 rounded to the nearest E4M3 value, ties to even, in FP32 arithmetic (the
    value fp4.e4m3_encode gives; Triton 3.6's interpreter rounds FP32 -> float8e4nv wrongly, e.g.
    126.3 -> 64). Normal range (x >= 2^-6): keep 3 mantissa bits of the FP32 bits; below: multiples
    of 2^-9 (x 2^9 + 2^23 - 2^23 rounds to an integer, ties to even)."""
    b = x.to(tl.uint32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = ((x * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)
    return tl.where(x >= 0.015625, normal, sub)


@_jit
def _hash_key(seed, hi):
    """fp4.hash_key(seed, hi) on uint32."""
    return _lowbias32(seed + (hi + 1) * 0x9E3779B9)


@_jit
def _scores_probs(q, k, lse2, m_idx, n_idx, c2, T, CAUSAL: tl.constexpr, INTERP: tl.constexpr):
    """P = exp(S - lse) (BM, BN) FP32 for one tile, 0 where masked."""
    p = tl.math.exp2(_dot(q, tl.trans(k), INTERP) * c2 - lse2[:, None])
    keep = (n_idx < T)[None, :] & (m_idx < T)[:, None]
    if CAUSAL:
        keep = keep & (m_idx[:, None] >= n_idx[None, :])
    return tl.where(keep, p, 0.0)


@_jit
def _bwd_dq_kernel(Qc, Qs, Qv, Kc, Ks, Kv, Vc, Vs, Vv, Ktc, Kts, Ktv, DO, LSE, DELTA, DQ, CST, SEED,
                   T, T16, TP, H, GROUP, ROWS,
                   D: tl.constexpr, BD: tl.constexpr, CAUSAL: tl.constexpr, SR: tl.constexpr,
                   CODES: tl.constexpr, INTERP: tl.constexpr):
    """dQ for 64 queries of one head: loop over 64-key tiles, dQ += Qk(dS) kt^."""
    BM: tl.constexpr = 64
    BN: tl.constexpr = 64
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    bkv = _kv_head(bh, H, GROUP)
    m_idx = pid_m * BM + tl.arange(0, BM)
    d = tl.arange(0, BD)
    mask = _tile_mask(m_idx, d, T, D)
    base = (bh * T).to(tl.int64) * D
    off = m_idx[:, None] * D + d[None, :]
    q = _rows_tile(Qc, Qs, Qv, bh * T, m_idx, d, T, D, CODES)
    do = _rn_bf16(tl.load(DO + base + off, mask=mask, other=0.0).to(tl.float32), INTERP)
    lse2 = tl.load(LSE + bh * T + m_idx, mask=m_idx < T, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + bh * T + m_idx, mask=m_idx < T, other=0.0)
    c2, gv, sgkt = tl.load(CST + 1), tl.load(CST + 2), tl.load(CST + 4)
    key = _hash_key(tl.load(SEED).to(tl.uint32), (2 * bh).to(tl.uint32))
    dq = tl.zeros((BM, BD), tl.float32)
    for n0 in range(0, _keys_end(pid_m, BM, T, CAUSAL), BN):
        n_idx = n0 + tl.arange(0, BN)
        k = _rows_tile(Kc, Ks, Kv, bkv * T, n_idx, d, T, D, CODES)
        v = _rows_tile(Vc, Vs, Vv, bkv * T, n_idx, d, T, D, CODES)
        kt = _tokens_tile(Ktc, Kts, Ktv, bkv * T16, n_idx, d, T, ROWS, D, CODES)
        p = _scores_probs(q, k, lse2, m_idx, n_idx, c2, T, CAUSAL, INTERP)
        dp = _dot(do, tl.trans(v), INTERP) * gv
        ds = p * (dp - delta[:, None])
        dq += _dot(_quant_ds(ds, m_idx, n0, TP, key, BM, BN, SR), kt, INTERP)
    _store(DQ + base + off, dq * sgkt, mask, INTERP)


@_jit
def _bwd_dkdv_kernel(Qc, Qs, Qv, Qtc, Qts, Qtv, Kc, Ks, Kv, Vc, Vs, Vv, Ktc, Kts, Ktv, DO, LSE, DELTA,
                     DQ32, DK, DV, CST, SEED, T, T16, TP, H, GROUP, QROWS, KROWS,
                     D: tl.constexpr, BD: tl.constexpr, CAUSAL: tl.constexpr, SR: tl.constexpr,
                     CODES: tl.constexpr, INTERP: tl.constexpr, FUSED_DQ: tl.constexpr):
    """dK, dV for 64 keys of one kv head: loop over the group's q heads and 64-query tiles,
    dV += bf16(P)^T dO, dK += Qq(dS)^T qt^.
    FUSED_DQ (FP4_ATTENTION_BWD=fused): each tile's share of dQ too, Qk(dS) kt^ added into DQ32
    (FP32, zeroed) by atomics, as FlashAttention-2's backward does, so that S, P and dP are computed
    once per tile rather than again in _bwd_dq_kernel. Qk(dS) quantizes the transposed tile along
    the keys with _bwd_dq_kernel's random bytes (layout index and key); the FP32 sums of dQ run in
    the atomics' order, which varies between runs. Otherwise Ktc, Kts, Ktv and DQ32 are unused."""
    BM: tl.constexpr = 64
    BN: tl.constexpr = 64
    pid_n, bkv = tl.program_id(0), tl.program_id(1)
    hkv = H // GROUP
    n_idx = pid_n * BN + tl.arange(0, BN)
    d = tl.arange(0, BD)
    k = _rows_tile(Kc, Ks, Kv, bkv * T, n_idx, d, T, D, CODES)
    v = _rows_tile(Vc, Vs, Vv, bkv * T, n_idx, d, T, D, CODES)
    if FUSED_DQ:
        kt = _tokens_tile(Ktc, Kts, Ktv, bkv * T16, n_idx, d, T, KROWS, D, CODES)  # (BN, BD)
    c2, gv, sgqt = tl.load(CST + 1), tl.load(CST + 2), tl.load(CST + 3)
    seed = tl.load(SEED).to(tl.uint32)
    dk = tl.zeros((BN, BD), tl.float32)
    dv = tl.zeros((BN, BD), tl.float32)
    lo = 0
    if CAUSAL:
        lo = pid_n * BN
    for g_i in range(GROUP):
        bh = (bkv // hkv) * H + (bkv % hkv) * GROUP + g_i
        key = _hash_key(seed, (2 * bh + 1).to(tl.uint32))
        for m0 in range(lo, T, BM):
            m_idx = m0 + tl.arange(0, BM)
            mask = _tile_mask(m_idx, d, T, D)
            off = (bh * T).to(tl.int64) * D + (m_idx[:, None] * D + d[None, :])
            q = _rows_tile(Qc, Qs, Qv, bh * T, m_idx, d, T, D, CODES)
            qt = _tokens_tile(Qtc, Qts, Qtv, bh * T16, m_idx, d, T, QROWS, D, CODES)
            do = _rn_bf16(tl.load(DO + off, mask=mask, other=0.0).to(tl.float32), INTERP)
            lse2 = tl.load(LSE + bh * T + m_idx, mask=m_idx < T, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + bh * T + m_idx, mask=m_idx < T, other=0.0)
            # the transposed tiles (BN keys, BM queries) directly: no transposes in registers
            p_t = tl.math.exp2(_dot(k, tl.trans(q), INTERP) * c2 - lse2[None, :])
            keep = (n_idx < T)[:, None] & (m_idx < T)[None, :]
            if CAUSAL:
                keep = keep & (m_idx[None, :] >= n_idx[:, None])
            p_t = tl.where(keep, p_t, 0.0)
            dv += _dot(_rn_bf16(p_t, INTERP), do, INTERP)
            ds_t = p_t * (_dot(v, tl.trans(do), INTERP) * gv - delta[None, :])
            dk += _dot(_quant_ds(ds_t, n_idx, m0, TP, key, BN, BM, SR), qt, INTERP)
            if FUSED_DQ:
                key_q = _hash_key(seed, (2 * bh).to(tl.uint32))
                dq = _dot(_quant_ds(tl.trans(ds_t), m_idx, pid_n * BN, TP, key_q, BM, BN, SR), kt, INTERP)  # (BM, BD)
                tl.atomic_add(DQ32 + off, dq, mask=mask, sem="relaxed")  # a sum: no ordering needed
    mask = _tile_mask(n_idx, d, T, D)
    off = (bkv * T).to(tl.int64) * D + (n_idx[:, None] * D + d[None, :])
    _store(DK + off, dk * sgqt, mask, INTERP)
    _store(DV + off, dv, mask, INTERP)


# ---------------------------------------------------------------------------------------------
# GPU: launching the kernels

def _codes_mode():
    """How the kernels get their NVFP4 operands. Default ('bf16'): one dequantize pass (kernels.cu)
    writes a transient BF16 copy, code * block scale (exact), which the kernels load like SDPA loads
    its inputs (cp.async, 16-byte vectors); only the FP4 tensors are saved. FP4_ATTENTION_OPERANDS=
    codes: the kernels read the packed codes and E4M3 scales and decode in registers, the same
    numbers (tested equal). On Hopper that decode runs again for every (query block, key tile) pair,
    with byte loads (SASS: LDG.E.U8 + STS.U16 an element): measured on the H200, 3.2 ms forward and
    22.9 ms forward + backward at B 8, H 16, T 2048, D 128 against SDPA's 0.28 and 1.14 (docs/fullstack.md)."""
    return os.environ.get("FP4_ATTENTION_OPERANDS", "bf16") == "codes"


def _operand(qt, codes_mode, tokens=None):
    """(codes, scales, BF16 values) kernel arguments of a QTensor (tokens: (B*H, T16) for along_tokens')."""
    if codes_mode:
        return qt.codes, qt.scales, qt.codes  # the last is unused
    vals = _unit(qt)
    if tokens is not None:
        vals = vals.t()  # the (D, ROWS) buffer the kernel reads
    return qt.codes, qt.scales, vals.contiguous()


def _interpreting():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch_shape(qq, kq):
    b, h, t, d = qq.shape
    return b, h, t, d, h // kq.shape[1], triton.next_power_of_2(d)


# Launch settings: 4 warps, 2 stages, the fastest of bench.py's candidates on the H200 in two
# sessions (forward 0.75-0.77 ms, backward 5.31-7.29 ms against 6.38-8.17 ms at 8 warps, 1B shape;
# results/nvidia-h200/attention/bench_attention.json). The numbers do not depend on them.
NUM_WARPS, NUM_STAGES = 4, 2


def triton_forward(qq, kq, vq, causal, scale, dtype, bm=128, bn=64, num_warps=NUM_WARPS, num_stages=NUM_STAGES):
    """O (B, H, T, D) in dtype and lse (B, H, T) FP32 from the NVFP4 Q, K, V (Triton)."""
    b, h, t, d, group, bd = _launch_shape(qq, kq)
    codes = _codes_mode()
    cst = _constants(scale, qq.tensor_scale, kq.tensor_scale, vq.tensor_scale)
    o = torch.empty(b, h, t, d, dtype=dtype, device=qq.codes.device)
    lse = torch.empty(b, h, t, dtype=torch.float32, device=o.device)
    grid = (triton.cdiv(t, bm), b * h)
    _fwd_kernel[grid](*_operand(qq, codes), *_operand(kq, codes), *_operand(vq, codes), o, lse, cst,
                      t, h, group, BM=bm, BN=bn, D=d, BD=bd, CAUSAL=causal, CODES=codes, INTERP=_interpreting(),
                      num_warps=num_warps, num_stages=num_stages)
    return o, lse


def _bwd_layout():
    """FP4_ATTENTION_BWD: 'split' (default: a dQ kernel and a dK/dV kernel, each recomputing S, P and
    dP) or 'fused' (one kernel, dQ by FP32 atomics). The same numbers up to FP32 summation order;
    the default stays until bench.py --sections attention has timed both on a GPU."""
    layout = os.environ.get("FP4_ATTENTION_BWD", "split")
    if layout not in BWD_LAYOUTS:
        raise ValueError(f"FP4_ATTENTION_BWD={layout!r}: choose one of {', '.join(BWD_LAYOUTS)}")
    return layout


def triton_backward(do, o, lse, qq, kq, vq, causal, scale, seed, ds_rounding, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                    layout=None):
    """dQ, dK, dV in O's dtype (Triton); seed: an int32 tensor (1,) on the device; layout: one of
    BWD_LAYOUTS, or None for FP4_ATTENTION_BWD (_bwd_layout)."""
    b, h, t, d, group, bd = _launch_shape(qq, kq)
    if t > 65536 or b * h * (t + 15) * d >= 2**31:
        raise ValueError(f"FP4 attention's backward indexes with 32 bits: needs T <= 65536 and B*H*T*D < 2^31, "
                         f"got {(b, h, t, d)}")
    codes = _codes_mode()
    qt, kt = along_tokens(qq), along_tokens(kq)
    t16, tp = qt.shape[0] // (b * h), triton.cdiv(t, TILE) * TILE
    cst = _constants(scale, qq.tensor_scale, kq.tensor_scale, vq.tensor_scale, qt.tensor_scale, kt.tensor_scale)
    delta = torch.empty(b, h, t, dtype=torch.float32, device=do.device)
    _delta_kernel[(triton.cdiv(b * h * t, 64),)](do, o, delta, b * h * t, D=d, BD=bd, BR=64)
    dk = torch.empty(kq.shape, dtype=o.dtype, device=do.device)
    dv = torch.empty_like(dk)
    ops = [_operand(x, codes) for x in (qq, kq, vq)]
    opt = [_operand(x, codes, tokens=True) for x in (qt, kt)]
    common = dict(D=d, BD=bd, CAUSAL=causal, SR=ds_rounding == "sr", CODES=codes, INTERP=_interpreting(),
                  num_warps=num_warps, num_stages=num_stages)
    if layout is not None and layout not in BWD_LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {', '.join(BWD_LAYOUTS)}")
    fused = (layout or _bwd_layout()) == "fused"
    if fused:
        dq32 = torch.zeros(b, h, t, d, dtype=torch.float32, device=do.device)
    else:
        dq = torch.empty(b, h, t, d, dtype=o.dtype, device=do.device)
        dq32 = dq  # a placeholder: the dK/dV kernel without FUSED_DQ leaves it alone
        _bwd_dq_kernel[(triton.cdiv(t, TILE), b * h)](
            *ops[0], *ops[1], *ops[2], *opt[1], do, lse, delta, dq, cst, seed,
            t, t16, tp, h, group, kt.shape[0], **common)
    _bwd_dkdv_kernel[(triton.cdiv(t, TILE), b * kq.shape[1])](
        *ops[0], *opt[0], *ops[1], *ops[2], *opt[1], do, lse, delta, dq32, dk, dv, cst, seed,
        t, t16, tp, h, group, qt.shape[0], kt.shape[0], FUSED_DQ=fused, **common)
    if fused:
        dq = (dq32 * cst[4]).to(o.dtype)  # _bwd_dq_kernel's final scale and rounding
    return dq, dk, dv
