"""
kernels.cu's device math on the CPU: built as C++ with FP4_HOST_EMU (g++), warp shuffles between
4 host threads (one lane quad), against the PyTorch reference in fp4.py bit for bit. Runs without
a GPU; test_kernels.py runs the same kernels on one.

$ python -m pytest test_kernels_host.py -q
"""
import shutil
import subprocess

import pytest
import torch

import formats
import fp4
import cuda_kernels as kernels
from test_kernels import KERNELS_CU, assert_same

# Host emulation (CPU, g++): kernels.cu's device math built as C++ with FP4_HOST_EMU, warp shuffles
# between 4 host threads (one lane quad), against the PyTorch reference bit for bit. Covers the
# warp-cooperative MXFP4 rows path (mx_chunk), the one-thread-per-group path (quant_group) and the
# quad NVFP4 128-group paths of quant_rows (nvq_group) and quant_cols (nvq_col on emulated tiles).
EMU_CPP = r"""
// Host emulation of kernels.cu's MXFP4 paths: the device functions compiled as host C++, warp
// shuffles between 4 host threads (one per lane of a quad) through a blocking barrier (a spinning
// one starved when the 4 threads shared 2 busy cores: one case took > 120 s instead of 0.1 s).
#include <algorithm>
#include <cfenv>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#include <string>
#define FP4_HOST_EMU
#define __device__
#define __host__
#define __forceinline__ inline
using std::max;
using std::min;
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
static inline float __uint2float_rn(unsigned u) { return (float)u; }
static inline float __fadd_ru(float a, float b) { fesetround(FE_UPWARD); volatile float r = a + b; fesetround(FE_TONEAREST); return r; }
static inline float __fadd_rd(float a, float b) { fesetround(FE_DOWNWARD); volatile float r = a + b; fesetround(FE_TONEAREST); return r; }
static inline float __fmaf_ru(float a, float b, float c) { fesetround(FE_UPWARD); volatile float r = __builtin_fmaf(a, b, c); fesetround(FE_TONEAREST); return r; }
static inline float __fmaf_rd(float a, float b, float c) { fesetround(FE_DOWNWARD); volatile float r = __builtin_fmaf(a, b, c); fesetround(FE_TONEAREST); return r; }
static inline unsigned __float2uint_rz(float a) { return (unsigned)a; }
static inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  return (unsigned)(((((unsigned long long)hi << 32) | lo) << (s & 31)) >> 32);
}

struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
static inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static std::mutex atomic_m;  // the quad's 4 host threads share the pre-pass amax
template <class T> static inline T atomicMax(T* p, T v) {
  std::lock_guard<std::mutex> lock(atomic_m);
  T o = *p; *p = std::max(o, v); return o;
}

// quad emulation
static thread_local int t_lane = 0;
static std::mutex bar_m;
static std::condition_variable bar_cv;
static int bar_count = 0, bar_gen = 0;
static float slot[4];
static int pslot[4];
static void barrier() {  // the mutex also orders the slot writes before the reads after it
  std::unique_lock<std::mutex> lock(bar_m);
  int gen = bar_gen;
  if (++bar_count == 4) { bar_count = 0; ++bar_gen; bar_cv.notify_all(); }
  else bar_cv.wait(lock, [gen] { return bar_gen != gen; });
}
static float shfl_xor(float v, int m) { slot[t_lane] = v; barrier(); float r = slot[t_lane ^ m]; barrier(); return r; }
static bool any_sync(bool p) { pslot[t_lane] = p; barrier(); bool r = pslot[0] | pslot[1] | pslot[2] | pslot[3]; barrier(); return r; }

#include KERNELS_CU_PATH

struct Job { int R, K, rule, rnd, H, has_signs; unsigned s0, seed; float hs; const float* x; u8 *codes, *scales, *mask;
             unsigned s1 = 0, s2 = 0, s3 = 0; };

template <int RULE, int RND>
static void run_quad(const Job& j) {
  std::vector<std::thread> th;
  for (int q = 0; q < 4; q++) th.emplace_back([&, q] {
    t_lane = q;
    MxArgs a;
    a.H = j.H; a.hs = j.hs; a.seed = j.seed; a.key0 = hash_key(j.seed, 0);
    a.codes = j.codes; a.scales = j.scales; a.mask = j.mask;
    mx_lane_signs(a, q, j.has_signs, j.s0, j.H);
    uint64_t ng = (uint64_t)j.R * j.K / 32;
    for (uint64_t g = 0; g < ng; g++) {
      uint64_t c = 4 * g + q;
      float v[8];
      for (int i = 0; i < 8; i++) v[i] = j.x[8 * c + i];
      mx_chunk<RULE, RND>(v, a, q, c, true);
    }
  });
  for (auto& t : th) t.join();
}

template <int RULE, int RND>
static void run_t1(const Job& j) {
  QParams p;
  p.H = j.H; p.hs = j.hs; p.seed = j.seed; p.key0 = hash_key(j.seed, 0); p.pass = 0;
  p.codes = j.codes; p.scales = j.scales; p.mask = j.mask; p.Kout = j.K;
  load_signs(p, j.has_signs, j.s0, 0, 0, 0);
  for (int r = 0; r < j.R; r++)
    for (int c = 0; c < j.K; c += 32) {
      float v[32];
      for (int i = 0; i < 32; i++) v[i] = j.x[(uint64_t)r * j.K + c + i];
      quant_group<32, false, RULE, RND>(v, p, r, c);
    }
}

// The NVFP4 kernels' parameters for job j (quantized axis of length kout), signs loaded.
static QParams nv_params(const Job& j, u32 kout, u32* amax, float* g) {
  QParams p;
  p.H = j.H; p.hs = j.hs; p.seed = j.seed; p.key0 = hash_key(j.seed, 0);
  p.codes = j.codes; p.scales = j.scales; p.mask = nullptr; p.Kout = kout; p.g = g; p.amax = amax; p.tiles = nullptr;
  load_signs(p, j.has_signs, j.s0, j.s1, j.s2, j.s3);
  return p;
}

// NVFP4, one thread a G-group (quant_group, as quant_rows runs it): the tensor-amax pre-pass over
// every group, g = amax / (6 * 448) as kernels.py divides (1 if 0), then the quantize pass.
template <int G, int RULE, int RND>
static void run_nv(const Job& j) {
  u32 amax = 0;
  float g = 0.0f;
  QParams p = nv_params(j, j.K, &amax, &g);
  for (int pass = 1; pass >= 0; pass--) {
    p.pass = pass;
    if (pass == 0) { float a = __uint_as_float(amax); g = a > 0.0f ? a / (6.0f * 448.0f) : 1.0f; }
    for (int r = 0; r < j.R; r++)
      for (int c = 0; c < j.K; c += G) {
        float v[G];
        for (int i = 0; i < G; i++) v[i] = j.x[(uint64_t)r * j.K + c + i];
        quant_group<G, true, RULE, RND>(v, p, r, c);
      }
  }
}

// NVFP4 128-groups, a lane quad a group (nvq_group, as quant_rows<..., 128, true, ..., 4> runs it):
// lane q of group gi holds elements 32 (4 gi + q) .. + 31; a trailing quad past the end (valid =
// false: zeros in, nothing may be stored) in each pass, like the grid's tail.
template <int RULE, int RND>
static void run_nvquad(const Job& j) {
  u32 amax = 0;
  std::vector<std::thread> th;
  for (int q = 0; q < 4; q++) th.emplace_back([&, q] {
    t_lane = q;
    float g = 0.0f;
    QParams p = nv_params(j, j.K, &amax, &g);
    nvq_lane_signs(p, q);
    const uint64_t ng = (uint64_t)j.R * j.K / 128;
    for (int pass = 1; pass >= 0; pass--) {
      p.pass = pass;
      barrier();  // every lane's pre-pass atomics are in before g is read
      if (pass == 0) { float a = __uint_as_float(amax); g = a > 0.0f ? a / (6.0f * 448.0f) : 1.0f; }
      for (uint64_t gi = 0; gi <= ng; gi++) {
        const bool valid = gi < ng;
        const uint64_t e0 = valid ? 32 * (4 * gi + q) : 32 * q;
        float v[32];
        for (int i = 0; i < 32; i++) v[i] = valid ? j.x[e0 + i] : 0.0f;
        nvq_group<RULE, RND>(v, p, q, (u32)(e0 / j.K), (u32)(e0 % j.K), valid);
      }
    }
  });
  for (auto& t : th) t.join();
}

// quant_cols' quad layout (quant_cols<SRC, 128, true, RULE, RND, 4> on an (R, K) input, quantized
// along R, output (K, R)): each 128 x 32 tile built as load_tile (dense: x, the row's sign bit
// xored in) or store_chunk (an NVFP4 QTensor's codes qc (R, K/2) and scales qs (R, K/16): (code *
// +-scale) * gin) build it, at tile_at<4>'s offsets, then nvq_col on the tile's 32 columns; 4 host
// threads as the lanes of one quad step through the columns (the GPU runs 32 quads at once), the
// columns past K (valid = false) too; the pre-pass over every tile, then the quantize pass.
template <int RULE, int RND>
static void run_nvqcols(const Job& j, const u8* qc, const u8* qs, float gin) {
  u32 amax = 0;
  std::vector<std::thread> th;
  for (int q = 0; q < 4; q++) th.emplace_back([&, q] {
    t_lane = q;
    float g = 0.0f;
    QParams p = nv_params(j, j.R, &amax, &g);  // output (K, R): the quantized axis is R
    const RowSigns sw = {{p.sw[0], p.sw[1], p.sw[2], p.sw[3]}, p.has_signs != 0};
    p.has_signs = 0;  // applied in the tile
    std::vector<float> tile(TILE_FLOATS(4), 0.0f);
    for (int pass = 1; pass >= 0; pass--) {
      p.pass = pass;
      barrier();
      if (pass == 0) { float a = __uint_as_float(amax); g = a > 0.0f ? a / (6.0f * 448.0f) : 1.0f; }
      for (int r0 = 0; r0 < j.R; r0 += TILE_R)
        for (int c0 = 0; c0 < j.K; c0 += TILE_C) {
          for (int rr = 0; rr < TILE_R; rr++)
            for (int cc = 0; cc < TILE_C; cc++) {
              const uint64_t r = r0 + rr, c = c0 + cc, e = r * j.K + c;
              const u32 sg = row_sign<128>(sw, rr);
              float v = 0.0f;
              if (c < (uint64_t)j.K && qc) {
                const float s = __uint_as_float(__float_as_uint(e4m3_dec(qs[e / 16])) ^ sg);
                v = __fmul_rn(__fmul_rn(e2m1_dec((qc[e / 2] >> (4 * (e & 1))) & 15u), s), gin);
              } else if (c < (uint64_t)j.K) {
                v = __uint_as_float(__float_as_uint(j.x[e]) ^ sg);
              }
              tile[tile_at<4>(rr, cc)] = v;
            }
          for (u32 cl = 0; cl < TILE_C; cl++)
            nvq_col<RULE, RND>(tile.data(), p, q, cl, c0 + cl, r0, c0 + cl < (u32)j.K);
        }
    }
  });
  for (auto& t : th) t.join();
}

// nv_amax (kernels.cu, "NVFP4 tensor amax"): every thread t of an nt-thread grid through
// nv_amax_thread, on the input's raw bits (FP32, BF16 or FP16: the kernel's own loads and
// conversions), into one amax word as the kernel's atomics (nv_amax_atomic's host branch).
template <int SRC, int H, int V>
static void run_nvamax(const void* x, u32 R, u32 K, float hs, int has_signs, u32 s0, u32 nt, u32* amax) {
  for (u32 t = 0; t < nt; t++) nv_amax_thread<SRC, H, V>(x, R, K, hs, has_signs, s0, 0u, 0u, 0u, amax, t, nt);
}

static int main_nvamax(int argc, char** argv) {
  if (argc < 12) { fprintf(stderr, "usage: nvamax R K src H V has_signs s0 hs nt dir\n"); return 2; }
  const u32 R = strtoul(argv[2], 0, 0), K = strtoul(argv[3], 0, 0);
  const int src = atoi(argv[4]), H = atoi(argv[5]), V = atoi(argv[6]), has_signs = atoi(argv[7]);
  const u32 s0 = strtoul(argv[8], 0, 0), nt = strtoul(argv[10], 0, 0);
  const float hs = strtof(argv[9], 0);
  const std::string dir = argv[11];
  const size_t bytes = (size_t)R * K * (src == 0 ? 4 : 2);
  std::vector<uint4> x((bytes + 15) / 16);  // 16-byte aligned, as the launcher checks
  FILE* f = fopen((dir + "/x.bin").c_str(), "rb");
  if (!f || fread(x.data(), 1, bytes, f) != bytes) { fprintf(stderr, "nvamax: x.bin holds fewer than %zu bytes\n", bytes); return 2; }
  fclose(f);
  u32 amax = 0;
  bool ran = false;
#define RUN_NVA(S_, H_, V_) \
  if (src == S_ && H == H_ && V == V_) { run_nvamax<S_, H_, V_>(x.data(), R, K, hs, has_signs, s0, nt, &amax); ran = true; }
  RUN_NVA(0, 0, 0) RUN_NVA(1, 0, 0) RUN_NVA(2, 0, 0) RUN_NVA(0, 16, 0) RUN_NVA(1, 16, 0) RUN_NVA(2, 16, 0)
  RUN_NVA(0, 0, 1) RUN_NVA(1, 0, 1) RUN_NVA(2, 0, 1) RUN_NVA(1, 0, 2) RUN_NVA(2, 0, 2)
  RUN_NVA(0, 16, 1) RUN_NVA(1, 16, 1) RUN_NVA(2, 16, 1) RUN_NVA(1, 16, 2) RUN_NVA(2, 16, 2)
  if (!ran) { fprintf(stderr, "nvamax: no variant src %d H %d V %d\n", src, H, V); return 2; }
  f = fopen((dir + "/amax.bin").c_str(), "wb"); fwrite(&amax, 4, 1, f); fclose(f);
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 2 && !strcmp(argv[1], "nvamax")) return main_nvamax(argc, argv);
  if (argc < 12) { fprintf(stderr, "usage: mode R K rule rnd H has_signs s0 seed hs dir\n"); return 2; }
  Job j;
  const char* mode = argv[1];
  j.R = atoi(argv[2]); j.K = atoi(argv[3]); j.rule = atoi(argv[4]); j.rnd = atoi(argv[5]); j.H = atoi(argv[6]);
  j.has_signs = atoi(argv[7]); j.s0 = strtoul(argv[8], 0, 0); j.seed = strtoul(argv[9], 0, 0); j.hs = strtof(argv[10], 0);
  std::string dir = argv[11];
  if (argc >= 15) { j.s1 = strtoul(argv[12], 0, 0); j.s2 = strtoul(argv[13], 0, 0); j.s3 = strtoul(argv[14], 0, 0); }
  size_t n = (size_t)j.R * j.K;
  std::vector<float> x(n);
  FILE* f = fopen((dir + "/x.bin").c_str(), "rb"); fread(x.data(), 4, n, f); fclose(f);
  bool nv = !strcmp(mode, "nv") || !strcmp(mode, "nvquad") || !strcmp(mode, "nvqcols");
  std::vector<u8> codes(n / 2, 0xAA), scales(n / (nv ? 16 : 32), 0xAA), mask(n / 8, 0xAA);
  j.x = x.data(); j.codes = codes.data(); j.scales = scales.data(); j.mask = j.rule == 1 ? mask.data() : nullptr;
  bool quad = !strcmp(mode, "quad");
  if (!strcmp(mode, "nvqcols")) {  // argv 15: 0 dense x, 4 an NVFP4 QTensor (qcodes.bin, qscales.bin); 16: its g
    if (argc < 17) { fprintf(stderr, "nvqcols: ... s1 s2 s3 src gin\n"); return 2; }
    const bool qt = atoi(argv[15]) == 4;
    const float gin = strtof(argv[16], 0);
    std::vector<u8> qc(qt ? n / 2 : 0), qs(qt ? n / 16 : 0);
    if (qt) {
      f = fopen((dir + "/qcodes.bin").c_str(), "rb"); fread(qc.data(), 1, qc.size(), f); fclose(f);
      f = fopen((dir + "/qscales.bin").c_str(), "rb"); fread(qs.data(), 1, qs.size(), f); fclose(f);
    }
#define RUN_NVQC(R_, D_) if (j.rule == R_ && j.rnd == D_) run_nvqcols<R_, D_>(j, qt ? qc.data() : nullptr, qs.data(), gin);
    RUN_NVQC(0, 0) RUN_NVQC(0, 1) RUN_NVQC(0, 2) RUN_NVQC(2, 0)
  } else if (!strcmp(mode, "nvquad")) {
    if (std::max({16, j.H, j.rnd == 2 ? 128 : 0}) != 128) { fprintf(stderr, "nvquad needs 128-groups\n"); return 2; }
#define RUN_NVQ(R_, D_) if (j.rule == R_ && j.rnd == D_) run_nvquad<R_, D_>(j);
    RUN_NVQ(0, 0) RUN_NVQ(0, 1) RUN_NVQ(0, 2) RUN_NVQ(2, 0)
  } else if (nv) {
    const int G = std::max({16, j.H, j.rnd == 2 ? 128 : 0});
#define RUN_NV(G_, R_, D_) if (G == G_ && j.rule == R_ && j.rnd == D_) run_nv<G_, R_, D_>(j);
    RUN_NV(16, 0, 0) RUN_NV(16, 0, 1) RUN_NV(16, 2, 0) RUN_NV(128, 0, 0) RUN_NV(128, 0, 1) RUN_NV(128, 0, 2) RUN_NV(128, 2, 0)
  } else {
#define RUN(R_, D_) if (j.rule == R_ && j.rnd == D_) { if (quad) run_quad<R_, D_>(j); else run_t1<R_, D_>(j); }
    RUN(0, 0) RUN(0, 1) RUN(1, 0) RUN(1, 1)
  }
  f = fopen((dir + "/codes.bin").c_str(), "wb"); fwrite(codes.data(), 1, codes.size(), f); fclose(f);
  f = fopen((dir + "/scales.bin").c_str(), "wb"); fwrite(scales.data(), 1, scales.size(), f); fclose(f);
  f = fopen((dir + "/mask.bin").c_str(), "wb"); fwrite(mask.data(), 1, mask.size(), f); fclose(f);
  return 0;
}
"""

