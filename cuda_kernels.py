"""
cuda_kernels.py: compiling kernels.cu with NVRTC (through CuPy) and launching its kernels on torch's
CUDA tensors. fp4.py holds the numerics and calls these launchers when a tensor is on a GPU;
FP4_KERNELS=torch forces the PyTorch reference there instead.

A raw pointer carries no metadata, so every launcher checks what the kernel assumes (dtype,
contiguity, 16-byte alignment, sizes that fit its index types) before launching, allocates its
outputs with torch, and launches on torch's current stream of the tensor's device. Each launcher
returns exactly what its fp4.py twin returns (quantize, dequantize, requantize, fold_mx,
rotate_back_reference); test_kernels.py checks them against the reference bit for bit.

Its name is not kernels.py (DESIGN.md's) because a module of that name at the top of the
repository shadows Hugging Face's `kernels` package, which transformers (a requirement, for
export_hf.py) imports: `from transformers import LlamaForCausalLM` then fails from this folder.
The importers read it as `import cuda_kernels as kernels`.
"""
import atexit
import dataclasses
import functools
import math
import os

import torch

import formats  # the bits these kernels compute (QTensor, block sizes, seeds); fp4.py calls this module

# ---------------------------------------------------------------------------------------------
# Compiling and launching

def enabled():
    """True when CUDA tensors should go through kernels.cu (CuPy importable, not overridden)."""
    return os.environ.get("FP4_KERNELS", "cuda") != "torch" and _cupy() is not None


def _cupy():
    try:
        import cupy
        return cupy
    except Exception:  # ImportError, or a CuPy that finds no CUDA driver
        return None


_KERNELS_CU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels.cu")
# IEEE FP32 as the reference computes it: no FMA contraction, subnormals kept, exact div/sqrt.
_NVRTC_OPTIONS = ("-std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")
_SRC_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, "mxfp4": 3, "nvfp4": 4}
RULE_ID = {"absmax": 0, "quest": 1, "four_over_six": 2}
ROUND_ID = {"rn": 0, "sr": 1, "eden": 2}
_TILE_R = 128  # quant_cols' tile: 128 rows (the quantized axis) x 32 columns
LAUNCH_LOG = None  # a list to record launches (bench.py replays them to time kernels alone)
COMPILER = {}  # device index -> how kernels.cu was compiled there (bench.py records it)


@functools.cache
def _kernel_function(device_index, name):
    """One kernels.cu template instantiation (e.g. 'quant_rows<1, 32, false, 1, 0>'), compiled by
    NVRTC once per device and process. cupy.RawModule appends -ftz=true to the caller's options
    (seen on the H200: subnormal inputs lost their sign), so NVRTC is driven directly through
    CuPy's bindings; RawModule (flushing subnormals) is the fallback if those bindings move."""
    cp = _cupy()
    with open(_KERNELS_CU) as f:
        code = f.read()
    with cp.cuda.Device(device_index):
        try:
            fn = _nvrtc_function(cp, code, name, device_index)
            COMPILER[device_index] = "nvrtc " + " ".join(_NVRTC_OPTIONS)
            return fn
        except Exception:
            module = cp.RawModule(code=code, options=_NVRTC_OPTIONS, name_expressions=(name,))
            COMPILER[device_index] = "cupy.RawModule (CuPy appends -ftz=true)"
            return module.get_function(name)


# Compute capabilities with an arch-specific target (sm_XXa): its features (Hopper's wgmma,
# Blackwell's cvt.rs SR encode behind __CUDA_ARCH_FEAT_SM100_ALL) exist only when compiled for it.
ARCH_SPECIFIC = ("90", "100", "101", "103", "110", "120", "121")


def nvrtc_arch(cc):
    """NVRTC's target for a device of compute capability cc ('90', '89', ...): 'sm_90a' where an
    arch-specific target exists, else 'sm_89' and the like."""
    return f"sm_{cc}a" if str(cc) in ARCH_SPECIFIC else f"sm_{cc}"


