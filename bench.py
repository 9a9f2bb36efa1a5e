"""Speed, side by side, in one run: python bench.py [--sections kernels,...] [--out results/<gpu>/]

Each section is one function that returns rows (dicts); every row is printed in a table and the
section's rows are written to results/<gpu-name-slug>/bench_<section>.json. Times are medians of
CUDA-event timings after warm-up. Bandwidth counts the bytes a kernel must read plus write once.
"""
import argparse
import json
import os
import platform
import re
import statistics
import time

import torch

import fp4


def bench(fn, warmup=3, reps=20):
    """Median milliseconds of fn() on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def print_table(rows, cols):
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)))


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def gpu_slug():
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ---------------------------------------------------------------------------------------------
# kernels: each quantization kernel's bandwidth against a device copy measured in the same run

KERNEL_SHAPES = [(16384, 2048), (16384, 8192), (8192, 8192)]


def _qbytes(q):
    """Bytes of a QTensor's outputs (codes, scales, mask)."""
    return sum(t.numel() * t.element_size() for t in (q.codes, q.scales, q.mask) if t is not None)


def kernel_only(call):
    """Record the kernel launches of call() and return a function that replays just those launches
    (no allocation or argument checks): the kernels' own time."""
    import cupy as cp
    fp4._LAUNCH_LOG = log = []
    try:
        keep = call()
    finally:
        fp4._LAUNCH_LOG = None
    launches = [item for item in log if item[0] != "keepalive"]

    def replay():
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            for fn, _, grid, block, a in launches:
                fn(grid, block, a)
    replay.keep = (keep, log)
    return replay


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
        only = [  # the kernels alone (Python dispatch and allocation excluded)
            ("  kernel only: mx quest+H32 rn +mask", xin + _qbytes(qf),
             kernel_only(lambda: fp4.quantize(x, "mxfp4", scale_rule="quest", hadamard=32))),
            ("  kernel only: mx absmax RHT32 sr", xin + _qbytes(qf) - qf.mask.numel(),
             kernel_only(lambda: fp4.quantize(x, "mxfp4", rounding="sr", hadamard=32, signs=signs))),
            ("  kernel only: requant mx RHT32 sr", 2 * (_qbytes(qf) - qf.mask.numel()),
             kernel_only(lambda: fp4.requantize(qf, rounding="sr", hadamard=32, signs=signs))),
            ("  kernel only: mx absmax rn", xin + _qbytes(qf) - qf.mask.numel(), kernel_only(lambda: fp4.quantize(x, "mxfp4"))),
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
        ms = bench(lambda: fp4.dequantize(qf, torch.bfloat16))
        nbytes = qf.codes.numel() + qf.scales.numel() + xin
        rows.append(dict(shape=f"{r}x{k}", kernel="dequantize mx -> bf16", ms=ms, GBs=nbytes / ms / 1e6,
                         pct_copy=100 * nbytes / ms / 1e6 / copy_gbs))
        del x, y, qf, qn
        torch.cuda.empty_cache()
    print_table(rows, ["shape", "kernel", "ms", "GBs", "pct_copy"])
    return rows


SECTIONS = {"kernels": section_kernels}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {list(SECTIONS)}")
    ap.add_argument("--out", default=None, help="folder for the JSON (default results/<gpu-name-slug>)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA device")
    out = args.out or os.path.join("results", gpu_slug())
    os.makedirs(out, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, backends=fp4.backends(),
                time=time.strftime("%Y-%m-%d %H:%M:%S"))
    for name in args.sections.split(","):
        print(f"\n== {name} ==")
        rows = SECTIONS[name](args)
        meta["kernel_compiler"] = dict(fp4._KERNEL_COMPILER)
        with open(os.path.join(out, f"bench_{name}.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