EMU_CASES = [  # (shape, dtype, rule, rounding, hadamard, signed)
    ((129, 160), torch.bfloat16, "quest", "rn", 32, False),
    ((64, 256), torch.float32, "quest", "rn", 0, False),
    ((100, 512), torch.float32, "quest", "rn", 32, True),
    ((129, 160), torch.float32, "absmax", "sr", 32, True),
    ((3, 128), torch.float16, "absmax", "rn", 16, True),
    ((65, 256), torch.bfloat16, "quest", "sr", 16, True),
    ((64, 256), torch.float32, "absmax", "rn", 0, False),
    ((100, 512), torch.float32, "absmax", "sr", 0, False),
]


@pytest.fixture(scope="module")
def emu_binary(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    d = tmp_path_factory.mktemp("emu")
    (d / "emu.cpp").write_text(EMU_CPP)
    cmd = ["g++", "-O2", "-std=c++17", "-mfma", "-ffp-contract=off", "-frounding-math", "-pthread",
           f'-DKERNELS_CU_PATH="{KERNELS_CU}"', "-o", str(d / "emu"), str(d / "emu.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 and "-mfma" in res.stderr:
        pytest.skip("host compiler without FMA")
    assert res.returncode == 0, res.stderr[-4000:]
    return d


def _emu_input(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 20, shape[:-1] + (1,), generator=gen).float())
    flat = x.view(-1)
    pick = torch.randint(0, flat.numel(), (26,), generator=gen)
    flat[pick[0]], flat[pick[1]], flat[pick[2]] = float("nan"), float("inf"), -float("inf")
    flat[pick[3:10]] = 1e-30
    flat[pick[10:14]] = 1e30
    flat[pick[14:18]] = -0.0
    flat[pick[18:22]] = -1e-40
    flat[pick[22:26]] = 3e38
    flat[:32] = 0.0
    if flat.numel() >= 256:
        flat[64:96] = 0.75  # constant block: QuEST's sigma == 0
        flat[96:128] = torch.tensor([1e20, -1e20] * 16)  # finite, squares overflow: sigma == Inf
        flat[128:160] = -0.0
        flat[160:192] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # E2M1 ties
        flat[192:224] = 1e30
        flat[192] = 1e-30  # x * 2^-e underflows to -0 / +0
        flat[224:256] = -5.0
    return x.to(dtype).float()


@pytest.mark.parametrize("mode", ["quad", "t1"])
@pytest.mark.parametrize("shape,dtype,rule,rnd,had,signed", EMU_CASES)
def test_host_emulation_mx(emu_binary, mode, shape, dtype, rule, rnd, had, signed):
    import numpy as np
    d = emu_binary
    x = _emu_input(shape, dtype, sum(shape) + had)
    signs = fp4.random_signs(had, 7) if signed else None
    seed = 1234
    q = fp4.quantize(x, "mxfp4", scale_rule=rule, rounding=rnd, hadamard=had, signs=signs, seed=seed)
    x.numpy().astype(np.float32).tofile(d / "x.bin")
    hs = formats._hadamard_scale(had) if had else 0.0
    args = [str(d / "emu"), mode, str(shape[0]), str(shape[1]), str(kernels.RULE_ID[rule]), str(kernels.ROUND_ID[rnd]),
            str(had), str(int(signed)), str(kernels.sign_words(signs)[0] if signed else 0), str(seed),
            repr(np.float32(hs).item()), str(d)]
    subprocess.run(args, check=True, timeout=120)
    r, k = shape
    got = {"codes": np.fromfile(d / "codes.bin", np.uint8).reshape(r, k // 2),
           "scales": np.fromfile(d / "scales.bin", np.uint8).reshape(r, k // 32)}
    want = {"codes": q.codes.numpy(), "scales": q.scales.numpy()}
    if rule == "quest":
        got["mask"] = np.fromfile(d / "mask.bin", np.uint8).reshape(r, k // 8)
        want["mask"] = q.mask.numpy()
    for name in got:
        assert_same(torch.from_numpy(got[name]), torch.from_numpy(want[name]), f"emulated {mode} {name}")


EMU_NV_CASES = [  # (shape, dtype, rule, rounding, hadamard, signed): MS-EDEN's 128-groups, G = 16 too
    ((64, 256), torch.float32, "absmax", "eden", 128, True),
    ((33, 384), torch.bfloat16, "absmax", "eden", 128, False),
    ((65, 128), torch.float32, "absmax", "sr", 128, True),
    ((64, 256), torch.float32, "four_over_six", "rn", 0, False),
    ((40, 160), torch.float32, "absmax", "sr", 16, True),
    ((24, 256), torch.float32, "absmax", "eden", 0, False),  # no rotation: the lane specials stay in their lanes
    ((16, 384), torch.bfloat16, "absmax", "eden", 64, True),
    ((16, 256), torch.float32, "four_over_six", "rn", 128, False),
]


def _emu_input_nv(shape, dtype, seed, binade=0):
    """Rows 2^-4..2^4 apart (one tensor scale: MX's 1e-30..3e38 would leave most NVFP4 blocks 0),
    heavy tails, a NaN, an Inf, a zero row and a constant row; rows 5 and 6 put a NaN, an Inf and
    zero blocks into single lanes of a 128-group's quad (lane q: elements 32q..32q+31). binade: all
    of it times 2^binade (FP32 squares overflow at 2^66 and lose bits at 2^-70: fp4._unit_scale)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) ** 3 * torch.exp2(torch.randint(-4, 5, shape[:-1] + (1,), generator=gen).float() + binade)
    x[1, 5], x[2, 17], x[3] = float("nan"), float("inf"), 0.0
    x[4] = 0.75
    x[5, 37], x[5, 116], x[5, 64:80] = float("nan"), -float("inf"), 0.0  # lanes 1, 3; a zero block in lane 2
    x[6, 64:96], x[6, 127] = 0.0, float("nan")  # lane 2 all zero, a NaN in lane 3
    return x.to(dtype).float()


@pytest.mark.parametrize("mode", ["nv", "nvquad"])
@pytest.mark.parametrize("shape,dtype,rule,rnd,had,signed", EMU_NV_CASES)
@pytest.mark.parametrize("binade", [0, 66, -70])
def test_host_emulation_nv(emu_binary, mode, shape, dtype, rule, rnd, had, signed, binade):
    """NVFP4 through quant_group as quant_rows runs it (pre-pass, tensor scale, quantize, and
    MS-EDEN's per-128-group correction of the scales), against fp4.quantize bit for bit; mode
    'nvquad': the 128-groups through nvq_group, 4 host threads as the lanes of a quad. The sums of
    squares (four_over_six, MS-EDEN) also at binades where unscaled FP32 squares over/underflow."""
    import numpy as np
    if mode == "nvquad" and max(16, had, fp4.EDEN_GROUP if rnd == "eden" else 0) != 128:
        pytest.skip("the quad layout is for 128-groups (Hadamard 128 or MS-EDEN)")
    if binade and rule != "four_over_six" and rnd != "eden":
        pytest.skip("other binades: for the sums of squares only")
    d = emu_binary
    x = _emu_input_nv(shape, dtype, sum(shape) + had + 1, binade)
    signs = fp4.random_signs(had, 11) if signed else None
    seed = 4321
    q = fp4.quantize(x, "nvfp4", scale_rule=rule, rounding=rnd, hadamard=had, signs=signs, seed=seed)
    x.numpy().astype(np.float32).tofile(d / "x.bin")
    hs = formats._hadamard_scale(had) if had else 0.0
    words = kernels.sign_words(signs) if signed else [0, 0, 0, 0]
    args = [str(d / "emu"), mode, str(shape[0]), str(shape[1]), str(kernels.RULE_ID[rule]), str(kernels.ROUND_ID[rnd]),
            str(had), str(int(signed)), str(words[0]), str(seed), repr(np.float32(hs).item()), str(d),
            *(str(w) for w in words[1:4])]
    subprocess.run(args, check=True, timeout=120)
    r, k = shape
    got = {"codes": np.fromfile(d / "codes.bin", np.uint8).reshape(r, k // 2),
           "scales": np.fromfile(d / "scales.bin", np.uint8).reshape(r, k // 16)}
    for name, want in (("codes", q.codes), ("scales", q.scales)):
        assert_same(torch.from_numpy(got[name]), want, f"emulated {mode} {name}")


EMU_NVQCOLS_CASES = [  # (input shape (R, K): quantized along R; src, dtype, rule, rounding, hadamard, signed)
    ((256, 40), "dense", torch.float32, "absmax", "eden", 128, True),  # K % 32: columns past K
    ((128, 33), "dense", torch.bfloat16, "absmax", "eden", 128, False),
    ((128, 48), "dense", torch.float32, "absmax", "sr", 128, True),
    ((128, 32), "dense", torch.float32, "four_over_six", "rn", 128, True),
    ((128, 24), "dense", torch.float32, "absmax", "eden", 64, True),
    ((256, 48), "nvfp4", torch.bfloat16, "absmax", "eden", 128, True),  # quartet2's backward re-quantize
    ((128, 80), "nvfp4", torch.float32, "absmax", "sr", 128, True),
]


@pytest.mark.parametrize("shape,src,dtype,rule,rnd,had,signed", EMU_NVQCOLS_CASES)
def test_host_emulation_nv_cols_quad(emu_binary, shape, src, dtype, rule, rnd, had, signed):
    """quant_cols' quad layout (nvq_col on the tiles, 4 host threads as a quad's lanes) against
    fp4.quantize(axis=0) (src dense) or fp4.requantize of an NVFP4 QTensor (src nvfp4), bit for bit:
    the tile's column mapping, the row signs applied at the load, the pre-pass and MS-EDEN."""
    import numpy as np
    d = emu_binary
    r, k = shape
    x = _emu_input_nv((k, r), dtype, r + k + had).t().contiguous()  # (R, K): lane specials in columns
    signs = fp4.random_signs(had, 13) if signed else None
    seed = 2468
    opts = dict(scale_rule=rule, rounding=rnd, hadamard=had, signs=signs, seed=seed)
    gin = 0.0
    if src == "dense":
        want = fp4.quantize(x, "nvfp4", axis=0, **opts)
        x.numpy().astype(np.float32).tofile(d / "x.bin")
    else:
        qin = fp4.quantize(x, "nvfp4", scale_rule="four_over_six")
        want = fp4.requantize(qin, "nvfp4", **opts)
        torch.zeros(shape).numpy().astype(np.float32).tofile(d / "x.bin")
        qin.codes.numpy().tofile(d / "qcodes.bin")
        qin.scales.numpy().tofile(d / "qscales.bin")
        gin = qin.tensor_scale.item()
    hs = formats._hadamard_scale(had) if had else 0.0
    words = kernels.sign_words(signs) if signed else [0, 0, 0, 0]
    args = [str(d / "emu"), "nvqcols", str(r), str(k), str(kernels.RULE_ID[rule]), str(kernels.ROUND_ID[rnd]),
            str(had), str(int(signed)), str(words[0]), str(seed), repr(np.float32(hs).item()), str(d),
            *(str(w) for w in words[1:4]), "0" if src == "dense" else "4", repr(np.float32(gin).item())]
    subprocess.run(args, check=True, timeout=300)
    assert want.codes.shape == (k, r // 2) and want.scales.shape == (k, r // 16)
    got = {"codes": np.fromfile(d / "codes.bin", np.uint8).reshape(k, r // 2),
           "scales": np.fromfile(d / "scales.bin", np.uint8).reshape(k, r // 16)}
    for name, w in (("codes", want.codes), ("scales", want.scales)):
        assert_same(torch.from_numpy(got[name]), w, f"emulated quad cols ({src}) {name}")


EMU_NVAMAX_CASES = [  # (shape quantized, axis, dtype, hadamard, signed, threads of the emulated grid, fill)
    ((40, 160), -1, torch.float32, 0, False, 64, "geometry"),
    ((33, 48), -1, torch.bfloat16, 0, False, 32, "geometry"),  # 99 blocks, 2 a thread a trip: a partial last trip
    ((7, 96), -1, torch.float16, 0, False, 32, "geometry"),
    ((40, 160), -1, torch.bfloat16, 16, True, 64, "geometry"),
    ((9, 64), -1, torch.float16, 16, False, 32, "geometry"),
    ((5, 32), -1, torch.float32, 16, True, 256, "geometry"),  # more threads than blocks
    ((160, 40), 0, torch.bfloat16, 0, False, 64, "geometry"),  # cols: V = 2
    ((48, 41), 0, torch.bfloat16, 0, False, 32, "geometry"),  # odd K: V = 1, 2-byte loads
    ((64, 36), 0, torch.float32, 0, False, 64, "geometry"),
    ((96, 38), 0, torch.float16, 0, False, 32, "geometry"),
    ((160, 40), 0, torch.bfloat16, 16, True, 64, "geometry"),  # the nvfp4 recipe's wgrad E^T: RHT-16 along the tokens
    ((48, 33), 0, torch.float16, 16, True, 32, "geometry"),
    ((32, 20), 0, torch.float32, 16, False, 32, "geometry"),
    ((33, 48), -1, torch.bfloat16, 0, False, 32, "last"),  # the amax in the grid's last, partial trip
    ((9, 64), -1, torch.float16, 16, True, 32, "last"),
    ((48, 41), 0, torch.bfloat16, 0, False, 32, "last"),
    ((160, 40), 0, torch.bfloat16, 16, True, 64, "last"),
    ((33, 48), -1, torch.bfloat16, 0, False, 32, "zero"),
    ((48, 41), 0, torch.float16, 0, False, 32, "zero"),
    ((7, 96), -1, torch.float32, 16, True, 32, "zero"),
    ((33, 48), -1, torch.bfloat16, 0, False, 32, "nonfinite"),
    ((64, 36), 0, torch.float32, 0, False, 64, "nonfinite"),
    ((48, 33), 0, torch.float16, 16, True, 32, "nonfinite"),
]


def _nvamax_input(moved, dtype, seed, fill):
    """A tensor in the quantized layout (rows, K: 16-blocks along K) whose answer depends on the
    blocks' geometry: a NaN and a larger value share a block (left out), a negative value one row
    below the NaN (the block along the OTHER axis would hold both) is the finite amax; an Inf block.
    fill 'last': the amax is the last element (the grid's tail); 'zero': all zeros and -0.0 (amax
    0, g 1); 'nonfinite': a NaN or Inf in every block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(moved, generator=gen) ** 3 * torch.exp2(torch.randint(-10, -1, moved[:-1] + (1,), generator=gen).float())
    m = float(x.abs().max())
    if fill == "geometry":
        x[1, 3], x[1, 4] = float("nan"), 1000 * m  # same block: 1000 m is left out
        x[2, 3] = -100 * m  # the finite amax (in rows 0..15's block of column 3 along the other axis)
        x[3, 20], x[3, 21] = float("inf"), 500 * m
    elif fill == "last":
        x[-1, -1] = -100 * m
    elif fill == "zero":
        x = torch.where(torch.rand(moved, generator=gen) < 0.5, 0.0, -0.0)
    else:  # nonfinite
        x.view(-1, 16)[:, 5] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(x.numel() // 48 + 1)[: x.numel() // 16]
    return x.to(dtype)


@pytest.mark.parametrize("shape,axis,dtype,had,signed,nt,fill", EMU_NVAMAX_CASES)
def test_host_emulation_nv_amax(emu_binary, shape, axis, dtype, had, signed, nt, fill, monkeypatch):
    """nv_amax's grid (every thread's loop and tail, as kernels.py picks the variant) on the input's
    raw bits against fp4.quantize's tensor scale bit for bit, and its amax against the reference's
    finite block amax: rows (16 consecutive elements) and cols (16 rows of a column) geometry, the
    NaN/Inf blocks left out, all-zero and all-nonfinite inputs (g = 1), RHT-16."""
    import numpy as np
    d = emu_binary
    moved = shape if axis == -1 else (shape[1], shape[0])
    xm = _nvamax_input(moved, dtype, sum(shape) + had, fill)
    x = xm if axis == -1 else xm.t().contiguous()  # (R, K); axis 0 quantizes along R
    signs = fp4.random_signs(had, 19) if signed else None
    want = fp4.quantize(x, "nvfp4", axis=axis, hadamard=had, signs=signs).tensor_scale
    xf = xm.float()
    if had:
        xf = fp4._fwht(xf, had, signs)
    block = fp4._blocks(xf, 16).abs().amax(-1)
    want_amax = torch.where(torch.isfinite(block), block, 0).amax()
    src = kernels._SRC_KIND[dtype]
    r, k = x.shape
    monkeypatch.setenv("FP4_NV_AMAX", "kernel")  # the variant kernels.py would launch for this call
    v = kernels.nv_amax_variant("rows" if axis == -1 else "cols", src, r, k, had, False)
    assert v is not None
    (x.view(torch.int16) if dtype != torch.float32 else x).numpy().tofile(d / "x.bin")
    hs = formats._hadamard_scale(had) if had else 0.0
    args = [str(d / "emu"), "nvamax", str(r), str(k), str(src), str(had), str(v), str(int(signed)),
            str(kernels.sign_words(signs)[0] if signed else 0), repr(np.float32(hs).item()), str(nt), str(d)]
    subprocess.run(args, check=True, timeout=60)
    bits = torch.from_numpy(np.fromfile(d / "amax.bin", np.int32))
    assert_same(bits.view(torch.float32).reshape(()), want_amax, f"emulated nv_amax<{src}, {had}, {v}> amax")
    assert_same(kernels.tensor_scale_of(bits), want, f"emulated nv_amax<{src}, {had}, {v}> tensor scale")
