// kernels.cu: the CUDA kernels behind fp4.py's quantizers (compiled by CuPy/NVRTC at first use,
// one module per template instantiation; plain nvcc must build it too, for CI's compile check).
//
// Every number is defined by the PyTorch reference in fp4.py and must match it bit for bit:
// FP32 arithmetic in the reference's order, no FMA contraction (compile with --fmad=false; the
// sums of products below also use __fmul_rn/__fadd_rn; the few explicit __fmaf_* compute one
// rounding of an exact product, e.g. fma(b, -1, a) == a - b), the Hadamard butterfly over strides
// 1, 2, ..., n/2 then one multiply by the FP32 1/sqrt(n), halving-tree block sums, and stochastic
// rounding with 8 random bits an element (SPEC 4, revised): element i takes byte i mod 4 of the word
// lowbias32(lo32(i / 4) ^ key(seed, i / 4 >> 32)) (fp4.random_bytes), one hash per 4 elements;
// MS-EDEN's scale rounding keeps the 24-bit u = (lowbias32(lo32(i) ^ key) >> 8) * 2^-24 (fp4.uniform).
// On sm_100a / sm_103a the E2M1 SR encode is Blackwell's cvt.rs.satfinite.e2m1x4.f32 (SR_CVT_RS):
// its rbits byte -> operand mapping is drawn only in the PTX ISA's figure and is NOT confirmed on
// hardware (no such GPU here); everywhere else the same rule is computed in FP32 / integers.
//
// Kernels (SRC: 0 f32, 1 bf16, 2 f16 dense input; 3 mxfp4, 4 nvfp4 QTensor input.
//          G: elements one thread holds = max(block, Hadamard size, 128 for MS-EDEN)):
//   quant_rows<SRC, G, NV>  fp4.quantize along the last dim of a row-major (R, K) tensor.
//       Fuses: load + convert, +-1 signs, blockwise Hadamard, scale rule (absmax / quest /
//       four_over_six, NVFP4 block2d tile amax), rounding (rn / sr / MS-EDEN), E2M1 pack, E8M0 /
//       E4M3 scales, QuEST clip mask. pass=1 is the NVFP4 pre-pass: block amax only, atomically
//       max-reduced into the tensor amax (finite blocks) and, for block2d, the 16x16 tile amax.
//       Called by fp4._kernel_quantize (axis = last, or a transposed view of a contiguous tensor).
//       G == 8 (MXFP4 only, Hadamard 0/16/32) is the warp-cooperative variant (mx_chunk): 8
//       consecutive elements a thread (one 16-byte load for BF16/F16), a lane quad per 32-block,
//       Hadamard strides 8 and 16 and the block reductions through __shfl_xor_sync, 4 chunks in
//       flight a thread; fp4._quant_launch sizes its grid as R * K / 8 / 4 threads. Which of G = 8
//       and G = 32 runs is fp4._mx_rows_layout's choice (FP4_MX_ROWS=quad|group overrides).
//       G == 32 MXFP4 (the default, mx_rows): one thread a 32-block, one resident wave of CTAs
//       looping over the blocks with the next block's load in flight, a loop per (Hadamard size,
//       signs) so the butterfly is straight-line code; round to nearest takes the block scale in
//       its FMAs (e2m1_rn_scaled) and the clip mask is shifted in by funnel shifts.
//   quant_cols<SRC, G, NV>  The same quantizer along the FIRST axis of a row-major (R, K) input,
//       through 128 x 32 shared-memory tiles (no materialised transpose). Output layout (K, R/2).
//       SRC 3/4 dequantize a QTensor's codes on the way in (PRMT table to FP16, e2m1x8_to_f16):
//       that is fp4.requantize (dequantize, transpose, random Hadamard, absmax/SR or any other
//       option, pack) in one pass. The random signs multiply whole row chunks as the tile loads
//       (one sign a row of the tile). G == 32: a resident wave of CTAs loops over the tiles.
//       NVFP4 G == 128 with LANES == 4 (FP4_NV128_COLS=quad; kernels.nv128_cols_layout) is the
//       warp-cooperative variant: 128 threads a tile, a lane quad a column (nvq_col, nvq_group).
//       Called by fp4._kernel_quantize (2-D, axis 0) and fp4._kernel_requantize.
//   nv_amax<SRC, H, V>      The NVFP4 tensor-amax pre-pass alone (the same bits as pass = 1 of the two
//       above) for a dense input, no block2d, Hadamard H = 0 or 16: V = 0 quant_rows' 16-blocks, V > 0
//       quant_cols' (16 rows x V columns a thread). Few registers, loads in flight, one resident
//       wave. Called by kernels._quant_launch before the quantize pass (FP4_NV_AMAX=fused: pass = 1).
//   fold_mx                 fp4.fold_mx: MXFP4 codes + E8M0 -> float8_e4m3fn elements
//       code * 2^(e_block - e_rowmax) and FP32 row scales 2^e_rowmax; one warp per row.
//       Called by fp4._kernel_fold.
//   quant_rows_fold<SRC, RULE, RND>  quant_rows for MXFP4 (G = 32) that also writes fold_mx's
//       outputs (E4M3 elements + row scales): a CTA holds whole rows. Called by fp4._quant_launch
//       when fp4.quantize is asked for fold=True (the fp8 GEMM backend's operands).
//   rotate_back<SRC, G>     fp4.rotate_back_reference: (gradient * QuEST clip mask) H_G in one pass
//       (the quartet backward's straight-through estimator). Called by linear._rotate_back.
//   dequant<OUT>            fp4.dequantize to f32 / bf16 / f16 in the QTensor layout (OUT: 0 f32,
//       1 bf16, 2 f16). Called by fp4._kernel_dequantize.
// Host emulation: with FP4_HOST_EMU defined (and host shims for the intrinsics and for
// shfl_xor), the device math up to the Loads section compiles as plain C++:
// test_kernels.py::test_host_emulation_mx checks the MXFP4 paths against the reference on the CPU
// (test_host_emulation_nv* the NVFP4 ones, test_host_emulation_nv_amax nv_amax's grid loop).
// FP4_HOST_EMU_ADAMW adds the Loads and the AdamW section's kernel, which test_optim.py runs as a
// whole grid on the host (test_emulated_kernel_matches_reference).
// The Blackwell scale swizzle stays a torch permute (fp4.swizzle_scales): one gather over the
// scales (1/16 or 1/32 of the elements), nothing for a kernel to fuse.

#ifndef FP4_HOST_EMU  // FP4_HOST_EMU: the device math built as host C++ (bit-exactness emulation)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

#define RULE_ABSMAX 0
#define RULE_QUEST 1
#define RULE_FOUR_OVER_SIX 2
#define ROUND_RN 0
#define ROUND_SR 1
#define ROUND_EDEN 2

// ---------------------------------------------------------------------------------------------
// Scalar helpers: hash, E2M1, E4M3, powers of two

__device__ __forceinline__ u32 lowbias32(u32 x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ u32 hash_key(u32 seed, u32 hi) {  // fp4.hash_key
  return lowbias32(seed + 0x9E3779B9u * (hi + 1u));
}

__device__ __forceinline__ float uniform_at(u32 key, u32 lo) {  // fp4.uniform, one index
  return __uint2float_rn(lowbias32(lo ^ key) >> 8) * 5.9604644775390625e-08f;  // * 2^-24, exact
}

__device__ __forceinline__ float exp2i(int n) {  // 2^n as FP32, n in [-149, 127]; 0 below (selects, no branch)
  const u32 sub = n >= -149 ? 1u << ((n + 149) & 31) : 0u;
  return __uint_as_float(n >= -126 ? (u32)(n + 127) << 23 : sub);
}

__device__ __forceinline__ float absmax_nan(float m, float v) {  // max(m, |v|), NaN propagates
#ifdef __CUDA_ARCH__
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
  return r;
#else  // host build of the device functions (test emulation)
  return (m != m || v != v) ? __uint_as_float(0x7FFFFFFFu) : fmaxf(m, fabsf(v));
#endif
}

// E2M1 round to nearest even, magnitude code 0..7 of |v| (v not NaN), saturating (fp4.e2m1_encode).
// |v| < 2: rint(2|v|) from the magic add 2^22 (spacing 0.5). |v| >= 1: round the FP32 mantissa to
// one bit (ties to even) and read (exponent, bit) as the code.
__device__ __forceinline__ u32 e2m1_rn_mag(float v) {
  u32 a = __float_as_uint(v) & 0x7FFFFFFFu;
  u32 cs = __float_as_uint(__uint_as_float(a) + 4194304.0f) - 0x4A800000u;
  u32 cn = (a + 0x1FFFFFu + ((a >> 22) & 1u) - 0x3F000000u) >> 22;
  cn = min(cn, 7u);
  return a < 0x40000000u ? cs : cn;
}

__device__ __forceinline__ u32 e2m1_sign(float v) { return v < 0.0f ? 8u : 0u; }

// Cheaper E2M1 encoders (MXFP4 paths), equal to e2m1_rn_mag / e2m1_sr_mag (host-emulation checked
// exhaustively for RN). The code is f(|v|) rounded, f(a) = min(2a, a + 2, a/2 + 4): 2a on [0, 2)
// (step 0.5), a + 2 on [2, 4) (step 1), a/2 + 4 on [4, 6] (step 2); the pieces meet at 2 and 4
// and the active piece is the smallest. Adding the piece's offset M' = 2^23 + k (ulp 1) to the
// exactly scaled a in one rounding gives M' + round(piece), so the minimum over the three pieces
// (FP32 min, no integer work) is M + code. FMA here is exact single-rounding, not a contraction.
// RN: returns 2^23 + code (ties to even: the integer offsets are even); saturates at 7.
// SAT = false: the caller guarantees |v| <= 6 or a NaN/Inf block (absmax: amax / 2^e <= 6).
template <bool SAT = true>
__device__ __forceinline__ float e2m1_rn_f(float v) {
  float a = fabsf(v);
  float y1 = __fmaf_rn(a, 2.0f, 8388608.0f);
  float y2 = __fadd_rn(a, 8388610.0f);
  float y3 = __fmaf_rn(a, 0.5f, 8388612.0f);
  return fminf(fminf(y1, y2), SAT ? fminf(y3, 8388615.0f) : y3);
}
// SR with 8 random bits (SPEC 4, fp4.e2m1_encode_sr): the code is floor(f(a) + r/256), r the random
// byte, f the piecewise map above (floor(a 256 / s) + r >> 8 is floor(a / s + r / 256); adding r/256
// to all three pieces keeps the smallest one smallest, and floor is monotone, so the minimum of the
// floors is the floor of the active piece). RD(fma(a, m, 1 + r/256)) has the exact sum's floor (a
// rounding down never crosses an integer, and integers are floats), and RD(y + 2^23 + 7 + k) =
// 2^23 + 8 + k + floor(y) - 1 while the sum stays in [2^23, 2^24). rr1 = 1 + r/256 (sr_rr1).
// Returns 2^23 + 8 + code. SAT = false: the caller guarantees |v| <= 6.
template <bool SAT = true>
__device__ __forceinline__ float e2m1_sr_f(float v, float rr1) {
  float a = SAT ? fminf(fabsf(v), 6.0f) : fabsf(v);
  float y1 = __fadd_rd(__fmaf_rd(a, 2.0f, rr1), 8388615.0f);
  float y2 = __fadd_rd(__fadd_rd(a, rr1), 8388617.0f);
  float y3 = __fadd_rd(__fmaf_rd(a, 0.5f, rr1), 8388619.0f);
  return fminf(fminf(y1, y2), y3);
}
#define E2M1_RN_BASE 0x4B000000u  // bits of 2^23: e2m1_rn_f's offset
#define E2M1_SR_BASE 0x4B000008u  // bits of 2^23 + 8: e2m1_sr_f's offset
// Eight codes packed into a word by integer multiply-adds of the offset floats' bits (nibble i:
// bits * 16^i), then one subtraction of the offsets' sum: sum_i BASE * 16^i mod 2^32.
__host__ __device__ constexpr u32 nibble_base(u32 b) {
  return b + (b << 4) + (b << 8) + (b << 12) + (b << 16) + (b << 20) + (b << 24) + (b << 28);
}
// Adds the sign (8 iff v < 0, so -0.0 gives 0) to an offset code float, exactly.
__device__ __forceinline__ float with_sign8(float r, float v) {
  return __fmaf_rn(v < 0.0f ? 1.0f : 0.0f, 8.0f, r);
}

// SR's random words (fp4.random_bytes): word j = lowbias32(lo32(j) ^ key), key = key(seed, j >> 32);
// element i takes byte i mod 4 of word i / 4. A group of G elements starts at a multiple of G, so
// its words share one key: key_for(seed, key0, i0) for the group's first element i0.
__device__ __forceinline__ u32 sr_key(u32 seed, u32 key0, u64 i0) {
  const u64 j = i0 >> 2;
  return (j >> 32) ? hash_key(seed, (u32)(j >> 32)) : key0;
}
__device__ __forceinline__ u32 sr_word(u32 key, u64 i0) { return lowbias32((u32)(i0 >> 2) ^ key); }
// 1 + (byte b of w) / 256 as FP32, exactly: the byte becomes mantissa bits 15..22 of 1.0.
__device__ __forceinline__ float sr_rr1(u32 w, int b) {
  return __uint_as_float(0x3F800000u | (((w >> (8 * b)) & 0xFFu) << 15));
}

// E2M1 stochastic rounding of the magnitude (fp4.e2m1_encode_sr), v not NaN, r the random byte:
// ((floor(a * 256 / s) + r) >> 8) multiples of s, in integers (a * 256 / s is exact, < 3072).
__device__ __forceinline__ u32 e2m1_sr_mag(float v, u32 r) {
  float a = fminf(fabsf(v), 6.0f);
  float k = a < 2.0f ? 512.0f : (a < 4.0f ? 256.0f : 128.0f);
  u32 base = a < 2.0f ? 0u : (a < 4.0f ? 2u : 4u);
  return ((__float2uint_rz(__fmul_rn(a, k)) + r) >> 8) + base;
}

#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL)
#define SR_CVT_RS 1
// Blackwell's hardware SR (PTX ISA 8.7, sm_100a / sm_103a): four magnitudes (the sign is added by
// the caller, as the reference's v < 0 test, so -0.0 stays code 0), one rbits word. ASSUMED: value
// k (x0 first) lands in nibble k and takes rbits byte k; unconfirmed on hardware (see the top).
__device__ __forceinline__ u32 e2m1x4_rs(float x0, float x1, float x2, float x3, u32 rbits) {
  unsigned short d;
  asm("cvt.rs.satfinite.e2m1x4.f32 %0, {%1, %2, %3, %4}, %5;"
      : "=h"(d) : "f"(fabsf(x3)), "f"(fabsf(x2)), "f"(fabsf(x1)), "f"(fabsf(x0)), "r"(rbits));
  return d;
}
#endif

// E2M1 code -> FP32 (fp4.e2m1_decode). Codes 2..7 are 2^((c >> 1) - 1) * (1 + (c & 1) / 2), whose
// FP32 bits are (c + 252) << 22; code 1 is 0.5, code 0 is 0.
__device__ __forceinline__ float e2m1_dec(u32 c) {
  u32 m = c & 7u;
  u32 bits = m >= 2u ? (m + 252u) << 22 : (m == 1u ? 0x3F000000u : 0u);
  return __uint_as_float(bits | ((c & 8u) << 28));
}

// FP32 x >= 0 (or NaN) -> E4M3 bits, round to nearest even, saturating at 448 (fp4.e4m3_encode).
__device__ __forceinline__ u32 e4m3_enc(float x) {
  if (x != x) return 0x7Fu;
  x = fminf(x, 448.0f);
  if (x < 0.015625f)  // below 2^-6: subnormal grid of 2^-9, rint(x * 512) via the magic 2^23
    return __float_as_uint(x * 512.0f + 8388608.0f) - 0x4B000000u;
  u32 a = __float_as_uint(x);
  a = a + 0x7FFFFu + ((a >> 20) & 1u);
  return (a >> 20) - (120u << 3);
}

__device__ __forceinline__ float e4m3_dec(u32 b) {  // fp4.e4m3_decode (bits 0..255)
  u32 e = (b >> 3) & 15u, m = b & 7u;
  float r;
  if ((b & 0x7Fu) == 0x7Fu) r = __uint_as_float(0x7FFFFFFFu);
  else if (e == 0) r = __uint2float_rn(m) * 0.001953125f;
  else r = __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) ? -r : r;
}

