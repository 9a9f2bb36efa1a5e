"""bench_io.py: what every bench section shares: the timer (CUDA-event medians), the printed
tables, and the result files (results/<gpu-name-slug>/bench_<section>.json with the run's meta:
device, versions, backends, commit, switches). bench_ops.py and bench_step.py hold the sections,
bench.py the command line, study/measure.py the design measurements; all of them record through here.
"""
import json
import os
import platform
import re
import statistics
import time

import torch

import cuda_kernels as kernels
import fp4
from runlog import git_state


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


def print_table_row(row, cols):
    print("  ".join(_fmt(row.get(c)) for c in cols), flush=True)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def gpu_slug():
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_meta():
    """What a result file records of the run: the device, versions, backends, commit, switches, time."""
    return dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                backends=fp4.backends(), code=code_version(), env=switches(), time=time.strftime("%Y-%m-%d %H:%M:%S"))


def code_version():
    """The commit measured (runlog.git_state: FP4_GIT_COMMIT where the tree's .git is not its own)."""
    commit, dirty = git_state()
    return dict(commit=commit, dirty=dirty)


SWITCHES = ("FP4_NS_GRAPH", "FP4_KERNELS", "FP4_BACKEND", "FP4_FAST_ACCUM_BITS", "FP4_MX_ROWS", "FP4_NV128_ROWS", "FP4_NV128_COLS",
            "FP4_ATTENTION", "FP4_ATTENTION_OPERANDS", "FP4_ATTENTION_BWD", "FP4_ADAMW_FUSED", "FP4_NV_AMAX",
            "FP4_NV_GEMM")


def switches():
    """The environment switches that change which code path runs (fp4, attention, optim), as set."""
    return {k: os.environ[k] for k in SWITCHES if k in os.environ}


def save_rows(args, name, rows, path=None):
    """results/<gpu>/bench_<name>.json (or path): the run's meta and the section's rows."""
    args.meta["kernel_compiler"] = dict(kernels.COMPILER)
    with open(path or os.path.join(args.out_dir, f"bench_{name}.json"), "w") as f:
        json.dump(dict(meta=args.meta, rows=rows), f, indent=1)
