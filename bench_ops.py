"""bench_ops.py: bench.py's per-operation sections (kernels, linear, gemm, attention, optim, accum,
fusion, ns_time, profile, overhead); the timer, tables and result files they share are bench_io.py's.

Each section is one function that returns rows (dicts); every row is printed in a table and the
section's rows are written to results/<gpu-name-slug>/bench_<section>.json. Times are medians of
CUDA-event timings after warm-up. Bandwidth counts the bytes a kernel must read plus write once.
The whole-model sections (step, saved, step_profile, fsdp) are in bench_step.py; bench.py is the
command line; the accuracy measurements that chose numerical designs are in study/measure.py.
"""
import os
import time

import torch

import fp4
import cuda_kernels as kernels
import gemm
import linear
from bench_io import bench, print_table


class SkipVariant(Exception):
    """A row that cannot run on this machine (an optional package missing): its row says why."""


# ---------------------------------------------------------------------------------------------
# kernels: each quantization kernel's bandwidth against a device copy measured in the same run

KERNEL_SHAPES = [(16384, 2048), (16384, 8192), (8192, 8192)]


def _qbytes(q):
    """Bytes of a QTensor's outputs (codes, scales, mask)."""
    return sum(t.numel() * t.element_size() for t in (q.codes, q.scales, q.mask) if t is not None)


def kernel_only(call, which=None):
    """Record the kernel launches of call() and return a function that replays just those launches
    (no allocation or argument checks): the kernels' own time. which: replay only that launch
    (e.g. 0 and 1: NVFP4's tensor-amax pre-pass and its quantize)."""
    import cupy as cp
    kernels.LAUNCH_LOG = log = []
    try:
        keep = call()
    finally:
        kernels.LAUNCH_LOG = None
    launches = [item for item in log if item[0] != "keepalive"]
    if which is not None:
        if which >= len(launches):
            raise ValueError(f"kernel_only(which={which}): the call made {len(launches)} launches")
        launches = [launches[which]]

    def replay():
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            for fn, _, grid, block, a in launches:
                fn(grid, block, a)
    replay.keep = (keep, log)
    return replay


def with_env(name, value, call):
    """call() with the environment switch name set to value (restored after): kernel_only records
    the launches a switch selects, e.g. FP4_NV_AMAX's two tensor-amax pre-passes."""
    def run():
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            return call()
        finally:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
    return run