// Stochastic rounding of t >= 0 to E4M3 (fp4.e4m3_encode_sr).
__device__ __forceinline__ u32 e4m3_enc_sr(float t, float u) {
  if (t != t) return 0x7Fu;
  u32 rn = e4m3_enc(t);
  u32 lo_b = e4m3_dec(rn) > t ? rn - 1u : rn;
  u32 hi_b = min(lo_b + 1u, 0x7Eu);
  float lo = e4m3_dec(lo_b), hi = e4m3_dec(hi_b);
  float p = hi > lo ? __fdiv_rn(t - lo, hi - lo) : 0.0f;
  return u < p ? hi_b : lo_b;
}

// FP32 value -> E4M3 bits with sign (torch's .to(float8_e4m3fn) for |y| <= 448).
__device__ __forceinline__ u32 e4m3_enc_signed(float y) {
  return e4m3_enc(fabsf(y)) | ((__float_as_uint(y) >> 24) & 0x80u);
}

// Halving-tree sum of n values (element j added to j + n/2, then the first half the same way).
// The halving loop is a compile-time recursion: as a plain loop nvcc kept it rolled, with
// predicated moves through the array.
template <int N>
__device__ __forceinline__ float tree_sum(const float* v) {
  float t[N / 2];
#pragma unroll
  for (int j = 0; j < N / 2; j++) t[j] = __fadd_rn(v[j], v[j + N / 2]);
  return tree_sum<N / 2>(t);
}

template <>
__device__ __forceinline__ float tree_sum<1>(const float* v) { return v[0]; }

// ---------------------------------------------------------------------------------------------
// One thread's group of G consecutive elements along the quantized axis

struct QParams {
  int H;            // Hadamard size (0: none)
  float hs;         // FP32 1/sqrt(H)
  int has_signs;
  u32 sw[4];        // signs as bits, expanded to the group's period (bit i: element i negative)
  u32 seed, key0;   // SR seed and key(seed, 0)
  int pass;         // 0: quantize; 1: NVFP4 amax pre-pass
  u8* codes;        // (rows, Kout/2)
  u8* scales;       // (rows, Kout/block)
  u8* mask;         // (rows, Kout/8) or null
  const float* g;   // NVFP4 tensor scale (device)
  u32* amax;        // pre-pass: [0] = finite block amax bits
  u32* tiles;       // block2d: (rows/16, Kout/16) tile amax bits, or null
  u32 Kout;         // length of the quantized axis
};

// The signs arrive by value (no device copy per call): bit i of word w set iff sign 32w + i is -1.
__device__ __forceinline__ void load_signs(QParams& p, int has_signs, u32 s0, u32 s1, u32 s2, u32 s3) {
  p.has_signs = has_signs;
  if (!p.has_signs) return;
  // element i of the group uses sign (i mod H): group word i/32 is signs word (i/32) mod (H/32)
  u32 w0 = s0;
  if (p.H == 16) w0 = (w0 & 0xFFFFu) | (w0 << 16);
  u32 w1 = p.H >= 64 ? s1 : w0;
  u32 w2 = p.H == 128 ? s2 : w0;
  u32 w3 = p.H == 128 ? s3 : w1;
  p.sw[0] = w0; p.sw[1] = w1; p.sw[2] = w2; p.sw[3] = w3;
}

// The signs and the Hadamard of size H (a compile-time constant: the stages are straight-line code;
// a runtime H compiled into predicated moves around every stage) on each H-block of the group.
// SCALE = false: the butterfly stages only (the quad path's last stages cross lanes; it scales after).
template <int G, int H, bool SG = true, bool SCALE = true>  // SG = false: no signs (p.has_signs is 0)
__device__ __forceinline__ void rotate_h(float (&x)[G], const QParams& p) {
  if (SG && p.has_signs) {
    constexpr int C = G < 32 ? G : 32;  // elements a sign word covers (G = 16: one half word)
#pragma unroll
    for (int c = 0; c < G / C; c++) {
      u32 w = p.sw[c & 3];
#ifndef FP4_HOST_EMU
      asm volatile("mov.b32 %0, %0;" : "+r"(w));  // per group: 32 hoisted sign masks would spill
#endif
#pragma unroll
      for (int i = 0; i < C; i++)
        x[C * c + i] = __uint_as_float(__float_as_uint(x[C * c + i]) ^ ((w << (31 - i)) & 0x80000000u));
    }
  }
#pragma unroll
  for (int h = 1; h < H; h <<= 1) {
#pragma unroll
    for (int i = 0; i < G; i++) {
      if (!(i & h)) {
        float a = x[i], b = x[i + h];
        x[i] = __fadd_rn(a, b);
        x[i + h] = __fsub_rn(a, b);
      }
    }
  }
  if constexpr (SCALE) {
#pragma unroll
    for (int i = 0; i < G; i++) x[i] = __fmul_rn(x[i], p.hs);
  }
}

template <int G>
__device__ __forceinline__ void rotate(float (&x)[G], const QParams& p) {  // p.H: 0, 16, ..., G
  if constexpr (G % 16 == 0) { if (p.H == 16) return rotate_h<G, 16>(x, p); }
  if constexpr (G % 32 == 0) { if (p.H == 32) return rotate_h<G, 32>(x, p); }
  if constexpr (G % 64 == 0) { if (p.H == 64) return rotate_h<G, 64>(x, p); }
  if constexpr (G % 128 == 0) { if (p.H == 128) return rotate_h<G, 128>(x, p); }
}

template <int N>
__device__ __forceinline__ u32 block_amax_bits(const float* x) {  // max |x| bits, NaN/Inf >= 0x7F800000
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < N; j++) m = absmax_nan(m, x[j]);
  return __float_as_uint(m) & 0x7FFFFFFFu;
}

__device__ __forceinline__ int absmax_exponent(float amax) {  // fp4._absmax_exponent
  const u32 bits = __float_as_uint(amax);
  if (bits - 0x00800000u < 0x7F000000u)  // normal: amax = 1.f 2^(b-127), frexp's E = b - 126
    return (int)(bits >> 23) - ((bits & 0x7FFFFFu) <= 0x400000u ? 129 : 128);  // m = 1.f / 2 <= 0.75
  if (amax == 0.0f) return -127;
  int E;
  float m = frexpf(amax, &E);
  return m <= 0.75f ? E - 3 : E - 2;
}

__device__ __forceinline__ int quest_exponent(float sigma) {  // floor(log2(0.487079 sigma)), sigma > 0 finite
  const float s = __fmul_rn(sigma, 0.487079f);
  const u32 bits = __float_as_uint(s);
  if (bits >= 0x00800000u) return (int)(bits >> 23) - 127;  // normal (s < 2^127: sigma finite)
  int E;
  frexpf(s, &E);
  return E - 1;
}

// fp4._unit_scale: 2^-e with e clamped to [-126, 126] (a normal FP32). QuEST's sigma, four_over_six's
// error and MS-EDEN's correction sum squares of the block times this (exact), so that FP32 squares
// neither overflow (|x| > 2^64) nor underflow (|x| < 2^-63); the same bits wherever they did not.
__device__ __forceinline__ float unit_scale(int e) { return exp2i(-max(-126, min(126, e))); }

__device__ __forceinline__ int floor_log2(float g) {  // g > 0 finite
  int E;
  frexpf(g, &E);
  return E - 1;
}

template <int N>
__device__ __forceinline__ void store_bytes(u8* dst, const u32* w) {  // N bytes from N/4 words
  if constexpr (N == 4) {
    *reinterpret_cast<u32*>(dst) = w[0];
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int i = 0; i < N / 16; i++)
      reinterpret_cast<uint4*>(dst)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
  }
}

// Round to nearest with the block scale folded into the encoder: e2m1_rn_f(x * 2^-e) / 2 from |x|.
// v = x * 2^-e is exact unless subnormal (then its code is 0 both ways), so fma(|x|, 2^-e, 2^22)
// = RN(v + 2^22) = RN(2v + 2^23) / 2 and likewise for the other two pieces: returns 2^22 + code/2
// (bits E2M1_RN_BASE2 + code; 4.0 more is the sign). i1, i2, i4 = 2^-e, 2^-e/2, 2^-e/4 (exact: e
// in [-127, 127], subnormals kept).
#define E2M1_RN_BASE2 0x4A800000u  // bits of 2^22
__device__ __forceinline__ float e2m1_rn_scaled(float x, float i1, float i2, float i4) {
  float a = fabsf(x);
  float y1 = __fmaf_rn(a, i1, 4194304.0f);
  float y2 = __fmaf_rn(a, i2, 4194305.0f);
  float y3 = __fmaf_rn(a, i4, 4194306.0f);
  return fminf(fminf(y1, y2), fminf(y3, 4194307.5f));
}

// MXFP4 (SPEC 2-3): scale 2^e per 32-block, E8M0 bits e + 127. base: the index of x[0] in the
// output (row * Kout + column; codes, scales, mask and the SR counter all follow from it).
// cw_out / e_out (G == 32, quant_rows_fold): the block's code words and its exponent (-128: NaN).
template <int G, int RULE, int RND>
__device__ __forceinline__ void quant_group_mx(float (&x)[G], const QParams& p, u64 base,
                                               u32* cw_out = nullptr, int* e_out = nullptr) {
  const u32 key = RND == ROUND_SR ? sr_key(p.seed, p.key0, base) : 0u;
  u32 cw[G / 8];
  u32 mw[G / 32];
#pragma unroll
  for (int b = 0; b < G / 32; b++) {
    float* xb = x + 32 * b;
    const u32 ab = block_amax_bits<32>(xb);
    const bool bad = ab >= 0x7F800000u;
    int e = absmax_exponent(__uint_as_float(ab));
    if (RULE == RULE_QUEST) {  // fp4._quest_exponent: sigma of the block in units of 2^e_absmax
      const int es = max(-126, min(126, e));
      const float unit = unit_scale(es);
      float t[32];
#pragma unroll
      for (int j = 0; j < 32; j++) t[j] = __fmul_rn(xb[j], unit);
      const float mean = __fmul_rn(tree_sum<32>(t), 0.03125f);
#pragma unroll
      for (int j = 0; j < 32; j++) t[j] = __fmul_rn(t[j], t[j]);
      const float mean2 = __fmul_rn(tree_sum<32>(t), 0.03125f);
      float var = __fsub_rn(mean2, __fmul_rn(mean, mean));
      var = var < 0.0f ? 0.0f : var;
      const float sigma = __fsqrt_rn(var);  // NaN for a NaN/Inf block (bad: e is overridden)
      if (sigma > 0.0f) e = quest_exponent(sigma) + es;  // else absmax's (a constant block)
    }
    e = bad ? 0 : max(-127, min(127, e));
    const float inv = exp2i(-e);  // x / 2^e == x * 2^-e exactly (both one rounding of one real)
    // clip mask |v| <= 6, i.e. |x| <= 6 2^e: bit i is the inverted sign of 6 2^e - |x_i|, shifted in
    // from the top element down (6 2^127 overflows to Inf: every finite |x| passes)
    const float t6 = __fmul_rn(6.0f, exp2i(e));
    u32 m = 0, w[4] = {0u, 0u, 0u, 0u};
    if constexpr (RND == ROUND_RN) {
      // v = x * 2^-e < 0 (the reference's sign test) iff x < -2^(e - 150): above that v rounds to -0
      const float neg = -exp2i(e > 0 ? e - 150 : -150);
      const float i2 = __fmul_rn(inv, 0.5f), i4 = __fmul_rn(inv, 0.25f);
#pragma unroll
      for (int i = 31; i >= 0; i--) {
        float r = e2m1_rn_scaled(xb[i], inv, i2, i4);
        r = __fmaf_rn(xb[i] < neg ? 1.0f : 0.0f, 4.0f, r);
        w[i / 8] += __float_as_uint(r) << (4 * (i % 8));
        if (RULE == RULE_QUEST) m = __funnelshift_l(__float_as_uint(__fsub_rn(t6, fabsf(xb[i]))), m, 1);
      }
#pragma unroll
      for (int j = 0; j < 4; j++) cw[4 * b + j] = bad ? 0u : w[j] - nibble_base(E2M1_RN_BASE2);
    } else {
      u32 rw[8];  // the block's 8 random words: one hash per 4 elements
#pragma unroll
      for (int k = 0; k < 8; k++) rw[k] = sr_word(key, base + 32 * b + 4 * k);
#ifdef SR_CVT_RS
#pragma unroll
      for (int k = 0; k < 8; k++) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = __fmul_rn(xb[4 * k + i], inv);
        u32 c = e2m1x4_rs(v[0], v[1], v[2], v[3], rw[k]);
#pragma unroll
        for (int i = 0; i < 4; i++) c |= (v[i] < 0.0f ? 8u : 0u) << (4 * i);
        w[k / 2] |= c << (16 * (k & 1));
      }
#pragma unroll
      for (int i = 31; i >= 0; i--)
        if (RULE == RULE_QUEST) m = __funnelshift_l(__float_as_uint(__fsub_rn(t6, fabsf(xb[i]))), m, 1);
#pragma unroll
      for (int j = 0; j < 4; j++) cw[4 * b + j] = bad ? 0u : w[j];
#else
#pragma unroll
      for (int i = 31; i >= 0; i--) {
        float v = __fmul_rn(xb[i], inv);
        float r = e2m1_sr_f<RULE != RULE_ABSMAX>(v, sr_rr1(rw[i / 4], i % 4));
        w[i / 8] += __float_as_uint(with_sign8(r, v)) << (4 * (i % 8));
        if (RULE == RULE_QUEST) m = __funnelshift_l(__float_as_uint(__fsub_rn(t6, fabsf(xb[i]))), m, 1);
      }
#pragma unroll
      for (int j = 0; j < 4; j++) cw[4 * b + j] = bad ? 0u : w[j] - nibble_base(E2M1_SR_BASE);
#endif
    }
    m = ~m;
    mw[b] = bad ? 0u : m;
    p.scales[base / 32 + b] = bad ? (u8)0xFF : (u8)(e + 127);
    if (e_out) *e_out = bad ? -128 : e;
  }
  if (cw_out) {
#pragma unroll
    for (int i = 0; i < G / 8; i++) cw_out[i] = cw[i];
  }
  store_bytes<G / 2>(p.codes + (base >> 1), cw);
  if (p.mask) store_bytes<G / 8>(p.mask + (base >> 3), mw);
}