def _nvrtc_function(cp, code, name, device_index):
    from cupy.cuda import function
    from cupy_backends.cuda.libs import nvrtc
    import hashlib
    arch = f"--gpu-architecture={nvrtc_arch(cp.cuda.Device(device_index).compute_capability)}"
    include = os.path.join(cp.cuda.get_cuda_path() or "/usr/local/cuda", "include")
    key = hashlib.sha1("\0".join((code, name, arch, nvrtc.getVersion().__repr__()) + _NVRTC_OPTIONS).encode()).hexdigest()
    cache = os.path.join(os.environ.get("FP4_KERNEL_CACHE", os.path.expanduser("~/.cache/fp4-kernels")), key)
    if os.path.exists(cache + ".cubin") and os.path.exists(cache + ".name"):
        module = function.Module()
        with open(cache + ".cubin", "rb") as f:
            module.load(f.read())
        with open(cache + ".name") as f:
            return module.get_function(f.read())
    prog = nvrtc.createProgram(code, "kernels.cu", (), ())
    try:
        add = getattr(nvrtc, "addNameExpression", None) or getattr(nvrtc, "addAddNameExpression")
        add(prog, name)
        try:
            nvrtc.compileProgram(prog, _NVRTC_OPTIONS + (arch, f"--include-path={include}"))
        except Exception as err:
            raise RuntimeError(f"{err}\n{nvrtc.getProgramLog(prog)}") from err
        cubin = nvrtc.getCUBIN(prog)
        lowered = nvrtc.getLoweredName(prog, name)
    finally:
        nvrtc.destroyProgram(prog)
    try:  # a disk cache like CuPy's: NVRTC takes seconds for the 128-element groups
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp"
        for ext, data in ((".name", lowered.encode()), (".cubin", cubin)):  # atomic, name first
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, cache + ext)
    except OSError:
        pass
    module = function.Module()
    module.load(cubin)
    return module.get_function(lowered)


@atexit.register
def _unload():
    """Drop the compiled modules and stream handles while the interpreter is whole: left to its
    teardown, CuPy's module destructors ran after their driver bindings were gone and printed a
    screen of "moduleUnload ... 'NoneType' object is not callable" tracebacks at every exit."""
    global LAUNCH_LOG
    LAUNCH_LOG = None
    _kernel_function.cache_clear()
    _cupy_stream.cache_clear()
    import gc
    gc.collect()


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what inductor uses


def launch(device, name, grid, block, args):
    """Launch on torch's current stream of `device`; args are numpy scalars (pointers as uint64),
    each tensor's taken through `_arg` by the launcher, which checked it against `device`."""
    if device.type != "cuda":
        raise ValueError(f"{name}: kernels.cu launches on a CUDA device, got {device}")
    current = torch.cuda.current_device()
    index = device.index if device.index is not None else current
    fn = _kernel_function(index, name)
    if LAUNCH_LOG is not None:
        LAUNCH_LOG.append((fn, index, grid, block, args))
    ptr = _raw_stream(index) if _raw_stream else torch.cuda.current_stream(index).cuda_stream
    if index == current:  # CuPy launches on the current device: no context switch needed
        fn(grid, block, args, stream=_cupy_stream(ptr, index))
    else:
        with _cupy().cuda.Device(index):
            fn(grid, block, args, stream=_cupy_stream(ptr, index))


@functools.lru_cache(maxsize=64)
def _cupy_stream(ptr, index):
    """CuPy's handle on one of torch's streams, made once per stream (not once per launch)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # ExternalStream: fine for a raw pointer
        return _cupy().cuda.ExternalStream(ptr, index)


def _ptr(t):
    import numpy as np
    return np.uint64(0 if t is None else t.data_ptr())


def _arg(kernel, name, t, device, dtype, rows, cols, align=16):
    """The pointer a kernel gets for its argument `name`, after checking on the host what the
    kernel assumes of it: a tensor on the launch device, of `dtype`, contiguous, `align`-byte
    aligned (the kernels' vector loads), holding `rows` x `cols` elements in that layout (last dim
    `cols`; a transposed layout of the same size has another last dim). A raw pointer carries
    none of this: a wrong argument would be read or written out of bounds and poison the CUDA
    context of the whole process, so a mismatch raises here, naming the argument."""
    where = f"{kernel}: argument {name!r}"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where} must be a tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{where} is on {t.device}, the launch on {device}")
    if t.dtype != dtype:
        raise ValueError(f"{where} must be {dtype}, got {t.dtype}")
    if t.numel() != rows * cols or (t.ndim and t.shape[-1] != cols):
        raise ValueError(f"{where} must hold ({rows}, {cols}) elements, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{where} must be contiguous, got strides {t.stride()}")
    if t.data_ptr() % align:
        raise ValueError(f"{where} must be {align}-byte aligned, got address {t.data_ptr():#x}")
    return _ptr(t)


def _dense(kernel, t):
    """t's dtype where the kernels read it as dense input (SRC 0-2), else a ValueError."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{kernel}: dense input must be a float32, bfloat16 or float16 tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)}")
    return t.dtype


def _dims(kernel, **dims):
    """Sizes passed as the kernels' u32 arguments: positive and below 2^32."""
    for name, n in dims.items():
        if not 0 < n < 1 << 32:
            raise ValueError(f"{kernel}: {name} = {n} is outside the kernel's 32-bit range")