def section_kernels(args):
    rows = []
    for r, k in KERNEL_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(r, k, generator=gen, device="cuda").to(torch.bfloat16)
        y = torch.empty_like(x)
        copy_ms = bench(lambda: y.copy_(x))
        copy_gbs = 2 * x.numel() * 2 / copy_ms / 1e6
        rows.append(dict(shape=f"{r}x{k}", kernel="copy (bf16, d2d)", ms=copy_ms, GBs=copy_gbs, pct_copy=100.0))
        signs = fp4.random_signs(32, 1, "cuda")
        xin = x.numel() * 2
        cases = [  # (name, fn, bytes read + written)
            ("mx quest+H32 rn +mask (fwd)", lambda: fp4.quantize(x, "mxfp4", scale_rule="quest", hadamard=32), None),
            ("mx absmax rn", lambda: fp4.quantize(x, "mxfp4"), None),
            ("mx absmax RHT32 sr (bwd E)", lambda: fp4.quantize(x, "mxfp4", rounding="sr", hadamard=32, signs=signs), None),
            ("mx absmax RHT32 sr axis0 (bwd E^T)",
             lambda: fp4.quantize(x, "mxfp4", axis=0, rounding="sr", hadamard=32, signs=signs), None),
            ("nv four_over_six rn (q2 fwd)", lambda: fp4.quantize(x, "nvfp4", scale_rule="four_over_six"), None),
            ("nv absmax rn", lambda: fp4.quantize(x, "nvfp4"), None),
            ("nv absmax block2d rn", lambda: fp4.quantize(x, "nvfp4", block2d=True), None),
        ]
        for name, fn, nbytes in cases:
            q = fn()
            ms = bench(fn)
            nbytes = nbytes or xin + _qbytes(q)
            rows.append(dict(shape=f"{r}x{k}", kernel=name, ms=ms, GBs=nbytes / ms / 1e6,
                             pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
        qf = fp4.quantize(x, "mxfp4", scale_rule="quest", hadamard=32)
        qn = fp4.quantize(x, "nvfp4")
        s16 = fp4.random_signs(16, 3, "cuda")

        def nv_bwd_et():  # the nvfp4 recipe's wgrad E^T: along the tokens (axis 0), RHT-16, SR
            return fp4.quantize(x, "nvfp4", axis=0, rounding="sr", hadamard=16, signs=s16)

        only = [  # the kernels alone (Python dispatch and allocation excluded)
            ("  kernel only: mx quest+H32 rn +mask", xin + _qbytes(qf),
             kernel_only(lambda: fp4.quantize(x, "mxfp4", scale_rule="quest", hadamard=32))),
            ("  kernel only: mx absmax RHT32 sr", xin + _qbytes(qf) - qf.mask.numel(),
             kernel_only(lambda: fp4.quantize(x, "mxfp4", rounding="sr", hadamard=32, signs=signs))),
            ("  kernel only: mx absmax RHT32 sr axis0 (bwd E^T)", xin + _qbytes(qf) - qf.mask.numel(),
             kernel_only(lambda: fp4.quantize(x, "mxfp4", axis=0, rounding="sr", hadamard=32, signs=signs))),
            ("  kernel only: requant mx RHT32 sr", 2 * (_qbytes(qf) - qf.mask.numel()),
             kernel_only(lambda: fp4.requantize(qf, rounding="sr", hadamard=32, signs=signs))),
            ("  kernel only: mx absmax rn", xin + _qbytes(qf) - qf.mask.numel(), kernel_only(lambda: fp4.quantize(x, "mxfp4"))),
            ("  kernel only: mx quest+H32 rn +mask +fold (fwd, fp8 operand)", xin + _qbytes(qf) + x.numel() + 4 * r,
             kernel_only(lambda: fp4.quantize(x, "mxfp4", scale_rule="quest", hadamard=32, fold=True))),
            ("  kernel only: rotate_back (mask + H32, bf16)", 2 * xin + qf.mask.numel(),
             kernel_only(lambda: linear._rotate_back(x, qf, 32))),
            # NVFP4's two passes apart: where its full call's time goes
            ("  kernel only: nv absmax rn, both passes", 2 * xin + _qbytes(qn), kernel_only(lambda: fp4.quantize(x, "nvfp4"))),
            ("  kernel only: nv absmax rn, tensor-amax pre-pass", xin,
             kernel_only(with_env("FP4_NV_AMAX", "fused", lambda: fp4.quantize(x, "nvfp4")), 0)),
            ("  kernel only: nv absmax rn, tensor-amax pre-pass (nv_amax kernel)", xin,
             kernel_only(with_env("FP4_NV_AMAX", "kernel", lambda: fp4.quantize(x, "nvfp4")), 0)),
            ("  kernel only: nv sr RHT16 axis0, tensor-amax pre-pass (nvfp4 bwd E^T)", xin,
             kernel_only(with_env("FP4_NV_AMAX", "fused", nv_bwd_et), 0)),
            ("  kernel only: nv sr RHT16 axis0, tensor-amax pre-pass (nv_amax kernel)", xin,
             kernel_only(with_env("FP4_NV_AMAX", "kernel", nv_bwd_et), 0)),
            ("  kernel only: nv absmax rn, quantize pass", xin + _qbytes(qn), kernel_only(lambda: fp4.quantize(x, "nvfp4"), 1)),
            ("  kernel only: nv sr RHT16, quantize pass (nvfp4 bwd E)", xin + _qbytes(qn),
             kernel_only(lambda: fp4.quantize(x, "nvfp4", rounding="sr", hadamard=16, signs=fp4.random_signs(16, 3, "cuda")), 1)),
        ]
        for name, nbytes, fn in only:
            ms = bench(fn)
            rows.append(dict(shape=f"{r}x{k}", kernel=name, ms=ms, GBs=nbytes / ms / 1e6,
                             pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
        s128 = fp4.random_signs(128, 2, "cuda")
        cases = [
            ("requant mx RHT32 sr (bwd)", qf, lambda: fp4.requantize(qf, rounding="sr", hadamard=32, signs=signs)),
            ("requant nv RHT128 eden (q2 bwd)", qn,
             lambda: fp4.requantize(qn, rounding="eden", hadamard=128, signs=s128)),
            ("requant nv RHT16 sr (nvfp4 bwd)", qn,
             lambda: fp4.requantize(qn, rounding="sr", hadamard=16, signs=fp4.random_signs(16, 3, "cuda"))),
        ]
        for name, qin, fn in cases:
            out = fn()
            ms = bench(fn)
            nbytes = _qbytes(qin) - (qin.mask.numel() if qin.mask is not None else 0) + _qbytes(out)
            rows.append(dict(shape=f"{r}x{k}", kernel=name, ms=ms, GBs=nbytes / ms / 1e6,
                             pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
        ms = bench(lambda: fp4.fold_mx(qf))
        nbytes = qf.codes.numel() + qf.scales.numel() + x.numel() + 4 * r
        rows.append(dict(shape=f"{r}x{k}", kernel="fold_mx (-> e4m3 + row scale)", ms=ms, GBs=nbytes / ms / 1e6,
                         pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
        qt = fp4.quantize(x, "mxfp4", axis=0, rounding="sr", hadamard=32, signs=signs)  # the backward's E^T:
        ms = bench(lambda: fp4.fold_mx(qt))  # k rows of r columns, few rows when k is small
        nbytes = qt.codes.numel() + qt.scales.numel() + x.numel() + 4 * k
        rows.append(dict(shape=f"{r}x{k}", kernel="fold_mx of the axis-0 quantize (k rows of r)", ms=ms,
                         GBs=nbytes / ms / 1e6, pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
        ms = bench(lambda: fp4.dequantize(qf, torch.bfloat16))
        nbytes = qf.codes.numel() + qf.scales.numel() + xin
        rows.append(dict(shape=f"{r}x{k}", kernel="dequantize mx -> bf16", ms=ms, GBs=nbytes / ms / 1e6,
                         pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
        del x, y, qf, qn
        torch.cuda.empty_cache()
    print_table(rows, ["shape", "kernel", "ms", "GBs", "pct_copy"])
    return rows


# ---------------------------------------------------------------------------------------------
# fusion: the most that fusing each FP4 linear's input quantize into the op before it could save
# (docs/speed.md). Fused, RMSNorm -> quantize (qkv, gate_up) and SwiGLU -> quantize (down)
# would never write their BF16 output nor read it back; everything else stays. So the gain is at
# most one write + one read of those activations: timed here as device copies of the same sizes.

def fusion_activations(size, tokens):
    """[(name, rows, cols)] a layer of model `size`: the BF16 tensors fusion would not write."""
    import model as llama
    cfg = llama.config_for(size)
    return [("ln_1 out -> qkv", tokens, cfg.n_embd), ("ln_2 out -> gate_up", tokens, cfg.n_embd),
            ("SwiGLU out -> down", tokens, cfg.ffn_hidden)]


def section_fusion(args):
    tokens, layers = args.batch * args.seq, llama_layers(args.model)
    rows, total = [], 0.0
    for name, r, c in fusion_activations(args.model, tokens):
        x = torch.randn(r, c, device="cuda").to(torch.bfloat16)
        y = torch.empty_like(x)
        ms = bench(lambda: y.copy_(x))  # one read + one write of the activation
        total += ms * layers
        rows.append(dict(activation=name, shape=f"{r}x{c}", ms_a_layer=ms, ms_a_step=ms * layers))
        del x, y
    rows.append(dict(activation=f"all ({args.model}, {tokens} tokens, {layers} layers)", shape="",
                     ms_a_layer=total / layers, ms_a_step=total))
    print_table(rows, ["activation", "shape", "ms_a_layer", "ms_a_step"])
    return rows


# ---------------------------------------------------------------------------------------------
# accum: how wide is Hopper's FP8 fast-accumulation accumulator? (fp4.FAST_ACCUM_BITS)

def accum_bits(device="cuda", k=64):
    """Significant bits p that Hopper's fast-accumulation mode keeps: one product 2^b and K - 1
    products 2^-j (all E4M3-exact) sum exactly iff p >= b + j + 1 (and the FP32 output holds
    them: p is found up to 24). The big product first, in the middle and last."""
    best = None
    for t in range(2, 24):
        b = min(t, 16)
        j = t - b
        a_big, b_big = 2.0 ** ((b + 1) // 2), 2.0 ** (b // 2)
        a_small, b_small = 2.0 ** -min(j, 9), 2.0 ** -(j - min(j, 9))
        exact = True
        for pos in (0, k // 2, k - 1):
            a = torch.full((16, k), a_small, device=device)
            w = torch.full((16, k), b_small, device=device)
            a[:, pos], w[:, pos] = a_big, b_big
            one = torch.ones(16, 1, device=device)
            y = torch._scaled_mm(a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t(), scale_a=one,
                                 scale_b=one.t(), out_dtype=torch.float32, use_fast_accum=True)
            exact &= bool((y.double() == 2.0**b + (k - 1) * 2.0**-j).all())
        if not exact:
            break
        best = t + 1
    return best


def section_accum(args):
    p = accum_bits()
    rows = [dict(what="fast-accumulation significant bits (exact sums)", value=p)]
    if p is None:
        print_table(rows, ["what", "value"])
        return rows
    # validate the bound on MXFP4 data: at the largest K it allows (span 0), fast == FP64 product
    bits = p - 1  # one bit of margin
    k = max(32, (2 ** bits // 144) // 32 * 32)
    x = torch.randn(512, k, device="cuda")
    a = fp4.quantize(torch.sign(x) * 4 + x.clamp(-1, 1))  # every block exponent equal: span 0
    fp4.FAST_ACCUM_BITS = bits
    exact = fp4.fast_accum_ok(a, a)
    got = fp4.mm(a, a, torch.float32, backend="fp8")
    want = fp4.dequantize(a).double() @ fp4.dequantize(a).double().t()
    rows.append(dict(what=f"bound holds at K={k} (span 0), result == FP64", value=bool(exact) and bool((got.double() == want).all())))
    # beyond the bound: all-positive worst case at 16x that K
    k2 = 16 * k
    a2 = fp4.quantize(torch.full((256, k2), 6.0, device="cuda") - torch.rand(256, k2, device="cuda"))
    y2 = torch._scaled_mm(*_fold_pair(a2, a2), out_dtype=torch.float32, use_fast_accum=True)
    w2 = fp4.dequantize(a2).double() @ fp4.dequantize(a2).double().t()
    rows.append(dict(what=f"outside the bound (K={k2}, all positive): max rel error", value=float(((y2.double() - w2).abs() / w2.abs()).max())))
    print_table(rows, ["what", "value"])
    return rows


def _fold_pair(a, b):
    a8, sa = fp4.fold_mx(a)
    b8, sb = fp4.fold_mx(b)
    return a8, b8.t(), sa.unsqueeze(1), sb.unsqueeze(0)


# ---------------------------------------------------------------------------------------------
# linear: FP4Linear forward + backward per recipe vs BF16 nn.Linear and an FP8 row-wise linear

LINEAR_SHAPES = [(2048, 6144), (2048, 2048), (2048, 11264), (5632, 2048)]  # Llama-1B, in -> out


class FP8RowwiseLinear(torch.autograd.Function):
    """The FP8 baseline: all three GEMMs in E4M3 with row-wise scales (torch._scaled_mm), the
    quantizations in plain PyTorch (not fused)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _fp8_mm(x, w)

    @staticmethod
    def backward(ctx, e):
        x, w = ctx.saved_tensors
        return _fp8_mm(e, w.t().contiguous()), _fp8_mm(e.t().contiguous(), x.t().contiguous())


def _fp8_rows(t):
    s = (t.abs().amax(-1, keepdim=True).float() / 448).clamp(min=1e-30)
    return (t / s).to(torch.float8_e4m3fn), s


def _fp8_mm(a, b):
    """a (M, K) @ b (N, K)^T with both row-wise FP8 along K."""
    a8, sa = _fp8_rows(a)
    b8, sb = _fp8_rows(b)
    return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16,
                            use_fast_accum=True)


def _gemms_only(x, w, e):
    """The three GEMMs of a linear layer's forward + backward alone, in BF16 and in row-wise FP8
    (promoted and fast accumulation): what the quantization passes are added to."""
    m, k, n = x.shape[0], x.shape[1], w.shape[0]
    f8 = lambda t: t.float().clamp(-6, 6).to(torch.float8_e4m3fn)  # noqa: E731
    x8, w8, e8 = f8(x), f8(w), f8(e)
    wt8, et8, xt8 = w8.t().contiguous(), e8.t().contiguous(), x8.t().contiguous()
    one = {d: torch.ones(d, 1, device="cuda") for d in {m, n, k}}

    def fp8(fast):
        def run():
            for a, b, ra, rb in ((x8, w8, m, n), (e8, wt8, m, k), (et8, xt8, n, k)):
                torch._scaled_mm(a, b.t(), scale_a=one[ra], scale_b=one[rb].t(), out_dtype=torch.bfloat16,
                                 use_fast_accum=fast)
        return run
    return {"bf16 GEMMs only": lambda: (x @ w.t(), e @ w, e.t() @ x),
            "fp8 GEMMs only (promoted)": fp8(False), "fp8 GEMMs only (fast accum)": fp8(True)}


def _fwd_bwd(layer, x, grad):
    """One forward + backward of layer (a module, or a torch.cuda.make_graphed_callables of one:
    then the forward and the backward are each one CUDA graph replay, with fresh randomness, plus
    the copies of x and grad into the graph's static buffers)."""
    def run():
        x.grad = None
        layer(x).backward(grad)
    return run


def min_linear_bytes(m, k, n):
    """The fewest bytes a quartet linear forward + backward on Hopper must move outside its GEMMs,
    with every pass fused as far as cuBLAS GEMMs allow (scales ignored): read X, W (BF16) and
    write their codes, masks and E4M3 operands; read E once and write its two E4M3 operands;
    re-quantize the saved codes into E4M3; mask + rotate back dX, dW (read, write BF16)."""
    per_operand = 2 + 0.5 + 0.125 + 1 + 0.5 + 1 + (2 + 0.125 + 2)
    return (m * k + n * k) * per_operand + m * n * (2 + 2)


def section_linear(args):
    rows, m = [], args.tokens
    big = torch.empty(16384, 8192, device="cuda", dtype=torch.bfloat16)
    copy_bw = 2 * big.numel() * 2 / bench(lambda: big.clone()) * 1e3  # bytes/s, read + write
    del big
    for k, n in LINEAR_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        layers = {"bf16": ref, "fp8-rowwise": lambda t: FP8RowwiseLinear.apply(t, ref.weight)}
        for recipe in ("quartet", "nvfp4", "quartet2", "fullstack"):
            lin = linear.FP4Linear(k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
            lin.weight = ref.weight
            linear.refit_lora(lin)  # fullstack's L from this weight (no-op for the others)
            layers[recipe] = lin
        base = None
        runs = {name: _fwd_bwd(layer, x, grad) for name, layer in layers.items()}
        for name in ("bf16", "quartet"):  # no host overhead: one graph replay (fresh seeds each)
            # make_graphed_callables replaces a module's forward: graph a twin sharing the weight
            twin = (torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) if name == "bf16" else
                    linear.FP4Linear(k, n, recipe=name, device="cuda", dtype=torch.bfloat16))
            twin.weight = ref.weight
            runs[f"{name} (CUDA graph)"] = _fwd_bwd(torch.cuda.make_graphed_callables(twin, (x,)), x, grad)
        runs.update(_gemms_only(x.detach(), ref.weight.detach(), grad))
        for name, run in runs.items():
            ms = bench(run)
            mem = _saved_bytes(layers[name], x) if name in layers else None
            base = base or ms
            rows.append(dict(shape=f"{m}x{k}->{n}", layer=name, ms=round(ms, 3),
                             speedup_vs_bf16=round(base / ms, 3),
                             saved_for_backward_mib=None if mem is None else round(mem / 2**20, 1)))
        promoted = next(r["ms"] for r in rows[::-1] if r["layer"] == "fp8 GEMMs only (promoted)")
        floor = promoted + min_linear_bytes(m, k, n) / copy_bw * 1e3  # promoted GEMMs + passes
        rows.append(dict(shape=f"{m}x{k}->{n}", layer="floor: fp8 GEMMs (promoted) + min bytes at copy speed",
                         ms=round(floor, 3), speedup_vs_bf16=round(base / floor, 3), saved_for_backward_mib=None))
    rows += linear_totals(rows)
    print_table(rows, ["shape", "layer", "ms", "speedup_vs_bf16", "saved_for_backward_mib"])
    print(f"copy bandwidth in this run: {copy_bw / 1e12:.2f} TB/s (read + write)")
    return rows


def linear_totals(rows):
    """One 'sum of shapes' row per layer kind: summed ms, and BF16's sum over it."""
    per_shape = [r for r in rows if not r["shape"].startswith("sum")]
    totals = {}
    for r in per_shape:
        totals[r["layer"]] = totals.get(r["layer"], 0.0) + r["ms"]
    n = len({r["shape"] for r in per_shape})
    return [dict(shape=f"sum of {n} shapes", layer=name, ms=round(t, 3),
                 speedup_vs_bf16=round(totals["bf16"] / t, 3), saved_for_backward_mib=None)
            for name, t in totals.items()]


def _saved_bytes(layer, x):
    """Device memory the forward leaves allocated for the backward (output excluded)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = layer(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    return held


# ---------------------------------------------------------------------------------------------
# gemm: NVFP4's GEMM on Hopper, the Triton kernel with the tensor scales in its epilogue (gemm.py)
# against cuBLAS, on the three GEMMs of each 1B linear; operands already dequantized (BF16)

GEMM_VARIANTS = ("cublas bf16 (torch.mm, bf16 out)", "bf16 backend (cublas fp32 out, then * g into bf16)",
                 "triton (default launch)", "triton HOPPER_ALT")


def gemm_shapes(m):
    """(gemm, M, N, K) of the 1B linears' GEMMs at m tokens: forward Y = X W^T (M = tokens, N =
    out, K = in), dgrad dX = E W (N = in, K = out), wgrad dW = E^T X (M = out, N = in, K = tokens)."""
    names = ("qkv", "o", "gate_up", "down")
    return [(f"{name} {which}", *dims) for name, (k, n) in zip(names, LINEAR_SHAPES)
            for which, dims in (("fwd", (m, n, k)), ("dgrad", (m, k, n)), ("wgrad", (n, k, m)))]


def _gemm_runs(a, b, g):
    out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device="cuda")
    return dict(zip(GEMM_VARIANTS, (
        lambda: torch.mm(a, b.t()),
        lambda: torch.mul(fp4._mm_f32(a, b), g, out=out),
        lambda: gemm.mm_scaled(a, b, g),
        lambda: gemm.mm_scaled(a, b, g, config=gemm.HOPPER_ALT))))


def section_gemm(args):
    """Median ms of each variant on NVFP4 operands dequantized as fp4's 'bf16' and 'triton' backends
    dequantize them (code * s * 2^k in BF16, g the FP32 rest of the tensor scales), and the ratio
    cuBLAS BF16 ms / ms (above 1: faster than cuBLAS). The Triton kernel must be no slower than
    cuBLAS BF16 here (the issue "The NVFP4 family at BF16 speed on Hopper")."""
    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    for name, m, n, k in gemm_shapes(args.tokens):
        x, w = (fp4.quantize(torch.randn(r, k, generator=gen, device="cuda"), "nvfp4") for r in (m, n))
        a, b, g = fp4._bf16_operands(x, w)
        base = None
        for variant, run in _gemm_runs(a, b, g).items():
            ms = bench(run)
            base = base or ms
            rows.append(dict(gemm=name, shape=f"{m}x{n}x{k}", variant=variant, ms=round(ms, 4),
                             tflops=round(2 * m * n * k / ms / 1e9, 1), vs_cublas_bf16=round(base / ms, 3)))
        del x, w, a, b
    totals = {v: sum(r["ms"] for r in rows if r["variant"] == v) for v in GEMM_VARIANTS}
    rows += [dict(gemm=f"sum of {len(rows) // len(GEMM_VARIANTS)} GEMMs", variant=v, ms=round(t, 3),
                  vs_cublas_bf16=round(totals[GEMM_VARIANTS[0]] / t, 3)) for v, t in totals.items()]
    print_table(rows, ["gemm", "shape", "variant", "ms", "tflops", "vs_cublas_bf16"])
    return rows


# ---------------------------------------------------------------------------------------------
# optim: one optimizer step over the ~1B Llama's parameters (SPEC 8.1): time and state bytes/param

OPTIM_VARIANTS = ("torch AdamW (fused)", "optim.AdamW fp32", "optim.AdamW nvfp4 (fused kernel)", "optim.AdamW nvfp4 (unfused reference)",
                  "torchao AdamW8bit", "torchao AdamW4bit")


def _optimizer(variant, params):
    hyper = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if variant == "torch AdamW (fused)":
        return torch.optim.AdamW(params, fused=True, **hyper)
    if variant.startswith("optim.AdamW"):
        import optim
        fused = True if "fused kernel" in variant else False if "unfused" in variant else None
        return optim.AdamW(params, state=variant.split()[1], fused=fused, **hyper)
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as err:
        raise SkipVariant(f"torchao not installed ({err.__class__.__name__}: pip install torchao)")
    return (AdamW8bit if "8bit" in variant else AdamW4bit)(params, **hyper)


def section_optim(args):
    """Median time of optimizer.step() and the bytes its states hold, per parameter, on the
    parameter set of args.model (FP32 parameters and gradients on the GPU), all in one run."""
    import model as llama
    import optim
    torch.manual_seed(0)
    with torch.device("cuda"):
        params = list(llama.GPT(llama.config_for(args.model)).parameters())
    n = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rows, base = [], None
    for variant in OPTIM_VARIANTS:
        row = dict(model=args.model, params=n, variant=variant)
        try:
            opt = _optimizer(variant, params)
        except SkipVariant as why:
            rows.append(dict(row, skipped=str(why)))
            print(f"  {variant}: skipped: {why}")
            continue
        opt.step()  # allocates the states (and compiles what compiles)
        ms = bench(opt.step, warmup=1, reps=args.optim_reps)
        nbytes = optim.state_bytes(opt)
        base = base or ms
        rows.append(dict(row, ms=round(ms, 2), vs_torch_fused=round(base / ms, 3),
                         state_bytes_per_param=round(nbytes / n, 4), state_gib=round(nbytes / 2**30, 3)))
        del opt
        torch.cuda.empty_cache()
    print_table([r for r in rows if "ms" in r], ["model", "variant", "ms", "vs_torch_fused", "state_bytes_per_param", "state_gib"])
    return rows


# ---------------------------------------------------------------------------------------------
# attention: FP4 attention (attention.py) forward + backward against SDPA's BF16 backends, one run

ATTN_SHAPE = (8, 16, 2048, 128)  # B, H, T, D: the 1b model's attention, causal


def _saved_tensor_bytes(fn):
    """Bytes of the distinct tensors autograd saves for the backward while fn() runs."""
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _attention_variants(attn):
    """name -> (context manager factory, attention function of q, k, v)."""
    from contextlib import nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = lambda q, k, v: attn.attention(q, k, v, causal=True)  # noqa: E731
    variants = {f"sdpa {name} (bf16)": (lambda b=backend: sdpa_kernel(b), sdpa) for name, backend in
                (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                 ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
    for operands in ("codes", "bf16"):
        for rnd in ("sr", "rn"):
            def fp4_attn(q, k, v, rnd=rnd):
                return attn.attention(q, k, v, causal=True, fmt="nvfp4", ds_rounding=rnd)

            def ctx(operands=operands):
                os.environ["FP4_ATTENTION_OPERANDS"] = operands
                return nullcontext()
            variants[f"fp4 nvfp4 ({operands} operands, dS {rnd})"] = (ctx, fp4_attn)

    def fused():  # the one-kernel backward (attention._bwd_layout), default operands
        os.environ["FP4_ATTENTION_BWD"] = "fused"
        return nullcontext()
    variants["fp4 nvfp4 (bf16 operands, dS sr, fused backward)"] = (
        fused, lambda q, k, v: attn.attention(q, k, v, causal=True, fmt="nvfp4"))
    return variants


def section_attention(args):
    import attention as attn
    b, h, t, d = ATTN_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    do = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 3.5 * 4 * b * h * t * t * d / 2  # forward 2 GEMMs (halved: causal), backward 2.5x that
    rows, best_bf16 = [], None
    for name, (ctx, fn) in _attention_variants(attn).items():
        row = dict(shape=f"{b}x{h}x{t}x{d} causal", attention=name)
        try:
            with ctx():
                fwd = lambda: fn(q, k, v)  # noqa: E731
                step = lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)  # noqa: E731
                step()
                row.update(fwd_ms=round(bench(fwd), 3), fwd_bwd_ms=round(bench(step), 3),
                           saved_mib=round(_saved_tensor_bytes(fwd) / 2**20, 1))
        except Exception as err:  # a backend this torch/GPU lacks: say so, keep the others
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        finally:
            os.environ.pop("FP4_ATTENTION_OPERANDS", None)
            os.environ.pop("FP4_ATTENTION_BWD", None)
        if "fwd_bwd_ms" in row:
            row["tflops_fwd_bwd"] = round(flops / row["fwd_bwd_ms"] * 1e-9, 1)
            if name.startswith("sdpa"):
                best_bf16 = min(best_bf16 or row["fwd_bwd_ms"], row["fwd_bwd_ms"])
        rows.append(row)
    for row in rows:
        if "fwd_bwd_ms" in row and best_bf16:
            row["vs_fastest_bf16"] = round(best_bf16 / row["fwd_bwd_ms"], 3)
    rows += _fp4_attention_parts(attn, q.detach(), k.detach(), v.detach(), do)
    print_table(rows, ["shape", "attention", "fwd_ms", "fwd_bwd_ms", "tflops_fwd_bwd", "vs_fastest_bf16",
                       "saved_mib", "part_ms", "error"])
    return rows


def _fp4_attention_parts(attn, q, k, v, do):
    """Where FP4 attention's time goes (default operands, dS sr): each stage timed alone."""
    b, h, t, d = q.shape
    sc = d ** -0.5
    qq, kq, vq = (attn.quantize_qkv(x) for x in (q, k, v))
    o, lse = attn.triton_forward(qq, kq, vq, True, sc, torch.bfloat16)
    seed = torch.tensor([1], dtype=torch.int32, device="cuda")
    parts = {
        "quantize Q, K, V (kernels.cu)": lambda: [attn.quantize_qkv(x) for x in (q, k, v)],
        "BF16 copies of Q, K, V (dequantize)": lambda: [attn._unit(x) for x in (qq, kq, vq)],
        "re-quantize Q, K along T (kernels.cu)": lambda: (attn.along_tokens(qq), attn.along_tokens(kq)),
    }
    for warps, stages in ((8, 2), (4, 2), (8, 3), (4, 3)):  # launch settings to choose from (numbers unchanged)
        parts[f"forward (copies + Triton), warps {warps} stages {stages}"] = lambda w=warps, st=stages: (
            attn.triton_forward(qq, kq, vq, True, sc, torch.bfloat16, num_warps=w, num_stages=st))
        parts[f"backward (all of it), warps {warps} stages {stages}"] = lambda w=warps, st=stages: (
            attn.triton_backward(do, o, lse, qq, kq, vq, True, sc, seed, "sr", num_warps=w, num_stages=st))
        parts[f"backward, fused (FP4_ATTENTION_BWD=fused), warps {warps} stages {stages}"] = lambda w=warps, st=stages: (
            attn.triton_backward(do, o, lse, qq, kq, vq, True, sc, seed, "sr", num_warps=w, num_stages=st, layout="fused"))
    return [dict(shape=f"{b}x{h}x{t}x{d} causal", attention=f"fp4 part: {name}", part_ms=round(bench(fn), 3))
            for name, fn in parts.items()]


# ---------------------------------------------------------------------------------------------
# profile: where one FP4Linear forward + backward spends its time (torch.profiler)

def section_profile(args):
    k, n, m = 2048, 2048, args.tokens
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    rows = []
    for recipe in ("quartet", "nvfp4"):
        lin = linear.FP4Linear(k, n, recipe=recipe, device="cuda", dtype=torch.bfloat16)
        run = _fwd_bwd(lin, x, grad)
        bench(run, warmup=2, reps=3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
        print(f"--- {recipe}, {m}x{k}->{n}, by device time\n{table}")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10))
        rows.append(dict(recipe=recipe, profile=table))
    return rows



# ---------------------------------------------------------------------------------------------
# overhead: host time per call of each step of an FP4Linear (small tensors: the GPU waits on us)

def section_overhead(args):
    m = k = n = 256
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    e = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    s_cpu, s_gpu = fp4.random_signs(32, 1), fp4.random_signs(32, 1, "cuda")
    qx = fp4.quantize(x, scale_rule="quest", hadamard=32)
    lin = linear.FP4Linear(k, n, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    steps = {
        "torch.empty": lambda: torch.empty(m, k, device="cuda"),
        "x.add_(0)": lambda: x.add_(0),
        "quantize quest h32": lambda: fp4.quantize(x, scale_rule="quest", hadamard=32),
        "quantize sr h32 cpu-signs": lambda: fp4.quantize(e, rounding="sr", hadamard=32, signs=s_cpu),
        "quantize sr h32 gpu-signs": lambda: fp4.quantize(e, rounding="sr", hadamard=32, signs=s_gpu),
        "quantize sr h32 axis0": lambda: fp4.quantize(e, axis=0, rounding="sr", hadamard=32, signs=s_cpu),
        "requantize sr h32": lambda: fp4.requantize(qx, hadamard=32, signs=s_cpu),
        "fold_mx": lambda: fp4.fold_mx(qx),
        "mm fp8": lambda: fp4.mm(qx, qx),
        "random_signs gpu": lambda: fp4.random_signs(32, 5, "cuda"),
        "random_signs cpu": lambda: fp4.random_signs(32, 5),
        "clip_mask": lambda: qx.clip_mask(),
        "FP4Linear fwd": lambda: lin(x),
        "FP4Linear fwd+bwd": lambda: lin(xg).sum().backward(),
    }
    rows = []
    for name, fn in steps.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - t) / 50
        torch.cuda.synchronize()
        total = (time.perf_counter() - t) / 50
        rows.append(dict(step=name, host_us=round(host * 1e6, 1), with_sync_us=round(total * 1e6, 1)))
    print_table(rows, ["step", "host_us", "with_sync_us"])
    return rows


# ---------------------------------------------------------------------------------------------
# ns_time: Newton-Schulz in FP4 (newton_schulz.py, SPEC 8.2): GPU time per optimizer step of the 1B model
# (its quality per design, on a CPU too: python study/measure.py --sections ns)

FP4_SPEEDUP = 4.0  # Blackwell: dense NVFP4 tensor-core rate / dense BF16 rate (B200 and RTX 5090 spec sheets)


def ns_shapes(size):
    """{name: (rows, cols)} of the block linears of model.SIZES[size] (nn.Linear weights: out x in)."""
    import model as llama
    c = llama.config_for(size)
    hs = c.n_embd // c.n_head
    return {"qkv": ((c.n_head + 2 * c.n_kv_head) * hs, c.n_embd), "o": (c.n_embd, c.n_embd),
            "gate_up": (2 * c.ffn_hidden, c.n_embd), "down": (c.n_embd, c.ffn_hidden)}


def section_ns_time(args):
    """Newton-Schulz time per optimizer step for all 2-D hidden matrices of --model (4 per block),
    per precision, on this GPU. blackwell_cost_vs_bf16 is a PROJECTION from the GEMM FLOPs
    (NVFP4 at FP4_SPEEDUP x the BF16 rate, quantization passes not counted), not a measurement."""
    import newton_schulz
    shapes = [s for s in ns_shapes(args.model).values() for _ in range(llama_layers(args.model))]
    gen = torch.Generator(device="cuda").manual_seed(0)
    mats = {s: torch.randn(*s, device="cuda", generator=gen) for s in set(shapes)}
    rows = []
    for precision, design in [("fp32", "-"), ("bf16", "-"), ("nvfp4", "residual"), ("nvfp4", "bf16_tail"),
                              ("nvfp4", "compensated_tail"), ("nvfp4", "diagonal_tail"), ("nvfp4", "residual, graphed"),
                              ("nvfp4", "compensated_tail, graphed"), ("nvfp4", "diagonal_tail, graphed")]:
        d = design.partition(",")[0] if design != "-" else "compensated_tail"
        stats = {}
        ns = newton_schulz.GraphedNS() if design.endswith("graphed") else None  # ROOT's default on a GPU

        def step(stats=None):
            for s in shapes:
                abc = newton_schulz.ns_coefficients(s, "root")
                if ns is not None and stats is None:
                    ns(mats[s], 5, abc, precision, d)
                else:
                    newton_schulz.newton_schulz(mats[s], 5, abc, precision, d, stats)

        step(stats)  # counts the FLOPs (eagerly: a graph replays the same GEMMs)
        ms = bench(step, warmup=1, reps=3)
        total = sum(stats.values())
        cost = stats.get("nvfp4", 0) / FP4_SPEEDUP + stats.get("bf16", 0) + stats.get("fp32", 0)
        rows.append(dict(model=args.model, matrices=len(shapes), precision=precision, design=design, ms=round(ms, 1),
                         gemm_tflop=round(total / 1e12, 2), fp4_share=round(stats.get("nvfp4", 0) / total, 3),
                         tflop_s=round(total / ms / 1e9), _cost=cost))
    bf16 = next(r for r in rows if r["precision"] == "bf16")
    for r in rows:
        r["vs_bf16_ms"] = round(r["ms"] / bf16["ms"], 2)
        r["blackwell_cost_vs_bf16_projected"] = round(r["_cost"] / bf16["_cost"], 3)
    for r in rows:
        del r["_cost"]
    print_table(rows, ["model", "matrices", "precision", "design", "ms", "vs_bf16_ms", "gemm_tflop", "tflop_s",
                       "fp4_share", "blackwell_cost_vs_bf16_projected"])
    return rows


def llama_layers(size):
    import model as llama
    return llama.config_for(size).n_layer


SECTIONS = {"overhead": section_overhead, "profile": section_profile, "kernels": section_kernels, "accum": section_accum,
            "linear": section_linear, "gemm": section_gemm, "ns_time": section_ns_time, "attention": section_attention,
            "optim": section_optim, "fusion": section_fusion}  # and bench_step.py's: all_sections()
CPU_SECTIONS = {"saved"}  # sections that also run without a GPU (bench_step.py's saved)
ON_REQUEST = {"step_profile"}  # not in the default sections (a diagnosis, not a comparison)