// four_over_six's squared error of one 16-block for scale s (fp4._four_over_six), the errors in units
// of the block's 2^e_absmax (unit = unit_scale(e_absmax)).
__device__ __forceinline__ float nv_err(const float* xb, u32 s, float g, float unit) {
  float sd = e4m3_dec(s);
  float den = __fmul_rn(sd, g);
  den = den == 0.0f ? __uint_as_float(0x7F800000u) : den;
  float d[16];
#pragma unroll
  for (int j = 0; j < 16; j++) {
    float v = __fdiv_rn(xb[j], den);
    u32 c = (v != v) ? 0u : (e2m1_rn_mag(v) | e2m1_sign(v));
    float q = __fmul_rn(__fmul_rn(e2m1_dec(c), sd), g);
    float t = __fmul_rn(__fsub_rn(xb[j], q), unit);
    d[j] = __fmul_rn(t, t);
  }
  return tree_sum<16>(d);
}

// NVFP4 (SPEC 2-4): E4M3 scale per 16-block (or 16x16 tile), FP32 tensor scale g. The pieces (the
// pre-pass amax, the per-block encode, MS-EDEN's scale rounding, the store) serve both layouts: one
// thread a G-group (quant_group_nv) and a lane quad a 128-group (nvq_group). (orow, ocol): the
// output position of x[0]; G elements, whole 16-blocks.

// Pre-pass: the raw block amax into the block2d tiles; returns the max over the finite blocks.
template <int G>
__device__ __forceinline__ u32 nv_prepass_amax(const float* x, const QParams& p, u32 orow, u32 ocol) {
  u32 fm = 0;
#pragma unroll
  for (int b = 0; b < G / 16; b++) {
    u32 ab = block_amax_bits<16>(x + 16 * b);
    if (ab < 0x7F800000u) fm = max(fm, ab);
    if (p.tiles) atomicMax(p.tiles + (u64)(orow / 16) * (p.Kout / 16) + ocol / 16 + b, ab);
  }
  return fm;
}

// The finite amax fm (bits) into amax[0].
__device__ __forceinline__ void nv_amax_atomic(const QParams& p, u32 fm) {
#ifdef FP4_HOST_EMU
  if (fm) atomicMax(p.amax, fm);
#else
  // one atomic a warp rather than a thread (every thread of a 64M-element tensor hit one
  // address); a max is order-free, so the tensor scale's bits do not change. The lanes here
  // are those __activemask sees (a grid loop's or the AdamW kernel's tail may have left).
  const unsigned active = __activemask();
  const u32 wm = __reduce_max_sync(active, fm);
  const u32 lane = (threadIdx.x + threadIdx.y * blockDim.x) & 31u;
  if (wm && lane == (u32)(__ffs(active) - 1)) atomicMax(p.amax, wm);
#endif
}

// The E4M3 scales sc (NaN 0x7F for a NaN/Inf block: badb) and E2M1 codes cw (8 a word, element i
// in nibble i % 8) of G elements, rounding RND (MS-EDEN: its RN codes; the scales are corrected after).
template <int G, int RULE, int RND>
__device__ __forceinline__ void nv_encode(const float* x, const QParams& p, u32 orow, u32 ocol, float g,
                                          u32 (&cw)[G / 8], u32 (&sc)[G / 16], bool (&badb)[G / 16]) {
  const u64 base = (u64)orow * p.Kout + ocol;
  const u32 key = RND == ROUND_SR ? sr_key(p.seed, p.key0, base) : 0u;
#pragma unroll
  for (int b = 0; b < G / 16; b++) {
    const float* xb = x + 16 * b;
    u32 ab = p.tiles ? p.tiles[(u64)(orow / 16) * (p.Kout / 16) + ocol / 16 + b] : block_amax_bits<16>(xb);
    bool bad = ab >= 0x7F800000u;
    float amax = __uint_as_float(ab);  // NaN or Inf when bad: the scale is overridden below
    u32 s = e4m3_enc(__fdiv_rn(__fdiv_rn(amax, 6.0f), g));
    if (RULE == RULE_FOUR_OVER_SIX) {
      u32 s4 = e4m3_enc(__fdiv_rn(__fdiv_rn(amax, 4.0f), g));
      const float unit = unit_scale(absmax_exponent(amax));  // NaN/Inf amax: any e (s is 0x7F)
      float e6 = nv_err(xb, s, g, unit), e4 = nv_err(xb, s4, g, unit);
      s = e4 < e6 ? s4 : s;
    }
    s = bad ? 0x7Fu : s;
    float den = __fmul_rn(e4m3_dec(s), g);
    den = den == 0.0f ? __uint_as_float(0x7F800000u) : den;
#pragma unroll
    for (int j = 0; j < 16; j += 8) {
      u32 w = 0;
      u32 rw[2] = {0u, 0u};
      if constexpr (RND == ROUND_SR) {
        rw[0] = sr_word(key, base + 16 * b + j);
        rw[1] = sr_word(key, base + 16 * b + j + 4);
      }
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; i++) v[i] = __fdiv_rn(xb[j + i], den);
#ifdef SR_CVT_RS
      if constexpr (RND == ROUND_SR) {
        w = e2m1x4_rs(v[0], v[1], v[2], v[3], rw[0]) | (e2m1x4_rs(v[4], v[5], v[6], v[7], rw[1]) << 16);
#pragma unroll
        for (int i = 0; i < 8; i++) w |= e2m1_sign(v[i]) << (4 * i);
      } else
#endif
      {
#pragma unroll
        for (int i = 0; i < 8; i++) {
          u32 c;
          if constexpr (RND == ROUND_SR) c = e2m1_sr_mag(v[i], (rw[i / 4] >> (8 * (i % 4))) & 0xFFu);
          else c = e2m1_rn_mag(v[i]);
          w |= (c | e2m1_sign(v[i])) << (4 * i);
        }
      }
      cw[(16 * b + j) / 8] = bad ? 0u : w;
    }
    sc[b] = s;
    badb[b] = bad;
  }
}

// The RN value q = (code * scale) * g of element e of a run of codes cw and scales sc (fp4._nv_dequant_blocks).
__device__ __forceinline__ float nv_value(const u32* cw, const u32* sc, int e, float g) {
  const u32 c = (cw[e / 8] >> (4 * (e % 8))) & 15u;
  return __fmul_rn(__fmul_rn(e2m1_dec(c), e4m3_dec(sc[e / 16])), g);
}

// MS-EDEN's scales (fp4._eden_scales) for NB 16-blocks starting at output (orow, ocol) of one
// 128-group with sums num = sum(x x), den = sum(x q): c = num / den (1 for a zero or non-finite
// group), each scale s becomes SR_E4M3(s c) with uniform(seed, block index); NaN blocks keep 0x7F.
template <int NB>
__device__ __forceinline__ void nv_eden_scales(u32* sc, const bool* badb, float num, float den, const QParams& p,
                                               u32 orow, u32 ocol) {
  float c = __fdiv_rn(num, den);
  if (!(fabsf(c) <= 3.402823466e+38f && den > 0.0f)) c = 1.0f;
  const u64 nb = p.Kout / 16;
#pragma unroll
  for (int b = 0; b < NB; b++) {
    u64 bi = (u64)orow * nb + ocol / 16 + b;
    u32 bkey = (bi >> 32) ? hash_key(p.seed, (u32)(bi >> 32)) : p.key0;
    float t = __fmul_rn(e4m3_dec(sc[b]), c);
    u32 s2 = e4m3_enc_sr(t, uniform_at(bkey, (u32)bi));
    sc[b] = badb[b] ? 0x7Fu : s2;
  }
}

template <int G>
__device__ __forceinline__ void nv_store(const QParams& p, u32 orow, u32 ocol, const u32 (&cw)[G / 8],
                                         const u32 (&sc)[G / 16]) {
#pragma unroll
  for (int b = 0; b < G / 16; b++) p.scales[(u64)orow * (p.Kout / 16) + ocol / 16 + b] = (u8)sc[b];
  store_bytes<G / 2>(p.codes + (((u64)orow * p.Kout + ocol) >> 1), cw);
}

// NVFP4, one thread a G-group.
template <int G, int RULE, int RND>
__device__ __forceinline__ void quant_group_nv(float (&x)[G], const QParams& p, u32 orow, u32 ocol) {
  if (p.pass == 1) {  // pre-pass: finite block amax into amax[0]; raw block amax into tiles
    nv_amax_atomic(p, nv_prepass_amax<G>(x, p, orow, ocol));
    return;
  }
  const float g = *p.g;
  u32 cw[G / 8];
  u32 sc[G / 16];
  bool badb[G / 16];
  nv_encode<G, RULE, RND>(x, p, orow, ocol, g, cw, sc, badb);
  if constexpr (G % 128 == 0) {
    if constexpr (RND == ROUND_EDEN) {  // MS-EDEN (fp4._eden_scales): per 128-group correction into the scales
#pragma unroll
      for (int gi = 0; gi < G / 128; gi++) {
        // num = tree_sum<128>(x x), den = tree_sum<128>(x q): the halving tree's first two levels
        // are taken at once (u[j] = (p[j] + p[j+64]) + (p[j+32] + p[j+96]), the same additions in
        // the same order), and q (the RN value, code * scale * g) is decoded where it is used: 32
        // partial sums live instead of 128 values of q and 64 sums, which spilled (ptxas, sm_90a).
        // x and q in units of g's power of two (fp4._eden_scales): unit x, and q from g unit.
        const float* xg = x + 128 * gi;
        const u32* cg = cw + 16 * gi;
        const u32* sg = sc + 8 * gi;
        const float unit = unit_scale(floor_log2(g)), gu = __fmul_rn(g, unit);
        float u[32];
#pragma unroll
        for (int j = 0; j < 32; j++) {
          float xs[4];
#pragma unroll
          for (int k = 0; k < 4; k++) xs[k] = __fmul_rn(xg[j + 32 * k], unit);
          const float a = __fadd_rn(__fmul_rn(xs[0], xs[0]), __fmul_rn(xs[2], xs[2]));
          const float b = __fadd_rn(__fmul_rn(xs[1], xs[1]), __fmul_rn(xs[3], xs[3]));
          u[j] = __fadd_rn(a, b);
        }
        float num = tree_sum<32>(u);
#pragma unroll
        for (int j = 0; j < 32; j++) {
          float q[4], xs[4];
#pragma unroll
          for (int k = 0; k < 4; k++) {
            q[k] = nv_value(cg, sg, j + 32 * k, gu);
            xs[k] = __fmul_rn(xg[j + 32 * k], unit);
          }
          const float a = __fadd_rn(__fmul_rn(xs[0], q[0]), __fmul_rn(xs[2], q[2]));
          const float b = __fadd_rn(__fmul_rn(xs[1], q[1]), __fmul_rn(xs[3], q[3]));
          u[j] = __fadd_rn(a, b);
        }
        float den = tree_sum<32>(u);
        nv_eden_scales<8>(sc + 8 * gi, badb + 8 * gi, num, den, p, orow, ocol + 128 * gi);
      }
    }
  }
  nv_store<G>(p, orow, ocol, cw, sc);
}

template <int G, bool NV, int RULE, int RND>
__device__ __forceinline__ void quant_group(float (&x)[G], const QParams& p, u32 orow, u32 ocol) {
  rotate<G>(x, p);
  if constexpr (NV) quant_group_nv<G, RULE, RND>(x, p, orow, ocol);
  else quant_group_mx<G, RULE, RND>(x, p, (u64)orow * p.Kout + ocol);
}

// ---------------------------------------------------------------------------------------------
// MXFP4 rows, warp-cooperative (quant_rows with G == 32): a thread owns 8 consecutive elements (a
// "chunk", one 16-byte BF16/F16 load), the 4 lanes 4t..4t+3 of a quad own one 32-block. Lane
// q = lane & 3 holds block elements 8q..8q+7. Hadamard strides 1, 2, 4 run in the thread, 8 and 16
// across lanes (xor 1, xor 2); block sums follow the halving tree (j + 16: xor 2, j + 8: xor 1,
// then 4, 2, 1 in the thread); amax is a max (order-free). Every lane of a quad computes the same
// scale; lane 0 writes it. Codes: one 32-bit store a thread; mask: one byte a thread.

#ifndef FP4_HOST_EMU
__device__ __forceinline__ float shfl_xor(float v, int m) { return __shfl_xor_sync(0xFFFFFFFFu, v, m); }
#endif

struct MxArgs {
  int H;           // 0, 16 or 32
  float hs;        // FP32 1/sqrt(H)
  int has_signs;
  float sg[8];     // this lane's signs (+-1) for elements 8q..8q+7 of the block (period H)
  u32 seed, key0;
  u8* codes;       // (chunks) u32 words
  u8* scales;      // (chunks / 4)
  u8* mask;        // (chunks) bytes, or null
};

// Butterfly across lanes at stride N (m = 1) or 2N (m = 2), N elements a lane: the lower lane of
// the pair holds a, the upper b; lower gets a + b = fma(a, 1, b), upper a - b = fma(b, -1, a) (both
// exact-product single roundings, identical to the add / subtract).
template <int N>
__device__ __forceinline__ void butterfly_x(float (&x)[N], int m, bool upper) {
  const float sgn = upper ? -1.0f : 1.0f;
#pragma unroll
  for (int i = 0; i < N; i++) {
    float p = shfl_xor(x[i], m);
    x[i] = __fmaf_rn(x[i], sgn, p);
  }
}

// Halving-tree sum of the quad's 4N values (x[i] is element Nq + i): every lane gets it.
// Stage j + 2N pairs lanes q, q ^ 2; j + N pairs q, q ^ 1 (a + b == b + a exactly).
template <int N>
__device__ __forceinline__ float quad_tree_sum(const float (&x)[N]) {
  float t[N];
#pragma unroll
  for (int i = 0; i < N; i++) t[i] = __fadd_rn(x[i], shfl_xor(x[i], 2));
#pragma unroll
  for (int i = 0; i < N; i++) t[i] = __fadd_rn(t[i], shfl_xor(t[i], 1));
  return tree_sum<N>(t);
}

// The signs and the blockwise Hadamard (H = 16 or 32) of one lane's 8 elements.
__device__ __forceinline__ void mx_rotate(float (&x)[8], const MxArgs& a, u32 q) {
  if (a.has_signs) {  // stride 1 with the signs folded in: (a s_a) +- b s_b = fma(b, +-s_b, a s_a)
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      float A = __fmul_rn(x[i], a.sg[i]), b = x[i + 1];
      x[i] = __fmaf_rn(b, a.sg[i + 1], A);
      x[i + 1] = __fmaf_rn(b, -a.sg[i + 1], A);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      float A = x[i], b = x[i + 1];
      x[i] = __fadd_rn(A, b);
      x[i + 1] = __fsub_rn(A, b);
    }
  }
#pragma unroll
  for (int h = 2; h < 8; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
      if (!(i & h)) {
        float A = x[i], b = x[i + h];
        x[i] = __fadd_rn(A, b);
        x[i + h] = __fsub_rn(A, b);
      }
    }
  }
  butterfly_x(x, 1, q & 1);
  if (a.H == 32) butterfly_x(x, 2, q & 2);
#pragma unroll
  for (int i = 0; i < 8; i++) x[i] = __fmul_rn(x[i], a.hs);
}

