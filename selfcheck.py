"""
selfcheck.py: every accelerated path checks itself on first use (DESIGN.md "Self-checks").

A layout or mapping error in a GPU path (a nibble order, a scale-tile order, an SR byte mapping)
crashes nothing: it trains on silently wrong numbers. So the first time a process uses a path on a
device, the module that owns the path runs it on small fixed inputs against the exact PyTorch
reference (bit for bit where SPEC.md says exact) through `verified(path, device)`:
  - pass: one log line, the result cached for the process (later calls are a dict hit);
  - fail: one warning naming the path, the device and the first mismatches; the caller switches to
    the exact fallback for the rest of the run, and `summary()` records it for train.py's log and
    summary.json.
FP4_SELFCHECK=0 turns the first-use checks off (and the log says so).

This module imports no project module: fp4.py, optim.py and attention.py register their checks
here (`register`) and ask `verified` before using a path. `main` (python check.py, which imports
those three) runs every registered check this machine can and prints the table.
"""
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

ENABLED = os.environ.get("FP4_SELFCHECK", "1") != "0"


@dataclass
class Check:
    path: str  # e.g. 'mm.native', 'kernel.quantize'
    run: Callable  # device -> list of mismatch lines (empty: the path agrees with its reference)
    against: str  # what the path is compared with, said plainly (the table's column)
    fallback: str  # what runs instead when the check fails
    available: Callable  # device -> None, or why the path does not exist there
    speed: Optional[Callable] = None  # device -> the table's speed text (see gemm_speed, kernel_speed)


CHECKS = {}  # path -> Check, in registration order
_RESULTS = {}  # (path, device string) -> bool: the per-process cache
FALLBACKS = {}  # 'path on device' -> the first mismatches
LOG = []  # the lines the checks logged
SINK = None  # where they go as they happen (train.py: its log); stderr while None


def register(check):
    CHECKS[check.path] = check


def verified(path, device):
    """True when `path` may be used on `device`: its check passed (run once a process) or the
    checks are off. False: the caller uses the path's fallback."""
    key = (path, str(device))
    hit = _RESULTS.get(key)
    if hit is None:
        hit = _RESULTS[key] = _first_use(CHECKS[path], torch.device(key[1]))
    return hit


def _first_use(check, device):
    if not ENABLED:
        _log("selfcheck: off (FP4_SELFCHECK=0): accelerated paths are used unchecked")
        return True
    ok, bad, ms = _run(check, device)
    if ok:
        _log(f"selfcheck: {check.path} on {device}: verified against {check.against} ({ms:.0f} ms)")
    else:
        FALLBACKS[f"{check.path} on {device}"] = bad[:3]
        line = (f"selfcheck: {check.path} on {device} ({_device_name(device)}) FAILED against "
                f"{check.against}: {'; '.join(bad[:3])}. Using {check.fallback} for the rest of the run")
        _log(line, echo=SINK is not None)
        warnings.warn(line, RuntimeWarning, stacklevel=3)
    return ok


def _run(check, device):
    t = time.perf_counter()
    try:
        bad = check.run(device)
    except Exception as err:  # a path that raises is a path that is not verified
        bad = [f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"]
    return not bad, bad, (time.perf_counter() - t) * 1e3


def _log(line, echo=True):
    if line not in LOG:
        LOG.append(line)
        if echo:
            SINK(line) if SINK else print(line, file=sys.stderr)


def attach(sink):
    """Send the check lines to `sink` (train.py's log): those logged so far, then each as it happens."""
    global SINK
    SINK = sink
    for line in LOG:
        sink(line)
    if not ENABLED:
        _log("selfcheck: off (FP4_SELFCHECK=0): accelerated paths are used unchecked")


def summary():
    """What train.py puts in summary.json: on/off, what was verified, what fell back and why."""
    return {"enabled": ENABLED,
            "verified": sorted(f"{p} on {d}" for (p, d), ok in _RESULTS.items() if ok),
            "fallbacks": dict(FALLBACKS)}


def reset():
    """Forget every result and the log sink (tests: a fresh process)."""
    global SINK
    SINK = None
    _RESULTS.clear()
    FALLBACKS.clear()
    LOG.clear()


# ---------------------------------------------------------------------------------------------
# Comparing with the reference: bits, NaN positions, the first mismatches printed

def mismatches(got, want, what="", limit=3):
    """Lines naming the first elements where `got` differs from `want` in bits (NaN == NaN, any
    payload; -0.0 != +0.0). Empty when they agree exactly."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{what} shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"]
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.is_floating_point():
        same = _float_bits(got) == _float_bits(want)
        same |= torch.isnan(got) & torch.isnan(want)
    else:
        same = got == want
    idx = (~same).nonzero()[:limit]
    return [f"{what}{tuple(i.tolist())}: got {got[tuple(i)].item()!r}, want {want[tuple(i)].item()!r}" for i in idx]


def _float_bits(x):
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}[x.element_size()]
    return x.contiguous().view(ints)


# ---------------------------------------------------------------------------------------------
# python check.py: every check this machine can run, as a table and results/<gpu>/check.json

def seconds(fn, device, reps=5):
    """Median wall time of fn() on `device` (synchronised on CUDA), after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def gemm_speed(fn, flops, device):
    return f"{flops / seconds(fn, device) / 1e12:.2f} TFLOP/s"


def kernel_speed(fn, nbytes, device):
    """GB/s of the bytes a kernel must read and write, and that as a share of a device copy moving
    the same bytes (read + write): how near the kernel runs to the memory bound."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = nbytes / seconds(lambda: dst.copy_(src), device)
    own = nbytes / seconds(fn, device)
    return f"{own / 1e9:.0f} GB/s ({100 * own / copy:.0f}% of copy)"


def devices():
    return [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def table(devs=None):
    rows = []
    for dev in devs or devices():
        for check in CHECKS.values():
            rows.append(_row(check, dev))
    return rows


def _row(check, dev):
    why = check.available(dev)
    if why:
        return dict(path=check.path, device=str(dev), status="unavailable", against=check.against, detail=why, speed=None)
    ok, bad, ms = _run(check, dev)
    _RESULTS[(check.path, str(dev))] = ok
    speed = None
    if ok and check.speed is not None:
        try:
            speed = check.speed(dev)
        except Exception as err:  # a speed that cannot be measured is not a failed check
            speed = f"not measured ({type(err).__name__})"
    return dict(path=check.path, device=str(dev), status="verified" if ok else "fallback",
                against=check.against, detail="; ".join(bad[:3]) if bad else f"{ms:.0f} ms", speed=speed)


def _device_name(dev):
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def _gpu_folder():
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(0).lower().replace(" ", "-")


def format_table(rows):
    head = ("path", "device", "status", "compared against", "speed", "detail")
    lines = [[r["path"], r["device"], r["status"], r["against"], r["speed"] or "-", r["detail"]] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), "-+-".join("-" * w for w in widths)] + [fmt.format(*map(str, ln)) for ln in lines])


def main(argv=(), out_root="results"):
    """Run every check, print the table, write results/<gpu>/check.json. Exit status 1 when a path
    this machine would use failed (it falls back; a new machine should not train unnoticed)."""
    if list(argv):
        print(f"usage: python check.py (no arguments; got: {' '.join(argv)})", file=sys.stderr)
        return 2
    rows = table()
    print(format_table(rows))
    path = os.path.join(out_root, _gpu_folder(), "check.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"command": "python check.py", "commit": _commit(), "torch": torch.__version__,
                   "device": _device_name(devices()[-1]), "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 1 if any(r["status"] == "fallback" for r in rows) else 0


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