def _aligned(t):
    return t.is_contiguous() and t.data_ptr() % 16 == 0


# ---------------------------------------------------------------------------------------------
# The launchers: grid sizes, random-number arguments, one function per fp4.py twin

_MX_ROWS_CTAS_PER_SM = 3  # kernels.cu's FP4_MX_MINB: quant_rows' MXFP4 CTAs resident on an SM
_COLS_CTAS_PER_SM = 8  # quant_cols' launch bounds for G = 32 (128 threads, 64 registers)


@functools.cache
def _sm_count(index):  # the quantize kernels size their grid to one resident wave
    return torch.cuda.get_device_properties(index).multi_processor_count



def sign_words(signs):
    """+-1 CPU signs (n <= 128,) -> 4 uint32 words (kernel arguments by value), bit i of word w
    set iff sign 32w + i is -1; words past n are 0."""
    words = [0, 0, 0, 0]
    for i, neg in enumerate((signs < 0).tolist()):
        words[i // 32] |= int(neg) << (i % 32)
    return words


def _rng_args(signs, seed, device):
    """(has_signs, 4 sign words, seed, key0, device seed tensor) for a kernel launch. A formats.DeviceSeed
    passes its tensor and its offset (the kernel adds them and derives key0); formats.DeviceSigns pass
    has_signs = 2 and their seed's offset in word 0 (the kernel derives the words)."""
    if isinstance(seed, formats.DeviceSeed):
        _arg("quantize", "DeviceSeed", seed.t, device, torch.int32, 1, seed.t.numel(), align=4)
        if isinstance(signs, formats.DeviceSigns):
            if signs.seed.t is not seed.t:
                raise ValueError("formats.DeviceSigns must share the formats.DeviceSeed's tensor")
            return 2, [signs.seed.offset & formats._M32, 0, 0, 0], seed.offset & formats._M32, 0, seed.t
        words = sign_words(signs) if signs is not None else [0, 0, 0, 0]
        return int(signs is not None), words, seed.offset & formats._M32, 0, seed.t
    if isinstance(signs, formats.DeviceSigns):
        raise ValueError("formats.DeviceSigns need a formats.DeviceSeed seed")
    words = sign_words(signs) if signs is not None else [0, 0, 0, 0]
    return int(signs is not None), words, seed & formats._M32, formats.hash_key(seed, 0), None


def mx_rows_layout(scale_rule, rounding):
    """MXFP4 quant_rows layout: 'quad' (G = 8: 8 elements a thread, 4 lanes a 32-block, shuffles)
    or 'group' (G = 32: one thread a block). Both are bit-exact; they differ in speed only. The
    kernels are issue-bound on the H200, and 'group' needs fewer SASS instructions per element in
    every MXFP4 case (no shuffles, no per-lane copies of the scale computation), so it is the
    default until timed otherwise; FP4_MX_ROWS=quad|group selects (bench.py can time both)."""
    forced = os.environ.get("FP4_MX_ROWS")
    return forced if forced in ("quad", "group") else "group"


def nv128_rows_layout():
    """NVFP4 quant_rows layout for 128-groups (Hadamard 128 or MS-EDEN): 'quad' (LANES = 4: a lane
    quad a group, 32 elements a lane, the last Hadamard stages and MS-EDEN's sums by shuffles) or
    'group' (one thread a group, 255 registers). Both are bit-exact (the quad in host emulation);
    'quad' is the default: 2.0x faster on the H200 for a 16384 x 8192 BF16 tensor, bit-equal to
    'group' (results/nvidia-h200/kernels/nv128_group_vs_quad.txt); FP4_NV128_ROWS=quad|group selects."""
    forced = os.environ.get("FP4_NV128_ROWS")
    return forced if forced in ("quad", "group") else "quad"


def nv128_cols_layout():
    """NVFP4 quant_cols layout for 128-groups (quantize along axis 0, requantize): 'quad' (LANES = 4:
    blockDim 128, a lane quad a tile column, lane q holding its rows 32q..32q+31, then
    nv128_rows_layout's quad math) or 'group' (one thread a column, 32 threads, 255 registers). Both
    are bit-exact; 'quad' is the default: 1.9-2.0x faster on the H200, bit-equal to 'group'
    (results/nvidia-h200/kernels/nv128_group_vs_quad.txt); FP4_NV128_COLS=quad|group selects."""
    forced = os.environ.get("FP4_NV128_COLS")
    return forced if forced in ("quad", "group") else "quad"


def _quant_launch(kind, src, qin, r, k, fmt, scale_rule, rounding, hadamard, signs, seed, block2d, fold=False):
    """Run quant_rows (kind 'rows': quantize the (r, k) row-major src along k) or quant_cols
    (kind 'cols': along r; src dense (r, k), or qin a formats.QTensor whose codes (r, k/2) are the input).
    Returns codes, scales, tensor scale, mask in the formats.QTensor layout (rows, K) of the output, and
    fold_mx's outputs when `fold` asked for them and quant_rows_fold applies (else None)."""
    import numpy as np
    dev = src.device
    bs = formats.FORMATS[fmt]
    nv = fmt == "nvfp4"
    rows, kq = (r, k) if kind == "rows" else (k, r)  # output layout: quantized axis kq last
    g_size = max(bs, hadamard, formats.EDEN_GROUP if rounding == "eden" else 0)
    if fold and kind == "rows" and not nv and g_size == 32 and k // 32 <= 1024:
        return _quant_rows_fold(src, r, k, scale_rule, rounding, hadamard, signs, seed)
    if kind == "rows" and not nv and g_size == 32 and mx_rows_layout(scale_rule, rounding) == "quad":
        g_size = 8  # quant_rows<..., 8, ...>: the warp-cooperative MXFP4 variant (8 elements a thread)
    layout = nv128_rows_layout() if kind == "rows" else nv128_cols_layout()
    lanes = 4 if nv and g_size == 128 and layout == "quad" else 1
    if lanes == 4 and kind == "rows" and 4 * r * (k // 128) >= 1 << 31 and "FP4_NV128_ROWS" not in os.environ:
        lanes = 1  # past the quad kernel's 32-bit chunk indices: the one-thread layout, unless asked for quad
    src_kind = _SRC_KIND[_dense("quantize", src)] if qin is None else _SRC_KIND[qin.fmt]
    src_ptrs = _quant_inputs(kind, src, qin, r, k, g_size)
    codes = torch.empty(rows, kq // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(rows, kq // bs, dtype=torch.uint8, device=dev)
    mask = torch.empty(rows, kq // 8, dtype=torch.uint8, device=dev) if scale_rule == "quest" else None
    has_signs, signw, seed_arg, key0, dseed = _rng_args(signs, seed, dev)
    amax = torch.zeros(1, dtype=torch.int32, device=dev) if nv else None
    tiles = torch.zeros(rows // 16, kq // 16, dtype=torch.int32, device=dev) if block2d else None
    g = None
    if LAUNCH_LOG is not None:
        LAUNCH_LOG.append(("keepalive", amax, tiles))
    name = (f"{'quant_rows' if kind == 'rows' else 'quant_cols'}<{src_kind}, {g_size}, {str(nv).lower()}, "
            f"{RULE_ID[scale_rule]}, {ROUND_ID[rounding]}{', 4' if lanes == 4 else ''}>")
    if kind == "rows":
        n = r * (k // g_size)
        if n >= 1 << 32:
            raise ValueError(f"tensor too large for the quantize kernel ({r} x {k})")
        if g_size == 8:  # warp-cooperative MXFP4: 8 elements a thread, 4 chunks in flight, one trip
            grid, block = (-(-n // (256 * 4)),), (256,)
        elif lanes == 4:  # quad NVFP4: 4 threads a 128-group, one trip up to 2^28 threads
            if 4 * n >= 1 << 31:  # the kernel's 32-bit chunk indices
                raise ValueError(f"tensor too large for the quad NVFP4 quantize kernel ({r} x {k}); FP4_NV128_ROWS=group")
            grid, block = (min(-(-4 * n // 256), 1 << 20),), (256,)
        elif not nv and g_size == 32:  # mx_rows: one resident wave, each thread loops over groups
            grid, block = (min(-(-n // 256), _MX_ROWS_CTAS_PER_SM * _sm_count(dev.index)),), (256,)
        else:
            grid, block = (min(-(-n // 256), 1 << 20),), (256,)
        head = (src_ptrs[0], np.uint32(r), np.uint32(k))
    else:
        ntiles = -(-k // 32) * -(-r // _TILE_R)
        if ntiles >= 1 << 31:
            raise ValueError(f"tensor too large for the transposing kernel ({r} x {k})")
        # G = 32: one resident wave looping over the tiles; else (NVFP4, wide Hadamards: few threads
        # a CTA, registers decide the residency) one CTA a tile
        ctas = min(ntiles, _COLS_CTAS_PER_SM * _sm_count(dev.index)) if g_size == 32 else ntiles
        grid, block = (ctas,), (4 * 32 if lanes == 4 else 32 * _TILE_R // g_size,)  # quad: 4 lanes a column
        head = src_ptrs + (np.uint32(r), np.uint32(k))
    hs = np.float32(formats._hadamard_scale(hadamard) if hadamard else 0.0)

    def args(pass_, g_):
        return head + (np.int32(hadamard), hs, np.int32(has_signs), *(np.uint32(w) for w in signw),
                       np.uint32(seed_arg), np.uint32(key0), _ptr(dseed), np.int32(pass_), _ptr(codes), _ptr(scales), _ptr(mask), _ptr(g_), _ptr(amax), _ptr(tiles))

    if nv:  # pre-pass: amax over the finite (rotated) blocks -> g (fp4._tensor_scale); tile amax
        v = nv_amax_variant(kind, src_kind, r, k, hadamard, block2d)
        if v is None:  # the quantize kernel's own pass = 1
            launch(dev, name, grid, block, args(1, None))
        else:
            _nv_amax_launch(src, src_kind, r, k, v, hadamard, hs, has_signs, signw, dseed, amax)
        g = tensor_scale_of(amax)
    launch(dev, name, grid, block, args(0, g))
    return codes, scales, g, mask, None


def _quant_inputs(kind, src, qin, r, k, g_size):
    """The checked input pointers of quant_rows / quant_cols: (src) for rows, (src or codes, scales,
    tensor scale) for cols. Rows: src (r, k) dense, groups of g_size along k; cols: the (r, k) input
    quantized along r (groups of g_size rows), dense or a QTensor's (r, k/2) codes + scales."""
    name = "quant_rows" if kind == "rows" else "quant_cols"
    _dims(name, rows=r, cols=k)
    quantized = k if kind == "rows" else r
    if quantized % g_size:
        raise ValueError(f"{name}: the quantized dim {quantized} is not a multiple of the kernel's group {g_size}")
    dev = src.device
    if qin is None:
        p = _arg(name, "src", src, dev, _dense(name, src), r, k)
        return (p,) if kind == "rows" else (p, _ptr(None), _ptr(None))
    bs = formats.FORMATS[qin.fmt]
    if k % bs:
        raise ValueError(f"{name}: the QTensor input's K = {k} is not a multiple of its block {bs}")
    ts = None if qin.fmt == "mxfp4" else _arg(name, "tensor_scale", qin.tensor_scale, dev, torch.float32, 1, 1, align=4)
    return (_arg(name, "codes", qin.codes, dev, torch.uint8, r, k // 2),
            _arg(name, "scales", qin.scales, dev, torch.uint8, r, k // bs, align=4), ts if ts is not None else _ptr(None))


def tensor_scale_of(amax):
    """fp4._tensor_scale from the pre-pass's finite amax bits (int32 (1,)): amax / (6 * 448), 1 for 0."""
    finite_amax = amax.view(torch.float32).reshape(())
    g = finite_amax / torch.full_like(finite_amax, 6 * formats.E4M3_MAX)  # a true division on any device
    return torch.where(finite_amax > 0, g, torch.ones_like(g))


def nv_amax_mode():
    """How the NVFP4 tensor-amax pre-pass runs: 'kernel' (nv_amax, a bandwidth-bound kernel of its
    own, wherever nv_amax_variant applies) or 'fused' (the quantize kernel itself with pass = 1, the
    only way before). Both give the same bits (kernels.cu, "NVFP4 tensor amax"; bit-equal on the
    H200, test_nv_amax_kernel_matches_fused). 'kernel' is the default: on the H200 the pre-pass
    takes 0.093 ms against 0.306 ms fused at 16384x8192 (results/nvidia-h200/kernels/bench_kernels.json).
    FP4_NV_AMAX=kernel|fused selects (bench.py times both)."""
    forced = os.environ.get("FP4_NV_AMAX")
    return forced if forced in ("kernel", "fused") else "kernel"


def nv_amax_variant(kind, src_kind, r, k, hadamard, block2d):
    """nv_amax's V for the pre-pass of quant_rows (kind 'rows': 0, flat 16-blocks) or quant_cols
    ('cols': the (r, k) input quantized along r, 16 rows x V columns a thread, one 4-byte load a
    row), or None where the fused pass = 1 runs: FP4_NV_AMAX=fused, block2d (that pass also takes
    the 16x16 tile amaxes), a QTensor input (requantize: SRC 3/4), a Hadamard other than 0 or 16,
    or 2^31 blocks or more (nv_amax's 32-bit indices)."""
    if nv_amax_mode() != "kernel" or block2d or src_kind > 2 or hadamard not in (0, 16):
        return None
    v = 0 if kind == "rows" else 1 if src_kind == 0 or k % 2 else 2
    return v if _nv_amax_units(r, k, v) < 1 << 31 else None


def _nv_amax_units(r, k, v):  # what one nv_amax thread takes at a time: a 16-block (rows), a strip (cols)
    return r * k // 16 if v == 0 else r // 16 * (k // v)


_NV_AMAX_CTAS_PER_SM = {0: 8, 16: 5}  # kernels.cu's FP4_NVA_MINB(H): nv_amax's CTAs resident on an SM


@functools.cache
def _nv_amax_wave(index, hadamard):
    """nv_amax's CTAs in one resident wave: FP4_NVA_MINB(H) an SM, fewer where an SM holds fewer
    than 2048 threads (sm_120: 1536, so 6; ptxas then allows the registers for 6)."""
    props = torch.cuda.get_device_properties(index)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    return min(_NV_AMAX_CTAS_PER_SM[hadamard], threads // 256) * props.multi_processor_count


def _nv_amax_launch(src, src_kind, r, k, v, hadamard, hs, has_signs, signw, dseed, amax):
    """nv_amax<src_kind, hadamard, v> over the (r, k) input into amax[0] (zeroed): one resident
    wave of 256-thread CTAs looping over the blocks."""
    import numpy as np
    dev = src.device
    grid = min(-(-_nv_amax_units(r, k, v) // 256), _nv_amax_wave(dev.index, hadamard))
    launch(dev, f"nv_amax<{src_kind}, {hadamard}, {v}>", (grid,), (256,),
           (_ptr(src), np.uint32(r), np.uint32(k), hs, np.int32(has_signs), *(np.uint32(w) for w in signw),
            _ptr(dseed), _ptr(amax)))


def _quant_rows_fold(src, r, k, scale_rule, rounding, hadamard, signs, seed):
    """MXFP4 along the rows of src (r, k) with the Hopper fold emitted by the same kernel: one
    CTA holds whole rows (k / 32 threads a row, rounded up to a warp)."""
    import numpy as np
    dev = src.device
    name = f"quant_rows_fold<{_SRC_KIND[_dense('quant_rows_fold', src)]}, {RULE_ID[scale_rule]}, {ROUND_ID[rounding]}>"
    _dims(name, rows=r, cols=k)
    if k % 32 or k // 32 > 1024:
        raise ValueError(f"{name}: K = {k} must be a multiple of 32 and at most 32768 (a CTA holds whole rows)")
    src_ptr = _arg(name, "src", src, dev, src.dtype, r, k)
    tpr = -(-(k // 32) // 32) * 32
    rpc = max(1, 256 // tpr)
    codes = torch.empty(r, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(r, k // 32, dtype=torch.uint8, device=dev)
    mask = torch.empty(r, k // 8, dtype=torch.uint8, device=dev) if scale_rule == "quest" else None
    f8 = torch.empty(r, k, dtype=torch.uint8, device=dev)
    rowscale = torch.empty(r, dtype=torch.float32, device=dev)
    has_signs, signw, seed_arg, key0, dseed = _rng_args(signs, seed, dev)
    hs = np.float32(formats._hadamard_scale(hadamard) if hadamard else 0.0)
    # about one resident wave (64 registers a thread: 1024 threads an SM), looping over row groups
    grid = min(-(-r // rpc), max(1, 1024 // (tpr * rpc)) * _sm_count(dev.index))
    launch(dev, name, (grid,), (tpr, rpc),
            (src_ptr, np.uint32(r), np.uint32(k), np.int32(hadamard), hs, np.int32(has_signs),
             *(np.uint32(w) for w in signw), np.uint32(seed_arg), np.uint32(key0), _ptr(dseed),
             _ptr(codes), _ptr(scales), _ptr(mask), _ptr(f8), _ptr(rowscale)))
    return codes, scales, None, mask, (f8.view(torch.float8_e4m3fn), rowscale)


def quantize(x, xm, fmt, axis, scale_rule, rounding, hadamard, signs, seed, block2d, fold=False):
    """fp4.quantize through quant_rows / quant_cols; quantize() has checked the options and moved
    the quantized axis last (xm)."""
    k = xm.shape[-1]
    lead = xm.shape[:-1]
    r = xm.numel() // k
    xt = x.detach()
    if x.ndim == 2 and axis == 0 and not _aligned(xm) and _aligned(xt):
        codes, scales, g, mask, folded = _quant_launch("cols", xt, None, k, r, fmt, scale_rule, rounding,
                                                       hadamard, signs, seed, block2d)
    else:
        src = xm if _aligned(xm) else xm.contiguous()
        src = src if _aligned(src) else src.clone()  # a view at an odd offset: realign
        codes, scales, g, mask, folded = _quant_launch("rows", src, None, r, k, fmt, scale_rule, rounding,
                                                       hadamard, signs, seed, block2d, fold)
    mask = None if mask is None else mask.view(*lead, k // 8)
    return formats.QTensor(codes.view(*lead, k // 2), scales.view(*lead, -1), g, fmt, tuple(x.shape), axis, mask, folded)


def dequantize(q, dtype):
    """fp4.dequantize through the dequant kernel (f32, bf16, f16 written directly)."""
    import numpy as np
    lead = q.lead_shape
    k, r = lead[-1], math.prod(lead[:-1])
    out_kind = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)
    name = f"dequant<{out_kind}>"
    codes, scales, ts = _qtensor_args(name, _packed(q), r, k, 8)  # a thread decodes 8 codes (one u32)
    out = torch.empty(lead, dtype=dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32,
                      device=q.codes.device)
    n = r * k // 8
    launch(q.codes.device, name, (min(-(-n // 256), 1 << 20),), (256,),
            (codes, scales, ts, np.uint32(r), np.uint32(k), np.int32(q.fmt == "nvfp4"), _ptr(out)))
    return out.movedim(-1, q.axis).to(dtype)


def _packed(q):
    """q with contiguous 16-byte aligned codes and contiguous scales, copied only where needed."""
    if _aligned(q.codes) and q.scales.is_contiguous():
        return q
    return dataclasses.replace(q, codes=q.codes.contiguous().clone(), scales=q.scales.contiguous())


def _qtensor_args(name, q, r, k, k_multiple):
    """Checked pointers to a QTensor's codes (r, k/2), scales (r, k/block) and tensor scale (NVFP4:
    one FP32; MXFP4: none) on the codes' device, for a kernel that wants k a multiple of k_multiple."""
    _dims(name, rows=r, cols=k)
    if q.fmt not in formats.FORMATS:
        raise ValueError(f"{name}: unknown format {q.fmt!r}")
    bs = formats.FORMATS[q.fmt]
    if k % max(bs, k_multiple):
        raise ValueError(f"{name}: K = {k} is not a multiple of {max(bs, k_multiple)}")
    dev = q.codes.device
    ts = (_arg(name, "tensor_scale", q.tensor_scale, dev, torch.float32, 1, 1, align=4) if q.fmt == "nvfp4"
          else _ptr(None))
    return (_arg(name, "codes", q.codes, dev, torch.uint8, r, k // 2, align=4),
            _arg(name, "scales", q.scales, dev, torch.uint8, r, k // bs, align=1), ts)


def requantize(q, fmt, scale_rule, rounding, hadamard, signs, seed):
    """fp4.requantize in one pass: quant_cols with the formats.QTensor's codes as input (dequantize in the
    tile load, transpose through shared memory, rotate, scale, round, pack); requantize() has
    checked the options."""
    axis = 1 - q.axis
    r_in, k_in = q.lead_shape  # the input layout; the output's quantized axis is r_in (== k)
    src = _packed(q)
    codes, scales, g, mask, _ = _quant_launch("cols", src.codes, src, r_in, k_in, fmt, scale_rule, rounding,
                                              hadamard, signs, seed, False)
    return formats.QTensor(codes, scales, g, fmt, tuple(q.shape), axis, mask)


def fold(q):
    """fp4.fold_mx through the fold_mx kernel (one warp per row: row max of block exponents)."""
    import numpy as np
    if q.fmt != "mxfp4":
        raise ValueError(f"fold_mx: folds MXFP4 QTensors, got {q.fmt}")
    k = q.lead_shape[-1]
    r = math.prod(q.lead_shape[:-1])
    codes, scales, _ = _qtensor_args("fold_mx", _packed(q), r, k, 32)
    elems = torch.empty(r, k, dtype=torch.uint8, device=q.codes.device)
    rows = torch.empty(r, dtype=torch.float32, device=q.codes.device)
    launch(q.codes.device, "fold_mx", (min(-(-r // 8), 1 << 16),), (256,),
            (codes, scales, np.uint32(r), np.uint32(k), _ptr(elems), _ptr(rows)))
    return elems.view(torch.float8_e4m3fn), rows


def rotate_back(d, mask, n):
    """linear._rotate_back through the rotate_back kernel: mask, Hadamard-n, rounding to d's dtype
    (its PyTorch twin: fp4.rotate_back_reference)."""
    import numpy as np
    name = f"rotate_back<{_SRC_KIND[_dense('rotate_back', d)]}, {n}>"
    if n not in (32, 64, 128):
        raise ValueError(f"{name}: the Hadamard size must be 32, 64 or 128 (a thread's mask words), got {n}")
    if d.ndim < 1 or d.shape[-1] % n:
        raise ValueError(f"{name}: the gradient's last dim must be a multiple of {n}, got shape {tuple(d.shape)}")
    k = d.shape[-1]
    r = d.numel() // k
    _dims(name, rows=r, cols=k)
    src = d if _aligned(d) else d.contiguous().clone()
    # the clip mask in the QTensor layout of the forward's quantize: (.., K/8), bit i of byte j
    # is element 8j + i of the row (formats.QTensor), on the gradient's device
    mask_ptr = _arg(name, "mask", mask, d.device, torch.uint8, r, k // 8, align=4)
    out = torch.empty(d.shape, dtype=d.dtype, device=d.device)
    groups = r * (k // n)
    launch(d.device, name, (min(-(-groups // 256), 1 << 20),), (256,),
            (_arg(name, "d", src, d.device, d.dtype, r, k), mask_ptr, np.uint32(r), np.uint32(k),
             np.float32(formats._hadamard_scale(n)), _ptr(out)))
    return out


_ADAMW_SCALARS = ("b1", "omb1", "b2", "omb2", "clamp", "bc2_sqrt", "eps", "neg_step", "decay")


def adamw_nvfp4(p, grad, m, v, hadamard, rounding_m, rounding_v, c, mean, seeds):
    """optim's AdamW step with NVFP4 states (SPEC 8.1) through kernels.cu's adamw_nvfp4, launched
    twice: pass 1 the new states' amaxes, pass 0 everything else. p and grad: FP32 (R, K); m, v:
    optim's packed states (codes (R, K/2), scales (R, K/16), an FP32 tensor scale; v's 'mean'
    (R, K/128) when mean is True), updated in place; c: optim._nvfp4_scalars; seeds: (m's, v's)
    SR seeds. Returns the two new tensor scales (2,) FP32 on p's device."""
    import numpy as np
    h = hadamard
    e = 32 if mean or h >= 32 else 16  # elements a thread (kernels.cu's adamw_elems)
    name = (f"adamw_nvfp4<{h}, {int(rounding_m == 'sr')}, {int(rounding_v == 'sr')}, "
            f"{str(math.isfinite(c['clamp'])).lower()}, {str(bool(mean)).lower()}>")
    if h not in (0, 16, 32, 64, 128):
        raise ValueError(f"{name}: Hadamard size {h} is not 0, 16, 32, 64 or 128")
    block = max(16, e, h, 128 if mean else 0)  # whole NVFP4, thread, Hadamard and mean blocks a row
    if not isinstance(p, torch.Tensor) or p.ndim < 2 or p.shape[-1] % block:
        raise ValueError(f"{name}: the parameter must be 2-D or more with a last dim divisible by {block}, "
                         f"got shape {tuple(getattr(p, 'shape', ()))}")
    dev, k = p.device, p.shape[-1]
    r = p.numel() // k
    _dims(name, rows=r, cols=k, threads=p.numel() // e)
    f32, u8 = torch.float32, torch.uint8

    def state(s, what):
        return (_arg(name, what + " codes", s["codes"], dev, u8, r, k // 2, align=4),
                _arg(name, what + " scales", s["scales"], dev, u8, r, k // 16, align=1),
                _arg(name, what + " tensor_scale", s["tensor_scale"], dev, f32, 1, 1, align=4))

    vmean = _arg(name, "exp_avg_sq mean", v["mean"], dev, f32, r, k // 128, align=4) if mean else _ptr(None)
    head = (_arg(name, "param", p, dev, f32, r, k), _arg(name, "grad", grad, dev, f32, r, k),
            np.uint32(p.numel() // e), np.uint32(k), *state(m, "exp_avg"), *state(v, "exp_avg_sq"), vmean,
            *(np.float32(c[s]) for s in _ADAMW_SCALARS), np.float32(formats._hadamard_scale(h) if h else 0.0),
            np.uint32(seeds[0]), np.uint32(formats.hash_key(seeds[0])), np.uint32(seeds[1]),
            np.uint32(formats.hash_key(seeds[1])))
    amax = torch.zeros(2, dtype=torch.int32, device=dev)
    g_new = torch.empty(2, dtype=torch.float32, device=dev)
    for pass_ in (1, 0):
        launch(dev, name, (-(-(p.numel() // e) // 256),), (256,), head + (np.int32(pass_), _ptr(amax), _ptr(g_new)))
    return g_new