template <int RULE, int RND>
__device__ __forceinline__ void mx_chunk(float (&x)[8], const MxArgs& a, u32 q, u64 c, bool valid) {
  if (a.H) mx_rotate(x, a, q);
  int e;
  bool bad;
  {  // block amax (shuffles in converged code)
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) m = absmax_nan(m, x[i]);
    m = absmax_nan(m, shfl_xor(m, 1));
    m = absmax_nan(m, shfl_xor(m, 2));
    const u32 ab = __float_as_uint(m) & 0x7FFFFFFFu;
    bad = ab >= 0x7F800000u;
    e = absmax_exponent(__uint_as_float(ab));
  }
  if constexpr (RULE == RULE_QUEST) {  // quant_group_mx's sigma, the sums across the lane quad
    const int es = max(-126, min(126, e));
    const float unit = unit_scale(es);
    float t[8];
#pragma unroll
    for (int i = 0; i < 8; i++) t[i] = __fmul_rn(x[i], unit);
    const float mean = __fmul_rn(quad_tree_sum(t), 0.03125f);
#pragma unroll
    for (int i = 0; i < 8; i++) t[i] = __fmul_rn(t[i], t[i]);
    const float mean2 = __fmul_rn(quad_tree_sum(t), 0.03125f);
    float var = __fsub_rn(mean2, __fmul_rn(mean, mean));
    var = var < 0.0f ? 0.0f : var;
    const float sigma = __fsqrt_rn(var);
    if (sigma > 0.0f) e = quest_exponent(sigma) + es;
  }
  e = bad ? 0 : max(-127, min(127, e));
  const float inv = exp2i(-e);
  const u64 i0 = c * 8;  // element index of x[0] in the output layout
  u32 rw[2] = {0u, 0u};  // the chunk's two random words (one hash per 4 elements)
  if constexpr (RND == ROUND_SR) {
    const u32 key = sr_key(a.seed, a.key0, i0);
    rw[0] = sr_word(key, i0);
    rw[1] = sr_word(key, i0 + 4);
  }
  u32 w = 0, m8 = 0;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    float v = __fmul_rn(x[i], inv);
    float r;
    if constexpr (RND == ROUND_SR) r = e2m1_sr_f<RULE != RULE_ABSMAX>(v, sr_rr1(rw[i / 4], i % 4));
    else r = e2m1_rn_f<RULE != RULE_ABSMAX>(v);
    w += __float_as_uint(with_sign8(r, v)) << (4 * i);
    if (RULE == RULE_QUEST && !(fabsf(v) > 6.0f)) m8 |= 1u << i;
  }
  w -= nibble_base(RND == ROUND_SR ? E2M1_SR_BASE : E2M1_RN_BASE);
  if (valid) {
    reinterpret_cast<u32*>(a.codes)[c] = bad ? 0u : w;
    if (RULE == RULE_QUEST && a.mask) a.mask[c] = bad ? (u8)0 : (u8)m8;
    if (q == 0) a.scales[c >> 2] = bad ? (u8)0xFF : (u8)(e + 127);
  }
}

__device__ __forceinline__ void mx_lane_signs(MxArgs& a, u32 q, int has_signs, u32 s0, int H) {
  // element 8q + i of the block uses sign (8q + i) mod H: H = 16 repeats the low half-word
  u32 w = H == 16 ? ((s0 & 0xFFFFu) | (s0 << 16)) : s0;
  a.has_signs = has_signs;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    a.sg[i] = ((w >> (8 * q + i)) & 1u) ? -1.0f : 1.0f;
#ifndef FP4_HOST_EMU
    asm("mov.b32 %0, %0;" : "+f"(a.sg[i]));  // opaque: kept in a register, not recomputed per chunk
#endif
  }
}

// ---------------------------------------------------------------------------------------------
// NVFP4 128-groups, warp-cooperative (quant_rows with G == 128, LANES == 4): the 4 lanes of a quad
// own one 128-group (Hadamard 128 or MS-EDEN), lane q = lane & 3 holds its elements 32q..32q+31
// (the group's 16-blocks 2q, 2q+1). Hadamard strides 1..16 run in the lane, 32 and 64 across lanes
// (xor 1, xor 2: butterfly_x); MS-EDEN's two 128-sums follow the halving tree (quad_tree_sum: level
// j + 64 pairs lanes q, q ^ 2, level j + 32 pairs q, q ^ 1, then tree_sum<32> in the lane), so every
// lane computes the group's correction with the same bits; block scales, codes and the pre-pass
// amax are lane-local (nv_encode, nv_prepass_amax on 32 elements). Same bits as quant_group_nv.

// Lane q's sign word: element 32q + i of the group takes bit i of group word q (load_signs).
__device__ __forceinline__ void nvq_lane_signs(QParams& p, u32 q) {
  if (!p.has_signs) return;
  p.sw[0] = q == 0 ? p.sw[0] : q == 1 ? p.sw[1] : q == 2 ? p.sw[2] : p.sw[3];
}

// Signs and the blockwise Hadamard (p.H: 0, 16, ..., 128) of lane q's 32 elements.
__device__ __forceinline__ void nvq_rotate(float (&x)[32], const QParams& p, u32 q) {
  if (p.H == 16) rotate_h<32, 16>(x, p);
  else if (p.H == 32) rotate_h<32, 32>(x, p);
  else if (p.H >= 64) {  // 64, 128: strides 1..16 in the lane, then across lanes, then 1/sqrt(H)
    rotate_h<32, 32, true, false>(x, p);
    butterfly_x(x, 1, q & 1);
    if (p.H == 128) butterfly_x(x, 2, q & 2);
#pragma unroll
    for (int i = 0; i < 32; i++) x[i] = __fmul_rn(x[i], p.hs);
  }
}

// Lane q's part of one 128-group; (orow, ocol): the output position of its x[0]. valid = false
// (past the end): zeros at a valid position in, nothing stored, every shuffle still run.
template <int RULE, int RND>
__device__ __forceinline__ void nvq_group(float (&x)[32], const QParams& p, u32 q, u32 orow, u32 ocol, bool valid) {
  nvq_rotate(x, p, q);
  if (p.pass == 1) {
    nv_amax_atomic(p, valid ? nv_prepass_amax<32>(x, p, orow, ocol) : 0u);
    return;
  }
  const float g = *p.g;
  u32 cw[4], sc[2];
  bool badb[2];
  nv_encode<32, RULE, RND>(x, p, orow, ocol, g, cw, sc, badb);
  if constexpr (RND == ROUND_EDEN) {  // the group's sum(x x) and sum(x q) (quant_group_nv's order)
    const float unit = unit_scale(floor_log2(g)), gu = __fmul_rn(g, unit);  // x, q in units of g's 2^E
    float t[32];
#pragma unroll
    for (int i = 0; i < 32; i++) {
      const float xs = __fmul_rn(x[i], unit);
      t[i] = __fmul_rn(xs, xs);
    }
    const float num = quad_tree_sum(t);
#pragma unroll
    for (int i = 0; i < 32; i++) t[i] = __fmul_rn(__fmul_rn(x[i], unit), nv_value(cw, sc, i, gu));
    const float den = quad_tree_sum(t);
    nv_eden_scales<2>(sc, badb, num, den, p, orow, ocol);
  }
  if (valid) nv_store<32>(p, orow, ocol, cw, sc);
}

// ---------------------------------------------------------------------------------------------
// quant_cols' tile (the kernel is below; these pieces are host-built too, for the emulation): a
// 128 x 32 shared-memory tile of the (R, K) input, rows = the quantized axis.

#define TILE_R 128
#define TILE_C 32
#define TILE_LD 36  // padded row (floats): 16-byte aligned rows for vector stores
// The quad layout (LANES = 4) shifts each 32-row band of the tile by 8 floats more: lane q of a
// quad reads row 32q + j of its column, and rows 32 apart are 32 * 36 floats apart, one bank for
// every pitch; with the shift lane l (column 8 warp + l / 4, q = l % 4) reads bank
// (4j + 8 warp + l / 4 + 8q) mod 32, 32 distinct banks. The bands stay 16-byte aligned.
#define TILE_BAND 8
#define TILE_FLOATS(LANES) (TILE_R * TILE_LD + ((LANES) == 4 ? (TILE_R / 32 - 1) * TILE_BAND : 0))

template <int LANES>
__device__ __forceinline__ int tile_at(int rr, int cc) {  // float offset of tile element (rr, cc)
  return rr * TILE_LD + (LANES == 4 ? (rr >> 5) * TILE_BAND : 0) + cc;
}

// Sign (bit 31) of tile row rr's element of its G-group: the random Hadamard's +-1, applied while
// loading (one sign covers a row's whole chunk), so the rotation itself runs without signs.
struct RowSigns {  // the sign words by value (a pointer into QParams would put it in local memory)
  u32 w[4];
  bool on;
};
template <int G>
__device__ __forceinline__ u32 row_sign(const RowSigns& s, u32 rr) {
  u32 w = s.w[0];
  if constexpr (G > 32) {
    const u32 k = (rr % G) >> 5;
    w = k == 0 ? s.w[0] : (k == 1 ? s.w[1] : (k == 2 ? s.w[2] : s.w[3]));
  }
  return s.on ? ((w >> (rr & 31)) & 1u) << 31 : 0u;
}

// quant_cols' quad layout (G = 128, blockDim 128): thread t is lane q = t % 4 of the quad for tile
// column cl = t / 4, and holds rows 32q..32q+31 of it (signed at the tile load: p.has_signs = 0),
// quantized by nvq_group at output (col, r0 + 32q) of the (K, R) layout. col = c0 + cl >= K (past
// the tile's last input column): valid = false, the zeros of the tile in at output row 0.
template <int RULE, int RND>
__device__ __forceinline__ void nvq_col(const float* tile, const QParams& p, u32 q, u32 cl, u32 col, u32 r0,
                                        bool valid) {
  float v[32];
#pragma unroll
  for (int j = 0; j < 32; j++) v[j] = tile[tile_at<4>(32 * q + j, cl)];
  nvq_group<RULE, RND>(v, p, q, valid ? col : 0u, r0 + 32 * q, valid);
}

// ---------------------------------------------------------------------------------------------
// NVFP4 tensor amax (nv_amax, the kernel is below; this part is host-built too, for the emulation):
// quant_rows' / quant_cols' pre-pass (pass = 1) as a kernel of its own, for a dense input (SRC 0-2)
// without block2d tiles and a Hadamard of 0 or 16. It returns the same bits as that pre-pass: each
// 16-block of the quantizer's geometry is converted, signed and rotated by the same rotate_h and
// reduced by the same nv_prepass_amax (NaN/Inf blocks left out), and a max over the blocks is
// order-free. The quantizer's group size, rule and rounding do not enter the pre-pass (its G-groups
// are whole 16-blocks with the same rotation), so one kernel serves them all. Bandwidth first: no
// quantizer state (quant_rows' G = 16 path holds 64-72 registers for it), several loads in flight
// a thread, about one resident wave of CTAs looping over the tensor, one atomic a warp.
//   V = 0 (rows: fp4.quantize along the last dim): the (R, K) input as R K / 16 blocks of 16
//       consecutive elements (K % 16 == 0: a block never straddles rows), 16-byte loads, NVA_U
//       blocks a thread in flight.
//   V > 0 (cols: along the first dim, quant_cols' blocks): a thread takes 16 rows x V columns (one
//       4-byte load a row, 16 in flight), each column's 16 elements one block; the signs go by the
//       row in the block (element i of rotate_h's block is row 16 rb + i: quant_cols' row_sign).

template <class T>
__device__ __forceinline__ T ld_nc(const T* p) {  // a load through the read-only (texture) path
#ifdef FP4_HOST_EMU
  return *p;
#else
  return __ldg(p);
#endif
}

__device__ __forceinline__ float f16_bits_to_f32(u32 h) {  // FP16 bits (low half) -> FP32, exact
#ifdef FP4_HOST_EMU
  _Float16 f;
  const unsigned short s = (unsigned short)h;
  memcpy(&f, &s, 2);
  return (float)f;
#else
  return __half2float(__ushort_as_half((unsigned short)h));
#endif
}

// Element i of packed words w as FP32 (load_dense's conversions): FP32 one a word; BF16 / FP16 two
// a word, element 2j in the low half of w[j].
template <int SRC>
__device__ __forceinline__ float elem_f32(const u32* w, int i) {
  if constexpr (SRC == 0) return __uint_as_float(w[i]);
  else if constexpr (SRC == 1) return __uint_as_float(i & 1 ? w[i / 2] & 0xFFFF0000u : w[i / 2] << 16);
  else return f16_bits_to_f32(i & 1 ? w[i / 2] >> 16 : w[i / 2] & 0xFFFFu);
}

// One 16-block's contribution: its amax bits, or 0 for a NaN/Inf block (p.tiles is null).
template <int H>
__device__ __forceinline__ u32 nva_block(float (&v)[16], const QParams& p) {
  if constexpr (H == 16) rotate_h<16, 16>(v, p);
  return nv_prepass_amax<16>(v, p, 0u, 0u);
}

template <int SRC, int H>  // blocks a thread loads before it reduces any: 64 bytes in flight
constexpr int NVA_U = SRC == 0 ? 1 : 2;

// Thread t of nt: blocks t + nt u + NVA_U nt i. n < 2^31 blocks (the host checks): no wrap-around.
template <int SRC, int H>
__device__ __forceinline__ u32 nva_rows(const void* __restrict__ x, u32 n, const QParams& p, u32 t, u32 nt) {
  constexpr int W = SRC == 0 ? 4 : 2;  // 16-byte words a block
  constexpr int U = NVA_U<SRC, H>;
  const uint4* src = reinterpret_cast<const uint4*>(x);
  u32 fm = 0;
  for (u32 b0 = t; b0 < n; b0 += U * nt) {
    uint4 raw[U][W];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const u32 b = b0 + u * nt;  // past the end: zeros, whose amax 0 changes no max
#pragma unroll
      for (int k = 0; k < W; k++) raw[u][k] = b < n ? ld_nc(src + (u64)b * W + k) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      u32 w[4 * W];
#pragma unroll
      for (int k = 0; k < W; k++) {
        w[4 * k] = raw[u][k].x; w[4 * k + 1] = raw[u][k].y; w[4 * k + 2] = raw[u][k].z; w[4 * k + 3] = raw[u][k].w;
      }
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; i++) v[i] = elem_f32<SRC>(w, i);
      fm = max(fm, nva_block<H>(v, p));
    }
  }
  return fm;
}

// Thread t of nt: strips t + nt i, strip s = (row block rb, columns V c .. V c + V - 1), c fastest (a
// warp's row loads are contiguous), one 4-byte load a row (V = 4 / element bytes; V = 1 and 2-byte
// loads for a 16-bit input with an odd K). R % 16 == 0, K % V == 0, (R / 16) (K / V) < 2^31 (the
// host checks). 8-byte loads (V = 4 for BF16) spilled at the 32-register cap (ptxas, sm_90a).
template <int SRC, int H, int V>
__device__ __forceinline__ u32 nva_cols(const void* __restrict__ x, u32 R, u32 K, const QParams& p, u32 t, u32 nt) {
  constexpr int ES = SRC == 0 ? 4 : 2;  // element bytes
  static_assert(V * ES == 4 || (ES == 2 && V == 1), "nva_cols loads 4 bytes a row (2 for V = 1, 16-bit)");
  const u32 kv = K / V, n = (R / 16) * kv;
  const u8* base = reinterpret_cast<const u8*>(x);
  u32 fm = 0;
  for (u32 s = t; s < n; s += nt) {
    const u32 rb = s / kv;
    const u64 e0 = (u64)rb * 16 * K + (u64)(s - rb * kv) * V;  // element (16 rb, V c)
    u32 raw[16];
#pragma unroll
    for (int j = 0; j < 16; j++) {
      const u8* a = base + (e0 + (u64)j * K) * ES;
      if constexpr (V * ES == 4) raw[j] = ld_nc(reinterpret_cast<const u32*>(a));
      else raw[j] = ld_nc(reinterpret_cast<const unsigned short*>(a));
    }
#pragma unroll
    for (int c = 0; c < V; c++) {
      float v[16];
#pragma unroll
      for (int j = 0; j < 16; j++) v[j] = elem_f32<SRC>(raw + j, c);
      fm = max(fm, nva_block<H>(v, p));
    }
  }
  return fm;
}

// One thread of the nv_amax grid (thread t of nt) on the (R, K) input x, signs as quant_rows takes
// them (device seeds already resolved): its max into amax[0], one atomic a warp (nv_amax_atomic).
template <int SRC, int H, int V>
__device__ __forceinline__ void nv_amax_thread(const void* __restrict__ x, u32 R, u32 K, float hs, int has_signs,
                                               u32 s0, u32 s1, u32 s2, u32 s3, u32* amax, u32 t, u32 nt) {
  static_assert(H == 0 || H == 16, "nv_amax takes Hadamard 0 or 16");
  QParams p;
  p.H = H; p.hs = hs; p.pass = 1; p.amax = amax; p.tiles = nullptr; p.Kout = 0;
  load_signs(p, has_signs, s0, s1, s2, s3);
  u32 fm;
  if constexpr (V == 0) fm = nva_rows<SRC, H>(x, (u32)((u64)R * K / 16), p, t, nt);
  else fm = nva_cols<SRC, H, V>(x, R, K, p, t, nt);
  nv_amax_atomic(p, fm);
}

// ---------------------------------------------------------------------------------------------
// Loads (host-built too with FP4_HOST_EMU_ADAMW: test_optim.py's grid emulation of the AdamW kernel
// brings the vector types and __ldg)
#if !defined(FP4_HOST_EMU) || defined(FP4_HOST_EMU_ADAMW)

__device__ __forceinline__ void bf16x2_to_f32(u32 w, float& a, float& b) {
  a = __uint_as_float(w << 16);
  b = __uint_as_float(w & 0xFFFF0000u);
}

__device__ __forceinline__ void f16x2_to_f32(u32 w, float& a, float& b) {
  __half2 h = *reinterpret_cast<__half2*>(&w);
  float2 f = __half22float2(h);
  a = f.x;
  b = f.y;
}

// One 16-byte load's elements as FP32: 4 FP32 (SRC 0) or 8 BF16 / FP16 (SRC 1, 2).
template <int SRC, int VEC>
__device__ __forceinline__ void unpack_vec(float (&v)[VEC], const uint4& raw) {
  const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; k++) {
    if constexpr (SRC == 0) v[k] = __uint_as_float(w[k]);
    else if constexpr (SRC == 1) bf16x2_to_f32(w[k], v[2 * k], v[2 * k + 1]);
    else f16x2_to_f32(w[k], v[2 * k], v[2 * k + 1]);
  }
}

template <int SRC, int G>  // G contiguous elements from a 16-byte aligned address
__device__ __forceinline__ void load_dense(float (&x)[G], const void* src, u64 off) {
  if constexpr (SRC == 0) {
    const float4* s = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(src) + off);
#pragma unroll
    for (int i = 0; i < G / 4; i++) {
      float4 v = __ldg(s + i);
      x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
    }
  } else {
    const uint4* s = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(src) + off);
    uint4 raw[G / 8];
#pragma unroll
    for (int i = 0; i < G / 8; i++) raw[i] = __ldg(s + i);
#pragma unroll
    for (int i = 0; i < G / 8; i++) {
      float v[8];
      unpack_vec<SRC, 8>(v, raw[i]);
#pragma unroll
      for (int k = 0; k < 8; k++) x[8 * i + k] = v[k];
    }
  }
}

template <int SRC>
__device__ __forceinline__ float load_one(const void* src, u64 off) {
  if constexpr (SRC == 0) return __ldg(reinterpret_cast<const float*>(src) + off);
  else {
    unsigned short h = __ldg(reinterpret_cast<const unsigned short*>(src) + off);
    if constexpr (SRC == 1) return __uint_as_float((u32)h << 16);
    else return __half2float(__ushort_as_half(h));
  }
}

#endif  // !FP4_HOST_EMU || FP4_HOST_EMU_ADAMW

#ifndef FP4_HOST_EMU  // the other host emulations stop here: the kernels are device-only
// ---------------------------------------------------------------------------------------------
// Seeds and signs from device memory (dseed non-null): the FP4Linear backward draws its seed on
// the GPU, so a captured CUDA graph gets fresh randomness on every replay. seed becomes
// dseed[0] + seed (the host passes an offset), and has_signs == 2 asks for fp4.random_signs of
// dseed[0] + s0: word w = lowbias32(base + 0x632BE5AB * (w + 1)).
__device__ __forceinline__ void device_rng(const u32* dseed, int& has_signs, u32& s0, u32& s1, u32& s2, u32& s3,
                                           u32& seed, u32& key0) {
  if (!dseed) return;
  const u32 base = __ldg(dseed);
  seed += base;
  key0 = hash_key(seed, 0);
  if (has_signs == 2) {
    const u32 b = base + s0;
    s0 = lowbias32(b + 0x632BE5ABu);
    s1 = lowbias32(b + 2u * 0x632BE5ABu);
    s2 = lowbias32(b + 3u * 0x632BE5ABu);
    s3 = lowbias32(b + 4u * 0x632BE5ABu);
    has_signs = 1;
  }
}

// ---------------------------------------------------------------------------------------------
// quant_rows: quantize along the last dim of a row-major (R, K) tensor. One thread per G-group.

// mx_rows' CTAs an SM (up to 85 registers: room for the prefetched group; 4 CTAs without the
// prefetch timed slower on the H200). fp4._MX_ROWS_CTAS_PER_SM sizes the grid to match.
#define FP4_MX_MINB 3

// quant_rows' MXFP4 one-thread-a-block loop for a fixed Hadamard size HH and signs flag SG. Group
// gi covers input (and output) elements 32 gi .. 32 gi + 31: rows are contiguous, so no division.
// The grid is about one wave (fp4._quant_launch): each thread loops over many groups, so the setup
// (signs, seeds) is paid once.
template <int SRC, int RULE, int RND, int HH, bool SG>
__device__ __forceinline__ void mx_rows(const void* __restrict__ x, const QParams& p, u32 n) {
  const u32 stride = gridDim.x * blockDim.x;
  u32 gi = blockIdx.x * blockDim.x + threadIdx.x;
  if constexpr (SRC != 0) {  // 16-bit input: the next group's 64 bytes load while this one computes
    const uint4* src = reinterpret_cast<const uint4*>(x);
    uint4 next[4];
#pragma unroll
    for (int k = 0; k < 4; k++) next[k] = gi < n ? __ldg(src + (u64)gi * 4 + k) : make_uint4(0, 0, 0, 0);
    for (; gi < n; gi += stride) {
      float v[32];
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const u32 w4[4] = {next[k].x, next[k].y, next[k].z, next[k].w};
#pragma unroll
        for (int t = 0; t < 4; t++) {
          if constexpr (SRC == 1) bf16x2_to_f32(w4[t], v[8 * k + 2 * t], v[8 * k + 2 * t + 1]);
          else f16x2_to_f32(w4[t], v[8 * k + 2 * t], v[8 * k + 2 * t + 1]);
        }
      }
      const u32 gn = gi + stride;
#pragma unroll
      for (int k = 0; k < 4; k++) if (gn < n) next[k] = __ldg(src + (u64)gn * 4 + k);
      if constexpr (HH > 0) rotate_h<32, HH, SG>(v, p);
      quant_group_mx<32, RULE, RND>(v, p, (u64)gi * 32);
    }
  } else {
    for (; gi < n; gi += stride) {
      float v[32];
      load_dense<SRC, 32>(v, x, (u64)gi * 32);
      if constexpr (HH > 0) rotate_h<32, HH, SG>(v, p);
      quant_group_mx<32, RULE, RND>(v, p, (u64)gi * 32);
    }
  }
}

// MXFP4 (G = 32 and G = 8) asks for 4 CTAs an SM: 64 registers, no spills (G = 32 was 80-95
// registers: 2 CTAs, 16 warps). LANES = 4 (NVFP4, G = 128 only): a lane quad a group (nvq_group),
// FP4_NVQ_MINB CTAs an SM.
#define FP4_NVQ_MINB 2
template <int SRC, int G, bool NV, int RULE, int RND, int LANES = 1>
__global__ void __launch_bounds__(256, (!NV && G == 32) ? FP4_MX_MINB : (!NV && G == 8) ? 4
                                       : (NV && LANES == 4) ? FP4_NVQ_MINB : 1) quant_rows(
    const void* __restrict__ x, u32 R, u32 K, int H, float hs, int has_signs, u32 s0, u32 s1, u32 s2, u32 s3,
    u32 seed, u32 key0, const u32* __restrict__ dseed, int pass, u8* __restrict__ codes, u8* __restrict__ scales,
    u8* __restrict__ mask, const float* __restrict__ g, u32* __restrict__ amax, u32* __restrict__ tiles) {
  device_rng(dseed, has_signs, s0, s1, s2, s3, seed, key0);
  if constexpr (!NV && G == 8) {  // MXFP4 32-blocks, Hadamard 0/16/32, 8 elements a thread: mx_chunk
    MxArgs a;
    const u32 lane = threadIdx.x & 31, q = lane & 3;
    a.H = H; a.hs = hs; a.seed = seed; a.key0 = key0; a.codes = codes; a.scales = scales; a.mask = mask;
    mx_lane_signs(a, q, has_signs, s0, H);
    constexpr int U = 4;  // chunks a thread has in flight (loads issued before any use)
    const u64 nchunks = (u64)R * K / 8;  // a multiple of 4: a quad is all valid or all not
    const u64 stride = (u64)gridDim.x * blockDim.x;
    // A trip count from launch constants only: ptxas then sees the shuffles as converged (a
    // bound on the warp's own index compiled each shuffle into a WARPSYNC/ENDCOLLECTIVE loop).
    // fp4._quant_launch sizes the grid for one trip.
    const u64 iters = (nchunks + U * stride - 1) / (U * stride);
    const u64 wbase0 = (u64)blockIdx.x * blockDim.x + (threadIdx.x & ~31u);
    for (u64 it = 0; it < iters; it++) {
      const u64 wbase = wbase0 + it * U * stride;
      constexpr int W = SRC == 0 ? 2 : 1;  // 16-byte words a chunk
      uint4 raw[U][W];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const u64 c = wbase + lane + u * stride;
#pragma unroll
        for (int k = 0; k < W; k++)
          raw[u][k] = c < nchunks ? __ldg(reinterpret_cast<const uint4*>(x) + c * W + k) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; u++) {
        const u64 c = wbase + lane + u * stride;  // past the end: zeros in, nothing stored
        float v[8];
#pragma unroll
        for (int k = 0; k < W; k++) {
          u32 w4[4] = {raw[u][k].x, raw[u][k].y, raw[u][k].z, raw[u][k].w};
#pragma unroll
          for (int t = 0; t < 4; t++) {
            if constexpr (SRC == 0) v[4 * k + t] = __uint_as_float(w4[t]);
            else if constexpr (SRC == 1) bf16x2_to_f32(w4[t], v[2 * t], v[2 * t + 1]);
            else f16x2_to_f32(w4[t], v[2 * t], v[2 * t + 1]);
          }
        }
        mx_chunk<RULE, RND>(v, a, q, c, c < nchunks);
      }
    }
  } else if constexpr (NV && LANES == 4) {  // NVFP4 128-groups, 32 elements a lane: nvq_group
    static_assert(G == 128, "the quad NVFP4 layout is for 128-groups");
    QParams p;
    p.H = H; p.hs = hs; p.seed = seed; p.key0 = key0; p.pass = pass;
    p.codes = codes; p.scales = scales; p.mask = mask; p.g = g; p.amax = amax; p.tiles = tiles;
    p.Kout = K;
    load_signs(p, has_signs, s0, s1, s2, s3);
    const u32 q = threadIdx.x & 3;
    nvq_lane_signs(p, q);
    // 32-bit indices (the host checks R * K / 32 < 2^31): with a 64-bit division by K (a branching
    // subroutine) ptxas wrapped every shuffle below in a WARPSYNC/ENDCOLLECTIVE loop (cuobjdump -sass)
    const u32 nchunks = (u32)((u64)R * K / 32);  // a multiple of 4: a quad is all valid or all not
    const u32 stride = gridDim.x * blockDim.x, kc = K / 32;
    // launch constants only in the trip count: converged shuffles (as for G == 8 above)
    const u32 iters = (nchunks + stride - 1) / stride;
    for (u32 it = 0; it < iters; it++) {
      const u32 c = it * stride + blockIdx.x * blockDim.x + threadIdx.x;
      const bool valid = c < nchunks;
      const u32 cv = valid ? c : q;  // the lane's chunk (row 0's chunk q when past the end)
      const u32 orow = cv / kc, ocol = (cv - orow * kc) * 32;
      const u64 e0 = (u64)orow * K + ocol;  // the lane's first element (rows are contiguous)
      float v[32];
      if (valid) load_dense<SRC, 32>(v, x, e0);
      else {
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = 0.0f;
      }
      nvq_group<RULE, RND>(v, p, q, orow, ocol, valid);
    }
  } else {
    QParams p;
    p.H = H; p.hs = hs; p.seed = seed; p.key0 = key0; p.pass = pass;
    p.codes = codes; p.scales = scales; p.mask = mask; p.g = g; p.amax = amax; p.tiles = tiles;
    p.Kout = K;
    load_signs(p, has_signs, s0, s1, s2, s3);
    const u32 n = R * (K / G);  // host checks R * K / G < 2^32
    if constexpr (NV) {
      // pre-pass: the thread's max over all its groups, then one atomic a warp after the loop (a
      // max is order-free: the same tensor amax as one atomic a group, far fewer atomics)
      u32 fm = 0;
      for (u32 gi = blockIdx.x * blockDim.x + threadIdx.x; gi < n; gi += gridDim.x * blockDim.x) {
        float v[G];
        u32 row = gi / (K / G), col = (gi - row * (K / G)) * G;
        load_dense<SRC, G>(v, x, (u64)row * K + col);
        if (p.pass == 1) {
          rotate<G>(v, p);
          fm = max(fm, nv_prepass_amax<G>(v, p, row, col));
        } else {
          quant_group<G, NV, RULE, RND>(v, p, row, col);
        }
      }
      if (p.pass == 1) nv_amax_atomic(p, fm);
    } else if constexpr (G == 32) {  // one loop per (Hadamard size, signs): straight-line bodies
      if (H == 32) {
        if (p.has_signs) mx_rows<SRC, RULE, RND, 32, true>(x, p, n);
        else mx_rows<SRC, RULE, RND, 32, false>(x, p, n);
      } else if (H == 16) {
        if (p.has_signs) mx_rows<SRC, RULE, RND, 16, true>(x, p, n);
        else mx_rows<SRC, RULE, RND, 16, false>(x, p, n);
      } else {
        mx_rows<SRC, RULE, RND, 0, false>(x, p, n);
      }
    } else {  // MXFP4 with a larger Hadamard (64, 128): G = H
      for (u32 gi = blockIdx.x * blockDim.x + threadIdx.x; gi < n; gi += gridDim.x * blockDim.x) {
        float v[G];
        load_dense<SRC, G>(v, x, (u64)gi * G);
        rotate<G>(v, p);
        quant_group_mx<G, RULE, RND>(v, p, (u64)gi * G);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// quant_cols: quantize along the first dim of a row-major (R, K) input through a 128 x 32 tile
// (its geometry, row signs and quad column read: "quant_cols' tile" above, host-built too).
// SRC 3/4: the input is a QTensor's codes (R, K/2) + scales (mxfp4 (R, K/32) E8M0; nvfp4
// (R, K/16) E4M3 with tensor scale *gin), dequantized into the tile (fp4.dequantize's values).

// E2M1 codes (8 nibbles of w) -> FP16 bits, two a word (h[0] = codes 0, 1; ... h[3] = codes 6, 7):
// the magnitude's FP16 high byte from an 8-entry PRMT table, the sign gathered from the nibbles'
// bit 3, the low byte 0 (E2M1 values are FP16 with a 2-bit significand, exactly).
#define F16HI_LO 0x3E3C3800u  // FP16 high bytes of 0, 0.5, 1, 1.5
#define F16HI_HI 0x46444240u  // ... of 2, 3, 4, 6
__device__ __forceinline__ void e2m1x8_to_f16(u32 w, u32* h) {
  const u32 w4 = w << 4;  // bit 3 of nibble 2k moved to the top of byte k of w4; nibble 2k+1's is there in w
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const u32 ww = w >> (16 * half), ww4 = w4 >> (16 * half);
    const u32 mag = __byte_perm(F16HI_LO, F16HI_HI, ww & 0x7777u);           // byte k: |code k| high byte
    const u32 sgn = __byte_perm(ww, ww4, 0x1504u) & 0x80808080u;              // byte k: sign of code k
    const u32 hb = mag | sgn;
    h[2 * half] = __byte_perm(hb, 0u, 0x1404u);      // (code 4 half, code 4 half + 1)
    h[2 * half + 1] = __byte_perm(hb, 0u, 0x3424u);  // (code 4 half + 2, code 4 half + 3)
  }
}

// A dense input's tile (SRC 0-2: FP32, BF16, FP16), signs applied; LANES: tile_at's layout.
// NT: quant_cols' blockDim (its launch bounds, which fp4's launch matches). The vector path issues
// up to 4 of a thread's 16-byte loads before the first is used: as a loop over a runtime blockDim
// it had one load in flight a thread (cuobjdump -sass: LDG.128 then STS.128, per trip).
template <int SRC, int G, int LANES>
__device__ __forceinline__ void load_tile(float* tile, const void* __restrict__ x, u32 R, u32 K, u32 r0, u32 c0,
                                          const RowSigns& sw) {
  const int nt = blockDim.x;
  {
    constexpr int VEC = SRC == 0 ? 4 : 8;  // elements a 16-byte load
    constexpr int NT = LANES == 4 ? 4 * TILE_C : 32 * TILE_R / G;
    constexpr int PER = TILE_R * (TILE_C / VEC) / NT;  // loads a thread
    constexpr int B = PER < 4 ? PER : 4;               // of them in flight at once
    static_assert(PER * NT == TILE_R * (TILE_C / VEC) && PER % B == 0, "quant_cols' tile and blockDim");
    const bool vec = (K % VEC == 0) && (c0 + TILE_C <= K);
    if (vec) {
      const int esz = SRC == 0 ? 4 : 2;  // bytes an element
#pragma unroll 1
      for (int i0 = 0; i0 < PER; i0 += B) {
        uint4 raw[B];
#pragma unroll
        for (int b = 0; b < B; b++) {
          const int e = threadIdx.x + (i0 + b) * NT;
          const int rr = e / (TILE_C / VEC), cc = (e % (TILE_C / VEC)) * VEC;
          raw[b] = r0 + rr < R ? __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const u8*>(x) +
                                                                     ((u64)(r0 + rr) * K + c0 + cc) * esz))
                               : make_uint4(0u, 0u, 0u, 0u);  // zeros: +0.0 in every format
        }
#pragma unroll
        for (int b = 0; b < B; b++) {
          const int e = threadIdx.x + (i0 + b) * NT;
          const int rr = e / (TILE_C / VEC), cc = (e % (TILE_C / VEC)) * VEC;
          float v[VEC];
          unpack_vec<SRC, VEC>(v, raw[b]);
          const u32 sg = row_sign<G>(sw, rr);
#pragma unroll
          for (int i = 0; i < VEC; i++) v[i] = __uint_as_float(__float_as_uint(v[i]) ^ sg);
#pragma unroll
          for (int i = 0; i < VEC; i += 4)
            *reinterpret_cast<float4*>(tile + tile_at<LANES>(rr, cc + i)) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
        }
      }
    } else {
      for (int e = threadIdx.x; e < TILE_R * TILE_C; e += nt) {
        int rr = e / TILE_C, cc = e % TILE_C;
        float v = (r0 + rr < R && c0 + cc < K) ? load_one<SRC>(x, (u64)(r0 + rr) * K + c0 + cc) : 0.0f;
        tile[tile_at<LANES>(rr, cc)] = __uint_as_float(__float_as_uint(v) ^ row_sign<G>(sw, rr));
      }
    }
  }
}

// A QTensor's codes as the input (SRC 3: MXFP4, 4: NVFP4), one chunk e of a tile at a time (16
// codes, 8 bytes, and their scale byte; 256 chunks a tile; K % 16 == 0, so a chunk is all in or all
// out), in two steps so that the next tile's loads can be in flight while this one is quantized:
// fetch_chunk issues the global loads into registers, store_chunk decodes them into the tile
// (fp4.dequantize's values, the row's sign applied).
struct CodeChunk {
  uint2 w;
  u32 sb;
};

template <int SRC>
__device__ __forceinline__ CodeChunk fetch_chunk(const void* __restrict__ x, const u8* __restrict__ in_scales,
                                                 u32 R, u32 K, u32 r0, u32 c0, int e) {
  const u32 r = r0 + (e >> 1), col = c0 + (e & 1) * 16;
  CodeChunk c = {make_uint2(0u, 0u), 0u};
  if (r < R && col < K) {
    c.w = __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const u8*>(x) + (u64)r * (K / 2) + col / 2));
    c.sb = SRC == 3 ? __ldg(in_scales + (u64)r * (K / 32) + col / 32) : __ldg(in_scales + (u64)r * (K / 16) + col / 16);
  }
  return c;
}

template <int SRC, int G, int LANES>
__device__ __forceinline__ void store_chunk(float* tile, const CodeChunk& c, const float* __restrict__ gin,
                                            u32 R, u32 K, u32 r0, u32 c0, const RowSigns& sw, int e) {
  const int rr = e >> 1, cc = (e & 1) * 16;
  float v[16];
  if (r0 + rr < R && c0 + cc < K) {
    float s, g2 = 1.0f;
    if constexpr (SRC == 3) {
      s = c.sb == 0xFFu ? __uint_as_float(0x7FFFFFFFu) : exp2i((int)c.sb - 127);
    } else {
      s = e4m3_dec(c.sb);
      g2 = *gin;  // nvfp4's tensor scale
    }
    s = __uint_as_float(__float_as_uint(s) ^ row_sign<G>(sw, rr));  // (code * -s) == -(code * s)
    u32 h[8];
    e2m1x8_to_f16(c.w.x, h);
    e2m1x8_to_f16(c.w.y, h + 4);
#pragma unroll
    for (int j = 0; j < 16; j++) {
      const float q = __half2float(__ushort_as_half((unsigned short)(h[j / 2] >> (16 * (j & 1)))));
      float d = __fmul_rn(q, s);  // mxfp4: code * 2^e; nvfp4: (code * s) * g
      if constexpr (SRC == 4) d = __fmul_rn(d, g2);
      v[j] = d;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; j++) v[j] = 0.0f;
  }
#pragma unroll
  for (int j = 0; j < 16; j += 4)
    *reinterpret_cast<float4*>(tile + tile_at<LANES>(rr, cc + j)) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
}

// One CTA loops over 128 x 32 tiles (t = column tile fastest); HH = G: the Hadamard as straight-line
// code (the usual case: the group is the Hadamard block), HH = 0: any H through rotate's dispatch.
// LANES = 4 (NVFP4, G = 128): a lane quad a column's group (nvq_col), blockDim 128.
template <int SRC, int G, bool NV, int RULE, int RND, int HH, int LANES>
__device__ __forceinline__ void cols_loop(float* tile, const void* __restrict__ x, const u8* __restrict__ in_scales,
                                          const float* __restrict__ gin, u32 R, u32 K, const QParams& p,
                                          const RowSigns& sw) {
  const u32 tiles_c = (K + TILE_C - 1) / TILE_C;
  const u32 ntiles = tiles_c * ((R + TILE_R - 1) / TILE_R);  // host checks < 2^32
  const u32 lane = threadIdx.x & 31, grp = threadIdx.x >> 5;  // blockDim = 32 * TILE_R / G (LANES 1)
  // SRC 3/4: the next tile's codes and scales are loaded while this one is quantized, where a CTA
  // loops over tiles (G = 32: fp4's launch gives one resident wave, 2 chunks a thread). Elsewhere
  // a CTA has one tile, and chunks held over the quantization would only cost registers (G = 128
  // spilled, G = 16 lost a CTA an SM: ptxas -v, sm_90a): there one chunk at a time.
  constexpr bool PREFETCH = G == 32;
  constexpr int NC = PREFETCH ? TILE_R * 2 / (32 * TILE_R / G) : 1;  // chunks a thread (blockDim = 32 TILE_R / G)
  CodeChunk next[NC];
  if constexpr (SRC >= 3 && PREFETCH) {
    if (blockIdx.x < ntiles) {
#pragma unroll
      for (int i = 0; i < NC; i++)
        next[i] = fetch_chunk<SRC>(x, in_scales, R, K, (blockIdx.x / tiles_c) * TILE_R, (blockIdx.x % tiles_c) * TILE_C,
                                   threadIdx.x + i * blockDim.x);
    }
  }
  for (u32 t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const u32 c0 = (t % tiles_c) * TILE_C, r0 = (t / tiles_c) * TILE_R;
    __syncthreads();  // the previous tile is read
    if constexpr (SRC >= 3 && PREFETCH) {
      const u32 tn = t + gridDim.x;
#pragma unroll
      for (int i = 0; i < NC; i++) {
        const int e = threadIdx.x + i * blockDim.x;
        store_chunk<SRC, G, LANES>(tile, next[i], gin, R, K, r0, c0, sw, e);
        if (tn < ntiles) next[i] = fetch_chunk<SRC>(x, in_scales, R, K, (tn / tiles_c) * TILE_R, (tn % tiles_c) * TILE_C, e);
      }
    } else if constexpr (SRC >= 3) {
      for (int e = threadIdx.x; e < TILE_R * 2; e += blockDim.x)
        store_chunk<SRC, G, LANES>(tile, fetch_chunk<SRC>(x, in_scales, R, K, r0, c0, e), gin, R, K, r0, c0, sw, e);
    } else {
      load_tile<SRC, G, LANES>(tile, x, R, K, r0, c0, sw);
    }
    __syncthreads();
    if constexpr (NV && LANES == 4) {  // every lane runs (converged shuffles); past K: valid = false
      const u32 cl = threadIdx.x >> 2;
      nvq_col<RULE, RND>(tile, p, threadIdx.x & 3, cl, c0 + cl, r0, c0 + cl < K);
      continue;
    }
    const u32 col = c0 + lane, r = r0 + grp * G;
    if (col < K && r < R) {
      float v[G];
#pragma unroll
      for (int j = 0; j < G; j++) v[j] = tile[(grp * G + j) * TILE_LD + lane];
      if constexpr (HH == G) rotate_h<G, G, false>(v, p);
      else rotate<G>(v, p);
      if constexpr (NV) quant_group_nv<G, RULE, RND>(v, p, col, r);
      else quant_group_mx<G, RULE, RND>(v, p, (u64)col * R + r);
    }
  }
}

// The grid is about one wave of CTAs (fp4._quant_launch), each looping over tiles: the setup
// (seeds, signs) is paid once a CTA. G = 32 (MXFP4) asks for 8 CTAs an SM (64 registers).
// LANES = 4 (NVFP4, G = 128 only): 128 threads, a lane quad a column (nvq_col), FP4_NVQ_COLS_MINB
// CTAs an SM (at most 128 registers).
#define FP4_NVQ_COLS_MINB 4
template <int SRC, int G, bool NV, int RULE, int RND, int LANES = 1>
__global__ void __launch_bounds__(LANES == 4 ? 4 * TILE_C : 32 * TILE_R / G,
                                  G == 32 ? 8 : LANES == 4 ? FP4_NVQ_COLS_MINB : 1) quant_cols(
    const void* __restrict__ x, const u8* __restrict__ in_scales, const float* __restrict__ gin, u32 R, u32 K,
    int H, float hs, int has_signs, u32 s0, u32 s1, u32 s2, u32 s3, u32 seed, u32 key0,
    const u32* __restrict__ dseed, int pass, u8* __restrict__ codes, u8* __restrict__ scales, u8* __restrict__ mask,
    const float* __restrict__ g, u32* __restrict__ amax, u32* __restrict__ tiles) {
  static_assert(LANES == 1 || (NV && G == 128), "the quad cols layout is for NVFP4 128-groups");
  device_rng(dseed, has_signs, s0, s1, s2, s3, seed, key0);
  __shared__ __align__(16) float tile[TILE_FLOATS(LANES)];
  QParams p;
  p.H = H; p.hs = hs; p.seed = seed; p.key0 = key0; p.pass = pass;
  p.codes = codes; p.scales = scales; p.mask = mask; p.g = g; p.amax = amax; p.tiles = tiles;
  p.Kout = R;  // output layout (K, R): the quantized axis is the input's first
  load_signs(p, has_signs, s0, s1, s2, s3);
  const RowSigns sw = {{p.sw[0], p.sw[1], p.sw[2], p.sw[3]}, p.has_signs != 0};
  p.has_signs = 0;  // applied by load_tile
  if constexpr (LANES == 4) cols_loop<SRC, G, NV, RULE, RND, 0, 4>(tile, x, in_scales, gin, R, K, p, sw);
  else if (H == G) cols_loop<SRC, G, NV, RULE, RND, G, 1>(tile, x, in_scales, gin, R, K, p, sw);
  else cols_loop<SRC, G, NV, RULE, RND, 0, 1>(tile, x, in_scales, gin, R, K, p, sw);
}

// ---------------------------------------------------------------------------------------------
// nv_amax<SRC, H, V>: the NVFP4 tensor-amax pre-pass alone (nv_amax_thread, "NVFP4 tensor amax"
// above). blockDim 256; fp4._quant_launch sizes the grid to one resident wave (FP4_NVA_MINB CTAs an
// SM, kernels._NV_AMAX_CTAS_PER_SM) and zeroes amax[0] first.
#define FP4_NVA_MINB(H) ((H) ? 5 : 8)
template <int SRC, int H, int V>
__global__ void __launch_bounds__(256, FP4_NVA_MINB(H)) nv_amax(
    const void* __restrict__ x, u32 R, u32 K, float hs, int has_signs, u32 s0, u32 s1, u32 s2, u32 s3,
    const u32* __restrict__ dseed, u32* __restrict__ amax) {
  u32 seed = 0, key0 = 0;  // device_rng's SR seed: unused here
  device_rng(dseed, has_signs, s0, s1, s2, s3, seed, key0);
  nv_amax_thread<SRC, H, V>(x, R, K, hs, has_signs, s0, s1, s2, s3, amax, blockIdx.x * blockDim.x + threadIdx.x,
                            gridDim.x * blockDim.x);
}

// ---------------------------------------------------------------------------------------------
// fold_mx: MXFP4 -> (R, K) float8_e4m3fn + (R,) FP32 row scales (fp4.fold_mx). One warp a row:
// the row's block-exponent max by warp reduction, then one 32-block a lane-step (a 16-byte load
// of codes, two 16-byte stores of E4M3 bytes).

// E4M3 bits of E2M1 magnitude index m (0..7: 0, .5, 1, 1.5, 2, 3, 4, 6) times 2^0, byte m.
#define E4M3_OF_E2M1 0x4C4844403C383000ull

// The E4M3 byte of e2m1_dec(c) * 2^d for d < -5 (fp4.fold_mx's element): subnormal, rounded or 0.
__device__ __forceinline__ u32 fold_byte_small(u32 c, float rel) {
  return e4m3_enc_signed(__fmul_rn(e2m1_dec(c), rel));
}

// Four codes (the nibbles of c's low 16 bits) -> four E4M3 bytes of code * 2^d, -5 <= d <= 0, where
// every product is an exact E4M3 normal: the d = 0 byte from a PRMT table, its biased exponent
// lowered by -d where the byte is non-zero (sub8 = -8d <= 40 < 0x30, the smallest such byte: no
// borrow between bytes), and the sign gathered from the nibbles' bit 3 (c4 = c << 4).
__device__ __forceinline__ u32 fold4(u32 c, u32 c4, u32 sub8) {
  u32 mag = __byte_perm((u32)E4M3_OF_E2M1, (u32)(E4M3_OF_E2M1 >> 32), c & 0x7777u);
  const u32 nz = (mag + 0x7F7F7F7Fu) & 0x80808080u;  // bit 7 of each non-zero byte (bytes <= 0x4C)
  mag -= (nz >> 7) * sub8;
  return mag | (__byte_perm(c, c4, 0x1504u) & 0x80808080u);
}

// One 32-block's 16 code bytes (4 words) -> 32 E4M3 bytes at dst (16-byte aligned); d = e - e_rowmax.
__device__ __forceinline__ void fold_block(uint4* dst, const u32 (&cw)[4], int d) {
  u32 o[8];
  if (d >= -5) {
    const u32 sub8 = (u32)(-8 * d);
#pragma unroll
    for (int w = 0; w < 8; w++) {
      const u32 c = cw[w / 2] >> (16 * (w & 1));
      o[w] = fold4(c, c << 4, sub8);
    }
  } else {
    const float rel = exp2i(d);
#pragma unroll
    for (int w = 0; w < 8; w++) {
      const u32 c = cw[w / 2] >> (16 * (w & 1));
      o[w] = fold_byte_small(c & 15u, rel) | (fold_byte_small((c >> 4) & 15u, rel) << 8) |
             (fold_byte_small((c >> 8) & 15u, rel) << 16) | (fold_byte_small((c >> 12) & 15u, rel) << 24);
    }
  }
  dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
  dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

__global__ void __launch_bounds__(256) fold_mx(const u8* __restrict__ codes, const u8* __restrict__ scales,
                                               u32 R, u32 K, u8* __restrict__ out, float* __restrict__ rowscale) {
  const u32 lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const u32 nb = K / 32;
  for (u32 row = blockIdx.x * warps + (threadIdx.x >> 5); row < R; row += gridDim.x * warps) {
    const u8* sr = scales + (u64)row * nb;
    int emax = -127, nan = 0;
    if (nb % 16 == 0 && (reinterpret_cast<u64>(scales) & 15u) == 0) {  // 16 scale bytes a lane-load
      for (u32 b0 = 16 * lane; b0 < nb; b0 += 16 * 32) {
        const uint4 s4 = __ldg(reinterpret_cast<const uint4*>(sr + b0));
        const u32 sw[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
        for (int i = 0; i < 16; i++) {
          const u32 s = (sw[i / 4] >> (8 * (i % 4))) & 0xFFu;
          if (s == 0xFFu) nan = 1;
          else emax = max(emax, (int)s - 127);
        }
      }
    } else {
      for (u32 b = lane; b < nb; b += 32) {
        u32 s = __ldg(sr + b);
        if (s == 0xFFu) nan = 1;
        else emax = max(emax, (int)s - 127);
      }
    }
    emax = __reduce_max_sync(0xFFFFFFFFu, emax);
    nan = __reduce_or_sync(0xFFFFFFFFu, nan);
    const uint4* cr = reinterpret_cast<const uint4*>(codes + (u64)row * (K / 2));  // 32 codes each
    uint4* orow = reinterpret_cast<uint4*>(out + (u64)row * K);
    // 4 blocks a lane in flight: a row of few warps (the backward's E^T: N rows of M = tokens
    // columns) had one 16-byte load a lane outstanding at a time
    constexpr int U = 4;
    for (u32 b0 = lane; b0 < nb; b0 += 32 * U) {
      uint4 c4[U];
      u32 s[U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const u32 b = b0 + 32 * u;
        c4[u] = b < nb ? __ldg(cr + b) : make_uint4(0u, 0u, 0u, 0u);
        s[u] = b < nb ? __ldg(sr + b) : 0u;
      }
#pragma unroll
      for (int u = 0; u < U; u++) {
        const u32 b = b0 + 32 * u;
        const u32 cw[4] = {c4[u].x, c4[u].y, c4[u].z, c4[u].w};
        if (b < nb) fold_block(orow + 2 * b, cw, (s[u] == 0xFFu ? -127 : (int)s[u] - 127) - emax);
      }
    }
    if (lane == 0) rowscale[row] = nan ? __uint_as_float(0x7FFFFFFFu) : exp2i(emax);
  }
}

// ---------------------------------------------------------------------------------------------
// quant_rows_fold<SRC, RULE, RND>: MXFP4 quant_rows (G = 32) that also emits the Hopper fold, so
// the fp8 GEMM needs no fold_mx pass. blockDim = (threads a row: K/32 rounded up to a warp
// multiple, <= 1024; rows a CTA); one thread a 32-block; the CTAs (about one resident wave, see
// fp4._quant_rows_fold) loop over row groups. The row's block-exponent max goes through a warp
// reduction and a shared atomicMax (two buffers, alternating: two barriers an iteration); codes,
// scales and mask are written as by quant_rows. Called by fp4._quant_launch
// (fp4.quantize(..., fold=True) on a GPU).

template <int SRC, int RULE, int RND, int HH, bool SG>
__device__ __forceinline__ void rows_fold_loop(const void* __restrict__ x, u32 R, u32 K, const QParams& p,
                                               u8* __restrict__ f8, float* __restrict__ rowscale,
                                               int (&red_e)[2][32], int (&red_nan)[2][32]) {
  const u32 tx = threadIdx.x, ty = threadIdx.y;
  u32 buf = 0;
  for (u32 r0 = blockIdx.x * blockDim.y; r0 < R; r0 += gridDim.x * blockDim.y, buf ^= 1u) {
    const u32 row = r0 + ty;
    const bool active = row < R && tx < K / 32;
    if (tx == 0) { red_e[buf][ty] = -127; red_nan[buf][ty] = 0; }  // its readers of two trips ago are past a barrier
    u32 cw[4];
    int e = -127;
    if (active) {
      float v[32];
      load_dense<SRC, 32>(v, x, (u64)row * K + tx * 32);
      if constexpr (HH > 0) rotate_h<32, HH, SG>(v, p);
      quant_group_mx<32, RULE, RND>(v, p, (u64)row * K + tx * 32, cw, &e);
    }
    int em = (active && e != -128) ? e : -127, nan = active && e == -128;
    em = __reduce_max_sync(0xFFFFFFFFu, em);  // a warp never spans two rows (blockDim.x % 32 == 0)
    nan = __reduce_or_sync(0xFFFFFFFFu, nan);
    __syncthreads();  // red_*[buf] initialised
    if ((tx & 31) == 0) { atomicMax(&red_e[buf][ty], em); atomicOr(&red_nan[buf][ty], nan); }
    __syncthreads();
    if (active) {
      const int emax = red_e[buf][ty];
      fold_block(reinterpret_cast<uint4*>(f8 + (u64)row * K) + 2 * tx, cw, (e == -128 ? -127 : e) - emax);
      if (tx == 0) rowscale[row] = red_nan[buf][ty] ? __uint_as_float(0x7FFFFFFFu) : exp2i(emax);
    }
  }
}

template <int SRC, int RULE, int RND>
__global__ void __launch_bounds__(1024) quant_rows_fold(
    const void* __restrict__ x, u32 R, u32 K, int H, float hs, int has_signs, u32 s0, u32 s1, u32 s2, u32 s3,
    u32 seed, u32 key0, const u32* __restrict__ dseed, u8* __restrict__ codes, u8* __restrict__ scales,
    u8* __restrict__ mask, u8* __restrict__ f8, float* __restrict__ rowscale) {
  device_rng(dseed, has_signs, s0, s1, s2, s3, seed, key0);
  __shared__ int red_e[2][32], red_nan[2][32];  // per row of the CTA (blockDim.y <= 32), two trips
  QParams p;
  p.H = H; p.hs = hs; p.seed = seed; p.key0 = key0; p.pass = 0;
  p.codes = codes; p.scales = scales; p.mask = mask; p.g = nullptr; p.amax = nullptr; p.tiles = nullptr;
  p.Kout = K;
  load_signs(p, has_signs, s0, s1, s2, s3);
  if (H == 32) {  // one loop per (Hadamard size, signs), as in mx_rows
    if (p.has_signs) rows_fold_loop<SRC, RULE, RND, 32, true>(x, R, K, p, f8, rowscale, red_e, red_nan);
    else rows_fold_loop<SRC, RULE, RND, 32, false>(x, R, K, p, f8, rowscale, red_e, red_nan);
  } else if (H == 16) {
    if (p.has_signs) rows_fold_loop<SRC, RULE, RND, 16, true>(x, R, K, p, f8, rowscale, red_e, red_nan);
    else rows_fold_loop<SRC, RULE, RND, 16, false>(x, R, K, p, f8, rowscale, red_e, red_nan);
  } else {
    rows_fold_loop<SRC, RULE, RND, 0, false>(x, R, K, p, f8, rowscale, red_e, red_nan);
  }
}

// ---------------------------------------------------------------------------------------------
// rotate_back<SRC, G>: fp4.rotate_back_reference, the quartet backward's straight-through step: (d * clip
// mask) H_G per G-group along the last dim of a row-major (R, K) d, written in d's dtype (SRC 0
// f32, 1 bf16, 2 f16). One thread a G-group (G a multiple of 32): one pass instead of a mask
// unpack, a multiply and a GEMM with H. Called by linear._rotate_back (cuda_kernels.rotate_back).

template <int SRC, int G>
__device__ __forceinline__ void store_dense(void* dst, u64 off, const float (&x)[G]) {
  if constexpr (SRC == 0) {
    float4* o = reinterpret_cast<float4*>(reinterpret_cast<float*>(dst) + off);
#pragma unroll
    for (int i = 0; i < G / 4; i++) o[i] = make_float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
  } else {
    uint4* o = reinterpret_cast<uint4*>(reinterpret_cast<unsigned short*>(dst) + off);
#pragma unroll
    for (int i = 0; i < G / 8; i++) {
      u32 w[4];
#pragma unroll
      for (int k = 0; k < 4; k++) {
        if constexpr (SRC == 1) {
          __nv_bfloat162 h = __floats2bfloat162_rn(x[8 * i + 2 * k], x[8 * i + 2 * k + 1]);
          w[k] = *reinterpret_cast<u32*>(&h);
        } else {
          __half2 h = __floats2half2_rn(x[8 * i + 2 * k], x[8 * i + 2 * k + 1]);
          w[k] = *reinterpret_cast<u32*>(&h);
        }
      }
      o[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

template <int SRC, int G>
__global__ void __launch_bounds__(256) rotate_back(const void* __restrict__ d, const u8* __restrict__ mask,
                                                   u32 R, u32 K, float hs, void* __restrict__ out) {
  QParams p;
  p.H = G; p.hs = hs; p.has_signs = 0;
  const u64 n = (u64)R * (K / G);
  for (u64 gi = (u64)blockIdx.x * blockDim.x + threadIdx.x; gi < n; gi += (u64)gridDim.x * blockDim.x) {
    const u64 off = gi * G;  // == row * K + col: groups never straddle rows
    float v[G];
    load_dense<SRC, G>(v, d, off);
#pragma unroll
    for (int c = 0; c < G / 32; c++) {
      u32 mw = __ldg(reinterpret_cast<const u32*>(mask + off / 8) + c);
#pragma unroll
      for (int i = 0; i < 32; i++) v[32 * c + i] = __fmul_rn(v[32 * c + i], (mw >> i) & 1u ? 1.0f : 0.0f);
    }
    rotate<G>(v, p);
    store_dense<SRC, G>(out, off, v);
  }
}

// ---------------------------------------------------------------------------------------------
// dequant: QTensor -> (R, K) in the QTensor layout. One thread per 8 codes.

template <int OUT>
__global__ void __launch_bounds__(256) dequant(const u8* __restrict__ codes, const u8* __restrict__ scales,
                                               const float* __restrict__ g, u32 R, u32 K, int nv, void* __restrict__ out) {
  const u64 n = (u64)R * K / 8;
  const u32 bs = nv ? 16 : 32;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    u64 e0 = i * 8;  // element index; blocks never straddle rows (K % bs == 0)
    u32 c = __ldg(reinterpret_cast<const u32*>(codes) + i);
    u32 sb = __ldg(scales + e0 / bs);
    float s, g2 = 1.0f;
    if (nv) { s = e4m3_dec(sb); g2 = *g; }
    else s = sb == 0xFFu ? __uint_as_float(0x7FFFFFFFu) : exp2i((int)sb - 127);
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
      float d = __fmul_rn(e2m1_dec((c >> (4 * k)) & 15u), s);
      v[k] = nv ? __fmul_rn(d, g2) : d;
    }
    if constexpr (OUT == 0) {
      float4* o = reinterpret_cast<float4*>(out) + 2 * i;
      o[0] = make_float4(v[0], v[1], v[2], v[3]);
      o[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      u32 w[4];
#pragma unroll
      for (int k = 0; k < 4; k++) {
        if constexpr (OUT == 1) {
          __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
          w[k] = *reinterpret_cast<u32*>(&h);
        } else {
          __half2 h = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
          w[k] = *reinterpret_cast<u32*>(&h);
        }
      }
      reinterpret_cast<uint4*>(out)[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Instantiations for plain nvcc (CI's compile check builds a cubin of this file). NVRTC skips
// them: fp4.py instantiates what it launches through CuPy's name_expressions.
#ifndef __CUDACC_RTC__
template __global__ void quant_rows<1, 8, false, 1, 0>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<1, 8, false, 0, 1>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<1, 8, false, 0, 0>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<1, 32, false, 0, 0>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<0, 8, false, 0, 0>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<1, 32, false, 1, 0>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<1, 32, false, 0, 1>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<0, 128, true, 0, 2>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<1, 128, true, 0, 2, 4>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<0, 128, true, 0, 1, 4>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<2, 16, true, 2, 0>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows<1, 16, true, 0, 1>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_cols<1, 32, false, 0, 1>(const void*, const u8*, const float*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_cols<3, 32, false, 0, 1>(const void*, const u8*, const float*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_cols<0, 64, false, 1, 0>(const void*, const u8*, const float*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_cols<1, 128, true, 0, 2, 4>(const void*, const u8*, const float*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_cols<4, 128, true, 0, 2, 4>(const void*, const u8*, const float*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_cols<0, 128, true, 2, 0, 4>(const void*, const u8*, const float*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, int, u8*, u8*, u8*, const float*, u32*, u32*);
template __global__ void quant_rows_fold<1, 1, 0>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, u8*, u8*, u8*, u8*, float*);
template __global__ void quant_rows_fold<1, 0, 1>(const void*, u32, u32, int, float, int, u32, u32, u32, u32, u32, u32, const u32*, u8*, u8*, u8*, u8*, float*);
template __global__ void nv_amax<1, 0, 0>(const void*, u32, u32, float, int, u32, u32, u32, u32, const u32*, u32*);
template __global__ void nv_amax<0, 0, 0>(const void*, u32, u32, float, int, u32, u32, u32, u32, const u32*, u32*);
template __global__ void nv_amax<2, 16, 0>(const void*, u32, u32, float, int, u32, u32, u32, u32, const u32*, u32*);
template __global__ void nv_amax<1, 16, 0>(const void*, u32, u32, float, int, u32, u32, u32, u32, const u32*, u32*);
template __global__ void nv_amax<1, 0, 2>(const void*, u32, u32, float, int, u32, u32, u32, u32, const u32*, u32*);
template __global__ void nv_amax<0, 0, 1>(const void*, u32, u32, float, int, u32, u32, u32, u32, const u32*, u32*);
template __global__ void nv_amax<1, 16, 2>(const void*, u32, u32, float, int, u32, u32, u32, u32, const u32*, u32*);
template __global__ void nv_amax<0, 16, 1>(const void*, u32, u32, float, int, u32, u32, u32, u32, const u32*, u32*);
template __global__ void nv_amax<2, 0, 1>(const void*, u32, u32, float, int, u32, u32, u32, u32, const u32*, u32*);
template __global__ void rotate_back<1, 32>(const void*, const u8*, u32, u32, float, void*);
template __global__ void rotate_back<0, 32>(const void*, const u8*, u32, u32, float, void*);
template __global__ void dequant<0>(const u8*, const u8*, const float*, u32, u32, int, void*);
template __global__ void dequant<1>(const u8*, const u8*, const float*, u32, u32, int, void*);
template __global__ void dequant<2>(const u8*, const u8*, const float*, u32, u32, int, void*);
#endif
#endif  // FP4_HOST_EMU

// ---------------------------------------------------------------------------------------------
// AdamW with NVFP4 states (SPEC 8.1): optim._adamw_nvfp4_kernel launches it, twice per parameter
// tensor; its twin is optim.adamw_nvfp4_reference between optim.dequantize_state and
// optim.quantize_state, bit for bit.
//   adamw_nvfp4<H, RNDM, RNDV, CLAMP, MEAN>  Dequantizes both states (code * E4M3 scale * tensor scale,
//       inverse Hadamard-H, + the per-block mean of sqrt(v), clamp >= 0, square), updates m and v
//       in FP32 (one rounding an operation, optim's order), projects m onto |m| <= C sqrt(v)
//       (CLAMP), steps the parameter, and re-quantizes m and sqrt(v) - mean, rotated by H, to NVFP4
//       absmax with roundings RNDM, RNDV (quant_group_nv, as fp4.quantize). The NVFP4 tensor scale needs
//       the new states' amax first, so pass 1 recomputes the update and only max-reduces the two
//       amaxes; pass 0 recomputes it (same bits) and writes the parameter, codes, scales, means and
//       the two new tensor scales (to g_out: the old ones are still being read).
//       A thread holds E = adamw_elems<H, MEAN> consecutive elements (32; 16 for H < 32 without the
//       mean); a 128-block of the mean spans 4 lanes, an H-block H / E (lane q), whose butterfly
//       stages and mean sums go through shfl_xor_all. adamw_group is the per-thread math. The whole
//       kernel also builds as host C++ (FP4_HOST_EMU with FP4_HOST_EMU_ADAMW, whose harness brings
//       shfl_xor_all, __syncthreads and the grid): test_optim.py::test_emulated_kernel_matches_reference
//       runs optim's own launches of it on the CPU against the reference, bit for bit.
#if !defined(FP4_HOST_EMU) || defined(FP4_HOST_EMU_ADAMW)

template <int H, bool MEAN>  // elements a thread (the launcher's n = numel / E)
constexpr int adamw_elems = MEAN || H >= 32 ? 32 : 16;

struct AdamArgs {
  u32 K;                    // the parameter's last dim (rows of the states' (R, K) view)
  u8 *mc, *ms, *vc, *vs;    // m and sqrt(v) state codes (R, K/2) and scales (R, K/16), updated in place
  const float *mg, *vg;     // their old tensor scales
  float* vmean;             // (R, K/128) means of sqrt(v), updated in place, or null (no mean)
  const float* g_new;       // pass 0: the new tensor scales [m, v]
  u32* amax;                // pass 1: the new states' finite amax bits [m, v]
  float b1, omb1, b2, omb2, clampc, bc2s, eps, neg_step, decay, hs;  // optim._nvfp4_scalars, 1/sqrt(H)
  u32 seed_m, key_m, seed_v, key_v;  // SR seeds and key(seed, 0)
  int pass;                 // 1: amax only; 0: write
};

template <int E>  // E dequantized elements of an NVFP4 state from element base on: (code * s) * g
__device__ __forceinline__ void state_load(float (&x)[E], const u8* codes, const u8* scales, float g, u64 base) {
  u32 w[E / 8];
  if constexpr (E == 16) {
    const uint2 t = *reinterpret_cast<const uint2*>(codes + base / 2);
    w[0] = t.x; w[1] = t.y;
  } else {
    const uint4 t = *reinterpret_cast<const uint4*>(codes + base / 2);
    w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
  }
#pragma unroll
  for (int b = 0; b < E / 16; b++) {
    const float s = e4m3_dec(scales[base / 16 + b]);
#pragma unroll
    for (int i = 0; i < 16; i++)
      x[16 * b + i] = __fmul_rn(__fmul_rn(e2m1_dec((w[2 * b + i / 8] >> (4 * (i % 8))) & 15u), s), g);
  }
}

#ifndef FP4_HOST_EMU  // the host emulation exchanges whole arrays between its lane threads
template <int E>  // y[i] = x[i] of the lane whose index differs by m
__device__ __forceinline__ void shfl_xor_all(float (&y)[E], const float (&x)[E], int m) {
#pragma unroll
  for (int i = 0; i < E; i++) y[i] = shfl_xor(x[i], m);
}
#endif

// fp4._fwht on an H-block spread over H / E lanes: strides below E in the thread, the others with
// the lane whose index differs in that bit (the lower element of a pair keeps a + b), then 1/sqrt(H).
template <int E, int H>
__device__ __forceinline__ void state_hadamard(float (&x)[E], float hs, u32 q) {
#pragma unroll
  for (int h = 1; h < (H < E ? H : E); h <<= 1) {
#pragma unroll
    for (int i = 0; i < E; i++) {
      if (!(i & h)) {
        const float a = x[i], b = x[i + h];
        x[i] = __fadd_rn(a, b);
        x[i + h] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int l = 1; l < H / E; l <<= 1) {
    const bool upper = q & l;
    float y[E];
    shfl_xor_all<E>(y, x, l);
#pragma unroll
    for (int i = 0; i < E; i++) x[i] = upper ? __fsub_rn(y[i], x[i]) : __fadd_rn(x[i], y[i]);
  }
#pragma unroll
  for (int i = 0; i < E; i++) x[i] = __fmul_rn(x[i], hs);
}

// The halving-tree sum of an H-block spread over H / E lanes (fp4._tree_sum), in every lane: the
// stage j + H/2 pairs lanes q, q ^ (H/E/2), ... down to E; then the thread's own tree.
template <int E, int H>
__device__ __forceinline__ float state_block_sum(const float (&x)[E]) {
  float t[E];
#pragma unroll
  for (int i = 0; i < E; i++) t[i] = x[i];
#pragma unroll
  for (int l = H / E / 2; l >= 1; l >>= 1) {
    float y[E];
    shfl_xor_all<E>(y, t, l);
#pragma unroll
    for (int i = 0; i < E; i++) t[i] = __fadd_rn(t[i], y[i]);
  }
  return tree_sum<E>(t);
}

__device__ __forceinline__ float state_tensor_scale(u32 amax_bits) {  // fp4._tensor_scale
  const float a = __uint_as_float(amax_bits);
  return a > 0.0f ? __fdiv_rn(a, 2688.0f) : 1.0f;  // amax / (6 * 448)
}

// One thread's E elements from element base on (lane q of its H-block): gr the gradient, x the
// parameter (stepped in place in pass 0). valid = false: only feeds the lanes' shuffles.
template <int E, int H, int RNDM, int RNDV, bool CLAMP, bool MEAN>
__device__ __forceinline__ void adamw_group(const float (&gr)[E], float (&x)[E], const AdamArgs& a, u64 base,
                                            u32 q, bool valid) {
  constexpr int HB = 128;  // optim.MEAN_BLOCK
  float m[E], v[E];
  state_load<E>(m, a.mc, a.ms, *a.mg, base);
  state_load<E>(v, a.vc, a.vs, *a.vg, base);
  const float mu_old = MEAN ? a.vmean[base / HB] : 0.0f;
  if constexpr (H > 0) {
    state_hadamard<E, H>(m, a.hs, q);
    state_hadamard<E, H>(v, a.hs, q);
  }
#pragma unroll
  for (int i = 0; i < E; i++) {
    m[i] = __fadd_rn(__fmul_rn(m[i], a.b1), __fmul_rn(gr[i], a.omb1));
    float s = MEAN ? __fadd_rn(v[i], mu_old) : v[i];
    s = s < 0.0f ? 0.0f : s;  // NaN stays NaN, as torch's clamp
    const float vn = __fadd_rn(__fmul_rn(__fmul_rn(s, s), a.b2), __fmul_rn(__fmul_rn(gr[i], gr[i]), a.omb2));
    v[i] = __fsqrt_rn(vn);  // from here on v holds sqrt(v)
    if (CLAMP) {
      const float bd = __fmul_rn(v[i], a.clampc);
      m[i] = m[i] > bd ? bd : (m[i] < -bd ? -bd : m[i]);
    }
    if (a.pass == 0) {
      const float u = __fdiv_rn(m[i], __fadd_rn(__fdiv_rn(v[i], a.bc2s), a.eps));
      x[i] = __fadd_rn(__fmul_rn(x[i], a.decay), __fmul_rn(u, a.neg_step));
    }
  }
  float mu = 0.0f;
  if constexpr (MEAN) {
    mu = __fmul_rn(state_block_sum<E, HB>(v), 1.0f / HB);
#pragma unroll
    for (int i = 0; i < E; i++) v[i] = __fsub_rn(v[i], mu);
  }
  if constexpr (H > 0) {
    state_hadamard<E, H>(m, a.hs, q);
    state_hadamard<E, H>(v, a.hs, q);
  }
  if (!valid) return;  // (the shuffles above ordered every lane's read of the old mean before the write)
  const u32 orow = (u32)(base / a.K), ocol = (u32)(base % a.K);
  QParams pm = {};
  pm.pass = a.pass; pm.codes = a.mc; pm.scales = a.ms; pm.g = a.g_new; pm.amax = a.amax; pm.Kout = a.K;
  pm.seed = a.seed_m; pm.key0 = a.key_m;
  quant_group_nv<E, RULE_ABSMAX, RNDM>(m, pm, orow, ocol);
  QParams pv = pm;
  pv.codes = a.vc; pv.scales = a.vs; pv.g = a.g_new + 1; pv.amax = a.amax + 1; pv.seed = a.seed_v; pv.key0 = a.key_v;
  quant_group_nv<E, RULE_ABSMAX, RNDV>(v, pv, orow, ocol);
  if (MEAN && a.pass == 0 && q == 0) a.vmean[base / HB] = mu;
}

template <int H, int RNDM, int RNDV, bool CLAMP, bool MEAN>
__global__ void __launch_bounds__(256) adamw_nvfp4(
    float* __restrict__ p, const float* __restrict__ grad, u32 n, u32 K,
    u8* mc, u8* ms, const float* mg, u8* vc, u8* vs, const float* vg, float* vmean,
    float b1, float omb1, float b2, float omb2, float clampc, float bc2s, float eps, float neg_step,
    float decay, float hs, u32 seed_m, u32 key_m, u32 seed_v, u32 key_v, int pass, u32* amax, float* g_out) {
  constexpr int E = adamw_elems<H, MEAN>;
  constexpr int LANES = MEAN ? 128 / E : (H > E ? H / E : 1);  // lanes of a mean or Hadamard block
  __shared__ float gsh[2];
  if (pass == 0) {  // the new tensor scales, from pass 1's amaxes
    if (threadIdx.x == 0) {
      gsh[0] = state_tensor_scale(amax[0]);
      gsh[1] = state_tensor_scale(amax[1]);
      if (blockIdx.x == 0) { g_out[0] = gsh[0]; g_out[1] = gsh[1]; }
    }
    __syncthreads();
  }
  const AdamArgs a = {K, mc, ms, vc, vs, mg, vg, vmean, gsh, amax, b1, omb1, b2, omb2, clampc, bc2s, eps,
                      neg_step, decay, hs, seed_m, key_m, seed_v, key_v, pass};
  const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
  const bool valid = t < n;  // the rest of the last warp only feeds its lanes' shuffles
  const u64 base = (u64)(valid ? t : 0) * E;
  float gr[E], x[E];
  load_dense<0, E>(gr, grad, base);
  if (pass == 0) load_dense<0, E>(x, p, base);
  adamw_group<E, H, RNDM, RNDV, CLAMP, MEAN>(gr, x, a, base, threadIdx.x & (LANES - 1), valid);
  if (pass == 0 && valid) {
    float4* dst = reinterpret_cast<float4*>(p + base);
#pragma unroll
    for (int i = 0; i < E / 4; i++) dst[i] = make_float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
  }
}

#if !defined(__CUDACC_RTC__) && !defined(FP4_HOST_EMU)  // plain nvcc (CI's compile check); NVRTC
// instantiates what optim launches, the host emulation what its harness lists
#define ADAMW_NVFP4_ARGS float*, const float*, u32, u32, u8*, u8*, const float*, u8*, u8*, const float*, float*, \
  float, float, float, float, float, float, float, float, float, float, u32, u32, u32, u32, int, u32*, float*
template __global__ void adamw_nvfp4<128, 1, 1, true, true>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<128, 0, 0, true, true>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<128, 1, 0, true, true>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<64, 1, 1, true, true>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<32, 1, 1, true, true>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<16, 1, 1, true, true>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<0, 1, 1, true, false>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<0, 0, 0, true, false>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<0, 1, 0, true, false>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<0, 1, 1, true, true>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<128, 1, 1, false, true>(ADAMW_NVFP4_ARGS);
template __global__ void adamw_nvfp4<128, 1, 1, true, false>(ADAMW_NVFP4_ARGS);
#undef ADAMW_NVFP4_ARGS
#endif
#endif  // !FP4_HOST_EMU || FP4_HOST_EMU_ADAMW
